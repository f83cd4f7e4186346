"""Decode speed of a picompile artifact beside onnxruntime on the same ONNX, same machine, same threads.

    python examples/bench_decode.py --family opt --preset small --tokens 64 --runs 3 [--record]

Runs alternate (onnxruntime, picompile, onnxruntime, ...) so machine drift cancels; the figures are the
medians. `--record` appends the table to BENCHMARKS.md with the date, machine and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def ensure_artifact(files, name: str, max_context: int, dense: bool = True, log=print) -> Path:
    from examples.models import cache_dir
    from picompile.compiler import build
    from picompile.pipeline import Options
    from picompile.targets import get_target

    artifact = cache_dir() / "artifacts" / f"{files.dir.name}-{name}.pic"
    if not (artifact / "manifest.json").exists():
        started = time.perf_counter()
        build(files.onnx, artifact, get_target("cpu"), Options(dense=dense, max_context=max_context))
        log(f"built {artifact.name} in {time.perf_counter() - started:.1f}s")
    return artifact


def time_decode(forward, reset, prompt, tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) for greedy generation of `tokens` tokens."""
    import numpy as np

    reset()
    started = time.perf_counter()
    logits = forward(prompt)[-1]
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(tokens):
        logits = forward(np.array([int(np.argmax(logits))], np.int64))[-1]
    return prefill, tokens / (time.perf_counter() - started)


def measure(files, artifact: Path, tokens: int, runs: int, threads: int, prompt_len: int = 16) -> dict:
    import numpy as np

    from picompile.reference import OrtDecoder
    from runtime import Engine

    ort = OrtDecoder(files.onnx, threads=threads)
    engine = Engine(artifact)
    prompt = np.random.default_rng(0).integers(0, engine.vocab_size, size=prompt_len)
    results = {"onnxruntime": [], "picompile": []}
    for _ in range(runs):
        results["onnxruntime"].append(time_decode(ort.forward, ort.reset, prompt, tokens))
        results["picompile"].append(time_decode(engine.forward, engine.reset, prompt, tokens))
    summary = {}
    for name, samples in results.items():
        summary[name] = {"decode_tokens_per_s": statistics.median(s[1] for s in samples),
                         "prefill_ms": 1000 * statistics.median(s[0] for s in samples)}
    summary["ratio"] = summary["picompile"]["decode_tokens_per_s"] / summary["onnxruntime"]["decode_tokens_per_s"]
    summary["prefill_ratio"] = summary["onnxruntime"]["prefill_ms"] / summary["picompile"]["prefill_ms"]
    return summary


def table(config: dict, summary: dict) -> str:
    ort, pic = summary["onnxruntime"], summary["picompile"]
    return "\n".join([
        f"| engine | decode tok/s | prefill {config['prompt_len']} tokens (ms) |",
        "| --- | --- | --- |",
        f"| onnxruntime fp32 | {ort['decode_tokens_per_s']:.2f} | {ort['prefill_ms']:.1f} |",
        f"| picompile dense fp32 | {pic['decode_tokens_per_s']:.2f} | {pic['prefill_ms']:.1f} |",
        f"| **ratio** (picompile / onnxruntime) | **{summary['ratio']:.2f}x** | {summary['prefill_ratio']:.2f}x faster |",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="opt", choices=["opt", "llama"])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--record", action="store_true", help="append the table to BENCHMARKS.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))

    from examples.models import cached_model, num_params  # noqa: F401

    files = cached_model(args.family, preset=args.preset, log=print)
    params = json.loads(files.config.read_text())["num_params"]
    artifact = ensure_artifact(files, "dense", args.max_context)
    summary = measure(files, artifact, args.tokens, args.runs, args.threads, args.prompt_len)
    config = {"family": args.family, "preset": args.preset, "params": params, "tokens": args.tokens,
              "runs": args.runs, "threads": args.threads, "prompt_len": args.prompt_len}
    text = table(config, summary)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"config": config, "summary": summary}, indent=1))
    if args.record:
        command = "python examples/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
        stamp = datetime.date.today().isoformat()
        with open(ROOT / "BENCHMARKS.md", "a") as f:
            f.write(f"\n### Dense decode, {args.family}-{args.preset} ({params / 1e6:.0f}M params), {stamp}\n\n"
                    f"Machine: {machine()}; {args.threads} threads; {args.tokens} greedy tokens after a "
                    f"{args.prompt_len}-token prompt; median of {args.runs} alternating runs.\n"
                    f"Command: `{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
