"""benchmarks/bench_cpu_decode.py's family options: what they parse to and which models they name."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_cpu_decode as bench  # noqa: E402
from examples import models  # noqa: E402


def test_predictability_option_takes_family_names_and_numbers():
    levels = models.PREDICTABILITY_LEVELS
    assert bench._predictabilities("family") == list(levels.values())
    assert bench._predictabilities("hard,0.7,hard") == [levels["hard"], 0.7]
    for bad in ("harder", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._predictabilities(bad)
    assert bench._calib_tokens("1024,4096") == [1024, 4096]
    with pytest.raises(argparse.ArgumentTypeError):
        bench._calib_tokens("1000")  # not whole sequences of 64


def test_the_default_member_is_the_suite_model_of_before():
    # the maker's defaults add no overrides, so the default member hashes to the model measured so far
    assert bench.member_overrides(None, None) == {}
    assert bench.member_overrides(models.SYNTH_DEFAULTS["predictability"], 4096) == {}
    assert bench.member_overrides(0.6, 1024) == {"predictability": 0.6, "calib_seqs": 16}
    plain = models.config_hash("opt", "1b", sparsity=0.9)
    assert models.config_hash("opt", "1b", sparsity=0.9, **bench.member_overrides(0.95, 4096)) == plain
    assert models.config_hash("opt", "1b", sparsity=0.9, **bench.member_overrides(0.6, 4096)) != plain


def test_family_flag_is_the_models_sweep(monkeypatch):
    seen = {}

    def stop(specs, log=None):  # stop before anything is built: record what the run would make
        seen["specs"] = specs
        raise SystemExit(0)

    monkeypatch.setattr(models, "cached_models", stop)
    with pytest.raises(SystemExit):
        bench.main(["--family", "--preset", "tiny", "--max-context", "64", "--prompt-len", "8", "--tokens", "4"])
    easy = models.FAMILY["levels"]["easy"]
    # the first level's members, one per calibration size of the sweep
    assert [s.get("calib_seqs", models.TOKEN_DEFAULTS["n_seqs"]) for s in seen["specs"]] == list(models.FAMILY["calib_seqs"])
    assert all(s.get("predictability") == easy and s["preset"] == "tiny" for s in seen["specs"])
