"""Decode on a busy machine: picompile's default threads beside one thread and onnxruntime, with and without
`--load N` busy background processes, alternated in one run.

    python benchmarks/bench_busy.py --model tiny,code,1b [--load 1] [--threads 2] [--tokens 32] [--runs 3]
                                    [--prompt-len 16] [--json PATH] [--record]

Models: `tiny` and `code` are the quickstart's (examples/text_model.py, dense and sparse artifacts), `1b` the
CPU decode suite's ~1B OPT-ReLU model (benchmarks/bench_cpu_decode.py's default, its dense fp32 build), and
`gguf:PATH` a GGUF file built dense from the file (onnxruntime runs the front end's ONNX of it).

Per model, engines: onnxruntime (`--threads` intra-op threads, as the quickstart runs it), and per artifact
picompile with its default threads (the runtime's governor, runtime/threads.py) and with one thread. Each run
times every engine unloaded and then under the load (N processes spinning, each bounded in time, started for
the loaded half alone), so machine drift cancels; figures are medians. The table gives, per artifact, the
loaded default against the loaded one-thread run (the governor's cost: target >= 0.8x) and against the
unloaded default (what the load took: target >= 0.45x), and every engine against onnxruntime in each half.
The host's state (load, busy and stolen CPU, read bandwidth) is printed for each half.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.host import BusyLoad, HostState  # noqa: E402
from examples.bench_decode import SETTLE_S, ensure_artifact, record, time_decode  # noqa: E402

HALVES = ("unloaded", "loaded")


def model_sources(name: str, log=print) -> tuple[Path, dict[str, Path], int]:
    """(the ONNX onnxruntime runs, {label: artifact}, max context) of a --model entry."""
    if name in ("tiny", "code", "small"):
        from examples.text_model import TEXT_PRESETS, cached_text_model

        files = cached_text_model(name, log=log)
        context = TEXT_PRESETS[name]["context"]
        return files.onnx, {"dense": ensure_artifact(files, "dense", context, log=log),
                            "sparse": ensure_artifact(files, "sparse", context, dense=False, log=log)}, context
    if name == "1b":
        from examples.models import cached_model

        files = cached_model("opt", preset="1b", sparsity=0.9, log=log)
        return files.onnx, {"dense fp32": ensure_artifact(files, "dense", 256, log=log, weight_dtype="fp32")}, 256
    if name.startswith("gguf:"):
        return gguf_sources(Path(name[5:]), log)
    raise SystemExit(f"error: --model {name!r}: one of tiny, code, small, 1b, gguf:PATH")


def gguf_sources(path: Path, log=print) -> tuple[Path, dict[str, Path], int]:
    """A GGUF file's front-end ONNX (onnxruntime runs it) and its dense build in the file's own format
    (bench_gguf's builder and cache)."""
    from benchmarks.bench_gguf import ensure_gguf_artifact
    from passes.import_gguf import reference_onnx

    built = ensure_gguf_artifact(path, "dense", 256, None, log=log)
    if built.artifact is None:
        raise SystemExit(f"error: {path}: {built.error}")
    return reference_onnx(path), {"dense": built.artifact}, 256


def measure_model(name: str, args) -> dict:
    import numpy as np

    from passes.reference import OrtDecoder
    from runtime import Engine

    onnx, artifacts, context = model_sources(name)
    tokens = min(args.tokens, context - args.prompt_len)
    engines = {"onnxruntime": OrtDecoder(onnx, threads=args.threads)}
    for label, path in artifacts.items():
        engines[f"picompile {label}"] = Engine(path)
        engines[f"picompile {label}, 1 thread"] = Engine(path, threads=1)
    vocab = next(e for e in engines.values() if hasattr(e, "vocab_size")).vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, size=args.prompt_len)
    for engine in engines.values():  # untimed: pools start, first calls settle
        time_decode(engine.forward, engine.reset, prompt, 2)
    samples = {half: {engine: [] for engine in engines} for half in HALVES}
    hosts = {half: [] for half in HALVES}
    for _ in range(args.runs):
        for half in HALVES:
            # the loaded half's processes spin for it alone: at most the time its engines could take, bounded
            load = args.load if half == "loaded" else 0
            with BusyLoad(load, seconds=args.load_seconds):
                state = HostState.before(load_processes=load)
                for engine_name, engine in engines.items():
                    time.sleep(SETTLE_S)
                    samples[half][engine_name].append(time_decode(engine.forward, engine.reset, prompt, tokens))
                state.after()
            hosts[half].append({"line": state.summary(), "flags": state.flags()})
    figures = {half: {engine: {"decode_tokens_per_s": statistics.median(s[1] for s in runs),
                               "prefill_ms": 1000 * statistics.median(s[0] for s in runs)}
                      for engine, runs in samples[half].items()} for half in HALVES}
    threads_chosen = {label: {" ".join(map(str, kind)): n for kind, n in engines[f"picompile {label}"].governor.choices().items()}
                      for label in artifacts}
    del engines
    gc.collect()
    return {"figures": figures, "hosts": hosts, "artifacts": {k: str(v) for k, v in artifacts.items()},
            "threads_chosen": threads_chosen, "tokens": tokens}


def report(name: str, result: dict, load: int) -> str:
    figures = result["figures"]
    un, lo = figures["unloaded"], figures["loaded"]
    rows = [f"#### {name} ({load} busy process{'es' if load != 1 else ''} in the loaded half)", "",
            "| engine | unloaded tok/s | loaded tok/s | loaded / unloaded | vs onnxruntime unloaded | vs onnxruntime loaded "
            "| prefill ms unloaded / loaded |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for engine in un:
        u, l_ = un[engine]["decode_tokens_per_s"], lo[engine]["decode_tokens_per_s"]
        rows.append(f"| {engine} | {u:,.1f} | {l_:,.1f} | {l_ / u:.2f}x | "
                    f"{u / un['onnxruntime']['decode_tokens_per_s']:.2f}x | {l_ / lo['onnxruntime']['decode_tokens_per_s']:.2f}x "
                    f"| {un[engine]['prefill_ms']:.1f} / {lo[engine]['prefill_ms']:.1f} |")
    rows.append("")
    for label in result["artifacts"]:
        default, single = lo[f"picompile {label}"]["decode_tokens_per_s"], lo[f"picompile {label}, 1 thread"]["decode_tokens_per_s"]
        unloaded = un[f"picompile {label}"]["decode_tokens_per_s"]
        rows.append(f"- picompile {label}: loaded default / loaded 1 thread **{default / single:.2f}x** (target >= 0.8), "
                    f"loaded / unloaded default **{default / unloaded:.2f}x** (target >= 0.45); threads chosen at the "
                    f"end: {result['threads_chosen'][label]}")
    for half in HALVES:
        for line in result["hosts"][half]:
            rows.append(f"- {half}: {line['line']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="comma-separated: tiny, code, small, 1b, gguf:PATH")
    parser.add_argument("--load", type=int, default=1, help="busy processes in the loaded half")
    parser.add_argument("--load-seconds", type=float, default=600.0, help="each busy process stops after this")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime's threads (default: every core)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", action="store_true", help="append the tables to BENCHMARKS.md")
    args = parser.parse_args(argv)
    import os

    args.threads = args.threads or os.cpu_count()
    config = {"threads": args.threads, "tokens": args.tokens, "prompt_len": args.prompt_len, "runs": args.runs}
    return run_models(args, measure_model, report, "Decode on a busy machine", "benchmarks/bench_busy.py", config, argv)


def run_models(args, measure, report_of, title: str, script: str, config: dict, argv) -> int:
    """Each of --model's models measured (`measure(name, args)`) and its table printed (`report_of(name, result,
    args.load)`); the results to --json, the tables to BENCHMARKS.md with --record."""
    results, texts = {}, []
    for name in args.model.split(","):
        results[name] = measure(name, args)
        texts.append(report_of(name, results[name], args.load))
        print(texts[-1], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.record:
        record(title, config, "\n\n".join(texts), script, argv, host="host: per half and run, in each table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
