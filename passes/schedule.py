"""schedule: order the kernel calls as a networkx DAG, with a device per call.

Reads: the kernel-call IR (`passes.kernel_ir`: each call's facts say which buffers it reads and writes).
Adds: a `picompile.schedule` graph-level metadata entry (`CallSchedule`) holding the DAG as networkx node-link
JSON, the artifact's schedule.json: one node
per call (its facts, `runtime.calls.Call`, under `call`, and its `order`), edges for every dependency:
read-after-write, and write-after-read / write-after-write on shared buffers (a buffer reused across layers
must not be overwritten while an earlier call still reads it). The order is a topological order of that
graph (stable with respect to program order) and the critical path is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import networkx as nx
import onnx_ir as ir
from onnx_ir.passes import PassResult

from .facts import ValueFact
from .pipeline import Context
from runtime.calls import PHASES

from .kernel_ir import KERNEL_CALLS, KernelProgram


def build_dag(program: KernelProgram) -> nx.DiGraph:
    """Nodes in program order; edges per phase (decode and prefill run different calls, so a buffer
    can have a different last writer in each), each edge tagged with the phases it binds."""
    dag = nx.DiGraph()
    weights = {name for name, info in program.buffers.items() if info["kind"] == "weight"}
    for index, call in enumerate(program.calls):
        if call.id in dag:
            raise ValueError(f"two kernel calls are both named {call.id}")
        dag.add_node(call.id, index=index, call=call.to_json())

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
        for call in program.calls:
            if not call.kernel(phase):
                continue
            for buffer in call.reads():
                if buffer in weights:
                    continue
                if buffer in last_writer:
                    depend(last_writer[buffer], call.id, "data", buffer, phase)
                readers.setdefault(buffer, []).append(call.id)
            for buffer in call.writes():
                for reader in readers.get(buffer, []):
                    depend(reader, call.id, "anti", buffer, phase)  # do not overwrite what is still being read
                if buffer in last_writer:
                    depend(last_writer[buffer], call.id, "output", buffer, phase)
                last_writer[buffer] = call.id
                readers[buffer] = []
    if not nx.is_directed_acyclic_graph(dag):
        raise ValueError("the kernel call graph has a cycle")
    order = list(nx.lexicographical_topological_sort(dag, key=lambda n: dag.nodes[n]["index"]))
    for position, name in enumerate(order):
        dag.nodes[name]["order"] = position
    return dag


@dataclass(frozen=True)
class CallSchedule(ValueFact):
    """The ordered call DAG as networkx node-link JSON (`runtime.calls.schedule_calls` reads its calls)."""

    KEY: ClassVar[str] = "picompile.schedule"
    node_link: dict


@dataclass
class Schedule:
    name = "schedule"
    requires = (KERNEL_CALLS,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        dag = build_dag(KernelProgram.from_model(model))
        critical = nx.dag_longest_path(dag)
        CallSchedule(nx.node_link_data(dag, edges="edges")).attach(model)
        devices = sorted({data["call"]["device"] for _, data in dag.nodes(data=True)})
        ctx.log(f"schedule: {dag.number_of_nodes()} calls, {dag.number_of_edges()} dependencies, "
                f"devices {', '.join(devices)}, critical path {len(critical)} calls")
        return PassResult(model, modified=True)
