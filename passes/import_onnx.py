"""import: load the user's ONNX decoder, fix batch to 1, compute in fp32, fold constants and infer shapes.

Reads: a path (the pass's argument), not an IR; weights may live in external data files beside it (models
over 2 GB; read into memory when they total under `passes.ir.EXTERNAL_DATA_BYTES`, else memory-mapped, so
a big model's weights are paged in as passes read them, never copied whole). Adds: the IR itself, with every
graph input's batch dimension fixed to 1, constant subgraphs folded (onnxscript's optimizer), so that the
recognise pass sees weights as initializers whatever exporter made the graph, and then the graph made to
compute in fp32: casts and inputs made fp32, small fp16 / bf16 constants widened, and fp16 / bf16 matrices
kept as stored behind a Cast to fp32 (`compute_in_fp32`), so a half-precision model is held at half the
memory of fp32 until lowering stores each weight in `--weight-dtype` (a half model keeps its rounded weight
values exactly). Sequence and past lengths stay symbolic.

Models quantized by onnxruntime (com.microsoft `MatMulNBits`, as its MatMulNBitsQuantizer, optimum and
onnxruntime-genai's builder write them) come in as ordinary models: each MatMulNBits with constant B, scales
(and zero_points) becomes a MatMul over its exactly dequantized float32 [K, N] weight, (q - zero_point) x
scale (zero point 2^(bits-1) where there is none), plus an Add of its bias if it has one, so every pass
after this one sees the MatMul (+ bias) it knows. That the weights came quantized is kept as a fact on the
model, `metadata_props["picompile.source_quantization"]`: the JSON of a `SourceQuantization`, one entry per
dequantized weight (its node, the new weight initializer, the B / scales / zero_points initializers it was
stored in, bits, block_size, whether symmetric (no zero points, or all equal to 2^(bits-1)), the scales'
dtype, K and N); read it with `SourceQuantization.of(model)` (recognise keeps it on the lifted model).
A 4-bit MatMulNBits with zero points (uint8 codes or floats; onnxruntime's asymmetric quantizer, or a GGUF
file's Q4_1 blocks) is written as int4a's blocks' values instead (`runtime.dtypes.dequantize_blocks`: x = d q + m
in float32, d = the scale, m = -scale x zero point, both in fp16 where that is exact: fp16 scales, and m within
fp32 rounding of an fp16 value, as a float32 zero point of -m / d gives back a Q4_1 block's fp16 m; else both in
float32, said in the log line), so that the quantize pass finds the same q, d and m in them again; the fact
records that type (`block_dtype`). The values differ from (q - zero point) x scale by fp32 rounding only.
Symmetric MatMulNBits with block_size 32 is picompile's int4 / int8 rule (scale = the block's
largest-magnitude weight / -2^(bits-1)): `passes.kernels.quant.quantize` recovers its q and scales exactly
from the dequantized weight where the scales are representable in the format's scale dtype (float16: an fp16
model's; an fp32 model's float32 scales would round once more), so a later pass may store such weights
without a second rounding.
Refuses, naming the node or value: files that are not ONNX, graphs with dangling references or missing
external data, models that are not decoders with a KV cache (CNNs, encoders), weights fed as graph
inputs, MatMulNBits that cannot be honoured (bits other than 4 or 8, a g_idx input, a weight prepacked for an
execution provider, unknown attributes, non-constant or misshapen weights), and models whose weights need
more memory than the machine has available.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes import PassResult

from . import ir as pir
from .errors import UserError
from .facts import ModelFact
from .pipeline import Context
from .sizes import weight_bytes
from .targets import format_size
from runtime.artifact import available_memory_bytes, first_line
from runtime.dtypes import WEIGHT_FORMATS, dequantize_blocks

REQUIRED_INPUTS = ("input_ids",)
REQUIRED_OUTPUTS = ("logits",)
# Graph inputs a decoder export may have besides its weights (optimum's names).
DECODER_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "cache_position")
# Ops whose second input is a weight: a graph input there means weights are fed at run time.
WEIGHT_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Gather"}
# Build memory = BASE + WORKING_FACTOR x weight bytes (as stored: fp16 ones count 2 bytes, since import keeps them
# so): the lower pass's peak on a streamed 7B fp16 build was 1.76x its weights, every other pass's lower
# (measurements: BENCHMARKS.md, "Measurements behind the code's constants"). A build that widens half weights
# (--weight-dtype fp32 of an fp16 model) stores twice their bytes, which this does not count: the refusal stops
# only builds that clearly cannot fit.
WORKING_FACTOR = 2.0
BASE_BYTES = 512 << 20


def check_memory(what: str, weights: int) -> None:
    """Refuse up front a build whose `weights` (bytes) cannot fit in memory, rather than swap or be killed."""
    needed = int(weights * WORKING_FACTOR) + BASE_BYTES
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise UserError(f"{what} needs about {format_size(needed)} of memory to build ({format_size(weights)} "
                        f"of weights x {WORKING_FACTOR:g} + {format_size(BASE_BYTES)}) but only {format_size(available)} "
                        "is available; free memory or build on a larger machine")


HALF_TYPES = pir.HALF_TYPES
FILE = "picompile.file"  # a loaded model's `meta` entry: the path `load` read it from


def _fp32_tensor(tensor: ir.TensorProtocol) -> ir.Tensor:
    return ir.tensor(np.asarray(tensor.numpy(), np.float32), name=tensor.name)


def compute_in_fp32(graph: ir.Graph) -> tuple[int, int]:
    """Make a half-precision (fp16 / bf16) graph compute in fp32: casts to half types cast to fp32, and inputs,
    outputs and intermediate values are typed fp32. Its matrices (weights, embedding tables) keep their stored
    precision behind a `Cast` to fp32 (`passes.ir.const_array` reads through it), so a half model is held
    at half the memory until lowering stores each weight in the build's format; its other constants are widened
    (exactly). Returns (matrices kept in half precision, tensors widened)."""
    kept = widened = 0
    for value in list(graph.initializers.values()):
        tensor = value.const_value
        if tensor is None or tensor.dtype not in HALF_TYPES:
            continue
        if len(tensor.shape) == 2 and value.uses():
            users = list(value.uses())
            if all(user.op_type == "Cast" and pir.attr(user, "to") == ir.DataType.FLOAT for user, _ in users):
                kept += 1  # already read through a Cast to fp32 (a GGUF file's F16 matrices come so)
                continue
            cast = ir.node("Cast", [value], attributes={"to": ir.DataType.FLOAT}, name=f"{value.name}/fp32")
            widened_value = cast.outputs[0]
            widened_value.name, widened_value.shape, widened_value.dtype = f"{value.name}/fp32", value.shape, ir.DataType.FLOAT
            for user, index in users:
                user.replace_input_with(index, widened_value)
            graph.insert_before(graph.node(0), cast) if len(graph) else graph.append(cast)
            kept += 1
        else:
            value.const_value = _fp32_tensor(tensor)
            value.dtype = ir.DataType.FLOAT
            widened += 1
    values = list(graph.inputs)
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
    return kept, widened


def load_onnx(path: Path, for_build: bool = True) -> ir.Model:
    """The ONNX model at `path`, its weights checked readable; a build (`for_build`) first checks that the
    machine has the memory to compile it (eval's reference only has to be read)."""
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if path.is_dir() or path.stat().st_size == 0:
        raise UserError(f"{path} is not an ONNX model (empty or a directory)")
    if for_build:
        check_memory(str(path), path.stat().st_size)  # inline weights are read with the file
    try:
        with _quiet("onnx_ir"):  # it warns about dangling names on stderr: _check_references names them
            model = ir.load(str(path))
    except Exception as error:  # protobuf raises several types for garbage bytes
        raise UserError(f"{path} is not a readable ONNX model ({type(error).__name__}: {error})") from None
    _check_external_data(model, path)
    _check_initializers(model, path)
    if for_build:
        check_memory(str(path), weight_bytes(model.graph))
    model.meta[FILE] = path
    return model


def stored_weight_dtype(model: ir.Model) -> str:
    """The --weight-dtype that keeps a loaded model's weights as the file stores them (what `auto` means):
    int4 / int8 where its MatMulNBits weights all have those bits (int4a where 4-bit ones have zero points),
    fp16 where most of its float matrix bytes are fp16 or bf16 (bf16 values are fp16 ones but for those below
    fp16's normal range, ~6e-5), else fp32."""
    nodes = [node for node in model.graph if node.op_type == "MatMulNBits" and node.domain == NBITS_DOMAIN]
    bits = {int(pir.attr(node, "bits", 4)) for node in nodes}
    if len(bits) == 1 and (name := f"int{bits.pop()}") in WEIGHT_FORMATS:
        if name == "int4" and not all(_read_matmul_nbits(node)["fact"]["symmetric"] for node in nodes):
            return "int4a"
        return name
    by_dtype: dict[bool, int] = {True: 0, False: 0}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and len(tensor.shape) == 2 and tensor.dtype.is_floating_point():
            by_dtype[tensor.dtype in HALF_TYPES] += tensor.nbytes
    return "fp16" if by_dtype[True] > by_dtype[False] else "fp32"


def source_file(model: ir.Model) -> Path | None:
    """The file `model` was loaded from, or None. It still takes any batch (the import pass fixes the
    in-memory graph's to 1 and folds shapes with it): the profile pass samples from it in batches."""
    return model.meta.get(FILE)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Libraries log warnings about bad models to stderr; the user gets our one `error:` line instead."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_external_data(model: ir.Model, path: Path) -> None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            data = Path(tensor.base_dir) / tensor.location
            end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
            if not data.is_file():
                raise UserError(f"{path}: the weights of {value.name} are in {tensor.location}, which is missing "
                                f"(keep the external data file beside the model)")
            if data.stat().st_size < end:
                raise UserError(f"{path}: {tensor.location} is {data.stat().st_size} bytes but {value.name} needs "
                                f"bytes up to {end}: the external data file is truncated")


def _check_initializers(model: ir.Model, path: Path) -> None:
    """Each initializer's bytes must match its dtype and shape (read as views: inline data is already in
    memory, external data is memory-mapped)."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None:
            continue
        try:
            tensor.numpy()
        except (ValueError, TypeError) as error:
            raise UserError(f"{path}: initializer {value.name!r} ({tensor.dtype}, shape {list(tensor.shape)}) holds "
                            f"data that does not match its type and shape ({error})") from None


def _check_nodes(model: ir.Model) -> None:
    """Every standard ONNX node must match its schema (op known at the model's opset, input and output
    counts, attribute types): the passes after this one may then rely on it."""
    import onnx

    context = onnx.checker.C.CheckerContext()
    context.ir_version = model.ir_version
    context.opset_imports = {domain or "": version for domain, version in model.opset_imports.items()}
    for node in model.graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            onnx.checker.check_node(ir.serde.serialize_node(node), context)
        except onnx.checker.ValidationError as error:
            reason = first_line(error, "invalid")
            raise UserError(f"node {node.name or node.op_type} ({node.op_type}) is not valid ONNX: {reason}") from None


def _check_references(graph: ir.Graph) -> None:
    """Every value a node reads (and every graph output) must be a graph input, a constant or some node's output."""
    inputs = {id(v) for v in graph.inputs}

    def dangling(value: ir.Value | None) -> bool:
        return (value is not None and value.producer() is None and id(value) not in inputs
                and value.const_value is None and value.name not in graph.initializers)

    for node in graph:
        for value in node.inputs:
            if dangling(value):
                raise UserError(f"node {node.name or node.op_type} ({node.op_type}) reads {value.name!r}, which no node, "
                                "input or initializer of the graph defines: the model file is damaged or incomplete")
    for value in graph.outputs:
        if dangling(value):
            raise UserError(f"graph output {value.name!r} is not produced by any node: the model file is damaged or incomplete")


def _sort(graph: ir.Graph) -> None:
    """Nodes in topological order (ONNX asks for it; some writers ignore it); a cycle is refused, named."""
    try:
        graph.sort()
    except ValueError:
        import networkx as nx

        edges = nx.DiGraph((id(value.producer()), id(node)) for node in graph for value in node.inputs
                           if value is not None and value.producer() is not None)
        names = {id(node): node.name or node.op_type for node in graph}
        cycle = [names.get(a, "?") for a, _ in nx.find_cycle(edges)]
        raise UserError(f"the graph has a cycle through nodes {' -> '.join(cycle[:6])}{' ...' if len(cycle) > 6 else ''}: "
                        "the model file is damaged") from None


def check_decoder(graph: ir.Graph) -> None:
    """The model must be a decoder LLM export with a KV cache; say what it looks like instead."""
    input_names = {v.name for v in graph.inputs}
    output_names = {v.name for v in graph.outputs}
    missing = [n for n in REQUIRED_INPUTS if n not in input_names] + [n for n in REQUIRED_OUTPUTS if n not in output_names]
    if missing:
        conv = next((n for n in graph if n.op_type in ("Conv", "ConvTranspose")), None)
        looks_like = f"; it has {conv.op_type} node {conv.name or '(unnamed)'}: a CNN?" if conv is not None else ""
        raise UserError(
            f"model is not a decoder LLM export: it lacks {', '.join(missing)} "
            f"(inputs: {', '.join(sorted(input_names)) or 'none'}; outputs: {', '.join(sorted(output_names)) or 'none'})"
            + looks_like)
    has_cache = any(n.startswith("present.") for n in output_names) or any(n.startswith("past_key_values.") for n in input_names)
    if not has_cache:
        softmax = next((n for n in graph if n.op_type == "Softmax"), None)
        if softmax is None:
            raise UserError("model has no decoder layers: no attention (Softmax) and no KV cache "
                            "(past_key_values.{i}.key/value inputs, present.{i}.key/value outputs)")
        raise UserError(f"model has attention ({softmax.name or 'Softmax'}) but no KV cache (no past_key_values.{{i}} "
                        "inputs, no present.{i} outputs): an encoder-only model (e.g. BERT) or a decoder exported "
                        "without its cache; picompile compiles decoder-only LLMs exported with past_key_values "
                        "(optimum's text-generation-with-past)")


def _check_weights_are_constants(graph: ir.Graph) -> None:
    """A graph input that a MatMul/Gemm/Conv/Gather reads as its weight means weights are fed at run time."""
    for value in graph.inputs:
        if value.name in DECODER_INPUTS or value.name.startswith("past_key_values.") or value.const_value is not None:
            continue
        for node, index in value.uses():
            while node.op_type in ("Transpose", "Cast", "Reshape", "Identity") and node.outputs[0].uses():
                node, index = next(iter(node.outputs[0].uses()))
            is_weight = index == 1 if node.op_type != "Gather" else index == 0
            if node.op_type in WEIGHT_OPS and is_weight:
                raise UserError(f"node {node.name or node.op_type} ({node.op_type}) reads its weight from graph input "
                                f"{value.name!r}, not a constant: picompile needs weights stored in the model as "
                                "initializers (export with the parameters included)")


NBITS_DOMAIN = "com.microsoft"
# MatMulNBits' attributes (onnxruntime's contrib schema). accuracy_level only lets onnxruntime compute less
# exactly (int8 activations at 4): the exact dequantized MatMul honours every level.
NBITS_ATTRIBUTES = {"K", "N", "bits", "block_size", "accuracy_level", "weight_prepacked"}
NBITS_BITS = (4, 8)  # the widths of picompile's integer formats (runtime.dtypes.WEIGHT_FORMATS)
NBITS_INPUTS = ("A", "B", "scales", "zero_points", "g_idx", "bias")
SOURCE_QUANTIZATION = "picompile.source_quantization"  # the metadata_props entry


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight the model stored quantized (a MatMulNBits), now a float32 [K, N] initializer."""

    node: str  # the MatMulNBits node, now a MatMul of the same name
    weight: str  # the dequantized [K, N] initializer the MatMul reads
    initializers: tuple[str, ...]  # where it was stored: B, scales (, zero_points)
    bits: int
    block_size: int  # weights per scale, along K
    symmetric: bool  # no zero points, or all of them 2^(bits-1)
    scale_dtype: str  # numpy's name: float32, float16 or bfloat16 (float16 for float32 scales that are all fp16 values)
    K: int
    N: int
    block_dtype: str = ""  # 4-bit with zero points: the type of the int4a scales and mins its values are exact in


@dataclass(frozen=True)
class SourceQuantization(ModelFact):
    """The fact that (some of) the model's weights came block-quantized, and how (see the module doc); `of`: None
    where its weights came in floats."""

    KEY: ClassVar[str] = SOURCE_QUANTIZATION
    weights: tuple[QuantizedWeight, ...]
    op: str = "com.microsoft.MatMulNBits"

    @classmethod
    def from_json(cls, data: dict) -> "SourceQuantization":
        fields = dict(data)
        weights = tuple(QuantizedWeight(**{**w, "initializers": tuple(w["initializers"])}) for w in fields.pop("weights"))
        return cls(weights=weights, **fields)

    def describe(self) -> str:
        """One line: how many weights, and their recipes."""
        recipes: dict[tuple, int] = {}
        for w in self.weights:
            key = (w.bits, w.block_size, w.symmetric, w.scale_dtype)
            recipes[key] = recipes.get(key, 0) + 1
        parts = [f"{count} {bits}-bit, block {block}, {'symmetric' if symmetric else 'with zero points'}, "
                 f"{scale} scales" for (bits, block, symmetric, scale), count in recipes.items()]
        return f"{len(self.weights)} {self.op} weights dequantized to float32 MatMuls ({'; '.join(parts)})"


def _nbits_refusal(node: ir.Node, reason: str) -> UserError:
    return UserError(f"MatMulNBits node {node.name or '(unnamed)'}: {reason}")


def _nbits_constant(node: ir.Node, index: int) -> np.ndarray | None:
    """Input `index` of a MatMulNBits as an array (None where absent); refused where it is computed."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        return None
    if value.const_value is None:
        raise _nbits_refusal(node, f"its {NBITS_INPUTS[index]} ({value.name}) is not a constant: picompile needs "
                                   "the quantized weights stored in the model")
    return value.const_value.numpy()


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint8 bytes [..., n] holding `bits`-bit codes low bits first -> the first `count` codes [..., count]."""
    if bits == 8:
        return packed[..., :count].astype(np.float32)
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count].astype(np.float32)


def _read_matmul_nbits(node: ir.Node) -> dict:
    """Check one MatMulNBits against what can be honoured; its arrays and facts, not yet dequantized."""
    unknown = sorted(set(node.attributes) - NBITS_ATTRIBUTES)
    if unknown:
        raise _nbits_refusal(node, f"attribute {', '.join(unknown)} is unknown to picompile (it knows "
                                   f"{', '.join(sorted(NBITS_ATTRIBUTES))})")
    missing = [name for name in ("K", "N", "block_size") if name not in node.attributes]
    if missing:
        raise _nbits_refusal(node, f"required attribute {', '.join(missing)} is missing")
    K, N, block = (int(pir.attr(node, name)) for name in ("K", "N", "block_size"))
    bits = int(pir.attr(node, "bits", 4))
    if bits not in NBITS_BITS:
        raise _nbits_refusal(node, f"its weights are {bits}-bit; picompile takes 4- and 8-bit MatMulNBits weights")
    if int(pir.attr(node, "weight_prepacked", 0)):
        raise _nbits_refusal(node, f"its B is prepacked in an execution provider's layout (weight_prepacked="
                                   f"{pir.attr(node, 'weight_prepacked')}); picompile reads the standard packing only")
    if K <= 0 or N <= 0 or block < 16 or block & (block - 1):
        raise _nbits_refusal(node, f"K={K}, N={N}, block_size={block}: K and N must be positive and block_size a "
                                   "power of two of at least 16")
    if len(node.inputs) > len(NBITS_INPUTS):
        raise _nbits_refusal(node, f"it has {len(node.inputs)} inputs; MatMulNBits has at most {len(NBITS_INPUTS)}")
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        raise _nbits_refusal(node, "it has a g_idx input (act-order column groups, deprecated in onnxruntime), "
                                   "which picompile does not support")
    if len(node.inputs) < 3 or node.inputs[0] is None or node.inputs[1] is None or node.inputs[2] is None:
        raise _nbits_refusal(node, "it lacks one of its inputs A, B and scales")
    B, scales, zero_points, bias = (_nbits_constant(node, i) for i in (1, 2, 3, 5))
    blocks, blob = -(-K // block), block * bits // 8
    if B.dtype != np.uint8 or (B.size and tuple(B.shape) != (N, blocks, blob)):
        raise _nbits_refusal(node, f"its B is {B.dtype} {list(B.shape)}; K={K}, N={N}, bits={bits}, "
                                   f"block_size={block} make it uint8 {[N, blocks, blob]}")
    if (scales.dtype.kind != "f" and str(scales.dtype) != "bfloat16") or (B.size and scales.size != N * blocks):
        raise _nbits_refusal(node, f"its scales are {scales.dtype} {list(scales.shape)}; they must be floats, "
                                   f"{N} x {blocks} of them")
    midpoint = float(1 << (bits - 1))
    if zero_points is None:
        points = None
    elif zero_points.dtype == np.uint8:
        per_row = -(-blocks * bits // 8)
        if zero_points.size != N * per_row:
            raise _nbits_refusal(node, f"its packed zero_points have {zero_points.size} bytes; {N} x {per_row} expected")
        points = _unpack(zero_points.reshape(N, per_row), bits, blocks)
    else:
        if zero_points.size != N * blocks:
            raise _nbits_refusal(node, f"its zero_points have {zero_points.size} values; {N} x {blocks} expected")
        points = zero_points.astype(np.float32).reshape(N, blocks)
    if bias is not None and bias.size != N:
        raise _nbits_refusal(node, f"its bias has {bias.size} values; N={N} expected")
    sources = tuple(v.name for v in node.inputs[1:4] if v is not None)
    symmetric = points is None or bool(np.all(points == midpoint))
    return dict(node=node, K=K, N=N, bits=bits, block=block, B=B, scales=scales, points=points, midpoint=midpoint,
                fact=dict(node=node.name, initializers=sources, bits=bits, block_size=block, symmetric=symmetric,
                          scale_dtype=_scale_dtype(scales), K=K, N=N))


def _scale_dtype(scales: np.ndarray) -> str:
    """The scales' dtype, float16 where float32 scales all hold float16 values (a GGUF file's fp16 scales come
    as float32, MatMulNBits' scale type for float32 inputs): the narrowest type that stores them exactly."""
    if scales.dtype == np.float32 and np.array_equal(scales.astype(np.float16).astype(np.float32), scales):
        return "float16"
    return str(scales.dtype)


def _dequantize(read: dict) -> tuple[np.ndarray, str]:
    """The float32 [K, N] weight a MatMulNBits stands for, (q - zero_point) x scale per block along K, and "";
    with 4-bit zero points int4a's values d q + m instead, and the type of d and m (`_asymmetric_blocks`)."""
    K, N, B = read["K"], read["N"], read["B"]
    if not B.size:  # the schema's omitted projection: every weight 0
        return np.zeros((K, N), np.float32), ""
    blocks = B.shape[1]
    codes = _unpack(B, read["bits"], read["block"])  # [N, blocks, block]
    if read["bits"] == 4 and not read["fact"]["symmetric"]:
        d, m, dtype = _asymmetric_blocks(read["scales"].reshape(N, blocks), read["points"])
        weight = dequantize_blocks(codes.reshape(N, -1), d, 1, m)[:, :K]
        return np.ascontiguousarray(weight.T), dtype
    points = read["midpoint"] if read["points"] is None else read["points"][..., None]
    scales = read["scales"].astype(np.float32).reshape(N, blocks, 1)
    weight = ((codes - np.float32(points)) * scales).reshape(N, blocks * read["block"])[:, :K]
    return np.ascontiguousarray(weight.T), ""


MIN_TOLERANCE = 2.0 ** -22  # relative: an fp16 min within 4 fp32 rounding steps of -scale x zero point is it


def _asymmetric_blocks(scales: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """(d, m, their type) of blocks with zero points: d = scale, m = -scale x zero point, in float16 where the
    scales are fp16 values and each m is within MIN_TOLERANCE of one (so stored in fp16 they are the values),
    else in float32."""
    d64 = scales.astype(np.float64)
    with np.errstate(invalid="ignore"):  # (a zero scale's block is 0 whatever its zero point)
        m64 = np.where(d64 == 0, 0.0, -(d64 * points.astype(np.float64)))
    d16, m16 = d64.astype(np.float16), m64.astype(np.float16)
    if np.array_equal(d16.astype(np.float64), d64, equal_nan=True) and np.all(
            np.abs(m16.astype(np.float64) - m64) <= MIN_TOLERANCE * np.abs(m64)):
        return d16, m16, "float16"
    return d64.astype(np.float32), m64.astype(np.float32), "float32"


def dequantize_matmul_nbits(model: ir.Model, ctx: Context) -> SourceQuantization | None:
    """Replace each MatMulNBits with a MatMul over its dequantized weight (+ Add of its bias), drop the
    quantized initializers, and attach the SourceQuantization fact; None where the model has none."""
    graph = model.graph
    nodes = [n for n in graph if n.op_type == "MatMulNBits" and n.domain == NBITS_DOMAIN]
    if not nodes:
        return None
    reads = [_read_matmul_nbits(node) for node in nodes]  # refuse before anything is allocated
    added = sum(4 * r["K"] * r["N"] for r in reads)
    path = source_file(model)
    check_memory(f"{path or 'the model'} (its {len(nodes)} MatMulNBits weights dequantized to float32)",
                 weight_bytes(graph) + added)
    taken = set(graph.initializers) | {v.name for n in graph for v in n.outputs}
    facts, block_dtypes = [], []
    for read in reads:
        node = read["node"]
        name = f"{node.inputs[1].name}.dequantized"
        while name in taken:
            name += "_"
        taken.add(name)
        array, block_dtype = _dequantize(read)
        weight = pir.initializer(graph, name, array)
        if block_dtype:
            block_dtypes.append(block_dtype)
        output = node.outputs[0]
        matmul = ir.node("MatMul", [node.inputs[0], weight], name=node.name)
        new_nodes, result = [matmul], matmul.outputs[0]
        bias = node.inputs[5] if len(node.inputs) > 5 else None
        if bias is not None:
            result.name = f"{output.name}/matmul"
            new_nodes.append(ir.node("Add", [result, bias], name=f"{node.name}/bias"))
            result = new_nodes[-1].outputs[0]
        quantized = [v for v in node.inputs[1:5] if v is not None]
        ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [output], [result])
        for value in quantized:  # B, scales, zero points: read by no one now
            if value.is_initializer() and not value.uses():
                graph.initializers.pop(value.name)
        facts.append(QuantizedWeight(weight=name, **read["fact"], block_dtype=block_dtype))
    fact = SourceQuantization(tuple(facts))
    fact.attach(model)
    ctx.log(f"import: {fact.describe()}")
    if block_dtypes:
        wide = block_dtypes.count("float32")
        ctx.log(f"import: {len(block_dtypes)} 4-bit weights with zero points written as int4a blocks (x = d q + m, "
                "m = -scale x zero point): " + (f"{wide} need float32 scales or mins (fp16 ones would change their "
                                                 "values): the build stores float32 ones, 0.75 bytes a weight"
                                                 if wide else "fp16 scales and mins, exact"))
    return fact


def _fold_constants(model: ir.Model) -> None:
    try:
        with _quiet("onnxscript"):  # failed folds of a node are warnings; the node just stays unfolded
            onnxscript.optimizer.optimize(model, num_iterations=2)
    except Exception as error:
        reason = first_line(error)
        raise UserError(f"constant folding failed on this model: {type(error).__name__}: {reason}") from None


@dataclass
class Import:
    name = "import"
    fold_constants: bool = True  # onnxscript's optimizer: constant subgraphs folded, exporters' patterns simplified

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        graph = model.graph
        _check_nodes(model)
        _check_references(graph)
        _sort(graph)
        check_decoder(graph)
        _check_weights_are_constants(graph)
        if weight_bytes(graph) <= pir.EXTERNAL_DATA_BYTES:
            # weights in external data files (as small models may be saved too) are read in now, while no
            # array views of the memory map exist, so that the source graph saves as one file when profiled
            ir.external_data.load_to_model(model)
        # before the fp32 widening, which would hide the scales' dtype the fact records
        dequantize_matmul_nbits(model, ctx)
        for value in graph.inputs:
            if value.shape is not None and len(value.shape) > 0 and not isinstance(value.shape[0], int):
                value.shape = ir.Shape([1, *value.shape[1:]])
        if self.fold_constants:
            _fold_constants(model)
        # after folding, which would fold the Casts in front of half-precision weights into fp32 copies
        kept, widened = compute_in_fp32(graph)
        if kept or widened:
            ctx.log(f"import: {kept} fp16/bf16 matrices kept in their precision, {widened} small tensors widened; "
                    "computing in fp32")
        return PassResult(model, modified=True)
