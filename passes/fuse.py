"""fuse: fold the block IR's residual Adds and the output layer's bias into the blocks before them.

Reads: the block IR (after recognise, or lower). Adds: nothing new; rewrites, each a rule (a pattern that
matches a node, a check, a replacement), applied until none matches:
- `residual`: Add(block output, skip) whose block is an Attention, FFN, MergePartial or the output layer,
  and which is the block output's only user, becomes the block's last input (attribute `residual` 1):
  the block's last kernel adds it in its epilogue. Every reader of the Add's result reads the block's.
- `head-bias`: MatMul(x, W) + constant b becomes `picompile.Linear(x, W, b)`.
The output layer's MatMul also becomes a `picompile.Linear` (without bias) so that kernel selection sees
one op for it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from . import ops
from .pipeline import Context, Fact
from .recognise import BLOCKS

# the ops declared to take a folded residual (`ops.Folds`): Attention, FFN, ThresholdFFN, MergePartial, Linear
RESIDUAL_BLOCKS = tuple(name for name, op in ops.OPS.items() if issubclass(op, ops.Folds))


def _only_add_user(node: ir.Node) -> ir.Node | None:
    users = node.outputs[0].consumers()
    if len(users) == 1 and users[0].op_type == "Add" and users[0].domain == "":
        return users[0]
    return None


@dataclass(frozen=True)
class Rule:
    """A rewrite: `match` returns what it needs from a node (None: no match), `rewrite` applies it."""

    name: str
    match: Callable[[ir.Node], object | None]
    rewrite: Callable[[ir.Graph, ir.Node, object], None]


def _match_residual(node: ir.Node):
    if node.domain != pir.DOMAIN or node.op_type not in RESIDUAL_BLOCKS or ops.view(node).residual:
        return None
    add = _only_add_user(node)
    if add is None:
        return None
    skip = add.inputs[0] if add.inputs[1] is node.outputs[0] else add.inputs[1]
    return None if skip is None or skip.const_value is not None else (add, skip)


def _fold_residual(graph: ir.Graph, node: ir.Node, match) -> None:
    add, skip = match
    node.resize_inputs(len(node.inputs) + 1)
    node.replace_input_with(len(node.inputs) - 1, skip)
    node.attributes["residual"] = ir.AttrInt64("residual", 1)
    add.outputs[0].replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
    name = add.outputs[0].name
    graph.remove(add, safe=True)
    node.outputs[0].name = name


def _match_head(node: ir.Node):
    if node.domain != "" or node.op_type != "MatMul" or pir.const_array(node.inputs[1]) is None:
        return None
    add = _only_add_user(node)
    bias = None
    if add is not None:
        other = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
        bias = other if pir.const_array(other) is not None else None
    return (add if bias is not None else None), bias


def _to_linear(graph: ir.Graph, node: ir.Node, match) -> None:
    add, bias = match
    linear = ir.node("Linear", [node.inputs[0], node.inputs[1], bias], domain=pir.DOMAIN, name=node.name)
    graph.insert_before(node, linear)
    last = add or node
    name = last.outputs[0].name
    linear.outputs[0].dtype, linear.outputs[0].shape = last.outputs[0].dtype, last.outputs[0].shape
    last.outputs[0].replace_all_uses_with(linear.outputs[0], replace_graph_outputs=True)
    if add is not None:
        graph.remove(add, safe=True)
    graph.remove(node, safe=True)
    linear.outputs[0].name = name


RULES = (Rule("head-bias", _match_head, _to_linear), Rule("residual", _match_residual, _fold_residual))


def _fused(model: ir.Model) -> bool:
    """No MatMul left, and no Add of a block's output: select-kernels has kernels for the blocks alone."""
    for node in model.graph:
        if node.domain == "" and (node.op_type == "MatMul" or node.op_type == "Add" and any(
                value is not None and value.producer() is not None and value.producer().domain == pir.DOMAIN
                for value in node.inputs)):
            return False
    return True


FUSED = Fact("residual Adds and the output layer folded into the blocks", "fuse", _fused)


@dataclass
class Fuse:
    name = "fuse"
    requires = (BLOCKS,)
    adds = (FUSED,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        applied: Counter = Counter()
        for rule in RULES:  # each rule's output is final for the rules before it: one sweep each
            for node in list(model.graph):
                match = rule.match(node)
                if match is not None:
                    rule.rewrite(model.graph, node, match)
                    applied[rule.name] += 1
        if applied:
            ctx.log("fuse: " + ", ".join(f"{name} x{count}" for name, count in sorted(applied.items())))
        return PassResult(model, modified=bool(applied))
