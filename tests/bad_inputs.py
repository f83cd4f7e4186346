"""A corpus of bad inputs, made on the fly from a tiny real export (nothing binary is committed).

Each model maker takes the path of a valid tiny decoder export (`base`) and a path to write, and writes
a damaged or unsuitable model there. The tests in test_bad_inputs.py feed them to `picompile build`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh


def _load(base: Path) -> onnx.ModelProto:
    return onnx.load(str(base))


def _node(model: onnx.ModelProto, op_type: str, contains: str = "layers.0") -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op_type and contains in n.name)


def _initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def empty(base: Path, path: Path) -> None:
    path.write_bytes(b"")


def random_bytes(base: Path, path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def truncated(base: Path, path: Path) -> None:
    data = base.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def broken_reference(base: Path, path: Path) -> None:
    """The first FFN's activation reads a value nothing produces."""
    model = _load(base)
    _node(model, "Relu").input[0] = "no_such_value"
    onnx.save(model, str(path))


def cycle(base: Path, path: Path) -> None:
    """Layer 0's fc1 reads fc2's output: a loop no evaluation order can satisfy."""
    model = _load(base)
    _node(model, "Gemm", "layers.0/fc1").input[0] = _node(model, "Gemm", "layers.0/fc2").output[0]
    onnx.save(model, str(path))


def ffn_weights_as_inputs(base: Path, path: Path) -> None:
    """fc1's weight is a graph input (fed at run time) instead of a constant initializer."""
    model = _load(base)
    gemm = _node(model, "Gemm", "layers.0/fc1")
    weight = _initializer(model, gemm.input[1])
    model.graph.input.append(oh.make_tensor_value_info(weight.name, weight.data_type, list(weight.dims)))
    model.graph.initializer.remove(weight)
    onnx.save(model, str(path))


def unsupported_activation(base: Path, path: Path) -> None:
    """The FFN activation is Tanh instead of ReLU."""
    model = _load(base)
    for node in model.graph.node:
        if node.op_type == "Relu":
            node.op_type = "Tanh"
    onnx.save(model, str(path))


def silu_ffn(base: Path, path: Path) -> None:
    """Every FFN's Relu becomes SiLU, x * Sigmoid(x): a model picompile lifts, but only builds densely."""
    model = _load(base)
    for node in [n for n in model.graph.node if n.op_type == "Relu"]:
        index = list(model.graph.node).index(node)
        x, y = node.input[0], node.output[0]
        sigmoid = oh.make_node("Sigmoid", [x], [f"{y}.sigmoid"], name=node.name.replace("Relu", "Sigmoid"))
        mul = oh.make_node("Mul", [x, f"{y}.sigmoid"], [y], name=node.name.replace("Relu", "SiLU"))
        model.graph.node.remove(node)
        model.graph.node.insert(index, mul)
        model.graph.node.insert(index, sigmoid)
    onnx.save(model, str(path))


def zero_width_ffn(base: Path, path: Path) -> None:
    """Layer 0's FFN has zero neurons: fc1 weight [0, d], bias [0], fc2 weight [d, 0] (consistent ONNX)."""
    model = _load(base)
    for name_part, shape in (("fc1.weight", lambda d: (0, d[1])), ("fc1.bias", lambda d: (0,)),
                             ("fc2.weight", lambda d: (d[0], 0))):
        tensor = next(t for t in model.graph.initializer if t.name.endswith(f"layers.0.{name_part}"))
        tensor.CopyFrom(onh.from_array(np.zeros(shape(list(tensor.dims)), np.float32), tensor.name))
    onnx.save(model, str(path))


def mismatched_ffn_shapes(base: Path, path: Path) -> None:
    """fc2 of layer 0 expects 100 inputs where fc1 gives 256 (an absurd, inconsistent shape)."""
    model = _load(base)
    tensor = next(t for t in model.graph.initializer if t.name.endswith("layers.0.fc2.weight"))
    tensor.CopyFrom(onh.from_array(np.zeros((tensor.dims[0], 100), np.float32), tensor.name))
    onnx.save(model, str(path))


def zero_layers(base: Path, path: Path) -> None:
    """A 'decoder' with an embedding, a final norm and an output layer but no transformer layers."""
    vocab, width = 16, 8
    rng = np.random.default_rng(0)
    inits = [onh.from_array(rng.standard_normal((vocab, width)).astype(np.float32), "embed"),
             onh.from_array(np.ones(width, np.float32), "norm.scale"),
             onh.from_array(np.zeros(width, np.float32), "norm.bias"),
             onh.from_array(rng.standard_normal((width, vocab)).astype(np.float32), "head")]
    nodes = [oh.make_node("Gather", ["embed", "input_ids"], ["h"]),
             oh.make_node("LayerNormalization", ["h", "norm.scale", "norm.bias"], ["hn"], axis=-1),
             oh.make_node("MatMul", ["hn", "head"], ["logits"])]
    graph = oh.make_graph(nodes, "no_layers", [oh.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, "seq"])],
                          [oh.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, "seq", vocab])], inits)
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]), str(path))


def _export(module, args, path: Path, input_names, output_names) -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=input_names, output_names=output_names,
                          dynamo=False, opset_version=18)


def cnn(base: Path, path: Path) -> None:
    """A small image classifier: Conv2d -> ReLU -> Linear."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(4 * 6 * 6, 10)).eval()
    _export(module, (torch.zeros(1, 3, 8, 8),), path, ["image"], ["logits"])


def encoder_only(base: Path, path: Path) -> None:
    """A tiny BERT masked-LM: input_ids in, logits out, but bidirectional attention and no KV cache."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    _export(BertForMaskedLM(config).eval(), (torch.zeros(1, 8, dtype=torch.long),), path, ["input_ids"], ["logits"])


MODELS = {
    "empty": (empty, ["empty"]),
    "random_bytes": (random_bytes, ["not a readable onnx model"]),
    "truncated": (truncated, ["onnx"]),
    "broken_reference": (broken_reference, ["no_such_value", "activation_fn/Relu"]),
    "cycle": (cycle, ["cycle", "fc1/Gemm", "fc2/Gemm"]),
    "ffn_weights_as_inputs": (ffn_weights_as_inputs, ["fc1", "graph input", "constant"]),
    "unsupported_activation": (unsupported_activation, ["Tanh", "activation"]),
    "zero_width_ffn": (zero_width_ffn, ["layer 0", "zero"]),
    "silu_ffn_predictor": (silu_ffn, ["layer 0", "silu", "activation_fn", "--dense", "--sparsity-mode threshold"]),
    "mismatched_ffn_shapes": (mismatched_ffn_shapes, ["fc2"]),
    "zero_layers": (zero_layers, ["no decoder layers"]),
    "cnn": (cnn, ["Conv", "not a decoder"]),
    "encoder_only": (encoder_only, ["encoder", "kv cache"]),
}


# ---- GGUF files: each maker writes a damaged or unsuitable GGUF at `path` (base: a valid tiny one's path)


def _gguf_patch(base: Path, path: Path, edit) -> None:
    """Copy `base` to `path` and let `edit(reader)` change header values in place (the reader's fields are
    views of the file, opened writable)."""
    import gguf

    path.write_bytes(base.read_bytes())
    reader = gguf.GGUFReader(str(path), "r+")
    edit(reader)
    reader.data.flush()
    del reader


def gguf_truncated(base: Path, path: Path) -> None:
    data = base.read_bytes()
    path.write_bytes(data[: len(data) - 5000])


def gguf_header_cut(base: Path, path: Path) -> None:
    path.write_bytes(base.read_bytes()[:300])


def gguf_wrong_magic(base: Path, path: Path) -> None:
    path.write_bytes(b"GGUG" + base.read_bytes()[4:])


def gguf_unknown_version(base: Path, path: Path) -> None:
    data = bytearray(base.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def gguf_missing_metadata(base: Path, path: Path) -> None:
    """llama.block_count renamed (same length): the key the layer count comes from is gone."""
    path.write_bytes(base.read_bytes().replace(b"llama.block_count", b"llama.block_coun_", 1))


def _tensor_part(reader, name: str, part: int):
    return next(t for t in reader.tensors if t.name == name).field.parts[part]


def gguf_unknown_type(base: Path, path: Path) -> None:
    """blk.0.attn_q.weight's type is 99, which no ggml knows."""
    def edit(reader):
        _tensor_part(reader, "blk.0.attn_q.weight", 4)[0] = 99
    _gguf_patch(base, path, edit)


def gguf_data_past_end(base: Path, path: Path) -> None:
    """output_norm.weight's data offset points past the end of the file."""
    def edit(reader):
        _tensor_part(reader, "output_norm.weight", 5)[0] = 1 << 30
    _gguf_patch(base, path, edit)


def _gguf_written(edit_tensors=None, **tiny):
    def make(base: Path, path: Path) -> None:
        import gguf_files

        gguf_files.write(path, gguf_files.Tiny(**tiny), edit=edit_tensors)
    return make


def _wrong_shape(tensors):
    array, kind = tensors["blk.1.ffn_up.weight"]
    tensors["blk.1.ffn_up.weight"] = (np.zeros((array.shape[0] // 2, array.shape[1]), array.dtype), kind)


GGUF_FILES = {
    "truncated": (gguf_truncated, ["truncated"]),
    "header_cut": (gguf_header_cut, ["truncated"]),
    "wrong_magic": (gguf_wrong_magic, ["not a gguf file", "GGUG"]),
    "unknown_version": (gguf_unknown_version, ["version 99"]),
    "unknown_type": (gguf_unknown_type, ["unknown ggml type", "99"]),
    "missing_metadata": (gguf_missing_metadata, ["llama.block_count", "missing"]),
    "data_past_end": (gguf_data_past_end, ["output_norm.weight", "past the end"]),
    "wrong_shape": (_gguf_written(_wrong_shape), ["blk.1.ffn_up.weight", "shape", "feed_forward_length"]),
    "missing_tensor": (_gguf_written(lambda tensors: tensors.pop("blk.1.attn_v.weight")),
                       ["blk.1.attn_v.weight", "missing"]),
    "extra_tensor": (_gguf_written(lambda tensors: tensors.update(
        {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 8), np.float32), __import__("gguf").GGMLQuantizationType.F32)})),
        ["blk.0.ffn_gate_exps.weight", "experts"]),
    "unknown_architecture": (_gguf_written(arch="mamba"), ["architecture", "mamba"]),
}


# Command-line flags a case needs besides `build MODEL -o OUT`.
MODEL_ARGS = {"silu_ffn_predictor": ["--sparsity-mode", "predictor"]}


def write_tokens(path: Path, kind: str) -> Path:
    """Bad token files: empty, ragged (an object array), 3-D, floats, out of vocabulary, negative."""
    if kind == "empty":
        path.write_text("")
    elif kind == "blank_lines":
        path.write_text("\n  \n\n")
    elif kind == "ragged":
        np.save(path, np.array([np.arange(5), np.arange(3)], dtype=object), allow_pickle=True)
    elif kind == "three_d":
        np.save(path, np.zeros((2, 2, 2), np.int64))
    elif kind == "floats":
        np.save(path, np.zeros((2, 4), np.float32))
    elif kind == "out_of_vocabulary":
        np.save(path, np.array([[1, 2, 100_000, 3]], np.int64))
    elif kind == "not_numbers":
        path.write_text("1 2 3\n4 five 6\n")
    else:
        raise ValueError(kind)
    return path
