"""Batch steps' kernels against B one-token ones: the prefill GEMM over B rows (what a batch step's row-wise
linears run) against B decode GEMVs, and the fused sparse FFN over B rows and the union of their selections
against B decode calls over each row's own.

The linears' weights are rotated copies (`--copies`, K x N each) so that they are read from memory, as in a
model; the FFN's up and down rows (F x K fp32 each) are larger than a cache. Medians of `--rounds`. The sparse
FFN's selections are a perfect predictor's: each row's x random and the up bias set so that about 10% of the
neurons fire, independently per row, and each row selects exactly the neurons that fire for it. So the union
grows as 1 - 0.9^B of the neurons (real models' rows share their hot neurons: smaller unions), and a neuron only
other rows selected does not fire for a row (its up dot product is computed, its down row is not read for it).

    python benchmarks/bench_batch_kernels.py [--k 2048] [--ffn 8192] [--batches 1,2,4,8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402

from passes.kernels import cpu, neuron  # noqa: E402
from passes.targets import host_cpu_isa  # noqa: E402
from runtime.artifact import aligned_zeros  # noqa: E402


def aligned(array: np.ndarray) -> np.ndarray:
    out = aligned_zeros(array.shape, array.dtype)
    out[...] = array
    return out


def median_seconds(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2048, help="model width (the GEMM's K = N, the FFN's D)")
    parser.add_argument("--ffn", type=int, default=8192, help="FFN neurons")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    K, F, max_batch = args.k, args.ffn, max(batches)
    isa = host_cpu_isa()
    funcs = []
    for dtype in ("float32", "float16"):
        funcs.append(cpu.linear_panels(f"gemv_{dtype}", K, K, rows=1, wdtype=dtype, bias=False,
                                       tile_panels=isa.gemm_panels))
        funcs.append(cpu.linear_panels(f"gemm_{dtype}", K, K, rows=None, wdtype=dtype, bias=False,
                                       tile_panels=isa.gemm_panels))
    funcs.append(neuron.sparse_ffn("ffn_decode", K, F, rows=1, gated=False, act="relu", max_batch=max_batch))
    funcs.append(neuron.sparse_ffn("ffn_batch", K, F, rows=None, gated=False, act="relu", max_batch=max_batch))
    library = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_batch_kernels_{os.getpid()}.so")
    cpu.build(funcs, isa.llvm_target(), library)
    lib = tvm.runtime.load_module(library)
    os.remove(library)
    ffi = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    print(f"CPU ISA {isa.name}; K = N = {K}; FFN {F} x {K} fp32; medians of {args.rounds} rounds over "
          f"{args.copies} weight copies")
    print(f"{'kernel':>14} {'B':>3} {'B one-token ms':>15} {'batch ms':>9} {'batch / B one-token':>20}")
    for dtype in ("float32", "float16"):
        weights = [ffi(aligned(cpu.pack_panels(rng.standard_normal((K, K)).astype(dtype)))) for _ in range(args.copies)]
        for B in batches:
            x, y = aligned(rng.standard_normal((B, K)).astype(np.float32)), aligned_zeros((B, K), np.float32)
            rows = [(ffi(x[i:i + 1]), ffi(y[i:i + 1])) for i in range(B)]
            X, Y = ffi(x), ffi(y)
            gemv, gemm = lib[f"gemv_{dtype}"], lib[f"gemm_{dtype}"]
            one = median_seconds(lambda: [gemv(xi, w, yi) for w in weights for xi, yi in rows], args.rounds)
            batch = median_seconds(lambda: [gemm(X, w, Y) for w in weights], args.rounds)
            print(f"{'linear ' + dtype:>14} {B:>3} {one / args.copies * 1e3:>15.3f} "
                  f"{batch / args.copies * 1e3:>9.3f} {batch / one:>20.2f}")
    up_rows, down_rows = (aligned(rng.standard_normal((F, K)).astype(np.float32)) for _ in range(2))
    parts = [(ffi(up_rows), ffi(down_rows))]
    bias_values = np.full(F, -1.2816 * np.sqrt(K), np.float32)  # P(N(0, K) > 1.2816 sqrt(K)) = 0.1
    bias = ffi(aligned(bias_values))
    scratch, fired = ffi(aligned_zeros((neuron.FFN_TASKS, max_batch * K), np.float32)), ffi(aligned_zeros((1, F), np.int32))

    def selection(chosen):
        index = aligned_zeros((1, F), np.int32)
        index[0, :len(chosen)] = chosen
        return ffi(index), ffi(aligned(np.array([[len(chosen)]], np.int32)))

    for B in batches:
        x = aligned(rng.standard_normal((B, K)).astype(np.float32))
        own = [np.nonzero(up_rows @ x[i] + bias_values > 0)[0].astype(np.int32) for i in range(B)]
        union = np.unique(np.concatenate(own)).astype(np.int32)
        singles = [(ffi(x[i:i + 1]), *selection(own[i]), ffi(aligned_zeros((1, F), np.float32)),
                    ffi(aligned_zeros((1, K), np.float32))) for i in range(B)]
        together = (ffi(x), *selection(union), ffi(aligned_zeros((B, F), np.float32)), ffi(aligned_zeros((B, K), np.float32)))
        decode, batched = lib["ffn_decode"], lib["ffn_batch"]

        def one_token():
            for up, down in parts:
                for xi, index, count, hidden, out in singles:
                    decode(xi, index, count, up, bias, down, hidden, fired, scratch, out)

        def batch_step():
            xb, index, count, hidden, out = together
            for up, down in parts:
                batched(xb, index, count, up, bias, down, hidden, fired, scratch, out)

        one, batch = median_seconds(one_token, args.rounds), median_seconds(batch_step, args.rounds)
        print(f"{'sparse_ffn':>14} {B:>3} {one / len(parts) * 1e3:>15.3f} {batch / len(parts) * 1e3:>9.3f} "
              f"{batch / one:>20.2f}   (union {len(union)} neurons, each row's own {len(own[0])})")


if __name__ == "__main__":
    main()
