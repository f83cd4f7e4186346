"""Decode GEMV over blocks kept from a GGUF file (q5_0, q5_1, q4_k, q5_k, q6_k: passes.kernels.kquant_gemv's
int8-activation kernel) against the int4 one (quant.gemv_panels_q4x8) at the same shape, in weight bytes read
per second (values and scales).

Per variant, enough distinct copies of the packed weight (`--mib` of bytes) that every call streams it from
memory; the variants alternate in rounds of one call per copy; medians over rounds. Also the best time of one
copy called again and again (in cache where it fits). Kernels are built for this machine's widest ISA (dot:
vnni where it has AVX512-VNNI, else madd), `--threads` threads (TVM_NUM_THREADS).

(The K-quants are left out at a K not a multiple of 256, their super-blocks.)

    python benchmarks/bench_kquant_gemv.py [--shapes 2048x5632,2048x2048] [--formats q4_k,q6_k] [--group 1,4]
        [--threads 2] [--rounds 10] [--fp32]
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
WARM_CALLS = 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2048x5632,2048x2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mib", type=int, default=192, help="weight bytes per variant and shape, in copies")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated kept formats")
    parser.add_argument("--group", default="",
                        help="panels a task of the kept formats' int8-activation kernels, a comma list timed "
                             "alternated (default: the kernel's choice)")
    parser.add_argument("--fp32", action="store_true", help="also the fp32-activation kernels (gemv_panels_kq)")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import tvm
    import tvm_ffi

    from passes.kernels import cpu, kquant, quant
    from passes.kernels.kquant_gemv import gemv_panels_kq, gemv_panels_kq_x8
    from passes.targets import host_cpu_isa
    from runtime.dtypes import WEIGHT_FORMATS
    from test_kernels import aligned
    from test_kquant_gemv import random_blocks

    isa = host_cpu_isa()
    groups = [int(g) for g in args.group.split(",") if g] or [None]
    wide = isa.gemm_panels > 1
    dot, lanes = (isa.int8_dot, 16) if wide else ("madd", 8)
    print(f"ISA {isa.name} (dot {dot}, {lanes} lanes), {args.threads} threads")
    rows = []
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        P = -(-N // cpu.PANEL)
        group = cpu.gemv_group(P, quant.X8_GEMV_PANELS if wide else 2)
        rng = np.random.default_rng(0)
        x = aligned(rng.standard_normal((1, K)).astype(np.float32))
        y = aligned(np.zeros((1, N), np.float32))
        funcs, packs = {}, {}
        # int4 (the baseline)
        q = rng.integers(-8, 8, (K, N)).astype(np.int8)
        s = (rng.random((K // 32, N)) * 0.01).astype(np.float16)
        funcs["int4 x8"] = quant.gemv_panels_q4x8("int4_x8", K, N, dot=dot, lanes=lanes, group=group)
        packs["int4 x8"] = quant.pack_panels(q, s, WEIGHT_FORMATS["int4"])
        for name in args.formats.split(","):
            fmt = WEIGHT_FORMATS[name]
            if K % (fmt.super_block or 32):
                continue  # (the K-quants need K a multiple of 256)
            packed = kquant.pack_panels(random_blocks(rng, fmt, K, N))
            for g in groups:
                label = f"{name} x8" + (f" ({g} a task)" if g else "")
                funcs[label] = gemv_panels_kq_x8(f"{name}_x8_{g}", K, N, fmt=fmt, dot=dot, lanes=lanes,
                                                 group=g or (None if wide else group))
                packs[label] = packed
            if args.fp32:
                funcs[f"{name} fp32"] = gemv_panels_kq(f"{name}_f32", K, N, fmt=fmt,
                                                       group=group if wide else 1)
                packs[f"{name} fp32"] = packed
        lib = tvm.compile(tvm.IRModule({str(f.attrs["global_symbol"]): f for f in funcs.values()}),
                          target=tvm.target.Target(isa.llvm_target()))
        dl = lambda a: tvm_ffi.from_dlpack(a)  # noqa: E731
        variants = {}
        for label, f in funcs.items():
            nbytes = sum(a.nbytes for a in packs[label])
            copies = max(2, -(-(args.mib << 20) // nbytes))
            base = [aligned(a) for a in packs[label]]
            cps = [[dl(base[0]), dl(base[1])]] + [[dl(aligned(a)) for a in base] for _ in range(copies - 1)]
            variants[label] = (lib[str(f.attrs["global_symbol"])], cps, nbytes)
        times = {label: [] for label in variants}
        hot = {label: [] for label in variants}
        xd, yd = dl(x), dl(y)
        for _ in range(args.rounds):
            for label, (fn, cps, _) in variants.items():
                start = time.perf_counter()
                for c in cps:
                    fn(xd, *c, yd)
                times[label].append((time.perf_counter() - start) / len(cps))
                for _ in range(WARM_CALLS):
                    start = time.perf_counter()
                    fn(xd, *cps[0], yd)
                    hot[label].append(time.perf_counter() - start)
                time.sleep(0.1)
        base_t = float(np.median(times["int4 x8"]))
        for label, (_, _, nbytes) in variants.items():
            t = float(np.median(times[label]))
            rows.append((f"{K}x{N}", label, nbytes / 2**20, t * 1e6, nbytes / t / 1e9, min(hot[label]) * 1e6,
                         nbytes / min(hot[label]) / 1e9, t / base_t))
    print("| shape | kernel | MiB | us/call (DRAM) | GB/s (DRAM) | us/call (hot) | GB/s (hot) | time vs int4 x8 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.0f} | {r[4]:.1f} | {r[5]:.0f} | {r[6]:.1f} | {r[7]:.2f} |")


if __name__ == "__main__":
    main()
