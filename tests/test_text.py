"""Text at the edges: the tokenizer travels in the artifact (listed and hashed), `run -p` streams text, `chat`
reads turns from stdin through the chat template, --calib takes text, and the incremental detokenizer is exact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picompile.cli import main
from passes.tokens import read_calibration
from runtime import Engine, GenerationStats, generate, generate_stream, load_manifest
from runtime.artifact import ArtifactError
from runtime.text import TextTokenizer, load_tokenizer
from test_cli_errors import assert_user_error
from text_tokenizers import BOS, CHAT_TEMPLATE, write_byte_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "def fib(n):"
CALIB_FILES = {"a.txt": "def add(a, b):\n    return a + b\n" * 3, "notes/b.md": "# Notes \u00e9\u2192\U0001f40d\n" * 4,
               "c.py": "import os\nprint(os.sep)\n" * 5, "ignored.json": "{\"not\": \"calibration\"}"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_byte_tokenizer(tmp_path_factory.mktemp("tokenizer"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return TextTokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib-text")
    for name, text in CALIB_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def artifact(tiny_models, tokenizer_dir, calib_dir, tmp_path_factory):
    """A sparse build of tiny OPT (vocabulary 300: the byte tokenizer's 258 fit) with the tokenizer, profiled
    on the text directory alone."""
    model = tiny_models("opt", vocab_size=300).onnx
    out = tmp_path_factory.mktemp("artifacts") / "text.pic"
    code = main(["build", str(model), "--tokenizer", str(tokenizer_dir), "--calib", str(calib_dir),
                 "--calib-samples", "0", "--max-context", "128", "-q", "-o", str(out)])
    assert code == 0
    return out


def cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "picompile", *map(str, args)], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def run_json(capsys, *args) -> dict:
    assert main(["run", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_artifact_lists_its_tokenizer_files_with_their_sha256(artifact, tokenizer_dir, capsys):
    manifest = load_manifest(artifact)
    listed = {name: digest for name, digest in manifest.files.items() if name.startswith("tokenizer/")}
    assert sorted(listed) == ["tokenizer/generation_config.json", "tokenizer/tokenizer.json",
                              "tokenizer/tokenizer_config.json"]
    for name, digest in listed.items():
        assert digest == hashlib.sha256((tokenizer_dir / name.split("/", 1)[1]).read_bytes()).hexdigest()
    assert manifest.tokenizer.files[0] == "tokenizer/tokenizer.json"
    assert sorted(manifest.tokenizer.files) == sorted(listed)
    assert main(["inspect", str(artifact), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["tokenizer"]
    assert shown == {"files": sorted(listed), "vocab_size": 258, "bos_id": BOS, "eos_ids": [BOS], "chat_template": True}
    assert main(["inspect", str(artifact)]) == 0
    assert "tokenizer   258 tokens, BOS 256, EOS 256, a chat template" in capsys.readouterr().out


def test_a_tampered_tokenizer_file_is_refused(artifact, tmp_path, capsys):
    copy = tmp_path / "copy.pic"
    shutil.copytree(artifact, copy)
    config = copy / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<s>", "<pad>"))
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer_config.json is damaged"):
        load_tokenizer(copy)
    code = main(["run", str(copy), "-p", PROMPT])
    assert_user_error(code, capsys.readouterr().err, "tokenizer_config.json", "sha256")


def test_text_calibration_is_what_the_build_profiled(artifact, tokenizer, calib_dir):
    calibration = load_manifest(artifact).calibration
    # one sequence per .txt/.md/.py file (BOS first), cut at 128 tokens (the profile pass's sequence length)
    expected = sum(1 + len(CALIB_FILES[name].encode()) for name in ("a.txt", "notes/b.md", "c.py"))
    assert calibration.given_tokens == expected
    assert calibration.source == str(calib_dir)
    sequences = read_calibration(calib_dir, tokenizer, max_length=16)
    assert sum(map(len, sequences)) == expected and max(map(len, sequences)) == 16
    assert sequences[0][0] == BOS and bytes(sequences[0][1:].tolist()) == CALIB_FILES["a.txt"].encode()[:15]


def test_calibration_files_are_ids_or_text_by_their_content(tmp_path, tokenizer):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3\n4,5,6\n")
    assert [s.tolist() for s in read_calibration(ids, None)] == [[1, 2, 3], [4, 5, 6]]  # no tokenizer needed
    text = tmp_path / "prose.txt"
    text.write_text("12 monkeys\n")
    assert [s.tolist() for s in read_calibration(text, tokenizer)] == [[BOS, *b"12 monkeys\n"]]


def _without_tokenizer(artifact, copy):
    """A copy of `artifact` as a build without a tokenizer makes it (its manifest sealed again)."""
    from runtime.artifact import seal_manifest

    shutil.copytree(artifact, copy)
    shutil.rmtree(copy / "tokenizer")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"] = {name: digest for name, digest in manifest["files"].items() if not name.startswith("tokenizer/")}
    manifest["tokenizer"] = None
    (copy / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
    return copy


def test_text_on_an_artifact_without_a_tokenizer_is_refused_and_ids_still_work(artifact, tmp_path, capsys):
    bare = _without_tokenizer(artifact, tmp_path / "bare.pic")
    assert load_tokenizer(bare) is None
    for command in (["run", str(bare), "-p", PROMPT], ["chat", str(bare)]):
        code = main(command)
        assert_user_error(code, capsys.readouterr().err, "no tokenizer", "--prompt-ids")
    assert len(run_json(capsys, bare, "--prompt-ids", "1,2,3", "-n", "5")["generated_ids"]) == 5
    assert main(["inspect", str(bare)]) == 0
    assert "tokenizer   none" in capsys.readouterr().out


def test_run_prompt_streams_the_text_of_the_ids_prompt_ids_generate(artifact, tokenizer, capsys):
    streamed = cli("run", artifact, "-p", PROMPT, "-n", "24")
    assert streamed.returncode == 0, streamed.stderr
    assert "tokens/s" in streamed.stderr and "tokens/s" not in streamed.stdout
    by_text = run_json(capsys, artifact, "-p", PROMPT, "-n", "24")
    prompt_ids = tokenizer.encode(PROMPT)
    assert by_text["prompt_ids"] == prompt_ids == [BOS, *PROMPT.encode()]
    by_ids = run_json(capsys, artifact, "--prompt-ids", ",".join(map(str, prompt_ids)), "-n", "24")
    assert by_text["generated_ids"] == by_ids["generated_ids"] and by_ids["generated_ids"]
    text = tokenizer.decode(by_text["generated_ids"])
    assert by_text["text"] == text and by_text["prompt"] == PROMPT and "text" not in by_ids
    assert streamed.stdout == text + ("" if text.endswith("\n") else "\n")


def test_chat_applies_the_template_to_the_whole_conversation(artifact, tokenizer):
    turns = ["hello", "and again"]
    result = cli("chat", artifact, "-n", "12", "--system", "be brief", stdin="".join(t + "\n" for t in turns))
    assert result.returncode == 0, result.stderr
    engine, messages, expected = Engine(artifact), [{"role": "system", "content": "be brief"}], ""
    for turn in turns:  # what each turn must have generated: greedy on the templated conversation so far
        messages.append({"role": "user", "content": turn})
        prompt = tokenizer.chat_prompt(messages)
        assert prompt.startswith("<s><|system|>be brief\n<|user|>hello\n") and prompt.endswith(f"<|user|>{turn}\n<|assistant|>")
        assert tokenizer.chat_ids(messages) == tokenizer.encode(prompt, add_special_tokens=False)  # <s> written once
        ids = generate(engine, tokenizer.encode(prompt, add_special_tokens=False), 12,
                       stop_ids=tokenizer.eos_ids)["generated_ids"]
        reply = tokenizer.decode(ids)
        messages.append({"role": "assistant", "content": reply})
        expected += reply + ("" if reply.endswith("\n") else "\n")
    assert result.stdout == expected
    assert result.stderr.count("tokens/s") == len(turns)


def test_chat_without_a_template_uses_plain_turns(tmp_path):
    plain = TextTokenizer(write_byte_tokenizer(tmp_path / "plain", chat_template=None))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    assert plain.chat_prompt(messages) == "user: hi\nassistant: yo\nuser: ?\nassistant: "


def test_generate_stream_yields_what_generate_returns_and_stops_at_a_stop_id(artifact):
    engine = Engine(artifact)
    prompt = [BOS, *b"x = "]
    whole = generate(engine, prompt, 10)["generated_ids"]
    stats = GenerationStats()
    assert list(generate_stream(engine, prompt, 10, stats=stats)) == whole
    assert stats.decode_steps == 9 and stats.prefill_s > 0 and stats.decode_s > 0
    stop = whole[3]
    assert list(generate_stream(engine, prompt, 10, stop_ids={stop})) == whole[: whole.index(stop) + 1]
    tokens = generate_stream(engine, prompt, 10, profile=True, stats=stats)
    next(tokens), next(tokens)
    tokens.close()  # a caller that stops early leaves the engine unprofiled, its profile in the stats
    assert engine.profile is None and stats.profile.get("decode_steps") == 1
    with pytest.raises(ValueError, match="max context"):
        generate_stream(engine, prompt, 1000)  # refused at the call, not at the first token


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_the_build(tiny_models, tokenizer_dir, tmp_path,
                                                                            capsys):
    out = tmp_path / "out.pic"
    code = main(["build", str(tiny_models("opt", "legacy").onnx), "--tokenizer", str(tokenizer_dir), "-o", str(out)])
    assert_user_error(code, capsys.readouterr().err, "258 tokens", "vocabulary is 128")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_snake_splits_into_four_byte_tokens_and_comes_out_whole(tokenizer):
    stream = tokenizer.stream()
    ids = tokenizer.encode("a\U0001f40d\u6f22", add_special_tokens=False)
    assert ids == list("a\U0001f40d\u6f22".encode())
    assert [stream.push(i) for i in ids] == ["a", "", "", "", "\U0001f40d", "", "", "\u6f22"]
    assert stream.flush() == ""


@settings(max_examples=150, deadline=None)
@given(text=st.text(), extra=st.lists(st.integers(0, 257), max_size=12))
def test_the_stream_concatenates_to_decode(tokenizer, text, extra):
    """Any text (so characters of 1 to 4 bytes), then arbitrary ids: broken UTF-8, BOS and padding."""
    ids = tokenizer.encode(text) + extra
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tokenizer.decode(ids)
    if not any(special in text for special in ("<s>", "<pad>", "\ufffd")):  # text as it is, special tokens aside
        assert tokenizer.decode(tokenizer.encode(text)) == text
        complete = tokenizer.stream()
        assert "".join(complete.push(i) for i in tokenizer.encode(text)) == text  # whole characters need no flush


def test_a_chat_template_renders_as_transformers_renders_it(tmp_path):
    """The template features the families' templates use, rendered as transformers' apply_chat_template does:
    loop control (Qwen3's `{% break %}`), `tojson` keeping non-ASCII text, `strftime_now` (Llama 3.1's date),
    `{% generation %}` blocks, and `raise_exception` refusing a conversation."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{{ bos_token }}Today: {{ strftime_now('%Y') }}\n"
        "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "<|{{ m.role }}|>{{ m.content | tojson }}\n"
        "{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = TextTokenizer(write_byte_tokenizer(tmp_path / "t", chat_template=template))
    messages = [{"role": "user", "content": "héllo \"ü\""}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}, {"role": "stop", "content": ""},
                {"role": "user", "content": "never"}]
    ours = tokenizer.chat_prompt(messages)
    theirs = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                   bos_token="<s>")[0][0]
    assert ours == theirs and '"héllo \\"ü\\""' in ours and "never" not in ours and "[ok]" in ours
    with pytest.raises(ValueError, match="no bad roles"):
        tokenizer.chat_prompt([{"role": "bad", "content": ""}])
