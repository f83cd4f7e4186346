"""Threshold sparsity over quantized weights and attention inputs: the column-sparse kernel over quantized rows
(neuron.sparse_columns_q: int8, int4 and int4a, fp16 and fp32 scales, decode and batch, bias, GLU and residual
epilogues) against numpy, and tiny SwiGLU builds whose thresholded matrices are quantized, whose attention
inputs are thresholded, and whose FFNs mix dense and sparse projections, against a numpy reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron, quant
from passes.targets import CPU_ISAS
from runtime.artifact import load_manifest
from runtime.dtypes import WEIGHT_FORMATS
from kernel_reference import aligned

K, N, BATCH = 40, 128, 3  # K input channels (no multiple of the row group), N = 4 blocks (gated: 2 a half)
ACT = {"none": lambda v: v, "silu": lambda v: v / (1 + np.exp(-v))}
QUANT_COLUMNS = {  # name -> (format, scale dtype, gated, act, bias, residual, rows)
    "int8_plain": ("int8", "float16", False, "none", False, False, 1),
    "int8_gated_silu_bias": ("int8", "float32", True, "silu", True, False, 1),
    "int4_residual_bias": ("int4", "float16", False, "none", True, True, 1),
    "int4_gated_silu": ("int4", "float32", True, "silu", False, False, 1),
    "int4a_gated_silu": ("int4a", "float16", True, "silu", False, False, 1),
    "int4a_residual": ("int4a", "float32", False, "none", False, True, 1),
    "int4_gated_silu_batch": ("int4", "float16", True, "silu", False, False, None),
    "int4a_residual_batch": ("int4a", "float16", False, "none", True, True, None),
    "int8_batch": ("int8", "float32", False, "none", False, False, None),
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select_abs", K, rows=1, magnitude=True),
             neuron.sparse_columns("f32_residual", K, N, rows=1, residual=True, bias=True)]
    for name, (fmt, sdtype, gated, act, bias, residual, rows) in QUANT_COLUMNS.items():
        f = WEIGHT_FORMATS[fmt]
        funcs.append(neuron.sparse_columns_q(name, K, N, rows=rows, bits=f.bits, sdtype=sdtype, has_min=f.has_min,
                                             gated=gated, act=act, bias=bias, residual=residual,
                                             max_batch=BATCH if rows is None else 1))
    path = tmp_path_factory.mktemp("threshold-quant") / "kernels.so"
    cpu.build(funcs, CPU_ISAS["avx2"].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *arrays):
    lib[name](*[tvm_ffi.from_dlpack(a) for a in arrays])


def selected(lib, x, threshold):
    """select_abs over the union of x's rows (one row at a time, as the union is what a batch step selects)."""
    index, count = aligned(np.full((1, K), -7, np.int32)), aligned(np.full((1, 1), -7, np.int32))
    union = np.abs(x).max(axis=0, keepdims=True).astype(np.float32)
    call(lib, "select_abs", aligned(union), aligned(np.array([threshold], np.float32)), index, count)
    kept = np.nonzero(union[0] > threshold)[0]
    assert int(count[0, 0]) == len(kept) and np.array_equal(index[0, :len(kept)], kept)
    return index, count, kept


@pytest.mark.parametrize("threshold", [np.inf, 0.7, -1.0])  # no channel kept, some, every one
@pytest.mark.parametrize("kernel", sorted(QUANT_COLUMNS))
def test_column_sparse_gemv_over_quantized_rows(lib, kernel, threshold):
    fmt_name, sdtype, gated, act, bias, residual, rows = QUANT_COLUMNS[kernel]
    fmt = replace(WEIGHT_FORMATS[fmt_name], scale_dtype=sdtype)
    rng = np.random.default_rng(3)
    m = BATCH if rows is None else 1
    out = N // 2 if gated else N
    x = aligned(rng.standard_normal((m, K)).astype(np.float32))
    index, count, kept = selected(lib, x, min(threshold, 3e38))
    w = rng.standard_normal((K, N)).astype(np.float32) + (0.3 if fmt.has_min else 0)  # (mins away from 0)
    q, scales, *mins = quant.quantize(w, fmt, axis=1)
    values, packed_scales = quant.pack_rows(q, scales, fmt, *mins)
    w_stored = quant.dequantize(q, scales, 1, *mins).astype(np.float64)
    b = aligned(rng.standard_normal(N).astype(np.float32))
    res = aligned(rng.standard_normal((m, out)).astype(np.float32))
    scratch = aligned(np.full((neuron.COLUMN_TASKS, BATCH * N if rows is None else N), 5.0, np.float32))
    y = aligned(np.full((m, out), 99.0, np.float32))
    call(lib, kernel, x, index, count, aligned(values), aligned(packed_scales), *([b] if bias else []),
         *([res] if residual else []), scratch, y)
    pre = x[:, kept].astype(np.float64) @ w_stored[kept] + (b if bias else 0)  # the union's rows, each row's x
    actf = ACT[act]
    expected = actf(pre[:, :out]) * pre[:, out:] if gated else actf(pre)
    expected = expected + (res if residual else 0)
    np.testing.assert_allclose(y, expected, atol=2e-4 * max(1.0, np.abs(expected).max()), rtol=1e-4)


@pytest.mark.parametrize("count", [-5, 7, K + 9])
def test_column_sparse_gemv_over_quantized_rows_clamps_counts_and_indices(lib, count):
    """A wrong count or index (however select went wrong) reads no row outside the weight: counts are clamped
    to [0, K], indices to [0, K - 1]."""
    fmt = WEIGHT_FORMATS["int4"]
    rng = np.random.default_rng(5)
    x = aligned(rng.standard_normal((1, K)).astype(np.float32))
    idx = rng.integers(-50, K + 50, size=(1, K)).astype(np.int32)
    q, scales = quant.quantize(rng.standard_normal((K, N)).astype(np.float32), fmt, axis=1)
    values, packed = quant.pack_rows(q, scales, fmt)
    y = aligned(np.zeros((1, N), np.float32))
    call(lib, "int4_residual_bias", x, aligned(idx), aligned(np.array([[count]], np.int32)),
         aligned(values), aligned(packed), aligned(np.zeros(N, np.float32)), aligned(np.zeros((1, N), np.float32)),
         aligned(np.zeros((neuron.COLUMN_TASKS, N), np.float32)), y)
    rows = np.clip(idx[0, : min(max(count, 0), K)], 0, K - 1)
    expected = x[0, rows].astype(np.float64) @ quant.dequantize(q, scales, 1)[rows]
    np.testing.assert_allclose(y[0], expected, atol=2e-4 * max(1.0, np.abs(expected).max()), rtol=1e-4)


def test_column_sparse_gemv_residual_epilogue_over_floats(lib):
    rng = np.random.default_rng(4)
    x = aligned(rng.standard_normal((1, K)).astype(np.float32))
    index, count, kept = selected(lib, x, 0.5)
    w, b = aligned(rng.standard_normal((K, N)).astype(np.float32)), aligned(rng.standard_normal(N).astype(np.float32))
    res = aligned(rng.standard_normal((1, N)).astype(np.float32))
    y = aligned(np.zeros((1, N), np.float32))
    call(lib, "f32_residual", x, index, count, w, b, res, aligned(np.zeros((neuron.COLUMN_TASKS, N), np.float32)), y)
    np.testing.assert_allclose(y[0], x[0, kept] @ w[kept] + b + res[0], atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- tiny LLaMA-SwiGLU builds

PROMPT = [11, 22, 33, 44, 55]
STEPS = 4
MATRICES = ["embed.tokens", "lm_head.weight"] + [f"layers.{i}.{m}" for i in range(2)
                                                 for m in ("attn.w_qkv", "attn.w_o", "ffn.w_up", "ffn.w_down")]


@pytest.fixture(scope="module")
def swiglu(tiny_models):
    return tiny_models("llama", hidden_act="silu")


_QUANTILES: dict = {}


def attention_quantiles(model, share=0.5):
    """Per (layer, attribute) the `share`-quantile of |input| of attention's qkv and o projections (and (None,
    "head"): the output layer's) over a dense numpy forward of a few tokens: thresholds that drop about that share
    of a decode step's inputs (once per model)."""
    from block_reference import run_blocks

    if id(model) not in _QUANTILES:
        seen = {}
        run_blocks(model, np.arange(3, 35) % 128, {}, 0, seen=seen)
        _QUANTILES[id(model)] = {key: float(np.quantile(np.abs(np.concatenate(v)), share))
                                 for key, v in seen.items() if key[1] in ("threshold_qkv", "threshold_o", "head")}
    return _QUANTILES[id(model)]


def threshold_build(swiglu, path, weight_dtype, plan, formats=None, max_context=64, thin_head=False, **options):
    """A threshold build at sparsity 0.5 with `plan`'s thresholds set after the threshold pass (`thin_head`: and
    the output layer's input at its median); returns (artifact, the block IR the thresholds apply to, the matrices
    as stored (quantized builds))."""
    from picompile.compiler import build, pipeline
    from passes.pipeline import Options
    from passes.targets import get_target
    from threshold_plans import PlanFormats, SetThresholds, Snapshot, StoredWeights, ThinOutputLayer, insert_after

    options = Options(max_context=max_context, calib=swiglu.calib, sparsity_mode="threshold", sparsity=0.5,
                      weight_dtype=weight_dtype, int8_activations=False, calib_tokens=512, **options)
    snapshot, stored = Snapshot(), StoredWeights()
    head = [ThinOutputLayer(lambda model: attention_quantiles(model)[(None, "head")])] if thin_head else []
    passes = insert_after(pipeline(options, "threshold"), "threshold", SetThresholds(plan), *head, snapshot)
    if any(p.name == "quantize" for p in passes):
        passes = insert_after(passes, "quality", PlanFormats(formats or {}))
        passes = insert_after(passes, "quantize", stored)
    artifact = build(swiglu.onnx, path, get_target("cpu"), options, passes=passes)
    return artifact, snapshot.model, stored


def check_against_reference(artifact, model, weights, slots=1):
    """The artifact's logits over the prompt and STEPS greedy decode steps equal the numpy block reference's
    of the thresholded model with the stored weights; each decode step's bytes as the cost model counts them.
    Returns the engine and the decode steps' weight bytes."""
    from block_reference import run_blocks
    from passes import costmodel
    from runtime import Engine

    engine, caches = Engine(artifact), {}
    tokens, start = PROMPT, 0
    engine.profile = {}
    for step in range(STEPS + 1):
        expected = run_blocks(model, np.array(tokens), caches, start, weights=weights, thresholded=True)
        got = engine.forward(tokens)
        np.testing.assert_allclose(got, expected, atol=1e-3 * max(1.0, np.abs(expected).max()), rtol=0,
                                   err_msg=f"step {step}")
        if step:
            assert costmodel.byte_disagreements(engine) == []
        start += len(tokens)
        tokens = [int(np.argmax(expected[-1]))]
        if step == 0:
            engine.profile = {}
    return engine, engine.profile["weight_bytes"]


def dense_bytes(engine) -> int:
    """The weight bytes one decode step of the same artifact would read with every input channel kept."""
    from passes import costmodel

    return sum(costmodel.weight_bytes(call, engine.manifest.buffers, call.selection.capacity if call.selection else 0)
               for call in engine.calls if call.decode)


def test_int4_threshold_build_quantizes_every_matrix_and_thresholds_attention(swiglu, tmp_path):
    """int4, thresholds on every linear input (the FFN's from the threshold pass, attention's the median of
    its inputs' magnitudes): every large matrix is stored in int4, the thresholded ones as rows; decode gives
    the numpy reference's logits of the thresholded model with the stored weights, reading fewer bytes."""
    import json

    from runtime import Engine
    from runtime.calls import schedule_calls
    from runtime.verify import check_files

    plan = lambda op, layer, model: ({key[1]: t for key, t in attention_quantiles(model).items() if key[0] == layer}
                                     if op == "Attention" else {})  # noqa: E731
    # a context longer than the vocabulary (128): the embedding's block scales, gathered by token as its codes
    # are, have fewer rows than the context and are no position table (inspect's and Engine's check)
    artifact, model, stored = threshold_build(swiglu, tmp_path / "int4.pic", "int4", plan, max_context=256)
    manifest = load_manifest(artifact)
    check_files(artifact, manifest)
    buffers = manifest.buffers
    for name in MATRICES:
        assert buffers[f"{name}.q"].format == "int4", name
        assert buffers[f"{name}.q"].layout == ("quant_rows" if "layers" in name or "embed" in name else "quant_panels")
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    assert {c.selection.part for c in calls if c.selection is not None} == {"up", "down", "qkv", "o"}
    assert set(stored.weights) == set(MATRICES)
    engine, read = check_against_reference(artifact, model, stored.weights)
    assert read < 0.8 * STEPS * dense_bytes(engine)
    # batch steps (sparse_columns_q's batch kernels): the union of the sequences' kept channels, each row near
    # its own decode step
    batch, alone = Engine(artifact, slots=2), Engine(artifact, slots=2)
    assert batch.batched
    for slot, prompt in enumerate((PROMPT, [7, 8, 9])):
        batch.forward(prompt, slot=slot), alone.forward(prompt, slot=slot)
    got = batch.forward_batch([3, 4], [0, 1])
    for slot, token in enumerate((3, 4)):
        own = alone.forward([token], slot=slot)[0]
        assert 0 < np.abs(got[slot] - own).max() < 0.2 * np.abs(own).max()


def test_mixed_formats_and_dense_projections(swiglu, tmp_path):
    """int8 with per-matrix formats (one FFN's up in int4, one qkv in fp16), the FFN's gate/up input dense
    (threshold_in < 0) and its down thresholded, attention's qkv thresholded and o dense: the reference's logits;
    an FFN whose two thresholds are < 0 stays a plain dense FFN."""
    from passes.threshold import KEEP_ALL

    def plan(op, layer, model):
        if op == "FFN":
            return {"threshold_in": KEEP_ALL, "sparsity_in": 0.0} if layer == 0 else {
                "threshold_in": KEEP_ALL, "threshold_down": KEEP_ALL, "sparsity_in": 0.0, "sparsity_down": 0.0}
        return {"threshold_qkv": attention_quantiles(model)[(layer, "threshold_qkv")], "sparsity_qkv": 0.5}

    formats = {"layers.0.ffn.w_up": "int4", "layers.1.attn.w_qkv": "fp16"}
    artifact, model, stored = threshold_build(swiglu, tmp_path / "mixed.pic", "int8", plan, formats)
    manifest = load_manifest(artifact)
    buffers = manifest.buffers
    assert buffers["layers.0.ffn.w_up.q"].format == "int4" and buffers["layers.0.ffn.w_up.q"].layout == "quant_panels"
    assert buffers["layers.0.ffn.w_down.q"].format == "int8" and buffers["layers.0.ffn.w_down.q"].layout == "quant_rows"
    assert buffers["layers.1.attn.w_qkv"].dtype == "float16" and "layers.1.attn.w_qkv.q" not in buffers
    assert buffers["layers.1.ffn.w_up.q"].layout == "quant_panels"
    layers = {layer.layer: layer for layer in manifest.layers}
    assert layers[1].dense and layers[0].sparsity_in == 0.0 and layers[0].sparsity_down > 0.4
    assert layers[0].sparsity_qkv == 0.5 and layers[0].sparsity_o == 0.0
    weights = dict(stored.weights)
    weights["layers.1.attn.w_qkv"] = model.graph.initializers["layers.1.attn.w_qkv"].const_value.numpy().astype(
        np.float16).astype(np.float32)  # (planned fp16: stored so)
    check_against_reference(artifact, model, weights)


@pytest.mark.parametrize("weight_dtype", ["fp32", "int8"])
def test_a_thinned_output_layer_reads_only_its_kept_inputs_rows(swiglu, tmp_path, weight_dtype):
    """The quality plan may thin the output layer's input too (`HeadThreshold`): lower makes it a Linear with the
    threshold, its decode step a select and a column kernel over its rows (an int8 build's blocked along them),
    prompts dense; the logits are the reference's with the output layer's input thresholded, and decode reads
    fewer of its bytes than dense."""
    import json

    from runtime.calls import schedule_calls

    plan = lambda op, layer, model: {}  # noqa: E731  (the FFN's from the threshold pass; attention dense)
    artifact, model, stored = threshold_build(swiglu, tmp_path / f"{weight_dtype}.pic", weight_dtype, plan,
                                              thin_head=True)
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    head = [c for c in calls if c.selection is not None and c.selection.part == "head"]
    assert len(head) == 1 and head[0].selection.kept == 0.5 and head[0].decode, head
    assert any(c.id.endswith("head_dense") and not c.decode for c in calls)
    buffers = load_manifest(artifact).buffers
    if weight_dtype == "int8":
        assert buffers["lm_head.weight.q"].layout == "quant_rows"
    engine, read = check_against_reference(artifact, model, stored.weights)
    assert read < STEPS * dense_bytes(engine)
