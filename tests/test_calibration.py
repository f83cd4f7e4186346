"""Calibration that uses the data it gets: every given token is profiled (spilled per layer to files, not
held), --calib-tokens caps it, a calibration set small for the model's width is said once and topped up
with sequences sampled from the model itself (--calib-samples), and inspect / -v set each layer's
predicted-active share against the true one."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from passes.import_onnx import Import
from passes.front_end import load
from passes.predict import Predict
from passes.profile import (MEASURED_SHARE, MEASURED_TOKENS, MIN_TOKENS_PER_NEURON, CalibrationSequences, Profile,
                            ProfiledActivations, sample_sequences)
from passes.recognise import Recognise
from picompile.cli import main
from passes.pipeline import Context, Options, run_passes
from passes.reference import OrtDecoder
from passes.targets import get_target
from runtime.artifact import load_manifest

CONTEXT = 64  # calibration sequences are cut to min(max_context, 128) tokens: 64 here


@pytest.fixture(scope="module")
def files(tiny_models):
    return tiny_models("opt", sparsity=0.9)  # d_model 64, 2 layers of 256 neurons, vocabulary 128


def profile(files, workdir, **fields):
    """The profile pass alone: (its ProfiledActivations, the model, warning lines, log lines); every given token
    profiled unless `hold_out=True` (the quality pass's tokens kept out)."""
    fields = {"hold_out": False, **fields}
    warnings, logs = [], []
    workdir.mkdir(exist_ok=True)
    ctx = Context(get_target("cpu"), workdir=workdir, log=logs.append, warnings=warnings.append,
                  options=Options(max_context=CONTEXT))
    model = run_passes(load(files.onnx), [Import(), Recognise(), Profile(**fields)], ctx)
    return ProfiledActivations.of(model), model, warnings, logs


def write(path, sequences):
    np.save(path, np.asarray(sequences, np.int64))
    return path


def test_every_given_token_is_profiled_into_files(files, tmp_path):
    """5500 tokens (more than the old 4096 cap) in sequences of 1100, cut into 64s and a 12: every one is
    profiled, the layers' arrays are memory maps of the workdir's files, and each row is the one a run of its
    own sequence alone gives (the rows are spilled in their place)."""
    rng = np.random.default_rng(7)
    calib = write(tmp_path / "big.npy", rng.integers(0, 128, size=(5, 1100)))
    profiled, model, warnings, _ = profile(files, tmp_path / "w1", calib=calib)
    assert warnings == []  # 5500 tokens are plenty for 256 neurons
    for layer, activations in profiled.layers.items():
        assert activations.tokens == 5500 and activations.inputs.shape == (5500, 64)
        assert isinstance(activations.inputs, np.memmap) and isinstance(activations.bits, np.memmap)
        assert activations.bits.shape == (5500, 256 // 8) and activations.active.shape == (5500, 256)
        frequency = model.graph.initializers[f"layers.{layer}.ffn.frequency"].const_value.numpy()
        np.testing.assert_allclose(frequency, activations.active.mean(0), atol=1e-6)
    assert sorted(p.name for p in next((tmp_path / "w1").glob("activations-*")).iterdir()) == [
        "layer0.active.npy", "layer0.inputs.npy", "layer1.active.npy", "layer1.inputs.npy"]

    # The last piece of the fourth sequence (its 12 tokens at 1088..1100) alone, and where it sits in the whole
    piece = np.load(calib)[3, 1088:]
    alone, _, _, _ = profile(files, tmp_path / "w2", calib=write(tmp_path / "piece.npy", piece[None]), calib_samples=0)
    begin = 3 * 1100 + 1088
    for layer in profiled.layers:
        whole, single = profiled.layer(layer), alone.layer(layer)
        np.testing.assert_allclose(whole.inputs[begin:begin + 12], single.inputs, rtol=1e-5, atol=1e-5)
        assert np.array_equal(whole.active[begin:begin + 12], single.active)


def test_the_users_tokens_kept_out_of_the_fits_come_from_across_the_file(files, tmp_path):
    """Some of the user's sequences (about MEASURED_TOKENS, at most half of the user's tokens), taken across
    the file, are not profiled: no fit sees them, and they ride last in CalibrationSequences for the quality
    pass to measure on."""
    calib = write(tmp_path / "big.npy", np.random.default_rng(7).integers(0, 128, size=(5, 1100)))
    profiled, model, _, _ = profile(files, tmp_path / "w1", calib=calib, hold_out=True)
    calibration = CalibrationSequences.of(model)
    kept = calibration.sequences[-calibration.measured:]
    kept_tokens = sum(len(s) for s in kept)
    assert calibration.measured > 1 and MEASURED_TOKENS <= kept_tokens <= MEASURED_SHARE * 5500
    rows = np.load(calib)
    # where each kept sequence sits in the file: (row, offset), in file order, spread over it
    places = [next((r, o) for r in range(5) for o in range(1100 - len(s) + 1)
                   if np.array_equal(rows[r, o:o + len(s)], s)) for s in kept]
    assert places == sorted(places) and places[0][0] <= 1 and places[-1][0] >= 3
    assert all(layer.tokens == 5500 - kept_tokens for layer in profiled.layers.values())
    fitted = np.concatenate(calibration.sequences[:-calibration.measured])
    assert len(fitted) == 5500 - kept_tokens and sorted(np.concatenate([fitted, *kept])) == sorted(rows.ravel())
    # the samples a short set is topped up with start from the fitted sequences' first tokens, never a kept one's
    small = np.load(files.calib)[:3]
    _, model, _, _ = profile(files, tmp_path / "w3", calib=write(tmp_path / "small.npy", small), hold_out=True)
    calibration = CalibrationSequences.of(model)
    assert calibration.measured == 1 and len(calibration.sequences) == 6 + 3  # 128 fitted + 6 x 64 reach 512
    fitted = calibration.sequences[6:-1]
    assert len(fitted) == 2 and not any(np.array_equal(f, calibration.sequences[-1]) for f in fitted)
    assert [int(s[0]) for s in calibration.sequences[:6]] == [int(fitted[i % 2][0]) for i in range(6)]
    assert int(calibration.sequences[-1][0]) not in {int(f[0]) for f in fitted}
    # a single sequence: nothing kept out (the quality pass then measures on the fits' tokens)
    _, model, _, _ = profile(files, tmp_path / "w2", calib=write(tmp_path / "one.npy", np.arange(60)[None]),
                             calib_samples=0, hold_out=True)
    assert CalibrationSequences.of(model).measured == 0


def test_profile_memory_does_not_grow_with_the_tokens(files, tmp_path):
    """The activations go to files as they come: what profiling 20000 tokens allocates on the heap stays far
    below the 49 MiB that holding both layers' inputs and activation outputs (float32) would take."""
    import tracemalloc

    profile(files, tmp_path / "warm", calib=files.calib, calib_tokens=512)  # first-use imports and caches
    calib = write(tmp_path / "many.npy", np.random.default_rng(3).integers(0, 128, size=(20, 1000)))
    tracemalloc.start()
    try:
        profiled, _, _, _ = profile(files, tmp_path / "many", calib=calib)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    held = 2 * 20000 * (64 + 256) * 4
    assert profiled.layer(0).tokens == 20000 and peak < held / 6, (peak, held)


def test_calib_tokens_caps_the_tokens(files, tmp_path):
    profiled, _, warnings, _ = profile(files, tmp_path, calib=files.calib, calib_tokens=1000)
    assert {a.tokens for a in profiled.layers.values()} == {1000}
    assert warnings == []  # 1000 >= 2 x 256


def test_a_small_calibration_set_is_said_once_and_topped_up_from_the_model(files, tmp_path):
    needed = MIN_TOKENS_PER_NEURON * 256
    small = write(tmp_path / "small.npy", np.load(files.calib)[:3])  # 192 tokens
    profiled, _, warnings, logs = profile(files, tmp_path / "auto", calib=small)
    # auto: enough 64-token sequences sampled to reach the rule's count, and one line that says so
    assert {a.tokens for a in profiled.layers.values()} == {192 + 5 * 64} and 192 + 5 * 64 >= needed
    assert len(warnings) == 1 and not any(line in logs for line in warnings)
    assert all(word in warnings[0] for word in ("192", str(needed), "256", "sampled 5 sequences", "--calib-samples"))
    # the user's tokens are the last rows (the predictors' held-out share is real text)
    given, _, _, _ = profile(files, tmp_path / "given", calib=small, calib_samples=0)
    for layer in profiled.layers:
        np.testing.assert_allclose(profiled.layer(layer).inputs[-192:], given.layer(layer).inputs, atol=1e-5)

    # sampling off: still one line, naming the numbers and how many samples would reach the rule
    _, _, warnings, _ = profile(files, tmp_path / "off", calib=small, calib_samples=0)
    assert len(warnings) == 1 and "192 calibration tokens" in warnings[0] and "--calib-samples 5" in warnings[0]
    # a cap the user chose is not topped up, but said
    _, _, warnings, _ = profile(files, tmp_path / "cap", calib=files.calib, calib_tokens=300)
    assert len(warnings) == 1 and "300 calibration tokens" in warnings[0]
    # large enough, or no --calib (random tokens): nothing to say
    for fields in (dict(calib=files.calib), dict()):
        _, _, warnings, _ = profile(files, tmp_path / f"quiet{len(fields)}", **fields)
        assert warnings == []


def test_calib_samples_adds_sequences_drawn_from_the_model(files, tmp_path):
    given = np.load(files.calib)
    plain, _, _, _ = profile(files, tmp_path / "plain", calib=files.calib, calib_samples=0)
    more, _, warnings, logs = profile(files, tmp_path / "more", calib=files.calib, calib_samples=3)
    assert more.layer(0).tokens == plain.layer(0).tokens + 3 * CONTEXT and warnings == []
    assert any("sampled 3 sequences of 64 tokens" in line for line in logs)

    starts = list(given[:2])
    first = np.asarray(sample_sequences(files.onnx, 3, 32, starts, seed=0, vocab_size=100))
    assert first.shape == (3, 32) and first[:, 1:].max() < 100 and first.min() >= 0  # drawn within the vocabulary
    assert list(first[:, 0]) == [given[0, 0], given[1, 0], given[0, 0]]  # the calibration's first tokens, cycled
    assert np.array_equal(first, np.asarray(sample_sequences(files.onnx, 3, 32, starts, seed=0, vocab_size=100)))
    assert not np.array_equal(first, np.asarray(sample_sequences(files.onnx, 3, 32, starts, seed=1, vocab_size=100)))


def test_sampled_tokens_are_the_models_draws(files):
    """Each token the batched, KV-cached sampler draws is the inverse-CDF draw of the same uniform from
    softmax(logits) of the model run on that row's prefix alone, without a cache: temperature-1 samples
    of the model, not of anything else."""
    decoder = OrtDecoder(files.onnx)
    rows = decoder.sample(np.array([3, 50, 99]), 12, np.random.default_rng(5))
    uniforms = np.random.default_rng(5)
    for t in range(1, rows.shape[1]):
        u = uniforms.random((len(rows), 1))
        for b, row in enumerate(rows):
            decoder.reset()
            logits = decoder.forward(row[:t])[-1].astype(np.float64)
            cdf = np.cumsum(np.exp(logits - logits.max()))
            assert row[t] == min(np.searchsorted(cdf, u[b, 0] * cdf[-1], side="left"), len(cdf) - 1), (b, t)


def test_predict_logs_predicted_and_true_active_shares(files, tmp_path):
    logs = []
    ctx = Context(get_target("cpu"), workdir=tmp_path, log=logs.append, options=Options(max_context=CONTEXT))
    model = run_passes(load(files.onnx), [Import(), Recognise(), Profile(calib=files.calib), Predict()], ctx)
    profiled = ProfiledActivations.of(model)
    lines = [line for line in logs if re.match(r"predict: layer \d+ rank", line)]
    assert len(lines) == 2
    for line in lines:
        layer = int(re.match(r"predict: layer (\d+)", line).group(1))
        shares = re.search(r"active share predicted ([\d.]+), true ([\d.]+) \(([\d.]+)x", line)
        assert shares, line
        predicted, true, ratio = map(float, shares.groups())
        assert true == pytest.approx(profiled.layer(layer).active.mean(), abs=1e-4)
        assert 0.05 < true < 0.2 and predicted > true  # a tenth fire; recall 0.99 needs more than those
        assert ratio == pytest.approx(predicted / true, abs=0.01)


def test_cli_build_warns_once_and_inspect_shows_both_shares(files, tmp_path, capsys):
    small = write(tmp_path / "small.npy", np.load(files.calib)[:3])
    out = tmp_path / "s.pic"
    assert main(["build", str(files.onnx), "-o", str(out), "--max-context", str(CONTEXT), "--calib", str(small),
                 "--calib-samples", "0"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    # (the last of the 3 sequences is kept out of the fits for the quality pass: 128 profiled, 6 samples to reach 512)
    assert len(warnings) == 1 and "--calib-samples 6" in warnings[0], err

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"calibration 192 tokens: 192 from {small} (small: 512 wanted)" in text
    header = next(line for line in text.splitlines() if line.split()[:1] == ["layer"])
    assert "true active" in header and "predicted" in header and "pred/true" in header
    layers = load_manifest(out).layers
    for layer in layers:
        row = next(line.split() for line in text.splitlines() if line.split()[:1] == [str(layer.layer)])
        true, predicted, ratio = float(row[-4]), float(row[-3]), float(row[-2].rstrip("x"))
        assert row[-1] == (layer.ffn or "sparse")  # the layer's FFN lowering, last
        assert true == pytest.approx(1 - layer.sparsity, abs=1e-3)
        assert predicted == pytest.approx(layer.predictor_active, abs=1e-3)
        assert ratio == pytest.approx(layer.predictor_active / (1 - layer.sparsity), abs=0.01)
    assert main(["inspect", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["layers"]
    assert [layer["active_ratio"] for layer in shown] == pytest.approx(
        [layer.predictor_active / (1 - layer.sparsity) for layer in layers])


@pytest.mark.parametrize("family, exporter, external", [("opt", "dynamo", True), ("llama", "legacy", False),
                                                       ("falcon", "dynamo", False)])
def test_layer_by_layer_profile_is_the_whole_models(tiny_models, tmp_path, monkeypatch, family, exporter, external):
    """Profiling one layer's part of the source graph at a time (what a model too big for onnxruntime gets)
    spills the same FFN inputs and activity as running the whole model, for a sequential, a legacy-exported
    gated and a parallel-attention family, and with the weights memory-mapped from external data as a big
    model's are; each part holds its own layer's weights only."""
    import onnx

    from passes.layer_reference import layer_cuts, lifted_layer_inputs, part_model
    from passes.recognise import source_model
    from passes import ir as pir

    model_files = tiny_models(family, exporter) if family == "falcon" else tiny_models(family, exporter, sparsity=0.9)
    onnx_path = model_files.onnx
    if external:  # weights beside the model, left memory-mapped by import (as past EXTERNAL_DATA_BYTES)
        onnx_path = tmp_path / "external" / "model.onnx"
        onnx_path.parent.mkdir()
        onnx.save(onnx.load(str(model_files.onnx)), str(onnx_path), save_as_external_data=True,
                  all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
        monkeypatch.setattr(pir, "EXTERNAL_DATA_BYTES", 0)
    results = {}
    for layered in (False, True):
        workdir = tmp_path / f"layered-{layered}"
        workdir.mkdir()
        ctx = Context(get_target("cpu"), workdir=workdir, options=Options(max_context=CONTEXT))
        passes = [Import(), Recognise(), Profile(calib=model_files.calib, calib_samples=0, layered=layered,
                                                 hold_out=False)]
        lifted = run_passes(load(onnx_path), passes, ctx)
        results[layered] = ProfiledActivations.of(lifted)
    for layer in results[False].layers:
        whole, parts = results[False].layer(layer), results[True].layer(layer)
        assert whole.tokens == parts.tokens == 64 * 64
        np.testing.assert_allclose(parts.inputs, whole.inputs, rtol=1e-5, atol=1e-6)
        assert np.array_equal(parts.active, whole.active)

    source = source_model(lifted)
    weights = {name for name, value in source.graph.initializers.items() if value.const_value.size >= 64 * 64}
    wanted = {int(pir.attr(node, "layer")): (node.metadata_props["source.input"], node.metadata_props["source.activation"])
              for node in pir.nodes_in_domain(lifted, "FFN")}
    cuts = layer_cuts(lifted_layer_inputs(lifted), wanted)
    held = [set(part_model(source, cut, previous).graph.initializers) & weights
            for cut, previous in zip(cuts, [None, *cuts[:-1]])]
    assert held[0] and held[1] and not held[0] & held[1] - {_embedding(source)}  # no matrix in both parts


def _embedding(source):
    from passes.recognise import find_embeddings

    token, _ = find_embeddings(source.graph)
    return token.inputs[0].name


def test_profile_goes_layer_by_layer_where_onnxruntime_could_not_hold_the_model(files, monkeypatch):
    """The choice: the source's weights in fp32 against half the memory available."""
    from passes import layer_reference
    from passes.recognise import source_model

    lifted = run_passes(load(files.onnx), [Import(), Recognise()],
                        Context(get_target("cpu"), options=Options(max_context=CONTEXT)))
    fp32_bytes = sum(4 * v.const_value.size for v in source_model(lifted).graph.initializers.values())
    monkeypatch.setattr(layer_reference, "available_memory_bytes", lambda: 3 * fp32_bytes)
    assert not layer_reference.needs_layers(source_model(lifted))
    monkeypatch.setattr(layer_reference, "available_memory_bytes", lambda: fp32_bytes)
    assert layer_reference.needs_layers(source_model(lifted))
