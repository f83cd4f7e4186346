"""The threshold-mode column-sparse GEMV (neuron.sparse_columns, after its `select`) against the dense panel GEMV
of the same matrix, on a model's decode shapes, in a model-like sweep: what the cost model's price of a sparse
linear input (costmodel.column_seconds) is fitted to.

For each shape, `--layers` distinct weight copies (a decode step reads each layer's matrix once, from memory) are
called in turn, the dense GEMV over all of them, then select + the sparse kernel over all of them at each kept
share of the input channels, alternated round by round (medians over rounds of the mean call). Per shape it
prints the dense call, the sparse call at each share, and the least-squares line through the sparse calls,
t(kept) = fixed + kept x slope: `fixed` is what a sparse call costs beyond the rows it reads (select's
compaction, the second parallel loop that sums the tasks' partial rows, zeroing them), `slope / dense` the time
a row costs against the dense GEMV's share of it, so `dense / slope` is the rows' efficiency (their GB/s over the
dense GEMV's).

    python benchmarks/bench_column_kernels.py [--shapes smollm2|1b] [--threads 2] [--rounds 7] [--layers 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402

# name: (K, N, gated, residual), as the lowering calls them (gate|up fused: N = 2F; o and down add the residual)
SHAPES = {
    "smollm2": {"qkv": (576, 960, False, False), "o": (576, 576, False, True), "in": (576, 3072, True, False),
                "down": (1536, 576, False, True)},
    "1b": {"qkv": (2048, 6144, False, False), "o": (2048, 2048, False, True), "in": (2048, 16384, True, False),
           "down": (8192, 2048, False, True)},
}
KEPT = (0.1, 0.3, 0.5, 0.7, 0.9)
SETTLE = 0.2  # seconds between phases: TVM's pool spins a while after a parallel call


def kernels(shapes: dict):
    from passes.kernels import cpu, neuron

    funcs = []
    for name, (K, N, gated, residual) in shapes.items():
        funcs.append(cpu.linear_panels(f"dense_{name}", K, N, rows=1, bias=False, residual=residual))
        funcs.append(neuron.select(f"select_{name}", K, rows=1, magnitude=True))
        funcs.append(neuron.sparse_columns(f"sparse_{name}", K, N, rows=1, gated=gated,
                                           act="silu" if gated else "none", residual=residual))
        if gated:
            funcs.append(cpu.glu(f"glu_{name}", N // 2, rows=1, act="silu"))
    return cpu, funcs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=list(SHAPES), default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30, help="distinct weight copies per shape")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels.neuron import COLUMN_TASKS
    from passes.targets import host_cpu_isa
    from runtime.artifact import aligned_copy

    shapes = SHAPES[args.shapes]
    cpu, funcs = kernels(shapes)
    isa = host_cpu_isa()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench_column_kernels.so")
        cpu.build(funcs, isa.llvm_target(), path)
        lib = tvm.runtime.load_module(path)
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    print(f"{isa.name}, {args.threads} threads, {args.layers} layers per shape, load average "
          f"{os.getloadavg()[0]:.2f}")

    calls = {}  # (shape, kept or None) -> a function of the layer index
    for name, (K, N, gated, residual) in shapes.items():
        weights = [(rng.standard_normal((K, N)) * 0.02).astype(np.float32) for _ in range(args.layers)]
        rows = [aligned_copy(w) for w in weights]
        panels = [aligned_copy(cpu.pack_panels(w)) for w in weights]
        x = aligned_copy(rng.standard_normal((1, K)).astype(np.float32))
        out = N // 2 if gated else N
        res = aligned_copy(np.zeros((1, out), np.float32))
        y, t = aligned_copy(np.zeros((1, out), np.float32)), aligned_copy(np.zeros((1, N), np.float32))
        idx, count = aligned_copy(np.zeros((1, K), np.int32)), aligned_copy(np.zeros((1, 1), np.int32))
        scratch = aligned_copy(np.zeros((COLUMN_TASKS, N), np.float32))
        extra = [dl(res)] if residual else []

        # the tensors bound once, as the runtime binds its calls' buffers
        if gated:
            bound = [([dl(x), dl(w), dl(t)], [dl(t), dl(y)]) for w in panels]
            dense = lambda i, f=lib[f"dense_{name}"], g=lib[f"glu_{name}"], b=bound: (  # noqa: E731
                f(*b[i][0]), g(*b[i][1]))
        else:
            bound = [[dl(x), dl(w), *extra, dl(y)] for w in panels]
            dense = lambda i, f=lib[f"dense_{name}"], b=bound: f(*b[i])  # noqa: E731

        calls[name, None] = dense
        for kept in KEPT:
            threshold = aligned_copy(np.array([np.quantile(np.abs(x), 1.0 - kept)], np.float32))

            selecting = [dl(x), dl(threshold), dl(idx), dl(count)]
            bound = [[dl(x), dl(idx), dl(count), dl(w), *extra, dl(scratch), dl(y)] for w in rows]
            sparse = lambda i, s=lib[f"select_{name}"], f=lib[f"sparse_{name}"], a=selecting, b=bound: (  # noqa: E731
                s(*a), f(*b[i]))
            calls[name, kept] = sparse
        sparse(0)  # the last share's kernel checked against numpy, once
        keep = np.abs(x[0]) > threshold[0]
        want = x[0, keep] @ weights[0][keep]
        if gated:
            want = want[: N // 2] / (1 + np.exp(-want[: N // 2])) * want[N // 2:]
        np.testing.assert_allclose(y[0], want, rtol=1e-3, atol=1e-4)
        del weights

    samples = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            started = time.perf_counter()
            for i in range(args.layers):
                call(i)
            samples[key].append((time.perf_counter() - started) / args.layers)
            time.sleep(SETTLE)

    print(f"{'shape':<6} {'K x N':>12} {'row B':>6} {'dense us':>9} " + " ".join(f"{f'kept {k}':>9}" for k in KEPT)
          + f" {'fixed us':>9} {'efficiency':>10}")
    for name, (K, N, gated, residual) in shapes.items():
        dense = float(np.median(samples[name, None]))
        sparse = np.array([np.median(samples[name, k]) for k in KEPT])
        slope, fixed = np.polyfit(np.array(KEPT), sparse, 1)
        print(f"{name:<6} {f'{K} x {N}':>12} {N * 4:>6} {dense * 1e6:>9.1f} "
              + " ".join(f"{s * 1e6:>9.1f}" for s in sparse) + f" {fixed * 1e6:>9.1f} {dense / slope:>10.2f}")


if __name__ == "__main__":
    main()
