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
runtime.artifact.aligned_empty(huge=True)). A variant may name the sparse kernel: `model-huge-ffng1`, a row at
a time with prefetches (the fp32 kernel before 2026-12-02; the default, `ffn`, reads ROW_GROUP rows in
lockstep), `ffng4` 4 rows in lockstep (sparse_ffn's row_group), `ffn2` a row at a time prefetching 2 rows
ahead (sparse_ffn's prefetch_rows), `ffn2t3` with prefetch locality 3 (prefetcht0, the kernel's default
before 2026-12-01; the default is 2); or a weight format, `model-huge-int4`: the kernel over that format's copy
of the same layers (fp32, fp16: sparse_ffn; int8, int4: sparse_ffn_q, blocks of 32 with fp16 scales, rows
layout, q and scales in one allocation), whose bytes read are its own (an int4 row of 2048 is 1,152 bytes: 1,024
of nibbles, 128 of scales; the neurons that fire are counted with its own dequantized rows), `int4p8` / `int4p2t3`
with 8 rows prefetched ahead / 2 at locality 3. `--dense-ffn` also times the dense FFN (up + down panel GEMVs of
each layer) in the model loop. It prints GB/s of rows read by the sparse kernel (every selected up row, the
down rows of neurons that fired), the dense GEMVs' GB/s, and the ratios: of the medians over rounds, and of the
90th percentiles over calls, and the time per call (median over every call). On a shared machine a parallel
call that outlasts a scheduler time slice is stretched by whole ticks (4 ms) while another process holds a core,
so long calls (a dense FFN: ~10 ms) are hit far more often than short ones (a sparse one at 10%: ~1 ms) and the
medians compare load, not kernels; the 90th percentile of calls is the uncontended figure there (`--threads 1`
sidesteps the waits for a second core). numpy's BLAS pool is held to one thread (its spinning workers would take
a core from TVM's).

    python benchmarks/bench_sparse_in_model.py [--layers 8] [--active 0.1,0.2] [--rounds 5] [--isa avx512]
    python benchmarks/bench_sparse_in_model.py --layers 6 --threads 1 \
        --variants model-huge-fp32,model-huge-fp16,model-huge-int8,model-huge-int4
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's pool must not spin beside TVM's
import numpy as np  # noqa: E402

D, FFN = 2048, 8192
INDEX_SETS = 8
FORMATS = ("fp32", "fp16", "int8", "int4")  # a variant's kernel field naming one: the layers in that weight format


DOTS = {"m": "madd", "v": "vnni"}  # a format field's suffix: sparse_ffn_q's int8_dot


def format_field(variant: str):
    """(format, rows prefetched ahead, prefetch locality, int8_dot; None: the kernel's defaults) of a variant
    whose kernel field names a format (`int4`, `int4p8`, `int4p2t3`, `int4m`: int8_dot "madd", `int4v`: "vnni"),
    else None."""
    fields = variant.split("-")
    found = (re.fullmatch(r"(%s)(?:p(\d+))?(?:t(\d))?([mv])?" % "|".join(FORMATS), fields[2])
             if len(fields) > 2 else None)
    return (found[1], *(int(g) if g else None for g in found.groups()[1:3]), DOTS.get(found[4])) if found else None


def fmt_of(variant: str) -> str:
    """The weight format a variant's kernel reads: the one its kernel field names, else fp32."""
    field = format_field(variant)
    return field[0] if field else "fp32"


def kernel_of(variant: str) -> str:
    """The kernel a variant times: ffn_<format>[p<rows>] for a format, its prefetch variant (ffn2t3, ...), else ffn."""
    fields = variant.split("-")
    return ("ffn_" + fields[2]) if format_field(variant) else (fields[2] if len(fields) > 2 else "ffn")


def format_kernel(neuron, name, fmt, ahead, locality, dot, tile_panels):
    """The relu sparse FFN kernel over 2048 x 8192 rows in weight format `fmt` (None: the default prefetching)."""
    options = dict(rows=1, gated=False, act="relu", prefetch_rows=ahead, prefetch_locality=locality)
    if fmt in ("fp32", "fp16"):
        return neuron.sparse_ffn(name, D, FFN, wdtype="float32" if fmt == "fp32" else "float16", **options)
    return neuron.sparse_ffn_q(name, D, FFN, bits=int(fmt[3:]), int8_dot=dot, tile_panels=tile_panels, **options)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--active", default="0.1,0.2", help="selected shares of the rows")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="avx512")
    parser.add_argument("--mcpu", help="the LLVM CPU to build for instead of the ISA's (int4v needs VNNI: znver4)")
    parser.add_argument("--variants", default="alone-4k,model-4k,alone-huge,model-huge")
    parser.add_argument("--dense-ffn", action="store_true", help="also time a dense FFN (panel GEMVs) in the model loop")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels import cpu, neuron, quant
    from passes.targets import CPU_ISAS
    from runtime.artifact import aligned_empty, huge_pages_in
    from runtime.dtypes import WEIGHT_FORMATS

    funcs = [neuron.sparse_ffn("ffn", D, FFN, rows=1, gated=False, act="relu"),
             *(neuron.sparse_ffn(f"ffng{g}", D, FFN, rows=1, gated=False, act="relu", row_group=g) for g in (1, 2, 4, 16)),
             *(neuron.sparse_ffn(f"ffn{a}", D, FFN, rows=1, gated=False, act="relu", prefetch_rows=a, row_group=1)
               for a in (1, 2, 4)),
             *(neuron.sparse_ffn(f"ffn{a}t{loc}", D, FFN, rows=1, gated=False, act="relu", prefetch_rows=a,
                                 prefetch_locality=loc, row_group=1) for a in (1, 2, 4) for loc in (1, 2, 3)),
             *(format_kernel(neuron, kernel, *format_field(v), CPU_ISAS[args.isa].gemm_panels)
               for kernel, v in {kernel_of(v): v for v in args.variants.split(",") if format_field(v)}.items()),
             cpu.linear_panels("qkv", D, 3 * D, rows=1, bias=False),
             cpu.linear_panels("o", D, D, rows=1, bias=False),
             cpu.linear_panels("up_dense", D, FFN, rows=1, bias=False, act="relu"),
             cpu.linear_panels("down_dense", FFN, D, rows=1, bias=False)]
    variants = args.variants.split(",")
    kernels = {kernel_of(v) for v in variants} | {"qkv", "o", "up_dense", "down_dense"}
    funcs = [f for f in funcs if str(f.attrs["global_symbol"]) in kernels]  # (each kernel compiles for seconds)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.so")
        target = CPU_ISAS[args.isa].llvm_target()
        cpu.build(funcs, dict(target, mcpu=args.mcpu) if args.mcpu else target, path)
        lib = tvm.runtime.load_module(path)
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    kinds = sorted({v.split("-")[1] for v in variants})  # where-pages[-kernel]: kernel ffn{a}, a rows prefetched ahead
    formats = {kind: {fmt_of(v) for v in variants if v.split("-")[1] == kind} for kind in kinds}

    def fill(shape, huge, scale=0.02):
        out = aligned_empty(shape, np.float32, huge=huge)
        out[...] = rng.standard_normal(shape, dtype=np.float32) * scale
        return out

    def stored(w, fmt, huge):
        """w in `fmt`, as the kernel's weight arguments: [w] in a float format, [q, scales] (rows layout) in a
        quantized one, both in one allocation (q, then the scales at a 64-byte boundary): so that the scales,
        1 MiB a matrix, share q's huge pages (alone they are too small for aligned_empty's)."""
        wf = WEIGHT_FORMATS[fmt]
        if not wf.quantized:
            copy = aligned_empty(w.shape, wf.storage, huge=huge)
            copy[...] = w
            return [copy]
        arrays = quant.pack_rows(*quant.quantize(w, wf, axis=1), wf)
        starts = [0, -(-arrays[0].nbytes // 64) * 64]
        whole = aligned_empty((starts[1] + arrays[1].nbytes,), np.uint8, huge=huge)
        views = []
        for start, array in zip(starts, arrays):
            views.append(whole[start:start + array.nbytes].view(array.dtype).reshape(array.shape))
            views[-1][...] = array
        return views

    layers = {}
    for kind in kinds:
        huge = kind == "huge"
        layers[kind] = []
        for _ in range(args.layers):
            up, down = (rng.standard_normal((FFN, D), dtype=np.float32) * 0.02 for _ in range(2))
            layer = dict(qkv=fill((3 * D // 16, D, 16), huge), o=fill((D // 16, D, 16), huge))
            for fmt in formats[kind]:
                layer[fmt] = (stored(up, fmt, huge), stored(down, fmt, huge))
            layers[kind].append(layer)
        if args.dense_ffn:
            for layer in layers[kind]:
                layer["up_p"] = fill((FFN // 16, D, 16), huge)
                layer["down_p"] = fill((D // 16, FFN, 16), huge)
        first = layers[kind][0][sorted(formats[kind])[0]][0][0]
        print(f"{kind}: {args.layers} layers, {huge_pages_in(first)} MiB of the first up rows' "
              f"{first.nbytes >> 20} MiB on huge pages")

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

    fired_rows = {}  # (kind, format, layer, share, index set) -> rows the fused kernel reads; computed before timing

    def rows_read(kind, fmt, li, share, si):
        key = (kind, fmt, li, share, si)
        if key not in fired_rows:
            sets, count = index_sets[share]
            sel = sets[si][0, :int(count[0, 0])]
            up_args = layers[kind][li][fmt][0]
            if len(up_args) == 1:
                up = up_args[0][sel].astype(np.float32)
            else:  # the format's own rows: rounding moves some neurons across 0
                q, scales = up_args
                up = quant.dequantize(quant.unpack_rows(q[sel], WEIGHT_FORMATS[fmt]), scales[sel], axis=1)
            fired_rows[key] = len(sel) + int(np.count_nonzero(up @ x[0] > 0))
        return fired_rows[key]

    clock = time.perf_counter
    results = {}  # (variant, share) -> list of GB/s samples; ("gemv", variant) -> GB/s
    best = {}  # (variant, share) -> every call's GB/s
    call_s = {}  # (variant, share) -> every call's seconds

    def one(variant, share, calls):
        where, kind = variant.split("-")[:2]
        fmt, kernel = fmt_of(variant), kernel_of(variant)
        row_bytes = int(D * WEIGHT_FORMATS[fmt].bytes_per_weight)
        sets, count = index_sets[share]
        n = int(count[0, 0])
        pool = layers[kind] if where in ("model", "cycle") else layers[kind][:1]
        gemvs = where in ("model", "alonegemv")
        ffn_s, ffn_bytes, gemv_s, gemv_b, dense_s = [], [], [], [], []
        for r in range(calls):
            li, si = r % len(pool), r % INDEX_SETS
            layer, idx = pool[li], sets[si]
            rows = rows_read(kind, fmt, li, share, si)
            if gemvs:
                began = clock()
                lib["qkv"](dl(x), dl(layer["qkv"]), dl(qkv_y))
                lib["o"](dl(x), dl(layer["o"]), dl(o_y))
                gemv_s.append(clock() - began)
                gemv_b.append(layer["qkv"].nbytes + layer["o"].nbytes)
            up_args, down_args = layer[fmt]
            began = clock()
            lib[kernel](dl(x), dl(idx), dl(count), *map(dl, up_args), dl(zeros), *map(dl, down_args),
                        dl(h), dl(fired), dl(scratch), dl(out))
            ffn_s.append(clock() - began)
            ffn_bytes.append(rows * row_bytes)
            if where == "model" and args.dense_ffn:
                began = clock()
                lib["up_dense"](dl(x), dl(layer["up_p"]), dl(hid_d))
                lib["down_dense"](dl(hid_d), dl(layer["down_p"]), dl(o_y))
                dense_s.append(clock() - began)
        rates = [b / s / 1e9 for b, s in zip(ffn_bytes, ffn_s)]
        if os.environ.get("TRACE"):
            print(variant, share, "ffn ms", " ".join(f"{1e3 * s:.2f}" for s in ffn_s))
        results.setdefault((variant, share), []).append(float(np.median(rates)))
        call_s.setdefault((variant, share), []).extend(ffn_s)
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
                    for fmt in formats[kind]:
                        rows_read(kind, fmt, li, share, si)
    for variant in variants:  # warm-up (and a correctness check)
        one(variant, shares[0], args.layers)
    for _ in range(args.rounds):
        for share in shares:
            for variant in variants:
                one(variant, share, calls)
    print(f"{args.threads} threads, {args.isa}, {args.layers} layers, {args.rounds} rounds x {calls} calls, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<18} {'share':>11} {'GB/s median':>12} {'p90 call':>9} {'ms/call':>8}  round medians")
    for (variant, share), samples in results.items():
        p90 = f"{np.percentile(best[(variant, share)], 90):9.1f}" if (variant, share) in best else " " * 9
        ms = f"{1e3 * np.median(call_s[(variant, share)]):8.3f}" if (variant, share) in call_s else " " * 8
        print(f"{variant!s:<18} {share!s:>11} {np.median(samples):12.1f} {p90} {ms}  "
              f"{' '.join(f'{s:.1f}' for s in samples)}")
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
            ms = np.median(call_s[(variant, share)]) / np.median(call_s[(variants[0], share)])
            print(f"ratio {variant} / {variants[0]} at {share}: GB/s {np.median(samples) / base[share]:.2f}, "
                  f"time per call {ms:.2f}")


if __name__ == "__main__":
    main()
