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

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from runtime.dtypes import INT4_OFFSET, QUANT_BLOCK, itemsize

from . import compute, quant
from .compute import clamp_count, clamp_index, drop_params, glu_unit, load_f32, prefetch, row_dim
from .cpu import MATH, _col_block, _lanes, _rowwise, gemm_nt

DOWN_CHUNK = 256  # columns per parallel chunk of sparse_down: 1 KiB contiguous per row and thread


def select(name, n, *, rows, magnitude: bool = False):
    """idx[0, :count] = the positions i with scores[0, i] > threshold[0] (with `magnitude`:
    |scores[0, i]| > threshold[0]), ascending.

    Args: scores[1, n], threshold[1], idx[1, n] int32, count[1, 1] int32. A serial compaction:
    n compares per layer part, negligible next to the rows it saves.

    rows=None (a batch step): scores[m, n], and the union is selected: i where any row's score passes.
    """
    if rows is None:
        return _select_any(name, n, magnitude)
    if rows != 1:
        raise ValueError("select runs in one-token steps only (decode: rows 1, batch: rows None)")

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


def _select_any(name, n, magnitude: bool):
    """select over scores[m, n]: the positions any of the m rows lets through."""
    m = row_dim(None)

    @T.prim_func
    def kernel(scores: T.Buffer((m, n), "float32"), threshold: T.Buffer((1,), "float32"),
               idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32")):
        T.func_attr({"tirx.noalias": True})
        found = T.alloc_local((1,), "int32")
        hit = T.alloc_local((1,), "int32")
        found[0] = 0
        for i in range(n):
            hit[0] = 0
            for r in range(m):
                if compute.passes_threshold(scores[r, i], threshold[0], magnitude):
                    hit[0] = 1
            if hit[0] == 1:
                idx[0, found[0]] = T.Cast("int32", i)
                found[0] = found[0] + 1
        count[0, 0] = found[0]

    return kernel.with_attr("global_symbol", name)


def sparse_up(name, D, n, *, rows, gated: bool, act: str, wdtype="float32"):
    """Gathered-row GEMV over the active neurons.

    Args: x[1, D], idx[1, n], count[1, 1], w[(2 if gated) n, D] (gate rows, then up rows),
    b[(2 if gated) n] (zeros for bias-free models), h[1, n]; w in ``wdtype`` (fp32 or fp16, math in fp32).
    Each active neuron's dot product runs
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
               w: T.Buffer((width, D), wdtype), b: T.Buffer((width,), "float32"), h: T.Buffer((1, n), "float32")):
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
                    acc[0, v] = acc[0, v] + load_f32(w[row, c * lanes + v], wdtype) * x[0, c * lanes + v]
                    if gated:
                        acc[1, v] = acc[1, v] + load_f32(w[n + row, c * lanes + v], wdtype) * x[0, c * lanes + v]
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


def sparse_down(name, n, D, *, rows, wdtype="float32"):
    """out[0, :] = sum over k < count of h[0, k] * w[idx[0, k], :].

    Args: h[1, n], idx[1, n], count[1, 1], w[n, D] (``wdtype``), out[1, D]. Columns are cut into chunks of
    DOWN_CHUNK run in parallel; each thread walks every active row but reads only its chunk, a
    contiguous segment, accumulating into its slice of out (which stays in L1).
    """
    if rows != 1:
        raise ValueError("sparse_down runs in decode only")
    chunk = DOWN_CHUNK if D % DOWN_CHUNK == 0 else D
    lanes = _lanes(chunk)

    @T.prim_func
    def kernel(h: T.Buffer((1, n), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((n, D), wdtype), out: T.Buffer((1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for c in T.parallel(D // chunk):
            for j in T.vectorized(chunk):
                out[0, c * chunk + j] = T.float32(0)
            for k in range(clamp_count(count[0, 0], n)):
                row = clamp_index(idx[0, k], n)
                for j0 in range(chunk // lanes):
                    for v in T.vectorized(lanes):
                        out[0, c * chunk + j0 * lanes + v] = (
                            out[0, c * chunk + j0 * lanes + v]
                            + h[0, k] * load_f32(w[row, c * chunk + j0 * lanes + v], wdtype)
                        )

    return kernel.with_attr("global_symbol", name)


FFN_TASKS = 8  # sparse_ffn: parallel tasks, each over an equal share of the active neurons
BATCH_TILE = 4  # sparse_ffn, batch steps: rows of x whose dot products with a weight row share one pass over it
DOT_CHAINS = 4  # sparse_ffn: independent ymm accumulators per dot product (FMA latency x throughput)
ROW_GROUP = 8
"""sparse_ffn's decode step over float rows reads this many neurons' rows in lockstep (a vector of each in turn,
an accumulator each) and prefetches nothing: each row is a sequential stream the L2 hardware prefetcher follows
on its own, and 8 streams at once keep far more lines in flight than one row's software prefetches can (those
hold an L1 fill buffer each until their line arrives: one core streamed gathered rows at ~7.5 GB/s with them,
the bound of 16 buffers at DRAM latency). Measured on a 2-core Intel Xeon (Sapphire Rapids class,
AVX-512; `benchmarks/bench_sparse_in_model.py --layers 8 --dense-ffn`, 2048 x 8192 fp32 layers on huge pages,
each call after its layer's attention GEMVs, alternated variants): at 10% and 20% of the rows selected the
rows of 1 row at a time with prefetches read at 0.69-0.76x the dense FFN GEMVs' GB/s (two threads), of 4 in
lockstep without prefetches 0.82-0.94x, of 8 0.87-1.03x (1.30-1.38x the one-row kernel's speed); one thread:
0.71-0.75, 0.89-0.97, 0.94-0.98. One row without prefetches: 0.63-0.66. In a whole 1B model (`run --profile`,
16 layers of 2048 x 8192, two threads) the fused sparse FFN then read at 21.3-22.0 GB/s against the dense build's
FFN GEMVs' 22.2-22.6 (0.94-0.99x; 0.54-0.86x with the one-row loop). Quantized rows keep the one-row loop with
prefetches: int4 rows (1,152 bytes) with integer dots in groups of 4, 8 or 16 ran 0.86-0.94x its speed (one
thread, the same benchmark) and slower with the rows in cache (their arithmetic, not DRAM, bounds them there).
Batch steps keep it too (their rows are read once for several rows of x: not measured grouped)."""
PREFETCH_ROWS = 1  # sparse_ffn (one row at a time): while a neuron's row is read, the row of the neuron this many places later is prefetched
PREFETCH_LOCALITY = 2
"""sparse_ffn's prefetches go to L2 (prefetcht1), not L1 (prefetcht0): a row of 8 KiB is 128 lines in flight,
far more than L1's miss buffers hold, and L1-bound prefetches queue behind each other (and behind the demand
loads of the row being read). Measured on a 2-core Zen 4 (benchmarks/bench_sparse_in_model.py, 6 layers
of 2048x8192, each call after its layer's attention GEMVs, alternated variants): rows read at 1.9-2.0x the
bandwidth of locality 3 (one thread: 16.1 against 8.2 GB/s at 10% selected, 17.6 against 8.8 at 20%; two: 15.2
against 7.7 at 10%, medians), faster per byte than the dense panel GEMVs of the same layers (1.1-1.2x);
prefetching 2 or 4 rows ahead instead of 1 changed nothing measurable, nor locality 1 against 2. sparse_columns
(threshold mode) too: 1.1-1.3x (gated up 2048x16384 at 30-50% of the inputs kept, between attention GEMVs over
5 layers, one and two threads)."""


def _row_lines(width: int, lanes: int, wdtype: str) -> tuple[int, int, int]:
    """How a kernel walks a weight row of `width` elements in cache lines (to prefetch one line per line it
    consumes): (elements per line, vectors per line, lines per row). Odd widths go per vector instead (more
    prefetch instructions, the same lines)."""
    line = min(64 // (2 if wdtype == "float16" else 4), width)
    if width % line or line % lanes:
        line = lanes
    return line, line // lanes, width // line


@dataclass(frozen=True)
class RowFormat:
    """How the gathered-row kernels read a weight row of D elements: as `block`s of `block / lanes` vectors.

    A float row (fp32, fp16) is read a vector at a time and has no scales: a block is one vector. A block-
    quantized row (rows layout, `passes.kernels.quant`) is read a quantization block at a time: two vectors of
    16 lanes (the low and the high nibbles of 16 bytes, for int4), summed, then scaled once; its scales are
    first converted into a row of fp32 factors (`rs`, in the kernel), one vector operation per 16 blocks instead
    of a conversion per block. The kernel's loops (`_sparse_ffn`) are the same for every format; these methods
    are the expressions and sizes that differ."""

    storage: str  # the element type of the weight buffer (int4: uint8, two weights a byte)
    lanes: int
    bits: int = 0  # 0: a float format
    sdtype: str = "float32"  # the scales' element type (quantized formats only)
    has_min: bool = False  # int4a: each block's scale and min side by side in the scales buffer (x = d q + m)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def per_block(self) -> int:
        """Elements of the scales buffer per block: a scale (and a min)."""
        return 2 if self.has_min else 1

    @property
    def offset(self) -> int:
        """What a stored value exceeds the weight by (int4's + 8): taken off per block or per row, not per weight."""
        return INT4_OFFSET if self.bits == 4 and not self.has_min else 0

    @property
    def block(self) -> int:
        return QUANT_BLOCK if self.quantized else self.lanes

    @property
    def vectors(self) -> int:
        return self.block // self.lanes

    def stored(self, elements):
        """Buffer elements holding `elements` weights (an int or a TIR expression)."""
        return elements // 2 if self.bits == 4 else elements

    @property
    def block_bytes(self) -> int:
        return QUANT_BLOCK * self.bits // 8 if self.quantized else self.lanes * itemsize(self.storage)

    def line_blocks(self, blocks: int) -> int:
        """Blocks per 64-byte line of the stored row (1 where lines do not tile the row: a prefetch per block)."""
        per = 64 // self.block_bytes
        return per if per and blocks % per == 0 else 1

    def scale_lines(self, D: int) -> int:
        """Cache lines of one row's scales (0 for a float row): prefetched up front, they are a few lines."""
        return -(-(D // QUANT_BLOCK) * self.per_block * itemsize(self.sdtype) // 64) if self.quantized else 0

    def row_bytes(self, D: int) -> int:
        """Bytes of one stored row, its scales included."""
        scales = D // QUANT_BLOCK * self.per_block * itemsize(self.sdtype) if self.quantized else 0
        return self.stored(D) * itemsize(self.storage) + scales

    def weight(self, w, row, blk, u, v):
        """Element v of vector u of block blk of row `row`, as fp32, unscaled (int4: + 8, see `offset`)."""
        if not self.quantized:
            return load_f32(w[row, blk * self.block + u * self.lanes + v], self.storage)
        return compute.quant_value(w, row, blk, u, v, self.bits, centred=False)

    def coefficient(self, a, rs, blk):
        """An axpy's factor for block blk: a for a float row; rs[blk] (a times the block's scale, made per row)
        for a quantized one."""
        return rs[blk] if self.quantized else a

    def block_dot(self, x, w, rs, row, blk, v, r=0):
        """Lane v of block blk's share of w[row] . x[r]: a float row's vector FMA term; a quantized row's vector
        products summed, then scaled once."""
        if not self.quantized:
            return self.weight(w, row, blk, 0, v) * x[r, blk * self.block + v]
        total = x[r, blk * self.block + v] * self.weight(w, row, blk, 0, v)
        for u in range(1, self.vectors):
            total = total + x[r, blk * self.block + u * self.lanes + v] * self.weight(w, row, blk, u, v)
        return total * rs[blk]


QUANT_LANES = QUANT_BLOCK // 2  # a quantized row's vectors: half a block, one nibble of 16 int4 bytes


def float_rows(D: int, wdtype: str) -> RowFormat:
    return RowFormat(wdtype, _lanes(D))


QUANT_PREFETCH_BYTES = 4096
"""sparse_ffn_q prefetches the rows of the neuron this many bytes of rows later (int4 at D = 2048: 4 rows of
1,152 bytes; int8: 2 of 2,176) instead of one row: a short row prefetched one ahead arrives late. Measured
on a 2-core Zen 4 (benchmarks/bench_sparse_in_model.py, 6 layers of 2048 x 8192 between attention GEMVs, one thread,
medians of 4-5 rounds): int4 1, 2, 4, 8 rows ahead 0.31, 0.29, 0.26, 0.26 ms a call at 10% selected, int8 1 and
2 rows 0.32, 0.27 ms; prefetcht0 (locality 3) was slower (0.32 ms at 4 rows)."""


def quant_prefetch_rows(D: int, bits: int, sdtype: str = "float16", has_min: bool = False) -> int:
    """Rows ahead for QUANT_PREFETCH_BYTES, at most 8 (no more was measured to help)."""
    return min(8, max(1, -(-QUANT_PREFETCH_BYTES // quant_rows(D, bits, sdtype, has_min).row_bytes(D))))


def quant_rows(D: int, bits: int, sdtype: str = "float16", has_min: bool = False) -> RowFormat:
    compute.quant_width(D, bits)  # (refuses a row that is not whole blocks)
    if has_min and bits != 4:
        raise ValueError("blocks with minimums (int4a) are 4-bit")
    return RowFormat(compute.quant_storage(bits), QUANT_LANES, bits, sdtype, has_min)


def sparse_ffn(name, D, n, *, rows, gated: bool, act: str, wdtype="float32", prefetch_rows: int | None = None,
               prefetch_locality: int | None = None, max_batch: int = 1, row_group: int | None = None):
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
    predictor let through but whose ReLU output is 0 costs one row, not two or three. A decode step reads
    ROW_GROUP neurons' rows in lockstep, so that the hardware prefetcher streams that many rows at once
    (see ROW_GROUP); a batch step reads a row at a time and, knowing which row comes next, prefetches it
    (`prefetch_rows` ahead, at `prefetch_locality`). `row_group`: the decode step's rows in lockstep (None:
    ROW_GROUP; 1: a row at a time with prefetches, as a batch step's).

    rows=None (a batch step of m <= `max_batch` sequences): x[m, D], h[m, n], out[m, D], the selection the union
    of the rows' (select's), scratch[FFN_TASKS, max_batch * D] (a row per task and sequence; decode's kernel
    takes the same buffer and uses its first D columns). Each selected neuron's rows are read once for all m
    rows: its first row's dot product with every row of x (the row is in L1 after the first), listed if any
    row fired; then, per row whose value is not 0, the other rows' work into that row's scratch.
    """
    if rows not in (1, None):
        raise ValueError("sparse_ffn runs in one-token steps only (decode: rows 1, batch: rows None)")
    kernel = _sparse_ffn(D, n, float_rows(D, wdtype), gated=gated, act=act, prefetch_rows=prefetch_rows,
                         prefetch_locality=prefetch_locality, rows=rows, max_batch=max_batch,
                         row_group=(ROW_GROUP if row_group is None else row_group) if rows == 1 else 1)
    return drop_params(kernel, ["w_up_s", "w_down_s"]).with_attr("global_symbol", name)


def int8_dot_fits(D: int, bits: int, dot: str, tile_panels: int) -> bool:
    """Whether sparse_ffn_q takes `dot` over rows of D weights on that register budget (its ValueErrors' rule)."""
    lanes = 16 if tile_panels > 1 else 8
    row_bytes = D // 2 if bits == 4 else D
    return (bits == 4 or dot == "vnni") and (dot, lanes) in quant.DOTS and row_bytes % (4 * lanes) == 0


def sparse_ffn_q(name, D, n, *, rows, gated: bool, act: str, bits: int, sdtype="float16",
                 prefetch_rows: int | None = None, prefetch_locality: int | None = None,
                 int8_dot: str | None = None, tile_panels: int = 1, max_batch: int = 1, has_min: bool = False):
    """`sparse_ffn` over block-quantized rows (int8 or int4 by `bits`, the rows layout of
    `passes.kernels.quant`, scales in `sdtype`; int4a's scales and mins side by side, [rows, 2 D / 32], with
    `has_min`: a dot product adds sum over blocks of m * x's block sum, an axpy a * m over each block).

    Args: x[1, D], idx[1, n], count[1, 1], w_up_q[(2 if gated) n, D or D/2], w_up_s[(2 if gated) n, D/32],
    b_up[(2 if gated) n], w_down_q[n, D or D/2], w_down_s[n, D/32], h[1, n], fired[1, n] int32,
    scratch[FFN_TASKS, D], out[1, D]. A dot product accumulates x * q over a block in fp32 and multiplies by
    the block's scale once; the down axpy adds (h * scale) * q. An int4 row is D/2 bytes and D/32 scales:
    fewer lines to read and prefetch than an fp16 row's 2 D bytes, so more rows are prefetched ahead
    (QUANT_PREFETCH_BYTES) unless `prefetch_rows` says otherwise.

    The arithmetic, not the bytes, bounds an int4 row: per 32 weights a widening, a mask and a shift, two
    conversions and three FMAs. Measured on a 2.6 GHz EPYC VM (AVX-512, one thread, rows in L2, D = 2048):
    a row's dot product took 119 ns in int4, 96 in int8, 103 in fp16, 108 in fp32 (whose bound is the FMA
    chains' latency); between attention GEMVs over 6 layers, one thread, 10% selected: 0.30 ms a call in int4,
    0.29 int8, 0.43 fp16, 0.69 fp32 (4.9, 9.3, 11.7, 14.7 GB/s of rows and scales read).

    `int8_dot` ("madd": AVX-512BW zmm or AVX2 ymm; "vnni": AVX512-VNNI, zmm; None: the fp32 path above) takes
    the up rows' dot products (the first row and, gated, the second) as integer dot products instead: x is
    quantized to int8 per 32-block once per call (quant.x_quantizer, as gemv_panels_q4x8; an error of ~1e-2 of
    the products' magnitude), each row's bytes dotted with it into int32 (quant.dot_u8s8, dot2_u8s8) and scaled
    by x's block scale times the row's, in fp32. The down axpy stays fp32. int4 with either dot; int8 with "vnni"
    only (vpmaddubsw's unsigned operand would have to be |q| and q = -128 occurs: no cheap madd form). `tile_panels`
    is the ISA's register budget as for quant.linear_panels_q (1: AVX2, ymm dots; 2: AVX-512, zmm). D must be
    whole vectors of the row's bytes (int4 zmm: a multiple of 128; ymm 64; int8 zmm 64).
    Measured on a Zen 4 (benchmarks/bench_sparse_in_model.py, relu 2048 x 8192, int4, medians): with one
    layer's rows cached ("alone") 1.4-1.8x the fp32 path's rate ("vnni" 0.17 against 0.26 ms a call at 10%);
    between attention GEMVs over 6 layers only 1.1-1.2x (0.27 against 0.30 ms, one thread), not bound by
    the arithmetic there (8 rows prefetched ahead instead of 4 changed nothing).

    rows=None: a batch step, as `sparse_ffn`'s (fp32 dot products: not with `int8_dot`).
    """
    if rows not in (1, None):
        raise ValueError("sparse_ffn_q runs in one-token steps only (decode: rows 1, batch: rows None)")
    if prefetch_rows is None:
        prefetch_rows = quant_prefetch_rows(D, bits, sdtype, has_min)
    kernel = _sparse_ffn(D, n, quant_rows(D, bits, sdtype, has_min), gated=gated, act=act, prefetch_rows=prefetch_rows,
                         prefetch_locality=prefetch_locality, int8_dot=int8_dot,
                         dot_lanes=16 if tile_panels > 1 else 8, rows=rows, max_batch=max_batch)
    return kernel.with_attr("global_symbol", name)


def _sparse_ffn(D, n, fmt: RowFormat, *, gated: bool, act: str, prefetch_rows: int | None,
                prefetch_locality: int | None, int8_dot: str | None = None, dot_lanes: int = 16, rows=1,
                max_batch: int = 1, row_group: int = 1):
    """sparse_ffn's kernel over rows read as `fmt` says, with a scales buffer after each weight (w_up_s,
    w_down_s; the float formats' are placeholders the caller drops).

    A quantized row's scales become fp32 factors first (rs: the scales for a dot product, h * scales for an
    axpy). int4's offset (values stored + 8) is taken out once per row, not per weight: a dot product subtracts
    8 * sum over blocks of rs[b] * xs[b] (xs[b]: block b's sum of x, once per call), an axpy adds 8 * rs[b]
    into off[b], which each task subtracts from its scratch row at the end. int4a's mins take the same two
    roads: a dot product adds sum over blocks of m[b] * xs[b] (the mins ride in rs after the scales), an axpy
    adds a * m[b] into off[b], which each task adds to its scratch row at the end.

    With `int8_dot` (sparse_ffn_q's), the up rows' dot products are integer: see row_dot8.

    `row_group` > 1 (decode over float rows only): that many neurons' rows are read in lockstep, without
    software prefetches (see ROW_GROUP); 1: a row at a time, prefetching the next.

    `rows` 1 (decode) or None (a batch step: m rows of x, h and out, m <= `max_batch`); the loops over the rows
    (`for r in range(m)`) have one trip in decode. The scratch holds `max_batch` rows of D per task."""
    m = row_dim(rows)
    if rows is None and int8_dot is not None:
        raise ValueError("a batch step's sparse_ffn_q takes fp32 dot products: int8_dot is decode-only")
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    batch_rows = max_batch if rows is None else 1  # rows of x-derived local state (int4's block sums, offsets)
    batch = rows is None  # (TVMScript branches on Python bools only)
    tile = min(BATCH_TILE, max_batch) if batch else 0
    actf = compute.activation(act, MATH)
    relu = act == "relu"
    lanes, vectors, block = fmt.lanes, fmt.vectors, fmt.block
    int4 = fmt.bits == 4
    blocks = D // block
    chains = DOT_CHAINS if blocks % DOT_CHAINS == 0 else 1
    steps = blocks // chains
    line_blocks = fmt.line_blocks(blocks)
    per_step = max(1, chains // line_blocks)  # prefetches per dot-product step
    lines = blocks // line_blocks
    stored = fmt.stored(D)
    last_stored = stored - 1
    sblocks = D // QUANT_BLOCK if fmt.quantized else 1
    scale_lines = fmt.scale_lines(D)
    per_scale_line = 64 // itemsize(fmt.sdtype)
    per = fmt.per_block  # scales-buffer elements per block (int4a: the scale, then the min)
    offset = fmt.offset
    has_offset = offset > 0  # (TVMScript branches on Python bools only)
    has_min = fmt.has_min
    offsets = has_offset or has_min  # per-block terms of x's block sums (dots) and of a's (axpys)
    off_factor = T.float32(-offset if has_offset else 1)  # what a task's scratch takes of off[b] at its end
    slanes = lanes if sblocks % lanes == 0 else 1  # the offset sums over blocks: in acc's vectors when they tile
    half = QUANT_BLOCK // 2
    factors = sblocks * per if fmt.quantized else 0  # (empty buffers cost nothing: a float kernel allocates none)
    sums = sblocks if offsets else 0
    row_sums = sums * batch_rows
    width = 2 * n if gated else n
    tasks = FFN_TASKS
    ahead = PREFETCH_ROWS if prefetch_rows is None else prefetch_rows
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality
    q8 = int8_dot is not None  # (TVMScript branches on Python bools only)
    group = row_group
    grouped = group > 1
    if grouped and (batch or fmt.quantized):
        raise ValueError("rows in lockstep (row_group > 1) take decode steps over float rows")
    gsize = group if grouped else 0  # (the grouped loops' local buffers; empty where they do not run)
    if q8:
        # A dot vector is `dot_lanes` int32 lanes, 4 row bytes each: nbytes bytes of the stored row, qblocks
        # whole blocks (int4: 16 bytes of nibbles a block; int8: 32), `block_lanes` lanes per block.
        quant.check_dot(int8_dot, dot_lanes)
        if not fmt.quantized or (fmt.bits == 8 and int8_dot != "vnni"):
            raise ValueError(f"int8_dot={int8_dot!r} takes int4 rows, or int8 rows with 'vnni'")
        L, nbytes = dot_lanes, 4 * dot_lanes
        if stored % nbytes:
            raise ValueError(f"int8_dot over {dot_lanes} lanes needs rows of whole {nbytes}-byte vectors, D = {D}")
        qblocks = nbytes // fmt.block_bytes
        block_lanes = L // qblocks
        qvectors = stored // nbytes
        qchains = next(c for c in (4, 2, 1) if qvectors % c == 0)  # independent accumulators (cvt + FMA latency)
        qsteps = qvectors // qchains
        qprefetch = max(1, qchains * nbytes // 64)  # lines of the next row per step
        stored_offset = offset if int4 else 128  # int8: q ^ 0x80 = q + 128, the unsigned operand
        xpats = 2 if int4 else 1
        m15, m4 = T.broadcast(T.uint8(15), nbytes), T.broadcast(T.uint8(4), nbytes)
        flip = T.broadcast(T.uint8(128), nbytes)
        spread = [tirx.IntImm("int32", lane // block_lanes) for lane in range(L)]  # lane -> its block in the vector
        quantize_x = quant.x_quantizer(D)

    @T.macro
    def prefetch_scales(ws_next, next_row):
        """The scales of the row to come, all of them up front (a few lines; a float row has none)."""
        if fmt.quantized:
            for q in T.unroll(scale_lines):
                prefetch(T.address_of(ws_next[next_row, T.min(q * per_scale_line, sblocks * per - 1)]), locality)

    @T.macro
    def dot_scales(rs, ws, row, ws_next, next_row):
        """Before a dot product with w[row]: the next row's scales prefetched, this row's as fp32 factors in rs."""
        prefetch_scales(ws_next, next_row)
        if fmt.quantized:
            for b in T.vectorized(sblocks):
                rs[b] = load_f32(ws[row, b * per], fmt.sdtype)
            if has_min:
                for b in T.vectorized(sblocks):
                    rs[sblocks + b] = load_f32(ws[row, b * per + 1], fmt.sdtype)

    @T.macro
    def take_offset(acc, a, rs, xs, r):
        """int4: acc[a] minus the stored offset's share of a dot product with x[r] (8 * sum over blocks of
        rs[b] * x[r]'s block sums), in acc's lanes; int4a: plus the mins' (sum over blocks of m[b] * the sums)."""
        if has_offset:
            for b in range(sblocks // slanes):
                for v in T.vectorized(slanes):
                    acc[a, v] = acc[a, v] - T.float32(offset) * rs[b * slanes + v] * xs[r * sblocks + b * slanes + v]
        if has_min:
            for b in range(sblocks // slanes):
                for v in T.vectorized(slanes):
                    acc[a, v] = acc[a, v] + rs[sblocks + b * slanes + v] * xs[r * sblocks + b * slanes + v]

    @T.macro
    def block_sums(xs, x, r):
        """xs[r, b] = the sum of x[r] over block b (int4's offset term, int4a's mins'), two half-block vectors and
        a horizontal sum (xs is flat: row r's sums start at r * sblocks)."""
        if offsets:
            for b in range(sblocks):
                part = T.alloc_local((half,), "float32")
                for v in T.vectorized(half):
                    part[v] = x[r, b * QUANT_BLOCK + v] + x[r, b * QUANT_BLOCK + half + v]
                xs[r * sblocks + b] = part[0]
                for v in T.unroll(1, half):
                    xs[r * sblocks + b] = xs[r * sblocks + b] + part[v]

    @T.macro
    def sum_chains(acc, count, width, dot, slot):
        """dot[slot] = the sum of acc's first `count` rows of `width` lanes: the chains, then the lanes."""
        for c in T.unroll(1, count):
            for v in T.vectorized(width):
                acc[0, v] = acc[0, v] + acc[c, v]
        dot[slot] = acc[0, 0]
        for v in T.unroll(1, width):
            dot[slot] = dot[slot] + acc[0, v]

    @T.macro
    def row_dot(acc, dot, rs, xs, x, r, w, ws, row, slot, w_next, ws_next, next_row):
        """dot[slot] = w[row] . x[r] in `chains` vector accumulators (a block each per step) and one horizontal
        sum, prefetching the row w_next[next_row] line by line as it goes (spread out, so the prefetches overlap
        the FMAs instead of queueing up in front of them)."""
        dot_scales(rs, ws, row, ws_next, next_row)
        for c in T.unroll(chains):
            for v in T.vectorized(lanes):
                acc[c, v] = T.float32(0)
        for s in range(steps):
            for q in T.unroll(per_step):
                prefetch(T.address_of(w_next[next_row, T.min(fmt.stored((s * chains + q * line_blocks) * block),
                                                              last_stored)]), locality)
            for c in T.unroll(chains):
                for v in T.vectorized(lanes):
                    acc[c, v] = acc[c, v] + fmt.block_dot(x, w, rs, row, s * chains + c, v, r)
        take_offset(acc, 0, rs, xs, r)
        sum_chains(acc, chains, lanes, dot, slot)

    @T.macro
    def tile_dot(tacc, dots, rs, xs, x, r0, w, ws, row, w_next, ws_next, next_row):
        """A batch step's dots[u] = w[row] . x[r0 + u] for the `tile` rows from r0 (rows past the last repeat
        it: their dots are not used), in one pass over the row: each of its vectors loaded once for all of
        them, an accumulator per row (the rows' chains hide the FMA latency), prefetching w_next[next_row]."""
        dot_scales(rs, ws, row, ws_next, next_row)
        for u in T.unroll(tile):
            for v in T.vectorized(lanes):
                tacc[u, v] = T.float32(0)
        for s in range(lines):
            prefetch(T.address_of(w_next[next_row, T.min(fmt.stored(s * line_blocks * block), last_stored)]),
                      locality)
            for b in T.unroll(line_blocks):
                for u in T.unroll(tile):
                    for v in T.vectorized(lanes):
                        tacc[u, v] = tacc[u, v] + fmt.block_dot(x, w, rs, row, s * line_blocks + b, v,
                                                                T.min(r0 + u, m - 1))
        for u in T.unroll(tile):
            take_offset(tacc, u, rs, xs, T.min(r0 + u, m - 1))
            dots[u] = tacc[u, 0]
            for v in T.unroll(1, lanes):
                dots[u] = dots[u] + tacc[u, v]

    @T.macro
    def row_dot8(qacc, part, dot, rs, sx, xpat, xc, w, ws, row, slot, w_next, ws_next, next_row):
        """row_dot with int8_dot: per vector of nbytes row bytes, part = xc (the stored offset's -offset * the
        block sums of xq, in one lane per block) + the u8 x s8 dot products with xq laid out as the row
        (xpat: int4 one pattern per nibble), exact in int32; then qacc += float(part) * (ws * sx) lane by
        lane (rs, made per row, spread over each block's lanes), in `qchains` fp32 accumulators."""
        prefetch_scales(ws_next, next_row)
        for b in T.vectorized(sblocks):
            rs[b] = load_f32(ws[row, b * per], fmt.sdtype) * sx[b]
        for c in T.unroll(qchains):
            for v in T.vectorized(L):
                qacc[c, v] = T.float32(0)
        for s in range(qsteps):
            for q in T.unroll(qprefetch):
                prefetch(T.address_of(w_next[next_row, T.min((s * qchains * nbytes + q * 64), last_stored)]),
                          locality)
            for c in T.unroll(qchains):
                part[c, T.ramp(0, 1, L)] = xc[s * qchains + c, T.ramp(0, 1, L)]
                if int4:
                    part[c, T.ramp(0, 1, L)] = quant.dot2_u8s8(  # both nibbles: the same blocks' lanes
                        int8_dot, L, part[c, T.ramp(0, 1, L)],
                        w[row, T.ramp((s * qchains + c) * nbytes, 1, nbytes)] & m15,
                        xpat[0, T.ramp((s * qchains + c) * nbytes, 1, nbytes)],
                        w[row, T.ramp((s * qchains + c) * nbytes, 1, nbytes)] >> m4,
                        xpat[1, T.ramp((s * qchains + c) * nbytes, 1, nbytes)])
                else:
                    part[c, T.ramp(0, 1, L)] = quant.dot_u8s8(
                        int8_dot, L, part[c, T.ramp(0, 1, L)],
                        T.Cast(f"uint8x{nbytes}", w[row, T.ramp((s * qchains + c) * nbytes, 1, nbytes)]) ^ flip,
                        xpat[0, T.ramp((s * qchains + c) * nbytes, 1, nbytes)])
                if qblocks == 1:
                    qacc[c, T.ramp(0, 1, L)] = qacc[c, T.ramp(0, 1, L)] + T.Cast(
                        f"float32x{L}", part[c, T.ramp(0, 1, L)]) * T.broadcast(rs[s * qchains + c], L)
                else:
                    qacc[c, T.ramp(0, 1, L)] = qacc[c, T.ramp(0, 1, L)] + T.Cast(
                        f"float32x{L}", part[c, T.ramp(0, 1, L)]) * T.Shuffle(
                        [rs[T.ramp((s * qchains + c) * qblocks, 1, qblocks)]] * block_lanes, spread)  # (a shuffle
                    # has no more lanes than its operands: the copies only make up the width)
        sum_chains(qacc, qchains, L, dot, slot)
        if has_min:  # sum over blocks of m * x's block sum as quantized (sx[sblocks + b], made per call)
            for b in range(sblocks):
                dot[slot] = dot[slot] + load_f32(ws[row, b * per + 1], fmt.sdtype) * sx[sblocks + b]

    @T.macro
    def axpy_block(y, t, col, a, rs, w, row, blk):
        """y[t, col + block blk] += the block's coefficient * w's block. int4: the 16 bytes are widened once, into
        `wide`, and both nibbles cut from it (separate loads of the two halves compile to byte-wide masks and
        two widenings, as in an 8-bit lane there is no shift)."""
        if int4:
            wide = T.alloc_local((lanes,), "int32")
            for v in T.vectorized(lanes):
                wide[v] = compute.int4_byte(w, row, blk, v)
            for u in T.unroll(2):
                for v in T.vectorized(lanes):
                    y[t, col + blk * block + u * lanes + v] = (y[t, col + blk * block + u * lanes + v]
                                                               + rs[blk] * compute.int4_nibble(wide[v], u))
        else:
            for u in T.unroll(vectors):
                for v in T.vectorized(lanes):
                    y[t, col + blk * block + u * lanes + v] = (
                        y[t, col + blk * block + u * lanes + v]
                        + fmt.coefficient(a, rs, blk) * fmt.weight(w, row, blk, u, v))

    @T.macro
    def row_axpy(y, t, r, a, rs, off, w, ws, row, w_next, ws_next, next_row):
        """y[t, row r's D columns] += a * w[row] (a quantized block: (a * scale) * q), prefetching
        w_next[next_row] a line per line consumed (off is flat too: row r's offsets start at r * sblocks)."""
        prefetch_scales(ws_next, next_row)
        if fmt.quantized:
            for b in T.vectorized(sblocks):
                rs[b] = a * load_f32(ws[row, b * per], fmt.sdtype)
                if has_offset:
                    off[r * sblocks + b] = off[r * sblocks + b] + rs[b]
                if has_min:
                    off[r * sblocks + b] = off[r * sblocks + b] + a * load_f32(ws[row, b * per + 1], fmt.sdtype)
        for s in range(lines):
            prefetch(T.address_of(w_next[next_row, T.min(fmt.stored(s * line_blocks * block), last_stored)]),
                      locality)
            for b in T.unroll(line_blocks):
                axpy_block(y, t, r * D, a, rs, w, row, s * line_blocks + b)

    @T.macro
    def group_dot(gacc, gdots, x, w, rows, base):
        """gdots[q] = w[base + rows[q]] . x[0] for the `group` rows (float), read in lockstep: a vector of each
        row in turn, an accumulator per row (the rows are the independent FMA chains), no software prefetch."""
        for q in T.unroll(group):
            for v in T.vectorized(lanes):
                gacc[q, v] = T.float32(0)
        for b in range(blocks):
            for q in T.unroll(group):
                for v in T.vectorized(lanes):
                    gacc[q, v] = gacc[q, v] + fmt.weight(w, base + rows[q], b, 0, v) * x[0, b * lanes + v]
        for q in T.unroll(group):
            gdots[q] = gacc[q, 0]
            for v in T.unroll(1, lanes):
                gdots[q] = gdots[q] + gacc[q, v]

    @T.macro
    def group_axpy(y, t, coefs, w, rows):
        """y[t] += the sum over the group of coefs[q] * w[rows[q]] (float), the rows read in lockstep: one load
        and store of y's vector for all of them."""
        for b in range(blocks):
            for q in T.unroll(group):
                for v in T.vectorized(lanes):
                    y[t, b * lanes + v] = y[t, b * lanes + v] + coefs[q] * fmt.weight(w, rows[q], b, 0, v)

    @T.prim_func
    def kernel(x: T.Buffer((m, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w_up: T.Buffer((width, stored), fmt.storage), w_up_s: T.Buffer((width, sblocks * per), fmt.sdtype),
               b_up: T.Buffer((width,), "float32"), w_down: T.Buffer((n, stored), fmt.storage),
               w_down_s: T.Buffer((n, sblocks * per), fmt.sdtype), h: T.Buffer((m, n), "float32"),
               fired: T.Buffer((1, n), "int32"), scratch: T.Buffer((tasks, max_batch * D), "float32"),
               out: T.Buffer((m, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        if q8:  # x quantized once per call, and laid out as the rows' bytes
            xq = T.alloc_buffer((D,), "int8")
            sx = T.alloc_buffer((sblocks * per,), "float32")  # x's block scales (int4a: then its block sums)
            xsum = T.alloc_buffer((sblocks,), "int32")
            xpat = T.alloc_buffer((xpats, stored), "int8")
            xc = T.alloc_buffer((qvectors, L), "int32")
            quantize_x(x, 0, xq, sx, xsum, 0)
            if has_min:
                for b in range(sblocks):
                    sx[sblocks + b] = sx[b] * T.Cast("float32", xsum[b])
            for b in range(sblocks):
                for i in T.vectorized(stored // sblocks):
                    if int4:  # byte 16 b + i of a row: element 32 b + i (low nibble), 32 b + 16 + i (high)
                        xpat[0, b * half + i] = xq[b * QUANT_BLOCK + i]
                        xpat[1, b * half + i] = xq[b * QUANT_BLOCK + half + i]
                    else:
                        xpat[0, b * QUANT_BLOCK + i] = xq[b * QUANT_BLOCK + i]
            for o in range(qvectors):
                for v in range(L):
                    xc[o, v] = T.if_then_else(v % block_lanes == 0, -stored_offset * xsum[o * qblocks + v // block_lanes], 0)
        for t in T.parallel(tasks):
            first = clamp_count(count[0, 0], n) * t // tasks
            last = clamp_count(count[0, 0], n) * (t + 1) // tasks
            acc = T.alloc_local((chains, lanes), "float32")
            dot = T.alloc_local((2,), "float32")
            listed = T.alloc_local((1,), "int32")
            any_fired = T.alloc_local((1,), "int32")
            tacc = T.alloc_local((tile, lanes), "float32")  # batch: tile_dot's accumulators and dots
            dots = T.alloc_local((tile,), "float32")
            rs = T.alloc_local((factors,), "float32")  # a quantized row's fp32 scale factors
            xs = T.alloc_local((row_sums,), "float32")  # int4: each row of x's block sums
            off = T.alloc_local((row_sums,), "float32")  # int4: the offsets the axpys added, per row and block
            if q8:
                qacc = T.alloc_local((qchains, L), "float32")
                part = T.alloc_local((qchains, L), "int32")
            gacc = T.alloc_local((gsize, lanes), "float32")  # grouped: an accumulator per row, the dots, the
            gdots = T.alloc_local((gsize,), "float32")  # rows (a group's tail repeats its last row), the axpys'
            grows = T.alloc_local((gsize,), "int32")  # coefficients (0 for a tail's repeats)
            coefs = T.alloc_local((gsize,), "float32")
            listed[0] = first
            if not q8:
                for r in range(m):
                    block_sums(xs, x, r)
            # 1. the first row of every selected neuron, against every row of x; list the ones that fired in any
            if not grouped:
                for k in range(first, last):
                    row = clamp_index(idx[0, k], n)
                    any_fired[0] = 0
                    if batch:  # the rows of x a tile at a time, the weight row read once per tile
                        for r0 in range((m + tile - 1) // tile):
                            tile_dot(tacc, dots, rs, xs, x, r0 * tile, w_up, w_up_s, row, w_up, w_up_s,
                                     clamp_index(idx[0, T.min(k + ahead, last - 1)], n))
                            for u in range(T.min(tile, m - r0 * tile)):
                                dots[u] = actf(dots[u] + b_up[row])
                                h[r0 * tile + u, k] = dots[u]
                                if not relu or dots[u] != T.float32(0):
                                    any_fired[0] = 1
                    if not batch:
                        for r in range(m):
                            if q8:
                                row_dot8(qacc, part, dot, rs, sx, xpat, xc, w_up, w_up_s, row, 0, w_up, w_up_s,
                                         clamp_index(idx[0, T.min(k + ahead, last - 1)], n))
                            else:
                                row_dot(acc, dot, rs, xs, x, r, w_up, w_up_s, row, 0, w_up, w_up_s,
                                        clamp_index(idx[0, T.min(k + ahead, last - 1)], n))  # (a named one: a workspace)
                            dot[0] = actf(dot[0] + b_up[row])
                            h[r, k] = dot[0]
                            if not relu or dot[0] != T.float32(0):
                                any_fired[0] = 1
                    if any_fired[0] == 1:
                        fired[0, listed[0]] = k
                        listed[0] = listed[0] + 1
            if grouped:  # (decode over float rows: `group` neurons at a time, see ROW_GROUP)
                for g in range((last - first + group - 1) // group):
                    start = first + g * group  # the group's first neuron
                    for q in T.unroll(group):
                        grows[q] = clamp_index(idx[0, T.min(start + q, last - 1)], n)
                    group_dot(gacc, gdots, x, w_up, grows, 0)
                    for q in range(T.min(group, last - start)):
                        dot[0] = actf(gdots[q] + b_up[grows[q]])
                        h[0, start + q] = dot[0]
                        if not relu or dot[0] != T.float32(0):
                            fired[0, listed[0]] = start + q
                            listed[0] = listed[0] + 1
            # 2. the other rows of the neurons that fired, for the rows of x they fired for
            for r in range(m):
                for j in T.vectorized(D):
                    scratch[t, r * D + j] = T.float32(0)
            if offsets:
                for b in T.vectorized(row_sums):
                    off[b] = T.float32(0)
            if not grouped:
                for i in range(first, listed[0]):
                    k = fired[0, i]
                    row = clamp_index(idx[0, k], n)
                    after = clamp_index(idx[0, fired[0, T.min(i + ahead, listed[0] - 1)]], n)  # a later listed neuron's row
                    for r in range(m):
                        if not relu or h[r, k] != T.float32(0):
                            dot[0] = h[r, k]
                            if gated:
                                if q8:
                                    row_dot8(qacc, part, dot, rs, sx, xpat, xc, w_up, w_up_s, n + row, 1, w_down,
                                             w_down_s, row)
                                else:
                                    row_dot(acc, dot, rs, xs, x, r, w_up, w_up_s, n + row, 1, w_down, w_down_s, row)
                                dot[0] = dot[0] * (dot[1] + b_up[n + row])  # the GLU, act(gate) taken in step 1
                                h[r, k] = dot[0]
                                row_axpy(scratch, t, r, dot[0], rs, off, w_down, w_down_s, row, w_up, w_up_s, n + after)
                            else:
                                row_axpy(scratch, t, r, dot[0], rs, off, w_down, w_down_s, row, w_down, w_down_s, after)
            if grouped:
                for g in range((listed[0] - first + group - 1) // group):
                    start = first + g * group  # the group's first place in the list
                    for q in T.unroll(group):
                        grows[q] = clamp_index(idx[0, fired[0, T.min(start + q, listed[0] - 1)]], n)
                        coefs[q] = T.if_then_else(start + q < listed[0], h[0, fired[0, T.min(start + q, listed[0] - 1)]],
                                                  T.float32(0))
                    if gated:
                        group_dot(gacc, gdots, x, w_up, grows, n)
                        for q in T.unroll(group):
                            coefs[q] = coefs[q] * (gdots[q] + b_up[n + grows[q]])  # the GLU, act(gate) in step 1
                        for q in range(T.min(group, listed[0] - start)):
                            h[0, fired[0, start + q]] = coefs[q]
                    group_axpy(scratch, t, coefs, w_down, grows)
            if offsets:
                for r in range(m):
                    for b in range(sblocks):
                        for v in T.vectorized(QUANT_BLOCK):
                            scratch[t, r * D + b * QUANT_BLOCK + v] = (scratch[t, r * D + b * QUANT_BLOCK + v]
                                                                       + off_factor * off[r * sblocks + b])
        for r in range(m):
            for j in T.vectorized(D):
                out[r, j] = scratch[0, r * D + j]
            for t in range(1, tasks):
                for j in T.vectorized(D):
                    out[r, j] = out[r, j] + scratch[t, r * D + j]

    return kernel

COLUMN_TASKS = 8  # sparse_columns: parallel tasks, each over an equal share of the selected rows
COLUMN_ROWS = 4  # sparse_columns: selected rows accumulated per pass over a task's partial sums


def sparse_columns(name, K, N, *, rows, gated: bool = False, act: str = "none", bias: bool = False,
                   residual: bool = False, wdtype="float32", prefetch_locality: int | None = None,
                   max_batch: int = 1):
    """A column-sparse GEMV: y = act(sum over k < count of v[0, r_k] * w[r_k] + b) (+ res), r_k = idx[0, k], for
    a weight stored one row per input channel ([K, N], a linear layer's x @ W layout), so that an input
    that is dropped costs nothing: its row is never read. Gated (w = [gate | up], N = 2F, y[1, F]):
    y = act(gate + b_gate) * (up + b_up), the GLU done on the sums. `residual`: the block's skip connection
    added in the epilogue (attention's o), as the dense linears' epilogue does.

    Args: v[1, K], idx[1, K] int32, count[1, 1] int32 (from `select`), w[K, N], (b[N]), (res[1, N or N/2]),
    scratch[COLUMN_TASKS, N], y[1, N or N/2].

    The selected rows are cut into COLUMN_TASKS equal slices run in parallel; a task reads its rows whole
    (long sequential streams), COLUMN_ROWS at a time, adding coefficient x row into its own partial-sum
    row of scratch (one load and store of it per COLUMN_ROWS rows of w), and prefetches the next rows'
    lines as it goes. A second parallel loop over column chunks sums the partial rows and applies bias,
    activation, the GLU and the residual (`_column_sums`).

    rows=None (a batch step of m <= `max_batch` sequences): v[m, K], y[m, N or N/2], the selection the union of
    the rows' (select's), scratch[COLUMN_TASKS, max_batch * N] (a partial-sum row per task and sequence; decode's
    kernel takes the same buffer). A task's kept rows of w are read once for all m rows: each group of them is
    added into every sequence's partial sums with that sequence's coefficients (the group in L1/L2 after the
    first), so a channel only another sequence kept counts with its own value: the union's product.
    """
    if rows not in (1, None):
        raise ValueError("sparse_columns runs in one-token steps only (decode: rows 1, batch: rows None)")
    m = row_dim(rows)
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality  # (L2: 1.1-1.3x over L1 here)
    out = N // 2 if gated else N
    if gated and N % 2:
        raise ValueError("a gated weight has gate and up halves")
    lanes = _lanes(N)
    line, line_vectors, lines = _row_lines(N, lanes, wdtype)
    tasks, group = COLUMN_TASKS, COLUMN_ROWS  # (the unrolled sum below reads coef[0..3]: 4 rows per pass)
    column_sums = _column_sums(N, m, gated=gated, act=act, bias=bias, residual=residual)

    @T.prim_func
    def kernel(v: T.Buffer((m, K), "float32"), idx: T.Buffer((1, K), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((K, N), wdtype), b: T.Buffer((N,), "float32"), res: T.Buffer((m, out), "float32"),
               scratch: T.Buffer((tasks, max_batch * N), "float32"), y: T.Buffer((m, out), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            first = clamp_count(count[0, 0], K) * t // tasks
            last = clamp_count(count[0, 0], K) * (t + 1) // tasks
            row = T.alloc_local((group,), "int32")
            after = T.alloc_local((group,), "int32")
            coef = T.alloc_local((group,), "float32")
            for r in range(m):  # (a vector of `lanes` at a time: a vector of N lanes fails LLVM codegen for a vocabulary)
                for j in range(N // lanes):
                    for l in T.vectorized(lanes):
                        scratch[t, r * N + j * lanes + l] = T.float32(0)
            for g in range((last - first) // group):
                for q in T.unroll(group):
                    row[q] = clamp_index(idx[0, first + g * group + q], K)
                    after[q] = clamp_index(idx[0, T.min(first + (g + 1) * group + q, last - 1)], K)
                for r in range(m):
                    for q in T.unroll(group):
                        coef[q] = v[r, row[q]]
                    for s in range(lines):
                        for q in T.unroll(group):
                            prefetch(T.address_of(w[after[q], s * line]), locality)
                        for u in T.unroll(line_vectors):
                            for l in T.vectorized(lanes):
                                scratch[t, r * N + (s * line_vectors + u) * lanes + l] = (
                                    scratch[t, r * N + (s * line_vectors + u) * lanes + l]
                                    + coef[0] * load_f32(w[row[0], (s * line_vectors + u) * lanes + l], wdtype)
                                    + coef[1] * load_f32(w[row[1], (s * line_vectors + u) * lanes + l], wdtype)
                                    + coef[2] * load_f32(w[row[2], (s * line_vectors + u) * lanes + l], wdtype)
                                    + coef[3] * load_f32(w[row[3], (s * line_vectors + u) * lanes + l], wdtype))
            for k in range(first + (last - first) // group * group, last):
                row[0] = clamp_index(idx[0, k], K)
                for r in range(m):
                    coef[0] = v[r, row[0]]
                    for s in range(N // lanes):
                        for l in T.vectorized(lanes):
                            scratch[t, r * N + s * lanes + l] = (scratch[t, r * N + s * lanes + l]
                                                                 + coef[0] * load_f32(w[row[0], s * lanes + l], wdtype))
        column_sums(scratch, b, res, y)

    kernel = drop_params(kernel, ([] if bias else ["b"]) + ([] if residual else ["res"]))
    return kernel.with_attr("global_symbol", name)


def _column_sums(N, m, *, gated: bool, act: str, bias: bool, residual: bool):
    """The column-sparse kernels' second loop: y[r] = the sum of the tasks' partial rows of scratch, plus the bias,
    through the activation (gated: the GLU of the two halves' sums), plus the residual; parallel over chunks of
    the output columns."""
    actf = compute.activation(act, MATH)
    out = N // 2 if gated else N
    tasks = COLUMN_TASKS
    out_lanes = _lanes(out)
    chunk = _col_block(out, max(out_lanes, min(1024, out // tasks)))

    @T.macro
    def column_sums(scratch, b, res, y):
        for c in T.parallel(out // chunk):
            total = T.alloc_local((2, out_lanes), "float32")
            for r in range(m):
                for s in range(chunk // out_lanes):
                    for l in T.vectorized(out_lanes):
                        total[0, l] = scratch[0, r * N + c * chunk + s * out_lanes + l]
                        if gated:
                            total[1, l] = scratch[0, r * N + out + c * chunk + s * out_lanes + l]
                    for q in range(1, tasks):
                        for l in T.vectorized(out_lanes):
                            total[0, l] = total[0, l] + scratch[q, r * N + c * chunk + s * out_lanes + l]
                            if gated:
                                total[1, l] = total[1, l] + scratch[q, r * N + out + c * chunk + s * out_lanes + l]
                    for l in T.vectorized(out_lanes):
                        if bias:
                            total[0, l] = total[0, l] + b[c * chunk + s * out_lanes + l]
                            if gated:
                                total[1, l] = total[1, l] + b[out + c * chunk + s * out_lanes + l]
                        if gated:
                            total[0, l] = glu_unit(actf, total[0, l], total[1, l])
                        else:
                            total[0, l] = actf(total[0, l])
                        if residual:
                            total[0, l] = total[0, l] + res[r, c * chunk + s * out_lanes + l]
                        y[r, c * chunk + s * out_lanes + l] = total[0, l]

    return column_sums


def sparse_columns_q(name, K, N, *, rows, bits: int, sdtype="float16", has_min: bool = False, gated: bool = False,
                     act: str = "none", bias: bool = False, residual: bool = False,
                     prefetch_locality: int | None = None, max_batch: int = 1):
    """`sparse_columns` over block-quantized rows: w [K, N] in quant's rows layout (`quant.pack_rows`, blocks of
    32 along each row, the N axis; int8 or int4 by `bits`, scales in `sdtype`; int4a with `has_min`: each
    block's scale and min side by side). A kept input channel's row is read once: its values and its N / 32
    scales (and mins).

    Args: v[m, K], idx[1, K], count[1, 1], w[K, N or N/2] (int8 / uint8), ws[K, N/32 (x2 int4a)], (b[N]),
    (res[m, N or N/2]), scratch[COLUMN_TASKS, max_batch * N], y[m, N or N/2].

    As `sparse_ffn_q`'s down axpy (the same RowFormat, `axpy_block`'s nibble widening): per kept row r and
    sequence, the factors a * scale[b] (a = v[r]) are made once per row (rs), the blocks added as rs[b] * q into
    the task's partial sums, COLUMN_ROWS rows per pass over them. int4's stored offset (+8) and int4a's mins are
    per block, not per weight: the task adds a's share (8 rs[b], or a m[b]) into off[b] and takes it off its
    partial sums once at its end. The second loop is sparse_columns' (`_column_sums`).

    The arithmetic bounds it, not the bytes (per 32 int4 weights of a row: a widening, a mask, a shift, two
    conversions, two FMAs). Measured on a Zen 4 VM (AVX-512, 2 threads on a busy machine, gated up 576 x 3072
    as in SmolLM2-135M, 30 matrices in turn so rows come from memory; medians): int4 10.5 / 8.5 GB/s of rows and
    scales at 60 / 40% of the inputs kept (57 / 47 us a call, the dense int4 VNNI GEMV 43 us: no faster than dense
    here); int8 16 GB/s (70 / 48 us against the dense int8 GEMV's 106 / 97 us: 1.5-2x); AVX2 int4 77 / 60 us against
    the dense panel GEMV's 144 us. Prefetching the next rows a line per line read, not all up front, gave 1.3-1.5x."""
    if rows not in (1, None):
        raise ValueError("sparse_columns_q runs in one-token steps only (decode: rows 1, batch: rows None)")
    fmt = quant_rows(N, bits, sdtype, has_min)  # (the GLU's halves need not be whole blocks: it reads the sums)
    if gated and N % 2:
        raise ValueError("a gated weight has gate and up halves")
    m = row_dim(rows)
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality
    out = N // 2 if gated else N
    lanes, vectors, block = fmt.lanes, fmt.vectors, fmt.block
    int4 = fmt.bits == 4
    sblocks = N // QUANT_BLOCK
    per = fmt.per_block
    stored = fmt.stored(N)
    line_blocks = fmt.line_blocks(sblocks)
    lines = sblocks // line_blocks
    scale_lines = fmt.scale_lines(N)
    per_scale_line = 64 // itemsize(sdtype)
    has_offset, offsets = fmt.offset > 0, fmt.offset > 0 or has_min
    off_factor = T.float32(-fmt.offset if has_offset else 1)
    tasks, group = COLUMN_TASKS, COLUMN_ROWS
    sums = sblocks * max_batch if offsets else 0
    column_sums = _column_sums(N, m, gated=gated, act=act, bias=bias, residual=residual)

    @T.macro
    def factors(rs, off, ws, v, r, q, row):
        """rs[q] = v[r, row] times row's block scales; its offset / mins' share into off (row r's)."""
        for b in T.vectorized(sblocks):
            rs[q * sblocks + b] = v[r, row] * load_f32(ws[row, b * per], sdtype)
        if has_offset:
            for b in T.vectorized(sblocks):
                off[r * sblocks + b] = off[r * sblocks + b] + rs[q * sblocks + b]
        if has_min:
            for b in T.vectorized(sblocks):
                off[r * sblocks + b] = off[r * sblocks + b] + v[r, row] * load_f32(ws[row, b * per + 1], sdtype)

    @T.macro
    def prefetch_scales(ws, after, count):
        """The scales of the rows to come (a few lines each), up front."""
        for q in T.unroll(count):
            for z in T.unroll(scale_lines):
                prefetch(T.address_of(ws[after[q], T.min(z * per_scale_line, sblocks * per - 1)]), locality)

    @T.macro
    def add_rows(scratch, t, r, rs, w, row, count, after, ahead):
        """scratch[t, row r's N columns] += the sum over q < count of rs[q] (per block) * w[row[q]]; with `ahead`,
        a line of each of the rows to come prefetched per line of these read (spread out, not queued up front)."""
        for s in range(lines):
            if ahead:
                for q in T.unroll(count):
                    prefetch(T.address_of(w[after[q], T.min(fmt.stored(s * line_blocks * block), stored - 1)]), locality)
            for i in T.unroll(line_blocks):
                if int4:
                    wide = T.alloc_local((count, lanes), "int32")
                    for q in T.unroll(count):
                        for l in T.vectorized(lanes):
                            wide[q, l] = compute.int4_byte(w, row[q], s * line_blocks + i, l)
                    for u in T.unroll(2):
                        for l in T.vectorized(lanes):
                            scratch[t, r * N + (s * line_blocks + i) * block + u * lanes + l] = _accumulate(
                                scratch[t, r * N + (s * line_blocks + i) * block + u * lanes + l], count,
                                lambda q: rs[q * sblocks + s * line_blocks + i] * compute.int4_nibble(wide[q, l], u))
                else:
                    for u in T.unroll(vectors):
                        for l in T.vectorized(lanes):
                            scratch[t, r * N + (s * line_blocks + i) * block + u * lanes + l] = _accumulate(
                                scratch[t, r * N + (s * line_blocks + i) * block + u * lanes + l], count,
                                lambda q: rs[q * sblocks + s * line_blocks + i] * fmt.weight(w, row[q], s * line_blocks + i, u, l))

    @T.prim_func
    def kernel(v: T.Buffer((m, K), "float32"), idx: T.Buffer((1, K), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((K, stored), fmt.storage), ws: T.Buffer((K, sblocks * per), sdtype),
               b: T.Buffer((N,), "float32"), res: T.Buffer((m, out), "float32"),
               scratch: T.Buffer((tasks, max_batch * N), "float32"), y: T.Buffer((m, out), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            first = clamp_count(count[0, 0], K) * t // tasks
            last = clamp_count(count[0, 0], K) * (t + 1) // tasks
            row = T.alloc_local((group,), "int32")
            after = T.alloc_local((group,), "int32")
            rs = T.alloc_local((group * sblocks,), "float32")
            off = T.alloc_local((sums,), "float32")
            for r in range(m):  # (`lanes` at a time, as sparse_columns)
                for j in range(N // lanes):
                    for l in T.vectorized(lanes):
                        scratch[t, r * N + j * lanes + l] = T.float32(0)
            if offsets:
                for j in T.vectorized(sums):
                    off[j] = T.float32(0)
            for g in range((last - first) // group):
                for q in T.unroll(group):
                    row[q] = clamp_index(idx[0, first + g * group + q], K)
                    after[q] = clamp_index(idx[0, T.min(first + (g + 1) * group + q, last - 1)], K)
                prefetch_scales(ws, after, group)
                for q in T.unroll(group):
                    factors(rs, off, ws, v, 0, q, row[q])
                add_rows(scratch, t, 0, rs, w, row, group, after, True)
                for r in range(1, m):  # (batch steps: the other sequences, the rows in cache now)
                    for q in T.unroll(group):
                        factors(rs, off, ws, v, r, q, row[q])
                    add_rows(scratch, t, r, rs, w, row, group, after, False)
            for k in range(first + (last - first) // group * group, last):
                row[0] = clamp_index(idx[0, k], K)
                for r in range(m):
                    factors(rs, off, ws, v, r, 0, row[0])
                    add_rows(scratch, t, r, rs, w, row, 1, row, False)
            if offsets:
                for r in range(m):
                    for c in range(sblocks):
                        for j in T.vectorized(QUANT_BLOCK):
                            scratch[t, r * N + c * QUANT_BLOCK + j] = (scratch[t, r * N + c * QUANT_BLOCK + j]
                                                                       + off_factor * off[r * sblocks + c])
        column_sums(scratch, b, res, y)

    kernel = drop_params(kernel, ([] if bias else ["b"]) + ([] if residual else ["res"]))
    return kernel.with_attr("global_symbol", name)


def _accumulate(total, count, term):
    """total + term(0) + ... + term(count - 1), added in that order: a chain of FMAs on the partial sum (one load
    and store of it for a group's rows, no separate products to add up)."""
    for q in range(count):
        total = total + term(q)
    return total


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


# --------------------------------------------------------------------------------------------
# Over block-quantized rows (quant's rows layout): the CPU twins of cuda.sparse_up_q / sparse_down_q, simple
# and correct (one weight at a time through compute.qrows_weight) so the CPU can emulate and check the GPU.
# The CPU's own fused kernel over the same rows is sparse_ffn_q.
# --------------------------------------------------------------------------------------------


def sparse_up_q(name, D, n, *, rows, gated: bool, act: str, bits: int, sdtype="float16"):
    """``sparse_up`` over quant rows.  Args: x[1, D], idx[1, n], count[1, 1], w[(2 if gated) n, D or D/2],
    ws[(2 if gated) n, D/32], b[(2 if gated) n], h[1, n]. Active neurons in parallel, a serial dot each."""
    if rows != 1:
        raise ValueError("sparse_up_q runs in decode only")
    actf = compute.activation(act, MATH)
    width = 2 * n if gated else n
    qw, storage, nb = compute.quant_width(D, bits), compute.quant_storage(bits), D // QUANT_BLOCK
    compute.qrows_check_sdtype(sdtype)

    @T.prim_func
    def kernel(x: T.Buffer((1, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((width, qw), storage), ws: T.Buffer((width, nb), sdtype),
               b: T.Buffer((width,), "float32"), h: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        for k in T.parallel(clamp_count(count[0, 0], n)):
            tot = T.alloc_local((2,), "float32")
            row = clamp_index(idx[0, k], n)
            tot[0] = b[row]
            tot[1] = T.float32(0)
            if gated:
                tot[1] = b[n + row]
            for j in range(D):
                tot[0] = tot[0] + x[0, j] * compute.qrows_weight(w, ws, row, j, bits, sdtype)
                if gated:
                    tot[1] = tot[1] + x[0, j] * compute.qrows_weight(w, ws, n + row, j, bits, sdtype)
            if gated:
                h[0, k] = glu_unit(actf, tot[0], tot[1])
            else:
                h[0, k] = actf(tot[0])

    return kernel.with_attr("global_symbol", name)


def sparse_down_q(name, n, D, *, rows, bits: int, sdtype="float16"):
    """``sparse_down`` over quant rows.  Args: h[1, n], idx[1, n], count[1, 1], w[n, D or D/2], ws[n, D/32],
    out[1, D]. Blocks of 32 columns in parallel, each walking every active row."""
    if rows != 1:
        raise ValueError("sparse_down_q runs in decode only")
    qw, storage, nb = compute.quant_width(D, bits), compute.quant_storage(bits), D // QUANT_BLOCK
    compute.qrows_check_sdtype(sdtype)

    @T.prim_func
    def kernel(h: T.Buffer((1, n), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((n, qw), storage), ws: T.Buffer((n, nb), sdtype), out: T.Buffer((1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for c in T.parallel(nb):
            for j in range(QUANT_BLOCK):
                out[0, c * QUANT_BLOCK + j] = T.float32(0)
            for k in range(clamp_count(count[0, 0], n)):
                row = clamp_index(idx[0, k], n)
                for j in range(QUANT_BLOCK):
                    out[0, c * QUANT_BLOCK + j] = out[0, c * QUANT_BLOCK + j] + h[0, k] * compute.qrows_weight(
                        w, ws, row, c * QUANT_BLOCK + j, bits, sdtype)

    return kernel.with_attr("global_symbol", name)
