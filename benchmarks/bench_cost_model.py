"""The cost model against the machine: each build's expected decode (the cost model's price of its calls, with this
machine's kernel rates measured at the start of the run) beside its measured decode, alternated.

    python benchmarks/bench_cost_model.py FILE.gguf [...] [--builds dense,default,loss3] [--runs 3] [--tokens 32]
                                          [--prompt-len 16] [--max-context 512] [--json PATH] [--record]

Builds are bench_gguf.py's (cached the same way; `loss3`: --max-quality-loss 3%), calibrated on its text. The
machine's rates are measured again first (`picompile calibrate`, in a child process): memory bandwidth on a shared
machine drifts by tens of percent over minutes, so the figures priced and the speeds measured are taken together.
Each round decodes `--tokens` tokens after a `--prompt-len` prompt on every build in turn (each round starting one
build later), a fresh engine each, default threads; speeds are medians. Also printed: the estimate the build wrote
into the artifact (the rates of its own day) and, per build, expected / measured (target: within 10%), and each
build's decode against the dense one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gguf import DENSE_OF, ensure_gguf_artifact, write_texts  # noqa: E402
from examples.bench_decode import SETTLE_S, record, time_decode  # noqa: E402


def measured_rates():
    """This machine's kernel rates, measured now (a child process: the compiler's TVM stays out of this one)."""
    from passes.machine_rates import CpuRates

    out = subprocess.run([sys.executable, "-m", "picompile", "calibrate", "--json"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return CpuRates.from_json(json.loads(out.stdout))


def expected_tokens_per_s(artifact: Path, rates) -> float:
    """The cost model's price of the artifact's decode calls on this machine's rates."""
    import dataclasses

    from passes import costmodel
    from passes.targets import get_target
    from runtime.artifact import load_manifest

    manifest = load_manifest(artifact, check_hashes=False)
    schedule = json.loads((artifact / "schedule.json").read_text())
    target = dataclasses.replace(get_target(manifest.target.name), cpu_rates=rates)
    return costmodel.estimate(manifest, schedule, target).picompile_tokens_per_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--builds", default="dense,default,loss3")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", action="store_true", help="append the table to BENCHMARKS.md")
    args = parser.parse_args(argv)
    import numpy as np

    from runtime import Engine

    work = Path.home() / ".cache" / "picompile" / "bench_gguf"
    work.mkdir(parents=True, exist_ok=True)
    _, calib = write_texts(work, heldout_chars=60_000, calib_chars=40_000)
    builds = args.builds.split(",")
    artifacts = {}
    for path in args.files:
        for build in builds:
            built = ensure_gguf_artifact(path, build, args.max_context, calib)
            if built.artifact is None:
                print(f"{path.name} {build}: {built.error}")
                continue
            artifacts[(path.name, build)] = built.artifact
    rates = measured_rates()
    print("\n".join(rates.lines()), flush=True)
    rng = np.random.default_rng(0)
    speeds: dict[tuple, list[float]] = {key: [] for key in artifacts}
    order = list(artifacts.items())
    for round_index in range(args.runs):
        # each round starts one build later: the last build of a fixed order measured 7% slow twice, its plan the
        # same as the build before it
        shift = round_index % len(order)
        for key, artifact in order[shift:] + order[:shift]:
            time.sleep(SETTLE_S)
            engine = Engine(artifact, check_hashes=False)
            prompt = rng.integers(0, engine.vocab_size, size=args.prompt_len)
            speeds[key].append(time_decode(engine.forward, engine.reset, prompt, args.tokens)[1])
            del engine
    after = measured_rates()  # the machine at the end: how far its rates drifted during the run
    rows = ["| file | build | measured tok/s | expected tok/s (rates of the run) | expected / measured "
            "| vs dense in its formats (measured) | the artifact's own estimate |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    results = {}
    for (name, build), artifact in artifacts.items():
        from runtime.artifact import load_manifest

        measured = statistics.median(speeds[(name, build)])
        expected = expected_tokens_per_s(artifact, rates)
        expected_after = expected_tokens_per_s(artifact, after)
        base = (name, DENSE_OF.get(build, "dense"))  # the dense build in the same formats
        dense = statistics.median(speeds[base]) if base in speeds else None
        own = load_manifest(artifact, check_hashes=False).estimate["picompile_tokens_per_s"]
        results[f"{name} {build}"] = {"measured": measured, "expected": expected, "expected_after": expected_after,
                                      "own_estimate": own, "runs": speeds[(name, build)]}
        rows.append(f"| {name} | {build} | {measured:.1f} | {expected:.1f} (end of run: {expected_after:.1f}) "
                    f"| **{expected / measured:.2f}** | {'' if dense is None else f'{measured / dense:.2f}x'} "
                    f"| {own:.1f} |")
    text = "\n".join(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rates": rates.to_json(), "after": after.to_json()},
                                        indent=1))
    if args.record:
        config = {"builds": builds, "runs": args.runs, "tokens": args.tokens, "prompt_len": args.prompt_len}
        record("The cost model against the machine", config, "\n".join(rates.lines()) + "\n\n" + text,
               "benchmarks/bench_cost_model.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
