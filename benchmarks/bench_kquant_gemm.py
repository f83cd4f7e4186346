"""Prefill GEMM over blocks kept from a GGUF file (q5_0, q5_1, q4_k, q5_k, q6_k): the int8-activation kernel
(passes.kernels.kquant_gemm.gemm_panels_kqx8, which linear_panels_kq takes with int8 activations)
against the old path (cpu.gemm over kquant_ops.kq_panels_weight: each task dequantizes its panels into fp32, then
an fp32 register-tiled GEMM), at `--rows` prompt rows, in milliseconds per call; int4's and int8's
gemm_panels_qx8 (quant's panels) against their fp32 GEMM likewise.

The shapes are Qwen2.5-0.5B's (K=896, N=9728: the gate+up FFN matrix, q5_0 in its Q4_K_M file; K=4864, N=896:
the down matrix, q4_k / q6_k) and Qwen2.5/TinyLlama-1B-ish 2048x5632 in every format. Variants alternate in
rounds; medians over rounds. Kernels are built for this machine's widest ISA (zmm tiles on AVX-512, ymm on AVX2;
int8 weights in zmm take VNNI: without it their row compares the fp32 GEMM with itself), `--threads` threads
(TVM_NUM_THREADS).

    python benchmarks/bench_kquant_gemm.py [--rows 128] [--threads 2] [--rounds 7]
        [--cases q5_0:896x9728,q4_k:4864x896,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

FORMATS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
QUANT = ("int4", "int8")  # quant's panels: gemm_panels_qx8 (int8 in zmm needs VNNI)
DEFAULT_CASES = (["q5_0:896x9728", "q4_k:4864x896", "q6_k:4864x896"]
                 + [f"{f}:2048x5632" for f in FORMATS] + ["int4:2048x5632"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help="format:KxN,... (int4, int8: gemm_panels_qx8)")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls per variant and round (the round's time: best)")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import tvm
    import tvm_ffi

    from passes.kernels import kquant, kquant_ops, quant
    from passes.kernels.kquant_gemm import gemm_panels_kqx8
    from passes.targets import host_cpu_isa
    from runtime.dtypes import WEIGHT_FORMATS
    from test_kernels import aligned
    from test_kquant_gemv import random_blocks

    isa = host_cpu_isa()
    if isa.int8_dot is None:
        sys.exit(f"ISA {isa.name}: the int8-activation prefill GEMM needs an int8 dot product")
    tp, dot = isa.gemm_panels, isa.int8_dot
    lanes = 16 if tp > 1 else 8
    print(f"ISA {isa.name} (dot {dot}, tile_panels {tp}), {args.threads} threads, m={args.rows} rows")
    dl = lambda a: tvm_ffi.from_dlpack(a)  # noqa: E731
    rng = np.random.default_rng(0)
    funcs, inputs = {}, {}
    for case in args.cases.split(","):
        name, shape = case.split(":")
        K, N = (int(v) for v in shape.split("x"))
        x = aligned(rng.standard_normal((args.rows, K)).astype(np.float32))
        y = aligned(np.zeros((args.rows, N), np.float32))
        tag = f"{name}_{K}x{N}"
        if name in QUANT:
            bits = WEIGHT_FORMATS[name].bits
            q = rng.integers(-(1 << bits - 1) + 1, 1 << bits - 1, (K, N)).astype(np.int8)
            s = (rng.random((K // 32, N)) * 0.01).astype(np.float16)
            packed = [aligned(a) for a in quant.pack_panels(q, s, WEIGHT_FORMATS[name])]
            funcs[(case, "old")] = quant.linear_panels_q(f"old_{tag}", K, N, rows=None, bits=bits, bias=False,
                                                         tile_panels=tp)
            funcs[(case, "new")] = quant.linear_panels_q(f"new_{tag}", K, N, rows=None, bits=bits, bias=False,
                                                         tile_panels=tp, int8_dot=dot)
        else:
            packed = [aligned(a) for a in kquant.pack_panels(random_blocks(rng, WEIGHT_FORMATS[name], K, N))]
            funcs[(case, "old")] = kquant_ops.linear_panels_kq(f"old_{tag}", K, N, rows=None, fmt=name, bias=False,
                                                               tile_panels=tp)
            funcs[(case, "new")] = gemm_panels_kqx8(f"new_{tag}", K, N, fmt=WEIGHT_FORMATS[name], dot=dot,
                                                    tile_panels=tp, lanes=lanes)
        inputs[case] = [dl(x), *(dl(a) for a in packed), dl(y)]
    start = time.perf_counter()
    lib = tvm.compile(tvm.IRModule({str(f.attrs["global_symbol"]): f for f in funcs.values()}),
                      target=tvm.target.Target(isa.llvm_target()))
    print(f"built in {time.perf_counter() - start:.0f} s")
    times = {key: [] for key in funcs}
    for key, f in funcs.items():  # warm up
        lib[str(f.attrs["global_symbol"])](*inputs[key[0]])
    for _ in range(args.rounds):
        for key, f in funcs.items():
            fn, a = lib[str(f.attrs["global_symbol"])], inputs[key[0]]
            best = float("inf")
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn(*a)
                best = min(best, time.perf_counter() - t0)
            times[key].append(best)
        time.sleep(0.05)
    print("| format | K x N | old: cpu.gemm, fp32 (ms) | new: int8 x (ms) | old / new | new GMAC/s |")
    print("|---|---|---:|---:|---:|---:|")
    for case in args.cases.split(","):
        name, shape = case.split(":")
        K, N = (int(v) for v in shape.split("x"))
        old, new = (float(np.median(times[(case, v)])) for v in ("old", "new"))
        label = f"{name} (qx8)" if name in QUANT else name
        print(f"| {label} | {K}x{N} | {old * 1e3:.2f} | {new * 1e3:.2f} | {old / new:.2f} | "
              f"{args.rows * K * N / new / 1e9:.0f} |")


if __name__ == "__main__":
    main()
