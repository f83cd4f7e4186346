"""schedule: order the kernel calls as a networkx DAG, with a device per call.

Reads: the lowered IR (`picompile.Call` nodes; values named `buffer#version`). Adds: a `schedule`
graph-level metadata entry holding the DAG as networkx node-link JSON: one node per call (kernels,
args, device, op class, `order`), edges for every dependency: read-after-write through the values,
and write-after-read / write-after-write on shared buffers (a buffer reused across layers must not be
overwritten while an earlier call still reads it). The order is a topological order of that graph
(stable with respect to program order) and the critical path is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import networkx as nx
import onnx_ir as ir
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.pipeline import Context


def buffer_of(value: ir.Value) -> str:
    return value.name.split("#", 1)[0]


def build_dag(model: ir.Model) -> nx.DiGraph:
    dag = nx.DiGraph()
    last_writer: dict[str, str] = {}
    readers_since_write: dict[str, list[str]] = {}
    for index, node in enumerate(model.graph):
        if node.domain != pir.DOMAIN or node.op_type != "Call":
            raise ValueError(f"schedule expects only picompile.Call nodes, found {node.op_type}")
        dag.add_node(node.name, index=index, decode=pir.attr(node, "decode"), prefill=pir.attr(node, "prefill"),
                     args=list(pir.attr(node, "args")), device=pir.attr(node, "device"),
                     op_class=pir.attr(node, "op_class"))
        for value in node.inputs:
            if value is None or value.const_value is not None:
                continue
            buffer = buffer_of(value)
            if (producer := value.producer()) is not None:
                dag.add_edge(producer.name, node.name, kind="data", buffer=buffer)
            readers_since_write.setdefault(buffer, []).append(node.name)
        for value in node.outputs:
            buffer = buffer_of(value)
            for reader in readers_since_write.get(buffer, []):
                if reader != node.name:
                    dag.add_edge(reader, node.name, kind="anti", buffer=buffer)
            if buffer in last_writer and last_writer[buffer] != node.name:
                dag.add_edge(last_writer[buffer], node.name, kind="output", buffer=buffer)
            last_writer[buffer] = node.name
            readers_since_write[buffer] = []
    if not nx.is_directed_acyclic_graph(dag):
        raise ValueError("the kernel call graph has a cycle")
    order = list(nx.lexicographical_topological_sort(dag, key=lambda n: dag.nodes[n]["index"]))
    for position, name in enumerate(order):
        dag.nodes[name]["order"] = position
    return dag


@dataclass
class Schedule:
    name = "schedule"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        dag = build_dag(model)
        critical = nx.dag_longest_path(dag)
        model.metadata_props["picompile.schedule"] = json.dumps(nx.node_link_data(dag, edges="edges"))
        devices = sorted({d for _, d in dag.nodes(data="device")})
        ctx.log(f"schedule: {dag.number_of_nodes()} calls, {dag.number_of_edges()} dependencies, "
                f"devices {', '.join(devices)}, critical path {len(critical)} calls")
        return PassResult(model, modified=True)
