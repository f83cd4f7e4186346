"""Benchmark of the CPU decode and prefill kernels (passes/kernels/cpu.py, neuron.py), uncached.

Prints, in one run, each beside the machine's copy bandwidth (np.copyto of 512 MiB over the same threads,
GB/s of bytes copied, as in bench_cpu_decode.py):
  * decode GEMV on the 1B model's shapes (qkv 2048x6144, o 2048x2048, FFN down 8192x2048, output
    2048x32000): the [K, N] kernel (what the GPU layout reads), panel-packed fp32 and fp16, numpy;
    GB/s of weight bytes read, weights rotated over copies so every call streams from memory;
  * the sparse FFN step of one layer (d 2048, ffn 8192, 10% of rows active, ReLU): the fused one-pass
    kernel in fp32 and fp16 against the separate sparse_up + sparse_down kernels. Index sets and weight
    copies rotate every call, so the gathered rows are not in cache. GB/s of rows actually read (every
    selected up row, and the down rows of neurons whose ReLU output is not 0);
  * prefill GEMM, m=128: panel-packed weights against the [K, N] kernel (which packs per call), the
    neuron-rows GEMM (linear_rows) and numpy, in GFLOP/s.

The kernels are called as the runtime calls them (load_module, tvm_ffi.from_dlpack on 64-byte aligned
arrays). Two thread pools (TVM's and numpy's) spin for a while after each call; on a 2-core machine a
spinning pool steals a core from the other one, so phases are separated by sleeps. Medians and bests
over all calls are reported.

    python benchmarks/bench_kernels.py [--threads 2] [--rounds 3]
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402

from runtime.dtypes import WEIGHT_DTYPES  # noqa: E402

GB = 1e9
SETTLE = 0.5  # seconds between phases, longer than either pool's spin time
GEMV_SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "down": (8192, 2048), "output": (2048, 32000)}
D, FFN, ACTIVE = 2048, 8192, 0.10
INDEX_SETS, COPIES = 16, 3
GEMM_M = 128
GEMM_SHAPES = {"attention 2048x2048": (2048, 2048), "ffn up 2048x8192": (2048, 8192)}


def aligned(array):
    from runtime.artifact import aligned_empty

    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def times(fn, reps):
    out = []
    for r in range(reps):
        started = time.perf_counter()
        fn(r)
        out.append(time.perf_counter() - started)
    time.sleep(SETTLE)
    return out


def rate(samples, work):
    return work / np.median(samples), work / np.min(samples)


def kernels():
    from passes.kernels import cpu, neuron

    funcs = []
    for name, (K, N) in GEMV_SHAPES.items():
        funcs.append(cpu.linear(f"kn_{name}", K, N, rows=1, bias=False))
        for dtype in WEIGHT_DTYPES.values():
            funcs.append(cpu.linear_panels(f"panels_{dtype}_{name}", K, N, rows=1, bias=False, wdtype=dtype))
    for dtype in WEIGHT_DTYPES.values():
        funcs.append(neuron.sparse_ffn(f"ffn_{dtype}", D, FFN, rows=1, gated=False, act="relu", wdtype=dtype))
    funcs += [neuron.sparse_up("up", D, FFN, rows=1, gated=False, act="relu"), neuron.sparse_down("down", FFN, D, rows=1)]
    for name, (K, N) in GEMM_SHAPES.items():
        funcs += [cpu.linear_panels(f"gemm_panels_{K}_{N}", K, N, rows=None, bias=False),
                  cpu.linear(f"gemm_kn_{K}_{N}", K, N, rows=None, bias=False),
                  neuron.linear_rows(f"gemm_rows_{K}_{N}", K, N, rows=None)]
    return cpu, funcs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=12, help="calls per phase and round")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from bench_cpu_decode import Bandwidth
    from passes.targets import host_cpu_isa

    cpu, funcs = kernels()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench_kernels.so")
        started = time.perf_counter()
        isa = host_cpu_isa()
        cpu.build(funcs, isa.llvm_target(), path)
        print(f"built {len(funcs)} kernels for {isa.name} in {time.perf_counter() - started:.1f} s; "
              f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}")
        lib = tvm.runtime.load_module(path)
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    bandwidth = Bandwidth(args.threads)
    results = {}  # label -> (samples, bytes or flops per call, unit)

    def run(label, fn, work, unit="GB/s"):
        results.setdefault(label, ([], work, unit))[0].extend(times(fn, args.reps))

    # ---- decode GEMV: every layout over rotating weight copies
    gemv = {}
    for name, (K, N) in GEMV_SHAPES.items():
        x, y = aligned(rng.standard_normal((1, K)).astype(np.float32)), aligned(np.zeros((1, N), np.float32))
        weights = [rng.standard_normal((K, N)).astype(np.float32) for _ in range(COPIES)]
        kn = [aligned(w) for w in weights]
        panels = {dtype: [aligned(cpu.pack_panels(w).astype(dtype)) for w in weights] for dtype in WEIGHT_DTYPES.values()}
        lib[f"panels_float32_{name}"](dl(x), dl(panels["float32"][0]), dl(y))
        np.testing.assert_allclose(y[0], x[0].astype(np.float64) @ weights[0], rtol=1e-3, atol=1e-3)
        gemv[name] = (K, N, x, y, kn, panels)
        del weights

    # ---- sparse FFN: rotating index sets (sorted, like select's output) and weight copies
    active = int(ACTIVE * FFN)
    up = [aligned((rng.standard_normal((FFN, D)) * 0.02).astype(np.float32)) for _ in range(COPIES)]
    down = [aligned((rng.standard_normal((FFN, D)) * 0.02).astype(np.float32)) for _ in range(COPIES)]
    rows = {"float32": (up, down), "float16": ([aligned(w.astype(np.float16)) for w in up],
                                               [aligned(w.astype(np.float16)) for w in down])}
    indices = []
    for _ in range(INDEX_SETS):
        index = np.zeros((1, FFN), np.int32)
        index[0, :active] = np.sort(rng.choice(FFN, active, replace=False))
        indices.append(aligned(index))
    x = aligned(rng.standard_normal((1, D)).astype(np.float32))
    bias = aligned(np.zeros(FFN, np.float32))
    count = aligned(np.array([[active]], np.int32))
    hidden, scratch, out = (aligned(np.zeros(shape, np.float32)) for shape in ((1, FFN), (8, D), (1, D)))
    fired_list = aligned(np.zeros((1, FFN), np.int32))
    fired = []  # rows actually read per call: every up row, the down rows of neurons that fired
    for r in range(INDEX_SETS):
        selected = indices[r][0, :active]
        fired.append(int(np.count_nonzero(np.maximum(up[r % COPIES][selected] @ x[0], 0))))
    mean_rows = active + float(np.mean(fired))

    def sparse(kind, dtype):
        ups, downs = rows[dtype]

        def call(r):
            i, c = r % INDEX_SETS, r % COPIES
            if kind == "fused":
                lib[f"ffn_{dtype}"](dl(x), dl(indices[i]), dl(count), dl(ups[c]), dl(bias), dl(downs[c]), dl(hidden),
                                    dl(fired_list), dl(scratch), dl(out))
            else:
                lib["up"](dl(x), dl(indices[i]), dl(count), dl(ups[c]), dl(bias), dl(hidden))
                lib["down"](dl(hidden), dl(indices[i]), dl(count), dl(downs[c]), dl(out))
        return call

    sparse("fused", "float32")(0)
    selected = indices[0][0, :active]
    np.testing.assert_allclose(out[0], np.maximum(up[0][selected] @ x[0], 0) @ down[0][selected], rtol=1e-3, atol=1e-4)

    # ---- prefill GEMM
    gemm = {}
    for label, (K, N) in GEMM_SHAPES.items():
        w = rng.standard_normal((K, N)).astype(np.float32)
        gx, gy = aligned(rng.standard_normal((GEMM_M, K)).astype(np.float32)), aligned(np.zeros((GEMM_M, N), np.float32))
        gemm[label] = (K, N, w, gx, gy, aligned(cpu.pack_panels(w)), aligned(w), aligned(np.ascontiguousarray(w.T)),
                       aligned(np.zeros(N, np.float32)))

    time.sleep(SETTLE)
    for _ in range(args.rounds):
        bandwidth()
        for name, (K, N, x1, y1, kn, panels) in gemv.items():
            run(f"GEMV {name} {K}x{N} [K,N] fp32", lambda r: lib[f"kn_{name}"](dl(x1), dl(kn[r % COPIES]), dl(y1)), K * N * 4)
            for dtype, size in (("float32", 4), ("float16", 2)):
                run(f"GEMV {name} {K}x{N} panels {dtype}",
                    lambda r: lib[f"panels_{dtype}_{name}"](dl(x1), dl(panels[dtype][r % COPIES]), dl(y1)), K * N * size)
            run(f"GEMV {name} {K}x{N} numpy fp32", lambda r: x1 @ kn[r % COPIES], K * N * 4)
        for kind, dtype, size in (("fused", "float32", 4), ("fused", "float16", 2), ("up+down", "float32", 4)):
            work = mean_rows * D * size if kind == "fused" else 2 * active * D * size
            run(f"sparse FFN {kind} {dtype}", sparse(kind, dtype), work)
        for label, (K, N, w, gx, gy, wp, wkn, wrows, zeros) in gemm.items():
            flops = 2 * GEMM_M * K * N
            run(f"GEMM m={GEMM_M} {label} panels", lambda r: lib[f"gemm_panels_{K}_{N}"](dl(gx), dl(wp), dl(gy)), flops, "GFLOP/s")
            run(f"GEMM m={GEMM_M} {label} [K,N]", lambda r: lib[f"gemm_kn_{K}_{N}"](dl(gx), dl(wkn), dl(gy)), flops, "GFLOP/s")
            run(f"GEMM m={GEMM_M} {label} rows", lambda r: lib[f"gemm_rows_{K}_{N}"](dl(gx), dl(wrows), dl(zeros), dl(gy)),
                flops, "GFLOP/s")
            run(f"GEMM m={GEMM_M} {label} numpy", lambda r: gx @ w, flops, "GFLOP/s")

    copy = bandwidth.summary()["copy_gbs"]
    print(f"copy bandwidth ({args.threads} threads, 512 MiB, GB/s copied): {copy:.1f} median of {bandwidth.copy}; "
          f"read {bandwidth.summary()['read_gbs']:.1f}")
    print(f"sparse FFN: {active} of {FFN} rows selected, {np.mean(fired):.0f} fired on average "
          f"({mean_rows:.0f} rows of {D} read per call by the fused kernel)")
    print(f"{'kernel':<44} {'median':>9} {'best':>9}  of copy bandwidth")
    for label, (samples, work, unit) in results.items():
        median, best = rate(samples, work / (GB if unit == "GB/s" else 1e9))
        share = f"{median / copy:6.0%}" if unit == "GB/s" else ""
        print(f"{label:<44} {median:7.1f}   {best:7.1f}  {unit:<8} {share}")


if __name__ == "__main__":
    main()
