"""Threshold sparsity (TEAL-style) for SiLU/GELU FFNs: the kernels against numpy, the calibration, the
mode choice, and tiny LLaMA-SwiGLU builds against onnxruntime (sparsity 0) and against a torch model
thresholded the same way (sparsity 0.5)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron
from passes.threshold import calibrate, hidden_of
from passes.targets import CPU_ISAS
from kernel_reference import act_ref, aligned
from runtime.artifact import load_manifest
from runtime.calls import Access, schedule_calls


def threshold_calls(artifact) -> list:
    """The decode calls that read only the input channels a threshold kept."""
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    return [call for call in calls if call.selection is not None and call.selection.by == "threshold"]

K, N = 40, 48  # K rows (input channels), N columns: gated -> 24 outputs; 40 is no multiple of the row group
COLUMN_KERNELS = {  # name -> (gated, act, bias, weight dtype)
    "cols": (False, "none", False, "float32"),
    "cols_gated_silu": (True, "silu", False, "float32"),
    "cols_gated_silu_f16": (True, "silu", False, "float16"),
    "cols_gated_gelu_tanh": (True, "gelu_tanh", False, "float32"),  # GeGLU (Gemma)
    "cols_relu_bias_f16": (False, "relu", True, "float16"),
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select_abs", K, rows=1, magnitude=True)]
    funcs += [neuron.sparse_columns(name, K, N, rows=1, gated=gated, act=act, bias=bias, wdtype=dtype)
              for name, (gated, act, bias, dtype) in COLUMN_KERNELS.items()]
    path = tmp_path_factory.mktemp("threshold") / "threshold.so"
    cpu.build(funcs, CPU_ISAS["avx2"].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *arrays):
    lib[name](*[tvm_ffi.from_dlpack(a) for a in arrays])


@pytest.mark.parametrize("threshold", [np.inf, 0.7, -1.0])  # no channel passes, some, every one
@pytest.mark.parametrize("kernel", sorted(COLUMN_KERNELS))
def test_select_and_column_sparse_gemv(lib, threshold, kernel):
    gated, act, bias, dtype = COLUMN_KERNELS[kernel]
    rng = np.random.default_rng(1)
    x = aligned(rng.standard_normal((1, K)).astype(np.float32))
    index, count = aligned(np.full((1, K), -7, np.int32)), aligned(np.full((1, 1), -7, np.int32))
    call(lib, "select_abs", x, aligned(np.array([min(threshold, 3e38)], np.float32)), index, count)
    kept = np.nonzero(np.abs(x[0]) > threshold)[0]
    k = int(count[0, 0])
    assert k == len(kept) and np.array_equal(index[0, :k], kept)

    w = aligned(rng.standard_normal((K, N)).astype(dtype))
    b = aligned(rng.standard_normal(N).astype(np.float32))
    scratch = aligned(np.full((neuron.COLUMN_TASKS, N), 5.0, np.float32))  # stale partial sums must not leak
    y = aligned(np.full((1, N // 2 if gated else N), 99.0, np.float32))
    call(lib, kernel, x, index, count, w, *([b] if bias else []), scratch, y)
    pre = x[0, kept] @ w[kept].astype(np.float32) + (b if bias else 0)  # only the kept rows count
    expected = act_ref(pre[: N // 2], act) * pre[N // 2:] if gated else act_ref(pre, act)
    np.testing.assert_allclose(y[0], expected, atol=1e-4, rtol=1e-5)


def test_calibration_reaches_the_sparsity_on_held_out_tokens():
    """Thresholds fitted on some tokens drop the asked share of the inputs of other tokens, for gate/up and down."""
    rng = np.random.default_rng(0)
    tokens, d, f = 4000, 32, 96
    scale = np.exp(rng.standard_normal(d)).astype(np.float32)  # channels of very different magnitudes
    x = (rng.standard_normal((tokens, d)) * scale).astype(np.float32)
    w_up = (rng.standard_normal((d, 2 * f)) * 0.2).astype(np.float32)
    for sparsity in (0.25, 0.5):
        c = calibrate(x, w_up, None, "silu", True, sparsity)
        assert abs(c.sparsity_in - sparsity) < 0.02 and abs(c.sparsity_down - sparsity) < 0.02, (sparsity, c)
        # independent check on fresh tokens from the same distribution
        fresh = (rng.standard_normal((2000, d)) * scale).astype(np.float32)
        assert abs(np.mean(np.abs(fresh) <= c.threshold_in) - sparsity) < 0.02
        h = hidden_of(np.where(np.abs(fresh) > c.threshold_in, fresh, 0), w_up, None, "silu", True)
        assert abs(np.mean(np.abs(h) <= c.threshold_down) - sparsity) < 0.02
    zero = calibrate(x, w_up, None, "silu", True, 0.0)
    assert zero.sparsity_in == 0.0 and zero.sparsity_down == 0.0


# ---------------------------------------------------------------- tiny LLaMA-SwiGLU builds

PROMPT = [11, 22, 33, 44, 55]
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def swiglu(tiny_models):
    return tiny_models("llama", hidden_act="silu")


@pytest.fixture(scope="module")
def threshold_builds(swiglu, tmp_path_factory):
    """Threshold builds of the SwiGLU model at sparsity 0 and 0.5 (built once for the module)."""
    from picompile.compiler import build
    from passes.pipeline import Options
    from passes.targets import get_target

    root = tmp_path_factory.mktemp("threshold-builds")
    return {s: build(swiglu.onnx, root / f"s{s}.pic", get_target("cpu"),
                     Options(max_context=64, calib=swiglu.calib, sparsity_mode="threshold", sparsity=s))
            for s in (0.0, 0.5)}


def greedy_steps(forward, prompt=PROMPT, steps=DECODE_STEPS):
    """Logits of the prompt (one call), then of each greedy decode step (one token a call)."""
    rows = [forward(prompt)]
    for _ in range(steps):
        rows.append(forward([int(np.argmax(rows[-1][-1]))]))
    return rows


def test_sparsity_zero_matches_onnxruntime(threshold_builds, swiglu):
    """Thresholds that keep every input (KEEP_ALL, < 0) mean dense projections: the build is the dense model
    (prefill and decode), with no column-sparse call."""
    from passes.reference import OrtDecoder
    from runtime import Engine

    assert load_manifest(threshold_builds[0.0]).sparsity.mode == "threshold"
    assert threshold_calls(threshold_builds[0.0]) == []
    assert {call.selection.part for call in threshold_calls(threshold_builds[0.5])} == {"up", "down"}
    engine, reference = Engine(threshold_builds[0.0]), OrtDecoder(swiglu.onnx)
    rows = greedy_steps(reference.forward)
    engine_rows = [engine.forward(PROMPT)] + [engine.forward([int(np.argmax(r[-1]))]) for r in rows[:-1]]
    for got, expected in zip(engine_rows, rows):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_fp16_threshold_build_stays_close_to_onnxruntime(swiglu, tmp_path):
    """--weight-dtype fp16: the column-sparse kernels read fp16 rows; with thresholds of 0 (only exact zeros
    dropped) only fp16 rounding remains."""
    from picompile.compiler import build, pipeline
    from passes.pipeline import Options
    from passes.reference import OrtDecoder
    from passes.targets import get_target
    from runtime import Engine
    from threshold_plans import SetThresholds, insert_after

    options = Options(max_context=32, calib=swiglu.calib, sparsity_mode="threshold", sparsity=0.0,
                      weight_dtype="fp16", calib_tokens=512)
    zero = SetThresholds(lambda op, layer, model: {"threshold_in": 0.0, "threshold_down": 0.0} if op == "FFN" else {})
    artifact = build(swiglu.onnx, tmp_path / "f16.pic", get_target("cpu"), options,
                     passes=insert_after(pipeline(options, "threshold"), "threshold", zero))
    buffers = load_manifest(artifact).buffers
    assert threshold_calls(artifact) and all(buffers[arg.buffer].dtype == "float16" for call in threshold_calls(artifact)
               for arg in call.args if arg.access is Access.SELECTED_ROWS)
    assert buffers["layers.0.ffn.w_up"].dtype == "float16"
    engine, reference = Engine(artifact), OrtDecoder(swiglu.onnx)
    expected = greedy_steps(reference.forward, steps=4)
    got = [engine.forward(PROMPT)] + [engine.forward([int(np.argmax(r[-1]))]) for r in expected[:-1]]
    errors = [np.abs(g - e).max() / e.std() for g, e in zip(got, expected)]
    assert 0 < max(errors) < 1e-2, errors


def test_threshold_mode_on_an_ungated_biased_relu_ffn(tiny_models, tmp_path):
    """Threshold mode asked for on OPT (ReLU, not gated, biases), with thresholds of 0 (only exact zeros dropped,
    so the column-sparse calls run and the model stays exactly the dense one)."""
    from picompile.compiler import build, pipeline
    from passes.pipeline import Options
    from passes.reference import OrtDecoder
    from passes.targets import get_target
    from runtime import Engine
    from threshold_plans import SetThresholds, insert_after

    files = tiny_models("opt", sparsity=0.9)
    options = Options(max_context=32, calib=files.calib, sparsity_mode="threshold", sparsity=0.0, calib_tokens=512)
    zero = SetThresholds(lambda op, layer, model: {"threshold_in": 0.0, "threshold_down": 0.0} if op == "FFN" else {})
    artifact = build(files.onnx, tmp_path / "opt.pic", get_target("cpu"), options,
                     passes=insert_after(pipeline(options, "threshold"), "threshold", zero))
    buffers = load_manifest(artifact).buffers
    up = [call for call in threshold_calls(artifact) if call.selection.part == "up"]
    # OPT's up projection has a bias: read whole beside the kept rows
    assert up and all(any(arg.access is Access.WHOLE and buffers[arg.buffer].kind == "weight"
                          for arg in call.args) for call in up)
    engine, reference = Engine(artifact), OrtDecoder(files.onnx)
    for got, expected in zip(greedy_steps(engine.forward, steps=4), greedy_steps(reference.forward, steps=4)):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_half_sparsity_matches_the_thresholded_model_and_reads_fewer_rows(threshold_builds, swiglu):
    """At sparsity 0.5 the artifact computes the model whose FFN inputs below the thresholds are zeroed (torch,
    hooks on the same weights; the prompt runs dense, as picompile's prefill does), and its decode steps read
    exactly the weight rows of the inputs kept: the bytes saved against sparsity 0 are the dropped rows'."""
    import torch

    from examples.models import build_model
    from runtime import Engine

    layers = {layer.layer: layer for layer in load_manifest(threshold_builds[0.5]).layers}
    model, _ = build_model("llama", "tiny", None, hidden_act="silu")  # the weights tiny_models exported
    config = model.config
    d, f = config.hidden_size, config.intermediate_size
    state = {"sparse": False, "dropped_bytes": 0}

    def threshold_hook(layer, key, row_bytes):
        def hook(module, args):
            if not state["sparse"]:
                return None
            (v,) = args
            keep = v.abs() > getattr(layer, key)
            state["dropped_bytes"] += int((~keep).sum()) * row_bytes
            return (v * keep,)
        return hook

    for i, block in enumerate(model.model.layers):
        block.mlp.register_forward_pre_hook(threshold_hook(layers[i], "threshold_in", 2 * f * 4))  # gate + up rows
        block.mlp.down_proj.register_forward_pre_hook(threshold_hook(layers[i], "threshold_down", d * 4))

    past = None

    def forward(tokens):
        nonlocal past
        with torch.no_grad():
            out = model(torch.tensor([tokens]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        state["sparse"] = True  # the prompt ran dense; every later step is a decode step
        return out.logits[0].numpy()

    expected = greedy_steps(forward)
    assert state["dropped_bytes"] > 0
    engine = Engine(threshold_builds[0.5])
    got = [engine.forward(PROMPT)] + [engine.forward([int(np.argmax(r[-1]))]) for r in expected[:-1]]
    for step, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=0, err_msg=f"step {step}")
    # the same greedy tokens on both engines: the rows torch dropped are the ones the artifact did not read
    tokens = [int(np.argmax(r[-1])) for r in expected[:-1]]

    def bytes_read(artifact):
        engine = Engine(artifact)
        engine.forward(PROMPT)
        engine.profile = {}
        for token in tokens:
            engine.forward([token])
        return engine.profile["weight_bytes"]

    dense, sparse = bytes_read(threshold_builds[0.0]), bytes_read(threshold_builds[0.5])
    thresholds = 2 * 4 * len(layers) * len(tokens)  # the sparse build's select calls read their fp32 thresholds
    assert dense - sparse + thresholds == state["dropped_bytes"]
    ffn_bytes = len(layers) * 3 * d * f * 4 * len(tokens)
    assert 0.4 < state["dropped_bytes"] / ffn_bytes < 0.6  # about half of the FFN rows, as asked


def test_auto_mode_picks_threshold_for_silu_and_says_why(swiglu, tmp_path, capsys):
    """The default SiLU build is planned within the default budget (ppl +1%), prints its expectation, and eval
    reports it beside what it measures on other text."""
    from picompile.cli import main

    out = tmp_path / "auto.pic"
    assert main(["build", str(swiglu.onnx), "-o", str(out), "--calib", str(swiglu.calib), "--max-context", "32"]) == 0
    printed = capsys.readouterr().out
    assert ("sparsity: threshold mode (a level per linear input, within the quality budget) (layer FFNs use SiLU: "
            "neurons are rarely exactly zero, so a predictor has nothing to predict)") in printed
    expected = re.search(r"expected quality: ppl ([+-][0-9.]+)% \(95%: [+-][0-9.]+\.\.[+-][0-9.]+%, "
                         r"budget ppl \+1%\), KL ([0-9.]+) \(ppl ([+-][0-9.]+)% on the model's own text\), top-1",
                         printed)
    assert expected and float(expected[1]) <= 1.0 and float(expected[3]) <= 1.0, printed  # both within the budget
    assert main(["eval", str(out), "--reference", str(swiglu.onnx), "--tokens", str(swiglu.heldout),
                 "--max-sequences", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sparsity_mode"] == "threshold" and "sparsity" not in report
    assert report["expected_ppl_change"] == pytest.approx(float(expected[1]) / 100, abs=1e-3)
    assert report["expected_kl"] == pytest.approx(float(expected[2]), abs=1e-4)
    assert abs(report["ppl_change"]) < 0.03 and report["kl_mean"] < 0.05, report


@pytest.mark.parametrize("args, message", [
    (["--sparsity-mode", "predictor"], "--sparsity-mode predictor needs ReLU FFNs, but layer 0's FFN uses SiLU"),
    (["--target", "rtx4090"], "threshold sparsity runs on the CPU only"),
    (["--sparsity", "1.0"], "--sparsity: expected a number in [0, 1)"),
    (["--dense", "--sparsity", "0.5"], "--dense computes every input"),
])
def test_threshold_mode_refusals(swiglu, tmp_path, capsys, args, message):
    from picompile.cli import main

    out = tmp_path / "refused.pic"
    assert main(["build", str(swiglu.onnx), "-o", str(out), "--calib", str(swiglu.calib), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".refused*"))


def test_sparsity_is_refused_in_predictor_mode(tiny_models, tmp_path, capsys):
    """A ReLU model goes to predictor mode, where --sparsity means nothing: refused, not ignored."""
    from picompile.cli import main

    files = tiny_models("llama", sparsity=0.9)
    assert main(["build", str(files.onnx), "-o", str(tmp_path / "r.pic"), "--calib", str(files.calib),
                 "--sparsity", "0.5"]) == 2
    assert "drop --sparsity, or add --sparsity-mode threshold" in capsys.readouterr().err


def test_report_of_a_threshold_build_tabulates_its_thresholds(threshold_builds, tmp_path, capsys):
    """`inspect --report`: a threshold build's table holds each layer's thresholds and dropped shares (no
    GPU/CPU split or predictor columns, nothing of them to draw)."""
    import html

    from picompile.cli import main

    artifact = threshold_builds[0.5]
    layers = load_manifest(artifact).layers
    report = tmp_path / "report.html"
    assert main(["inspect", str(artifact), "--report", str(report)]) == 0
    page = html.unescape(report.read_text())
    assert "gate/up threshold" in page and "predictor rank" not in page and "GPU neurons" not in page
    for layer in layers:
        assert f"<td>{layer.threshold_in:.4g}</td><td>{layer.sparsity_in:.3f}</td>" in page
    assert page.count("<figure>") == 1  # the activation CDF only


def test_batch_steps_keep_the_union_of_the_sequences_channels(threshold_builds, swiglu):
    """Threshold builds batch too: at sparsity 0 a batch step's rows are each sequence's own decode step; at 0.5
    each row computes the union of the batch's kept channels, so it is as close to the dense model as its own."""
    from passes.reference import OrtDecoder
    from runtime import Engine

    prompts = [PROMPT, [3, 1, 4, 1, 5, 9], [27, 18]]
    for sparsity, artifact in threshold_builds.items():
        engine, alone = Engine(artifact, slots=3), Engine(artifact, slots=3)
        dense = [OrtDecoder(swiglu.onnx) for _ in prompts]
        assert engine.batched
        tokens = []
        for slot, prompt in enumerate(prompts):
            engine.forward(prompt, slot=slot), alone.forward(prompt, slot=slot)
            tokens.append(int(np.argmax(dense[slot].forward(prompt)[-1])))
        for _ in range(4):
            got = engine.forward_batch(tokens, [0, 1, 2])
            for slot in range(3):
                own = alone.forward([tokens[slot]], slot=slot)[0]
                want = dense[slot].forward([tokens[slot]])[-1]
                if sparsity == 0.0:
                    np.testing.assert_allclose(got[slot], own, atol=1e-4, rtol=0)
                else:
                    assert np.abs(got[slot] - want).max() <= np.abs(own - want).max() + 1e-3
                tokens[slot] = int(np.argmax(want))
