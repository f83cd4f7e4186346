"""The default thread count from a fresh engine's first step: prefill and decode with the runtime's default
threads against `--threads 1` and `--threads 2` (every usable core), quiet and beside busy processes, alternated.

    python benchmarks/bench_threads.py --model gguf:PATH,1b [--prompts 16,64] [--tokens 32] [--runs 3] [--load 1]
                                       [--json PATH] [--record]

Models as bench_busy.py's (`tiny`, `code`, `small`, `1b`, `gguf:PATH`; one artifact each: the first it lists).
Each measurement loads a new engine (what `picompile run` does for a one-shot prompt), prefills a random prompt of
each `--prompts` length and decodes `--tokens` tokens after it, so the figures are those of the first steps,
before the governor has measured anything. Per run, each half (quiet; `--load` busy processes started before the
engines load) times every configuration in turn, each run in a rotated order. The table gives medians and the default against the best fixed
count (target >= 0.95x quiet) and against one thread beside the busy processes (target >= 0.8x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_busy import model_sources, run_models  # noqa: E402
from benchmarks.host import BusyLoad, HostState  # noqa: E402
from examples.bench_decode import SETTLE_S, time_decode  # noqa: E402

HALVES = ("quiet", "busy")


def measure_model(name: str, args) -> dict:
    import numpy as np

    from runtime import Engine
    from runtime.threads import usable_cores

    _, artifacts, context = model_sources(name)
    label, path = next(iter(artifacts.items()))
    configs = {"default": None, "1 thread": 1, f"{usable_cores()} threads": usable_cores()}
    prompts = [p for p in args.prompts if p + args.tokens <= context]
    rng = np.random.default_rng(0)
    samples = {half: {(config, p): [] for config in configs for p in prompts} for half in HALVES}
    chosen: dict[str, dict] = {half: {} for half in HALVES}
    hosts = {half: [] for half in HALVES}
    warm = Engine(path)  # untimed: the pool starts, the files come into the page cache
    time_decode(warm.forward, warm.reset, rng.integers(0, warm.vocab_size, size=8), 2)
    vocab = warm.vocab_size
    del warm
    order = list(configs.items())
    for run in range(args.runs):
        for half in HALVES:
            load = args.load if half == "busy" else 0
            with BusyLoad(load, seconds=args.load_seconds):
                state = HostState.before(load_processes=load)
                for p in prompts:
                    prompt = rng.integers(0, vocab, size=p)
                    for config, threads in order[run % len(order):] + order[:run % len(order)]:  # order effects cancel
                        time.sleep(SETTLE_S)
                        engine = Engine(path, threads=threads, check_hashes=False)
                        samples[half][(config, p)].append(time_decode(engine.forward, engine.reset, prompt, args.tokens))
                        if threads is None:
                            chosen[half][p] = {" ".join(map(str, k)): n for k, n in engine.governor.choices().items()}
                        del engine
                state.after()
            hosts[half].append(state.summary())
    figures = {half: {f"{config} | {p}": {"prefill_ms": 1000 * statistics.median(s[0] for s in runs),
                                          "decode_tokens_per_s": statistics.median(s[1] for s in runs)}
                      for (config, p), runs in samples[half].items()} for half in HALVES}
    return {"artifact": str(path), "label": label, "configs": list(configs), "prompts": prompts, "figures": figures,
            "chosen": chosen, "hosts": hosts, "tokens": args.tokens}


def report(name: str, result: dict, load: int) -> str:
    rows = [f"#### {name} ({result['label']}; {load} busy process{'es' if load != 1 else ''} in the busy half, "
            f"{result['tokens']} tokens decoded after each prompt)", "",
            "| half | prompt | " + " | ".join(f"{c} prefill ms / decode tok/s" for c in result["configs"])
            + " | default prefill / best fixed | default decode / best fixed | default / 1 thread (prefill, decode) |",
            "| --- | --- | " + " | ".join("---" for _ in result["configs"]) + " | --- | --- | --- |"]
    for half in HALVES:
        figures = result["figures"][half]
        for p in result["prompts"]:
            cells = {c: figures[f"{c} | {p}"] for c in result["configs"]}
            fixed = [c for c in result["configs"] if c != "default"]
            best_prefill = min(cells[c]["prefill_ms"] for c in fixed)
            best_decode = max(cells[c]["decode_tokens_per_s"] for c in fixed)
            d, one = cells["default"], cells["1 thread"]
            rows.append(f"| {half} | {p} | " + " | ".join(f"{cells[c]['prefill_ms']:.1f} / {cells[c]['decode_tokens_per_s']:.1f}"
                                                   for c in result["configs"])
                        + f" | **{best_prefill / d['prefill_ms']:.2f}x** | **{d['decode_tokens_per_s'] / best_decode:.2f}x**"
                        f" | {one['prefill_ms'] / d['prefill_ms']:.2f}x, {d['decode_tokens_per_s'] / one['decode_tokens_per_s']:.2f}x |")
    rows.append("")
    for half in HALVES:
        rows.append(f"- {half}: default threads chosen at the end: {result['chosen'][half]}")
        for line in result["hosts"][half]:
            rows.append(f"- {half}: {line}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b", help="comma-separated: tiny, code, small, 1b, gguf:PATH")
    parser.add_argument("--prompts", type=lambda text: [int(p) for p in text.split(",")], default=[16, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", type=int, default=1, help="busy processes in the busy half")
    parser.add_argument("--load-seconds", type=float, default=600.0, help="each busy process stops after this")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", action="store_true", help="append the tables to BENCHMARKS.md")
    args = parser.parse_args(argv)
    config = {"tokens": args.tokens, "prompts": args.prompts, "runs": args.runs, "load": args.load}
    return run_models(args, measure_model, report, "Default threads from the first step", "benchmarks/bench_threads.py",
                      config, argv)


if __name__ == "__main__":
    sys.exit(main())
