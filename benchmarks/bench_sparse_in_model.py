"""The fused sparse FFN kernel alone against the same kernel inside a whole-model-like decode loop.

Issue 13 item 3: in `run --profile` of a 0.9B OPT the fused sparse FFN reached ~14 GB/s of rows read while
bench_kernels.py measured the same kernel alone at ~30 GB/s. This benchmark separates the candidate causes
by running, alternated inside one process (A, B, A, B, ...; medians):

  alone   one layer's weights, the kernel called repeatedly (index sets rotating), as bench_kernels does;
  model   `--layers` distinct layers' weights (up rows + down rows: 2 x ffn x d fp32 each), each layer's
          sparse FFN call preceded by dense panel GEMVs standing in for its attention projections (qkv
          d x 3d and o d x d), so nothing a call reads was read recently (as in a decode step);

each with the weights in ordinary anonymous memory (`numpy`/malloc: 4 KiB pages while THP is `madvise`,
the runtime's allocation) and in huge-page-advised memory (mmap + madvise(MADV_HUGEPAGE), 2 MiB aligned:
runtime.artifact.aligned_empty(huge=True)). A variant may name the sparse kernel, `model-huge-ffn2`: prefetching
2 rows ahead (sparse_ffn's prefetch_rows), `ffn2t3` with prefetch locality 3 (prefetcht0,
the kernel's default before 2026-12-01; the default is 2). `--dense-ffn` also times the dense FFN (up + down panel GEMVs of
each layer) in the model loop. It prints GB/s of rows read by the sparse kernel (every selected up row, the
down rows of neurons that fired), the dense GEMVs' GB/s, and the ratios: of the medians over rounds, and of the
90th percentiles over calls. On a shared machine a parallel call that outlasts a scheduler time slice is
stretched by whole ticks (4 ms) while another process holds a core, so long calls (a dense FFN: ~10 ms) are hit
far more often than short ones (a sparse one at 10%: ~1 ms) and the medians compare load, not kernels; the 90th
percentile of calls is the uncontended figure there. numpy's BLAS pool is held to one thread (its spinning
workers would take a core from TVM's).

    python benchmarks/bench_sparse_in_model.py [--layers 8] [--active 0.1,0.2] [--rounds 5] [--isa avx512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's pool must not spin beside TVM's
import numpy as np  # noqa: E402

D, FFN = 2048, 8192
INDEX_SETS = 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--active", default="0.1,0.2", help="selected shares of the rows")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="avx512")
    parser.add_argument("--variants", default="alone-4k,model-4k,alone-huge,model-huge")
    parser.add_argument("--dense-ffn", action="store_true", help="also time a dense FFN (panel GEMVs) in the model loop")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels import cpu, neuron
    from picompile.targets import CPU_ISAS
    from runtime.artifact import aligned_empty, huge_pages_in

    funcs = [neuron.sparse_ffn("ffn", D, FFN, rows=1, gated=False, act="relu"),
             *(neuron.sparse_ffn(f"ffn{a}", D, FFN, rows=1, gated=False, act="relu", prefetch_rows=a) for a in (1, 2, 4)),
             *(neuron.sparse_ffn(f"ffn{a}t{loc}", D, FFN, rows=1, gated=False, act="relu", prefetch_rows=a,
                                 prefetch_locality=loc) for a in (1, 2, 4) for loc in (1, 2, 3)),
             cpu.linear_panels("qkv", D, 3 * D, rows=1, bias=False),
             cpu.linear_panels("o", D, D, rows=1, bias=False),
             cpu.linear_panels("up_dense", D, FFN, rows=1, bias=False, act="relu"),
             cpu.linear_panels("down_dense", FFN, D, rows=1, bias=False)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.so")
        cpu.build(funcs, CPU_ISAS[args.isa].llvm_target(), path)
        lib = tvm.runtime.load_module(path)
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    variants = args.variants.split(",")
    kinds = sorted({v.split("-")[1] for v in variants})  # where-pages[-kernel]: kernel ffn{a}, a rows prefetched ahead

    def fill(shape, huge, scale=0.02):
        out = aligned_empty(shape, np.float32, huge=huge)
        out[...] = rng.standard_normal(shape, dtype=np.float32) * scale
        return out

    layers = {}
    for kind in kinds:
        huge = kind == "huge"
        layers[kind] = [dict(up=fill((FFN, D), huge), down=fill((FFN, D), huge),
                             qkv=fill((3 * D // 16, D, 16), huge), o=fill((D // 16, D, 16), huge))
                        for _ in range(args.layers)]
        if args.dense_ffn:
            for layer in layers[kind]:
                layer["up_p"] = fill((FFN // 16, D, 16), huge)
                layer["down_p"] = fill((D // 16, FFN, 16), huge)
        mib = huge_pages_in(layers[kind][0]["up"])
        print(f"{kind}: {args.layers} layers, {mib} MiB of the first up rows' 64 MiB on huge pages")

    x = aligned_empty((1, D)); x[...] = rng.standard_normal((1, D))
    h = aligned_empty((1, FFN)); fired = aligned_empty((1, FFN), np.int32)
    scratch = aligned_empty((neuron.FFN_TASKS, D)); out = aligned_empty((1, D))
    qkv_y, o_y = aligned_empty((1, 3 * D)), aligned_empty((1, D))
    hid_d = aligned_empty((1, FFN))
    shares = [float(s) for s in args.active.split(",")]
    index_sets = {}
    for share in shares:
        n = int(share * FFN)
        sets = []
        for _ in range(INDEX_SETS):
            idx = aligned_empty((1, FFN), np.int32); idx[...] = 0
            idx[0, :n] = np.sort(rng.choice(FFN, n, replace=False))
            sets.append(idx)
        count = aligned_empty((1, 1), np.int32); count[...] = n
        index_sets[share] = (sets, count)

    fired_rows = {}  # (kind, layer, share, index set) -> rows the fused kernel reads; computed before timing

    def rows_read(kind, li, share, si):
        key = (kind, li, share, si)
        if key not in fired_rows:
            sets, count = index_sets[share]
            sel = sets[si][0, :int(count[0, 0])]
            fired_rows[key] = len(sel) + int(np.count_nonzero(layers[kind][li]["up"][sel] @ x[0] > 0))
        return fired_rows[key]

    clock = time.perf_counter
    results = {}  # (variant, share) -> list of GB/s samples; ("gemv", variant) -> GB/s
    best = {}  # (variant, share) -> every call's GB/s

    def one(variant, share, calls):
        where, kind, *kernel = variant.split("-")
        kernel = kernel[0] if kernel else "ffn"
        sets, count = index_sets[share]
        n = int(count[0, 0])
        pool = layers[kind] if where in ("model", "cycle") else layers[kind][:1]
        gemvs = where in ("model", "alonegemv")
        ffn_s, ffn_bytes, gemv_s, gemv_b, dense_s = [], [], [], [], []
        for r in range(calls):
            li, si = r % len(pool), r % INDEX_SETS
            layer, idx = pool[li], sets[si]
            rows = rows_read(kind, li, share, si)
            if gemvs:
                began = clock()
                lib["qkv"](dl(x), dl(layer["qkv"]), dl(qkv_y))
                lib["o"](dl(x), dl(layer["o"]), dl(o_y))
                gemv_s.append(clock() - began)
                gemv_b.append(layer["qkv"].nbytes + layer["o"].nbytes)
            began = clock()
            lib[kernel](dl(x), dl(idx), dl(count), dl(layer["up"]), dl(zeros),
                       dl(layer["down"]), dl(h), dl(fired), dl(scratch), dl(out))
            ffn_s.append(clock() - began)
            ffn_bytes.append(rows * D * 4)
            if where == "model" and args.dense_ffn:
                began = clock()
                lib["up_dense"](dl(x), dl(layer["up_p"]), dl(hid_d))
                lib["down_dense"](dl(hid_d), dl(layer["down_p"]), dl(o_y))
                dense_s.append(clock() - began)
        rates = [b / s / 1e9 for b, s in zip(ffn_bytes, ffn_s)]
        if os.environ.get("TRACE"):
            print(variant, share, "ffn ms", " ".join(f"{1e3 * s:.2f}" for s in ffn_s))
        results.setdefault((variant, share), []).append(float(np.median(rates)))
        best.setdefault((variant, share), []).extend(rates)
        if gemvs:
            results.setdefault(("gemv", variant), []).append(sum(gemv_b) / sum(gemv_s) / 1e9)
            best.setdefault(("gemv", variant), []).extend(b / t / 1e9 for b, t in zip(gemv_b, gemv_s))
            if dense_s:
                dense_bytes = layer["up_p"].nbytes + layer["down_p"].nbytes
                results.setdefault(("dense ffn", variant), []).append(dense_bytes / float(np.median(dense_s)) / 1e9)
                best.setdefault(("dense ffn", variant), []).extend(dense_bytes / t / 1e9 for t in dense_s)

    zeros = aligned_empty((FFN,)); zeros[...] = 0
    calls = max(2 * args.layers, 16)
    for kind in kinds:
        for li in range(args.layers):
            for share in shares:
                for si in range(INDEX_SETS):
                    rows_read(kind, li, share, si)
    for variant in variants:  # warm-up (and a correctness check)
        one(variant, shares[0], args.layers)
    for _ in range(args.rounds):
        for share in shares:
            for variant in variants:
                one(variant, share, calls)
    print(f"{args.threads} threads, {args.isa}, {args.layers} layers, {args.rounds} rounds x {calls} calls, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<14} {'share':>11} {'GB/s median':>12} {'p90 call':>9}  round medians")
    for (variant, share), samples in results.items():
        p90 = f"{np.percentile(best[(variant, share)], 90):9.1f}" if (variant, share) in best else " " * 9
        print(f"{variant!s:<14} {share!s:>11} {np.median(samples):12.1f} {p90}  {' '.join(f'{s:.1f}' for s in samples)}")
    for variant in variants:
        if ("dense ffn", variant) in results:
            dense = np.median(results[("dense ffn", variant)])
            dense90 = np.percentile(best[("dense ffn", variant)], 90)
            for share in shares:
                print(f"sparse / dense FFN bandwidth, {variant} at {share}: medians "
                      f"{np.median(results[(variant, share)]) / dense:.2f} (dense {dense:.1f} GB/s), p90 calls "
                      f"{np.percentile(best[(variant, share)], 90) / dense90:.2f} (dense {dense90:.1f} GB/s)")
    base = {share: np.median(results[(variants[0], share)]) for share in shares}
    for (variant, share), samples in results.items():
        if variant in variants:
            print(f"ratio {variant} / {variants[0]} at {share}: {np.median(samples) / base[share]:.2f}")


if __name__ == "__main__":
    main()
