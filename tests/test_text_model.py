"""The model trained on real text (examples/text_model.py): tokenizer (its ids, and its tokenizer.json that
the artifact carries), corpus split, training that learns, and a picompile build of it with its calibration
file that speaks text."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from examples import text_model
from picompile.cli import main
from runtime.text import TOKENIZER_FILES, TextTokenizer, load_tokenizer


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


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_text):
    return TextTokenizer(tiny_text.dir)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=64))
def test_the_model_directorys_tokenizer_json_is_text_model_encode_exactly(tiny_tokenizer, text):
    assume(text_model.BOS_TEXT not in text and text_model.PAD_TEXT not in text)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert ids == text_model.encode(text).tolist()
    assert tiny_tokenizer.encode(text) == text_model.encode(text, bos=True).tolist()  # BOS first, as in training
    assert tiny_tokenizer.decode(ids) == text == text_model.decode(ids)
    stream = tiny_tokenizer.stream()  # what `picompile run -p` prints, piece by piece
    assert "".join(stream.push(i) for i in [*ids, text_model.BOS]) + stream.flush() == text


def test_tokenizer_special_ids_and_text_the_corpus_never_holds(tiny_text, tiny_tokenizer):
    assert tiny_tokenizer.vocab_size == text_model.VOCAB
    assert tiny_tokenizer.bos_id == text_model.BOS and tiny_tokenizer.eos_ids == {text_model.BOS}
    assert tiny_tokenizer.decode([text_model.BOS, 104, 105, text_model.PAD]) == "hi"
    # the one difference from text_model.encode: the library reads the special tokens' own text as them
    assert tiny_tokenizer.encode(text_model.BOS_TEXT, add_special_tokens=False) == [text_model.BOS]
    root = text_model.stdlib_root()
    holding = [f for f in text_model.corpus_files() if any(
        special in (root / f).read_text(encoding="utf-8", errors="replace")
        for special in (text_model.BOS_TEXT, text_model.PAD_TEXT))]
    assert holding == [], "choose other special-token text: these corpus files hold it"
    config = json.loads((tiny_text.dir / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == text_model.TEXT_PRESETS["tiny"]["context"]
    assert json.loads((tiny_text.dir / "generation_config.json").read_text())["eos_token_id"] == text_model.BOS


def test_a_cached_model_without_tokenizer_files_gets_them_without_training(tiny_text, tmp_path, monkeypatch):
    """A directory trained before tokenizer.json was written: asking for it again adds the files, nothing else."""
    old = tmp_path / "models" / tiny_text.dir.name
    shutil.copytree(tiny_text.dir, old)
    for name in TOKENIZER_FILES:
        (old / name).unlink(missing_ok=True)
    before = {p.name: p.stat().st_mtime_ns for p in old.iterdir()}
    monkeypatch.setenv("PICOMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(text_model, "make_text_model", lambda *a, **k: pytest.fail("trained again"))
    again = text_model.cached_text_model("tiny", seed=0, threads=1)
    assert again.dir == old
    assert {p.name: p.stat().st_mtime_ns for p in old.iterdir() if p.name in before} == before
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in tiny_text.dir.iterdir())
    assert [(old / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")] == \
        [(tiny_text.dir / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")]


@pytest.fixture(scope="module")
def text_artifact(tiny_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("text") / "text.pic"
    assert main(["build", str(tiny_text.onnx), "--target", "cpu", "-o", str(out), "--calib", str(tiny_text.calib),
                 "--max-context", "64", "-q"]) == 0
    return out


def test_picompile_builds_the_trained_model_with_its_calibration(tiny_text, text_artifact, capsys):
    from picompile.evaluate import evaluate
    from passes.reference import OrtDecoder
    from passes.tokens import read_tokens
    from runtime import Engine

    out = text_artifact
    engine = Engine(out)
    report = evaluate(engine, OrtDecoder(tiny_text.onnx), read_tokens(tiny_text.heldout)[:2])
    meta = json.loads(tiny_text.config.read_text())
    # the exported graph is the trained model: onnxruntime's perplexity on held-out text is the trained one's
    # (on two of the windows, so near, not equal), far below the untrained model's
    assert report["ppl_reference"] < math.exp(meta["heldout_loss"]["untrained"] - 0.5)
    assert report["top1_agreement"] > 0.8
    # the tokenizer beside model.onnx travels in the artifact: `run -p` speaks text
    assert load_tokenizer(out).encode("def f(x):") == text_model.encode("def f(x):", bos=True).tolist()
    assert main(["run", str(out), "-p", "def f(x):", "--max-new-tokens", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["prompt_ids"] == text_model.encode("def f(x):", bos=True).tolist() and result["generated_ids"]
    assert result["text"] == text_model.decode(result["generated_ids"])


def test_the_server_speaks_the_artifacts_own_tokenizer(text_artifact, capsys):
    """`serve`'s default tokenizer is the artifact's tokenizer.json (runtime.text), as `run -p` reads it: a string
    prompt's greedy completion is the CLI's text, and chat applies the tokenizer config's template."""
    from test_serve import client, live_server

    from runtime import Engine

    assert main(["run", str(text_artifact), "-p", "def f(x):", "--max-new-tokens", "12", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.splitlines()[-1])
    tokenizer = load_tokenizer(text_artifact)
    messages = [{"role": "user", "content": "print('hi')"}]
    with live_server(Engine(text_artifact, slots=2), parallel=2) as url:
        answer = client(url).completions.create(model="any", prompt="def f(x):", max_tokens=12, temperature=0)
        assert answer.choices[0].text == cli["text"]
        assert answer.usage.prompt_tokens == len(cli["prompt_ids"])
        chat = client(url).chat.completions.create(model="any", messages=messages, max_tokens=4, temperature=0)
        assert chat.usage.prompt_tokens == len(tokenizer.chat_ids(messages))
        ids = chat.choices[0].model_extra["token_ids"]
        assert chat.choices[0].message.content == tokenizer.decode(ids)


# ----------------------------------------------------------------------------- a BPE vocabulary (the code preset's)


@pytest.fixture(scope="module")
def tiny_bpe_text():
    """The tiny preset with a 384-token BPE: the code preset's path (tokenizer trained on the training files,
    model on its ids) in seconds."""
    return text_model.cached_text_model("tiny", seed=0, threads=1, vocab=384)


def test_a_bpe_vocabulary_is_trained_deterministically_and_round_trips_any_text():
    texts = text_model.file_texts(text_model.split_files(text_model.corpus_files())[0][:40])
    first, second = text_model.Vocabulary.bpe(texts, 320), text_model.Vocabulary.bpe(texts, 320)
    assert first.tokenizer.to_str() == second.tokenizer.to_str()
    assert first.size == 320 and (first.bos, first.pad) == (text_model.BPE_BOS, text_model.BPE_PAD)
    [ids] = first.encode_texts([texts[0]])
    assert ids[0] == first.bos and text_model.BPE_PAD not in ids[1:]
    assert len(ids) < len(texts[0].encode("utf-8")) / 1.2  # merges: fewer tokens than bytes
    text = "def f(x):\n    return x ** 2  # \u00e9t\u00e9 \u2192 \U0001f40d\n"  # unseen characters: byte tokens
    assert first.tokenizer.decode(first.encode_texts([text])[0].tolist()) == text


def test_a_bpe_text_model_carries_its_tokenizer_into_the_artifact(tiny_bpe_text, tmp_path, capsys):
    meta = json.loads(tiny_bpe_text.config.read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["vocab_size"] == 384
    assert meta["tokenizer"]["bytes_per_token"] > 1.5
    assert meta["hf_config"]["vocab_size"] == 384 and meta["hf_config"]["pad_token_id"] == text_model.BPE_PAD
    assert meta["heldout_loss"]["trained"] < meta["heldout_loss"]["untrained"] - 0.5  # 40 steps: token statistics
    calib = np.load(tiny_bpe_text.calib)
    assert calib.max() < 384 and calib.min() >= 0
    # the model directory's tokenizer.json (what build copies) is the one the ids were made with
    tokenizer = TextTokenizer(tiny_bpe_text.dir)
    assert tokenizer.bos_id == text_model.BPE_BOS and tokenizer.eos_ids == {text_model.BPE_BOS}
    held_texts = text_model.file_texts(text_model.split_files(text_model.corpus_files())[1])
    joined = np.concatenate([tokenizer.encode(text) for text in held_texts]).astype(np.int64).tobytes()
    assert all(row.astype(np.int64).tobytes() in joined for row in np.load(tiny_bpe_text.heldout)[:3])
    out = tmp_path / "bpe.pic"
    assert main(["build", str(tiny_bpe_text.onnx), "--target", "cpu", "-o", str(out), "--calib",
                 str(tiny_bpe_text.calib), "--max-context", "64", "-q"]) == 0
    assert main(["run", str(out), "-p", "def f(x):", "--max-new-tokens", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["prompt_ids"] == tokenizer.encode("def f(x):") and result["prompt_ids"][0] == text_model.BPE_BOS
    assert result["text"] == tokenizer.decode(result["generated_ids"])
