"""Benchmark of PowerInfer's placement ILP (benchmarks/powerinfer_placement.py, solve_placement) at real model shapes;
picompile's own placement of every block is `bench_placement_sweep.py`'s.

Shapes (LLaMA-2, gated FFN, fp16 weights: bytes per neuron = 3 * d_model * 2):
  7B   32 layers x 11008 neurons, d_model 4096, 32 kv heads
  13B  40 layers x 13824 neurons, d_model 5120, 40 kv heads
  70B  80 layers x 28672 neurons, d_model 8192,  8 kv heads (GQA)
Frequencies are synthetic power law (zipf-like, exponent 0.7-1.1 per layer, ~10% mean activity,
log-normal noise, random neuron order), fixed seed.

Budgets, per shape:
  24GiB   what the pass would give an RTX 4090: 24 GiB minus the dense fp16 part (attention, norms,
          embeddings, output layer), the fp16 KV cache for 256 tokens and a 5% reserve. At fp16 the whole
          7B model fits (every neuron on the GPU), and the 70B dense part alone exceeds 24 GiB: those rows
          are marked and the second budget is the one that exercises the solver;
  10/50/90%FFN  that share of the FFN bytes (--shares), binding at every shape.
The solver runs as the pass runs it: min-or-nothing from the RTX 4090 profile (60 GB/s CPU, 25 GB/s
PCIe, 20 us synchronisation), balance from its GPU/CPU bandwidths (900 / 60 GB/s), mip_rel_gap 1e-3.
"true gap" re-solves to proven optimality (mip_rel_gap 0) and compares objectives.

    python benchmarks/bench_placement.py [--json OUT] [--batches 64 256] [--no-exact]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from passes.targets import RESERVE_FRACTION  # noqa: E402
from benchmarks.powerinfer_placement import min_neurons_for, solve_placement  # noqa: E402
from passes.costmodel import sync_seconds  # noqa: E402
from passes.targets import GiB, get_target  # noqa: E402

SHAPES = {  # name: (layers, ffn, d_model, kv_heads, head_dim, vocab)
    "7B": (32, 11008, 4096, 32, 128, 32000),
    "13B": (40, 13824, 5120, 40, 128, 32000),
    "70B": (80, 28672, 8192, 8, 128, 32000),
}
BYTES = 2  # fp16
CONTEXT = 256
GPU_BYTES = 24 * GiB


def zipf_frequencies(rng: np.random.Generator, layers: int, width: int, mean: float = 0.10) -> list[np.ndarray]:
    out = []
    ranks = np.arange(1, width + 1, dtype=np.float64)
    for _ in range(layers):
        raw = ranks ** -rng.uniform(0.7, 1.1)
        lo, hi = 0.0, 1e6  # scale so that the mean activity is `mean`, saturating at 1
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.minimum(1.0, mid * raw).mean() < mean else (lo, mid)
        f = np.clip(np.minimum(1.0, lo * raw) * rng.lognormal(0.0, 0.2, width), 0.0, 1.0)
        out.append(rng.permutation(f).astype(np.float32))
    return out


def dense_bytes(layers, ffn, d, kv_heads, head_dim, vocab) -> int:
    attention = layers * (2 * d * d + 2 * d * kv_heads * head_dim)
    norms = layers * 2 * d + d
    return (attention + norms + 2 * vocab * d) * BYTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write the rows as JSON to OUT")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--shares", type=int, nargs="+", default=[10, 50, 90],
                        help="further budgets, as percentages of the FFN bytes")
    parser.add_argument("--no-exact", action="store_true", help="skip the re-solve to proven optimality")
    parser.add_argument("--time-limit", type=float, default=30.0)
    args = parser.parse_args()

    target = get_target("rtx4090")
    timing = {"gpu_time_per_byte": 1 / (target.gpu_bandwidth_gbs * 1e9),
              "cpu_time_per_byte": 1 / (target.cpu_bandwidth_gbs * 1e9)}
    rows = []
    header = (f"{'model':<5} {'shape':>11} {'batch':>5} {'budget':>7} {'GiB':>6} {'of FFN':>6} {'vars':>6} "
              f"{'status':<13} {'gap':>8} {'true gap':>8} {'time s':>7} {'GPU neurons':>11} {'activ.':>6}  note")
    print(header)
    print("-" * len(header))
    for name in args.shapes:
        layers, ffn, d, kv_heads, head_dim, vocab = SHAPES[name]
        frequencies = zipf_frequencies(np.random.default_rng(0), layers, ffn)
        ranked = [np.sort(f)[::-1].astype(np.float64) for f in frequencies]
        per_neuron = 3 * d * BYTES
        ffn_total = layers * ffn * per_neuron
        dense = dense_bytes(*SHAPES[name])
        kv = 2 * layers * kv_heads * head_dim * CONTEXT * BYTES
        on_card = int(GPU_BYTES - dense - kv - GPU_BYTES * RESERVE_FRACTION)
        budgets = []
        if on_card <= 0:
            budgets.append(("24GiB", on_card, "dense part exceeds 24 GiB: nothing to place"))
        elif on_card >= ffn_total:
            budgets.append(("24GiB", on_card, "every neuron fits"))
        else:
            budgets.append(("24GiB", on_card, ""))
        budgets += [(f"{share}%FFN", ffn_total * share // 100, "") for share in args.shares]
        for batch in args.batches:
            sync = sync_seconds(target, d * BYTES)  # the layer's input to the GPU, its partial output back
            minimum = [min_neurons_for(f, per_neuron, batch, target.cpu_bandwidth_gbs, sync) for f in ranked]
            for label, budget, note in budgets:
                started = time.perf_counter()
                placement = solve_placement(frequencies, [per_neuron] * layers, budget, batch=batch,
                                            min_neurons=minimum, time_limit_s=args.time_limit, **timing)
                wall = time.perf_counter() - started
                true_gap = None
                if not args.no_exact and budget > 0:
                    exact = solve_placement(frequencies, [per_neuron] * layers, budget, batch=batch,
                                            min_neurons=minimum, time_limit_s=120.0, mip_rel_gap=0.0, **timing)
                    if exact.status == "Optimal" and exact.objective > 0:
                        true_gap = max(0.0, (exact.objective - placement.objective) / exact.objective)
                total_activity = float(sum(f.sum() for f in ranked))
                row = {
                    "model": name, "layers": layers, "ffn": ffn, "d_model": d, "batch": batch, "budget": label,
                    "budget_bytes": int(budget), "ffn_bytes": int(ffn_total), "dense_bytes": int(dense),
                    "kv_cache_bytes": int(kv), "status": placement.status, "gap": placement.gap, "true_gap": true_gap,
                    "solve_time_s": placement.solve_time_s, "wall_s": wall, "num_variables": placement.num_variables,
                    "gpu_neurons": int(sum(placement.gpu_neurons)), "neurons": layers * ffn,
                    "activation_share": placement.objective / total_activity, "used_bytes": placement.used_bytes,
                    "min_neurons_median": int(np.median(minimum)), "note": note,
                }
                rows.append(row)
                status = placement.status[:13]
                gap = f"{placement.gap * 100:.4f}%"
                true = "-" if true_gap is None else f"{true_gap * 100:.4f}%"
                print(f"{name:<5} {f'{layers}x{ffn}':>11} {batch:>5} {label:>7} {max(budget, 0) / GiB:>6.1f} "
                      f"{max(budget, 0) / ffn_total * 100:>5.0f}% {placement.num_variables:>6} {status:<13} {gap:>8} "
                      f"{true:>8} {placement.solve_time_s:>7.2f} {row['gpu_neurons'] / row['neurons'] * 100:>10.1f}% "
                      f"{row['activation_share'] * 100:>5.1f}%  {note}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "gpu_bytes": GPU_BYTES, "bytes_per_element": BYTES, "context": CONTEXT,
                       "cpu_count": os.cpu_count()}, out, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
