"""benchmarks/bench_quality.py without a real model: build names to options, a failed build's row, the manifest's
"quality" reader, and the table / ratio / curve logic on made-up rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_gguf  # noqa: E402
import bench_quality as bench  # noqa: E402


def test_build_names_become_build_options():
    assert bench.build_args("dense-fp32") == ["--dense", "--weight-dtype", "fp32"]
    assert bench.build_args("dense-int4") == ["--dense", "--weight-dtype", "int4"]
    assert bench.build_args("default") == []
    assert bench.build_args("thr-0.25") == ["--weight-dtype", "fp32", "--sparsity-mode", "threshold",
                                            "--sparsity", "0.25"]
    assert bench.build_args("budget-fp32-1%") == ["--weight-dtype", "fp32", "--max-quality-loss", "1%"]
    assert bench.build_args("budget-int4-10%") == ["--weight-dtype", "int4", "--max-quality-loss", "10%"]
    assert bench.build_args("budget-int4-kl=0.01") == ["--weight-dtype", "int4", "--max-quality-loss", "kl=0.01"]
    for name in (*bench.BUILDS_GGUF, *bench.BUILDS_RELU):
        bench.build_args(name)
    for bad in ("thr-1.5", "thr-x", "budget-fp16-1%", "budget-fp32-lots", "budget-fp32", "sparse"):
        with pytest.raises(bench.Refused):
            bench.build_args(bad)
    assert not bench.takes_calib("dense-fp32") and bench.takes_calib("dense-int4") and bench.takes_calib("default")


def test_a_budget_build_passes_its_budget_and_a_refused_option_is_a_row(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    calib = tmp_path / "calib.txt"
    calib.write_text("some prose")
    seen = []

    def refused(command):  # (exit code, stdout, stderr, peak resident bytes) of the build's child process
        seen.append(command)
        return 2, "", "error: picompile build: unrecognized arguments: --max-quality-loss 3%\n", 1 << 20

    monkeypatch.setattr(bench_gguf, "_measured_run", refused)
    built = bench_gguf.build_cached(model, "budget-fp32-3%", bench.build_args("budget-fp32-3%"), calib,
                                    log=lambda m: None)
    command = seen[0]
    assert command[command.index("--max-quality-loss") + 1] == "3%"
    assert command[command.index("--calib") + 1] == str(calib)
    assert built.artifact is None and built.error.startswith("error: picompile build: unrecognized arguments")
    bench_gguf.build_cached(model, "budget-fp32-3%", bench.build_args("budget-fp32-3%"), calib, log=lambda m: None)
    assert len(seen) == 2  # a failure is not cached: the next run tries again
    row = {"build": "budget-fp32-3%", "error": built.error, "build_s": built.seconds}
    text = bench.table(bench.finish_rows([row]))
    assert "| budget-fp32-3% |" in text and "failed: error: picompile build: unrecognized arguments" in text


def test_expected_quality_reads_the_manifest(tmp_path):
    # the manifest's other entries play no part (a real artifact's would cost a build: not in a light test)
    artifact = tmp_path / "art.pic"
    artifact.mkdir()
    manifest = {"format_version": 1, "files": {}, "estimate": {}}
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    assert bench.expected_quality(artifact) is None  # built without a budget: states none
    manifest["quality"] = {"budget": {"kind": "ppl", "value": 0.01}, "ppl_change": 0.008, "kl": 0.004,
                           "top1": 0.98, "tokens": 2048}
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    assert bench.expected_quality(artifact) == bench.Expected("ppl", 0.01, 0.008, 0.004, 0.98, 2048)
    manifest["quality"] = {"budget": {"kind": "kl", "value": 0.01}, "kl": 0.006}  # a KL budget, fields missing
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    assert bench.expected_quality(artifact) == bench.Expected("kl", 0.01, None, 0.006, None, None)


def _row(build, speed, change, expected=None, interval=(None, None), kl=0.01):
    return {"build": build, "error": None, "build_s": 60.0, "decode_tokens_per_s": speed,
            "measured": {"ppl_change": change, "kl": kl, "top1": 0.9},
            "expected": expected and {"budget_kind": "ppl", "budget_value": 0.03, "ppl_change": expected, "kl": 0.01,
                                      "top1": 0.9, "ppl_low": interval[0], "ppl_high": interval[1]}}


def test_ratios_table_and_curves():
    rows = bench.finish_rows([
        _row(bench.ORT_FP32, 80.0, 0.0), _row(bench.ORT_INT4, 100.0, 0.25),
        _row("dense-fp32", 100.0, 0.0, kl=0.0), _row("thr-0.2", 120.0, 0.02, kl=0.02),
        _row("thr-0.4", 140.0, 0.10, kl=0.1),
        _row("budget-fp32-3%", 150.0, 0.03, expected=0.025, interval=(0.01, 0.04), kl=0.06),
        _row("dense-int4", 200.0, 0.3),
        _row("budget-int4-10%", 250.0, 0.12, expected=0.3, interval=(0.2, 0.4))])
    by = {r["build"]: r for r in rows}
    assert by["thr-0.4"]["vs_dense_fp32"] == pytest.approx(1.4)
    assert by["thr-0.4"]["vs_ort_fp32"] == pytest.approx(1.75)
    assert by["budget-fp32-3%"]["expected_over_measured"] == pytest.approx(0.025 / 0.03)
    assert by["budget-int4-10%"]["expected_over_measured"] == pytest.approx(2.5)
    assert by["dense-fp32"]["expected_over_measured"] is None  # no expectation, and no increase to divide by
    assert by["budget-fp32-3%"]["kl_expected_over_measured"] == pytest.approx(0.01 / 0.06)
    assert by["dense-fp32"]["kl_expected_over_measured"] is None
    assert by["budget-fp32-3%"]["budget_met"] is True and by["budget-int4-10%"]["budget_met"] is False
    assert by["dense-fp32"]["budget_met"] is None
    text = bench.table(rows)
    # eval's +3.0% lies in the build's interval (+1..+4%); +12% is outside +20..+40%; no interval, no verdict
    assert by["budget-fp32-3%"]["within_expected"] is True and by["budget-int4-10%"]["within_expected"] is False
    assert by["dense-fp32"]["within_expected"] is None
    assert "| budget-fp32-3% | 60 | ppl +3% (yes) | +2.5% (+1.0..+4.0) |" in text
    assert "| 0.83 | 0.17 | yes | 150.0 | 1.50x | 1.88x |" in text and "| 2.50 | 1.00 | **no** | 250.0 |" in text
    curve = bench.curves(rows)
    # today's speed at +3%: an eighth of the way from (+2%, 120) to (+10%, 140); at KL 0.06, half the way
    assert "| budget-fp32-3% | +3.0% | 0.0600 | 150.0 | 122.5 | 1.22x | 130.0 | 1.15x |" in curve
    assert "| thr-0.4 (today) | +10.0% | 0.1000 | 140.0 | | | | |" in curve
    assert "| budget-int4-10% | +12.0% | 250.0 | 1.25x | 2.50x | - |" in curve


def test_interpolate():
    points = [(0.0, 100.0), (0.1, 140.0)]
    assert bench.interpolate(points, 0.05) == pytest.approx(120.0)
    assert bench.interpolate(points[::-1], 0.1) == pytest.approx(140.0)
    assert bench.interpolate(points, 0.2) is None and bench.interpolate(points, -0.01) is None
    assert bench.interpolate([], 0.0) is None
    assert bench.interpolate([(0.0, 5.0)], 0.0) == 5.0
