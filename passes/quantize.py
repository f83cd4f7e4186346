"""quantize: store the CPU's weight matrices in blocks of int8, int4 or int4a (--weight-dtype int8|int4|int4a),
and in every build the CPU's predictors in blocks of int8 (`sizes.PREDICTOR_FORMAT`).

Reads: the block IR after place (each node's device), the build's weight format (`ctx.build`), `method` and the awq pass's report
(`picompile.awq`, repeated in the summary for inspect). Rewrites each weight matrix
of a CPU block into a standard ONNX `DequantizeLinear` of its block-quantized values (INT8 or INT4, one scale
per `runtime.dtypes.QUANT_BLOCK` weights along `axis`, `block_size` set; no zero point: the formats are
symmetric), so the IR between passes stays valid ONNX and says exactly which values the kernels will read.
int4a's asymmetric blocks (x = d q + m, q in [0, 15]: GGUF's Q4_1) are a DequantizeLinear of UINT4 values and
their scales, reshaped to [.., blocks, 32, ..], plus an Add of the mins (shaped [.., blocks, 1, ..]), reshaped
back (`_with_mins`, which `QuantizedMatrix.of` reads). select-kernels packs those values into its layouts and
never rounds anything itself.

The block axis is the one each matrix's kernels read contiguously (`BLOCKED`): the reduction axis K of a dense
linear's [K, N] (panels), the row of a weight whose rows are gathered (the FFN parts' up and down rows, one row
per neuron; the embedding table), and in threshold mode the row of a matrix whose input a threshold thins
(`THRESHOLDED`: ThresholdFFN's and attention's, threshold >= 0; the column-sparse kernels read one row per kept
input channel). The quality pass's `WeightPlan` (by initializer name, read through `format_for`) stores a matrix
in another format than `weight_dtype`, or keeps it in floats (fp16). A matrix whose axis is not a whole number of blocks stays in floats (as
`sizes.float_format` says: fp16). Predictors are stored in `sizes.PREDICTOR_FORMAT` (int8: predict fitted their thresholds to those values), biases and norms fp32,
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
max|w| / 127 no rounding rule here gives, and its Q4_0 blocks in int4 or int8), whatever `method` says; in int4a
(asymmetric 4-bit blocks: Q4_1, MatMulNBits with zero points) `quant.quantize_asymmetric`'s exact mode finds
each block's q, d and m again, and a block it cannot reproduce bit for bit is re-rounded and counted in the log.
With `keep_source_blocks` (a build whose format was chosen from the file, --weight-dtype auto) a matrix the
model stores in other blocks than the build's format (a Q4_1 file's Q8_0 embedding) is stored in the first
declared format that holds it exactly (`SOURCE_FORMATS`), not re-rounded. That rule lives in `passes.blocking`,
which the quality pass's reference computes with too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from .facts import read_entry, write_entry
from . import ir as pir
from .pipeline import Context, Options
from .sizes import PREDICTOR_FORMAT
from runtime.dtypes import QUANT_METHODS, WEIGHT_FORMATS, WeightFormat
from runtime.manifest import Quantization

from .awq import AwqReport
from .blocking import Blocking, relative_error
from .file_blocks import FileMatrix, FileTensor, file_matrix
from .quality import WeightPlan
from .kernels import quant
from .place import DEVICE_KEY, PLACED, device_of
from . import ops

# op type -> (input index, block axis) of each weight matrix a quantized build stores in blocks
BLOCKED: dict[str, tuple[tuple[int, int], ...]] = {
    "Embed": ((2, 1),),  # table [V, D]: rows gathered
    "Attention": ((4, 0), (6, 0)),  # qkv and o: [K, N] linears
    "FFN": ((1, 0), (3, 0)),  # a dense FFN's up and down
    "Linear": ((1, 0),),  # the output layer
    "SparseFFN": ((2, 1), (4, 1)),  # a part's up (gate) rows [n, D] and down rows [n, D]: rows gathered
    "ThresholdFFN": ((1, 0), (3, 0)),  # w_up, w_down [K, N]: panels where dense (THRESHOLDED: rows where thinned)
}
# a projection whose input a threshold thins (threshold >= 0) is read one row per input channel by the column-sparse
# kernels: blocked along its rows (axis 1), as the SparseFFN rows; else it is a dense linear's panels (axis 0).
# op type -> (input index, the node's threshold attribute) of each such matrix
THRESHOLDED: dict[str, tuple[tuple[int, str], ...]] = {
    "ThresholdFFN": ((1, "threshold_in"), (3, "threshold_down")),  # w_up [D, 2F or F], w_down [F, D]
    "Attention": ((4, "threshold_qkv"), (6, "threshold_o")),  # w_qkv, w_o: [K, N]; absent attributes: dense
    "Linear": ((1, "threshold"),),  # the output layer's [K, V], where the quality plan thins its input
}
PREDICTOR_AXIS = 0  # Predict's w1 [D, r] and each part's w2 [r, n] (inputs 1 on): linears, in PREDICTOR_FORMAT
QUANTIZED_KEY = "picompile.quantized"  # metadata: what the pass stored (runtime.manifest.Quantization)
_ONNX_TYPES = {(8, False): (ir.DataType.INT8, np.int8), (4, False): (ir.DataType.INT4, ml_dtypes.int4),
               (4, True): (ir.DataType.UINT4, ml_dtypes.uint4)}  # (bits, has_min) -> the values' types


@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight matrix as select-kernels reads it from the IR: integer values (int8 numpy, unpacked), scales,
    the block axis, the format and, for an asymmetric one, its mins (shaped as the scales)."""

    values: np.ndarray
    scales: np.ndarray
    axis: int
    fmt: WeightFormat
    mins: np.ndarray | None = None

    @property
    def blocks(self) -> tuple:
        """(values, scales (, mins)): what quant.pack_rows / pack_panels take before the format."""
        return (self.values, self.scales) if self.mins is None else (self.values, self.scales, self.mins)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def of(cls, value: ir.Value | None) -> "QuantizedMatrix | None":
        """The matrix `value` stands for, when a DequantizeLinear of constants (this pass's rewrite; with int4a's
        mins, `_with_mins`') makes it."""
        node, mins = None if value is None else value.producer(), None
        added = _standard(node, "Reshape") and _standard(node.inputs[0].producer(), "Add")
        if added:
            add = node.inputs[0].producer()
            mins, node = pir.const_array(add.inputs[1]), add.inputs[0].producer()
            node = node.inputs[0].producer() if _standard(node, "Reshape") else None
        if not _standard(node, "DequantizeLinear") or (added and mins is None):
            return None
        q, scales = (pir.const_array(v) for v in node.inputs[:2])
        if q is None or scales is None or (len(node.inputs) > 2 and node.inputs[2] is not None):
            return None
        key = next((key for key, (onnx_type, _) in _ONNX_TYPES.items()
                    if onnx_type == node.inputs[0].const_value.dtype), None)
        if key is None or key[1] != added:
            return None
        fmt = next(f for f in WEIGHT_FORMATS.values() if (f.bits, f.has_min) == key and not f.kept_from_file)
        if scales.dtype != np.dtype(fmt.scale_dtype):  # e.g. float32 scales, as an imported model had them
            fmt = replace(fmt, scale_dtype=scales.dtype.name)
        return cls(np.asarray(q).astype(np.int8), scales, int(pir.attr(node, "axis", 1)), fmt,
                   None if mins is None else np.ascontiguousarray(mins.reshape(scales.shape)))


@dataclass
class Quantize:
    name = "quantize"
    requires = (PLACED,)
    method: str = Options.quant_method  # --quant-method: "awq" fits each block's scale (`quant.quantize`'s fit_scales)

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; known: {', '.join(QUANT_METHODS)}")

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        # the build's format (int8 / int4 block every matrix, float formats the predictors); a model that came
        # quantized keeps its values, in its own blocks where a format holds them (passes.blocking)
        blocking = Blocking.of(model, ctx.build.weight_format, self.method, ctx.build.keep_source_blocks)
        fmt = blocking.format
        graph = model.graph
        done: dict[tuple[int, int], ir.Value] = {}  # (id of the float value, axis) -> its DequantizeLinear's output
        kept, stored, floats, errors, quantized_bytes, rerounded, foreign = [], 0, 0, [], 0.0, 0, []
        exact_matrices, moved = 0, {}  # matrices kept exactly; format name -> matrices stored in it instead
        from_file: dict[str, int] = {}  # format name -> matrices kept in a model file's own blocks (FileMatrix)
        planned = WeightPlan.of(model).formats  # the quality pass's format per matrix, where not the build's
        planned_floats: list[str] = []  # matrices the plan keeps in floats
        planned_formats: dict[str, int] = {}  # format name -> matrices the plan stores in it instead of fmt
        for node in list(graph):
            if node.domain != pir.DOMAIN or device_of(node) != "cpu":
                continue
            thinned = thinned_inputs(node)
            for index, axis, matrix_format in _matrices(node, fmt):
                value = node.inputs[index]
                key = (id(value), axis)
                if node.op_type != "Predict":
                    matrix_format = blocking.format_for(planned.get(value.name))
                    if not matrix_format.quantized:  # planned in floats: select-kernels stores it so
                        planned_floats.append(value.name)
                        continue
                held = file_matrix(value, any_formats=True) if node.op_type != "Predict" else None
                used = blocking.kept(held, matrix_format, axis, thinned=index in thinned)
                if key not in done and blocking.kept_in_runs(held, matrix_format, axis):  # each run its blocks
                    for run in held.runs():
                        from_file[run.stored_format().name] = from_file.get(run.stored_format().name, 0) + 1
                        quantized_bytes += run.size * run.stored_format().bytes_per_weight
                    stored += held.size
                    floats += held.size * 4
                    keep_blocks(value, None)
                    continue
                if key not in done and used is not None:  # the file's own blocks: nothing is rounded
                    from_file[used.name] = from_file.get(used.name, 0) + 1
                    stored += held.size
                    floats += held.size * 4
                    quantized_bytes += held.size * used.bytes_per_weight
                    if used.kept_from_file:  # select-kernels packs the file's blocks themselves
                        keep_blocks(value, used)
                        continue
                    blocks = held.blocks()
                    done[key] = self._dequantize(graph, node, value.name, blocks.values(), blocks.scales, axis, used,
                                                 blocks.mins)
                    exact_matrices += 1
                matrix_format = blocking.rounding_format(matrix_format)
                if key not in done:
                    array = pir.const_array(value)
                    if array is None or not quant.quantizable(array.shape, axis, matrix_format.block):
                        kept.append(value.name)
                        continue
                    array = np.asarray(array, np.float32)  # a half model's matrix, widened one at a time
                    if node.op_type == "Predict":  # rounded to nearest: predict fitted their thresholds to those
                        blocks, used, missed = quant.quantize(array, matrix_format, axis), matrix_format, 0
                    else:
                        blocks, used, missed = blocking.blocks(array, matrix_format, axis, held)
                    if blocks is None:  # a matrix the model stores in floats (or in other blocks): not re-rounded
                        foreign.append(value.name)
                        continue
                    rerounded += missed
                    if used is not matrix_format:
                        moved[used.name] = moved.get(used.name, 0) + 1
                    errors.append(relative_error(array, quant.dequantize(*blocks[:2], axis, *blocks[2:])))
                    exact_matrices += errors[-1] == 0.0
                    done[key] = self._dequantize(graph, node, value.name, *blocks[:2], axis, used, *blocks[2:])
                    matrix_format = used
                    if node.op_type != "Predict" and used.name != fmt.name and value.name in planned:
                        planned_formats[used.name] = planned_formats.get(used.name, 0) + 1
                    stored += array.size
                    floats += array.nbytes
                    quantized_bytes += array.size * matrix_format.bytes_per_weight
                node.replace_input_with(index, done[key])
        pir.drop_unused_initializers(graph)
        if not done and not from_file and not fmt.quantized:
            return PassResult(model, modified=False)
        method = "rtn" if blocking.came_quantized or not fmt.quantized else self.method
        blocked = fmt if fmt.quantized else PREDICTOR_FORMAT
        summary = Quantization(format=blocked.name, method=method, block=blocked.block,
                               scale_dtype=blocked.scale_dtype, matrices=len(done),
                               scope="weights" if fmt.quantized else "predictors",
                               weights=stored, float32_bytes=floats, bytes=int(quantized_bytes),
                               mean_relative_error=float(np.mean(errors)) if errors else 0.0, kept_in_floats=kept,
                               exact_matrices=exact_matrices, planned_floats=planned_floats,
                               planned_formats=planned_formats, source_blocks_rerounded=rerounded,
                               source_floats_kept=foreign, source_formats_kept={**moved, **from_file},
                               channel_scales=channel_scales.to_json() if (channel_scales := AwqReport.of(model)) else {})
        write_entry(model, QUANTIZED_KEY, summary)
        ctx.log(f"quantize: {len(done) + sum(from_file.values())} {summary.scope[:-1]} matrices to {blocked.name} "
                f"({method}, blocks of "
                f"{blocked.block}, {blocked.scale_dtype} scales): "
                f"{floats / 2**20:.1f} MiB fp32 -> {quantized_bytes / 2**20:.1f} MiB, mean relative error "
                f"{summary.mean_relative_error:.4f}"
                f"{(f'; the model{chr(39)}s own blocks kept exactly in {exact_matrices}' if exact_matrices else '') if blocking.came_quantized and fmt.quantized else ''}"
                f"{f'; {len(kept)} not whole blocks, kept in floats' if kept else ''}"
                f"{''.join(f'; {n} in {name} by the quality plan' for name, n in planned_formats.items())}"
                f"{f'; {len(planned_floats)} kept in floats by the quality plan' if planned_floats else ''}"
                f"{''.join(f'; {n} in {name}, the blocks the model stores them in' for name, n in moved.items())}"
                f"{''.join(f'; {n} in {name} straight from the file' for name, n in from_file.items())}"
                f"{f'; {len(foreign)} not in 4-bit blocks in the model ({_names(foreign)}), kept in floats' if foreign else ''}"
                f"{f'; {rerounded} of the model{chr(39)}s blocks not reproduced, re-rounded' if rerounded else ''}")
        return PassResult(model, modified=True)

    @staticmethod
    def _dequantize(graph: ir.Graph, before: ir.Node, name: str, q: np.ndarray, scales: np.ndarray, axis: int,
                    fmt: WeightFormat, mins: np.ndarray | None = None) -> ir.Value:
        onnx_type, numpy_type = _ONNX_TYPES[(fmt.bits, fmt.has_min)]
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
        return node.outputs[0] if mins is None else _with_mins(graph, before, name, node.outputs[0], mins, axis, fmt)


KEPT_KEY = "picompile.kept_blocks"  # a value's metadata: the quantize pass stores it in the file's blocks (format name)


KEPT_IN_RUNS = "runs"  # KEPT_KEY's value for a matrix stored run by run (FileMatrix.runs), each in its own blocks


def keep_blocks(value: ir.Value, fmt: WeightFormat | None) -> None:
    """Record on `value` that it is stored in the file's own blocks of `fmt` (None: run by run, each run in its
    own: `FileMatrix.runs`) (this pass's decision)."""
    value.metadata_props[KEPT_KEY] = KEPT_IN_RUNS if fmt is None else fmt.name


def kept_blocks(value: ir.Value | None) -> FileMatrix | None:
    """The file matrix the quantize pass decided to store in the file's own blocks, else None."""
    tensor = None if value is None else value.const_value
    matrix = tensor.matrix if isinstance(tensor, FileTensor) else None
    if matrix is None:
        return None
    kept = value.metadata_props.get(KEPT_KEY)
    stored = matrix.stored_format()
    return matrix if (kept == KEPT_IN_RUNS and stored is None) or (stored is not None and kept == stored.name) else None


def _standard(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def dequantizes_weight(node: ir.Node) -> bool:
    """Whether `node` is part of a stored matrix's dequantization (its DequantizeLinear; int4a's mins' Reshape /
    Add / Reshape after one): constants a kernel reads as blocks (`QuantizedMatrix.of`), not a computation."""
    while (_standard(node, "Reshape") or _standard(node, "Add")) and pir.const_array(node.inputs[1]) is not None:
        node = node.inputs[0].producer()
    return _standard(node, "DequantizeLinear") and pir.const_array(node.inputs[0]) is not None


def _with_mins(graph: ir.Graph, before: ir.Node, name: str, scaled: ir.Value, mins: np.ndarray, axis: int,
               fmt: WeightFormat) -> ir.Value:
    """scaled (DequantizeLinear's q * d, [K, N]) plus each block's min: Reshape to [.., blocks, block, ..], Add
    the mins shaped [.., blocks, 1, ..], Reshape back (standard ONNX, as QuantizedMatrix.of reads it)."""
    shape = list(scaled.shape)
    blocked = shape[:axis] + [shape[axis] // fmt.block, fmt.block] + shape[axis + 1:]
    min_shape = shape[:axis] + [shape[axis] // fmt.block, 1] + shape[axis + 1:]
    out = scaled
    for step, (op, operand) in enumerate((("Reshape", np.array(blocked, np.int64)), ("Add", mins.reshape(min_shape)),
                                          ("Reshape", np.array(shape, np.int64)))):
        constant = pir.initializer(graph, f"{name}.{('blocks', 'mins', 'shape')[step]}", operand)
        node = ir.node(op, [out, constant], name=f"{name}.{('blocked', 'add_mins', 'unblocked')[step]}")
        node.outputs[0].name, node.outputs[0].dtype = f"{name}.{('blocked', 'with_mins', 'dequantized_mins')[step]}", \
            ir.DataType.FLOAT
        node.outputs[0].shape = ir.Shape(blocked if step < 2 else shape)
        node.metadata_props[DEVICE_KEY] = "cpu"
        graph.insert_before(before, node)
        out = node.outputs[0]
    return out


def _matrices(node: ir.Node, fmt: WeightFormat) -> list[tuple[int, int, WeightFormat]]:
    """(input index, block axis, format) of each weight matrix of `node` the pass blocks: in a float build (`fmt`
    not quantized) the predictors' alone."""
    if node.op_type == "Predict":
        return [(index, PREDICTOR_AXIS, PREDICTOR_FORMAT) for index in range(1, len(node.inputs))]
    if not fmt.quantized:
        return []
    return [(index, axis, fmt) for index, axis in blocked_axes(node)]


def thinned_inputs(node: ir.Node) -> set[int]:
    """The input indices of `node`'s matrices whose input a threshold thins (`THRESHOLDED`, threshold >= 0)."""
    return {index for index, key in THRESHOLDED.get(node.op_type, ()) if float(ops.view(node).value(key)) >= 0}


def blocked_axes(node: ir.Node) -> list[tuple[int, int]]:
    """(input index, block axis) of each weight matrix of `node` a quantized build stores in blocks: `BLOCKED`'s,
    the matrices a threshold thins blocked along their rows instead (`THRESHOLDED`)."""
    rows = thinned_inputs(node)
    return [(index, 1 if index in rows else axis) for index, axis in BLOCKED.get(node.op_type, ())]


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def quantization_of(model: ir.Model) -> Quantization | None:
    """What the quantize pass stored (None where it stored nothing)."""
    return read_entry(model, QUANTIZED_KEY, Quantization)


