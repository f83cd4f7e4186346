"""Tests of the model makers (examples/models.py): export, synthetic sparsity, token files, cache."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import models  # noqa: E402

FAMILIES = ("opt", "llama")
EXPORTERS = ("dynamo", "legacy")
PROMPT = [5, 17, 3, 99, 42, 7, 64]
_BUILT: dict = {}


def sparse_tiny(family: str):
    """The tiny synthetic-sparse model of ``family`` (built once per test session)."""
    if family not in _BUILT:
        _BUILT[family] = models.build_model(family, "tiny", sparsity=0.9, skew="zipf", seed=0)
    return _BUILT[family]


def heldout_ids(model) -> np.ndarray:
    return models.random_tokens(model.config.vocab_size, 64, 64, seed=3001, avoid=models._avoid_ids(model.config))


# ----------------------------------------------------------------------------- ONNX export


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_matches_torch_with_kv_cache(family, exporter, tmp_path):
    import onnx

    model, _ = sparse_tiny(family)
    path = models.export_onnx(model, tmp_path, exporter)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)

    # optimum's names and shapes
    n, kv_heads, head_dim = models._kv_shape(model.config)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in proto.graph.output}
    expected_in = ["input_ids", "attention_mask"] + (["position_ids"] if family == "llama" else [])
    expected_in += [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert list(inputs) == expected_in
    assert list(outputs) == ["logits"] + [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert inputs["past_key_values.0.key"][1:] == [kv_heads, "past", head_dim]
    assert outputs["present.1.value"][1:] == [kv_heads, "total", head_dim]
    assert outputs["logits"][1:] == ["seq", model.config.vocab_size]
    if family == "llama":
        assert kv_heads < model.config.num_attention_heads  # grouped-query attention

    # no two weights are equal (ONNX optimizers would de-duplicate them)
    blobs = Counter(init.raw_data for init in proto.graph.initializer if len(init.raw_data) >= 64)
    assert max(blobs.values()) == 1

    # prompt (empty past) + 3 decode steps feeding present back as past, against one torch forward
    steps = models.ort_logits_steps(path, PROMPT, 3)
    tokens = PROMPT + [int(np.argmax(steps[0][-1]))] + [int(np.argmax(s)) for s in steps[1:-1]]
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    assert steps[0].shape == (len(PROMPT), model.config.vocab_size)
    np.testing.assert_allclose(steps[0], reference[: len(PROMPT)], atol=1e-4, rtol=0)
    for k, step in enumerate(steps[1:], 1):
        np.testing.assert_allclose(step, reference[len(PROMPT) - 1 + k], atol=1e-4, rtol=0)
    assert models.ort_greedy(path, PROMPT, 4) == tokens[len(PROMPT):] + [int(np.argmax(steps[-1]))]


def test_large_model_layout_external_data(tmp_path, monkeypatch):
    """Above the inline limit the weights go to one ``model.onnx.data`` beside ``model.onnx``."""
    import onnx

    monkeypatch.setattr(models, "INLINE_LIMIT_BYTES", 0)
    model, _ = sparse_tiny("opt")
    path = models.export_onnx(model, tmp_path, "legacy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert len(onnx.load(str(path)).graph.initializer) > 0
    steps = models.ort_logits_steps(path, PROMPT, 1)
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(steps[0], reference, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- synthetic sparsity


def _activation_hooks(model, family, store):
    """Hooks on the FFN activation itself: OPT's ReLU output; LLaMA's relu(gate)*up (down_proj input)."""
    handles = []
    for i, mods in enumerate(models.ffn_modules(model)):
        if family == "opt":
            handles.append(mods["layer"].activation_fn.register_forward_hook(
                lambda m, args, out, i=i: store.setdefault(i, []).append(out.reshape(-1, out.shape[-1]))))
        else:
            handles.append(mods["down"].register_forward_pre_hook(
                lambda m, args, i=i: store.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1]))))
    return handles


@pytest.mark.parametrize("family", FAMILIES)
def test_synthetic_sparsity_level_and_skew(family):
    model, report = sparse_tiny(family)
    assert report["synthetic"] is True and report["sparsity"] == 0.9
    ids = heldout_ids(model)
    store: dict = {}
    handles = _activation_hooks(model, family, store)
    _forward_with_hooks(model, ids, handles)
    assert len(store) == model.config.num_hidden_layers
    per_layer = []
    for i in sorted(store):
        active = torch.cat(store[i]) != 0
        assert active.shape[0] == ids.size
        per_layer.append(1 - active.float().mean().item())
        counts = np.sort(active.sum(0).numpy())[::-1]
        top = counts[: len(counts) // 5].sum() / counts.sum()
        assert top > 0.5, f"layer {i}: top 20% of neurons carry only {top:.2f} of activations"
    assert all(abs(s - 0.9) <= 0.03 for s in per_layer), per_layer
    assert abs(np.mean(per_layer) - 0.9) <= 0.03
    measured = models.measure_sparsity(model, ids)  # the library's own measurement agrees
    np.testing.assert_allclose(measured["per_layer"], per_layer, atol=1e-6)


def _forward_with_hooks(model, ids, handles) -> None:
    """Run the model on ids once, then remove the forward hooks that recorded what it computed."""
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()


def _probe_recall(model, family, rank=32) -> list[float]:
    """Rank-``rank`` least-squares probe from FFN input to pre-activation (fc1 / gate), fitted on
    half the tokens; recall of its sign on the true active neurons of the other half."""
    store: dict = {}
    handles = []
    for i, mods in enumerate(models.ffn_modules(model)):
        module = mods["up"] if family == "opt" else mods["gate"]

        def hook(m, args, out, i=i):
            store[i] = (args[0].reshape(-1, args[0].shape[-1]).double().numpy(),
                        out.reshape(-1, out.shape[-1]).double().numpy())

        handles.append(module.register_forward_hook(hook))
    ids = heldout_ids(model)
    _forward_with_hooks(model, ids, handles)
    recalls = []
    for i in sorted(store):
        x, y = store[i]
        half = len(x) // 2
        a = np.c_[x, np.ones(len(x))]
        b, *_ = np.linalg.lstsq(a[:half], y[:half], rcond=None)
        _, _, vt = np.linalg.svd(a[:half] @ b, full_matrices=False)  # reduced-rank regression
        b_rank = b @ vt[:rank].T @ vt[:rank]
        predicted = a[half:] @ b_rank > 0
        active = y[half:] > 0
        recalls.append(float(predicted[active].mean()))
    return recalls


@pytest.mark.parametrize("family", FAMILIES)
def test_low_rank_probe_predicts_activity(family):
    model, _ = sparse_tiny(family)
    recalls = _probe_recall(model, family)
    assert min(recalls) > 0.9, recalls
    # control: the same sparsity on full-rank weights is much harder to predict
    control, _ = models.build_model(family, "tiny", sparsity=0.9, seed=0, predictability=0.0)
    assert max(_probe_recall(control, family)) < 0.85


def test_llama_bias_channel_is_constant():
    model, report = sparse_tiny("llama")
    c = report["bias_channel"]
    store = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, args, out: store.append((out[0] if isinstance(out, tuple) else out)[..., c]))
    ids = heldout_ids(model)[:4]
    with torch.no_grad():
        model(input_ids=torch.tensor(ids))
    handle.remove()
    values = store[0]
    assert torch.allclose(values, values.flatten()[0].expand_as(values)) and values.flatten()[0] > 0


def test_dense_random_has_no_synthetic_structure():
    model, report = models.build_model("opt", "tiny", sparsity=None)
    assert report is None
    assert 0.3 < models.measure_sparsity(model, heldout_ids(model))["mean"] < 0.7


def test_activation_probs_mean_and_skew():
    p = models.activation_probs(3072, 0.1, "zipf", rng=np.random.default_rng(0))
    assert abs(p.mean() - 0.1) < 1e-6 and p.max() <= 0.95
    ordered = np.sort(p)[::-1]
    assert ordered[: len(p) // 5].sum() / p.sum() > 0.6
    assert np.allclose(models.activation_probs(100, 0.2, "uniform"), 0.2)


# ----------------------------------------------------------------------------- token files


def test_token_files_round_trip(tmp_path):
    square = [np.arange(5) + i for i in range(3)]
    ragged = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    for name, seqs in [("a.npy", square), ("b.npy", ragged), ("c.txt", square), ("d.txt", ragged)]:
        path = models.write_tokens(tmp_path / name, seqs)
        back = models.read_tokens(path)
        assert len(back) == len(seqs)
        for x, y in zip(back, seqs):
            assert x.dtype == np.int64 and np.array_equal(x, y)
    assert np.load(tmp_path / "a.npy").shape == (3, 5)
    (tmp_path / "e.csv").write_text("1, 2,3\n\n4 5\t6\n7,8\n")
    assert [s.tolist() for s in models.read_tokens(tmp_path / "e.csv")] == [[1, 2, 3], [4, 5, 6], [7, 8]]
    np.save(tmp_path / "f.npy", np.array([9, 8, 7], dtype=np.int32))
    assert [s.tolist() for s in models.read_tokens(tmp_path / "f.npy")] == [[9, 8, 7]]
    (tmp_path / "g.txt").write_text("1 2 x\n")
    with pytest.raises(ValueError):
        models.read_tokens(tmp_path / "g.txt")


# ----------------------------------------------------------------------------- cache and CLI


def test_cached_model_reuses_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOMPILE_CACHE", str(tmp_path / "cache"))
    assert models.cache_dir() == tmp_path / "cache"
    first = models.cached_model("llama", "tiny", sparsity=0.9, exporter="legacy")
    assert first.dir.parent == tmp_path / "cache" / "models" and first.dir.name.startswith("llama-tiny-")
    for path in (first.onnx, first.calib, first.heldout, first.config, first.stats):
        assert path.is_file()
    assert abs(first.sparsity - 0.9) <= 0.03 and len(first.layer_sparsity) == 2
    assert models.read_tokens(first.calib)[0].shape == (64,) and len(models.read_tokens(first.heldout)) == 64
    stamp = first.onnx.stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cached_model rebuilt a cached model")

    monkeypatch.setattr(models, "make_models", no_rebuild)  # what cached_model(s) build through
    second = models.cached_model("llama", "tiny", sparsity=0.9, exporter="legacy")
    assert second.dir == first.dir and second.onnx.stat().st_mtime_ns == stamp
    assert second.sparsity == first.sparsity
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [first.dir.name]
    with pytest.raises(AssertionError):  # another configuration is another directory
        models.cached_model("llama", "tiny", sparsity=0.8, exporter="legacy")


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOMPILE_CACHE", str(tmp_path))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "export_onnx", killed)
    with pytest.raises(KeyboardInterrupt):
        models.cached_model("opt", "tiny", exporter="legacy")
    assert list((tmp_path / "models").iterdir()) == []


def test_cli_writes_and_prints_paths(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import make_model

    out = tmp_path / "m"
    assert make_model.main(["opt", "--preset", "tiny", "--sparsity", "0.9", "--skew", "zipf",
                            "--exporter", "legacy", "-o", str(out), "-q"]) == 0
    printed = capsys.readouterr().out.split()
    assert {Path(p).name for p in printed} == {"model.onnx", "calib.npy", "heldout.npy", "config.json", "sparsity.npz"}
    assert all(Path(p).is_file() and Path(p).parent == out for p in printed)
    files = models.ModelFiles.from_dir(out)
    assert abs(files.sparsity - 0.9) <= 0.03
    meta = json.loads(files.config.read_text())
    assert meta["synthetic_sparsity"]["synthetic"] is True
    assert meta["measured_sparsity"]["checks"]["sparsity_ok"] and meta["measured_sparsity"]["checks"]["skew_ok"]
    assert len(models.ort_greedy(files.onnx, PROMPT, 3)) == 3


def test_predictability_orders_the_family_and_is_hashed_under_either_name():
    levels = models.PREDICTABILITY_LEVELS
    assert list(levels.values()) == sorted(levels.values(), reverse=True)  # easy first
    recall = {}
    for name, value in levels.items():
        model, report = models.build_model("opt", "tiny", sparsity=0.9, seed=0, predictability=value)
        assert report["predictability"] == value
        recall[name] = min(_probe_recall(model, "opt"))
    assert recall["easy"] > recall["medium"] > recall["hard"], recall
    assert models.config_hash("opt", sparsity=0.9, lowrank_var=0.8) == models.config_hash("opt", sparsity=0.9, predictability=0.8)
    assert models.config_hash("opt", sparsity=0.9, predictability=0.8) != models.config_hash("opt", sparsity=0.9, predictability=0.6)
    with pytest.raises(ValueError, match="twice"):
        models.config_hash("opt", sparsity=0.9, lowrank_var=0.8, predictability=0.8)


def test_predictability_and_calibration_size_reach_the_model_files(tmp_path):
    files = models.make_model("opt", tmp_path, sparsity=0.9, predictability=0.7, calib_seqs=4)
    meta = json.loads(files.config.read_text())
    assert files.predictability == meta["predictability"] == meta["synthetic_sparsity"]["predictability"] == 0.7
    assert np.load(files.calib).shape == (4, models.TOKEN_DEFAULTS["seq_len"]) and meta["calib_tokens"] == 4 * 64
    assert np.load(files.heldout).shape[0] == models.TOKEN_DEFAULTS["n_seqs"]  # held-out data keeps its size
    import onnx

    props = {p.key: p.value for p in onnx.load(str(files.onnx), load_external_data=False).metadata_props}
    assert props["picompile.predictability"] == "0.7"


def test_the_artifact_cache_evicts_the_least_recently_used_beyond_its_size(tmp_path, monkeypatch):
    """1 MiB artifacts under a 2.5 MiB cap: a reuse marks its artifact used now; before a build the least recently
    used go (with their build records) until the rest fit, and never one used within the last hour, even over the
    cap."""
    import os
    import time

    monkeypatch.setenv("PICOMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("PICOMPILE_ARTIFACT_CACHE_GB", str(2.5 / 1024))
    root = tmp_path / "artifacts"
    long_ago = time.time() - 3 * models.ARTIFACT_IN_USE_S

    def made(name: str, when: float | None = None) -> None:
        (root / name).mkdir(parents=True)
        (root / name / "weights.bin").write_bytes(bytes(2**20))
        (root / f"{name}.build.json").write_text("{}")
        if when is not None:
            os.utime(root / name, (when, when))

    for age, name in enumerate(("a.pic", "b.pic", "c.pic")):
        made(name, long_ago + age)
    assert models.cached_artifact("a.pic") == root / "a.pic"  # reused: a is now the most recent
    models.evict_artifacts(keep=root / "e.pic")  # before building another
    assert sorted(p.name for p in root.iterdir()) == ["a.pic", "a.pic.build.json", "c.pic", "c.pic.build.json"]
    made("d.pic")  # built just now
    models.evict_artifacts(keep=models.cached_artifact("e.pic"))  # 3 MiB: c, the least recently used, goes; a, d in use
    assert sorted(p.name for p in root.glob("*.pic")) == ["a.pic", "d.pic"]
    monkeypatch.setenv("PICOMPILE_ARTIFACT_CACHE_GB", "0")
    models.evict_artifacts(keep=models.cached_artifact("f.pic"))
    assert sorted(p.name for p in root.glob("*.pic")) == ["a.pic", "d.pic"]
