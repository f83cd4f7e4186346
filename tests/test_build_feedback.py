"""What a build tells its user: progress bars (only where someone watches), `--quiet`, `-v` per pass,
the `--dump-ir` index of node counts, errors from inside a pass named with the pass and the layer, and
`inspect --report`."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import re
from collections import Counter
from pathlib import Path

import pytest

from passes.import_onnx import Import
from passes.front_end import load
from passes.kernels import ops
from passes.partition import Partition
from passes.profile import Profile
from passes.recognise import Recognise
from picompile.cli import main
from passes.errors import PassError
from passes.pipeline import Context, Options, PassResult, ProgressBars, describe_change, describe_pass, run_passes
from passes.targets import get_target


@pytest.fixture(scope="module")
def sparse_files(tiny_models):
    return tiny_models("opt", sparsity=0.9)


@pytest.fixture(scope="module")
def forced_build(sparse_files, tmp_path_factory):
    """A sparse CLI build with progress bars forced on (as on a terminal): (artifact, its stderr)."""
    out = tmp_path_factory.mktemp("feedback") / "s.pic"
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        patch.setenv("PICOMPILE_PROGRESS", "1")
        assert main(["build", str(sparse_files.onnx), "-o", str(out), "--max-context", "64",
                     "--calib", str(sparse_files.calib)]) == 0
    return out, err.getvalue()


BAR_LINES = ["profile: calibration sequences", "predict: pricing ranks", "predict: training predictors",
             "compile: making CPU kernels", "compile: compiling"]


def test_progress_bars_when_forced_and_silence_otherwise(forced_build, sparse_files, tmp_path, capsys, monkeypatch):
    _, err = forced_build
    for line in BAR_LINES:
        assert line in err, line
    from picompile.compiler import pipeline

    passes = len(pipeline(Options(), "predictor"))  # the bar grows to the passes of the mode, once it is known
    assert "pass schedule" in err and f"{passes}/{passes}" in err  # the passes' own bar, at its end

    model = str(sparse_files.onnx)
    monkeypatch.delenv("PICOMPILE_PROGRESS", raising=False)  # pytest's stderr is not a terminal: no bars
    assert main(["build", model, "-o", str(tmp_path / "b.pic"), "--dense", "--max-context", "64"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()  # the context chosen, before the passes; what was written; the estimate
    assert lines[0] == "context 64 tokens (--max-context; KV cache 64.00 KiB per sequence)", lines[0]
    assert lines[1].startswith("wrote ") and "expected decode" in captured.out

    monkeypatch.setenv("PICOMPILE_PROGRESS", "1")  # --quiet wins even over a terminal
    assert main(["build", model, "-o", str(tmp_path / "c.pic"), "--quiet", "--dense", "--max-context", "64"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == f"wrote {tmp_path / 'c.pic'}\n"

    assert main(["build", model, "-o", str(tmp_path / "d.pic"), "--quiet", "-v"]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_placement_ilp_shows_a_spinner(sparse_files, tmp_path):
    bars_out = io.StringIO()
    passes = [Import(), Recognise(), Profile(calib=sparse_files.calib), Partition(placement_batch=32)]
    with ProgressBars(True, passes=len(passes), file=bars_out) as bars:
        ctx = Context(get_target("rtx4090"), workdir=tmp_path, progress_bars=bars,
                      options=Options(max_context=64, vram_budget_bytes=600_000))
        model = run_passes(load(sparse_files.onnx), passes, ctx, [bars])
    assert "partition: HiGHS placement ILP (2 layers)" in bars_out.getvalue()
    assert "picompile.placement" in model.metadata_props  # the solve ran under the spinner


def test_verbose_lists_each_pass_with_time_and_node_counts(sparse_files, tmp_path, capsys):
    assert main(["build", str(sparse_files.onnx), "-o", str(tmp_path / "v.pic"), "--dense", "--max-context", "64",
                 "-v", "--dump-ir", str(tmp_path / "ir")]) == 0
    err = capsys.readouterr().err
    timed = re.findall(r"^pass (\d\d) ([\w-]+) +([\d.]+) ms  (.*)$", err, re.M)
    assert [name for _, name, _, _ in timed] == ["import", "recognise", "partition", "fuse", "place",
                                                  "select-kernels", "plan-buffers", "compile", "schedule"]
    recognise = timed[1][3]
    assert re.match(r"\d+ -> 15 nodes \(.*\+picompile\.FFN 2", recognise), recognise
    for *_, rest in timed:  # each pass's memory: its peak resident set, at least what stayed resident after it
        peak, unit_peak, after, unit_after = re.search(r"memory peak ([\d.]+) (\w+), ([\d.]+) (\w+) after$", rest).groups()
        scale = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
        assert float(peak) * scale[unit_peak] >= float(after) * scale[unit_after] > 50 << 20
    assert re.search(r"^build peak memory [\d.]+ [MG]iB resident$", err, re.M)

    index = (tmp_path / "ir" / "index.txt").read_text().splitlines()
    assert [line.split()[0] for line in index] == ["00-import.onnx", "01-recognise.onnx", "02-partition.onnx",
                                                   "03-fuse.onnx", "04-place.onnx", "05-select-kernels.onnx",
                                                   "06-plan-buffers.onnx", "07-compile.onnx", "08-schedule.onnx"]
    assert "+picompile.Attention 2" in index[1] and "-MatMul" in index[1]
    assert "+picompile.Call" in index[5] and "-picompile.FFN 2" in index[5]
    for line in index:  # every listed file exists, and its node count is the one in the index
        name, counts = line.split()[0], re.search(r"-> (\d+) nodes", line).group(1)
        assert int(counts) == len(list(load_ir(tmp_path / "ir" / name).graph))


@pytest.mark.parametrize("mode", ["dense", "predictor", "threshold"])
def test_verbose_plan_is_exactly_the_passes_that_ran(tiny_models, tmp_path, capsys, mode):
    """-v lists the passes with their fields before they run: for each mode, `pipeline(options, mode)`
    exactly, and the passes timed and dumped are those."""
    from picompile.compiler import pipeline

    files = tiny_models("llama", hidden_act="silu") if mode == "threshold" else tiny_models("opt", sparsity=0.9)
    dump = tmp_path / "ir"
    assert main(["build", str(files.onnx), "-o", str(tmp_path / "p.pic"), "--max-context", "32", "--calib",
                 str(files.calib), "-v", "--dump-ir", str(dump), *(["--dense"] if mode == "dense" else [])]) == 0
    err = capsys.readouterr().err
    expected = pipeline(Options(dense=mode == "dense", max_context=32, calib=files.calib), mode)
    planned = re.findall(r"^plan (\d\d) (.*)$", err, re.M)
    timed = re.findall(r"^pass (\d\d) ([\w-]+) +[\d.]+ ms", err, re.M)
    numbers = [f"{i:02d}" for i in range(len(expected))]
    assert planned == list(zip(numbers, map(describe_pass, expected)))
    assert timed == list(zip(numbers, [p.name for p in expected]))
    dumped = [line.split()[0] for line in (dump / "index.txt").read_text().splitlines()]
    assert dumped == [f"{n}-{p.name}.onnx" for n, p in zip(numbers, expected)]
    if mode != "dense":
        assert "sparsity(requested='auto', sparsity=None)" in err and f"sparsity: {mode} mode" in err


def test_passes_are_configured_by_their_fields_not_the_options():
    """No pass reads ctx.options: each takes the options it reads as its fields."""
    passes = Path(__file__).resolve().parents[1] / "passes"
    assert sorted(p.name for p in passes.glob("*.py") if "ctx.options" in p.read_text()) == []


def load_ir(path: Path):
    import onnx_ir as ir

    return ir.load(str(path))


def test_describe_change_counts_each_op_type():
    before = Counter(["MatMul"] * 24 + ["Add"] * 3)
    after = Counter(["picompile.FFN"] * 2 + ["Add"] * 3)
    assert describe_change(before, after) == "27 -> 5 nodes (-MatMul 24, +picompile.FFN 2)"
    assert describe_change(after, after) == "5 -> 5 nodes (same op types)"


class _FailsInLayer:
    name = "explode"

    def apply(self, model, ctx):
        for layer in range(3):
            with ctx.layer(layer):
                if layer == 2:
                    raise RuntimeError("solver blew up\nsecond line of detail")
        return PassResult(model, modified=False)


def test_an_exception_in_a_pass_names_the_pass_and_the_layer(sparse_files):
    ctx = Context(get_target("cpu"))
    with pytest.raises(PassError) as failed:
        run_passes(load(sparse_files.onnx), [Import(), _FailsInLayer()], ctx)
    assert str(failed.value) == "pass explode, layer 2: RuntimeError: solver blew up"
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert (failed.value.pass_name, failed.value.layer) == ("explode", 2)


def test_cli_wraps_a_tvm_error_deep_in_kernel_making(sparse_files, tmp_path, capsys, monkeypatch):
    import tvm.error

    def broken_attention(*args, **kwargs):
        raise tvm.error.InternalError("Check failed: (vectorizable) is false: lanes must divide\nStack trace: ...")

    monkeypatch.setattr(ops, "attention", dataclasses.replace(ops.attention, cpu=broken_attention))
    out = tmp_path / "x.pic"
    assert main(["build", str(sparse_files.onnx), "-o", str(out), "--dense", "--max-context", "64"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["error: pass compile, layer 0: InternalError: Check failed: (vectorizable) is false: "
                   "lanes must divide"]
    assert not out.exists() and not list(tmp_path.glob(".x.pic*"))

    assert main(["build", str(sparse_files.onnx), "-o", str(out), "--dense", "--max-context", "64", "-v"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "broken_attention" in err  # -v: where it came from
    assert err.strip().splitlines()[-1].startswith("error: pass compile, layer 0:")


def test_inspect_report_html_and_png(forced_build, tmp_path, capsys):
    sparse_artifact, _ = forced_build
    html_path = tmp_path / "report.html"
    assert main(["inspect", str(sparse_artifact), "--report", str(html_path)]) == 0
    out = capsys.readouterr().out
    page = html_path.read_text()
    rows = re.findall(r"<tr><td>(\d+)</td>", page)
    assert rows == ["0", "1"]  # one table row per layer
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3  # activation CDF, GPU/CPU split, predictor recall
    for image in images:
        assert base64.b64decode(image).startswith(b"\x89PNG")
    cdf = (sparse_artifact / "plots" / "activation_cdf.png").read_bytes()
    assert base64.b64encode(cdf).decode() in images
    assert "placement" in out and out.splitlines()[0] in page  # the text summary is in the page too
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written under a temp name, renamed

    png_path = tmp_path / "report.png"
    assert main(["inspect", str(sparse_artifact), "--report", str(png_path)]) == 0
    assert png_path.read_bytes().startswith(b"\x89PNG")

    assert main(["inspect", str(sparse_artifact), "--report", str(tmp_path / "report.pdf")]) == 2
    assert "html or .png" in capsys.readouterr().err
