"""benchmarks/llama_cpp.py and bench_gguf.py without llama.cpp: what its tools print is parsed, the windows
llama-perplexity scores are reproduced, a missing build says how to make one. (The tools themselves are run
by the benchmark, never by a test: they are built by scripts/build_llama_cpp.sh, outside the project.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_gguf  # noqa: E402
import llama_cpp  # noqa: E402

BENCH_JSON = [
    {"build_commit": "abc1234", "build_number": 7000, "model_type": "llama ?B Q4_1", "n_prompt": 64, "n_gen": 0,
     "n_threads": 2, "avg_ts": 812.5, "stddev_ts": 10.25},
    {"build_commit": "abc1234", "build_number": 7000, "model_type": "llama ?B Q4_1", "n_prompt": 0, "n_gen": 32,
     "n_threads": 2, "avg_ts": 45.5, "stddev_ts": 0.5},
]


def test_llama_bench_json_is_parsed():
    text = "some log line\n" + json.dumps(BENCH_JSON, indent=2)
    figures = llama_cpp.parse_bench_json(text, threads=2, n_prompt=64, n_gen=32, repetitions=3)
    assert figures.prompt_tokens_per_s == 812.5 and figures.decode_tokens_per_s == 45.5
    assert figures.decode_stddev == 0.5 and figures.build == "abc1234 (7000)" and figures.model_type.endswith("Q4_1")
    only_decode = llama_cpp.parse_bench_json(json.dumps(BENCH_JSON[1:]), threads=2, n_prompt=0, n_gen=32,
                                             repetitions=1)
    assert only_decode.prompt_tokens_per_s is None and only_decode.decode_tokens_per_s == 45.5
    for bad in ("no json here", "[]"):
        with pytest.raises(llama_cpp.LlamaCppFailed):
            llama_cpp.parse_bench_json(bad, threads=2, n_prompt=64, n_gen=32, repetitions=1)


def test_llama_perplexity_output_is_parsed():
    log = ("perplexity: tokenizing the input ..\nperplexity: calculating perplexity over 8 chunks, n_ctx=512, "
           "batch_size=512, n_seq=1\n[1]12.3,[2]13.1,\nFinal estimate: PPL = 13.4567 +/- 0.41234\n")
    figures = llama_cpp.parse_perplexity(log)
    assert (figures.ppl, figures.ppl_error, figures.chunks, figures.ctx) == (13.4567, 0.41234, 8, 512)
    assert figures.scored == 8 * 255
    with pytest.raises(llama_cpp.LlamaCppFailed):
        llama_cpp.parse_perplexity("perplexity: tokenizing the input ..\n")


def test_perplexity_windows_are_llama_perplexitys():
    ids = list(range(100, 100 + 10 * 8 + 3))  # 10 whole windows of 8 and a partial one
    windows = list(llama_cpp.perplexity_windows(ids, ctx=8, chunks=None, bos=None))
    assert len(windows) == 10 and windows[1] == (ids[8:16], 4)
    assert [w for w, _ in llama_cpp.perplexity_windows(ids, 8, 3, bos=1)] == [[1, *ids[i * 8 + 1:(i + 1) * 8]]
                                                                             for i in range(3)]


def test_missing_build_names_the_script(tmp_path):
    with pytest.raises(llama_cpp.LlamaCppMissing, match="scripts/build_llama_cpp.sh"):
        llama_cpp.find(tmp_path)


def test_a_tool_runs_with_the_shim_and_passive_waiting(tmp_path):
    """A stand-in tool that prints its environment: LD_PRELOAD and OMP_WAIT_POLICY are set for it."""
    bin_dir = tmp_path / "current" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in llama_cpp.TOOLS:
        path = bin_dir / tool
        path.write_text('#!/bin/sh\necho "[$OMP_WAIT_POLICY]"\necho "$LD_PRELOAD" >&2\n[ "$1" = fail ] && exit 139\n'
                        'exit 0\n')
        path.chmod(0o755)
    (tmp_path / "noamx.so").write_bytes(b"")  # not loaded: the stand-ins are shell scripts
    llama = llama_cpp.find(tmp_path)
    done = llama.run("llama-tokenize", ["ok"])
    assert done.stdout.strip() == "[passive]" and str(tmp_path / "noamx.so") in done.stderr
    with pytest.raises(llama_cpp.LlamaCppFailed, match="exited 139.*preloaded"):
        llama.run("llama-bench", ["fail"])


def test_derived_file_names():
    source = Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert llama_cpp.derived_file(source, "q8_0", "/c") == Path("/c/SmolLM2-135M-Instruct.Q8_0.gguf")
    assert llama_cpp.derived_file(Path("/x/model.gguf"), "F16", "/c") == Path("/c/model.F16.gguf")


def test_heldout_text_and_prompts(tmp_path):
    paragraphs = bench_gguf.heldout_paragraphs()
    assert len(paragraphs) > 100 and all(not p.startswith(" ") and "\n" not in p for p in paragraphs)
    heldout, calib = bench_gguf.write_texts(tmp_path, heldout_chars=5000, calib_chars=3000)
    held, cal = heldout.read_text(), calib.read_text()
    assert len(held) >= 5000 and not held.endswith("\n")
    assert not set(held.split("\n\n")) & set(cal.split("\n\n"))  # disjoint
    assert len(bench_gguf.PROMPTS) == 20 == len(set(bench_gguf.PROMPTS))


def test_tables_show_ratios_and_build_errors():
    results = {"files": {"m.Q4_1.gguf": {
        "llama.cpp": {"decode_tokens_per_s": 40.0, "prompt_tokens_per_s": 800.0, "ppl": 20.0, "error": None},
        "picompile dense": {"decode_tokens_per_s": 60.0, "prompt_tokens_per_s": 400.0, "ppl": 20.1, "error": None},
        "picompile default": {"decode_tokens_per_s": None, "prompt_tokens_per_s": None, "ppl": None,
                              "error": "error: no GGUF front end"}}},
        "tokens_check": {"file": "m.Q4_1.gguf", "equal": 19, "of": 20, "differ": ["'x': llama.cpp [1] vs picompile [2]"]},
        "host": "host: load avg 0.10 on 2 cores: quiet", "config": {"no_picompile": False}}
    text = bench_gguf.tables(results)
    assert "| picompile dense | 60.0 | 1.50x | 400.0 | 0.50x | 20.100 | x1.0050 |" in text
    assert "not built: error: no GGUF front end" in text
    assert "19 of 20" in text and text.endswith("quiet")
