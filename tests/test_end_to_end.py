"""ONNX in, artifact out, tokens from the thin runtime: logits and greedy tokens match onnxruntime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from picompile.cli import main
from picompile.compiler import build
from passes.pipeline import Options
from passes.reference import OrtDecoder
from passes.targets import get_target
from runtime import Engine, generate, load_manifest
from test_runtime_thin import run_without_compiler_stack

ROOT = Path(__file__).resolve().parents[1]
CASES = [(family, exporter) for family in ("opt", "llama") for exporter in ("dynamo", "legacy")]


@pytest.fixture(scope="module")
def artifacts(tiny_models, tmp_path_factory):
    built = {}

    def get(family, exporter="dynamo"):
        if (family, exporter) not in built:
            files = tiny_models(family, exporter)
            out = tmp_path_factory.mktemp("artifacts") / f"{family}-{exporter}.pic"
            build(files.onnx, out, get_target("cpu"), Options(dense=True, max_context=64))
            built[family, exporter] = (files, out)
        return built[family, exporter]

    return get


@pytest.mark.parametrize("family,exporter", CASES)
def test_logits_match_onnxruntime_at_prefill_and_every_decode_step(artifacts, family, exporter):
    files, artifact = artifacts(family, exporter)
    engine, reference = Engine(artifact), OrtDecoder(files.onnx)
    prompt = np.array([3, 14, 15, 92, 65], np.int64)
    np.testing.assert_allclose(engine.forward(prompt), reference.forward(prompt), atol=1e-4, rtol=0)
    token = 7
    for _ in range(8):
        got, expected = engine.forward([token]), reference.forward([token])
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        token = int(np.argmax(expected[-1]))


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_greedy_generation_equals_onnxruntime(artifacts, family):
    files, artifact = artifacts(family)
    prompt = [1, 2, 3, 50, 60]
    ours = generate(Engine(artifact), prompt, 16)["generated_ids"]
    assert ours == OrtDecoder(files.onnx).greedy(prompt, 16)


def test_sampling_is_seeded(artifacts):
    _, artifact = artifacts("llama")
    engine = Engine(artifact)
    runs = [generate(engine, [5, 6], 12, temperature=1.5, top_k=20, top_p=0.9, seed=s)["generated_ids"] for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_runtime_alone_generates_the_same_tokens(artifacts):
    """Run the artifact in a process where the compiler stack (onnx, torch, picompile, ...) cannot import."""
    _, artifact = artifacts("opt")
    expected = generate(Engine(artifact), [4, 8, 15], 10)["generated_ids"]
    out = run_without_compiler_stack(f"from runtime import Engine, generate; "
                                     f"print(generate(Engine({str(artifact)!r}), [4, 8, 15], 10)['generated_ids'])")
    assert out.strip() == str(expected)


def test_cli_build_dump_run_eval_inspect(tiny_models, tmp_path, capsys):
    files = tiny_models("llama")
    out, dumps = tmp_path / "m.pic", tmp_path / "ir"
    assert main(["build", str(files.onnx), "--target", "cpu", "-o", str(out), "--max-context", "48", "--dense",
                 "--dump-ir", str(dumps)]) == 0
    capsys.readouterr()
    dumped = sorted(p.name for p in dumps.glob("*.onnx"))
    assert dumped == ["00-import.onnx", "01-recognise.onnx", "02-partition.onnx", "03-fuse.onnx", "04-place.onnx",
                      "05-select-kernels.onnx", "06-plan-buffers.onnx", "07-compile.onnx", "08-schedule.onnx"]
    for name in dumped:
        onnx.checker.check_model(onnx.load(str(dumps / name)))
        assert (dumps / name.replace(".onnx", ".txt")).read_text().strip()
    assert "picompile.FFN" in (dumps / "01-recognise.txt").read_text()
    assert "picompile.Call" in (dumps / "05-select-kernels.txt").read_text()

    assert main(["run", str(out), "--prompt-ids", "1,2,3", "-n", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"prompt_ids", "generated_ids", "prefill_ms", "decode_tokens_per_s"}
    assert result["prompt_ids"] == [1, 2, 3] and len(result["generated_ids"]) == 6
    assert result["generated_ids"] == OrtDecoder(files.onnx).greedy([1, 2, 3], 6)

    assert main(["run", str(out), "--prompt-ids", "1,2,3", "-n", "6", "--json", "--profile"]) == 0
    profiled = json.loads(capsys.readouterr().out)
    profile = profiled["profile_ms_per_token"]
    assert {"attention", "ffn_up", "ffn_down", "norm", "head", "embed", "overhead", "wall"} <= set(profile)
    parts = sum(v for k, v in profile.items() if k != "wall")
    assert abs(parts - profile["wall"]) <= 0.05 * profile["wall"]  # the classes and the overhead add up
    by_role = profiled["weight_bytes_per_token_by_role"]  # each class's weights, adding up to the total
    assert sum(by_role.values()) == pytest.approx(profiled["weight_bytes_per_token"])
    assert by_role["head"] == 64 * 128 * 4 and set(profiled["weight_gbs_by_role"]) == set(by_role)
    # as a user runs it: a fresh process, where the runtime has loaded TVM before the profile prices the calls
    done = subprocess.run([sys.executable, "-m", "picompile", "run", str(out), "--prompt-ids", "1,2,3", "-n", "2",
                           "--profile"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ms/token" in done.stderr, done.stderr  # (the profile goes to stderr)

    assert main(["eval", str(out), "--reference", str(files.onnx), "--tokens", str(files.heldout),
                 "--max-sequences", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_abs_logit_diff"] < 1e-4
    assert report["top1_agreement"] == 1.0
    assert abs(report["ppl_compiled"] - report["ppl_reference"]) < 1e-3 * report["ppl_reference"]
    assert abs(report["kl_mean"]) < 1e-6

    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["num_layers"] == 2 and info["model"]["max_context"] == 48
    assert any(k.startswith("attention") for k in info["kernels"])


def test_damaged_artifacts_are_refused(artifacts, tmp_path, capsys):
    _, artifact = artifacts("opt")
    damaged = tmp_path / "damaged.pic"
    shutil.copytree(artifact, damaged)
    weights = damaged / "weights" / "cpu.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["run", str(damaged), "--prompt-ids", "1"]) == 2
    assert "damaged" in capsys.readouterr().err

    newer = tmp_path / "newer.pic"
    shutil.copytree(artifact, newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["format_version"] = 99
    (newer / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", str(newer), "--prompt-ids", "1"]) == 2
    assert "format version 99" in capsys.readouterr().err

    assert main(["run", str(artifact), "--prompt-ids", "1,99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["run", str(artifact), "--prompt-ids", "1", "-n", "1000"]) == 2
    assert "max context" in capsys.readouterr().err


def test_rebuild_replaces_the_artifact_and_a_failed_build_keeps_it(tiny_models, tmp_path, capsys):
    files = tiny_models("opt")
    out = tmp_path / "m.pic"
    assert main(["build", str(files.onnx), "-o", str(out), "--dense", "--max-context", "32"]) == 0
    assert load_manifest(out).model.max_context == 32
    assert main(["build", str(files.onnx), "-o", str(out), "--dense", "--max-context", "40"]) == 0
    assert load_manifest(out).model.max_context == 40
    # OPT's learned positions end at 256: a longer context is refused and the old artifact stays
    assert main(["build", str(files.onnx), "-o", str(out), "--dense", "--max-context", "100000"]) == 2
    assert "learned positions" in capsys.readouterr().err
    assert load_manifest(out).model.max_context == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pic"]


def test_inspect_into_a_closed_pipe_exits_quietly(artifacts):
    """`picompile inspect ART --json | head -c 1`: the reader left before the output came; no traceback, exit 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, artifact = artifacts("opt")
    root = Path(__file__).resolve().parents[1]
    read, write = os.pipe()
    os.close(read)  # nobody will read: every write to the pipe fails (EPIPE)
    done = subprocess.run([sys.executable, "-m", "picompile", "inspect", str(artifact), "--json"], cwd=root,
                          stdout=write, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_run_refuses_an_artifact_larger_than_available_memory(artifacts, capsys, monkeypatch):
    """Loading is refused up front, with both numbers, before any weight is read."""
    import runtime.artifact
    import runtime.engine

    _, artifact = artifacts("opt")
    needed = runtime.artifact.host_bytes(load_manifest(artifact))
    weights = sum(p.stat().st_size for p in (artifact / "weights").glob("*.safetensors"))
    assert needed >= weights  # every weight is a buffer the engine holds
    monkeypatch.setattr(runtime.engine, "available_memory_bytes", lambda: needed - 1)
    monkeypatch.setattr(runtime.engine, "read_safetensors", lambda path: pytest.fail("read weights before refusing"))
    assert main(["run", str(artifact), "--prompt-ids", "1,2", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this artifact needs")
    assert runtime.artifact.format_size(needed) in err[0] and runtime.artifact.format_size(needed - 1) in err[0]
    monkeypatch.undo()
    monkeypatch.setattr(runtime.engine, "available_memory_bytes", lambda: needed)  # exactly enough: it runs
    assert main(["run", str(artifact), "--prompt-ids", "1,2", "-n", "2"]) == 0


def test_eval_runs_the_reference_layer_by_layer_where_onnxruntime_could_not_hold_it(tiny_models, tmp_path, capsys,
                                                                                     monkeypatch):
    """A model too big for onnxruntime (made so here) is still eval's reference: run one layer at a time, its
    logits are the whole model's, so the report is the same."""
    from passes import layer_reference

    files = tiny_models("llama")
    out = tmp_path / "m.pic"
    assert main(["build", str(files.onnx), "-o", str(out), "--max-context", "48", "--dense"]) == 0
    command = ["eval", str(out), "--reference", str(files.onnx), "--tokens", str(files.heldout),
               "--max-sequences", "2", "--json"]
    capsys.readouterr()
    assert main(command) == 0
    whole = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(layer_reference, "needs_layers", lambda source: True)
    assert main(command) == 0
    layered = json.loads(capsys.readouterr().out)
    assert layered["positions"] == whole["positions"] > 0
    for key in ("kl_mean", "ppl_reference", "max_abs_logit_diff"):
        assert layered[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-9), key
