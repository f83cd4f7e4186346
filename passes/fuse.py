"""fuse: fold the block IR's residual Adds and the output layer's bias into the blocks before them.

Reads: the block IR (after recognise, or lower). Adds: nothing new; rewrites, each an onnxscript rewrite rule
(a pattern, a check, a replacement; `onnxscript.rewriter`), the head's rules in one sweep, then the residuals':
- `head-bias`: MatMul(x, W) + constant b becomes `picompile.Linear(x, W, b)`; the output layer's MatMul
  without a bias becomes a `picompile.Linear(x, W)`, so that kernel selection sees one op for it.
- `residual`: Add(block output, skip) whose block is an op declared to fold one (`ops.Folds`: Attention, FFN,
  ThresholdFFN, MergePartial, the output layer's Linear), and which is the block output's only user, becomes the
  block's last input (attribute `residual` 1): the block's last kernel adds it in its epilogue. Every reader of the
  Add's result reads the block's.
- `post-norm` (in the same sweep): Add(skip, RMSNormalization(x, scale)) whose norm is the Add's only reader, a
  norm of a block's output inside its residual branch (Gemma's; a pre-norm's output is never added to the
  residual stream), becomes `picompile.PostNorm(x, scale, skip)` (`residual` 1): one rms_norm kernel adds the skip.
Each replacement keeps the name of the node it replaces (kernel calls are named after their block) and the names
of the values it replaces (the rewriter's own doing), so a build is the same as before the rules moved to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import PassResult
from onnxscript.rewriter import pattern

from . import ir as pir
from . import ops
from .pipeline import Context, Fact
from .recognise import BLOCKS

# the ops declared to take a folded residual (`ops.Folds`): Attention, FFN, ThresholdFFN, MergePartial, Linear (and
# PostNorm, which only the post-norm rule makes, its residual folded from the start)
RESIDUAL_BLOCKS = tuple(name for name, op in ops.OPS.items() if issubclass(op, ops.Folds))


def _bias_of(product: ir.Value) -> ir.Value | None:
    """The constant an Add that is the product's only user adds to it, else None."""
    users = product.consumers()
    if len(users) != 1 or users[0].op_type != "Add" or users[0].domain != "":
        return None
    add = users[0]
    other = add.inputs[1] if add.inputs[0] is product else add.inputs[0]
    return other if pir.const_array(other) is not None else None


def _linear(op, x: ir.Value, weight: ir.Value, bias: ir.Value | None, product: ir.Value) -> ir.Value:
    return op.op("Linear", x, weight, bias, _domain=pir.DOMAIN, _name=product.producer().name)


HEAD_RULES = pattern.RewriteRuleSet([
    pattern.RewriteRule(  # with its bias (either side of the Add)
        lambda op, x, weight, bias: op.Add(op.MatMul(x, weight, _outputs=["product"]), bias),
        lambda op, x, weight, bias, product: _linear(op, x, weight, bias, product),
        lambda context, weight, bias, **_: pir.const_matrix(weight) is not None and pir.const_array(bias) is not None),
    pattern.RewriteRule(  # without one (a MatMul with a constant bias after it is the rule above's)
        lambda op, x, weight: op.MatMul(x, weight, _outputs=["product"]),
        lambda op, x, weight, product: _linear(op, x, weight, None, product),
        lambda context, weight, product, **_: pir.const_matrix(weight) is not None and _bias_of(product) is None),
], commute=True)


def _residual_rule(op_type: str) -> pattern.RewriteRule:
    """Add(skip, the block's first output) -> the block with `skip` as its last input, for one declared op (its
    other outputs, Attention's caches, are the pattern's outputs too: their readers keep reading them)."""
    outputs = [port.name for port in ops.OPS[op_type].outputs]

    def target(op, x, skip):
        block = getattr(op, op_type)(x, _domain=pir.DOMAIN, _allow_other_inputs=True, _allow_other_attributes=True,
                                     _outputs=outputs)
        block = list(block) if len(outputs) > 1 else [block]
        added = op.Add(skip, block[0])
        return (added, *block[1:]) if len(outputs) > 1 else added

    def check(context, skip, **bound) -> bool:
        out = bound[outputs[0]]
        return skip.const_value is None and len(out.uses()) == 1 and not ops.view(out.producer()).residual

    def replace(op, skip, **bound):
        block = bound[outputs[0]].producer()
        return op.op(op_type, *block.inputs, skip, _domain=pir.DOMAIN, _name=block.name, _outputs=len(outputs),
                     **dict(block.attributes), residual=ir.AttrInt64("residual", 1))

    return pattern.RewriteRule(target, replace, check)


def _post_norm_rule() -> pattern.RewriteRule:
    """Add(skip, RMSNormalization(x, scale)) -> picompile.PostNorm(x, scale, skip), residual 1."""

    def target(op, x, scale, skip):
        return op.Add(skip, op.RMSNormalization(x, scale, _allow_other_attributes=True, _outputs=["normed"]))

    def check(context, scale, skip, normed, **_) -> bool:
        return skip.const_value is None and len(normed.uses()) == 1 and pir.const_array(scale) is not None

    def replace(op, x, scale, skip, normed, **_):
        norm = normed.producer()
        epsilon = float(pir.attr(norm, "epsilon", 1e-5))
        return op.op("PostNorm", x, scale, skip, _domain=pir.DOMAIN, _name=norm.name,
                     epsilon=ir.AttrFloat32("epsilon", epsilon), residual=ir.AttrInt64("residual", 1))

    return pattern.RewriteRule(target, replace, check)


RESIDUAL_RULES = pattern.RewriteRuleSet([*(_residual_rule(op_type) for op_type in RESIDUAL_BLOCKS if op_type != "PostNorm"),
                                         _post_norm_rule()], commute=True)
RULES = (("head-bias", HEAD_RULES), ("residual", RESIDUAL_RULES))


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
        # each rule's output is final for the rules before it: one sweep each
        applied = {name: rules.apply_to_model(model) for name, rules in RULES}
        applied = {name: count for name, count in applied.items() if count}
        if applied:
            ctx.log("fuse: " + ", ".join(f"{name} x{count}" for name, count in sorted(applied.items())))
        return PassResult(model, modified=bool(applied))
