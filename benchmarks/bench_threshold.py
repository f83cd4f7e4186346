"""Threshold sparsity (TEAL-style) on a LLaMA-SwiGLU model: the quality each sparsity costs and the decode
speed it buys, against the dense build of the same model.

    python benchmarks/bench_threshold.py [--preset small] [--sparsities 0.25,0.4,0.5] [--threads 2] [--tokens 32]
        [--runs 3] [--prompt-len 16] [--max-context 256] [--weight-dtype fp32] [--sequences 4] [--json PATH] [--record]

One run makes the dense-random SwiGLU model (examples/models.py, llama with hidden_act="silu"; cached by its
config hash), builds it dense and with `--sparsity-mode threshold` at each sparsity (builds cached by model,
options and compiler source), evaluates every artifact against onnxruntime on `--sequences` held-out
sequences (`picompile eval`'s measure: KL divergence, perplexity of the reference and of the artifact, top-1
agreement; a 4-token prefill, then one decode step per position, so the figures are those of the thresholded
decode path), then times greedy decoding with runs alternating between the dense build and each threshold
build (medians and best runs), with the weight bytes a decoded token reads (the runtime's profile).

The model's weights are random, so the perplexities are near the vocabulary size; what the table shows is how
far the thresholded model moves from the dense one (KL, top-1, perplexity change), not its language quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.bench_decode import add_run_arguments, parsed_run_arguments  # noqa: E402 (stdlib only: TVM not yet)


def _sparsities(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1), got {text!r}") from None
    if not values or any(not 0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1), got {text!r}")
    return values


def name_of(sparsity: float | None) -> str:
    return "picompile dense" if sparsity is None else f"picompile threshold {sparsity:.2f}"


def timing(artifacts: dict[str, Path], tokens: int, runs: int, prompt_len: int) -> dict:
    """Greedy decode tokens/s per artifact: runs alternate between the artifacts (after one untimed warm-up each),
    the median and the best run are kept; then one profiled generation each gives the weight bytes a decoded
    token reads. On a shared machine the best run is the one least disturbed by other work."""
    import statistics
    import time

    import numpy as np

    from examples.bench_decode import SETTLE_S, time_decode
    from runtime import Engine, generate

    engines = {name: Engine(path) for name, path in artifacts.items()}
    prompt = np.random.default_rng(0).integers(0, next(iter(engines.values())).vocab_size, size=prompt_len)
    for engine in engines.values():
        time_decode(engine.forward, engine.reset, prompt, 2)
    samples = {name: [] for name in engines}
    for _ in range(runs):
        for name, engine in engines.items():
            time.sleep(SETTLE_S)
            samples[name].append(time_decode(engine.forward, engine.reset, prompt, tokens)[1])
    summary = {}
    for name, engine in engines.items():
        profiled = generate(engine, prompt, tokens, profile=True)
        summary[name] = {"decode_tokens_per_s": statistics.median(samples[name]), "best_tokens_per_s": max(samples[name]),
                         "samples_tokens_per_s": samples[name], "weight_bytes_per_token": profiled["weight_bytes_per_token"],
                         "profile_ms_per_token": profiled["profile_ms_per_token"]}
    return summary


def report(summary: dict, qualities: dict, builds: dict) -> str:
    dense = summary[name_of(None)]
    rows = ["| engine | inputs dropped (gate/up, down) | KL | ppl reference -> compiled | top-1 | weights MiB/token "
            "| byte limit vs dense | decode tok/s, median (best) | vs dense, median (best) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, figures in summary.items():
        q = qualities.get(name)
        dropped = builds.get(name, "-")
        quality = "- | - | -"
        if q is not None:
            change = (q["ppl_compiled"] / q["ppl_reference"] - 1) * 100
            quality = (f"{q['kl_mean']:.2e} | {q['ppl_reference']:.2f} -> {q['ppl_compiled']:.2f} ({change:+.2f}%) | "
                       f"{q['top1_agreement']:.3f}")
        traffic = limit = "-"
        if "weight_bytes_per_token" in figures:  # decode is memory-bound: the speed-up the bytes saved allow
            traffic = f"{figures['weight_bytes_per_token'] / 2**20:.1f}"
            limit = f"{dense['weight_bytes_per_token'] / figures['weight_bytes_per_token']:.2f}x"
        speed = figures["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
        best = figures["best_tokens_per_s"] / dense["best_tokens_per_s"]
        rows.append(f"| {name} | {dropped} | {quality} | {traffic} | {limit} | {figures['decode_tokens_per_s']:.2f} "
                    f"({figures['best_tokens_per_s']:.2f}) | **{speed:.2f}x** ({best:.2f}x) |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsities", type=_sparsities, default=[0.25, 0.4, 0.5])
    parser.add_argument("--weight-dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--sequences", type=int, default=4, help="held-out sequences evaluated per artifact")
    add_run_arguments(parser, preset="small")
    args = parsed_run_arguments(parser, argv)

    from examples.bench_decode import ensure_artifact, machine, quality, record
    from examples.models import cached_model
    from passes.reference import OrtDecoder
    from runtime import load_manifest

    files = cached_model("llama", preset=args.preset, hidden_act="silu", log=print)
    params = json.loads(files.config.read_text())["num_params"]
    artifacts = {name_of(None): ensure_artifact(files, "dense", args.max_context, dense=True,
                                                weight_dtype=args.weight_dtype, rebuild=args.rebuild)}
    for s in args.sparsities:
        artifacts[name_of(s)] = ensure_artifact(files, f"threshold-{s}", args.max_context, dense=False,
                                                sparsity_mode="threshold", sparsity=s,
                                                weight_dtype=args.weight_dtype, rebuild=args.rebuild)
    builds = {}
    for name, path in artifacts.items():
        layers = load_manifest(path, check_hashes=False).layers
        if layers:
            builds[name] = (f"{sum(layer.sparsity_in for layer in layers) / len(layers):.3f}, "
                            f"{sum(layer.sparsity_down for layer in layers) / len(layers):.3f}")
    print(f"evaluating {len(artifacts)} artifacts against onnxruntime on {args.sequences} held-out sequences")
    reference = OrtDecoder(files.onnx)
    qualities = {name: quality(files, path, args.sequences, reference=reference) for name, path in artifacts.items()}
    del reference
    gc.collect()
    print(f"timing: {args.runs} alternating runs of {args.tokens} tokens after a {args.prompt_len}-token prompt")
    load_before = os.getloadavg()[0]
    summary = timing(artifacts, args.tokens, args.runs, args.prompt_len)
    load = (load_before, os.getloadavg()[0])  # the machine may be shared: its load says how far to trust the timing
    config = {"family": "llama-swiglu", "preset": args.preset, "params": params, "sparsities": args.sparsities,
              "threads": args.threads, "tokens": args.tokens, "runs": args.runs, "prompt_len": args.prompt_len,
              "max_context": args.max_context, "weight_dtype": args.weight_dtype, "sequences": args.sequences,
              "machine": machine(), "load_average": load}
    text = report(summary, qualities, builds)
    text += (f"\n\nQuality on {args.sequences} held-out sequences of random tokens (dense-random weights: the "
             "perplexities sit near the vocabulary size; KL and top-1 measure the distance from the dense model). "
             "Inputs dropped: the shares measured on held-out profiled tokens at build time. Byte limit: dense "
             "weight bytes per decoded token over the build's (the speed-up a memory-bound step allows). 1-minute "
             f"load average before / after the timing: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores.")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"config": config, "summary": summary, "quality": qualities,
                                         "dropped": builds}, indent=1))
    if args.record:
        record(f"Threshold sparsity, llama-swiglu-{args.preset} ({params / 1e6:.0f}M params, dense-random, "
               f"{args.weight_dtype} weights)", config, text, "benchmarks/bench_threshold.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
