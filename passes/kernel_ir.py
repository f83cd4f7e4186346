"""The kernel-call IR, shared by the back-end passes (select-kernels, plan-buffers, compile, schedule).

A `KernelProgram` is the typed form: the calls (`runtime.calls.Call`, in program order), the buffers
(name -> manifest entry: kind, shape, dtype, layout, device), the weights' arrays and the kernels' specs
(kernel name -> how to make it: op, rows, arguments). `to_model` writes it as an ONNX graph of
`picompile.Call` nodes (one per call, its facts in the `call` attribute, values named `buffer#version` so the
dump shows where each buffer is written, weights as initializers, the buffers and kernel specs as the facts
`Buffers` and `Kernels`); `from_model` reads it back. Passes work on the typed form and never parse the names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from . import ir as pir
from .facts import ModelFact, ValueFact
from .ops import Call as CallOp
from .pipeline import Fact
from runtime.calls import START, Call

_DTYPES = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "int32": ir.DataType.INT32,
           "int64": ir.DataType.INT64}
PER_TOKEN_KINDS = ("activation", "input")  # buffers with one row per token of the step
KERNEL_CALLS = Fact("the kernel-call IR", "select-kernels",
                    lambda model: "picompile.buffers" in model.metadata_props
                    and all(CallOp.matches(node) for node in model.graph))


@dataclass(frozen=True)
class KernelSpec:
    """How to make one kernel: the op (a `passes.kernels.ops` entry), its row count (1: decode, None: a
    symbolic number of rows) and the op's arguments."""

    op: str
    rows: int | None
    args: tuple
    kwargs: dict

    def to_json(self) -> dict:
        return {"op": self.op, "rows": self.rows, "args": list(self.args), "kwargs": self.kwargs}

    @classmethod
    def from_json(cls, data: dict) -> "KernelSpec":
        return cls(data["op"], data["rows"], tuple(data["args"]), dict(data["kwargs"]))


@dataclass(frozen=True)
class Buffers(ValueFact):
    """The program's buffers: name -> its manifest entry (kind, shape, dtype, layout, device), as the artifact's
    manifest lists them."""

    KEY: ClassVar[str] = "picompile.buffers"
    SORT_KEYS: ClassVar[bool] = True
    entries: dict[str, dict]


@dataclass(frozen=True)
class Kernels(ModelFact):
    """The program's kernels: name -> how to make it (`KernelSpec`), for the compile pass."""

    KEY: ClassVar[str] = "picompile.kernels"
    SORT_KEYS: ClassVar[bool] = True
    specs: dict[str, KernelSpec]

    def to_json(self) -> dict:
        return {name: spec.to_json() for name, spec in self.specs.items()}

    @classmethod
    def from_json(cls, data: dict) -> "Kernels":
        return cls({name: KernelSpec.from_json(spec) for name, spec in data.items()})

    @classmethod
    def missing(cls) -> "Kernels":
        return cls({})


@dataclass
class KernelProgram:
    calls: list[Call] = field(default_factory=list)
    buffers: dict[str, dict] = field(default_factory=dict)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    kernels: dict[str, KernelSpec] = field(default_factory=dict)

    def to_model(self, metadata: dict[str, str]) -> ir.Model:
        """The program as an ONNX model; `metadata` (earlier passes' facts) is carried over."""
        graph = ir.Graph([], [], nodes=[], name="kernels",
                         opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: pir.DOMAIN_VERSION})
        version: dict[str, int] = {}
        current: dict[str, ir.Value] = {}

        def read(buffer: str) -> ir.Value:
            if buffer not in current:
                info = self.buffers.get(buffer)
                if info is not None and info["kind"] == "weight":
                    current[buffer] = pir.initializer(graph, buffer, self.weights[buffer])
                else:
                    dtype = ir.DataType.INT64 if buffer == START else _DTYPES[info["dtype"]]
                    current[buffer] = ir.val(f"{buffer}#0", dtype, self._shape(buffer))
                    version[buffer] = 0
                    graph.inputs.append(current[buffer])
            return current[buffer]

        for call in self.calls:
            reads = [read(arg.buffer) for arg in call.args if arg.buffer == START or arg.reads]
            writes = call.writes()
            node = ir.node("Call", reads, {"call": json.dumps(call.to_json())}, domain=pir.DOMAIN,
                           num_outputs=len(writes), name=call.id)
            graph.append(node)
            for value, buffer in zip(node.outputs, writes):
                version[buffer] = version.get(buffer, 0) + 1
                value.name = f"{buffer}#{version[buffer]}"
                value.dtype = _DTYPES[self.buffers[buffer]["dtype"]]
                value.shape = self._shape(buffer)
                current[buffer] = value
        graph.outputs.append(current["logits"])
        graph.outputs.extend(current[b] for b, info in self.buffers.items() if info["kind"] == "cache" and b in current)
        model = ir.Model(graph, ir_version=10, producer_name="picompile")
        model.metadata_props.update(metadata)
        Buffers(self.buffers).attach(model)
        Kernels(self.kernels).attach(model)
        return model

    def _shape(self, buffer: str) -> ir.Shape:
        info = self.buffers.get(buffer)
        if info is None:  # the scalar `start`
            return ir.Shape([])
        dims = list(info["shape"])
        if info["kind"] in PER_TOKEN_KINDS:
            dims[0] = "rows"
        return ir.Shape(dims)

    @classmethod
    def from_model(cls, model: ir.Model) -> "KernelProgram":
        calls = []
        for node in model.graph:
            if not CallOp.matches(node):
                raise ValueError(f"the kernel-call IR holds only picompile.Call nodes, found {node.op_type} ({node.name})")
            calls.append(Call.from_json(json.loads(CallOp(node).call)))
        weights = {name: value.const_value.numpy() for name, value in model.graph.initializers.items()
                   if value.const_value is not None}
        buffers = Buffers.of(model)
        if buffers is None:
            raise ValueError("the model is no kernel-call IR: it has no buffers (run select-kernels first)")
        return cls(calls, buffers.entries, weights, Kernels.of(model).specs)


def carried_metadata(model: ir.Model) -> dict[str, str]:
    """What earlier passes decided (placement, layers, sparsity), without the program's own entries."""
    own = (Buffers.KEY, Kernels.KEY)
    return {key: value for key, value in model.metadata_props.items() if key not in own}
