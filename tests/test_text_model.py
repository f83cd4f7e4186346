"""The model trained on real text (examples/text_model.py): tokenizer, corpus split, training that learns,
and a picompile build of it with its calibration file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from examples import text_model
from picompile.cli import main


def test_byte_tokenizer_round_trips_any_text():
    text = "def f(x):\n    return x ** 2  # \u00e9t\u00e9 \u2192 \U0001f40d\n"
    ids = text_model.encode(text, bos=True)
    assert ids[0] == text_model.BOS and ids.dtype == np.int64
    assert ids[1:].max() < 256 and len(ids) == 1 + len(text.encode("utf-8"))
    assert text_model.decode(ids) == text
    assert text_model.decode([text_model.PAD, *text_model.encode("ab")]) == "ab"


def test_corpus_split_is_deterministic_disjoint_and_by_file():
    files = text_model.corpus_files()
    assert len(files) > 100 and files == sorted(files, key=lambda p: p.as_posix())
    assert not any("site-packages" in f.parts or "test" in f.parts[:-1] for f in files)
    train, held = text_model.split_files(files)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(files)
    assert 0.03 < len(held) / len(files) < 0.2
    # a file's side depends on its path only: the split of a subset is the subset of the split
    sub_train, sub_held = text_model.split_files(files[::3])
    assert set(sub_held) == set(held) & set(files[::3])


@pytest.fixture(scope="module")
def tiny_text():
    return text_model.cached_text_model("tiny", seed=0, threads=1)


def test_training_lowers_the_heldout_loss_and_relu_sparsity_is_measured(tiny_text):
    meta = json.loads(tiny_text.config.read_text())
    loss = meta["heldout_loss"]
    # untrained: about log(vocab) = 5.55 nats/byte; a few dozen steps learn at least the byte statistics
    assert loss["untrained"] > 5.0
    assert loss["trained"] < loss["untrained"] - 1.0, loss
    assert meta["measured_sparsity"]["per_layer"] and all(0 < s < 1 for s in meta["measured_sparsity"]["per_layer"])
    assert meta["synthetic_sparsity"] is None and meta["predictability"] is None
    calib, heldout = np.load(tiny_text.calib), np.load(tiny_text.heldout)
    context = text_model.TEXT_PRESETS["tiny"]["context"]
    assert calib.shape[1] == heldout.shape[1] == context and calib.max() <= text_model.BOS
    # held-out windows are text of the held-out files, which training never saw
    held_stream = text_model.token_stream(text_model.split_files(text_model.corpus_files())[1])
    joined = held_stream.tobytes()
    assert all(row.astype(np.int64).tobytes() in joined for row in heldout[:3])
    assert meta["calib_tokens"] == calib.size
    # cached: asking again finds the same directory without training
    again = text_model.cached_text_model("tiny", seed=0, threads=1)
    assert again.dir == tiny_text.dir


def test_picompile_builds_the_trained_model_with_its_calibration(tiny_text, tmp_path):
    from picompile.evaluate import evaluate
    from picompile.reference import OrtDecoder
    from picompile.tokens import read_tokens
    from runtime import Engine

    out = tmp_path / "text.pic"
    assert main(["build", str(tiny_text.onnx), "--target", "cpu", "-o", str(out), "--calib", str(tiny_text.calib),
                 "--max-context", "64", "-q"]) == 0
    engine = Engine(out)
    report = evaluate(engine, OrtDecoder(tiny_text.onnx), read_tokens(tiny_text.heldout)[:2])
    meta = json.loads(tiny_text.config.read_text())
    # the exported graph is the trained model: onnxruntime's perplexity on held-out text is the trained one's
    # (on two of the windows, so near, not equal), far below the untrained model's
    assert report["ppl_reference"] < math.exp(meta["heldout_loss"]["untrained"] - 0.5)
    assert report["top1_agreement"] > 0.8
