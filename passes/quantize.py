"""quantize: store the CPU's weight matrices in blocks of int8 or int4 (--weight-dtype int8|int4), and in every
build the CPU's predictors in blocks of int8 (`sizes.predictor_format`).

Reads: the block IR after place (each node's device), `weight_dtype`, `method` and the awq pass's report
(`picompile.awq`, repeated in the summary for inspect). Rewrites each weight matrix
of a CPU block into a standard ONNX `DequantizeLinear` of its block-quantized values (INT8 or INT4, one scale
per `runtime.dtypes.QUANT_BLOCK` weights along `axis`, `block_size` set; no zero point: the formats are
symmetric), so the IR between passes stays valid ONNX and says exactly which values the kernels will read.
select-kernels packs those values into its layouts and never rounds anything itself.

The block axis is the one each matrix's kernels read contiguously (`BLOCKED`): the reduction axis K of a dense
linear's [K, N] (panels), the row of a weight whose rows are gathered (the FFN parts' up and down rows, one row
per neuron; the embedding table). A matrix whose axis is not a whole number of blocks stays in floats (as
`sizes.float_format` says: fp16). Predictors are stored in `sizes.predictor_format` (int8: predict fitted their thresholds to those values), biases and norms fp32,
and GPU blocks keep the GPU's format (`sizes.GPU_WEIGHT_FORMAT`: fp16).

`method` "rtn" rounds each weight to the nearest step of its block's scale, the largest weight of a block
mapping to -2^(bits-1) (`passes.kernels.quant.quantize`). "awq" (the default) fits each block's scale to the
least squared error instead: AWQ's clipping search; its other half, the channel scales, the awq pass applied
before predict, where the profile's activations are. Predictors round to nearest either way (predict fitted
their thresholds to those values).
A model that came quantized in this format (MatMulNBits, symmetric, the same bits and block: import's
`SourceQuantization`) keeps its own values: they are on the grid, and rounding them again returns them, with
the source's scale type (float32 where it had float32 scales) so that no scale rounds either. In a model that
came quantized (that fact, or a GGUF file with block-quantized tensors: `GGUFSource`) every block already on the
format's grid keeps the integers and scale it came with (`quant.on_grid`: a GGUF file's Q8_0 blocks, whose scale
max|w| / 127 no rounding rule here gives, and its Q4_0 blocks in int4 or int8), whatever `method` says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.pipeline import Context, Options
from picompile.sizes import predictor_format, weight_format
from runtime.dtypes import QUANT_METHODS, WEIGHT_FORMATS, WeightFormat

from .awq import AWQ_KEY
from .import_gguf import GGUFSource
from .import_onnx import SourceQuantization
from .kernels import quant
from .place import DEVICE_KEY, device_of

# op type -> (input index, block axis) of each weight matrix a quantized build stores in blocks
BLOCKED: dict[str, tuple[tuple[int, int], ...]] = {
    "Embed": ((2, 1),),  # table [V, D]: rows gathered
    "Attention": ((4, 0), (6, 0)),  # qkv and o: [K, N] linears
    "FFN": ((1, 0), (3, 0)),  # a dense FFN's up and down
    "Linear": ((1, 0),),  # the output layer
    "SparseFFN": ((2, 1), (4, 1)),  # a part's up (gate) rows [n, D] and down rows [n, D]: rows gathered
}
PREDICTOR_AXIS = 0  # Predict's w1 [D, r] and each part's w2 [r, n] (inputs 1 on): linears, in predictor_format
QUANTIZED_KEY = "picompile.quantized"  # metadata: what the pass stored, for inspect and -v
_ONNX_TYPES = {8: (ir.DataType.INT8, np.int8), 4: (ir.DataType.INT4, ml_dtypes.int4)}


@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight matrix as select-kernels reads it from the IR: integer values (int8 numpy, unpacked), scales,
    the block axis and the format."""

    values: np.ndarray
    scales: np.ndarray
    axis: int
    fmt: WeightFormat

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def of(cls, value: ir.Value | None) -> "QuantizedMatrix | None":
        """The matrix `value` stands for, when a DequantizeLinear of constants (this pass's rewrite) makes it."""
        node = None if value is None else value.producer()
        if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            return None
        q, scales = (pir.const_array(v) for v in node.inputs[:2])
        if q is None or scales is None or (len(node.inputs) > 2 and node.inputs[2] is not None):
            return None
        bits = 4 if node.inputs[0].const_value.dtype == ir.DataType.INT4 else 8
        fmt = next(f for f in WEIGHT_FORMATS.values() if f.bits == bits)
        if scales.dtype != np.dtype(fmt.scale_dtype):  # e.g. float32 scales, as an imported model had them
            fmt = replace(fmt, scale_dtype=scales.dtype.name)
        return cls(np.asarray(q).astype(np.int8), scales, int(pir.attr(node, "axis", 1)), fmt)


@dataclass
class Quantize:
    name = "quantize"
    weight_dtype: str = Options.weight_dtype  # --weight-dtype: int8 / int4 block every matrix, float formats the predictors
    method: str = Options.quant_method  # --quant-method: "awq" fits each block's scale (`quant.quantize`'s fit_scales)

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; known: {', '.join(QUANT_METHODS)}")

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        fmt = weight_format("cpu", self.weight_dtype)
        source = SourceQuantization.of(model) if fmt.quantized else None
        fmt = _source_format(source, fmt)
        # a model that came quantized keeps its values: rounding to nearest returns them, a fitted scale would not
        fit_scales = self.method == "awq" and source is None  # (predictors never are: `_matrices`)
        # and its blocks that are on the format's grid keep the integers and scales they came with (a GGUF file's
        # Q8_0 blocks are, under a scale no rounding rule here gives: max|w| / 127)
        gguf = GGUFSource.of(model)
        keep_grid = fmt.quantized and (source is not None or (gguf is not None and gguf.quantized()))
        graph = model.graph
        done: dict[tuple[int, int], ir.Value] = {}  # (id of the float value, axis) -> its DequantizeLinear's output
        kept, stored, floats, errors, quantized_bytes, exact = [], 0, 0, [], 0.0, 0
        for node in list(graph):
            if node.domain != pir.DOMAIN or device_of(node) != "cpu":
                continue
            for index, axis, matrix_format, fit in _matrices(node, fmt, self.weight_dtype, fit_scales):
                value = node.inputs[index]
                key = (id(value), axis)
                if key not in done:
                    array = pir.const_array(value)
                    if array is None or not quant.quantizable(array.shape, axis, matrix_format.block):
                        kept.append(value.name)
                        continue
                    array = np.asarray(array, np.float32)  # a half model's matrix, widened one at a time
                    q, scales = quant.quantize(array, matrix_format, axis, fit_scales=fit,
                                               keep_grid=keep_grid and node.op_type != "Predict")
                    errors.append(_relative_error(array, quant.dequantize(q, scales, axis)))
                    exact += errors[-1] == 0.0
                    done[key] = self._dequantize(graph, node, value.name, q, scales, axis, matrix_format)
                    stored += array.size
                    floats += array.nbytes
                    quantized_bytes += array.size * matrix_format.bytes_per_weight
                node.replace_input_with(index, done[key])
        pir.drop_unused_initializers(graph)
        if not done and not fmt.quantized:
            return PassResult(model, modified=False)
        method = "rtn" if source is not None or not fmt.quantized else self.method
        blocked = fmt if fmt.quantized else predictor_format(self.weight_dtype)
        summary = {"format": blocked.name, "method": method, "block": blocked.block,
                   "scale_dtype": blocked.scale_dtype, "matrices": len(done),
                   "scope": "weights" if fmt.quantized else "predictors",
                   "weights": stored, "float32_bytes": floats, "bytes": int(quantized_bytes),
                   "mean_relative_error": float(np.mean(errors)) if errors else 0.0, "kept_in_floats": kept,
                   "exact_matrices": exact,
                   "channel_scales": json.loads(model.metadata_props.get(AWQ_KEY, "{}"))}
        model.metadata_props[QUANTIZED_KEY] = json.dumps(summary)
        ctx.log(f"quantize: {len(done)} {summary['scope'][:-1]} matrices to {blocked.name} ({method}, blocks of "
                f"{blocked.block}, {blocked.scale_dtype} scales): "
                f"{floats / 2**20:.1f} MiB fp32 -> {quantized_bytes / 2**20:.1f} MiB, mean relative error "
                f"{summary['mean_relative_error']:.4f}{f' ({exact} of them exactly as they came)' if keep_grid else ''}"
                f"{f'; {len(kept)} not whole blocks, kept in floats' if kept else ''}")
        return PassResult(model, modified=True)

    @staticmethod
    def _dequantize(graph: ir.Graph, before: ir.Node, name: str, q: np.ndarray, scales: np.ndarray, axis: int,
                    fmt: WeightFormat) -> ir.Value:
        onnx_type, numpy_type = _ONNX_TYPES[fmt.bits]
        q_value = ir.val(f"{name}.q", const_value=ir.tensor(q.astype(numpy_type), dtype=onnx_type, name=f"{name}.q"))
        graph.register_initializer(q_value)
        s_value = pir.initializer(graph, f"{name}.scales", scales)
        node = ir.node("DequantizeLinear", [q_value, s_value],
                       {"axis": axis, "block_size": fmt.block, "output_dtype": int(ir.DataType.FLOAT)},
                       name=f"{name}.dequantize")
        node.outputs[0].name, node.outputs[0].dtype = f"{name}.dequantized", ir.DataType.FLOAT
        node.outputs[0].shape = ir.Shape(list(q.shape))
        node.metadata_props[DEVICE_KEY] = "cpu"
        graph.insert_before(before, node)
        return node.outputs[0]


def _matrices(node: ir.Node, fmt: WeightFormat, weight_dtype: str,
              fit_scales: bool) -> list[tuple[int, int, WeightFormat, bool]]:
    """(input index, block axis, format, whether to fit the block scales) of each weight matrix of `node` the
    pass blocks: in a float build (`fmt` not quantized) the predictors' alone. Predictors round to nearest:
    predict fitted their thresholds to those values (`as_stored`)."""
    if node.op_type == "Predict":
        return [(index, PREDICTOR_AXIS, predictor_format(weight_dtype), False) for index in range(1, len(node.inputs))]
    if not fmt.quantized:
        return []
    return [(index, axis, fmt, fit_scales) for index, axis in BLOCKED.get(node.op_type, ())]


def _source_format(source: SourceQuantization | None, fmt: WeightFormat) -> WeightFormat:
    """`fmt`, with the source's scale type where every weight of the model came quantized in it (bits, block,
    symmetric)."""
    if source is None or not source.weights:
        return fmt
    if all(w.symmetric and w.bits == fmt.bits and w.block_size == fmt.block for w in source.weights):
        scale_types = {w.scale_dtype for w in source.weights}
        if scale_types == {"float32"}:
            return replace(fmt, scale_dtype="float32")
    return fmt


def _relative_error(w: np.ndarray, approx: np.ndarray) -> float:
    """||w - approx|| / ||w||: how much of the matrix the rounding changed."""
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - approx)) / norm if norm else 0.0
