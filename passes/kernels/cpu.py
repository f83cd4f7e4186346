"""CPU kernels (x86-64, AVX2 + FMA, or AVX-512) for picompile, generated with TVM 0.27.

Every public function returns one ``tvm.tirx.PrimFunc`` whose ``global_symbol`` is ``name``;
``build`` compiles a list of them into one shared library. The conventions of every kernel are
``compute``'s (fp32, rows=1 decode / symbolic-m prefill, int64 ``start``); on the CPU besides:

* The runtime may pass row slices ``buf[:m]`` of larger buffers (contiguous, same start).
* TVM's generated code assumes 64-byte aligned buffers (aligned vector loads); callers must
  allocate accordingly, unaligned arrays crash the parallel kernels.
* Parallel loops use TVM's thread pool (``TVM_NUM_THREADS``, default: physical cores).
* exp and erf are ``compute.POLYNOMIAL`` (vectorisable), see ``MATH``.

Where TE can express a kernel, its compute is ``compute``'s and this module only schedules it
with ``tvm.s_tir``. The panel GEMV and the register-tiled GEMM, and kernels with in-place updates
or data-dependent loop bounds (``rope_kv_write``, ``attention``), are TVMScript with the schedule
(parallel / vectorized / unrolled loops) written into the script; their math (epilogues,
activations, RoPE, exp) is ``compute``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm.script import tirx as T


from . import compute
from runtime.dtypes import QUANT_BLOCK

from .compute import drop_params, load_f32, rope_high, rope_low, row_dim

MATH = compute.POLYNOMIAL  # exp / erf as vectorisable polynomials (LLVM's libm calls would stop vectorisation)

VEC = 8  # fp32 lanes in one ymm register
GEMM_MR = 6  # prefill register tile rows: 6 x 16 (AVX2) or 6 x 32 (AVX-512) columns = 12 accumulators
PANEL = 16  # columns per panel of a panel-packed weight: one k step of a panel is one 64 B line (fp32)
# Decode over panels: panels per task, read in lockstep: 8 sequential streams a core (8 zmm or 16 ymm
# accumulators). Measured from DRAM on a 2-core Xeon (2 threads, 2048 x 2048-32000 fp32): 27-28 GB/s against
# 24-25 with 4 panels, 22-23 with 2, 27-28 with 16 (AVX-512); 26-27 against 25-26 with 4 (AVX2): the L2
# prefetcher follows each stream, and more streams keep more lines in flight.
GEMV_PANELS = 8
GEMV_MIN_TASKS = 8  # ... fewer panels per task where that leaves fewer parallel tasks than this
GEMV_NR = 64  # decode: 64 columns = 8 ymm accumulators
GEMV_KT = 16  # decode: rows of w per register pass (unrolled)
GEMV_CHUNKS = 8  # decode: aim for this many parallel column chunks ...
GEMV_CHUNK_MAX = 1024  # ... of at most this many columns (4 KB of each w row)


def gemv_group(panels: int, cap: int | None = None) -> int:
    """Panels per decode task: the most, a power of two up to `cap` (what the accumulators leave of the
    registers; None: GEMV_PANELS), that divides the panels and leaves at least GEMV_MIN_TASKS parallel tasks
    (else 1)."""
    group = GEMV_PANELS if cap is None else cap
    while group > 1 and (panels % group or panels // group < GEMV_MIN_TASKS):
        group //= 2
    return max(group, 1)


# --------------------------------------------------------------------------------------------
# Shapes and the scheduling steps shared by the TE kernels.
# --------------------------------------------------------------------------------------------


def _lanes(n):
    """Vector width for a contiguous extent ``n``: 8 when possible, else the largest divisor."""
    return math.gcd(n, VEC)


def _col_block(n, cap):
    """Widest column block <= cap that divides ``n`` in whole vectors (no tail predicates)."""
    lanes = _lanes(n)
    return max(b for b in range(lanes, cap + 1, lanes) if n % b == 0)


def _vectorize_inner(sch, block, lanes):
    """Split the innermost loop of ``block`` into whole vectors and vectorise them."""
    if lanes > 1:
        *_, inner = sch.get_loops(block)
        _, vec = sch.split(inner, [None, lanes])
        sch.vectorize(vec)


def _rowwise(sch, block, lanes, rows):
    """Elementwise (row, column) block: vector columns; rows across threads in prefill.

    Decode rows are a few thousand elements: a parallel launch costs more than it saves.
    """
    _vectorize_inner(sch, block, lanes)
    if rows is None:
        sch.parallel(sch.get_loops(block)[0])


def concat_columns(name, widths, *, rows):
    """y = [p_1 p_2 ...] side by side: a linear stored in parts of different formats writes each part's columns
    to a buffer of its own (passes.select_kernels).  Args: p_1 [m, w_1], ..., y [m, sum w]."""
    sch = compute.schedule(name, compute.concat_columns(tuple(widths), rows))
    _rowwise(sch, sch.get_sblock("y"), 1, rows)
    return sch.mod[name]


def _row_reductions(sch, reductions, out, lanes, rows):
    """Per-row reductions feeding the elementwise ``out`` block (norm statistics).

    Each reduction is rfactor'ed over ``lanes``, so it runs as ``lanes`` vector accumulators
    plus one horizontal sum instead of a serial scalar chain, and is computed inside out's
    row loop (the row is still in L1 when out reads it again), in registers (local scope).
    """
    out_block = sch.get_sblock(out)
    pairs = []
    for red in reductions:
        block = sch.get_sblock(red)
        *_, k = sch.get_loops(block)
        _, kv = sch.split(k, [None, lanes])
        pairs.append((sch.rfactor(kv, 0), block))
    row = sch.get_loops(out_block)[0]
    for rf, block in reversed(pairs):  # consumers first, so every compute_at finds its consumer
        sch.compute_at(block, row)
        sch.compute_at(rf, row)
    for rf, block in pairs:
        sch.set_scope(rf, 0, "local")
        sch.set_scope(block, 0, "local")
        kv, ko = sch.get_loops(rf)[-2:]
        sch.reorder(ko, kv)
        sch.vectorize(kv)
    _rowwise(sch, out_block, lanes, rows)
    for rf, _ in pairs:  # last: vectorize/parallel are refused once the init is split off
        init = sch.decompose_reduction(rf, sch.get_loops(rf)[-2])
        sch.vectorize(sch.get_loops(init)[-1])


def _schedule_gemv(sch, nr, lanes, K, N):
    """Decode ``acc[1, N] = x @ w`` streaming w once, then the epilogue ``y`` per chunk.

    Threads take contiguous column chunks (parallel loop). Within a chunk the k loop is
    tiled by kt rows: for each kt-row slab and each nr-column block, nr/8 ymm accumulators
    (the block of acc, in L1) are loaded, take kt unrolled broadcast-FMA steps and are stored
    back, i.e. one load/store of acc per kt rows of w. The slab is read as kt sequential
    streams of chunk*4 bytes, which the hardware prefetchers follow; a k-innermost order
    (one 256 B piece per 8-32 KB-strided row) measured ~30% slower. The epilogue (bias,
    activation, residual) runs over the chunk once its k loop is done, while it is in L1.
    """
    kt = math.gcd(K, GEMV_KT)
    chunk = _col_block(N, max(nr, min(GEMV_CHUNK_MAX, N // GEMV_CHUNKS)))
    block = sch.get_sblock("acc")
    i, n, k = sch.get_loops(block)
    no, nb, nj, nv = sch.split(n, [None, chunk // nr, nr // lanes, lanes])
    ko, ki = sch.split(k, [None, kt])
    sch.reorder(no, i, ko, nb, ki, nj, nv)
    epilogue = sch.get_sblock("y")
    sch.reverse_compute_at(epilogue, no)
    sch.parallel(no)
    sch.unroll(ki)
    sch.unroll(nj)
    sch.vectorize(nv)  # before decompose_reduction (the other order is refused)
    init = sch.decompose_reduction(block, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    _vectorize_inner(sch, epilogue, lanes)


# --------------------------------------------------------------------------------------------
# TE kernels: compute's definitions, scheduled for the CPU
# --------------------------------------------------------------------------------------------


def linear(name, K, N, *, rows, bias: bool, act="none", residual=False, wdtype="float32", tile_panels=1,
           skip_zero_rows=False):
    """y[m, N] = act(x[m, K] @ w[K, N] + b) + res.  Args: x, w, (b), (res), y.

    The [K, N] layout, for weights that are not panel-packed: the GPU's (when emulated), and the FFN
    down rows the sparse decode kernels gather. Decode is a TE GEMV; prefill is `gemm` with layout "kn"
    (panels packed per call, `tile_panels` per register tile), or with `skip_zero_rows`, for an x that is
    mostly exact zeros (a ReLU FFN's hidden values), `gemm_kn`, which reads w in place and skips the rows
    of w that only zeros multiply. (gemm_kn without skipping beat the packing GEMM at m = 16 in fp32 only;
    at m = 64, and at m = 16 in fp16, the packing GEMM was faster: see gemm_kn.)
    """
    if rows is None and skip_zero_rows:
        return gemm_kn(name, K, N, wdtype=wdtype, bias=bias, act=act, residual=residual, tile_panels=tile_panels,
                       skip_zero_rows=True)
    if rows is None:
        return gemm(name, K, N, layout="kn", wdtype=wdtype, bias=bias, act=act, residual=residual,
                    tile_panels=tile_panels)
    args = compute.linear(K, N, rows, bias=bias, act=act, residual=residual, math=MATH, wdtype=wdtype)
    sch = compute.schedule(name, args)
    _schedule_gemv(sch, _col_block(N, GEMV_NR), _lanes(N), K, N)
    return sch.mod[name]


def glu(name, F, *, rows, act):
    """y[m, F] = act(t[:, :F]) * t[:, F:] (gate first, then up).  Args: t, y."""
    sch = compute.schedule(name, compute.glu(F, rows, act=act, math=MATH))
    _rowwise(sch, sch.get_sblock("y"), _lanes(F), rows)
    return sch.mod[name]


def layer_norm(name, D, eps, *, rows):
    """y = (x - mean) / sqrt(var + eps) * g + b, biased variance (two-pass).  Args: x, g, b, y."""
    sch = compute.schedule(name, compute.layer_norm(D, eps, rows))
    _row_reductions(sch, ["total", "sq"], "y", _lanes(D), rows)
    return sch.mod[name]


def rms_norm(name, D, eps, *, rows, residual: bool = False):
    """y = x / sqrt(mean(x^2) + eps) * g (+ res).  Args: x, g, (res), y."""
    sch = compute.schedule(name, compute.rms_norm(D, eps, rows, residual=residual))
    _row_reductions(sch, ["sq"], "y", _lanes(D), rows)
    return sch.mod[name]


def softcap(name, N, cap, *, rows):
    """y = cap * tanh(x / cap) (the logits' soft-cap).  Args: x, y."""
    sch = compute.schedule(name, compute.softcap(N, cap, rows, math=MATH))
    _rowwise(sch, sch.get_sblock("y"), _lanes(N), rows)
    return sch.mod[name]


def embed(name, V, D, *, rows, positions: int | None, wdtype="float32", scale: float = 1.0):
    """y[i] = table[ids[i]] (* scale) (+ pos_table[start + i]), ids and positions clamped to the tables.
    Args: ids, table, (pos_table, start), y."""
    sch = compute.schedule(name, compute.embed(V, D, rows, positions=positions, wdtype=wdtype, scale=scale))
    _rowwise(sch, sch.get_sblock("y"), _lanes(D), rows)
    return sch.mod[name]


def embed_q(name, V, D, *, rows, positions: int | None, bits: int, sdtype="float16", has_min: bool = False,
            scale: float = 1.0):
    """`embed` over a block-quantized table (rows layout, int8 or int4 by `bits`, scales in `sdtype`; int4a's
    scales and mins with `has_min`). Args: ids, table_q, table_s, (pos_table, start), y. Vectors of half a block
    (16 lanes), so that an int4 vector is the low or the high nibbles of 16 consecutive bytes."""
    sch = compute.schedule(name, compute.embed_q(V, D, rows, positions=positions, bits=bits, sdtype=sdtype,
                                                 has_min=has_min, scale=scale))
    _rowwise(sch, sch.get_sblock("y"), QUANT_BLOCK // 2, rows)
    return sch.mod[name]


# --------------------------------------------------------------------------------------------
# Panel-packed linear layers (the CPU's dense weights) and the register-tiled GEMM they share
# with row-major weights. TVMScript: the loops are the schedule.
# --------------------------------------------------------------------------------------------


def pack_panels(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [ceil(N / PANEL), K, PANEL], the last panel zero-padded.

    A decode GEMV then reads each panel as one sequential stream (the [K, N] layout makes it a
    strided walk of K short row segments, which the hardware prefetchers follow poorly), and the
    prefill GEMM uses a panel as its packed operand directly, with no per-call packing.
    """
    K, N = w.shape
    panels = -(-N // PANEL)
    padded = np.zeros((K, panels * PANEL), w.dtype)
    padded[:, :N] = w
    return np.ascontiguousarray(padded.reshape(K, panels, PANEL).transpose(1, 0, 2))


def _epilogue(act, bias, residual):
    """compute's linear epilogue with the CPU's activation math."""
    return compute.linear_epilogue(compute.activation(act, MATH), bias, residual)


def _unused(bias, residual):
    return ([] if bias else ["b"]) + ([] if residual else ["res"])


def _gemv_panels(name, K, N, *, wdtype, bias, act, residual, panels_per_task=None):
    """Decode y[1, N] = act(x[1, K] @ w + b) + res over a panel-packed w [P, K, 16].

    Each parallel task takes `group` adjacent panels (`gemv_group` up to `panels_per_task`, None:
    GEMV_PANELS): per k it broadcasts x[k] and issues one FMA per vector of columns into accumulators
    that stay in registers for the whole k loop, so w is read as `group` sequential streams; the
    epilogue runs on the accumulators.
    """
    panels = -(-N // PANEL)
    group = gemv_group(panels, panels_per_task)
    width = group * PANEL
    full = N % width == 0  # no padded columns: a vectorised epilogue without predicates
    epilogue = _epilogue(act, bias, residual)
    out_loop = T.vectorized if full else T.serial

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, K, PANEL), wdtype), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(panels // group):
            acc = T.alloc_local((width,), "float32")
            for j in T.vectorized(width):
                acc[j] = T.float32(0)
            for k in range(K):
                for g in T.unroll(group):
                    for v in T.vectorized(PANEL):
                        acc[g * PANEL + v] = acc[g * PANEL + v] + x[0, k] * load_f32(w[t * group + g, k, v], wdtype)
            for j in out_loop(width):
                if full or t * width + j < N:
                    y[0, t * width + j] = epilogue(acc[j], b, res, 0, t * width + j)

    return drop_params(kernel, _unused(bias, residual)).with_attr("global_symbol", name)


@dataclass(frozen=True)
class GemmWeight:
    """`gemm`'s weight operand: its parameters and how a task fills its fp32 panels from them.

    `w` (and `ws`, the scales of a quantized weight; None for float weights) are (shape, dtype) of the kernel's
    parameters. `pack(tile_panels)` returns a T.macro `(packed, w, ws, p)` that stores panel group p's columns
    p * tile_panels * 16 + [0, tile_panels * 16) into packed [tile_panels, K, 16] as fp32 (columns past N: any
    finite value, they are not stored); pack None means w is already [P, K, 16] panels, read in place.
    """

    w: tuple
    ws: tuple | None
    pack: Callable | None


def _pack_float_rows(K, N, wdtype):
    """[N, K] rows (the neuron-major FFN up rows): panel column v is row n, read along k."""

    def make(tile_panels):
        @T.macro
        def pack(packed, w, ws, p):
            for q, v, k in T.grid(tile_panels, PANEL, K):
                packed[q, k, v] = load_f32(w[T.min((p * tile_panels + q) * PANEL + v, N - 1), k], wdtype)

        return pack

    return GemmWeight(((N, K), wdtype), None, make)


def _pack_float_kn(K, N, wdtype):
    """[K, N] row-major: a panel's k step is 16 adjacent elements of row k."""

    def make(tile_panels):
        @T.macro
        def pack(packed, w, ws, p):
            for k, q, v in T.grid(K, tile_panels, PANEL):
                packed[q, k, v] = load_f32(w[k, T.min((p * tile_panels + q) * PANEL + v, N - 1)], wdtype)

        return pack

    return GemmWeight(((K, N), wdtype), None, make)


def gemm_weight(layout: str, K, N, wdtype="float32") -> GemmWeight:
    """The float weight operands: "panels" [P, K, 16] (pack_panels, read in place), "rows" [N, K] (one row per
    output, the neuron-major FFN up rows), "kn" [K, N] (row-major, e.g. the FFN down rows a sparse decode
    kernel gathers)."""
    if layout == "panels":
        return GemmWeight(((-(-N // PANEL), K, PANEL), wdtype), None, None)
    if layout == "rows":
        return _pack_float_rows(K, N, wdtype)
    if layout == "kn":
        return _pack_float_kn(K, N, wdtype)
    raise ValueError(f"unknown weight layout {layout!r}")


def gemm(name, K, N, *, layout: str | GemmWeight, wdtype="float32", bias: bool, act="none", residual=False,
         tile_panels=1):
    """Prefill y[m, N] = act(x[m, K] @ W + b) + res.  Args: x, w, (ws), (b), (res), y.

    W is a float layout of `gemm_weight` ("panels", "rows", "kn", stored in `wdtype`) or any `GemmWeight`
    (the quantized ones of `quant`, which add the scales ws).

    Loop order: groups of `tile_panels` column panels (parallel) > 6-row tiles > k > register tile
    of 6 rows x 16 * tile_panels columns. Per k step the tile broadcasts 6 values of x, loads its
    panels' columns and issues 6 * 16 * tile_panels / lanes FMAs into accumulators that stay in
    registers for the whole k loop: 12 of them either way, ymm with AVX2 (tile_panels=1) or zmm with
    AVX-512 (tile_panels=2). A panel (K x 64 B) is read from memory once and then from L2 for every
    row tile. Weights not in float panels are first packed into per-task fp32 panels (the operand's
    pack: K x 16 elements per panel, against m x K x 16 FMAs). Pad rows of the last tile recompute
    row m-1 and are not stored, so the k loop carries no predicate.
    """
    weight = gemm_weight(layout, K, N, wdtype) if isinstance(layout, str) else layout
    m = row_dim(None)
    panels = -(-N // PANEL)
    tile_panels = tile_panels if panels % tile_panels == 0 else 1
    width = tile_panels * PANEL
    (wshape, wtype), (sshape, stype) = weight.w, weight.ws or ((1,), "float32")
    direct = weight.pack is None  # float panels, read in place
    pack = None if direct else weight.pack(tile_panels)
    full = N % width == 0
    epilogue = _epilogue(act, bias, residual)
    out_loop = T.vectorized if full else T.serial
    MR = GEMM_MR

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer(wshape, wtype), ws: T.Buffer(sshape, stype), b: T.Buffer((N,), "float32"),
               res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        res = T.match_buffer(res_h, (m, N), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        for p in T.parallel(panels // tile_panels):
            packed = T.alloc_buffer((tile_panels, K, PANEL), "float32")
            if not direct:
                pack(packed, w, ws, p)
            for io in range((m + MR - 1) // MR):
                acc = T.alloc_local((MR, width), "float32")
                for r in T.unroll(MR):
                    for v in T.vectorized(width):
                        acc[r, v] = T.float32(0)
                for k in range(K):
                    for r in T.unroll(MR):
                        for q in T.unroll(tile_panels):
                            for v in T.vectorized(PANEL):
                                if not direct:
                                    acc[r, q * PANEL + v] = (acc[r, q * PANEL + v]
                                                             + x[T.min(io * MR + r, m - 1), k] * packed[q, k, v])
                                else:
                                    acc[r, q * PANEL + v] = (
                                        acc[r, q * PANEL + v]
                                        + x[T.min(io * MR + r, m - 1), k] * load_f32(w[p * tile_panels + q, k, v], wtype))
                for r in T.unroll(MR):
                    if io * MR + r < m:
                        for v in out_loop(width):
                            if full or p * width + v < N:
                                y[io * MR + r, p * width + v] = epilogue(acc[r, v], b, res, io * MR + r, p * width + v)

    unused = _unused(bias, residual) + ([] if weight.ws else ["ws"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)


NT_TILE = {1: (8, 3, 4), 2: (16, 4, 6)}
"""gemm_nt's register tile per `tile_panels` (the ISA's, see gemm): (fp32 lanes per vector, tokens, neurons),
tokens x neurons vector accumulators: 12 ymm (AVX2) or 24 zmm (AVX-512). Measured 2026-12-01 on the Zen 4
(benchmarks/bench_prefill_gemm.py, up 2048 -> 8192 at m = 16, 2 threads, alternated): with AVX-512, 4 x 6 read
the rows 10-25% faster than 4 x 4, 6 x 4, 3 x 8, 2 x 8 and 4 x 5 (2 x 12 and 8 x 2 far slower); the tree of
halvings before the horizontal sum ~3% over a scalar sum of each accumulator's lanes."""


@dataclass(frozen=True)
class QuantizedRows:
    """A GEMM weight stored as rows of quantized blocks (quant.quantized_rows), read in place by gemm_nt (one row
    per output: the FFN up rows) and gemm_kn (one row per reduction index: the down rows): its parameters w and
    ws as (shape, dtype), and `values(width)`, a T.macro `(wv, i, w, ws, row, col)` that stores the row's
    elements [col, col + width) into wv[i, :] as fp32 (dequantized once per tile, not per FMA)."""

    w: tuple
    ws: tuple
    values: Callable


def gemm_nt(name, K, N, *, wdtype="float32", bias: bool, act="none", residual=False, tile_panels=1,
            tokens: int | None = None, neurons: int | None = None, rows: QuantizedRows | None = None):
    """Prefill y[m, N] = act(x[m, K] @ w[N, K]^T + b) + res over weights stored one row per output (the FFN
    up rows the sparse decode kernels gather), read in place: no per-call packing.

    Loop order: groups of `neurons` rows (parallel: each thread streams a contiguous range of rows) >
    tiles of `tokens` rows of x > k in vectors > register tile of tokens x neurons vector accumulators
    (NT_TILE), each a dot product along k: per step `tokens` + `neurons` vector loads and their
    tokens x neurons FMAs. A group's rows are read from memory by its first token tile and from L1/L2 by
    the others; x stays in L2. Each accumulator is reduced once, after its k loop (halved in vectors down
    to one lane), plus a scalar tail where K is not a whole number of vectors. Pad rows and neurons of the
    last tiles recompute the last row / neuron and are not stored.

    `rows` (a quantized weight) replaces the float w by its parameters: a group's rows are dequantized once,
    into a task-local fp32 copy (NR x K: L2-resident), which the token tiles then read as a float w.
    """
    quantized = rows is not None  # (TVMScript branches on Python bools only)
    w_spec, ws_spec = (rows.w, rows.ws) if quantized else (((N, K), wdtype), ((1,), "float32"))
    values = rows.values(K) if quantized else None
    lanes, TR, NR = NT_TILE.get(tile_panels, NT_TILE[1])
    TR, NR = tokens or TR, neurons or NR
    m = row_dim(None)
    L = lanes
    steps = K // L
    halvings = int(math.log2(L))  # L >> halvings == 1
    groups = -(-N // NR)
    full = N % NR == 0
    epilogue = _epilogue(act, bias, residual)

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer(*w_spec), ws: T.Buffer(*ws_spec), b: T.Buffer((N,), "float32"),
               res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        res = T.match_buffer(res_h, (m, N), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        for g in T.parallel(groups):
            wg = T.alloc_local((NR if quantized else 0, K), "float32")
            if quantized:
                for n in range(NR):
                    values(wg, n, w, ws, T.min(g * NR + n, N - 1), 0)
            for io in range((m + TR - 1) // TR):
                acc = T.alloc_local((TR, NR, L), "float32")
                tot = T.alloc_local((TR, NR), "float32")
                for t in T.unroll(TR):
                    for n in T.unroll(NR):
                        for v in T.vectorized(L):
                            acc[t, n, v] = T.float32(0)
                for c in range(steps):
                    for t in T.unroll(TR):
                        for n in T.unroll(NR):
                            for v in T.vectorized(L):
                                acc[t, n, v] = acc[t, n, v] + x[T.min(io * TR + t, m - 1), c * L + v] * (
                                    wg[n, c * L + v] if quantized else load_f32(w[T.min(g * NR + n, N - 1), c * L + v],
                                                                                wdtype))
                for t in T.unroll(TR):
                    for n in T.unroll(NR):
                        if halvings >= 1:
                            for v in T.vectorized(L >> 1):
                                acc[t, n, v] = acc[t, n, v] + acc[t, n, v + (L >> 1)]
                        if halvings >= 2:
                            for v in T.vectorized(L >> 2):
                                acc[t, n, v] = acc[t, n, v] + acc[t, n, v + (L >> 2)]
                        if halvings >= 3:
                            for v in T.vectorized(L >> 3):
                                acc[t, n, v] = acc[t, n, v] + acc[t, n, v + (L >> 3)]
                        if halvings >= 4:
                            for v in T.vectorized(L >> 4):
                                acc[t, n, v] = acc[t, n, v] + acc[t, n, v + (L >> 4)]
                        tot[t, n] = acc[t, n, 0]
                        for v in T.unroll(1, L >> halvings):
                            tot[t, n] = tot[t, n] + acc[t, n, v]
                        for k in range(steps * L, K):
                            tot[t, n] = tot[t, n] + x[T.min(io * TR + t, m - 1), k] * load_f32(
                                w[T.min(g * NR + n, N - 1), k], wdtype)
                for t in T.unroll(TR):
                    if io * TR + t < m:
                        for n in T.unroll(NR):
                            if full or g * NR + n < N:
                                y[io * TR + t, g * NR + n] = epilogue(tot[t, n], b, res, io * TR + t, g * NR + n)

    return drop_params(kernel, _unused(bias, residual) + ([] if quantized else ["ws"])).with_attr("global_symbol", name)


KN_COLUMNS = 1024  # gemm_kn: columns per parallel task (4 KiB of each fp32 row)
KN_KB = 12  # gemm_kn: rows of w per k block, reused from L1 by a task's row tiles
"""Measured 2026-12-01 on the Zen 4 (benchmarks/bench_prefill_gemm.py, down 8192 -> 2048 at m = 16, alternated):
with 2 threads, tasks of 1024 columns took 25-45% less time than tasks of 256 or 512 (the two threads then read
long contiguous row segments); k blocks of 12 rows beat 4, 8, 16, 24, 32 and 64 (rows 8 KiB apart share L1
sets: a block much deeper than the L1's ways falls out before the next row tile reads it); software prefetches
of the next k block, per-call packing of each k block into a contiguous buffer and 8- or 16-row register tiles
gained nothing or lost. Against `gemm`'s "kn" layout (a panel packed per call) over a dense x, gemm_kn was faster
at m = 16 in fp32 (20.5 against 25.8 ms, medians) but slower in fp16 (17.0 against 14.7) and at m = 64 (fp32
61.6 against 31.4, fp16 36.4 against 30.7; heavily loaded machine): `linear` uses it only with skip_zero_rows,
where, over ReLU hidden values of which 35% of the columns hold a nonzero, it took 11.7 (fp32) and 7.4 ms (fp16)
at m = 16, about the panel GEMM's 12.0 and 7.5 over the whole matrix."""


def gemm_kn(name, K, N, *, wdtype="float32", bias: bool, act="none", residual=False, tile_panels=1,
            columns=KN_COLUMNS, kb=KN_KB, skip_zero_rows=False, rows: QuantizedRows | None = None):
    """Prefill y[m, N] = act(x[m, K] @ w[K, N] + b) + res over a row-major w (the FFN down rows the sparse
    decode kernels gather), read in place: no per-call packing.

    Loop order: chunks of `columns` columns (parallel) > blocks of `kb` rows of w > 6-row tiles of x >
    column blocks of the chunk > k > gemm's register tile (6 rows x 16 * tile_panels columns, broadcast x,
    FMA). A k block of a chunk (kb contiguous row segments) is read from memory by the first row tile and
    from L1 by the others; a tile's partial sums go through y between k blocks, and the epilogue is applied
    after the last. A last column block narrower than the register tile reads its columns clamped and does
    not store the pad columns.

    `skip_zero_rows` (x a ReLU's output, as the FFN hidden values are): first list the k whose column of x
    has a nonzero in any of the m rows (a serial scan of x), then run the k blocks over that list only, so a
    row of w that only zeros multiply is never read. Exact; over a prompt of 16 tokens of the 1B OPT-ReLU
    the list held 26-45% of the rows.

    `rows` (a quantized weight, `quant.quantized_rows`) replaces the float w by its parameters: a k block's row
    segments are dequantized once per column block into an fp32 block that every row tile then reads (needs N
    whole tiles).
    """
    m = row_dim(None)
    width = 16 * tile_panels
    quantized = rows is not None  # (TVMScript branches on Python bools only)
    w_spec, ws_spec = (rows.w, rows.ws) if quantized else (((K, N), wdtype), ((1,), "float32"))
    values = rows.values(width) if quantized else None
    if quantized and N % width:
        raise ValueError(f"gemm_kn over quantized rows needs N a multiple of {width}, got {N}")
    blocks = -(-N // width)
    chunk = max(1, min(columns // width, blocks))
    tasks = -(-blocks // chunk)
    kb = min(kb, K)
    full = N % width == 0
    epilogue = _epilogue(act, bias, residual)
    out_loop = T.vectorized if full else T.serial
    MR = GEMM_MR

    def clamp(col):
        return col if full else T.min(col, N - 1)

    def row(live, kk):  # the kk-th row of w a k block reads
        return live[kk] if skip_zero_rows else kk

    def rows_read(found):  # how many rows of w the k blocks read
        return found[0] if skip_zero_rows else K

    def k_blocks(found):  # k blocks the row list makes (one, empty, when no row is live)
        return T.max(1, (rows_read(found) + kb - 1) // kb)

    @T.macro
    def tile_start(acc, y, io, col, ko):
        """A register tile's partial sums: zero in the first k block, else what the last one left in y."""
        for r in T.unroll(MR):
            for v in T.vectorized(width):
                acc[r, v] = T.float32(0)
        if ko > 0:
            for r in T.unroll(MR):
                for v in out_loop(width):
                    acc[r, v] = y[T.min(io * MR + r, m - 1), clamp(col + v)]

    @T.macro
    def tile_end(acc, y, b, res, io, col, ko, found):
        """The tile's sums into y: through the epilogue after the last k block, as they are before it."""
        for r in T.unroll(MR):
            if io * MR + r < m:
                for v in out_loop(width):
                    if full or col + v < N:
                        if ko == k_blocks(found) - 1:
                            y[io * MR + r, col + v] = epilogue(acc[r, v], b, res, io * MR + r, col + v)
                        else:
                            y[io * MR + r, col + v] = acc[r, v]

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer(*w_spec), ws: T.Buffer(*ws_spec), b: T.Buffer((N,), "float32"),
               res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        res = T.match_buffer(res_h, (m, N), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        live = T.alloc_buffer((K,), "int32")
        found = T.alloc_buffer((1,), "int32")
        if skip_zero_rows:
            found[0] = 0
            for k in range(K):
                nonzero = T.alloc_local((1,), "int32")
                nonzero[0] = 0
                for i in range(m):
                    if x[i, k] != T.float32(0):
                        nonzero[0] = 1
                if nonzero[0] != 0:
                    live[found[0]] = T.Cast("int32", k)
                    found[0] = found[0] + 1
        for p in T.parallel(tasks):
            if quantized:  # a k block's row segments dequantized once per column block, for every row tile
                wblk = T.alloc_local((kb, width), "float32")
                for ko in range(k_blocks(found)):
                    for j in range(T.min(chunk, blocks - p * chunk)):
                        col = (p * chunk + j) * width
                        for kk in range(ko * kb, T.min(ko * kb + kb, rows_read(found))):
                            values(wblk, kk - ko * kb, w, ws, row(live, kk), col)
                        for io in range((m + MR - 1) // MR):
                            acc = T.alloc_local((MR, width), "float32")
                            tile_start(acc, y, io, col, ko)
                            for kk in range(ko * kb, T.min(ko * kb + kb, rows_read(found))):
                                for r in T.unroll(MR):
                                    for v in T.vectorized(width):
                                        acc[r, v] = acc[r, v] + x[T.min(io * MR + r, m - 1), row(live, kk)] * wblk[
                                            kk - ko * kb, v]
                            tile_end(acc, y, b, res, io, col, ko, found)
            else:
                for ko in range(k_blocks(found)):
                    for io in range((m + MR - 1) // MR):
                        for j in range(T.min(chunk, blocks - p * chunk)):
                            acc = T.alloc_local((MR, width), "float32")
                            col = (p * chunk + j) * width
                            tile_start(acc, y, io, col, ko)
                            if full or col + width <= N:
                                for kk in range(ko * kb, T.min(ko * kb + kb, rows_read(found))):
                                    for r in T.unroll(MR):
                                        for v in T.vectorized(width):
                                            acc[r, v] = acc[r, v] + x[T.min(io * MR + r, m - 1), row(live, kk)] * load_f32(
                                                w[row(live, kk), col + v], wdtype)
                            else:
                                for kk in range(ko * kb, T.min(ko * kb + kb, rows_read(found))):
                                    for r in T.unroll(MR):
                                        for v in range(width):
                                            acc[r, v] = acc[r, v] + x[T.min(io * MR + r, m - 1), row(live, kk)] * load_f32(
                                                w[row(live, kk), T.min(col + v, N - 1)], wdtype)
                            tile_end(acc, y, b, res, io, col, ko, found)

    return drop_params(kernel, _unused(bias, residual) + ([] if quantized else ["ws"])).with_attr("global_symbol", name)


def linear_panels(name, K, N, *, rows, wdtype="float32", bias: bool, act="none", residual=False, tile_panels=1,
                  panels_per_task: int | None = None):
    """y[m, N] = act(x[m, K] @ W + b) + res with W panel-packed (pack_panels).  Args: x, w, (b), (res), y.
    `tile_panels` sets the prefill GEMM's register tile (see gemm); `panels_per_task` the decode GEMV's panels
    read in lockstep (None: GEMV_PANELS; benchmarks compare others)."""
    if rows == 1:
        return _gemv_panels(name, K, N, wdtype=wdtype, bias=bias, act=act, residual=residual,
                            panels_per_task=panels_per_task)
    row_dim(rows)
    return gemm(name, K, N, layout="panels", wdtype=wdtype, bias=bias, act=act, residual=residual,
                tile_panels=tile_panels)


# --------------------------------------------------------------------------------------------
# Block-quantized rows (quant's rows layout) for the GPU's kernels: plain TE schedules, so the CPU can stand
# in for the GPU (emulation) and check it; the CPU's own quantized layouts are the panels.
# --------------------------------------------------------------------------------------------


def linear_qrows(name, K, N, *, rows, bits: int, sdtype="float16", bias: bool, act="none", residual=False):
    """y[m, N] = act(x[m, K] @ W + b) + res with W^T [N, K] in the quant rows layout (``cuda.linear_qrows``'s
    weights).  Args: x, w [N, K or K/2], ws [N, K/32], (b), (res), y.

    Simple and correct rather than fast: output columns in parallel chunks of 16, each a serial dot product
    over the row's blocks (decode and prefill alike).
    """
    args = compute.linear_qrows(K, N, rows, bias=bias, act=act, residual=residual, math=MATH, bits=bits,
                                sdtype=sdtype)
    sch = compute.schedule(name, args)
    block = sch.get_sblock("acc")
    i, n, *_ = sch.get_loops(block)
    no, ni = sch.split(n, [None, PANEL])
    sch.reorder(no, i, ni)
    sch.parallel(no)
    _rowwise(sch, sch.get_sblock("y"), _lanes(N), rows)
    return sch.mod[name]


# --------------------------------------------------------------------------------------------
# TVMScript kernels (in-place cache writes, causal loop bounds). Per device because the loops are the
# schedule: here one thread per row (rope) or per (head, row) pair (attention) walking vectors, where
# the GPU's are thread blocks with cross-thread reductions and an online softmax.
# --------------------------------------------------------------------------------------------


def _row_loop(rows):
    """Prefill rows run on the thread pool; the single decode row runs inline."""
    return T.parallel if rows is None else T.serial


def rope_kv_write(name, H, KVH, hd, max_ctx, *, rows, rope: bool, qk_norm_eps: float | None = None):
    """Split qkv rows, rotate q and k (rotate-half RoPE), write q and the KV cache in place.

    Args: qkv[m, (H+2KVH)*hd], (cos, sin [max_ctx, hd/2]), (q_norm, k_norm [hd]), kcache, vcache
    [KVH, max_ctx, hd], q[m, H*hd], start. Row i goes to cache position start + i; other positions are
    untouched. With `qk_norm_eps` (Qwen3) each q and k head is first RMS-normalised over its hd values
    (x * 1/rms * w[j], w: q_norm or k_norm), the rotation reading the normed values. The work per row is tiny
    (a few KB), so rows are parallel only in prefill; each head's half-rows are processed in vectors (a head's
    sum of squares too, before its rotation).
    """
    if hd % 2:
        raise ValueError("rope_kv_write needs an even head dim")
    M = row_dim(rows)
    loop = _row_loop(rows)
    half = hd // 2
    width = (H + 2 * KVH) * hd
    hl = _lanes(half)  # vector width over a half head
    dl = _lanes(hd)  # vector width over a whole head
    K0, V0 = H * hd, (H + KVH) * hd  # column offsets of the k and v heads in a qkv row
    norm = qk_norm_eps is not None
    eps = float(qk_norm_eps or 0.0)

    def qk(x, factor, w):  # a q or k value as the rotation (or the copy) reads it
        return x * factor * w if norm else x

    @T.prim_func
    def kernel(
        qkv_h: T.handle,
        cos: T.Buffer((max_ctx, half), "float32"),
        sin: T.Buffer((max_ctx, half), "float32"),
        q_norm: T.Buffer((hd,), "float32"),
        k_norm: T.Buffer((hd,), "float32"),
        kcache: T.Buffer((KVH, max_ctx, hd), "float32"),
        vcache: T.Buffer((KVH, max_ctx, hd), "float32"),
        q_h: T.handle,
        start: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        qkv = T.match_buffer(qkv_h, (M, width), "float32")
        q = T.match_buffer(q_h, (M, H * hd), "float32")
        for i in loop(M):
            p = start + i
            factor = T.alloc_local((H + KVH,), "float32")  # each q, then k, head's 1/rms (read with a norm only)
            if norm:
                acc = T.alloc_local((dl,), "float32")
                for h in range(H + KVH):  # the q heads, then the k heads: contiguous in a qkv row
                    for v in T.vectorized(dl):
                        acc[v] = T.float32(0)
                    for j0 in range(hd // dl):
                        for v in T.vectorized(dl):
                            acc[v] = acc[v] + qkv[i, h * hd + j0 * dl + v] * qkv[i, h * hd + j0 * dl + v]
                    for v in T.unroll(1, dl):
                        acc[0] = acc[0] + acc[v]
                    factor[h] = compute.head_norm_scale(acc[0], hd, eps)
            if rope:
                for h, j0 in T.grid(H, half // hl):
                    for v in T.vectorized(hl):
                        q[i, h * hd + j0 * hl + v] = rope_low(
                            qk(qkv[i, h * hd + j0 * hl + v], factor[h], q_norm[j0 * hl + v]),
                            qk(qkv[i, h * hd + half + j0 * hl + v], factor[h], q_norm[half + j0 * hl + v]),
                            cos[p, j0 * hl + v], sin[p, j0 * hl + v])
                        q[i, h * hd + half + j0 * hl + v] = rope_high(
                            qk(qkv[i, h * hd + j0 * hl + v], factor[h], q_norm[j0 * hl + v]),
                            qk(qkv[i, h * hd + half + j0 * hl + v], factor[h], q_norm[half + j0 * hl + v]),
                            cos[p, j0 * hl + v], sin[p, j0 * hl + v])
                for h, j0 in T.grid(KVH, half // hl):
                    for v in T.vectorized(hl):
                        kcache[h, p, j0 * hl + v] = rope_low(
                            qk(qkv[i, K0 + h * hd + j0 * hl + v], factor[H + h], k_norm[j0 * hl + v]),
                            qk(qkv[i, K0 + h * hd + half + j0 * hl + v], factor[H + h], k_norm[half + j0 * hl + v]),
                            cos[p, j0 * hl + v], sin[p, j0 * hl + v])
                        kcache[h, p, half + j0 * hl + v] = rope_high(
                            qk(qkv[i, K0 + h * hd + j0 * hl + v], factor[H + h], k_norm[j0 * hl + v]),
                            qk(qkv[i, K0 + h * hd + half + j0 * hl + v], factor[H + h], k_norm[half + j0 * hl + v]),
                            cos[p, j0 * hl + v], sin[p, j0 * hl + v])
            else:
                for h, j0 in T.grid(H, hd // dl):
                    for v in T.vectorized(dl):
                        q[i, h * hd + j0 * dl + v] = qk(qkv[i, h * hd + j0 * dl + v], factor[h], q_norm[j0 * dl + v])
                for h, j0 in T.grid(KVH, hd // dl):
                    for v in T.vectorized(dl):
                        kcache[h, p, j0 * dl + v] = qk(qkv[i, K0 + h * hd + j0 * dl + v], factor[H + h],
                                                       k_norm[j0 * dl + v])
            for h, j0 in T.grid(KVH, hd // dl):
                for v in T.vectorized(dl):
                    vcache[h, p, j0 * dl + v] = qkv[i, V0 + h * hd + j0 * dl + v]

    # one kernel for every variant: the tables a variant never reads leave its signature
    kernel = drop_params(kernel, ([] if rope else ["cos", "sin"]) + ([] if norm else ["q_norm", "k_norm"]))
    return kernel.with_attr("global_symbol", name)


ATTENTION_BLOCK = 128  # keys scored at a time: the score buffer (512 bytes) stays on the stack, whatever the context


def attention(name, H, KVH, hd, max_ctx, scale, *, rows, softcap: float = 0.0, window: int = 0):
    """Causal grouped-query attention over the KV cache.

    Args: q[m, H*hd], kcache, vcache [KVH, max_ctx, hd], out[m, H*hd], start.
    Query head h reads kv head h // (H // KVH); row i (position p = start + i) attends keys
    lo .. p, lo = 0, or with a sliding `window` max(0, p - window + 1). One (head, row) pair per
    parallel iteration, heads outermost so each thread gets whole heads and the causal triangle
    stays balanced. Per pair, the keys from lo are taken ATTENTION_BLOCK at a time (an online softmax:
    neither the work nor the memory of a step depends on max_ctx, only on the keys it attends), per block:
      1. scores s[t] = scale * q . k_t (soft-capped: softcap * tanh(s / softcap), Gemma 2's), q.k as
         hd/8 vector FMAs and one horizontal sum;
      2. the block's max and exp/sum over s in whole vectors (s padded to a multiple of 8 with -inf); the
         running max, sum and output are rescaled by exp(old max - new max) (0 at the first block);
      3. out += sum_t p_t v_t, accumulated in hd/8 ymm registers, key loop outside.
    The output is divided by the sum at the end.
    """
    if H % KVH:
        raise ValueError("H must be a multiple of KVH")
    M = row_dim(rows)
    group = H // KVH
    dl = _lanes(hd)
    nd = hd // dl
    block = min(ATTENTION_BLOCK, (max_ctx + VEC - 1) // VEC * VEC)  # score buffer, whole vectors
    scale = float(scale)
    softcap, window = float(softcap), int(window)

    def capped(value):
        return compute.softcap_value(value, softcap, MATH) if softcap else value

    def first_key(n_keys):  # the first key a query attends to: its window's, or the first
        return T.max(n_keys - T.int64(window), T.int64(0)) if window else T.int64(0)

    @T.prim_func
    def kernel(
        q_h: T.handle,
        kcache: T.Buffer((KVH, max_ctx, hd), "float32"),
        vcache: T.Buffer((KVH, max_ctx, hd), "float32"),
        out_h: T.handle,
        start: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        q = T.match_buffer(q_h, (M, H * hd), "float32")
        out = T.match_buffer(out_h, (M, H * hd), "float32")
        for hi in T.parallel(H * M):
            h = hi // M
            i = hi % M
            g = h // group
            n_keys = start + i + 1
            lo = first_key(n_keys)
            s = T.alloc_local((block,), "float32")
            dot = T.alloc_local((dl,), "float32")
            red = T.alloc_local((VEC,), "float32")
            # running max, running sum, the block's max, the rescale factor, a sum
            stat = T.alloc_local((5,), "float32")
            o = T.alloc_local((hd,), "float32")
            for d0 in T.unroll(nd):
                for v in T.vectorized(dl):
                    o[d0 * dl + v] = T.float32(0)
            stat[0] = T.float32(compute.NEG_INF)
            stat[1] = T.float32(0)
            for b in range((n_keys - lo + block - 1) // block):
                base = lo + b * block
                count = T.min(n_keys - base, block)
                n_vec = (count + VEC - 1) // VEC
                # 1. scores
                for t in range(count):
                    for v in T.vectorized(dl):
                        dot[v] = T.float32(0)
                    for d0 in T.unroll(nd):
                        for v in T.vectorized(dl):
                            dot[v] = dot[v] + q[i, h * hd + d0 * dl + v] * kcache[g, base + t, d0 * dl + v]
                    stat[4] = dot[0]
                    for v in T.unroll(1, dl):
                        stat[4] = stat[4] + dot[v]
                    s[t] = capped(stat[4] * T.float32(scale))
                for t in range(count, n_vec * VEC):
                    s[t] = T.float32(compute.NEG_INF)
                # 2. the block's max, the new running max and the rescale of what came before
                for v in T.vectorized(VEC):
                    red[v] = T.float32(compute.NEG_INF)
                for tb in range(n_vec):
                    for v in T.vectorized(VEC):
                        red[v] = T.max(red[v], s[tb * VEC + v])
                stat[2] = red[0]
                for v in T.unroll(1, VEC):
                    stat[2] = T.max(stat[2], red[v])
                stat[2] = T.max(stat[2], stat[0])
                stat[3] = MATH.exp(stat[0] - stat[2])
                stat[0] = stat[2]
                # exp and sum (padding gives exp(-huge) ~ 1e-38, nothing next to the max's 1.0)
                for v in T.vectorized(VEC):
                    red[v] = T.float32(0)
                for tb in range(n_vec):
                    for v in T.vectorized(VEC):
                        s[tb * VEC + v] = MATH.exp(s[tb * VEC + v] - stat[0])
                        red[v] = red[v] + s[tb * VEC + v]
                stat[4] = red[0]
                for v in T.unroll(1, VEC):
                    stat[4] = stat[4] + red[v]
                stat[1] = stat[1] * stat[3] + stat[4]
                # 3. weighted sum of values
                for d0 in T.unroll(nd):
                    for v in T.vectorized(dl):
                        o[d0 * dl + v] = o[d0 * dl + v] * stat[3]
                for t in range(count):
                    for d0 in T.unroll(nd):
                        for v in T.vectorized(dl):
                            o[d0 * dl + v] = o[d0 * dl + v] + s[t] * vcache[g, base + t, d0 * dl + v]
            for d0 in T.unroll(nd):
                for v in T.vectorized(dl):
                    out[i, h * hd + d0 * dl + v] = o[d0 * dl + v] / stat[1]

    return kernel.with_attr("global_symbol", name)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def build(funcs, target, path):
    """Compile ``funcs`` into one module (one symbol per kernel) and export it as a .so."""
    mod = {}
    for f in funcs:
        symbol = str(f.attrs["global_symbol"])
        if symbol in mod:
            raise ValueError(f"duplicate kernel name {symbol!r}")
        mod[symbol] = f
    lib = tvm.compile(tvm.IRModule(mod), target=tvm.target.Target(target))
    lib.export_library(path)
