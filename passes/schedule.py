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


PHASES = ("decode", "prefill")


def build_dag(model: ir.Model) -> nx.DiGraph:
    """Nodes in program order; edges per phase (decode and prefill run different calls, so a buffer
    can have a different last writer in each), each edge tagged with the phases it binds."""
    dag = nx.DiGraph()
    calls = []
    for index, node in enumerate(model.graph):
        if node.domain != pir.DOMAIN or node.op_type != "Call":
            raise ValueError(f"schedule expects only picompile.Call nodes, found {node.op_type}")
        if node.name in dag:
            raise ValueError(f"two kernel calls are both named {node.name}")
        dag.add_node(node.name, index=index, decode=pir.attr(node, "decode"), prefill=pir.attr(node, "prefill"),
                     args=list(pir.attr(node, "args")), device=pir.attr(node, "device"),
                     op_class=pir.attr(node, "op_class"))
        reads = [buffer_of(v) for v in node.inputs if v is not None and v.const_value is None]
        writes = [buffer_of(v) for v in node.outputs]
        calls.append((node.name, reads, writes))

    def depend(source: str, target: str, kind: str, buffer: str, phase: str) -> None:
        if source == target:
            return
        if dag.has_edge(source, target):
            dag.edges[source, target]["phases"] = sorted(set(dag.edges[source, target]["phases"]) | {phase})
        else:
            dag.add_edge(source, target, kind=kind, buffer=buffer, phases=[phase])

    for phase in PHASES:
        last_writer: dict[str, str] = {}
        readers: dict[str, list[str]] = {}
        for name, reads, writes in calls:
            if not dag.nodes[name][phase]:
                continue
            for buffer in reads:
                if buffer in last_writer:
                    depend(last_writer[buffer], name, "data", buffer, phase)
                readers.setdefault(buffer, []).append(name)
            for buffer in writes:
                for reader in readers.get(buffer, []):
                    depend(reader, name, "anti", buffer, phase)  # do not overwrite what is still being read
                if buffer in last_writer:
                    depend(last_writer[buffer], name, "output", buffer, phase)
                last_writer[buffer] = name
                readers[buffer] = []
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
