"""A model split across machines, on paper: the cost model's decode tokens/s of picompile's stages (passes/nodes.py's
split, each stage's own placement) against llama.cpp RPC-style layer splitting, for a 70B ReLU model on two and
four machines. No cluster is needed: both are priced by the same cost model (passes/costmodel.py) for the nodes'
bandwidths, with the same hand-over price (passes/nodes.py: a 10 GbE link).

Two kinds of machine, each offering 90% of its memory to the model (the rest is the system's):
- `cpu`: 24 GiB of RAM and the CPU alone (the `cpu` target's 38 GB/s), int4 weights (a 70B model in fp16 fits
  neither two nor four of them). picompile: every stage's FFNs sparse (its predictors, int8). llama.cpp RPC: the
  same layers, dense.
- `rtx4090`: an RTX 4090 (24 GB) beside 64 GiB of RAM (the `rtx4090` target's bandwidths), fp16 weights.
  picompile: each stage's hot/cold split of its layers between its card and its CPU (passes/placement.py's
  integer program over the stage's blocks). llama.cpp RPC: each machine's layers offloaded whole to its card
  as far as they fit (`placement.layer_offload`), the rest on its CPU, dense.

Layers go to nodes in contiguous ranges. The machines are alike, so picompile's split (fastest slowest stage)
and llama.cpp's (by memory) give the same ranges. Figures:
- one request: a token passes every stage and every hand-over, one after the other (both systems);
- concurrent requests: picompile's stages overlap the tokens of different requests, so the slowest stage bounds
  the pipeline (`pipelined`); llama.cpp's RPC backend runs one graph at a time over its nodes, whose stages do not
  overlap (it batches concurrent sequences into one pass instead: a gain this per-token model does not price).

    python benchmarks/bench_nodes.py [--shape 70B] [--nodes 2,4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_placement import zipf_frequencies  # noqa: E402
from bench_placement_sweep import SHAPES, problem  # noqa: E402
from passes import placement  # noqa: E402
from passes.costmodel import step_seconds  # noqa: E402
from passes.partition import stage_problems  # noqa: E402
from passes.nodes import Node, Part, handover_seconds, split_layers  # noqa: E402
from passes.sizes import KV_CACHE_DTYPE, PREDICTOR_FORMAT  # noqa: E402
from passes.targets import GiB, get_target  # noqa: E402
from runtime.dtypes import WEIGHT_FORMATS, itemsize  # noqa: E402

OFFERED = 0.9  # of a machine's RAM: what the model may take
MACHINES = {  # kind: (target, RAM, CPU weight format)
    "cpu": ("cpu", 24 * GiB, "int4"),
    "rtx4090": ("rtx4090", 64 * GiB, "fp16"),
}


def layer_part(shape: str, weight_dtype: str, rank: int, max_context: int) -> Part:
    """One layer's bytes on its node's CPU: its matrices in `weight_dtype`, its predictor (int8) and KV cache."""
    _, d, ffn, gated, kv_heads, head_dim, _ = SHAPES[shape]
    weights = (2 * d * d + 2 * d * kv_heads * head_dim + ((2 if gated else 1) + 1) * d * ffn)
    stored = (weights * WEIGHT_FORMATS[weight_dtype].bytes_per_weight + (d * rank + rank * ffn)
              * PREDICTOR_FORMAT.bytes_per_weight + 2 * kv_heads * head_dim * max_context * itemsize(KV_CACHE_DTYPE))
    return Part(int(stored), float(stored))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="70B", choices=list(SHAPES))
    parser.add_argument("--nodes", default="2,4", help="node counts, comma-separated")
    parser.add_argument("--machines", default="cpu,rtx4090", help=f"machine kinds: {', '.join(MACHINES)}")
    parser.add_argument("--precision", type=float, default=0.4, help="predictor precision (truly active / selected)")
    parser.add_argument("--rank", type=int, default=1024, help="predictor rank")
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    layers, d = SHAPES[args.shape][0], SHAPES[args.shape][1]
    frequencies = zipf_frequencies(np.random.default_rng(0), layers, SHAPES[args.shape][2])
    handover = handover_seconds(4 * d)
    rows = []
    header = (f"{'machines':<14} {'layers per node':<22} {'GiB per node':<18} {'picompile 1 req':>15} "
              f"{'pipelined':>9} {'llama.cpp RPC':>13} {'1 req ratio':>11} {'pipelined ratio':>15}")
    print(f"{args.shape} ReLU, predictor precision {args.precision}, context {args.max_context}; hand-over "
          f"{4 * d} B = {handover * 1e6:.0f} us")
    print(header)
    print("-" * len(header))
    for kind in args.machines.split(","):
        target_name, ram, weight_dtype = MACHINES[kind]
        target = get_target(target_name)
        budget = int(target.gpu_memory_bytes * (1 - 0.05))
        whole = problem(args.shape, target, weight_dtype, budget, frequencies, args.rank, args.precision,
                        args.max_context)
        part = layer_part(args.shape, weight_dtype, args.rank, args.max_context)
        _, d_, _, _, _, _, vocab = SHAPES[args.shape]
        table = Part(int(vocab * d_ * WEIGHT_FORMATS[weight_dtype].bytes_per_weight), 0.0)
        head = Part(table.stored_bytes, float(table.stored_bytes))
        for count in (int(n) for n in args.nodes.split(",")):
            nodes = tuple(Node(f"node{k}", int(ram * OFFERED + target.gpu_memory_bytes * (1 - 0.05)), target_name)
                          for k in range(count))
            try:
                stages = split_layers([part] * layers, table, head, nodes)
            except Exception as error:  # the model does not fit these machines
                print(f"{count} x {kind:<10} does not fit: {error}")
                rows.append({"machines": kind, "nodes": count, "fits": False, "reason": str(error)})
                continue
            ours, theirs = [], []
            # each stage's blocks within its own node's card, as the partition pass places a split build
            subs = stage_problems(whole, list(range(layers)), [range(s.first_layer, s.stop_layer) for s in stages],
                                  [budget if target.has_gpu else 0] * count)
            for sub in subs:
                if target.has_gpu:
                    ours.append(placement.solve(sub, time_limit_s=args.time_limit).seconds)
                    theirs.append(step_seconds(sub, placement.layer_offload(sub)))
                else:
                    ours.append(step_seconds(sub, placement.cpu_only(sub)))
                    theirs.append(step_seconds(sub, placement.cpu_dense(sub)))
            one, pipelined = sum(ours) + (count - 1) * handover, max(ours)
            rpc = sum(theirs) + (count - 1) * handover
            row = {"machines": kind, "nodes": count, "fits": True, "weight_dtype": weight_dtype,
                   "ranges": [(s.first_layer, s.stop_layer) for s in stages],
                   "stored_bytes": [s.stored_bytes for s in stages], "picompile_stage_s": ours,
                   "rpc_stage_s": theirs, "picompile_tok_s": 1 / one, "picompile_pipelined_tok_s": 1 / pipelined,
                   "rpc_tok_s": 1 / rpc, "handover_s": handover}
            rows.append(row)
            spans = ", ".join(f"{a}-{b - 1}" for a, b in row["ranges"])
            sizes = ", ".join(f"{b / GiB:.1f}" for b in row["stored_bytes"])
            print(f"{count} x {kind:<10} {spans:<22} {sizes:<18} {1 / one:>15.2f} {1 / pipelined:>9.2f} "
                  f"{1 / rpc:>13.2f} {rpc / one:>10.2f}x {rpc / pipelined:>14.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
