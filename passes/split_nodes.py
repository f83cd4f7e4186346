"""split-nodes: give each node of `--nodes` a contiguous range of the decoder layers (passes.nodes decides).

Reads: the block IR (recognise's `Embed`, `Attention`, `FFN`; the output layer is the rest of the matrices) and
the build target's nodes, weight format and context. Adds: `picompile.stages` (a `NodeSplit`: one
`runtime.manifest.Stage` per node, the manifest's `stages`), which the hand-over and the schedule follow.
Runs only when the build is split (`BuildTarget.nodes`); the IR itself is unchanged.

A layer's size on its node is its matrices in the build's CPU format and its KV cache; what a decode step reads of
it is the same bytes, its KV cache at half the context (the split runs before the profile: the layers' sparsity
is not known yet, and the layers of one model are alike, so a balance of bytes is a balance of reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir
from onnx_ir.passes import PassResult

from .facts import ModelFact
from .nodes import Part, handover_seconds, split_layers
from .ops import FFN, Attention, Embed
from .pipeline import Context
from .sizes import cpu_bytes, kv_cache_bytes
from .targets import format_size
from runtime.calls import Role
from runtime.dtypes import nbytes
from runtime.manifest import Stage


@dataclass(frozen=True)
class NodeSplit(ModelFact):
    """The stages of a split build, in order."""

    KEY: ClassVar[str] = "picompile.stages"
    stages: list[Stage]

    def to_json(self) -> list:
        return [stage.to_json() for stage in self.stages]

    @classmethod
    def from_json(cls, data: list) -> "NodeSplit":
        return cls([Stage.from_json(stage) for stage in data])


def stage_of(stages: list[Stage], layer: int | None, role: Role | None = None) -> int:
    """The stage that runs `layer`; outside the layers, the embedding's (stage 0) or, for the final norm and
    the output layer (any other role), the last stage."""
    if layer is None:
        return 0 if role is Role.EMBED else len(stages) - 1
    for index, stage in enumerate(stages):
        if stage.first_layer <= layer < stage.stop_layer:
            return index
    raise ValueError(f"layer {layer} is in no stage ({', '.join(f'[{s.first_layer}, {s.stop_layer})' for s in stages)})")


@dataclass
class SplitNodes:
    name = "split-nodes"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        nodes, fmt, context = ctx.build.nodes, ctx.build.weight_format, ctx.build.max_context
        if not nodes:
            return PassResult(model, modified=False)
        layers: dict[int, list[int]] = {}  # layer -> [stored bytes, KV cache bytes]
        counted: set[str] = set()
        hidden = 0
        for node in model.graph:
            view = (Attention(node) if Attention.matches(node) else FFN(node) if FFN.matches(node) else None)
            if view is None:
                continue
            entry = layers.setdefault(view.layer, [0, 0])
            entry[0] += _matrix_bytes(node.inputs, fmt, counted)
            if isinstance(view, Attention):
                entry[1] += kv_cache_bytes([(view.num_kv_heads, view.head_dim)], context)
            else:
                hidden = int(node.inputs[1].shape[0])  # w_up: [d_model, (2 x) neurons]
        embed = sum(_matrix_bytes(node.inputs, fmt, counted) for node in Embed.nodes(model))
        head = _matrix_bytes(list(model.graph.initializers.values()), fmt, counted)  # the rest: the output layer
        parts = [Part(weights + cache, weights + cache / 2) for _, (weights, cache) in sorted(layers.items())]
        plans = split_layers(parts, Part(embed, 0.0), Part(head, float(head)), nodes)
        handover = nbytes([hidden], "float32")  # one row of the residual stream (select-kernels' activations)
        stages = [Stage(name=plan.node.name, first_layer=plan.first_layer, stop_layer=plan.stop_layer,
                        memory_bytes=plan.node.memory_bytes, target=plan.node.target,
                        resources=dict(plan.node.resources), weight_bytes=plan.stored_bytes,
                        expected_step_s=plan.step_s, handover_bytes=handover if i < len(plans) - 1 else 0,
                        gpu_bytes=plan.node.gpu_bytes or None)
                  for i, plan in enumerate(plans)]
        NodeSplit(stages).attach(model)
        for stage in stages:
            card = f" (and {format_size(stage.gpu_bytes)} of its {stage.target})" if stage.gpu_bytes else ""
            ctx.log(f"split-nodes: {stage.name} runs {stage.layers_text()}: "
                    f"{format_size(stage.weight_bytes)} of {format_size(stage.memory_bytes)}{card}, "
                    f"{stage.expected_step_s * 1e3:.2f} ms a token")
        slowest = max(stage.expected_step_s for stage in stages)
        ctx.log(f"split-nodes: {len(stages) - 1} hand-over(s) of {format_size(handover)} a token, "
                f"{handover_seconds(handover) * 1e6:.0f} us each; the slowest stage bounds the pipeline at "
                f"{1 / slowest:.1f} tokens/s")
        return PassResult(model, modified=True)


def _matrix_bytes(values, fmt, counted: set[str]) -> int:
    """Bytes of the constants among `values` not counted before, in the build's CPU format."""
    total = 0
    for value in values:
        if value is None or value.const_value is None or value.name in counted:
            continue
        counted.add(value.name)
        total += cpu_bytes(value.shape, fmt)
    return total
