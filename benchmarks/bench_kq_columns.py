"""The column-sparse GEMV over a file's own blocks (kquant_columns.sparse_columns_kq, after its select) against the
dense decode GEMV of the same blocks and against the int8 rows the same matrix was re-rounded to before
(neuron.sparse_columns_q): what a threshold over a K-quant or 5-bit matrix costs, at the real 0.5B file's shapes.
Also the prompt GEMM over the columns layout (linear_columns_kq) against the panels' GEMM, at --prompt rows.

Per shape and format, --layers distinct copies of each kernel's weights are called in turn (a decode step reads
each layer's matrix once, from memory), rounds alternating the kernels (medians over rounds of the mean call).
Random blocks (every code and scale drawn at random); the kept inputs are the largest |x| of a random x.

    python benchmarks/bench_kq_columns.py [--shapes down,in] [--formats q4_k,q6_k,q5_0] [--threads 2]
        [--rounds 7] [--layers 24] [--prompt 128] [--chunk-groups G]

--chunk-groups G also times the column kernel with G output groups a pass over the kept rows (kquant_columns'
chunk_groups; a G of N / 32 or more: whole rows, as before chunks), alternated with the default's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numpy as np  # noqa: E402

# name: (K, N, gated), as Qwen2.5-0.5B's decode calls them (gate | up fused: N = 2F)
SHAPES = {"down": (4864, 896, False), "in": (896, 9728, True)}
KEPT = (0.1, 0.2, 0.3, 0.5, 0.8)
SETTLE = 0.1  # seconds between kernels: TVM's pool spins a while after a parallel call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="down,in")
    parser.add_argument("--formats", default="q4_k,q6_k,q5_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=24, help="distinct weight copies per kernel")
    parser.add_argument("--prompt", type=int, default=128, help="rows of the prompt GEMMs (0: none)")
    parser.add_argument("--chunk-groups", type=int, default=None, help="also the column kernel at this chunk width")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels import cpu, kquant, kquant_columns, kquant_ops, neuron, quant
    from passes.targets import host_cpu_isa
    from runtime.artifact import aligned_copy
    from runtime.dtypes import WEIGHT_FORMATS
    from test_kquant_ops import random_blocks

    isa = host_cpu_isa()
    dot = {"int8_dot": isa.int8_dot} if isa.int8_dot else {}
    cases = [(s, f) for s in args.shapes.split(",") for f in args.formats.split(",")
             if SHAPES[s][0] % (WEIGHT_FORMATS[f].super_block or 32) == 0]
    funcs = []
    for shape, fmt in cases:
        K, N, gated = SHAPES[shape]
        act = {"gated": True, "act": "silu"} if gated else {}
        tag = f"{shape}_{fmt}"
        funcs.append(kquant_ops.linear_panels_kq(f"dense_{tag}", K, N, rows=1, fmt=fmt, bias=False,
                                                 tile_panels=isa.gemm_panels, **dot))
        funcs.append(kquant_columns.sparse_columns_kq(f"columns_{tag}", K, N, rows=1, fmt=fmt, **act))
        if args.chunk_groups:
            funcs.append(kquant_columns.sparse_columns_kq(f"chunks_{tag}", K, N, rows=1, fmt=fmt,
                                                          chunk_groups=args.chunk_groups, **act))
        if args.prompt:
            funcs.append(kquant_ops.linear_panels_kq(f"gemm_{tag}", K, N, rows=None, fmt=fmt, bias=False,
                                                     tile_panels=isa.gemm_panels, **dot))
            funcs.append(kquant_columns.linear_columns_kq(f"colgemm_{tag}", K, N, rows=None, fmt=fmt))
    for shape in dict.fromkeys(s for s, _ in cases):
        K, N, gated = SHAPES[shape]
        act = {"gated": True, "act": "silu"} if gated else {}
        funcs.append(neuron.select(f"select_{shape}", K, rows=1, magnitude=True))
        funcs.append(neuron.sparse_columns_q(f"int8rows_{shape}", K, N, rows=1, bits=8, **act))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench_kq_columns.so")
        cpu.build(funcs, isa.llvm_target(), path)
        lib = tvm.runtime.load_module(path)
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    print(f"{isa.name} (int8 dot: {isa.int8_dot}), {args.threads} threads, {args.layers} copies, load average "
          f"{os.getloadavg()[0]:.2f}")

    calls, sizes = {}, {}  # (case, kernel, kept) -> a function of the copy's index; bytes a copy
    for shape, fmt in cases:
        K, N, gated = SHAPES[shape]
        tag = f"{shape}_{fmt}"
        blocks = random_blocks(rng, fmt, (K, N), 0)
        w = blocks.dequantize()
        x = aligned_copy(rng.standard_normal((1, K)).astype(np.float32))
        out = N // 2 if gated else N
        y = aligned_copy(np.zeros((1, out), np.float32))
        t = aligned_copy(np.zeros((1, N), np.float32))
        idx, count = aligned_copy(np.zeros((1, K), np.int32)), aligned_copy(np.zeros((1, 1), np.int32))
        panels = [tuple(dl(aligned_copy(a)) for a in kquant.pack_panels(blocks)) for _ in range(args.layers)]
        columns = [tuple(dl(aligned_copy(a)) for a in kquant.pack_columns(blocks)) for _ in range(args.layers)]
        q8, s8 = quant.quantize(w, WEIGHT_FORMATS["int8"], 1)
        int8 = [tuple(dl(aligned_copy(a)) for a in quant.pack_rows(q8, s8, WEIGHT_FORMATS["int8"])) for _ in range(args.layers)]
        sizes[tag] = {"dense": sum(a.nbytes for a in kquant.pack_panels(blocks)),
                      "columns": sum(a.nbytes for a in kquant.pack_columns(blocks)), "int8 rows": q8.nbytes + s8.nbytes}
        scratch = dl(aligned_copy(np.zeros((neuron.COLUMN_TASKS, kquant_columns.scratch_columns(N)), np.float32)))
        rows_scratch = dl(aligned_copy(np.zeros((neuron.COLUMN_TASKS, N), np.float32)))
        index, counted, xd, yd = dl(idx), dl(count), dl(x), dl(y)
        dense = lib[f"dense_{tag}"]  # (gated: gate | up's outputs; the GLU after it is a small call of its own)
        calls[tag, "dense", None] = lambda i, f=dense, p=panels, a=dl(x), b=dl(t): f(a, *p[i], b)
        for kept in KEPT:
            threshold = dl(aligned_copy(np.array([np.quantile(np.abs(x), 1.0 - kept)], np.float32)))
            select = (lambda s=lib[f"select_{shape}"], th=threshold, a=xd, i=index, n=counted:  # noqa: E731
                      s(a, th, i, n))
            bound = (xd, index, counted)
            calls[tag, "columns", kept] = (lambda i, s=select, f=lib[f"columns_{tag}"], c=columns, b=bound, o=(scratch, yd):
                                           (s(), f(*b, *c[i], *o)))
            if args.chunk_groups:
                calls[tag, "chunks", kept] = (lambda i, s=select, f=lib[f"chunks_{tag}"], c=columns, b=bound,
                                              o=(scratch, yd): (s(), f(*b, *c[i], *o)))
            calls[tag, "int8 rows", kept] = (lambda i, s=select, f=lib[f"int8rows_{shape}"], c=int8, b=bound,
                                             o=(rows_scratch, yd): (s(), f(*b, *c[i], *o)))
        # the columns kernel checked against numpy, at the last share
        calls[tag, "columns", KEPT[-1]](0)
        keep = np.abs(x[0]) > np.quantile(np.abs(x), 1.0 - KEPT[-1])
        want = x[0, keep].astype(np.float64) @ w[keep].astype(np.float64)
        if gated:
            want = want[:out] / (1 + np.exp(-want[:out])) * want[out:]
        np.testing.assert_allclose(y[0], want, rtol=0, atol=1e-5 * np.abs(want).max())
        if args.prompt:
            xs = aligned_copy(rng.standard_normal((args.prompt, K)).astype(np.float32))
            ys = aligned_copy(np.zeros((args.prompt, N), np.float32))
            calls[tag, "gemm panels", None] = lambda i, f=lib[f"gemm_{tag}"], p=panels, a=dl(xs), b=dl(ys): f(a, *p[i], b)
            calls[tag, "gemm columns", None] = (lambda i, f=lib[f"colgemm_{tag}"], c=columns, a=dl(xs), b=dl(ys):
                                                f(a, *c[i], b))

    samples = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            copies = args.layers if "gemm" not in key[1] else min(2, args.layers)
            started = time.perf_counter()
            for i in range(copies):
                call(i)
            samples[key].append((time.perf_counter() - started) / copies)
            time.sleep(SETTLE)

    other = f"columns at {args.chunk_groups} groups / " if args.chunk_groups else ""
    prompt_cell = f" | prompt {args.prompt}: columns / panels ms" if args.prompt else ""
    print("| shape | format | bytes (dense / columns / int8 rows) | dense us | " + " | ".join(
        f"kept {k}: columns / {other}int8 rows (x dense)" for k in KEPT) + prompt_cell + " |")
    print("|---|---|---|---:|" + "---:|" * len(KEPT) + ("---:|" if args.prompt else ""))
    for shape, fmt in cases:
        tag = f"{shape}_{fmt}"
        med = lambda kind, kept: float(np.median(samples[tag, kind, kept]))  # noqa: E731
        dense = med("dense", None)
        size = sizes[tag]
        cells = [f"{med('columns', k) / dense:.2f} / "
                 + (f"{med('chunks', k) / dense:.2f} / " if args.chunk_groups else "")
                 + f"{med('int8 rows', k) / dense:.2f}" for k in KEPT]
        prompt = ([f"{med('gemm columns', None) * 1e3:.1f} / {med('gemm panels', None) * 1e3:.1f}"]
                  if args.prompt else [])
        print(f"| {shape} {SHAPES[shape][0]}x{SHAPES[shape][1]} | {fmt} | {size['dense'] / 2**20:.2f} / "
              f"{size['columns'] / 2**20:.2f} / {size['int8 rows'] / 2**20:.2f} MiB | {dense * 1e6:.0f} | "
              + " | ".join(cells + prompt) + " |")


if __name__ == "__main__":
    main()
