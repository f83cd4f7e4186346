"""Benchmark of the CPU kernels in passes/kernels/cpu.py.

Prints, in one run:
  * copy bandwidth: np.copyto of a 256 MiB array (GB/s of bytes copied, single thread);
  * decode GEMV, x[1, 2048] @ W[2048, 8192] fp32 (64 MiB weights, three copies used in turn so
    every call streams W from memory): GB/s of weights read, TVM kernel vs numpy ``x @ W``;
  * prefill GEMM, m=128, K=N=2048: GFLOP/s, TVM kernel vs numpy;
  * decode attention over a 2048-entry KV cache (32 heads, 8 KV heads, hd 64), for scale.

The TVM kernels are built to a .so and called as the runtime calls them (load_module,
tvm_ffi.from_dlpack on 64-byte aligned arrays). TVM_NUM_THREADS defaults to 2.

Two thread pools (TVM's and OpenBLAS's) spin for a while after each call; on a 2-core machine
a spinning pool steals a core from the other one, so phases are separated by sleeps.
Each phase is repeated for several rounds; medians and bests over all calls are reported.

    python benchmarks/bench_kernels.py [--rounds N]
"""

import os

os.environ.setdefault("TVM_NUM_THREADS", "2")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402

from passes.kernels import cpu  # noqa: E402

K, N = 2048, 8192  # GEMV
GM, GK, GN = 128, 2048, 2048  # GEMM
H, KVH, HD, CTX = 32, 8, 64, 2048  # attention
GB = 1e9
SETTLE = 0.5  # seconds between phases, longer than either pool's spin time


def aligned_empty(shape, dtype="float32", align=64):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + n].view(dtype).reshape(shape)


def aligned_rand(rng, *shape):
    a = aligned_empty(shape)
    a[...] = rng.standard_normal(shape, dtype=np.float32)
    return a


def times(fn, reps):
    out = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r)
        out.append(time.perf_counter() - t)
    time.sleep(SETTLE)
    return out


def summary(samples, work, unit):
    s = np.asarray(samples)
    return f"{work / np.median(s):7.1f} {unit} median, {work / s.min():7.1f} best"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=12, help="calls per phase and round")
    args = ap.parse_args()

    print(f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}  load average {os.getloadavg()[0]:.2f}")
    funcs = [
        cpu.linear("gemv", K, N, rows=1, bias=False),
        cpu.linear("gemm", GK, GN, rows=None, bias=False),
        cpu.attention("attn", H, KVH, HD, CTX, HD**-0.5, rows=1),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench_kernels.so")
        t = time.perf_counter()
        cpu.build(funcs, cpu.CPU_TARGET, path)
        print(f"built {len(funcs)} kernels in {time.perf_counter() - t:.1f} s")
        lib = tvm.runtime.load_module(path)
    gemv, gemm, attn = lib["gemv"], lib["gemm"], lib["attn"]
    dl = tvm_ffi.from_dlpack

    rng = np.random.default_rng(0)
    ws = [aligned_rand(rng, K, N) for _ in range(3)]  # 192 MiB in turn: far above the 32 MiB L3
    x, y = aligned_rand(rng, 1, K), aligned_empty((1, N))
    gemv_args = [(dl(x), dl(w), dl(y)) for w in ws]
    gemv(*gemv_args[0])
    np.testing.assert_allclose(y, x.astype(np.float64) @ ws[0], rtol=1e-3, atol=1e-3)

    gx, gw, gy = aligned_rand(rng, GM, GK), aligned_rand(rng, GK, GN), aligned_empty((GM, GN))
    gemm_args = (dl(gx), dl(gw), dl(gy))
    gemm(*gemm_args)
    np.testing.assert_allclose(gy, gx.astype(np.float64) @ gw, rtol=1e-3, atol=1e-3)

    q, out = aligned_rand(rng, 1, H * HD), aligned_empty((1, H * HD))
    kc, vc = aligned_rand(rng, KVH, CTX, HD), aligned_rand(rng, KVH, CTX, HD)
    attn_args = (dl(q), dl(kc), dl(vc), dl(out), CTX - 1)

    src = np.ones(64 << 20, np.float32)  # 256 MiB
    dst = np.empty_like(src)
    res = {k: [] for k in ("copy", "gemv", "np_gemv", "gemm", "np_gemm", "attn")}
    time.sleep(SETTLE)
    for _ in range(args.rounds):
        res["copy"] += times(lambda r: np.copyto(dst, src), 4)
        res["gemv"] += times(lambda r: gemv(*gemv_args[r % 3]), args.reps)
        res["np_gemv"] += times(lambda r: x @ ws[r % 3], args.reps)
        res["gemm"] += times(lambda r: gemm(*gemm_args), args.reps)
        res["np_gemm"] += times(lambda r: gx @ gw, args.reps)
        res["attn"] += times(lambda r: attn(*attn_args), args.reps)

    wbytes, flops, kvbytes = K * N * 4 / GB, 2 * GM * GK * GN / GB, 2 * KVH * CTX * HD * 4 / GB
    print(f"copy bandwidth (np.copyto 256 MiB, GB/s copied): {summary(res['copy'], src.nbytes / GB, 'GB/s')}")
    print(f"decode GEMV {K}x{N} fp32, uncached, TVM:   {summary(res['gemv'], wbytes, 'GB/s')}")
    print(f"decode GEMV {K}x{N} fp32, uncached, numpy: {summary(res['np_gemv'], wbytes, 'GB/s')}")
    for stat in (np.median, np.min):  # the best calls are the ones no other process interrupted
        gemv_s, np_s, copy_s = stat(res["gemv"]), stat(res["np_gemv"]), stat(res["copy"])
        print(
            f"  ({'median' if stat is np.median else 'best'}) GEMV / copy bandwidth = "
            f"{wbytes / gemv_s / (src.nbytes / GB / copy_s):.0%}, GEMV / numpy = {np_s / gemv_s:.0%}"
        )
    print(f"prefill GEMM m={GM} K={GK} N={GN}, TVM:   {summary(res['gemm'], flops, 'GFLOP/s')}")
    print(f"prefill GEMM m={GM} K={GK} N={GN}, numpy: {summary(res['np_gemm'], flops, 'GFLOP/s')}")
    print(
        f"decode attention H={H} KVH={KVH} hd={HD} ctx={CTX}: "
        f"{np.median(res['attn']) * 1e6:.0f} us median ({kvbytes / np.median(res['attn']):.1f} GB/s of KV read)"
    )


if __name__ == "__main__":
    main()
