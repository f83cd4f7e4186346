"""The column-sparse GEMV over blocks kept from a model file: threshold mode's decode of a linear whose input a
threshold thins, reading only the kept input channels' codes, in the file's own blocks (`kquant`'s columns layout).

y = act(sum over kept k of v[k] * W[k] + b) (+ res), W [K, N] blocked along K as the file stores it. A value of
W is d_j * q + m_j for the block j of K it sits in (d_j, m_j per output column; `kquant`'s module doc), so the sum
over a block's kept inputs factors:

    sum_k v[k] * W[k, n] = d_j[n] * (sum_k v[k] * c[k, n]) + (m_j[n] - offset * d_j[n]) * (sum_k v[k])

with c the stored codes. A task walks its share of the kept channels in order, adds v[k] * c[k] into a row of
code sums `acc`, and where the block changes (and at its end) takes acc into its partial sums through the block's
scales (`flush`): a block's record of scales is read once for all its kept inputs, only for blocks with one. It
does so one chunk of the outputs at a time (`CHUNK_GROUPS` 32-element groups), walking its channels again for
each chunk and reading only that chunk's bytes of their rows, so that the chunk's code sums and partial sums stay
in L1 (a wide matrix's whole rows of them do not: on a Zen 5 the FFN's gate|up of 9,728 outputs at 80% of its
inputs kept took 1.39x its dense GEMV's time with whole rows, 1.20x in chunks). The tasks' partial rows are summed as
`neuron.sparse_columns`' are (`neuron._column_sums`: bias, activation, GLU and residual there).

Bytes a call reads: the kept rows' codes (bits / 8 a weight) and the touched blocks' scales, about what the dense
GEMV reads of those blocks; the arithmetic is one widening and one FMA a weight, in fp32.
"""

from __future__ import annotations

from tvm.script import tirx as T

from . import compute
from .compute import clamp_count, clamp_index, drop_params, prefetch, row_dim
from .cpu import MATH
from .kquant import ColumnScales, column_plane_bytes, column_row_bytes, scale_byte_dtype
from .kquant_ops import _check_length, kq_format
from .neuron import COLUMN_TASKS, _column_sums

LANES = 16  # the code vectors: half of a 32-element nibble group (its low or its high nibbles)
AHEAD = 4  # kept rows ahead whose lines a task prefetches
GEMM_ROWS = 4  # linear_columns_kq: token rows a pass over a block's codes serves (their sums in registers)
CHUNK_GROUPS = 32  # sparse_columns_kq: 32-element output groups a pass over the kept rows serves (a multiple of 8:
# a group's bit in a high-bits byte is then a constant); its code and partial sums are 8 KiB a sequence


class _Columns:
    """The columns layout's reads for a [K, N] matrix in kept format `f` (TIR expressions; no names bound, so that
    they can sit in vectorized loops: the vectorizer takes a let's last lane)."""

    def __init__(self, f, K: int, N: int):
        self.f, self.N = f, N
        self.at = ColumnScales(f, N)
        self.VB, self.PB, self.planes = column_row_bytes(f, N), column_plane_bytes(N), f.bits - 4
        self.records = K // (f.super_block or f.block)
        self.byte_dtype = scale_byte_dtype(f)
        self.offset = T.float32(f.offset)

    def code(self, w, row, g, u, l):
        """The code of element 32 g + 16 u + l of w's row, as fp32 (low nibble | the planes' high bits << 4)."""
        c = T.shift_right(T.Cast("int32", w[row, 16 * g + l]), 4 * u) & 15
        for j in range(self.planes):
            bit = T.shift_right(T.Cast("int32", w[row, self.N // 2 + j * self.PB + g // 8 * 32 + 16 * u + l]), g % 8) & 1
            c = c | T.shift_left(bit, 4 + j)
        return T.Cast("float32", c)

    def scale(self, wsb, wsh, blk, n):
        """d of block blk at column n (two levels: D * sc, exact)."""
        at, REC = self.at, self.at.record
        rec = blk // at.per
        if at.two:
            return (T.Cast("float32", wsh[(rec * REC + at.sup) // 2 + n])
                    * T.Cast("float32", wsb[rec * REC + at.scale + blk % at.per * self.N + n]))
        return T.Cast("float32", wsh[(rec * REC + at.scale) // 2 + n])

    def shift(self, wsb, wsh, blk, n):
        """What block blk adds at column n per unit of input: m - offset * d (two levels: m = -(Dmin * mn))."""
        at, REC = self.at, self.at.record
        rec = blk // at.per
        shift = -(self.offset * self.scale(wsb, wsh, blk, n))
        if not self.f.has_min:
            return shift
        if at.two:
            return shift - (T.Cast("float32", wsh[(rec * REC + at.sup_min) // 2 + n])
                            * T.Cast("float32", wsb[rec * REC + at.min + blk % at.per * self.N + n]))
        return shift + T.Cast("float32", wsh[(rec * REC + at.min) // 2 + n])


def scratch_columns(N: int, max_batch: int = 1) -> int:
    """Columns of the kernel's scratch rows (one a task): the partial sums and the code sums, a row per sequence."""
    return 2 * max_batch * N


def sparse_columns_kq(name, K, N, *, rows, fmt: str, gated: bool = False, act: str = "none", bias: bool = False,
                      residual: bool = False, max_batch: int = 1, chunk_groups: int = CHUNK_GROUPS):
    """The column-sparse GEMV over `kquant.pack_columns`' layout of a [K, N] matrix in the kept format `fmt`.

    Args: v[m, K], idx[1, K], count[1, 1], w[K, column_row_bytes], ws[K / record, record bytes], (b[N]),
    (res[m, N or N/2]), scratch[COLUMN_TASKS, scratch_columns(N, max_batch)], y[m, N or N/2]; idx[0, :count] the
    kept channels (ascending reads each block's scales once; any order is correct)."""
    if rows not in (1, None):
        raise ValueError("sparse_columns_kq runs in one-token steps only (decode: rows 1, batch: rows None)")
    f = kq_format(fmt)
    _check_length(f, K, "K")
    if N % 32 or (gated and N % 64):
        raise ValueError(f"the columns layout needs N a multiple of 32 (gated: of 64), got {N}")
    if chunk_groups <= 0 or chunk_groups % 8:
        raise ValueError(f"chunk_groups must be a positive multiple of 8, got {chunk_groups}")
    m = row_dim(rows)
    out = N // 2 if gated else N
    cols = _Columns(f, K, N)
    B, VB, records, REC, byte_dtype = f.block, cols.VB, cols.records, cols.at.record, cols.byte_dtype
    groups = N // 32
    octets, tail = groups // 8, groups % 8  # whole 8-group octets, then the last groups
    per_chunk = chunk_groups // 8  # octets a chunk
    chunks = max(1, -(-octets // per_chunk))  # the tail groups go with the last chunk
    span = min(chunk_groups, groups)  # groups a chunk's rows are prefetched over
    part0, acc0 = 0, max_batch * N  # scratch row: partial sums, then code sums
    tasks = COLUMN_TASKS
    column_sums = _column_sums(N, m, gated=gated, act=act, bias=bias, residual=residual)

    def taken(scratch, t, r, n, blk, xs, wsb, wsh):
        """Column n's partial sum with block blk's code sums taken in: + d acc + (m - offset d) xs."""
        return (scratch[t, part0 + r * N + n] + cols.scale(wsb, wsh, blk, n) * scratch[t, acc0 + r * N + n]
                + cols.shift(wsb, wsh, blk, n) * xs[r])

    @T.macro
    def flush(scratch, t, blk, xs, wsb, wsh, first_lane, last_lane):
        """The code sums of block blk into the task's partial sums through the block's scales, over the chunk's
        vectors [first_lane, last_lane) of LANES columns; acc and xs zeroed."""
        for r in range(m):
            for c in range(first_lane, last_lane):
                for l in T.vectorized(LANES):  # (no names bound in here: the vectorizer takes a let's last lane)
                    scratch[t, part0 + r * N + c * LANES + l] = taken(scratch, t, r, c * LANES + l, blk, xs, wsb, wsh)
                    scratch[t, acc0 + r * N + c * LANES + l] = T.float32(0)
            xs[r] = T.float32(0)

    @T.macro
    def add_group(scratch, t, r, v, w, row, g):
        """acc of sequence r += v[r, row] times the codes of row's 32-element group g."""
        for u in T.unroll(2):
            for l in T.vectorized(LANES):
                scratch[t, acc0 + r * N + 32 * g + 16 * u + l] = (
                    scratch[t, acc0 + r * N + 32 * g + 16 * u + l] + v[r, row] * cols.code(w, row, g, u, l))

    @T.prim_func
    def kernel(v: T.Buffer((m, K), "float32"), idx: T.Buffer((1, K), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((K, VB), "uint8"), ws: T.Buffer((records, REC), "uint8"),
               b: T.Buffer((N,), "float32"), res: T.Buffer((m, out), "float32"),
               scratch: T.Buffer((tasks, scratch_columns(N, max_batch)), "float32"),
               y: T.Buffer((m, out), "float32")):
        T.func_attr({"tirx.noalias": True})
        wsb = T.decl_buffer((records * REC,), byte_dtype, data=ws.data)
        wsh = T.decl_buffer((records * REC // 2,), "float16", data=ws.data)
        wf = T.decl_buffer((K * VB,), "uint8", data=w.data)
        for t in T.parallel(tasks):
            first = clamp_count(count[0, 0], K) * t // tasks
            last = clamp_count(count[0, 0], K) * (t + 1) // tasks
            current = T.alloc_local((1,), "int32")
            xs = T.alloc_local((max_batch,), "float32")
            for r in range(m):
                xs[r] = T.float32(0)
                for c in range(N // LANES):
                    for l in T.vectorized(LANES):
                        scratch[t, part0 + r * N + c * LANES + l] = T.float32(0)
                        scratch[t, acc0 + r * N + c * LANES + l] = T.float32(0)
            for chunk in range(chunks):
                o0 = chunk * per_chunk  # the chunk's first octet, its end, and its vectors of LANES columns
                o1 = T.min(o0 + per_chunk, octets)
                lane1 = T.if_then_else(chunk == chunks - 1, N // LANES, o1 * 16)
                current[0] = -1
                for e in range(first, last):
                    row = clamp_index(idx[0, e], K)
                    ahead = clamp_index(idx[0, T.min(e + AHEAD, last - 1)], K)
                    for line in T.unroll(-(-span * 16 // 64)):  # the chunk's nibbles and its high bits' bytes
                        prefetch(T.address_of(wf[ahead * VB + T.min(o0 * 128 + line * 64, VB - 1)]), 3)
                    for j in T.unroll(cols.planes):
                        for line in T.unroll(-(-span * 4 // 64)):
                            prefetch(T.address_of(wf[ahead * VB + T.min(N // 2 + j * cols.PB + o0 * 32 + line * 64,
                                                                         VB - 1)]), 3)
                    if row // B != current[0]:
                        if current[0] >= 0:
                            flush(scratch, t, current[0], xs, wsb, wsh, o0 * 16, lane1)
                        current[0] = row // B
                    for r in range(m):
                        xs[r] = xs[r] + v[r, row]
                        # (eight groups a pass, unrolled: each group's shift into the high-bit planes is a constant)
                        for octet in range(o0, o1):
                            for gi in T.unroll(8):
                                add_group(scratch, t, r, v, w, row, octet * 8 + gi)
                        if chunk == chunks - 1:
                            for gi in T.unroll(tail):
                                add_group(scratch, t, r, v, w, row, octets * 8 + gi)
                if current[0] >= 0:
                    flush(scratch, t, current[0], xs, wsb, wsh, o0 * 16, lane1)
        column_sums(scratch, b, res, y)

    kernel = drop_params(kernel, ([] if bias else ["b"]) + ([] if residual else ["res"]))
    return kernel.with_attr("global_symbol", name)


def linear_columns_kq(name, K, N, *, rows, fmt: str, bias: bool = False, act: str = "none", residual: bool = False):
    """Prefill y[m, N] = act(x[m, K] @ W + b) + res over `kquant.pack_columns`' layout (the rows a column-sparse
    decode reads, so that a prompt needs no second copy of the matrix).  Args: x, w, ws, (b), (res), y.

    Parallel over chunks of 32 output columns (a 32-element group of each row: its 16 nibble bytes and its high
    bits); per chunk, GEMM_ROWS tokens at a time walk every block of K: each code is widened once for the tile's
    rows, their code sums and input sums kept in registers, and taken through the block's scales at its end (the
    factored sum of the module doc)."""
    if rows is not None:
        raise ValueError("linear_columns_kq runs in prefill only")
    f = kq_format(fmt)
    _check_length(f, K, "K")
    if N % 32:
        raise ValueError(f"the columns layout needs N a multiple of 32, got {N}")
    m = row_dim(rows)
    cols = _Columns(f, K, N)
    B, VB, records, REC, byte_dtype = f.block, cols.VB, cols.records, cols.at.record, cols.byte_dtype
    R = GEMM_ROWS
    epilogue = compute.linear_epilogue(compute.activation(act, MATH), bias, residual)

    @T.prim_func
    def kernel(x: T.Buffer((m, K), "float32"), w: T.Buffer((K, VB), "uint8"), ws: T.Buffer((records, REC), "uint8"),
               b: T.Buffer((N,), "float32"), res: T.Buffer((m, N), "float32"), y: T.Buffer((m, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        wsb = T.decl_buffer((records * REC,), byte_dtype, data=ws.data)
        wsh = T.decl_buffer((records * REC // 2,), "float16", data=ws.data)
        for g in T.parallel(N // 32):
            acc = T.alloc_local((R, 32), "float32")
            tot = T.alloc_local((R, 32), "float32")
            xs = T.alloc_local((R,), "float32")
            for tile in range((m + R - 1) // R):
                for q in T.unroll(R):
                    for l in T.vectorized(32):
                        tot[q, l] = T.float32(0)
                for blk in range(K // B):
                    for q in T.unroll(R):
                        xs[q] = T.float32(0)
                        for l in T.vectorized(32):
                            acc[q, l] = T.float32(0)
                    for i in range(B):
                        for q in T.unroll(R):
                            xs[q] = xs[q] + x[T.min(tile * R + q, m - 1), blk * B + i]
                            for u in T.unroll(2):
                                for l in T.vectorized(16):
                                    acc[q, 16 * u + l] = (acc[q, 16 * u + l] + x[T.min(tile * R + q, m - 1), blk * B + i]
                                                          * cols.code(w, blk * B + i, g, u, l))
                    for q in T.unroll(R):
                        for l in T.vectorized(32):
                            tot[q, l] = (tot[q, l] + cols.scale(wsb, wsh, blk, 32 * g + l) * acc[q, l]
                                         + cols.shift(wsb, wsh, blk, 32 * g + l) * xs[q])
                for q in T.unroll(R):
                    if tile * R + q < m:
                        for l in T.vectorized(32):
                            y[tile * R + q, 32 * g + l] = epilogue(tot[q, l], b, res, tile * R + q, 32 * g + l)

    kernel = drop_params(kernel, ([] if bias else ["b"]) + ([] if residual else ["res"]))
    return kernel.with_attr("global_symbol", name)
