"""Neuron-aware CPU kernels (PowerInfer's operators), generated with TVM 0.27.

One decode step of a sparse FFN part is three kernels over the part's rows (one row per neuron):
  select       the neurons whose predictor score passes the threshold -> index list + count;
  sparse_up    h[k] = act(W_up[idx[k]] . x) (gated: act(W_gate[idx[k]] . x) * W_up[idx[k]] . x),
               a GEMV over gathered rows, parallel over the active neurons;
  sparse_down  out = sum_k h[k] * W_down[idx[k]], an axpy over the same rows ("ffn_down_t"),
               parallel over column chunks so each thread streams contiguous row segments.
Prompts (prefill) compute a whole part densely with `linear_rows`, a GEMM over the same row-major
weights; `merge` adds the parts, the down bias and the residual.

Conventions are those of `passes.kernels.cpu` (fp32, 64-byte aligned buffers, rows=1 for decode and a
symbolic `m` for prefill); index and count buffers are int32, shaped [1, n] and [1, 1].
"""

from __future__ import annotations

from tvm import te
from tvm.script import tirx as T

from .cpu import _activation, _lanes, _row_dim, _rowwise, _te_schedule

DOWN_CHUNK = 256  # columns per parallel chunk of sparse_down: 1 KiB contiguous per row and thread


def select(name, n, *, rows):
    """idx[0, :count] = the positions i with scores[0, i] > threshold[0], ascending.

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
            if scores[0, i] > threshold[0]:
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
    actf = _activation(act)
    lanes = _lanes(D)
    chunks = D // lanes
    width = 2 * n if gated else n

    @T.prim_func
    def kernel(x: T.Buffer((1, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((width, D), "float32"), b: T.Buffer((width,), "float32"), h: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        for k in T.parallel(count[0, 0]):
            acc = T.alloc_local((2, lanes), "float32")
            tot = T.alloc_local((2,), "float32")
            row = idx[0, k]
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
                h[0, k] = actf(tot[0]) * (tot[1] + b[n + row])
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
            for k in range(count[0, 0]):
                for j0 in range(chunk // lanes):
                    for v in T.vectorized(lanes):
                        out[0, c * chunk + j0 * lanes + v] = (
                            out[0, c * chunk + j0 * lanes + v] + h[0, k] * w[idx[0, k], c * chunk + j0 * lanes + v]
                        )

    return kernel.with_attr("global_symbol", name)


def merge_tensors(D, parts: int, *, rows, bias: bool, residual: bool) -> list:
    """The TE definition of `merge` (shared with the CUDA kernel): its arguments, output last."""
    m = _row_dim(rows)
    res = te.placeholder((m, D), name="res") if residual else None
    partials = [te.placeholder((m, D), name=f"p{i}") for i in range(parts)]
    b = te.placeholder((D,), name="b") if bias else None

    def add(i, j):
        total = partials[0][i, j]
        for p in partials[1:]:
            total = total + p[i, j]
        if bias:
            total = total + b[j]
        if residual:
            total = total + res[i, j]
        return total

    out = te.compute((m, D), add, name="y")
    return ([res] if residual else []) + partials + ([b] if bias else []) + [out]


def merge(name, D, parts: int, *, rows, bias: bool, residual: bool):
    """out = res + p_1 (+ p_2) + b.  Args: (res), p_1 (, p_2), (b), out; all [m, D] except b [D]."""
    sch = _te_schedule(name, merge_tensors(D, parts, rows=rows, bias=bias, residual=residual))
    _rowwise(sch, sch.get_sblock("y"), _lanes(D), rows)
    return sch.mod[name]


def linear_rows(name, K, N, *, rows, act="none"):
    """y[m, N] = act(x[m, K] @ w[N, K]^T + b), for weights stored one row per output neuron.

    Args: x, w, b (zeros for bias-free models), y. Prefill only. Neurons are spread over threads; each weight row is read
    once from memory and then, from L1, dotted with every token row as K/8 ymm FMAs.
    """
    if rows is not None:
        raise ValueError("linear_rows runs in prefill only")
    actf = _activation(act)
    lanes = _lanes(K)
    chunks = K // lanes
    m = _row_dim(rows)

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer((N, K), "float32"), b: T.Buffer((N,), "float32"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        for n in T.parallel(N):
            for i in range(m):
                acc = T.alloc_local((lanes,), "float32")
                tot = T.alloc_local((1,), "float32")
                for v in T.vectorized(lanes):
                    acc[v] = T.float32(0)
                for c in range(chunks):
                    for v in T.vectorized(lanes):
                        acc[v] = acc[v] + w[n, c * lanes + v] * x[i, c * lanes + v]
                tot[0] = acc[0] + b[n]
                for v in T.unroll(1, lanes):
                    tot[0] = tot[0] + acc[v]
                y[i, n] = actf(tot[0])

    return kernel.with_attr("global_symbol", name)
