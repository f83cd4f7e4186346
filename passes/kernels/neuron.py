"""Neuron-aware CPU kernels (PowerInfer's operators), generated with TVM 0.27.

One decode step of a sparse FFN part is three kernels over the part's rows (one row per neuron):
  select       the neurons whose predictor score passes the threshold -> index list + count;
  sparse_up    h[k] = act(W_up[idx[k]] . x) (gated: act(W_gate[idx[k]] . x) * W_up[idx[k]] . x),
               a GEMV over gathered rows, parallel over the active neurons;
  sparse_down  out = sum_k h[k] * W_down[idx[k]], an axpy over the same rows ("ffn_down_t"),
               parallel over column chunks so each thread streams contiguous row segments.
Prompts (prefill) compute a whole part densely with `linear_rows`, a GEMM over the same row-major
weights read in place; `merge` adds the parts, the down bias and the residual.

Conventions are those of `passes.kernels.cpu` (fp32, 64-byte aligned buffers, rows=1 for decode and a
symbolic `m` for prefill); index and count buffers are int32, shaped [1, n] and [1, 1]. A count is clamped to
its index buffer's length and every index to the rows of the weight it selects (`compute.clamp_count`,
`compute.clamp_index`), so no select output, however wrong, drives a kernel out of its buffers.

The sparse kernels are TVMScript, their loops the schedule, and per device: here a thread pool of a few
cores, each task walking its share of the neurons in vectors (with prefetches, and, fused, up and down in
one pass); the GPU's (cuda.py) give a warp or a block of threads to each neuron or column instead. Their
math (activations, the GLU product, select's test) is `compute`'s; `merge` is compute's definition with
the CPU's elementwise schedule.
"""

from __future__ import annotations

from tvm.script import tirx as T

from . import compute
from .compute import clamp_count, clamp_index, drop_params, glu_unit, load_f32
from .cpu import MATH, _col_block, _lanes, _rowwise, gemm_nt

DOWN_CHUNK = 256  # columns per parallel chunk of sparse_down: 1 KiB contiguous per row and thread


def select(name, n, *, rows, magnitude: bool = False):
    """idx[0, :count] = the positions i with scores[0, i] > threshold[0] (with `magnitude`:
    |scores[0, i]| > threshold[0]), ascending.

    Args: scores[1, n], threshold[1], idx[1, n] int32, count[1, 1] int32. A serial compaction:
    n compares per layer part, negligible next to the rows it saves.
    """
    if rows != 1:
        raise ValueError("select runs in decode only")

    @T.prim_func
    def kernel(scores: T.Buffer((1, n), "float32"), threshold: T.Buffer((1,), "float32"),
               idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32")):
        T.func_attr({"tirx.noalias": True})
        found = T.alloc_local((1,), "int32")
        found[0] = 0
        for i in range(n):
            if compute.passes_threshold(scores[0, i], threshold[0], magnitude):
                idx[0, found[0]] = T.Cast("int32", i)
                found[0] = found[0] + 1
        count[0, 0] = found[0]

    return kernel.with_attr("global_symbol", name)


def sparse_up(name, D, n, *, rows, gated: bool, act: str):
    """Gathered-row GEMV over the active neurons.

    Args: x[1, D], idx[1, n], count[1, 1], w[(2 if gated) n, D] (gate rows, then up rows),
    b[(2 if gated) n] (zeros for bias-free models), h[1, n]. Each active neuron's dot product runs
    as D/8 vector FMAs into one ymm accumulator (two when gated) and a horizontal sum; neurons
    are spread over the thread pool.
    """
    if rows != 1:
        raise ValueError("sparse_up runs in decode only")
    actf = compute.activation(act, MATH)
    lanes = _lanes(D)
    chunks = D // lanes
    width = 2 * n if gated else n

    @T.prim_func
    def kernel(x: T.Buffer((1, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((width, D), "float32"), b: T.Buffer((width,), "float32"), h: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        for k in T.parallel(clamp_count(count[0, 0], n)):
            acc = T.alloc_local((2, lanes), "float32")
            tot = T.alloc_local((2,), "float32")
            row = clamp_index(idx[0, k], n)
            for v in T.vectorized(lanes):
                acc[0, v] = T.float32(0)
                acc[1, v] = T.float32(0)
            for c in range(chunks):
                for v in T.vectorized(lanes):
                    acc[0, v] = acc[0, v] + w[row, c * lanes + v] * x[0, c * lanes + v]
                    if gated:
                        acc[1, v] = acc[1, v] + w[n + row, c * lanes + v] * x[0, c * lanes + v]
            tot[0] = acc[0, 0] + b[row]
            tot[1] = acc[1, 0]
            for v in T.unroll(1, lanes):
                tot[0] = tot[0] + acc[0, v]
                tot[1] = tot[1] + acc[1, v]
            if gated:
                h[0, k] = glu_unit(actf, tot[0], tot[1] + b[n + row])
            else:
                h[0, k] = actf(tot[0])

    return kernel.with_attr("global_symbol", name)


def sparse_down(name, n, D, *, rows):
    """out[0, :] = sum over k < count of h[0, k] * w[idx[0, k], :].

    Args: h[1, n], idx[1, n], count[1, 1], w[n, D], out[1, D]. Columns are cut into chunks of
    DOWN_CHUNK run in parallel; each thread walks every active row but reads only its chunk, a
    contiguous segment, accumulating into its slice of out (which stays in L1).
    """
    if rows != 1:
        raise ValueError("sparse_down runs in decode only")
    chunk = DOWN_CHUNK if D % DOWN_CHUNK == 0 else D
    lanes = _lanes(chunk)

    @T.prim_func
    def kernel(h: T.Buffer((1, n), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((n, D), "float32"), out: T.Buffer((1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for c in T.parallel(D // chunk):
            for j in T.vectorized(chunk):
                out[0, c * chunk + j] = T.float32(0)
            for k in range(clamp_count(count[0, 0], n)):
                row = clamp_index(idx[0, k], n)
                for j0 in range(chunk // lanes):
                    for v in T.vectorized(lanes):
                        out[0, c * chunk + j0 * lanes + v] = (
                            out[0, c * chunk + j0 * lanes + v] + h[0, k] * w[row, c * chunk + j0 * lanes + v]
                        )

    return kernel.with_attr("global_symbol", name)


FFN_TASKS = 8  # sparse_ffn: parallel tasks, each over an equal share of the active neurons
DOT_CHAINS = 4  # sparse_ffn: independent ymm accumulators per dot product (FMA latency x throughput)
PREFETCH_ROWS = 1  # sparse_ffn: while a neuron's row is read, the row of the neuron this many places later is prefetched
PREFETCH_LOCALITY = 2
"""sparse_ffn's prefetches go to L2 (prefetcht1), not L1 (prefetcht0): a row of 8 KiB is 128 lines in flight,
far more than L1's miss buffers hold, and L1-bound prefetches queue behind each other (and behind the demand
loads of the row being read). Measured 2026-12-01 on the Zen 5 (benchmarks/bench_sparse_in_model.py, 6 layers
of 2048x8192, each call after its layer's attention GEMVs, alternated variants): rows read at 1.9-2.0x the
bandwidth of locality 3 (one thread: 16.1 against 8.2 GB/s at 10% selected, 17.6 against 8.8 at 20%; two: 15.2
against 7.7 at 10%, medians), now faster per byte than the dense panel GEMVs of the same layers (1.1-1.2x);
prefetching 2 or 4 rows ahead instead of 1 changed nothing measurable, nor locality 1 against 2. sparse_columns
(threshold mode) too: 1.1-1.3x (gated up 2048x16384 at 30-50% of the inputs kept, between attention GEMVs over
5 layers, one and two threads)."""


def _prefetch(address, locality: int = 3):
    """Ask for a cache line before it is used (llvm.prefetch: a read; locality 3 keeps it in every cache level,
    prefetcht0; 2 from L2 outward, prefetcht1)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", address, T.uint32(0), T.uint32(locality), T.uint32(1))


def _row_lines(width: int, lanes: int, wdtype: str) -> tuple[int, int, int]:
    """How a kernel walks a weight row of `width` elements in cache lines (to prefetch one line per line it
    consumes): (elements per line, vectors per line, lines per row). Odd widths go per vector instead (more
    prefetch instructions, the same lines)."""
    line = min(64 // (2 if wdtype == "float16" else 4), width)
    if width % line or line % lanes:
        line = lanes
    return line, line // lanes, width // line


def sparse_ffn(name, D, n, *, rows, gated: bool, act: str, wdtype="float32", prefetch_rows: int | None = None,
               prefetch_locality: int | None = None):
    """A decode step of one sparse FFN part: up, activation and down in one kernel.

    For each selected neuron k (row r = idx[0, k]): h = act(w_up[r] . x + b[r]) (gated:
    act(gate . x + b_gate) * (up . x + b_up)), then, unless h is 0, out += h * w_down[r].
    Args: x[1, D], idx[1, n], count[1, 1], w_up[(2 if gated) n, D] (gate rows, then up rows),
    b_up[(2 if gated) n], w_down[n, D], h[1, n] (hidden values, for inspection), fired[1, n] int32
    (work list), scratch[FFN_TASKS, D], out[1, D].

    The selected list is cut into FFN_TASKS equal slices run in parallel. A task first computes the
    first row's dot product (the gate's when gated) for each of its neurons and lists the ones that
    fired (with ReLU: h != 0; other activations: all), then, for the listed ones only, reads the
    remaining rows (the up row when gated, the down row) and accumulates h * w_down[r] into its own
    scratch row (L1-resident, no atomics); the scratch rows are summed at the end. So a neuron the
    predictor let through but whose ReLU output is 0 costs one row, not two or three; and because
    each loop knows exactly which row comes next, it prefetches the next neuron's rows while the
    current one computes (gathered rows are otherwise demand misses until the hardware prefetcher
    catches on, row after row).
    """
    if rows != 1:
        raise ValueError("sparse_ffn runs in decode only")
    actf = compute.activation(act, MATH)
    relu = act == "relu"
    lanes = _lanes(D)
    chains = DOT_CHAINS if (D // lanes) % DOT_CHAINS == 0 else 1
    steps = D // lanes // chains
    line, line_vectors, lines = _row_lines(D, lanes, wdtype)
    per_step = max(1, chains * lanes // line)  # prefetches per dot-product step
    width = 2 * n if gated else n
    tasks = FFN_TASKS
    ahead = PREFETCH_ROWS if prefetch_rows is None else prefetch_rows
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality

    @T.macro
    def row_dot(acc, dot, x, w, row, slot, w_next, next_row):
        """dot[slot] = w[row] . x in `chains` vector accumulators and one horizontal sum, prefetching the
        row w_next[next_row] line by line as it goes (spread out, so the prefetches overlap the FMAs
        instead of queueing up in front of them)."""
        for c in T.unroll(chains):
            for v in T.vectorized(lanes):
                acc[c, v] = T.float32(0)
        for s in range(steps):
            for q in T.unroll(per_step):
                _prefetch(T.address_of(w_next[next_row, T.min(s * chains * lanes + q * line, D - 1)]), locality)
            for c in T.unroll(chains):
                for v in T.vectorized(lanes):
                    acc[c, v] = acc[c, v] + load_f32(w[row, (s * chains + c) * lanes + v], wdtype) * x[0, (s * chains + c) * lanes + v]
        for c in T.unroll(1, chains):
            for v in T.vectorized(lanes):
                acc[0, v] = acc[0, v] + acc[c, v]
        dot[slot] = acc[0, 0]
        for v in T.unroll(1, lanes):
            dot[slot] = dot[slot] + acc[0, v]

    @T.macro
    def row_axpy(y, t, a, w, row, w_next, next_row):
        """y[t, :] += a * w[row], prefetching w_next[next_row] a line per line consumed."""
        for s in range(lines):
            _prefetch(T.address_of(w_next[next_row, T.min(s * line, D - 1)]), locality)
            for u in T.unroll(line_vectors):
                for v in T.vectorized(lanes):
                    y[t, (s * line_vectors + u) * lanes + v] = (
                        y[t, (s * line_vectors + u) * lanes + v]
                        + a * load_f32(w[row, (s * line_vectors + u) * lanes + v], wdtype))

    @T.prim_func
    def kernel(x: T.Buffer((1, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w_up: T.Buffer((width, D), wdtype), b_up: T.Buffer((width,), "float32"),
               w_down: T.Buffer((n, D), wdtype), h: T.Buffer((1, n), "float32"), fired: T.Buffer((1, n), "int32"),
               scratch: T.Buffer((tasks, D), "float32"), out: T.Buffer((1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            first = clamp_count(count[0, 0], n) * t // tasks
            last = clamp_count(count[0, 0], n) * (t + 1) // tasks
            acc = T.alloc_local((chains, lanes), "float32")
            dot = T.alloc_local((2,), "float32")
            listed = T.alloc_local((1,), "int32")
            listed[0] = first
            # 1. the first row of every selected neuron; list the ones that fired
            for k in range(first, last):
                row = clamp_index(idx[0, k], n)
                row_dot(acc, dot, x, w_up, row, 0, w_up, clamp_index(idx[0, T.min(k + ahead, last - 1)], n))
                dot[0] = actf(dot[0] + b_up[row])
                h[0, k] = dot[0]
                if not relu or dot[0] != T.float32(0):
                    fired[0, listed[0]] = k
                    listed[0] = listed[0] + 1
            # 2. the other rows of the neurons that fired
            for j in T.vectorized(D):
                scratch[t, j] = T.float32(0)
            for i in range(first, listed[0]):
                k = fired[0, i]
                row = clamp_index(idx[0, k], n)
                after = clamp_index(idx[0, fired[0, T.min(i + ahead, listed[0] - 1)]], n)  # a later listed neuron's row
                dot[0] = h[0, k]
                if gated:
                    row_dot(acc, dot, x, w_up, n + row, 1, w_down, row)
                    dot[0] = dot[0] * (dot[1] + b_up[n + row])  # the GLU, act(gate) taken in step 1
                    h[0, k] = dot[0]
                    row_axpy(scratch, t, dot[0], w_down, row, w_up, n + after)
                else:
                    row_axpy(scratch, t, dot[0], w_down, row, w_down, after)
        for j in T.vectorized(D):
            out[0, j] = scratch[0, j]
        for t in range(1, tasks):
            for j in T.vectorized(D):
                out[0, j] = out[0, j] + scratch[t, j]

    return kernel.with_attr("global_symbol", name)

COLUMN_TASKS = 8  # sparse_columns: parallel tasks, each over an equal share of the selected rows
COLUMN_ROWS = 4  # sparse_columns: selected rows accumulated per pass over a task's partial sums


def sparse_columns(name, K, N, *, rows, gated: bool = False, act: str = "none", bias: bool = False,
                   wdtype="float32", prefetch_locality: int | None = None):
    """A column-sparse GEMV: y = act(sum over k < count of v[0, r_k] * w[r_k] + b), r_k = idx[0, k], for a
    weight stored one row per input channel ([K, N], a linear layer's x @ W layout), so that an input
    that is dropped costs nothing: its row is never read. Gated (w = [gate | up], N = 2F, y[1, F]):
    y = act(gate + b_gate) * (up + b_up), the GLU done on the sums.

    Args: v[1, K], idx[1, K] int32, count[1, 1] int32 (from `select`), w[K, N], (b[N]),
    scratch[COLUMN_TASKS, N], y[1, N or N/2].

    The selected rows are cut into COLUMN_TASKS equal slices run in parallel; a task reads its rows whole
    (long sequential streams), COLUMN_ROWS at a time, adding coefficient x row into its own partial-sum
    row of scratch (one load and store of it per COLUMN_ROWS rows of w), and prefetches the next rows'
    lines as it goes. A second parallel loop over column chunks sums the partial rows and applies bias,
    activation and the GLU.
    """
    if rows != 1:
        raise ValueError("sparse_columns runs in decode only")
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality  # (L2: 1.1-1.3x over L1 here)
    actf = compute.activation(act, MATH)
    out = N // 2 if gated else N
    if gated and N % 2:
        raise ValueError("a gated weight has gate and up halves")
    lanes = _lanes(N)
    line, line_vectors, lines = _row_lines(N, lanes, wdtype)
    tasks, group = COLUMN_TASKS, COLUMN_ROWS  # (the unrolled sum below reads coef[0..3]: 4 rows per pass)
    out_lanes = _lanes(out)
    chunk = _col_block(out, max(out_lanes, min(1024, out // tasks)))

    @T.prim_func
    def kernel(v: T.Buffer((1, K), "float32"), idx: T.Buffer((1, K), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((K, N), wdtype), b: T.Buffer((N,), "float32"), scratch: T.Buffer((tasks, N), "float32"),
               y: T.Buffer((1, out), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            first = clamp_count(count[0, 0], K) * t // tasks
            last = clamp_count(count[0, 0], K) * (t + 1) // tasks
            row = T.alloc_local((group,), "int32")
            after = T.alloc_local((group,), "int32")
            coef = T.alloc_local((group,), "float32")
            for j in T.vectorized(N):
                scratch[t, j] = T.float32(0)
            for g in range((last - first) // group):
                for r in T.unroll(group):
                    row[r] = clamp_index(idx[0, first + g * group + r], K)
                    after[r] = clamp_index(idx[0, T.min(first + (g + 1) * group + r, last - 1)], K)
                    coef[r] = v[0, row[r]]
                for s in range(lines):
                    for r in T.unroll(group):
                        _prefetch(T.address_of(w[after[r], s * line]), locality)
                    for u in T.unroll(line_vectors):
                        for l in T.vectorized(lanes):
                            scratch[t, (s * line_vectors + u) * lanes + l] = (
                                scratch[t, (s * line_vectors + u) * lanes + l]
                                + coef[0] * load_f32(w[row[0], (s * line_vectors + u) * lanes + l], wdtype)
                                + coef[1] * load_f32(w[row[1], (s * line_vectors + u) * lanes + l], wdtype)
                                + coef[2] * load_f32(w[row[2], (s * line_vectors + u) * lanes + l], wdtype)
                                + coef[3] * load_f32(w[row[3], (s * line_vectors + u) * lanes + l], wdtype))
            for k in range(first + (last - first) // group * group, last):
                row[0] = clamp_index(idx[0, k], K)
                coef[0] = v[0, row[0]]
                for s in range(N // lanes):
                    for l in T.vectorized(lanes):
                        scratch[t, s * lanes + l] = scratch[t, s * lanes + l] + coef[0] * load_f32(w[row[0], s * lanes + l], wdtype)
        for c in T.parallel(out // chunk):
            total = T.alloc_local((2, out_lanes), "float32")
            for s in range(chunk // out_lanes):
                for l in T.vectorized(out_lanes):
                    total[0, l] = scratch[0, c * chunk + s * out_lanes + l]
                    if gated:
                        total[1, l] = scratch[0, out + c * chunk + s * out_lanes + l]
                for q in range(1, tasks):
                    for l in T.vectorized(out_lanes):
                        total[0, l] = total[0, l] + scratch[q, c * chunk + s * out_lanes + l]
                        if gated:
                            total[1, l] = total[1, l] + scratch[q, out + c * chunk + s * out_lanes + l]
                for l in T.vectorized(out_lanes):
                    if bias:
                        total[0, l] = total[0, l] + b[c * chunk + s * out_lanes + l]
                        if gated:
                            total[1, l] = total[1, l] + b[out + c * chunk + s * out_lanes + l]
                    if gated:
                        y[0, c * chunk + s * out_lanes + l] = glu_unit(actf, total[0, l], total[1, l])
                    else:
                        y[0, c * chunk + s * out_lanes + l] = actf(total[0, l])

    kernel = kernel if bias else drop_params(kernel, ["b"])
    return kernel.with_attr("global_symbol", name)


def merge(name, D, parts: int, *, rows, bias: bool, residual: bool):
    """out = res + p_1 (+ p_2) + b.  Args: (res), p_1 (, p_2), (b), out; all [m, D] except b [D]."""
    sch = compute.schedule(name, compute.merge(D, parts, rows, bias=bias, residual=residual))
    _rowwise(sch, sch.get_sblock("y"), _lanes(D), rows)
    return sch.mod[name]


def linear_rows(name, K, N, *, rows, act="none", wdtype="float32", tile_panels=1):
    """y[m, N] = act(x[m, K] @ w[N, K]^T + b), for weights stored one row per output neuron.

    Args: x, w, b (zeros for bias-free models), y. Prefill only: `passes.kernels.cpu.gemm_nt`, register tiles
    of a few tokens x a few neurons taking dot products along the rows as stored (no per-call packing).
    """
    if rows is not None:
        raise ValueError("linear_rows runs in prefill only")
    return gemm_nt(name, K, N, wdtype=wdtype, bias=True, act=act, tile_panels=tile_panels)
