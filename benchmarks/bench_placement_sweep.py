"""The placement sweep: expected decode tok/s of picompile's placement (passes/placement.py: one integer program
over every block) against llama.cpp-style layer offload and PowerInfer's policy (`powerinfer_plan`), from no GPU
memory to the whole model, at 7B, 13B, 40B and 70B shapes. No GPU is needed: all three are priced by the same cost
model (passes/costmodel.py `price`, `price_ffn`, `step_seconds`) for a target's bandwidths.

Shapes: LLaMA-2 7B/13B/70B (ReGLU: gated FFN; 70B with 8 KV heads), ReluFalcon-40B (plain ReLU FFN, 8 KV heads).
Weights: the GPU stores matrices in fp16 (`sizes.GPU_WEIGHT_FORMAT`), the CPU in --weight-dtype (fp16 or int4 here).
Neuron activity: power law per layer with mean 10% (bench_placement.py's `zipf_frequencies`, seeded); predictors of rank r (d*r + r*F
parameters per layer, 1024 by default, int8 on the CPU in quantized builds); `--precision` sets the predicted rows
per truly active neuron (1/precision: 0.4 is the hard end this project measured, 1.0 an ideal predictor).

    python benchmarks/bench_placement_sweep.py [--target rtx4090] [--weight-dtype fp16] [--precision 0.4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_placement import zipf_frequencies  # noqa: E402  (the same synthetic activity as PowerInfer's ILP benchmark)
from passes import placement  # noqa: E402
from benchmarks.powerinfer_placement import min_neurons_for, solve_placement  # noqa: E402
from passes.costmodel import (CONTEXT, BlockBytes, FfnBytes, copy_seconds, price, price_ffn, step_seconds,  # noqa: E402
                              sync_seconds)
from passes.sizes import GPU_WEIGHT_FORMAT, KV_CACHE_DTYPE, PREDICTOR_FORMAT  # noqa: E402
from passes.targets import GiB, get_target  # noqa: E402
from runtime.dtypes import WEIGHT_FORMATS, itemsize  # noqa: E402

SHAPES = {  # name: (layers, d_model, ffn, gated, kv_heads, head_dim, vocab)
    "7B": (32, 4096, 11008, True, 32, 128, 32000),
    "13B": (40, 5120, 13824, True, 40, 128, 32000),
    "40B": (60, 8192, 32768, False, 8, 128, 65024),
    "70B": (80, 8192, 28672, True, 8, 128, 32000),
}
ATTENTION_CALLS = 5  # norm, q/k/v, attention, output projection with the residual, the FFN's norm
DENSE_FFN_CALLS = 2
PREDICTOR_CALLS = 2


def problem(shape: str, target, weight_dtype: str, budget: int, frequencies, rank: int, precision: float,
            max_context: int) -> placement.Problem:
    layers, d, ffn, gated, kv_heads, head_dim, vocab = SHAPES[shape]
    gpu, cpu = GPU_WEIGHT_FORMAT.bytes_per_weight, WEIGHT_FORMATS[weight_dtype].bytes_per_weight
    kv = 2 * kv_heads * head_dim * itemsize(KV_CACHE_DTYPE)  # per token
    attention_weights = 2 * d * d + 2 * d * kv_heads * head_dim
    kv_read = kv * min(CONTEXT, max_context)
    attention = price(target, BlockBytes(int(attention_weights * gpu + kv * max_context + 8 * d),
                                         attention_weights * cpu + kv_read, attention_weights * gpu + kv_read,
                                         ATTENTION_CALLS))
    up = 2 if gated else 1
    ffn_weights = (up + 1) * d * ffn
    predictor_weights = d * rank + rank * ffn
    row = 4 * d  # fp32 activations
    built = []
    for f in frequencies:
        ffn_bytes = FfnBytes(
            dense=BlockBytes(int(ffn_weights * gpu), ffn_weights * cpu, ffn_weights * gpu, DENSE_FFN_CALLS),
            width=ffn, activation_bytes=row, gpu_bytes_per_neuron=int((up + 1) * d * gpu),
            cpu_bytes_per_neuron=int((up + 1) * d * cpu), frequencies=f,
            predictor=BlockBytes(int(predictor_weights * gpu),
                                 predictor_weights * PREDICTOR_FORMAT.bytes_per_weight,
                                 predictor_weights * gpu, PREDICTOR_CALLS),
            rows_per_active=1.0 / precision)
        built.append(placement.Layer(attention, price_ffn(target, ffn_bytes)))
    embed = price(target, BlockBytes(int(vocab * d * gpu), d * cpu, d * gpu, 1))
    head = price(target, BlockBytes(int(vocab * d * gpu + 4 * d), vocab * d * cpu, vocab * d * gpu, 2))
    head = placement.Block(head.gpu_bytes, head.cpu_s, head.gpu_s + copy_seconds(target, 4 * vocab))
    return placement.Problem(embed, tuple(built), head, copy_seconds(target, row), int(budget))


def powerinfer_plan(p: placement.Problem, shape: str, target, weight_dtype: str, batch: int = 64) -> placement.Plan:
    """PowerInfer's policy, priced by the same costs: every dense block (attention, output layer) and predictor on
    the GPU if they all fit, then FFN neurons by its ILP (benchmarks/powerinfer_placement.py, with its
    minimum-or-nothing and balance rules) in what is left; else everything on the CPU. FFNs always sparse."""
    n = len(p.layers)
    dense = p.head.gpu_bytes + sum(layer.attention.gpu_bytes + layer.ffn.predictor.gpu_bytes for layer in p.layers)
    if dense > p.budget_bytes:
        return placement.Plan("cpu", ["cpu"] * n, ["sparse"] * n, [0] * n, "cpu")
    _, d, _, gated, _, _, _ = SHAPES[shape]
    cpu_bytes = int(((2 if gated else 1) + 1) * d * WEIGHT_FORMATS[weight_dtype].bytes_per_weight)
    frequencies = [layer.ffn.frequencies for layer in p.layers]
    sync = sync_seconds(target, 4 * d)
    minimum = [min_neurons_for(np.sort(f)[::-1], cpu_bytes, batch, target.cpu_bandwidth_gbs, sync) for f in frequencies]
    share = cpu_bytes / p.layers[0].ffn.gpu_bytes_per_neuron
    solved = solve_placement(frequencies, [layer.ffn.gpu_bytes_per_neuron for layer in p.layers], p.budget_bytes - dense,
                             batch=batch, min_neurons=minimum, gpu_time_per_byte=1 / (target.gpu_bandwidth_gbs * 1e9),
                             cpu_time_per_byte=share / (target.cpu_bandwidth_gbs * 1e9))
    return placement.Plan("cpu", ["gpu"] * n, ["sparse"] * n, solved.gpu_neurons, "gpu")


def model_gpu_bytes(p: placement.Problem) -> int:
    return p.embed.gpu_bytes + p.head.gpu_bytes + sum(
        layer.attention.gpu_bytes + layer.ffn.dense.gpu_bytes + layer.ffn.predictor.gpu_bytes for layer in p.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="rtx4090")
    parser.add_argument("--weight-dtype", default="fp16", choices=["fp32", "fp16", "int8", "int4"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=12, help="budgets per shape, evenly from 0 to the whole model")
    parser.add_argument("--precision", type=float, default=0.4, help="predictor precision (truly active / selected)")
    parser.add_argument("--rank", type=int, default=1024, help="predictor rank")
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=None, help="neurons per program column (default: placement.default_batch)")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    target = get_target(args.target)
    rows = []
    print(f"target {target.name} (GPU {target.gpu_bandwidth_gbs:.0f} GB/s, CPU {target.cpu_bandwidth_gbs:.0f} GB/s, "
          f"PCIe {target.pcie_bandwidth_gbs:.0f} GB/s), CPU weights {args.weight_dtype}, GPU fp16, "
          f"predictor precision {args.precision}")
    header = (f"{'model':<5} {'budget GiB':>10} {'of model':>8} {'picompile':>10} {'offload':>8} {'ratio':>6} "
              f"{'PowerInfer':>10} {'ratio':>6} {'layers':>6} {'attn GPU':>8} {'FFN on GPU':>10} {'status':<10} {'solve s':>7}")
    print(header)
    print("-" * len(header))
    for shape in args.shapes:
        frequencies = zipf_frequencies(np.random.default_rng(0), SHAPES[shape][0], SHAPES[shape][2])
        whole = model_gpu_bytes(problem(shape, target, args.weight_dtype, 0, frequencies, args.rank, args.precision,
                                        args.max_context))
        for step in range(args.steps + 1):
            budget = int(whole * step / args.steps)
            p = problem(shape, target, args.weight_dtype, budget, frequencies, args.rank, args.precision,
                        args.max_context)
            solved = placement.solve(p, batch=args.batch, time_limit_s=args.time_limit)
            offload = placement.layer_offload(p)
            ours, theirs = 1 / solved.seconds, 1 / step_seconds(p, offload)
            theirs_powerinfer = powerinfer_plan(p, shape, target, args.weight_dtype)
            assert placement.gpu_bytes_used(p, theirs_powerinfer) <= budget
            powerinfer = 1 / step_seconds(p, theirs_powerinfer)
            plan = solved.plan
            ffn_share = sum(plan.gpu_neurons) / sum(layer.ffn.width for layer in p.layers)
            row = {"model": shape, "budget_bytes": budget, "model_bytes": whole, "picompile_tok_s": ours,
                   "offload_tok_s": theirs, "powerinfer_tok_s": powerinfer, "offload_layers": offload.attention.count("gpu"),
                   "attention_on_gpu": plan.attention.count("gpu"), "ffn_neurons_on_gpu": ffn_share,
                   "status": solved.status, "gap": solved.gap, "solve_time_s": solved.solve_time_s,
                   "used_bytes": solved.used_bytes, "plan": plan.to_json()}
            rows.append(row)
            print(f"{shape:<5} {budget / GiB:>10.1f} {step / args.steps:>8.0%} {ours:>10.2f} {theirs:>8.2f} "
                  f"{ours / theirs:>6.2f} {powerinfer:>10.2f} {ours / powerinfer:>6.2f} {row['offload_layers']:>6} {row['attention_on_gpu']:>8} "
                  f"{ffn_share:>10.1%} {solved.status[:10]:<10} {solved.solve_time_s:>7.2f}", flush=True)
    worst = min(r["picompile_tok_s"] / r["offload_tok_s"] for r in rows)
    worst_powerinfer = min(r["picompile_tok_s"] / r["powerinfer_tok_s"] for r in rows)
    print(f"lowest picompile / layer offload: {worst:.3f}; lowest picompile / PowerInfer's policy: {worst_powerinfer:.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"target": target.name, "args": vars(args), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
