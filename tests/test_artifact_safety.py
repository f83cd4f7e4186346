"""Artifacts defend themselves: the runtime refuses damaged, incomplete, too-new or hand-edited artifacts
with one clear error before loading anything from them (a manifest that disagrees with its verified files
is refused naming the field, so no claim of it can make a kernel read out of bounds), eval refuses a
reference it cannot compare the artifact with, and a build killed at any moment leaves the previous
artifact whole (or nothing), never a partial one."""

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
from passes.pipeline import Options
from passes.targets import get_target
from runtime import ArtifactError, Engine, load_manifest
from runtime.artifact import DIGEST_KEY, FORMAT_VERSION, seal_manifest
from runtime.calls import Role, schedule_calls

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


def _edit_manifest(change, seal: bool = True):
    """An edit of the manifest; `seal` recomputes its digest afterwards (as a deliberate editor could), so that
    the checks behind the digest are what must refuse it."""
    def damage(directory: Path):
        manifest = json.loads((directory / "manifest.json").read_text())
        change(manifest)
        (directory / "manifest.json").write_text(json.dumps(seal_manifest(manifest) if seal else manifest))
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
    "older format": (_edit_manifest(lambda m: m.update(format_version=1)), ["format version 1", "rebuild it"]),
    "edited manifest": (_edit_manifest(lambda m: m["model"].update(vocab_size=1025), seal=False),
                        ["manifest.json was edited or damaged (sha256 mismatch)", "rebuild"]),
    "digest edited": (_edit_manifest(lambda m: m.update({DIGEST_KEY: "0" * 64}), seal=False),
                      ["manifest.json was edited or damaged (sha256 mismatch)"]),
    "digest removed": (_edit_manifest(lambda m: m.pop(DIGEST_KEY), seal=False),
                       ["manifest.json was edited or damaged (sha256 mismatch)"]),
    "signatures unlisted": (_edit_manifest(lambda m: m["files"].pop("kernels/signatures.json")),
                            ["does not list kernels/signatures.json"]),
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


def _set(*path_and_value):
    """An edit setting manifest[path...] = value (several, as path, value, path, value ...)."""
    def change(manifest):
        for keys, value in zip(path_and_value[::2], path_and_value[1::2]):
            entry = manifest
            for key in keys[:-1]:
                entry = entry[key]
            entry[keys[-1]] = value
    return change


def _context_everywhere(length):
    """max_context changed consistently: the model facts, the options and every row buffer and KV cache."""
    def change(manifest):
        manifest["model"]["max_context"] = manifest["options"]["max_context"] = length
        for info in manifest["buffers"].values():
            if info["kind"] in ("activation", "input") and info["shape"][0] > 1:
                info["shape"][0] = length
            elif info["kind"] == "cache":
                info["shape"][1] = length
    return change


def _drop_buffers(*names):
    def change(manifest):
        for name in names:
            manifest["buffers"].pop(name)
    return change


# The tiny OPT artifact: vocabulary 128 (embed.tokens [128, 64]), 2 layers, max context 32 (KV caches [4, 32, 16],
# learned positions embed.positions [32, 64]). Every edit is sealed (its digest recomputed), so the consistency
# checks behind the digest must refuse it, naming the field.
CLAIMS = {
    "vocab size": (_set(("model", "vocab_size"), 1025), ["model.vocab_size is 1025", "embed.tokens", "128 rows"]),
    "vocab size and logits": (_set(("model", "vocab_size"), 1025, ("buffers", "logits", "shape"), [32, 1025]),
                              ["model.vocab_size is 1025", "128 rows"]),
    "logits width": (_set(("buffers", "logits", "shape"), [32, 1025]), ["buffers.logits", "[32, 1025]", "128"]),
    "weight shape": (_set(("buffers", "embed.tokens", "shape"), [1025, 64]),
                     ["buffers.embed.tokens.shape is [1025, 64]", "weights/cpu.safetensors", "[128, 64]"]),
    "weight dtype": (_set(("buffers", "layers.0.ffn.w_up", "dtype"), "float16"),
                     ["buffers.layers.0.ffn.w_up.dtype is float16", "float32"]),
    "weight unlisted": (_drop_buffers("lm_head.weight"), ["lm_head.weight", "buffers does not list"]),
    "weight made a cache": (_set(("buffers", "layers.1.ffn.b_up", "kind"), "cache"),
                            ["buffers.layers.1.ffn.b_up.kind is 'cache'", "as a weight"]),
    "cache length": (_set(("buffers", "cache.0.key", "shape"), [4, 64, 16]),
                     ["buffers.cache.0.key.shape is [4, 64, 16]", "model.max_context (32)"]),
    "cache heads": (_set(("buffers", "cache.1.value", "shape"), [8, 32, 16]),
                    ["buffers.cache.1.value.shape is [8, 32, 16]", "takes [4, 32, 16]"]),
    "activation width": (_set(("buffers", "act.qkv", "shape"), [32, 100]),
                         ["buffers.act.qkv.shape is [32, 100]", "takes [1, 192]"]),
    "activation rows": (_set(("buffers", "act.attn", "shape"), [16, 64]), ["buffers.act.attn.shape is [16, 64]",
                                                                           "buffers.input_ids (32)"]),
    "input ids dtype": (_set(("buffers", "input_ids", "dtype"), "int32"), ["buffers.input_ids", "int64"]),
    "max context": (_set(("model", "max_context"), 64), ["buffers.cache.0.key.shape is [4, 32, 16]",
                                                          "model.max_context (64)"]),
    "max context and options": (_set(("model", "max_context"), 64, ("options", "max_context"), 64),
                                ["cache.0.key", "model.max_context (64)"]),
    "prefill rows past the context": (_set(("model", "max_context"), 16, ("options", "max_context"), 16),
                                      ["model.max_context is 16", "buffers.input_ids has 32 rows"]),
    "max context everywhere": (_context_everywhere(64), ["model.max_context is 64", "embed.positions", "32 rows"]),
    "smaller max context everywhere": (_context_everywhere(16), ["buffers.cache.0.key.shape is [4, 16, 16]",
                                                                 "takes [4, 32, 16]"]),
    "layer count": (_set(("model", "num_layers"), 3), ["model.num_layers is 3", "2 layers"]),
    "layer report": (_set(("layers",), [{"layer": 0}]), ["layers (the per-layer report) has 1 entries", "2 layers"]),
    "a layer's caches dropped": (_drop_buffers("cache.1.key", "cache.1.value"), ["buffers has no entry for cache.1.key"]),
    "call count": (_set(("model", "num_calls"), 5), ["model.num_calls is 5", "19 calls"]),
    "max batch of one": (_set(("model", "max_batch"), 1), ["model.max_batch is 1", "has a batch kernel"]),
    "max batch past the prefill rows": (_set(("model", "max_batch"), 33), ["model.max_batch is 33",
                                                                            "2 to 32 sequences"]),
    "max batch not a number": (_set(("model", "max_batch"), "8"), ["model.max_batch is '8'", "not a non-negative"]),
}


@pytest.mark.parametrize("case", CLAIMS)
def test_a_manifest_that_disagrees_with_its_files_is_refused(artifact, tmp_path, capsys, monkeypatch, case):
    """The issue-12 attack and its relatives: a hand-edited (and resealed) manifest. Refused naming the field, exit
    2, before the kernel library is loaded (so no kernel can read out of bounds), and `run` prints nothing."""
    change, words = CLAIMS[case]
    copy = tmp_path / "copy.pic"
    shutil.copytree(artifact, copy)
    _edit_manifest(change)(copy)
    assert load_manifest(copy)  # the digest matches: only the consistency checks stand in the way

    import runtime.engine

    def no_loading():
        raise AssertionError("the kernel library was loaded before the manifest was checked")
    monkeypatch.setattr(runtime.engine, "_tvm_runtime", no_loading)
    with pytest.raises(ArtifactError) as refused:
        Engine(copy)
    message = str(refused.value)
    assert message.startswith("manifest.json disagrees with its files: "), message
    for word in words:
        assert word in message, message

    for command in (["run", copy, "--prompt-ids", "1,2,700"], ["inspect", copy]):
        assert main([str(a) for a in command]) == 2
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert out == "" and len(lines) == 1 and lines[0] == f"error: {message}", (out, err)


def test_token_ids_are_checked_against_the_embedding_table(artifact, capsys):
    engine = Engine(artifact)
    assert engine.vocab_size == engine.buffers["embed.tokens"].shape[0] == 128
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.forward([1, 2, 700])
    assert main(["run", str(artifact), "--prompt-ids", "1,2,700"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --prompt-ids: id 700 is outside the vocabulary (size 128)")


def test_the_writer_seals_the_manifest(artifact):
    """Format 2: the manifest carries the digest of the rest of it, and lists the kernel signatures."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2
    assert seal_manifest(manifest)[DIGEST_KEY] == manifest[DIGEST_KEY]
    assert "kernels/signatures.json" in manifest["files"]
    signatures = json.loads((artifact / "kernels" / "signatures.json").read_text())
    embed = next(call for call in schedule_calls(json.loads((artifact / "schedule.json").read_text()))
                 if call.role is Role.EMBED)
    assert signatures[embed.decode][1] == {"shape": [128, 64], "dtype": "float32"}  # the table, as compiled


# ---------------------------------------------------------------- eval's reference


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    """Token files: ids 1..9 (in every vocabulary here), and with 100 (past a 96-token vocabulary)."""
    import bad_inputs

    directory = tmp_path_factory.mktemp("eval")
    np.save(directory / "tokens.npy", np.arange(1, 10, dtype=np.int64)[None])
    np.save(directory / "past96.npy", np.array([[1, 2, 100, 3, 4, 5]], np.int64))
    bad_inputs.cnn(None, directory / "cnn.onnx")
    return directory


def _eval_fails(capsys, artifact, reference, tokens, *words):
    assert main(["eval", str(artifact), "--reference", str(reference), "--tokens", str(tokens)]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


def test_eval_refuses_a_reference_that_is_not_a_decoder(artifact, eval_files, capsys):
    """A CNN as the reference: refused as build refuses it (was: an onnxruntime error about its inputs, exit 1)."""
    _eval_fails(capsys, artifact, eval_files / "cnn.onnx", eval_files / "tokens.npy",
                "reference", "cnn.onnx", "not a decoder LLM export", "lacks input_ids", "Conv")


def test_eval_refuses_a_reference_of_another_vocabulary(artifact, eval_files, tiny_models, capsys):
    """A decoder with 96 tokens against the 128-token artifact: refused, naming both; token ids past the
    reference's vocabulary are named as such (was: onnxruntime's Gather error, exit 1)."""
    other = tiny_models("opt", "legacy", vocab_size=96).onnx  # legacy: this decoder's export is all that matters
    _eval_fails(capsys, artifact, other, eval_files / "tokens.npy",
                "vocabulary of 96 tokens", str(artifact), "has 128")
    _eval_fails(capsys, artifact, other, eval_files / "past96.npy",
                "past96.npy holds token id 100", "vocabulary of the reference", "96 tokens")


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
        if target == output and manifest.model.max_context == 32:
            assert _tree(output) == previous
        else:  # the build finished before the kill: the new artifact, complete
            assert manifest.model.max_context == 40
        visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
        assert set(visible) <= {"m.pic", "fresh.pic"}
        for hidden in tmp_path.glob(".*"):  # leftovers are only ever staging directories
            assert ".tmp-" in hidden.name or ".old-" in hidden.name, hidden.name

    # The next build replaces the artifact and clears what the killed ones left (in this process: the same build
    # without starting Python and TVM again)
    assert main(_build_command(files.onnx, output, 48)[3:]) == 0
    assert load_manifest(output).model.max_context == 48
    assert not list(tmp_path.glob(".m.pic.*"))


def test_weights_file_written_tensor_by_tensor_reads_back_with_safetensors(tmp_path):
    """The compiler's own safetensors writer (it streams each array instead of joining them in memory): the
    safetensors library and the runtime's reader both read back every dtype and odd shape exactly."""
    import safetensors.numpy

    from picompile.artifact import write_safetensors
    from runtime.artifact import read_safetensors

    rng = np.random.default_rng(0)
    tensors = {"w16": rng.standard_normal((3, 5)).astype(np.float16), "w32": rng.standard_normal(7).astype(np.float32),
               "q": rng.integers(-8, 8, (2, 3, 3)).astype(np.int8), "packed": rng.integers(0, 255, 5).astype(np.uint8),
               "rows": np.arange(3, dtype=np.int64), "ids": np.arange(4, dtype=np.int32)[::2]}  # a strided view too
    path = tmp_path / "w.safetensors"
    write_safetensors(tensors, path)
    for read in (safetensors.numpy.load_file(str(path)), read_safetensors(path)):
        assert read.keys() == tensors.keys()
        for name, array in tensors.items():
            assert read[name].dtype == array.dtype and np.array_equal(read[name], array), name
