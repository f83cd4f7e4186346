"""Test-only passes around a threshold build: set thresholds the tests choose (what the quality plan will), keep a
copy of the block IR they apply to, and collect the matrices a quantized build stores (the numpy references'
weights). Insert them in a pipeline with `insert_after`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from passes.kernels import quant
from passes.quantize import QuantizedMatrix
from passes import ir as pir


@dataclass
class SetThresholds:
    """Writes `plan(op_type, layer, model)`'s attributes ({name: float}) on each FFN and Attention node."""

    plan: Callable[[str, int, ir.Model], dict[str, float]]
    name = "set-thresholds"

    def apply(self, model, ctx):
        for op_type in ("FFN", "Attention"):
            for node in pir.nodes_in_domain(model, op_type):
                for key, value in self.plan(op_type, int(pir.attr(node, "layer")), model).items():
                    node.attributes[key] = ir.AttrFloat32(key, value)
        return PassResult(model, modified=True)


@dataclass
class ThinOutputLayer:
    """Attaches `threshold(model)` as the output layer's input threshold (what the quality plan may choose), its
    held-out share dropped `dropped`."""

    threshold: Callable[[ir.Model], float]
    dropped: float = 0.5
    name = "thin-output-layer"

    def apply(self, model, ctx):
        from passes.quality import HeadThreshold

        HeadThreshold(self.threshold(model), self.dropped).attach(model)
        return PassResult(model, modified=True)


@dataclass
class PlanFormats:
    """Replaces the quality pass's per-matrix formats with the test's ({initializer name: format name})."""

    formats: dict[str, str]
    name = "plan-formats"

    def apply(self, model, ctx):
        from passes.quality import WeightPlan

        WeightPlan(dict(self.formats)).attach(model)
        return PassResult(model, modified=True)


@dataclass
class Snapshot:
    """A copy of the model as it is where the pass runs (later passes change the one they get in place)."""

    model: ir.Model | None = None
    name = "snapshot"

    def apply(self, model, ctx):
        self.model = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        return PassResult(model, modified=False)


@dataclass
class StoredWeights:
    """After quantize: each block-quantized matrix's float32 values, by its initializer's name."""

    weights: dict[str, np.ndarray] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    name = "stored-weights"

    def apply(self, model, ctx):
        for node in model.graph:
            matrix = QuantizedMatrix.of(node.outputs[0]) if node.outputs else None
            if matrix is None:
                continue
            source = node
            while source.op_type != "DequantizeLinear":  # (int4a: the mins' Reshape / Add / Reshape after it)
                source = source.inputs[0].producer()
            name = source.inputs[0].name.removesuffix(".q")
            self.weights[name] = quant.dequantize(*matrix.blocks[:2], matrix.axis, *matrix.blocks[2:])
            self.formats[name] = matrix.fmt.name
        return PassResult(model, modified=False)


def insert_after(passes: list, name: str, *extra) -> list:
    """`passes` with `extra` right after the pass called `name`."""
    index = next(i for i, p in enumerate(passes) if p.name == name)
    return passes[: index + 1] + list(extra) + passes[index + 1:]
