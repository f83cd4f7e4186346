"""A model split into two stages on two Ray nodes of this host, against the one-node artifact: logits, decode
tokens/s, what a hand-over costs, and the cost model's expectation beside each.

Builds (or reuses) `--out`/split.pic from MODEL with `--nodes` (two nodes, the second offering the Ray resource
`picompile_stage1`) and the same build options as the one-node artifact `--whole` (default: built beside it,
`--dense` unless `--sparse`). Then, alternated `--runs` times, a prompt of `--prompt-len` tokens and `--tokens`
decode steps of:
- `whole`: `Engine(whole)` at 1 thread and at 2 (this host's cores), each engine loaded for its turn;
- `one process`: `Engine(split)`, every stage in this process, the hand-over a row copy (1 thread);
- `ray`: `runtime.ray_stages.Pipeline` on a Ray cluster of two node processes on 127.0.0.1 (one CPU each, the
  second offering `picompile_stage1`), one kernel thread per stage: one request, and `--concurrent` requests
  decoded together (`forward_batch`: the stages overlap their micro-batches).
Every step's logits of the Ray pipeline and of the one-process run are compared with the whole artifact's.
A hand-over's cost is Ray's time a token over the one-process run's (the same kernels, the same single thread).

    python benchmarks/bench_stages.py MODEL.onnx --out DIR [--whole WHOLE.pic] [--sparse] [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.artifact import load_manifest  # noqa: E402
from runtime.engine import Engine  # noqa: E402

STAGE1 = {"picompile_stage1": 1}


def build(model: Path, out: Path, options: list[str]) -> Path:
    if not (out / "manifest.json").is_file():
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "picompile", "build", str(model), "-o", str(out), "-q", *options],
                       check=True)
        print(f"built {out} in {time.perf_counter() - began:.0f} s", flush=True)
    return out


def decode(forward, reset, prompt: np.ndarray, tokens: int) -> tuple[float, list[np.ndarray]]:
    """Seconds per decode step (greedy, after the prompt) and every step's logits row."""
    reset()
    rows = [forward(prompt)[-1]]
    token, began = int(np.argmax(rows[-1])), time.perf_counter()
    for _ in range(tokens):
        rows.append(forward([token])[-1])
        token = int(np.argmax(rows[-1]))
    return (time.perf_counter() - began) / tokens, rows


def decode_concurrent(pipeline, prompts: list[np.ndarray], tokens: int) -> float:
    """Total tokens/s of len(prompts) requests decoded together through the pipeline's batch steps."""
    slots = list(range(len(prompts)))
    ids = []
    for slot, prompt in zip(slots, prompts):
        pipeline.reset(slot)
        ids.append(int(np.argmax(pipeline.forward(prompt, slot)[-1])))
    began = time.perf_counter()
    for _ in range(tokens):
        ids = [int(i) for i in np.argmax(pipeline.forward_batch(ids, slots), axis=1)]
    return len(prompts) * tokens / (time.perf_counter() - began)


def start_cluster():
    import ray
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    constants.ENABLE_RAY_CLUSTER = False  # keep both node processes on 127.0.0.1
    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 200 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    second = cluster.add_node(**node, resources=STAGE1)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    return cluster, second.node_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--whole", type=Path, help="the one-node artifact (default: built in --out)")
    parser.add_argument("--sparse", action="store_true", help="sparse builds (default --dense)")
    parser.add_argument("--memory", default="12GiB", help="each node's memory")
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = ["--max-context", str(args.max_context), *([] if args.sparse else ["--dense"])]
    nodes = args.out / "nodes.json"
    nodes.write_text(json.dumps({"nodes": [{"name": "head", "memory": args.memory},
                                           {"name": "second", "memory": args.memory, "resources": STAGE1}]}))
    whole_path = args.whole or build(args.model, args.out / "whole.pic", options)
    split_path = build(args.model, args.out / "split.pic", [*options, "--nodes", str(nodes)])
    manifest = load_manifest(split_path, check_hashes=False)
    expected = {"stages": [{"name": s.name, "layers": [s.first_layer, s.stop_layer], "step_s": s.expected_step_s,
                            "handover_bytes": s.handover_bytes} for s in manifest.stages],
                "estimate": manifest.estimate}
    print("stages:", json.dumps(expected["stages"]), flush=True)
    vocab = manifest.model.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=args.prompt_len) for _ in range(max(args.concurrent, 1))]

    from runtime import ray_stages

    cluster, second = start_cluster()
    results: dict[str, list[float]] = {}
    worst = {"one process": 0.0, "ray": 0.0}
    try:
        pipeline = ray_stages.Pipeline(split_path, slots=max(args.concurrent, 1), threads=1, code_path=str(ROOT))
        assert pipeline.where[1]["node"] == second and pipeline.where[0]["node"] != second, pipeline.where
        # loaded one at a time, each run (a 1B model's weights thrice would not fit beside the stages)
        engines = {"whole, 1 thread": lambda: Engine(whole_path, threads=1),
                   "whole, 2 threads": lambda: Engine(whole_path, threads=2),
                   "one process": lambda: Engine(split_path, threads=1)}
        for run in range(args.runs):
            reference = None
            for name, load in engines.items():
                engine = load()
                seconds, rows = decode(engine.forward, engine.reset, prompts[0], args.tokens)
                del engine
                results.setdefault(name, []).append(seconds)
                if reference is None:
                    reference = rows
                elif name == "one process":
                    worst[name] = max(worst[name], max(float(np.abs(a - b).max()) for a, b in zip(rows, reference)))
            seconds, rows = decode(pipeline.forward, pipeline.reset, prompts[0], args.tokens)
            results.setdefault("ray", []).append(seconds)
            worst["ray"] = max(worst["ray"], max(float(np.abs(a - b).max()) for a, b in zip(rows, reference)))
            if args.concurrent > 1:
                total = decode_concurrent(pipeline, prompts, args.tokens)
                results.setdefault(f"ray, {args.concurrent} concurrent", []).append(1 / total)
            print(f"run {run + 1}: " + ", ".join(f"{name} {1 / values[-1]:.2f} tok/s" for name, values in results.items()),
                  flush=True)
        pipeline.close()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    median = {name: statistics.median(values) for name, values in results.items()}
    handover = (median["ray"] - median["one process"]) / max(len(manifest.stages) - 1, 1)
    print(f"logits against the whole artifact, largest difference over every step: one process {worst['one process']:.3g}, "
          f"ray {worst['ray']:.3g}")
    for name, seconds in median.items():
        print(f"{name:<22} {1 / seconds:8.2f} tok/s  ({seconds * 1e3:.1f} ms a token)")
    stage_ms = ", ".join(f"{stage['step_s'] * 1e3:.1f}" for stage in expected["stages"])
    print(f"hand-over on Ray: {handover * 1e3:.2f} ms a token (Ray's time over the one-process run's); the cost model's "
          f"stages {stage_ms} ms, estimate "
          f"{(manifest.estimate or {}).get('picompile_tokens_per_s', float('nan')):.2f} tok/s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results, "median_s": median,
                       "max_abs_logit_difference": worst, "handover_s": handover, "expected": expected,
                       "machine": os.uname().machine}, out, indent=1)


if __name__ == "__main__":
    main()
