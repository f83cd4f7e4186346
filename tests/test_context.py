"""The context an artifact is built for: by default the model's trained context (a GGUF file's
<arch>.context_length, config.json's max_position_embeddings beside an ONNX file), capped by the KV memory budget
and printed; an explicit --max-context wins. Whatever the context, a step's buffers hold at most
passes.sizes.PREFILL_ROWS rows, and the engine prefills a longer prompt in steps with the logits of one step."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest

import gguf_files as gf
from passes import context
from passes.context import choose_context, trained_context
from passes.front_end import load
from passes.import_gguf import reference_onnx
from passes.reference import OrtDecoder
from passes.sizes import PREFILL_ROWS
from picompile.cli import main
from runtime import Engine, load_manifest

TRAINED = 1024  # the tiny file's context_length: past PREFILL_ROWS, so that its prompts may take several steps
TINY = gf.Tiny(context=TRAINED)
KV_PER_TOKEN = TINY.layers * 2 * TINY.kv_heads * TINY.head_dim * 4  # float32 keys and values: 512 bytes


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("context") / "tiny.gguf"
    gf.write(path, TINY)
    return path


def _build(path, out, capsys, *extra) -> tuple[list[str], str]:
    assert main(["build", str(path), "--dense", "--target", "cpu", "-o", str(out), *extra]) == 0
    captured = capsys.readouterr()
    return captured.out.splitlines(), captured.err


@pytest.fixture(scope="module")
def default_build(tiny_file, tmp_path_factory):
    """The tiny file built without --max-context: (artifact, its stdout lines)."""
    out = tmp_path_factory.mktemp("context-default") / "tiny.pic"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(io.StringIO()):
        patch.setattr(context, "available_memory_bytes", lambda: 64 << 30)  # room for any KV cache here
        assert main(["build", str(tiny_file), "--dense", "--target", "cpu", "-o", str(out)]) == 0
    return out, stdout.getvalue().splitlines()


def test_the_default_context_is_the_files_trained_context(tiny_file, default_build):
    out, lines = default_build
    assert trained_context(tiny_file) == (TRAINED, "the file's")
    assert lines[0] == f"context {TRAINED} tokens (the file's trained context; KV cache 512.00 KiB per sequence)"
    assert TRAINED * KV_PER_TOKEN == 512 << 10
    manifest = load_manifest(out)
    assert manifest.model.max_context == manifest.options.max_context == TRAINED
    # the context costs the KV cache: every row buffer holds a step's rows, PREFILL_ROWS of them
    rows = {info.shape[0] for info in manifest.buffers.values() if info.kind in ("activation", "input")}
    assert max(rows) == PREFILL_ROWS < TRAINED
    assert {info.shape[1] for info in manifest.buffers.values() if info.kind == "cache"} == {TRAINED}
    engine = Engine(out)
    assert (engine.max_context, engine.prefill_rows, engine.prefill_chunk) == (TRAINED, PREFILL_ROWS, PREFILL_ROWS)


def test_the_kv_memory_budget_caps_the_trained_context(tiny_file, tmp_path, capsys, monkeypatch):
    """A budget of 300 KiB for the KV cache holds 600 tokens of this model: the context is 512 (a multiple of 256)."""
    weights = tiny_file.stat().st_size
    monkeypatch.setattr(context, "available_memory_bytes", lambda: weights + 4 * (300 << 10))
    lines, err = _build(tiny_file, tmp_path / "capped.pic", capsys)
    assert lines[0] == (f"context 512 tokens (the file's {TRAINED} capped by the KV memory budget 300.00 KiB, 25% of "
                        "the memory available beside the weights; --max-context raises it; KV cache 256.00 KiB per "
                        "sequence)")
    assert "warning: --max-context" not in err
    assert load_manifest(tmp_path / "capped.pic").model.max_context == 512


def test_an_explicit_max_context_wins_with_a_warning_past_the_trained_one(tiny_file, tmp_path, capsys, monkeypatch):
    weights = tiny_file.stat().st_size
    monkeypatch.setattr(context, "available_memory_bytes", lambda: weights + 4 * (300 << 10))  # the budget above
    lines, err = _build(tiny_file, tmp_path / "long.pic", capsys, "--max-context", "2048")
    assert lines[0] == "context 2048 tokens (--max-context; KV cache 1.00 MiB per sequence)"
    warnings = [line for line in err.splitlines() if line.startswith("warning: --max-context")]
    assert warnings == [f"warning: --max-context 2048 is past the model's trained context of {TRAINED} tokens (the "
                        "file's); the model has not learned positions past it, and its output there degrades"]
    assert load_manifest(tmp_path / "long.pic").model.max_context == 2048
    lines, err = _build(tiny_file, tmp_path / "short.pic", capsys, "--max-context", "64", "-q")  # no line: quiet
    assert lines == [f"wrote {tmp_path / 'short.pic'}"] and "warning: --max-context" not in err
    assert load_manifest(tmp_path / "short.pic").model.max_context == 64


def test_an_onnx_models_context_comes_from_the_config_beside_it(tiny_models, tmp_path, monkeypatch):
    files = tiny_models("llama")
    model = load(files.onnx)
    per_token = KV_PER_TOKEN  # the tiny llama's caches are the tiny file's: 2 layers, 2 kv heads of 16
    # the tiny models' own config.json (picompile's notes) names no trained context: the default
    assert trained_context(files.onnx) == (None, "")
    choice = choose_context(files.onnx, model, None)
    assert (choice.tokens, choice.kv_bytes) == (256, 256 * per_token)
    assert choice.line() == ("context 256 tokens (the default: the model states no trained context; KV cache "
                             "128.00 KiB per sequence)")
    beside = tmp_path / "model.onnx"
    shutil.copyfile(files.onnx, beside)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 640}))
    assert trained_context(beside) == (640, "config.json's max_position_embeddings")
    choice = choose_context(beside, model, None)
    assert choice.tokens == 640 and choice.line() == (
        "context 640 tokens (the trained context, config.json's max_position_embeddings; KV cache 320.00 KiB per "
        "sequence)")
    assert choose_context(beside, model, 100).line() == "context 100 tokens (--max-context; KV cache 50.00 KiB per sequence)"
    # a GPU target's budget caps it too (never below 256 tokens)
    monkeypatch.setattr(context, "available_memory_bytes", lambda: 64 << 30)
    choice = choose_context(beside, model, None, gpu_bytes=4 * (100 << 10))
    assert choice.tokens == 256 and choice.line() == (
        "context 256 tokens (config.json's max_position_embeddings 640 capped by the KV memory budget 100.00 KiB, "
        "25% of the GPU budget; --max-context raises it; KV cache 128.00 KiB per sequence)")


def test_a_long_prompt_is_prefilled_in_steps_with_the_logits_of_one(tiny_file, default_build, capsys):
    """Chunked prefill: the logits of a prompt prefilled in steps of 7 tokens are those of one step (a prompt of
    PREFILL_ROWS tokens at most), every row and with last_only; a prompt past PREFILL_ROWS runs in steps (the
    artifact has no buffer for more rows) and agrees with onnxruntime on the file's import."""
    out, _ = default_build
    whole, chunked = Engine(out), Engine(out, prefill_chunk=7)
    assert chunked.prefill_chunk == 7
    prompt = np.random.default_rng(0).integers(0, TINY.vocab, 700)
    short = prompt[:PREFILL_ROWS]
    one = whole.forward(short)
    np.testing.assert_allclose(chunked.forward(short), one, atol=1e-5, rtol=0)
    whole.reset()
    chunked.reset()
    last = whole.forward(short, last_only=True)
    assert last.shape == (1, TINY.vocab)
    np.testing.assert_allclose(chunked.forward(short, last_only=True), last, atol=1e-5, rtol=0)
    np.testing.assert_allclose(last, one[-1:], atol=1e-5, rtol=0)
    # decode after a chunked prompt continues from the same cache
    np.testing.assert_allclose(chunked.forward([5]), whole.forward([5]), atol=1e-5, rtol=0)

    whole.reset()
    logits = whole.forward(prompt)  # 700 tokens: two steps of 350
    assert logits.shape == (700, TINY.vocab) and whole.position == 700
    reference = OrtDecoder(reference_onnx(tiny_file)).forward(prompt).reshape(logits.shape)
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
    whole.reset()
    np.testing.assert_allclose(whole.forward(prompt, last_only=True), logits[-1:], atol=1e-5, rtol=0)
    # the command line takes such a prompt too
    assert main(["run", str(out), "--prompt-ids", ",".join(map(str, prompt)), "-n", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["generated_ids"]) == 4
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(out, prefill_chunk=0)
