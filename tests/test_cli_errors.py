"""Bad input gets exit 2, one `error:` line naming the problem, no traceback, and nothing written."""

from __future__ import annotations

import subprocess
import sys

import onnx
import onnx.helper as oh
import pytest

from picompile.cli import main


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.err


def assert_user_error(code, err, *words):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]


def _not_a_decoder(path):
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    graph = oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "cnn_like", [x], [y])
    onnx.save(oh.make_model(graph), path)


@pytest.mark.parametrize("make,words", [
    (None, ["not found"]),
    (lambda p: p.write_bytes(b""), ["not an onnx model"]),
    (lambda p: p.write_bytes(b"\x00garbage bytes that are not protobuf\xff" * 10), ["onnx"]),
    (_not_a_decoder, ["not a decoder", "input_ids"]),
])
def test_bad_model_files(tmp_path, capsys, make, words):
    model = tmp_path / "model.onnx"
    if make:
        make(model)
    out = tmp_path / "out.pic"
    code, err = run_cli(["build", model, "-o", out], capsys)
    assert_user_error(code, err, *words)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "model.onnx"] == []


@pytest.mark.parametrize("extra,words", [
    (["--target", "tpu9000"], ["unknown target", "tpu9000"]),
    (["--vram-budget", "lots"], ["malformed size", "lots"]),
    (["--max-context", "0"], ["max-context"]),
    (["--max-context", "abc"], ["max-context"]),
    (["--calib-tokens", "0"], ["calib-tokens", "positive integer"]),
    (["--calib-tokens", "many"], ["calib-tokens"]),
    (["--calib-samples", "-1"], ["calib-samples", "non-negative"]),
    (["--calib-samples", "2.5"], ["calib-samples"]),
])
def test_bad_build_options(tmp_path, capsys, extra, words):
    model = tmp_path / "model.onnx"
    _not_a_decoder(model)
    out = tmp_path / "out.pic"
    code, err = run_cli(["build", model, "-o", out, *extra], capsys)
    assert_user_error(code, err, *words)
    assert not out.exists()


def test_missing_artifact_and_bad_ids(tmp_path, capsys):
    code, err = run_cli(["run", tmp_path / "nothing.pic", "--prompt-ids", "1,2"], capsys)
    assert_user_error(code, err, "not a picompile artifact")
    code, err = run_cli(["run", tmp_path / "nothing.pic", "--prompt-ids", "1,x,2"], capsys)
    assert_user_error(code, err, "prompt-ids")
    code, err = run_cli(["run", tmp_path / "nothing.pic", "--prompt-ids", "1,2", "-n", "-3"], capsys)
    assert_user_error(code, err, "positive integer")


def test_usage_errors_are_one_line():
    result = subprocess.run([sys.executable, "-m", "picompile", "build"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1


def test_bad_tokenizers_and_text_calibration(tmp_path, capsys):
    """--tokenizer without a readable tokenizer.json, text calibration without a tokenizer or without text:
    refused before the build reads the model (a Relu graph here: it never gets that far)."""
    from text_tokenizers import write_byte_tokenizer

    model = tmp_path / "model.onnx"
    _not_a_decoder(model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{\"model\": 3}")
    (tmp_path / "prose.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "no-text").mkdir()
    (tmp_path / "no-text" / "a.txt").write_text("")
    (tmp_path / "no-text" / "data.json").write_text("[1, 2]")
    good = write_byte_tokenizer(tmp_path / "good")
    out = tmp_path / "out.pic"
    for extra, words in [
        (["--tokenizer", tmp_path / "empty"], ["--tokenizer", "no tokenizer.json"]),
        (["--tokenizer", tmp_path / "missing"], ["--tokenizer", "not a directory"]),
        (["--tokenizer", tmp_path / "broken"], ["tokenizer", "broken"]),
        (["--calib", tmp_path / "prose.txt"], ["prose.txt", "text", "line 1", "tokenizer"]),
        (["--calib", tmp_path / "no-text"], ["no-text", "tokenizer"]),
        (["--calib", tmp_path / "no-text", "--tokenizer", good], ["no-text", "holds no text"]),
        (["--calib", tmp_path / "nothing"], ["calibration file not found"]),
    ]:
        code, err = run_cli(["build", model, "-o", out, *extra], capsys)
        assert_user_error(code, err, *words)
        assert not out.exists()
