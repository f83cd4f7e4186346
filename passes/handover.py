"""handover: make the hand-over of a token's hidden state between the stages of a split model an op of the IR.

Reads: the block IR after place, and split-nodes' stages (`NodeSplit`: each stage's layer range).
Adds: each node's stage (`picompile.stage` metadata, `stage_of_node`: the stage of its layer; the embedding the
first stage's, the final norm and output layer the last's), and a `picompile.Handover` node (from_stage, to_stage)
on every value one stage computes and the next reads: at each layer boundary where the stage changes, the
residual stream, whose readers in the next stage then read the Handover's output. Kernel selection lowers it to a
`Role.HANDOVER` call that reads the sending stage's buffer and writes the receiving stage's, so the schedule's DAG
carries the dependency and the runtime knows what crosses the network. Runs only in a build split by --nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .pipeline import Context, Fact
from .place import PLACED, set_device
from .split_nodes import NodeSplit, stage_of

STAGE_KEY = "picompile.stage"
HANDOVER = "handover"  # a hand-over call's kernel name in every phase: the runtime's own transfer, as plan-buffers' copy


def stage_of_node(node: ir.Node) -> int:
    """The stage handover gave a node (0 where no split: the one stage)."""
    return int(node.metadata_props.get(STAGE_KEY, 0))


def _set_stage(node: ir.Node, stage: int) -> None:
    node.metadata_props[STAGE_KEY] = str(stage)


HANDED_OVER = Fact("a stage for every node", "handover",
                   lambda model: all(STAGE_KEY in node.metadata_props for node in model.graph))


@dataclass
class Handover:
    name = "handover"
    requires = (PLACED,)
    adds = (HANDED_OVER,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        split = NodeSplit.of(model)
        if split is None:
            raise ValueError("handover runs in a build split by --nodes (split-nodes attaches the stages)")
        stages = split.stages
        layers, blocks = pir.node_layers(model.graph), pir.node_blocks(model.graph)
        nodes = list(model.graph)
        last = len(stages) - 1  # (outside the layers: the embedding is the first stage's, the head the last's)
        staged = {node: stage_of(stages, layers[node]) if layers[node] is not None else
                  0 if blocks[node] == pir.EMBED else last for node in nodes}
        for node, stage in staged.items():
            _set_stage(node, stage)
        handovers = 0
        for node in nodes:
            for value in node.outputs:
                readers = [user for user in value.consumers() if staged.get(user, staged[node]) != staged[node]]
                if not readers:
                    continue
                later = {staged[user] for user in readers}
                if len(later) != 1 or later != {staged[node] + 1}:
                    raise ValueError(f"{value.name} (stage {staged[node]}) is read by stages {sorted(later)}: a stage "
                                     "hands over to the next one only")
                to_stage = staged[node] + 1
                handover = ir.node("Handover", [value], {"from_stage": staged[node], "to_stage": to_stage},
                                   domain=pir.DOMAIN, name=f"handover.stage{staged[node]}_to_{to_stage}")
                handover.outputs[0].name = f"{value.name}.stage{to_stage}"
                handover.outputs[0].dtype, handover.outputs[0].shape = value.dtype, value.shape
                set_device(handover, "cpu")  # the network leaves from and arrives in host memory
                _set_stage(handover, staged[node])
                model.graph.insert_after(node, handover)
                for user in readers:
                    for index, read in enumerate(user.inputs):
                        if read is value:
                            user.replace_input_with(index, handover.outputs[0])
                handovers += 1
        ctx.log(f"handover: {len(stages)} stages, {handovers} hand-overs ("
                + ", ".join(f"{s.name} {s.layers_text()}" for s in stages) + ")")
        return PassResult(model, modified=True)
