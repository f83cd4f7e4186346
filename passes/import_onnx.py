"""import: load the user's ONNX decoder, fix batch to 1, compute in fp32, fold constants and infer shapes.

Reads: a path (the pass's argument), not an IR; weights may live in external data files beside it (models
over 2 GB; read into memory when they total under `picompile.ir.EXTERNAL_DATA_BYTES`). Adds: the IR itself, with every graph input's batch dimension fixed to 1, fp16 / bf16 tensors,
casts and inputs made fp32 (the compiler computes in fp32; `--weight-dtype` decides how weights are stored
later, so a half-precision model keeps its rounded weight values exactly), and constant subgraphs folded
(onnxscript's optimizer), so that the recognise pass sees weights as initializers whatever exporter made
the graph. Sequence and past lengths stay symbolic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.errors import UserError
from picompile.pipeline import Context

REQUIRED_INPUTS = ("input_ids",)
REQUIRED_OUTPUTS = ("logits",)
HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _fp32_tensor(tensor: ir.TensorProtocol) -> ir.Tensor:
    return ir.tensor(np.asarray(tensor.numpy(), np.float32), name=tensor.name)


def compute_in_fp32(graph: ir.Graph) -> int:
    """Make a half-precision (fp16 / bf16) graph compute in fp32: its constants are widened (exactly), casts
    to half types cast to fp32, and inputs, outputs and intermediate values are typed fp32. Returns how many
    tensors were widened."""
    widened = 0
    for value in graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype in HALF_TYPES:
            value.const_value = _fp32_tensor(value.const_value)
            widened += 1
    values = [*graph.inputs, *graph.initializers.values()]
    for node in ir.traversal.RecursiveGraphIterator(graph):
        values.extend(node.outputs)
        to = node.attributes.get("to")
        if node.op_type == "Cast" and to is not None and to.value in HALF_TYPES:
            node.attributes["to"] = ir.AttrInt64("to", ir.DataType.FLOAT)
        for name in ("value", "value_float") if node.op_type in ("Constant", "ConstantOfShape") else ():
            attribute = node.attributes.get(name)
            if attribute is not None and attribute.type == ir.AttributeType.TENSOR and attribute.value.dtype in HALF_TYPES:
                node.attributes[name] = ir.AttrTensor(name, _fp32_tensor(attribute.value))
                widened += 1
    for value in values:
        if value.dtype in HALF_TYPES:
            value.dtype = ir.DataType.FLOAT
    return widened


def load(path: Path) -> ir.Model:
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if path.is_dir() or path.stat().st_size == 0:
        raise UserError(f"{path} is not an ONNX model (empty or a directory)")
    try:
        return ir.load(str(path))
    except Exception as error:  # protobuf raises several types for garbage bytes
        raise UserError(f"{path} is not a readable ONNX model ({type(error).__name__}: {error})") from None


@dataclass
class Import:
    name = "import"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        graph = model.graph
        input_names = {v.name for v in graph.inputs}
        output_names = {v.name for v in graph.outputs}
        missing = [n for n in REQUIRED_INPUTS if n not in input_names] + [
            n for n in REQUIRED_OUTPUTS if n not in output_names
        ]
        if missing:
            raise UserError(
                f"model is not a decoder LLM export: it lacks {', '.join(missing)} "
                f"(inputs: {', '.join(sorted(input_names)) or 'none'}; outputs: {', '.join(sorted(output_names)) or 'none'})"
            )
        weight_bytes = sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)
        if weight_bytes <= pir.EXTERNAL_DATA_BYTES:
            # weights in external data files (as small models may be saved too) are read in now, while no
            # array views of the memory map exist, so that the source graph saves as one file when profiled
            ir.external_data.load_to_model(model)
        widened = compute_in_fp32(graph)
        if widened:
            ctx.log(f"import: {widened} fp16/bf16 tensors widened to fp32")
        for value in graph.inputs:
            if value.shape is not None and len(value.shape) > 0 and not isinstance(value.shape[0], int):
                value.shape = ir.Shape([1, *value.shape[1:]])
        try:
            onnxscript.optimizer.optimize(model, num_iterations=2)
        except Exception as error:
            raise UserError(f"constant folding failed on this model: {type(error).__name__}: {error}") from None
        return PassResult(model, modified=True)
