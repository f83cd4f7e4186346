"""Models quantized by onnxruntime (com.microsoft MatMulNBits) build: the import pass dequantizes them exactly
and records that they came quantized; what it cannot honour is refused in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from examples.models import matmul_weights_as_initializers, ort_quantize_nbits
from passes.import_onnx import SOURCE_QUANTIZATION, Import, SourceQuantization
from passes.front_end import load
from passes.kernels import quant
from passes import ir as pir
from picompile.cli import main
from passes.pipeline import Context, Options
from passes.reference import OrtDecoder
from passes.targets import get_target
from runtime import Engine, load_manifest
from runtime.dtypes import WEIGHT_FORMATS
from test_cli_errors import assert_user_error

PROMPT = np.array([3, 14, 15, 92, 65], np.int64)


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """(bits, symmetric, accuracy_level) -> the tiny OPT quantized so by onnxruntime's quantizer (cached).
    accuracy_level None: onnxruntime's MatMulNBits computes in fp32, so it is an exact reference."""
    made = {}
    root = tmp_path_factory.mktemp("quantized")

    def get(bits=4, symmetric=True, accuracy_level=None, block_size=32):
        key = (bits, symmetric, accuracy_level, block_size)
        if key not in made:
            made[key] = ort_quantize_nbits(tiny_models("opt").onnx,
                                           root / f"q{bits}-{int(symmetric)}-{accuracy_level}-{block_size}.onnx",
                                           bits=bits, block_size=block_size, symmetric=symmetric,
                                           accuracy_level=accuracy_level)
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
    lifted = Recognise().apply(model, Context(get_target("cpu"), options=Options(max_context=64))).model
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


def _asymmetric_sources(path, mins_from=None):
    """(node, codes [N, K], scales [N, blocks], zero points [N, blocks]) of every 4-bit MatMulNBits of the ONNX at
    `path` (zero points unpacked to floats)."""
    proto = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    out = []
    for node in nbits_nodes(proto):
        packed, scales = inits[node.input[1]], inits[node.input[2]]
        N = packed.shape[0]
        codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(N, -1)
        points = inits[node.input[3]]
        if points.dtype == np.uint8:
            points = np.stack([points & 0xF, points >> 4], -1).reshape(N, -1)[:, :scales.shape[1]]
        out.append((node, codes, scales.reshape(N, -1), points.reshape(N, -1).astype(np.float32)))
    return out


def q4_1_zero_points(tmp_path, source):
    """The ORT-quantized asymmetric model with its blocks made Q4_1's (what a GGUF front end writes): fp16 scales
    d and fp16 minimums m that are no multiple of d, as float32 scales d and float32 zero points -m / d (the
    schema's float form). Returns (path, {node name: (d, m) fp16 [N, blocks]})."""
    proto = onnx.load(str(source))
    inits = {t.name: t for t in proto.graph.initializer}
    rng, blocks = np.random.default_rng(3), {}
    for node, _, scales, points in _asymmetric_sources(source):
        d = scales.astype(np.float16)
        m = (-(d.astype(np.float32) * points) * rng.uniform(0.9, 1.1, points.shape)).astype(np.float16)
        m[d == 0] = 0  # (a zero scale's block is 0: its minimum has no zero point -m / d)
        inits[node.input[2]].CopyFrom(numpy_helper.from_array(d.astype(np.float32), node.input[2]))
        with np.errstate(invalid="ignore"):
            z = np.where(d == 0, 0, -m.astype(np.float32) / d.astype(np.float32)).astype(np.float32)
        inits[node.input[3]].CopyFrom(numpy_helper.from_array(z, node.input[3]))
        blocks[node.name] = (d, m)
    path = tmp_path / "q4_1.onnx"
    onnx.save(proto, str(path))
    return path, blocks


@pytest.mark.parametrize("block_size", [32, 64])
def test_zero_points_import_as_int4a_blocks_that_give_back_the_models_q_d_and_m(quantized, tmp_path, block_size):
    """The contract with a GGUF front end: a 4-bit MatMulNBits with zero points imports as int4a's values, from
    which the quantize pass's exact rounding recovers the model's codes, scales and minimums bit for bit: fp16
    ones from Q4_1 blocks written as float32 d and -m / d; float32 ones (m = -scale x zero point) from
    onnxruntime's quantizer, whose scales are no fp16 values. Blocks of 64 are two of int4a's with one d and m
    (found from the pair: a half whose codes miss 0 or 15 still gets them)."""
    source = quantized(4, False, block_size=block_size)
    gguf_like, q4_1 = q4_1_zero_points(tmp_path, source)
    group = block_size // 32
    for path, block_dtype in ((gguf_like, "float16"), (source, "float32")):
        logs = []
        model = imported(path, logs)
        fact = SourceQuantization.of(model)
        assert {w.block_dtype for w in fact.weights} == {block_dtype}
        assert any("int4a blocks" in line for line in logs)
        fmt = dataclasses.replace(WEIGHT_FORMATS["int4a"], scale_dtype=block_dtype)
        for (node, codes, scales, points), w in zip(_asymmetric_sources(path), fact.weights):
            q, d, m, missed, foreign = quant.quantize_asymmetric(
                pir.const_array(model.graph.initializers[w.weight]), fmt, axis=0, exact=True, group=group)
            assert missed == foreign == 0
            np.testing.assert_array_equal(q, codes.T)
            want_d, want_m = q4_1[node.name] if block_dtype == "float16" else (
                scales, (-(scales.astype(np.float64) * points)).astype(np.float32))
            np.testing.assert_array_equal(d, np.repeat(want_d, group, axis=1).T)
            np.testing.assert_array_equal(m, np.repeat(want_m, group, axis=1).T)
    assert stored_weight_dtype_of(gguf_like) == "int4a" and stored_weight_dtype_of(source) == "int4a"


def stored_weight_dtype_of(path):
    from passes.import_onnx import stored_weight_dtype

    return stored_weight_dtype(load(path))


def test_an_ort_model_with_zero_points_builds_in_int4a_and_matches_onnxruntime(quantized, tmp_path, capsys):
    """--weight-dtype auto keeps a zero-point model's blocks (int4a, nothing re-rounded), and its logits are
    onnxruntime's on the same ONNX within int8 activations' rounding (the default), prompt and decode steps."""
    source = quantized(4, False)
    out = tmp_path / "q4a.pic"
    assert main(["build", str(source), "--target", "cpu", "--dense", "-o", str(out), "--max-context", "64",
                 "-v"]) == 0
    log = capsys.readouterr().err
    assert "weight dtype int4a" in log and "the model's own blocks kept exactly" in log
    quantization = load_manifest(out).quantization
    assert quantization.format == "int4a" and quantization.source_blocks_rerounded == 0
    ours, reference = logits_steps(Engine(out)), logits_steps(OrtDecoder(source))
    for got, expected in zip(ours, reference):
        assert np.abs(got - expected).max() < 5e-2 * expected.std()
