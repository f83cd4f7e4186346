"""import: load the user's ONNX decoder, fix batch to 1, compute in fp32, fold constants and infer shapes.

Reads: a path (the pass's argument), not an IR; weights may live in external data files beside it (models
over 2 GB; read into memory when they total under `picompile.ir.EXTERNAL_DATA_BYTES`). Adds: the IR itself,
with every graph input's batch dimension fixed to 1, fp16 / bf16 tensors, casts and inputs made fp32 (the
compiler computes in fp32; `--weight-dtype` decides how weights are stored later, so a half-precision model
keeps its rounded weight values exactly), and constant subgraphs folded (onnxscript's optimizer), so that
the recognise pass sees weights as initializers whatever exporter made the graph. Sequence and past
lengths stay symbolic.
Refuses, naming the node or value: files that are not ONNX, graphs with dangling references or missing
external data, models that are not decoders with a KV cache (CNNs, encoders), weights fed as graph
inputs, and models whose weights need more memory than the machine has available.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.errors import UserError
from picompile.pipeline import Context
from picompile.sizes import weight_bytes
from picompile.targets import format_size
from runtime.artifact import available_memory_bytes, first_line

REQUIRED_INPUTS = ("input_ids",)
REQUIRED_OUTPUTS = ("logits",)
# Graph inputs a decoder export may have besides its weights (optimum's names).
DECODER_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "cache_position")
# Ops whose second input is a weight: a graph input there means weights are fed at run time.
WEIGHT_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Gather"}
# Build memory = BASE + WORKING_FACTOR x weight bytes. Measured (sparse builds with --calib, `/usr/bin/time -v
# python -m picompile build ...`, 2026-11-29): opt-small, 0.42 GiB of weights, peak RSS 2.86 GiB (0.47 GiB of
# it the imports: python, torch, TVM, onnxruntime), i.e. 5.8x; opt-1b, 3.26 GiB of weights, peak 12.8 GiB,
# 3.9x. Part of the working set (profiled activations, predictor training) grows with layers x width, slower
# than the weights, so the factor is the large model's: a refusal must only stop builds that cannot fit.
WORKING_FACTOR = 4.0
BASE_BYTES = 512 << 20


def check_memory(what: str, weights: int) -> None:
    """Refuse up front a build whose `weights` (bytes) cannot fit in memory, rather than swap or be killed."""
    needed = int(weights * WORKING_FACTOR) + BASE_BYTES
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise UserError(f"{what} needs about {format_size(needed)} of memory to build ({format_size(weights)} "
                        f"of weights x {WORKING_FACTOR:g} + {format_size(BASE_BYTES)}) but only {format_size(available)} "
                        "is available; free memory or build on a larger machine")


HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
FILE = "picompile.file"  # a loaded model's `meta` entry: the path `load` read it from


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


def load(path: Path, for_build: bool = True) -> ir.Model:
    """The model at `path`, its weights checked readable; a build (`for_build`) first checks that the machine
    has the memory to compile it (eval's reference only has to be read)."""
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


@dataclass
class Import:
    name = "import"

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
        widened = compute_in_fp32(graph)
        if widened:
            ctx.log(f"import: {widened} fp16/bf16 tensors widened to fp32")
        for value in graph.inputs:
            if value.shape is not None and len(value.shape) > 0 and not isinstance(value.shape[0], int):
                value.shape = ir.Shape([1, *value.shape[1:]])
        try:
            with _quiet("onnxscript"):  # failed folds of a node are warnings; the node just stays unfolded
                onnxscript.optimizer.optimize(model, num_iterations=2)
        except Exception as error:
            reason = first_line(error)
            raise UserError(f"constant folding failed on this model: {type(error).__name__}: {reason}") from None
        return PassResult(model, modified=True)
