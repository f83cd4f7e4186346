"""The IR: an ONNX model held as an `onnx_ir.Model`, with picompile's own ops in the `picompile` domain.

Every stage of the pipeline is a valid ONNX model, so each dump opens in any ONNX viewer. Facts a pass
adds (layer numbers, placement, the sparsity mode, kernel names) ride on node attributes, initializers and
the model's `metadata_props`, never on the side. The few too large to serialise ride on the in-memory IR,
`model.meta` (never saved), each as one typed object with its accessor beside the pass that adds it:
the source model recognise lifted the graph from (`passes.recognise.source_model`) and the profiled
activations (`passes.profile.ProfiledActivations`). `passes.facts` has the base of both kinds of fact.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from .sizes import weight_bytes

DOMAIN = "picompile"
DOMAIN_VERSION = 1
ONNX_OPSET = 23  # RMSNormalization is a standard op from opset 23 on
EXTERNAL_DATA_BYTES = 1_500_000_000  # weights past this go beside the .onnx (protobuf stops at 2 GB)
INLINE_TENSOR_BYTES = 1024  # smaller tensors stay in the .onnx even then (shape inference reads shape inputs)


def initializer(graph: ir.Graph, name: str, array) -> ir.Value:
    """Add a constant tensor to the graph and return its value (a file's blocks, `FileMatrix`, stay as they are)."""
    from .file_blocks import FileMatrix, FileTensor

    tensor = FileTensor(array, name=name) if isinstance(array, FileMatrix) else ir.tensor(np.ascontiguousarray(array),
                                                                                           name=name)
    value = ir.val(name, const_value=tensor)
    graph.register_initializer(value)
    return value


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The numpy array of a constant value (initializer or folded constant), else None. A half-precision
    matrix the import pass keeps behind a Cast to fp32 reads as the stored fp16 / bf16 array (`weight_array`)."""
    if value is None:
        return None
    if value.const_value is None:
        node = value.producer()
        if (node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx")
                or attr(node, "to") != ir.DataType.FLOAT or node.inputs[0] is None
                or node.inputs[0].const_value is None or node.inputs[0].const_value.dtype not in HALF_TYPES):
            return None
        value = node.inputs[0]
    return value.const_value.numpy()


HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
HALF_ARRAYS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def const_matrix(value: ir.Value | None):
    """A constant weight as the front end gave it: a `FileMatrix` where it is a file's blocks (the lift keeps
    them so), else `const_array`'s array."""
    from .file_blocks import FileTensor

    if value is not None and isinstance(value.const_value, FileTensor):
        return value.const_value.matrix
    return const_array(value)


def weight_array(array):
    """A weight as the compiler holds it: fp16 and bf16 as stored (half the memory of fp32), a file's blocks
    (`FileMatrix`) as they are, any other dtype as float32. A pass that computes with it widens it
    (`np.asarray(w, np.float32)`) for the part it works on."""
    from .file_blocks import FileMatrix

    if isinstance(array, FileMatrix):
        return array
    array = np.asarray(array)
    return array if array.dtype in HALF_ARRAYS else np.asarray(array, np.float32)


def drop_unused_initializers(graph: ir.Graph) -> None:
    """Remove the constants no node reads any more (a pass folded or replaced them)."""
    consumed = {v.name for n in graph for v in n.inputs if v is not None}
    for name in [n for n in graph.initializers if n not in consumed]:
        graph.initializers.pop(name)


def attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def nodes_in_domain(model: ir.Model, op_type: str) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == DOMAIN and n.op_type == op_type]


def node_layers(graph: ir.Graph) -> dict[ir.Node, int | None]:
    """Each node's decoder layer: its `layer` attribute, else the lowest layer among the nodes that read it
    (a norm belongs to the block it feeds); None outside the layers (embedding, final norm, output layer)."""
    layers: dict[ir.Node, int | None] = {}
    for node in reversed(list(graph)):
        if "layer" in node.attributes:
            layers[node] = int(attr(node, "layer"))
            continue
        readers = [layers.get(user) for value in node.outputs for user in value.consumers()]
        known = [layer for layer in readers if layer is not None]
        layers[node] = min(known) if known else None
    return layers


EMBED, HEAD = "embed", "head"


def node_blocks(graph: ir.Graph) -> dict[ir.Node, int | str]:
    """Each node's placement block: EMBED for the `Embed` op (it gathers token rows, and positions for OPT), else
    its layer (`node_layers`), else HEAD (the final norm and output layer)."""
    layers = node_layers(graph)
    return {node: EMBED if node.domain == DOMAIN and node.op_type == "Embed" else
            HEAD if layers[node] is None else layers[node] for node in graph}


def release_mapped_pages(model: ir.Model) -> int:
    """Drop from this process's resident set the pages of every weight of `model` still memory-mapped from its
    external data file (and of every array that views one). They stay in the page cache and map back in when
    read again, so a big model's file is paged in by the pass that reads it and never held resident by the
    build. Returns the bytes released."""
    from .file_blocks import FileTensor

    released = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, FileTensor):  # a model file's blocks
            released += sum(part.release() for part in tensor.matrix.parts)
        elif isinstance(tensor, ir.ExternalTensor) and tensor.raw is not None and tensor.nbytes:
            begin = (tensor.offset or 0) // mmap.PAGESIZE * mmap.PAGESIZE
            end = min((tensor.offset or 0) + tensor.nbytes, len(tensor.raw))
            tensor.raw.madvise(mmap.MADV_DONTNEED, begin, end - begin)
            released += end - begin
    return released


def save(model: ir.Model, path: Path) -> None:
    """Write the model as one .onnx file, with weights beside it (`.onnx.data`) past protobuf's 2 GB limit.
    Weights are written tensor by tensor (never joined in memory), and every one is copied, so the result never
    points back into the user's files; the model itself is left as it was (its tensors, memory maps included)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    initializers = [value for value in model.graph.initializers.values() if value.const_value is not None]
    originals = [value.const_value for value in initializers]
    try:
        external = weight_bytes(model.graph) > EXTERNAL_DATA_BYTES
        with open(path.with_name(path.name + ".data"), "wb") if external else contextlib.nullcontext() as data:
            for value, tensor in zip(initializers, originals):
                if external and tensor.nbytes >= INLINE_TENSOR_BYTES:
                    offset = data.tell()
                    data.write(tensor.tobytes())
                    value.const_value = ir.ExternalTensor(Path(data.name).name, offset, data.tell() - offset,
                                                          tensor.dtype, shape=tensor.shape, name=tensor.name,
                                                          base_dir=path.parent)
                elif isinstance(tensor, ir.ExternalTensor):  # else saved as a reference into its file
                    value.const_value = ir.tensor(np.array(tensor.numpy()), name=tensor.name)
        onnx.save(ir.to_proto(model), str(path))
    finally:
        for value, tensor in zip(initializers, originals):
            value.const_value = tensor


def to_text(model: ir.Model) -> str:
    """Readable text of the model without weight values (ONNX textual syntax)."""
    return ir.to_onnx_text(model, exclude_initializers=True)
