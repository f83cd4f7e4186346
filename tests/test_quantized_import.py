"""Models quantized by onnxruntime (com.microsoft MatMulNBits) build: the import pass dequantizes them exactly
and records that they came quantized; what it cannot honour is refused in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from examples.models import matmul_weights_as_initializers, ort_quantize_nbits
from passes.import_onnx import SOURCE_QUANTIZATION, Import, SourceQuantization, load
from passes.kernels import quant
from picompile import ir as pir
from picompile.cli import main
from picompile.pipeline import Context
from picompile.reference import OrtDecoder
from picompile.targets import get_target
from runtime import Engine
from runtime.dtypes import WEIGHT_FORMATS
from test_cli_errors import assert_user_error

PROMPT = np.array([3, 14, 15, 92, 65], np.int64)


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """(bits, symmetric, accuracy_level) -> the tiny OPT quantized so by onnxruntime's quantizer (cached).
    accuracy_level None: onnxruntime's MatMulNBits computes in fp32, so it is an exact reference."""
    made = {}
    root = tmp_path_factory.mktemp("quantized")

    def get(bits=4, symmetric=True, accuracy_level=None):
        key = (bits, symmetric, accuracy_level)
        if key not in made:
            made[key] = ort_quantize_nbits(tiny_models("opt").onnx, root / f"q{bits}-{int(symmetric)}-{accuracy_level}.onnx",
                                           bits=bits, block_size=32, symmetric=symmetric, accuracy_level=accuracy_level)
        return made[key]

    return get


def nbits_nodes(proto) -> list:
    return [n for n in proto.graph.node if n.op_type == "MatMulNBits"]


def imported(path, logs=None):
    ctx = Context(get_target("cpu"), log=(logs.append if logs is not None else lambda message: None))
    return Import().apply(load(path), ctx).model


def logits_steps(engine, steps: int = 6) -> list[np.ndarray]:
    """Logits of a prompt then of `steps` greedy decode steps (fed the engine's own argmax)."""
    engine.reset()
    rows = [engine.forward(PROMPT)]
    for _ in range(steps):
        rows.append(engine.forward([int(np.argmax(rows[-1][-1]))]))
    return rows


def test_linear_layers_become_matmuls_of_initializers_for_the_quantizer():
    """A Gemm (transB, alpha, beta) becomes MatMul + Add over a [K, N] initializer and a tied head's
    Transpose is folded, with the same outputs in onnxruntime."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w, c, e = (rng.standard_normal(shape).astype(np.float32) for shape in ((8, 4), (8,), (16, 8)))
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5, beta=2.0),
         onnx.helper.make_node("Transpose", ["e"], ["et"], perm=[1, 0]),
         onnx.helper.make_node("MatMul", ["h", "et"], ["y"]),
         onnx.helper.make_node("Gather", ["e", "ids"], ["g"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4]),
         onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2])],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("y", "g")],
        [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (c, "c"), (e, "e"))])
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32), "ids": np.array([1, 5])}

    def run(model):
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    before = run(proto)
    assert matmul_weights_as_initializers(proto) == 2
    inits = {t.name for t in proto.graph.initializer}
    assert [n.op_type for n in proto.graph.node] == ["MatMul", "Add", "MatMul", "Gather"]
    assert all(n.input[1] in inits for n in proto.graph.node if n.op_type == "MatMul") and "w" not in inits
    for got, expected in zip(run(proto), before):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_an_ort_int4_model_builds_and_matches_onnxruntime(quantized, tmp_path, capsys):
    source = quantized()
    out = tmp_path / "q4.pic"
    assert main(["build", str(source), "--target", "cpu", "--dense", "-o", str(out), "--max-context", "64", "-v",
                 "--weight-dtype", "fp32"]) == 0
    log = capsys.readouterr().err
    assert "MatMulNBits weights dequantized" in log and "4-bit, block 32, symmetric" in log
    assert "warning: the model's weights came 4-bit quantized" in log and "--weight-dtype int4 keeps" in log
    ours, reference = logits_steps(Engine(out)), logits_steps(OrtDecoder(source))
    for got, expected in zip(ours, reference):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits,symmetric,zero_points", [(4, True, None), (4, False, "packed"), (4, False, "float"),
                                                        (8, True, None), (8, False, "packed")])
def test_import_dequantizes_exactly_and_records_the_quantization(quantized, tmp_path, bits, symmetric, zero_points):
    source = quantized(bits, symmetric)
    if zero_points == "float":  # the schema's other form: unpacked, in the scales' type (as HQQ writes them)
        proto = onnx.load(str(source))
        inits = {t.name: t for t in proto.graph.initializer}
        for node in nbits_nodes(proto):
            packed = numpy_helper.to_array(inits[node.input[3]])
            codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
            blocks = numpy_helper.to_array(inits[node.input[2]]).shape[1]
            inits[node.input[3]].CopyFrom(numpy_helper.from_array(codes[:, :blocks].astype(np.float32), node.input[3]))
        source = tmp_path / "float-zero-points.onnx"
        onnx.save(proto, str(source))
    nodes = nbits_nodes(onnx.load(str(source)))
    logs = []
    model = imported(source, logs)
    assert not [n for n in model.graph if n.op_type == "MatMulNBits"]
    fact = SourceQuantization.of(model)
    assert SOURCE_QUANTIZATION in model.metadata_props and fact.op == "com.microsoft.MatMulNBits"
    assert [w.node for w in fact.weights] == [n.name for n in nodes]
    assert {(w.bits, w.block_size, w.symmetric, w.scale_dtype) for w in fact.weights} == {(bits, 32, symmetric, "float32")}
    for w, node in zip(fact.weights, nodes):
        assert w.initializers == tuple(node.input[1:4] if not symmetric else node.input[1:3])
        assert w.weight in model.graph.initializers and not set(w.initializers) & set(model.graph.initializers)
        assert model.graph.initializers[w.weight].const_value.shape == (w.K, w.N)
    assert any("MatMulNBits" in line and f"{bits}-bit" in line for line in logs)
    # the dequantized graph runs in onnxruntime as the quantized one does (which computes in fp32 here)
    path = tmp_path / "imported.onnx"
    pir.save(model, path)
    ours, reference = logits_steps(OrtDecoder(path)), logits_steps(OrtDecoder(source))
    for got, expected in zip(ours, reference):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_default_weight_dtype_keeps_a_quantized_models_bits(quantized, bits):
    from passes.import_onnx import stored_weight_dtype

    assert stored_weight_dtype(load(quantized(bits))) == f"int{bits}"


def test_recognise_keeps_the_fact(quantized):
    from passes.recognise import Recognise

    model = imported(quantized())
    lifted = Recognise(max_context=64).apply(model, Context(get_target("cpu"))).model
    assert lifted.metadata_props[SOURCE_QUANTIZATION] == model.metadata_props[SOURCE_QUANTIZATION]


def test_int4_requantizes_to_the_same_q_and_scales(quantized):
    """picompile's int4 (Q4_0's rule) is MatMulNBits' symmetric rule: quantizing the dequantized weight again,
    in 32-blocks along K with float32 scales, gives back onnxruntime's codes and scales exactly."""
    source = quantized(4, True, accuracy_level=4)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(source)).graph.initializer}
    model = imported(source)
    fmt = dataclasses.replace(WEIGHT_FORMATS["int4"], scale_dtype="float32")
    for w in SourceQuantization.of(model).weights:
        packed, scales = inits[w.initializers[0]], inits[w.initializers[1]]  # [N, blocks, 16], [N, blocks]
        codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(w.N, -1).astype(np.int8) - 8  # [N, K]
        q, s = quant.quantize(pir.const_array(model.graph.initializers[w.weight]), fmt, axis=0)
        np.testing.assert_array_equal(q, codes.T)
        np.testing.assert_array_equal(s, scales.T)


def test_fp16_scales_requantize_to_picompile_int4_as_it_stores_it(tiny_models, tmp_path):
    """An fp16 model's MatMulNBits have fp16 scales, picompile's int4 default: its q and scales come back
    from the dequantized weight with no second rounding."""
    proto = onnx.load(str(tiny_models("opt").onnx))
    matmul_weights_as_initializers(proto)
    weights = {n.input[1] for n in proto.graph.node if n.op_type == "MatMul"}
    for tensor in proto.graph.initializer:  # only the weights: the import pass never runs this graph
        if tensor.name in weights:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    half = tmp_path / "fp16-weights.onnx"
    onnx.save(proto, str(half))
    source = ort_quantize_nbits(half, tmp_path / "q4-fp16.onnx", bits=4, block_size=32, symmetric=True)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(source)).graph.initializer}
    model = imported(source)
    fact = SourceQuantization.of(model)
    assert {w.scale_dtype for w in fact.weights} == {"float16"} and WEIGHT_FORMATS["int4"].scale_dtype == "float16"
    for w in fact.weights:
        packed, scales = inits[w.initializers[0]], inits[w.initializers[1]]
        codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(w.N, -1).astype(np.int8) - 8
        q, s = quant.quantize(pir.const_array(model.graph.initializers[w.weight]), WEIGHT_FORMATS["int4"], axis=0)
        np.testing.assert_array_equal(q, codes.T)
        np.testing.assert_array_equal(s, scales.T)


def _bits2(path, source):
    return ort_quantize_nbits(source, path, bits=2, block_size=32, symmetric=True, accuracy_level=None)


def _edited(edit):
    def make(path, source):
        proto = onnx.load(str(ort_quantize_nbits(source, path, bits=4, block_size=32, accuracy_level=None)))
        edit(proto, nbits_nodes(proto)[0])
        onnx.save(proto, str(path))
        return path
    return make


def _g_idx(proto, node):
    K = next(a.i for a in node.attribute if a.name == "K")
    proto.graph.initializer.append(numpy_helper.from_array(np.arange(K, dtype=np.int32) // 32, "g_idx"))
    node.input.extend(["", "g_idx"])


@pytest.mark.parametrize("make,words", [
    (_bits2, ["MatMulNBits node", "2-bit"]),
    (_edited(_g_idx), ["MatMulNBits node", "g_idx"]),
    (_edited(lambda proto, node: node.attribute.append(onnx.helper.make_attribute("weight_prepacked", 1))),
     ["MatMulNBits node", "prepacked"]),
    (_edited(lambda proto, node: node.attribute.append(onnx.helper.make_attribute("transpose_b", 1))),
     ["MatMulNBits node", "transpose_b", "unknown"]),
])
def test_matmul_nbits_that_cannot_be_honoured_is_refused(tiny_models, tmp_path, capsys, make, words):
    path = make(tmp_path / "model.onnx", tiny_models("opt").onnx)
    out = tmp_path / "out.pic"
    code = main(["build", str(path), "--target", "cpu", "--dense", "-o", str(out)])
    assert_user_error(code, capsys.readouterr().err, *words)
    assert not out.exists()
