"""Artifacts defend themselves: the runtime refuses damaged, incomplete or too-new artifacts with one clear
error before loading anything from them, and a build killed at any moment leaves the previous artifact
whole (or nothing), never a partial one."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from picompile import artifact as writer
from picompile.cli import main
from picompile.compiler import build
from picompile.pipeline import Options
from picompile.targets import get_target
from runtime import ArtifactError, Engine, load_manifest
from runtime.artifact import FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(tiny_models, tmp_path_factory):
    files = tiny_models("opt")
    out = tmp_path_factory.mktemp("safety") / "good.pic"
    build(files.onnx, out, get_target("cpu"), Options(dense=True, max_context=32))
    return out


def _flip_byte(relative, at=0.5):
    def damage(directory: Path):
        path = directory / relative
        data = bytearray(path.read_bytes())
        data[int(len(data) * at)] ^= 0x01
        path.write_bytes(bytes(data))
    return damage


def _truncate(relative):
    def damage(directory: Path):
        path = directory / relative
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


def _edit_manifest(change):
    def damage(directory: Path):
        manifest = json.loads((directory / "manifest.json").read_text())
        change(manifest)
        (directory / "manifest.json").write_text(json.dumps(manifest))
    return damage


def _symlink_weights(directory: Path):
    weights = directory / "weights" / "cpu.safetensors"
    moved = directory.parent / f"{directory.name}-elsewhere.safetensors"
    weights.rename(moved)
    weights.symlink_to(moved)


DAMAGE = {
    "truncated weights": (_truncate("weights/cpu.safetensors"), ["weights/cpu.safetensors", "damaged"]),
    "edited weight byte": (_flip_byte("weights/cpu.safetensors", 0.9), ["weights/cpu.safetensors", "damaged"]),
    "edited kernel byte": (_flip_byte("kernels/cpu.so"), ["kernels/cpu.so", "damaged"]),
    "edited schedule byte": (_flip_byte("schedule.json"), ["schedule.json", "damaged"]),
    "missing kernel library": (lambda d: (d / "kernels" / "cpu.so").unlink(), ["kernels/cpu.so", "missing"]),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), ["not a picompile artifact"]),
    "truncated manifest": (_truncate("manifest.json"), ["manifest.json", "damaged"]),
    "newer format": (_edit_manifest(lambda m: m.update(format_version=FORMAT_VERSION + 1)),
                     [f"format version {FORMAT_VERSION + 1}", "newer picompile", "upgrade"]),
    "kernel unlisted": (_edit_manifest(lambda m: m["files"].pop("kernels/cpu.so")), ["does not list kernels/cpu.so"]),
    "file outside": (_edit_manifest(lambda m: m["files"].update({"../x": "0" * 64})), ["outside the artifact"]),
    "model facts gone": (_edit_manifest(lambda m: m.pop("model")), ["'model'", "damaged"]),
    "weights are a link": (_symlink_weights, ["weights/cpu.safetensors", "link"]),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_artifact_is_one_clear_error(artifact, tmp_path, capsys, monkeypatch, case):
    damage, words = DAMAGE[case]
    copy = tmp_path / "copy.pic"
    shutil.copytree(artifact, copy)
    damage(copy)

    # The checks run before the kernel library is opened: a damaged .so must never be dlopened.
    import runtime.engine

    def no_loading():
        raise AssertionError("the kernel library was loaded before the artifact was checked")
    monkeypatch.setattr(runtime.engine, "_tvm_runtime", no_loading)
    with pytest.raises(ArtifactError) as refused:
        Engine(copy)
    for word in words:
        assert word.lower() in str(refused.value).lower(), str(refused.value)

    for command in (["run", copy, "--prompt-ids", "1,2"], ["inspect", copy]):
        assert main([str(a) for a in command]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error:") and words[0].lower() in err[0].lower(), err


def test_only_listed_files_are_read(artifact, tmp_path):
    """A stray file in weights/ (not in the manifest, so not hash-checked) is never read."""
    copy = tmp_path / "copy.pic"
    shutil.copytree(artifact, copy)
    (copy / "weights" / "stray.safetensors").write_bytes(b"\xff" * 64)  # unreadable as safetensors
    logits = Engine(copy).forward([1, 2, 3])
    np.testing.assert_array_equal(logits, Engine(artifact).forward([1, 2, 3]))


def test_build_refuses_to_replace_what_is_not_an_artifact(tiny_models, tmp_path, capsys):
    files = tiny_models("opt")
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    assert main(["build", str(files.onnx), "-o", str(precious), "--dense"]) == 2
    assert "not a picompile artifact" in capsys.readouterr().err
    assert (precious / "thesis.txt").read_text() == "years of work"


def test_stale_staging_of_dead_builds_is_removed_and_live_ones_kept(tmp_path):
    output = tmp_path / "m.pic"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m.pic.tmp-{int(dead.stdout)}-abc"
    stale.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f".m.pic.tmp-{sleeper.pid}-def"
        running.mkdir()
        other = tmp_path / ".n.pic.tmp-1-ghi"  # another output's
        other.mkdir()
        assert writer.remove_stale(output) == [stale]
        assert running.is_dir() and other.is_dir() and not stale.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_replacing_an_artifact_leaves_only_the_new_one(tmp_path, monkeypatch, exchange):
    output = tmp_path / "m.pic"
    output.mkdir()
    (output / "manifest.json").write_text("old")
    if not exchange:  # the fallback where renameat2 is unsupported
        monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    for content in ("new", "newer"):
        staging = writer._staging_dir(output)
        (staging / "manifest.json").write_text(content)
        writer._replace_dir(staging, output)
        assert (output / "manifest.json").read_text() == content
        assert [p.name for p in tmp_path.iterdir()] == ["m.pic"]


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _build_command(model: Path, output: Path, max_context: int) -> list[str]:
    return [sys.executable, "-m", "picompile", "build", str(model), "-o", str(output), "--dense", "--quiet",
            "--max-context", str(max_context)]


def _build(command, env) -> None:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_build_killed_at_any_moment_leaves_the_old_artifact_or_none(tiny_models, tmp_path):
    files = tiny_models("opt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    output = tmp_path / "m.pic"
    started = time.perf_counter()
    _build(_build_command(files.onnx, output, 32), env)
    duration = time.perf_counter() - started
    previous = _tree(output)
    fresh = tmp_path / "fresh.pic"  # built from nothing: after a kill it is complete or absent

    rng = random.Random(1234)
    # The first two kills fall anywhere in the build, the last near its end, where the swap happens.
    kill_at = [rng.uniform(0.2, 1.0) * duration for _ in range(2)] + [rng.uniform(0.85, 1.05) * duration]
    for number, delay in enumerate(kill_at):
        target = fresh if number == 0 else output
        build = subprocess.Popen(_build_command(files.onnx, target, 40), cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        build.send_signal(signal.SIGKILL)
        build.wait()
        if target == fresh and not fresh.exists():
            continue
        manifest = load_manifest(target)  # every listed file present with its hash
        if target == output and manifest["model"]["max_context"] == 32:
            assert _tree(output) == previous
        else:  # the build finished before the kill: the new artifact, complete
            assert manifest["model"]["max_context"] == 40
        visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
        assert set(visible) <= {"m.pic", "fresh.pic"}
        for hidden in tmp_path.glob(".*"):  # leftovers are only ever staging directories
            assert ".tmp-" in hidden.name or ".old-" in hidden.name, hidden.name

    # The next build replaces the artifact and clears what the killed ones left.
    _build(_build_command(files.onnx, output, 48), env)
    assert load_manifest(output)["model"]["max_context"] == 48
    assert not list(tmp_path.glob(".m.pic.*"))
