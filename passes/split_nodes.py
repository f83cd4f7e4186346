"""STAND-IN for the lead's split-nodes pass (replaced at merge): stages of equal layer ranges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .facts import ValueFact
from .pipeline import Context
from runtime.manifest import Stage


@dataclass(frozen=True)
class NodeSplit(ValueFact):
    KEY: ClassVar[str] = "picompile.stages"
    stages: list

    def to_json(self):
        return [stage.to_json() for stage in self.stages]

    @classmethod
    def from_json(cls, data):
        return cls([Stage.from_json(stage) for stage in data])


def stage_of(stages: list[Stage], layer: int | None, role: str | None = None) -> int:
    if layer is None:
        return 0 if role == "embed" else len(stages) - 1
    return next(i for i, stage in enumerate(stages) if stage.first_layer <= layer < stage.stop_layer)


@dataclass
class SplitNodes:
    name = "split-nodes"
    nodes: str = ""

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        count = int(self.nodes.split("x")[0])
        layers = max(layer for layer in pir.node_layers(model.graph).values() if layer is not None) + 1
        bounds = [round(i * layers / count) for i in range(count + 1)]
        stages = [Stage(f"stage{i}", bounds[i], bounds[i + 1], 24 << 30, "cpu",
                        {} if i == 0 else {f"picompile_stage{i}": 1}, 0, 0.0, 0) for i in range(count)]
        NodeSplit(stages).attach(model)
        return PassResult(model, modified=True)
