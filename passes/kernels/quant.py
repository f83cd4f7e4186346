"""Block-quantized weights: the quantization rules (numpy) and the layouts the CPU's kernels read them in.

The formats are `runtime.dtypes.WEIGHT_FORMATS`' int8, int4 and int4a: one scale (int4a: a scale and a minimum,
x = d q + m) per QUANT_BLOCK consecutive weights along one axis of the matrix (`axis`). A matrix is quantized
once (`quantize`: integer values, unpacked, and their scales (and mins), shaped like the matrix with the block
axis divided by the block) and packed into the layout of the kernel that reads it:

* rows (`pack_rows`): a row-major [R, C] weight whose rows kernels read whole (the gathered FFN rows, one per
  neuron; the embedding table), blocks along the row (axis 1). int8: q [R, C] int8; int4: q [R, C/2] uint8,
  byte 16 b + i of a row holding its element 32 b + i in the low nibble and 32 b + 16 + i in the high one
  (Q4_0's order), each as q + 8 (int4a: q, in [0, 15]). Scales [R, C / 32]; int4a's scales and mins
  interleaved, [R, 2 C / 32] (d and m of block b at 2b and 2b + 1, as Q4_1 keeps them beside each other).
* panels (`pack_panels`): a dense linear's [K, N] weight, blocks along the reduction axis K (axis 0), cut
  into panels of PANEL columns like `cpu.pack_panels`. int8: q [P, K, 16] int8; int4: q [P, K, 8] uint8 in
  groups of 4 rows (byte 4 v + j of group g: row 4 g + j's column v in the low nibble and column v + 8 in the
  high one, each as q + 8; int4a: q; kquant.group_rows), so that a dword is one column pair's 4 consecutive k
  steps, as the int8-activation kernels dot them: they load a vector with no shuffle. Scales [P, K / 32, 16];
  int4a's [P, K / 32, 32], a block's 16 scales then its 16 mins (one 64-byte line). Padded columns are 0 with
  scale 0 (and min 0).

A quantized axis must be a whole number of blocks (`quantizable`); other weights stay in floats.

Below the numpy code, the CPU kernels that read these layouts (TVMScript, fp32 arithmetic): the decode GEMV over
panels (`gemv_panels_q`; `gemv_panels_q4x8` and `gemv_panels_q8x8`, int4 / int4a and int8 with int8
activations; int4a's kernels add each block's min times x's block sum, sum_k (d q_k + m) x_k = d sum_k q_k x_k +
m sum_k x_k, so a block costs one more FMA per column, not one per weight), the
prefill operands: `panels_weight`, which `cpu.gemm` dequantizes into its per-task panels, and `quantized_rows`,
the FFN rows as `cpu.gemm_nt` (up rows, [N, K]) and `cpu.gemm_kn` (down rows, [K, N]) read them in place
(`rows_weight` and `kn_weight`, the same rows packed per call by `cpu.gemm`, are what linear_rows_q and
linear_kn_q ran before: benchmarks/bench_prefill_gemm.py's baselines), and the makers `ops` registers
(`linear_panels_q`, `linear_rows_q`, `linear_kn_q`).
"""

from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..sizes import float_format
from runtime.dtypes import INT4_OFFSET, QUANT_BLOCK, WeightFormat, dequantize_blocks

from . import cpu as _cpu
from .compute import drop_params, load_f32, prefetch, row_dim
from .cpu import PANEL
from .kquant import group_rows, grouped_byte


def quantizable(shape, axis: int, block: int = QUANT_BLOCK) -> bool:
    """Whether a matrix of `shape` can be blocked along `axis`."""
    return len(shape) == 2 and shape[axis] % block == 0 and shape[axis] > 0


def _blocked(w: np.ndarray, axis: int, block: int) -> np.ndarray:
    """`w` as [.., blocks, block] with the blocks of `axis` on the last two axes (a view when axis is 1)."""
    if not quantizable(w.shape, axis, block):
        raise ValueError(f"a {list(w.shape)} weight is not a whole number of {block}-blocks along axis {axis}")
    moved = w if axis == 1 else w.T
    return moved.reshape(moved.shape[0], -1, block)


# fit_scales: each block's scale is the best of these multiples of the round-to-nearest one, mapping the largest
# weight to -2^(bits-1) or +2^(bits-1) - 1 (a finer step clips the largest weight a little and rounds the rest
# closer): ~9% less squared error than Q4_0's rule on Gaussian weights
FITTED_SCALE_RATIOS = (0.8, 0.85, 0.9, 0.95, 1.0)
FIT_CHUNK_BLOCKS = 1 << 20  # blocks searched at a time (bounds the search's temporaries)


def quantize(w: np.ndarray, fmt: WeightFormat, axis: int, fit_scales: bool = False, keep_grid: bool = False,
             exact: bool = False):
    """Block quantization of the matrix `w` along `axis`: (q, scales), and for an asymmetric format (q, scales,
    mins); q int8 shaped like w (int8: [-128, 127]; int4: [-8, 7]; int4a: [0, 15]), scales (mins) in
    fmt.scale_dtype shaped like w with `axis` divided by the block. q * scales (+ mins, each
    repeated over its block) is the dequantized weight (`dequantize`).
    Symmetric: round-to-nearest by default: the block's largest-magnitude weight maps to -2^(bits-1) exactly
    (Q4_0's rule, MatMulNBits' symmetric one), so an imported MatMulNBits weight re-quantizes to its own values.
    With `fit_scales` each block takes the scale of FITTED_SCALE_RATIOS (either sign) whose rounding has the least
    squared error (the clipping search of AWQ, without activations).
    With `keep_grid` a block whose values already are integers times one scale of the format (a model that came
    quantized: a GGUF file's Q8_0 blocks, d = max|w| / 127, or Q4_0's, or ones an imatrix placed elsewhere) keeps
    exactly those integers and that scale (`on_grid`) whatever the rule would give.
    Asymmetric: `quantize_asymmetric` (`exact` finds a model's own blocks again)."""
    if fmt.has_min:
        q, scales, mins, *_ = quantize_asymmetric(w, fmt, axis, exact=exact or keep_grid)
        return q, scales, mins
    if fmt.bits not in (4, 8):
        raise ValueError(f"{fmt.name} is not a block-quantized format")
    blocks = _blocked(np.asarray(w, np.float32), axis, fmt.block)
    low, high = fmt.levels
    pick = np.abs(blocks).argmax(axis=-1)
    largest = np.take_along_axis(blocks, pick[..., None], axis=-1)[..., 0]
    shape = blocks.shape
    flat, largest = blocks.reshape(-1, fmt.block), largest.reshape(-1)
    candidates = [1.0 / low] + ([ratio / end for ratio in FITTED_SCALE_RATIOS for end in (low, high)
                                 if (ratio, end) != (1.0, low)] if fit_scales else [])
    q = np.empty(flat.shape, np.int8)
    scale = np.empty(largest.shape, fmt.scale_dtype)
    for begin in range(0, len(flat), FIT_CHUNK_BLOCKS):
        chunk = slice(begin, begin + FIT_CHUNK_BLOCKS)
        part, best_error = flat[chunk], None
        for factor in candidates:
            s = (largest[chunk] * factor).astype(fmt.scale_dtype)
            stored = s.astype(np.float32)[:, None]  # round with the scale as stored, so q * scale is exact
            with np.errstate(divide="ignore", invalid="ignore"):
                values = np.clip(np.where(stored == 0, 0, np.rint(part / stored)), low, high)
            error = ((values * stored - part) ** 2).sum(-1) if len(candidates) > 1 else None
            better = slice(None) if best_error is None else error < best_error
            q[chunk][better], scale[chunk][better] = values[better], s[better]
            best_error = error if best_error is None else np.minimum(error, best_error)
        if keep_grid:
            grid_q, grid_scale, on = on_grid(part, largest[chunk], fmt)
            q[chunk][on], scale[chunk][on] = grid_q[on], grid_scale[on]
    return _unblocked(axis, shape, q, scale)


def on_grid(blocks: np.ndarray, largest: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For float32 `blocks` [n, block] with their largest-magnitude values `largest` [n]: (q, scales, exact),
    where exact[i] says block i is q[i] x scales[i] exactly, q in the format's range and the scale a value of
    fmt.scale_dtype. The scale is the largest value over its own code, tried in this order: -2^(bits-1) (Q4_0's
    and MatMulNBits' rule), +-(2^(bits-1) - 1) with a positive scale (Q8_0's: d = max|w| / 127), then, for
    int4, every other code (quantizers with an importance matrix place the largest elsewhere)."""
    low, high = -(1 << (fmt.bits - 1)), (1 << (fmt.bits - 1)) - 1
    codes = [low, high, -high] + ([c for c in range(high - 1, 0, -1) for c in (c, -c)] if fmt.bits == 4 else [])
    q = np.zeros(blocks.shape, np.int8)
    scale = np.zeros(largest.shape, fmt.scale_dtype)
    exact = ~blocks.any(axis=-1)  # all-zero blocks: q 0, scale 0
    possible = ~exact
    gap = None
    if fmt.bits == 4:  # a block of more than 16 distinct values is on no 4-bit grid: float weights stop here
        steps = np.diff(np.sort(blocks, axis=-1), axis=-1)
        possible &= (steps != 0).sum(-1) < 16
        gap = np.where(steps > 0, steps, np.inf).min(-1)  # the least step between its values (inf: one value)
    for code in codes:
        todo = np.flatnonzero(possible & ~exact)
        if not todo.size:
            break
        if gap is not None:
            todo = todo[_whole_steps(gap[todo], largest[todo] / code)]
        s = np.abs(largest[todo]) / abs(code) if code in (high, -high) else largest[todo] / code
        s = (s if code != -high else -s).astype(fmt.scale_dtype)
        # the first few values first: a block off the grid (a float one, one with a minimum) seldom passes them
        _, near = _multiples(blocks[todo, :PEEK], s, low, high)
        todo, s = todo[near], s[near]
        values, good = _multiples(blocks[todo], s, low, high)
        hit = todo[good]
        q[hit], scale[hit], exact[hit] = values[good].astype(np.int8), s[good], True
    return q, scale, exact


PEEK = 4  # values of a block on_grid tests before the rest


def _multiples(part: np.ndarray, scale: np.ndarray, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, good): `part` [n, k] over its blocks' `scale` [n] (a stored type) rounded, and per block whether
    those codes are in [low, high] and times the scale give back every value exactly."""
    stored = scale.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.where(stored == 0, np.inf, np.rint(part / stored))
    good = ((values >= low) & (values <= high)).all(-1)
    good &= (np.where(good[:, None], values, 0) * stored == part).all(-1)
    return values, good


def _whole_steps(gap: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per block, whether its least step between values `gap` (inf: a single value) is a whole number of `scale`,
    loosely: on a grid of that scale it is one exactly. A filter before on_grid's exact test, which a 4-bit file's
    blocks with a minimum (Q4_1, the K-quants) never pass: without it every code would be tried on each of their
    blocks, a third of the quality pass of an int4 build of such a file."""
    steps = np.abs(gap / scale)
    return ~np.isfinite(steps) | (np.abs(steps - np.rint(steps)) <= 1e-3 * steps)


def _unblocked(axis, shape, q, *per_block):
    """quantize's flat [blocks, block] q and per-block arrays back in the matrix's orientation."""
    q, per_block = q.reshape(shape[0], -1), [a.reshape(shape[:2]) for a in per_block]
    if axis == 1:
        return (q, *per_block)
    return (np.ascontiguousarray(q.T), *(np.ascontiguousarray(a.T) for a in per_block))


def _round_asymmetric(part, d, m, high):
    """(q, float32 values) of blocks `part` [n, block] with steps d and minimums m ([n], stored types)."""
    d32, m32 = d.astype(np.float32)[:, None], m.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d32 == 0, 0, np.clip(np.rint((part.astype(np.float64) - m32) / d32), 0, high)).astype(np.int8)
    return q, q.astype(np.float32) * d32 + m32  # (float32 ops, as WeightFormat.dequantize)


def quantize_asymmetric(w: np.ndarray, fmt: WeightFormat, axis: int, exact: bool = False, group: int = 1):
    """Asymmetric blocks (Q4_1's rule): per block m = min, d = (max - m) / (2^bits - 1), q = round((x - m) / d)
    in [0, 2^bits - 1], d and m rounded to their stored types first. Returns (q, scales, mins, missed, foreign):
    with `exact`, the counts of blocks not reproduced and of blocks that are no dequantized blocks (0 without).

    `exact`: `w` may hold dequantized blocks (an imported MatMulNBits with zero points, written by
    `dequantize_blocks`): a block whose values the rule does not reproduce bit for bit (its codes do not span
    0 .. 2^bits - 1, or its scale's division rounded) tries every narrower span k and the stored types'
    neighbours of (max - m) / k, keeping the first that reproduces it; `missed` counts those no candidate
    reproduces (re-rounded by the rule), `foreign` the blocks of more than 2^bits distinct values, which no
    dequantized block has (rounded by the rule too: a float matrix, or another format's blocks). `group`: the
    source's blocks are that many of ours (MatMulNBits' block_size 64, 128: one d and m for all of them), so the
    candidates take the min and max of the group's weights first: a block whose codes miss 0 or 15 still gets
    its source block's d and m.
    """
    blocks = _blocked(np.asarray(w, np.float32), axis, fmt.block)
    shape, flat = blocks.shape, blocks.reshape(-1, fmt.block)
    high, sdtype = fmt.levels[1], np.dtype(fmt.scale_dtype)
    ranges = [(flat.min(axis=-1), flat.max(axis=-1))]  # each block's own (the rule), then its group's
    if exact and group > 1 and shape[1] % group == 0:
        grouped = blocks.reshape(shape[0], -1, group * fmt.block)
        ranges.insert(0, tuple(np.repeat(a, group, axis=-1).reshape(-1)
                               for a in (grouped.min(axis=-1), grouped.max(axis=-1))))

    def candidate(lo, hi, k, step=0):
        m = lo.astype(sdtype)
        d = ((hi.astype(np.float64) - m.astype(np.float64)) / k).astype(sdtype)
        return (np.nextafter(d, np.array(np.inf if step > 0 else -np.inf, sdtype)) if step else d), m

    d, m = candidate(*ranges[-1], high)
    q, values = _round_asymmetric(flat, d, m, high)
    missed, foreign = np.empty(0, np.intp), 0
    if exact:  # (only blocks of at most 2^bits distinct values can be dequantized blocks)
        missed = np.flatnonzero((values != flat).any(-1))
        grid = (np.diff(np.sort(flat[missed], axis=-1), axis=-1) != 0).sum(-1) < high + 1
        missed, foreign = missed[grid], int((~grid).sum())
        for lo, hi in ranges:
            for k in range(high, 0, -1):
                for step in (0, 1, -1):
                    if not missed.size:
                        break
                    td, tm = candidate(lo[missed], hi[missed], k, step)
                    tq, tv = _round_asymmetric(flat[missed], td, tm, high)
                    hit = (tv == flat[missed]).all(-1)
                    q[missed[hit]], d[missed[hit]], m[missed[hit]] = tq[hit], td[hit], tm[hit]
                    missed = missed[~hit]
    q, d, m = _unblocked(axis, shape, q, d, m)
    return q, d, m, int(missed.size), foreign


dequantize = dequantize_blocks  # (q, scales, axis, mins=None) -> the float32 matrix `quantize`'s blocks stand for


def as_stored(w: np.ndarray, fmt: WeightFormat, axis: int) -> np.ndarray:
    """The float32 values the matrix `w` holds once stored in `fmt` (blocked along `axis` where it is whole
    blocks, else in the build's float format, `sizes.float_format`): what a kernel will read. Passes that fit
    something to a stored weight (predict's thresholds) fit it to these."""
    if fmt.quantized and quantizable(w.shape, axis, fmt.block):
        q, scales, *mins = quantize(w, fmt, axis)
        return dequantize(q, scales, axis, *mins)
    return np.asarray(w, np.float32).astype(float_format(fmt).storage).astype(np.float32)


def int8_blocks(x: np.ndarray) -> np.ndarray:
    """The float32 values the int8-activation GEMVs compute with for the input `x` (x_quantizer's numpy twin):
    per 32-block of the last axis, round(x * (127 / max|x|)) * (max|x| / 127). Passes that fit something to a
    decode GEMV's output (predict's thresholds) feed it these."""
    blocks = np.asarray(x, np.float32).reshape(-1, QUANT_BLOCK)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    return (np.round(blocks * inv) * (amax / np.float32(127))).astype(np.float32).reshape(np.shape(x))


def pack_rows(q: np.ndarray, scales: np.ndarray, fmt: WeightFormat, mins: np.ndarray | None = None) -> tuple:
    """(q, scales) of a matrix quantized along its rows (axis 1) in the rows layout (see the module doc); an
    asymmetric format's scales and mins [R, C / 32] interleaved, [R, 2 C / 32]: d and m of block b at 2b, 2b + 1."""
    scales = _with_mins(scales, mins, fmt, lambda d, m: np.stack([d, m], -1).reshape(d.shape[0], -1))
    if fmt.bits == 8:
        return np.ascontiguousarray(q, np.int8), scales
    rows, columns = q.shape
    blocks = (q.astype(np.int16) + fmt.offset).astype(np.uint8).reshape(rows, columns // fmt.block, 2, fmt.block // 2)
    packed = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)
    return np.ascontiguousarray(packed.reshape(rows, columns // 2)), scales


def _with_mins(scales, mins, fmt: WeightFormat, join):
    """The scales a layout stores: `join(scales, mins)` for an asymmetric format, else the scales."""
    if fmt.has_min != (mins is not None):
        raise ValueError(f"{fmt.name} blocks {'take' if fmt.has_min else 'have no'} minimums")
    return np.ascontiguousarray(scales if mins is None else join(scales, mins))


def unpack_rows(packed: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """The int8 values of `pack_rows`' q (the inverse, for tests and references)."""
    if fmt.bits == 8:
        return packed.astype(np.int8)
    rows, half = packed.shape
    blocks = packed.reshape(rows, -1, fmt.block // 2)
    low, high = (blocks & 0xF).astype(np.int8), (blocks >> 4).astype(np.int8)
    return (np.concatenate([low, high], axis=-1) - fmt.offset).reshape(rows, 2 * half).astype(np.int8)


def pack_panels(q: np.ndarray, scales: np.ndarray, fmt: WeightFormat, mins: np.ndarray | None = None) -> tuple:
    """(q, scales) of a [K, N] matrix quantized along K (axis 0) in the panels layout (see the module doc); an
    asymmetric format's scales [P, K / 32, 32]: per block a panel's 16 scales, then its 16 mins."""
    K, N = q.shape
    panels = -(-N // PANEL)
    padded_q = np.zeros((K, panels * PANEL), np.int8)
    padded_q[:, :N] = q

    def per_block(a):
        padded = np.zeros((K // fmt.block, panels * PANEL), a.dtype)
        padded[:, :N] = a
        return padded.reshape(-1, panels, PANEL).transpose(1, 0, 2)

    s_panels = _with_mins(scales, mins, fmt, lambda d, m: np.concatenate([per_block(d), per_block(m)], -1))
    if not fmt.has_min:
        s_panels = np.ascontiguousarray(per_block(scales))
    q_panels = padded_q.reshape(K, panels, PANEL).transpose(1, 0, 2)
    if fmt.bits == 8:
        return np.ascontiguousarray(q_panels), s_panels
    stored = (q_panels.astype(np.int16) + fmt.offset).astype(np.uint8)
    half = PANEL // 2
    return group_rows(stored[..., :half] | (stored[..., half:] << 4)), s_panels


# --------------------------------------------------------------------------------------------
# CPU kernels over quantized panels (TVMScript, the loops are the schedule; see cpu._gemv_panels)
# --------------------------------------------------------------------------------------------

HALF = PANEL // 2  # int4 panels: bytes per k step (columns v and v + 8 share byte v)


# Quantized decode with fp32 activations: panels per task where the registers allow (AVX-512). Their block sums
# double the accumulators.
QUANT_GEMV_PANELS = 4

X8_GEMV_PANELS = 1
"""Decode with int8 activations under AVX-512 (gemv_panels_q4x8, gemv_panels_q8x8, kquant_gemv.gemv_panels_kq_x8):
panels per task. One: a thread then reads its panels as one sequential stream (each panel's bytes follow the
last's), which its prefetchers follow while the unpacking and dot products run; several panels in lockstep are as
many streams, whose misses the core waits out between bursts of arithmetic. Measured from DRAM on a 2-core Zen 5
(2 threads, the next task's and the near prefetches below, alternated in one process): int8 896 x 151936 35.8-37.0
GB/s against 25.1-32.7 at 8 a task, int4 896 x 4864 29.2-36.2 against 23.3-27.4 at 4, q5_0 896 x 4864 31.5-33.8
against 25.7-29.5, q4_k 4864 x 896 29.7-29.8 against 23.7-25.2, q6_k 4864 x 896 31.1-31.5 against 26.4-27.0. (The
fp32 GEMV, whose arithmetic never waits, streams alike at 1, 4 or 8 panels a task there: 40-44 GB/s.) Register
reuse is not at stake: x's pattern vector a panel reads is in L1. (A 2-core Xeon measured 4 a task against 8 only:
int4 15.1-17.7 GB/s against 13.7-16.2, int8 18.4-20.3 against 19.6-21.4; one a task was not timed there.)"""

PREFETCH_TASK_BYTES = 256 << 10
"""The int8-activation decode GEMVs prefetch the next task's panels (to L2, a line per line read, at the same
block) while a task runs where a task reads at most this many weight bytes: a task's short panel streams end
before the hardware prefetcher has ramped up on the next task's. Measured on a 2-core Intel Xeon
(AVX512-VNNI; 2 threads, matrices streamed from DRAM, the two variants alternated in one process, time without
prefetch / with): int4 panels (4 a task) 2048 x 6144 1.30x, 2048 x 2048 1.21x, 2048 x 8192 1.27x, 8192 x 2048
(256 KiB a task) 1.23x, 2048 x 32000 1.21x; int8 (8 a task) the predictors' second layers 128-896 x 8192
1.08-1.34x, 2048 x 6144 1.13x, 2048 x 32000 1.18x, 2048 x 2048 1.04x, but 8192 x 2048 (1 MiB a task) 0.72x."""

PREFETCH_NEAR_BYTES = 1024
"""... and the lines this many bytes ahead in the task's own stream, to L1: the L2 prefetch above is a task's
length ahead, this one the few hundred cycles of arithmetic a line's wait would otherwise stall. Zen 5, one panel a
task: 3-8% on top of it (int8 896 x 151936 35.8-37.0 against 33.7-35.4 GB/s, int4 4864 x 896 29.2-32.1 against
27.5-29.8)."""


def stream_prefetcher(panels, group, panel_bytes, regions):
    """A macro prefetch_next(wf, t, kb) for the int8-activation decode GEMVs (wf: the flat weights, panels of
    `panel_bytes` bytes; `regions`: (start, bytes a 32-row block) of each part of a panel the kernel reads block by
    block, e.g. the nibbles then the high bits): while task t reads block kb, the next task's lines of that block go
    to L2 where a task reads at most PREFETCH_TASK_BYTES, and the task's own lines PREFETCH_NEAR_BYTES ahead (in
    blocks of its first region) to L1. Addresses past the weights clamp to their last byte."""
    ahead, last = group * panel_bytes <= PREFETCH_TASK_BYTES, panels * panel_bytes - 1
    near = -(-PREFETCH_NEAR_BYTES // regions[0][1]) if PREFETCH_NEAR_BYTES > 0 else 0  # blocks ahead
    (start0, bytes0), (start1, bytes1) = (*regions, (0, 0))[:2]  # (TVMScript unrolls loops over ints, not tuples)

    @T.macro
    def prefetch_region(wf, t, kb, start, block_bytes):
        for g in T.unroll(group):
            for line in T.unroll(block_bytes // 64):
                if near > 0:
                    prefetch(T.address_of(wf[T.min((t * group + g) * panel_bytes + start + (kb + near) * block_bytes
                                                   + line * 64, last)]), 3)
                if ahead:
                    prefetch(T.address_of(wf[T.min(((t + 1) * group + g) * panel_bytes + start + kb * block_bytes
                                                   + line * 64, last)]), 2)

    @T.macro
    def prefetch_next(wf, t, kb):
        prefetch_region(wf, t, kb, start0, bytes0)
        if bytes1 > 0:
            prefetch_region(wf, t, kb, start1, bytes1)

    return prefetch_next


def gemv_panels_q(name, K, N, *, bits, sdtype="float16", bias=False, act="none", residual=False, group=None,
                  has_min=False):
    """Decode y[1, N] = act(x[1, K] @ W + b) + res, W in the quant panels layout.  Args: x, w, ws, (b), (res), y.

    int8: w [P, K, 16] int8; int4: w [P, K, 8] uint8 (q + 8 nibbles; int4a, `has_min`: q); ws [P, K / 32, 16]
    in `sdtype` (int4a: [P, K / 32, 32], the scales then the mins).
    Each parallel task takes `group` adjacent panels (default: as cpu._gemv_panels); per 32-row block it sums
    x[k] * q in registers and adds that sum times the block's scales to the accumulators (one multiply per
    block), then runs the epilogue on the accumulators.
    """
    _check(K, N, bits, K, "K", has_min)
    panels = -(-N // PANEL)
    group = group or _cpu.gemv_group(panels, QUANT_GEMV_PANELS)
    epilogue = _cpu._epilogue(act, bias, residual)
    kernel = _gemv_q8(K, N, panels, group, sdtype, epilogue) if bits == 8 else _gemv_q4(K, N, panels, group, sdtype,
                                                                                         epilogue, has_min)
    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)


def _gemv_q8(K, N, panels, group, sdtype, epilogue):
    """gemv_panels_q's int8 kernel: per k, one int8 -> fp32 conversion and FMA per 16 columns."""
    B, nb, width = QUANT_BLOCK, K // QUANT_BLOCK, group * PANEL
    full = N % width == 0

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, K, PANEL), "int8"),
               ws: T.Buffer((panels, nb, PANEL), sdtype), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(panels // group):
            acc = T.alloc_local((width,), "float32")
            part = T.alloc_local((width,), "float32")
            for j in T.vectorized(width):
                acc[j] = T.float32(0)
            for kb in range(nb):
                for j in T.vectorized(width):
                    part[j] = T.float32(0)
                for kk in range(B):
                    for g in T.unroll(group):
                        for v in T.vectorized(PANEL):
                            part[g * PANEL + v] = part[g * PANEL + v] + x[0, kb * B + kk] * T.Cast(
                                "float32", w[t * group + g, kb * B + kk, v])
                for g in T.unroll(group):
                    for v in T.vectorized(PANEL):
                        acc[g * PANEL + v] = acc[g * PANEL + v] + part[g * PANEL + v] * load_f32(
                            ws[t * group + g, kb, v], sdtype)
            for j in (T.vectorized if full else T.serial)(width):
                if full or t * width + j < N:
                    y[0, t * width + j] = epilogue(acc[j], b, res, 0, t * width + j)

    return kernel


def _gemv_q4(K, N, panels, group, sdtype, epilogue, has_min=False):
    """gemv_panels_q's int4 kernel. It computes two k steps per vector: lanes 0-7 are row k, 8-15 row k + 1, so a
    k pair's low nibbles are one vector (columns 0-7) and its high nibbles another (columns 8-15), against
    x[k] x8 ++ x[k+1] x8 (xp, made once per call); lanes l and l + 8 are summed in the epilogue. A 4-row group's
    32 bytes (stored grouped: a dword one column pair's 4 rows) are put in the pairs' order by two shuffles
    (`pair_of_group`). The +8
    offset is folded into the block sums' start, -8 * sum(x) over the block (xc). int4a (`has_min`): xc holds
    the block sums of x themselves (lanes 0-7 the even k, 8-15 the odd), and each block adds m * xc to the
    accumulators beside d * its sums: sum_k (d q_k + m) x_k = d sum_k q_k x_k + m sum_k x_k."""
    B, nb, width = QUANT_BLOCK, K // QUANT_BLOCK, group * PANEL
    full = N % width == 0
    factor = T.float32(1) if has_min else T.float32(-INT4_OFFSET)  # xc: sum(x), or the offset's -8 sum(x)

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, K, HALF), "uint8"),
               ws: T.Buffer((panels, nb, PANEL * (1 + has_min)), sdtype), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        qf = T.decl_buffer((panels * K * HALF,), "uint8", data=w.data)
        xp = T.alloc_buffer((K // 2, PANEL), "float32")
        xc = T.alloc_buffer((nb, PANEL), "float32")
        ctl = T.alloc_buffer((16,), "int32")
        ctl8 = T.decl_buffer((64,), "int8", data=ctl.data)
        pair_controls(ctl, ctl8)
        for j in range(K // 2):
            for v in T.vectorized(PANEL):
                xp[j, v] = x[0, 2 * j + v // HALF]
        for kb in range(nb):
            for v in T.vectorized(PANEL):
                xc[kb, v] = T.float32(0)
            for j in range(B // 2):
                for v in T.vectorized(PANEL):
                    xc[kb, v] = xc[kb, v] + factor * xp[kb * (B // 2) + j, v]
        for t in T.parallel(panels // group):
            acc = T.alloc_local((group, 2, PANEL), "float32")
            part = T.alloc_local((group, 2, PANEL), "float32")
            for g, h in T.grid(group, 2):
                for v in T.vectorized(PANEL):
                    acc[g, h, v] = T.float32(0)
            for kb in range(nb):
                for g, h in T.grid(group, 2):
                    for v in T.vectorized(PANEL):
                        if has_min:
                            part[g, h, v] = T.float32(0)
                        else:
                            part[g, h, v] = xc[kb, v]
                for j4 in T.unroll(B // 4):
                    for g in T.unroll(group):
                        part[g, 0, T.ramp(0, 1, PANEL)] = part[g, 0, T.ramp(0, 1, PANEL)] + xp[
                            kb * (B // 2) + 2 * j4, T.ramp(0, 1, PANEL)] * _k_pair(
                                qf, (ctl, ctl8), ((t * group + g) * K + kb * B + 4 * j4) * HALF, 0, 0)
                        part[g, 1, T.ramp(0, 1, PANEL)] = part[g, 1, T.ramp(0, 1, PANEL)] + xp[
                            kb * (B // 2) + 2 * j4, T.ramp(0, 1, PANEL)] * _k_pair(
                                qf, (ctl, ctl8), ((t * group + g) * K + kb * B + 4 * j4) * HALF, 0, 1)
                        part[g, 0, T.ramp(0, 1, PANEL)] = part[g, 0, T.ramp(0, 1, PANEL)] + xp[
                            kb * (B // 2) + 2 * j4 + 1, T.ramp(0, 1, PANEL)] * _k_pair(
                                qf, (ctl, ctl8), ((t * group + g) * K + kb * B + 4 * j4) * HALF, 1, 0)
                        part[g, 1, T.ramp(0, 1, PANEL)] = part[g, 1, T.ramp(0, 1, PANEL)] + xp[
                            kb * (B // 2) + 2 * j4 + 1, T.ramp(0, 1, PANEL)] * _k_pair(
                                qf, (ctl, ctl8), ((t * group + g) * K + kb * B + 4 * j4) * HALF, 1, 1)
                for g, h, half in T.grid(group, 2, 2):
                    for c in T.vectorized(HALF):
                        acc[g, h, half * HALF + c] = acc[g, h, half * HALF + c] + part[g, h, half * HALF + c] * load_f32(
                            ws[t * group + g, kb, h * HALF + c], sdtype)
                if has_min:
                    for g, h, half in T.grid(group, 2, 2):
                        for c in T.vectorized(HALF):
                            acc[g, h, half * HALF + c] = acc[g, h, half * HALF + c] + xc[
                                kb, half * HALF + c] * load_f32(ws[t * group + g, kb, PANEL + h * HALF + c], sdtype)
            for g, h in T.grid(group, 2):
                for c in (T.vectorized if full else T.serial)(HALF):
                    if full or t * width + g * PANEL + h * HALF + c < N:
                        y[0, t * width + g * PANEL + h * HALF + c] = epilogue(
                            acc[g, h, c] + acc[g, h, HALF + c], b, res, 0, t * width + g * PANEL + h * HALF + c)

    return kernel


@T.macro
def pair_controls(ctl, ctl8):
    """`pair_of_group`'s shuffle controls into ctl int32 [16] (vpermd's, then vpshufb's in its bytes 32 .. 63,
    ctl8 its int8 view), made at run time so that LLVM keeps one pair of shuffles for both pairs of a group."""
    for d in range(8):
        ctl[d] = d % 2 * 4 + d // 2
    for i in range(32):
        ctl8[32 + i] = T.Cast("int8", 4 * (i % 4) + i % 16 // 4)


def pair_of_group(codes, ctls, q):
    """The fp32 codes of k pair q (a Python 0 or 1) of a 4-row group's 32 code bytes in the stored (grouped)
    order (`codes` uint8x32: a dword one column's 4 rows) as 16 lanes, lanes 0-7 the pair's first row and 8-15
    its second: vpshufb (in each 16-byte lane a 4x4 byte transpose: dword r is row r of the lane's 4 columns)
    and vpermd (the two lanes' dwords interleaved: the group's first pair, then its second), controls from
    `ctls` (`pair_controls`)."""
    rows = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.pshuf.b", T.reinterpret("int8x32", codes),
                                   ctls[1][T.ramp(32, 1, 32)])
    pairs = T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.permd", T.reinterpret("int32x8", rows),
                                    ctls[0][T.ramp(0, 1, 8)])
    return T.Cast(f"float32x{PANEL}", T.Shuffle([T.reinterpret("uint8x32", pairs)],
                                                 [tirx.IntImm("int32", PANEL * q + v) for v in range(PANEL)]))


def _k_pair(qf, ctls, start, q, nib_half):
    """The fp32 codes of k pair q of the 4-row group of int4 panel bytes at qf[start] (nibble half 0: columns
    0-7, 1: 8-15), as `pair_of_group` gives them."""
    raw = qf[T.ramp(start, 1, 4 * HALF)]
    nibbles = raw & T.broadcast(T.uint8(15), 4 * HALF) if nib_half == 0 else raw >> T.broadcast(T.uint8(4), 4 * HALF)
    return pair_of_group(nibbles, ctls, q)


# int8 activations for int4 weights: x is quantized per 32-block (ORT's accuracy_level 4, llama.cpp's Q8_0 x)
# and the block sums are integer dot products of the stored bytes (u8, q + 8) with x's (s8), a vector of
# `lanes` int32 lanes (16: AVX-512, 8: AVX2) at a time: 4 * lanes bytes of a panel, lanes / 2 k steps.
DOTS = {  # (dot, lanes): the LLVM intrinsics of sum_j a[4 l + j] * b[4 l + j], a unsigned, b signed bytes
    ("vnni", 16): ("llvm.x86.avx512.vpdpbusd.512",),  # AVX512-VNNI: one instruction per 64 products
    ("madd", 16): ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),  # AVX512BW
    ("madd", 8): ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),  # AVX2
}


def dot_u8s8(dot, lanes, acc, a, b):
    """acc[l] + sum_j a[4 l + j] * b[4 l + j] over int32 lanes."""
    names = DOTS[(dot, lanes)]
    if dot == "vnni":
        return T.call_llvm_pure_intrin(f"int32x{lanes}", names[0], acc, a, b)
    pairs = T.call_llvm_pure_intrin(f"int16x{2 * lanes}", names[0], a, b)  # no saturation: 15 * 127 * 2 < 2^15
    return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", names[1], pairs, T.broadcast(T.int16(1), 2 * lanes))


def dot2_u8s8(dot, lanes, acc, a, b, c, d):
    """acc[l] + sum_j a[4 l + j] * b[4 l + j] + c[4 l + j] * d[4 l + j] (a, c unsigned codes < 64, b, d in
    [-127, 127]): with "madd" the two vpmaddubsw pair sums are added in int16 (2 * 2 * 63 * 127 < 2^15), one
    vpmaddwd for both."""
    if dot == "vnni":
        return dot_u8s8(dot, lanes, dot_u8s8(dot, lanes, acc, a, b), c, d)
    names = DOTS[(dot, lanes)]
    pairs = (T.call_llvm_pure_intrin(f"int16x{2 * lanes}", names[0], a, b)
             + T.call_llvm_pure_intrin(f"int16x{2 * lanes}", names[0], c, d))
    return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", names[1], pairs, T.broadcast(T.int16(1), 2 * lanes))


def dot_s8s8_avx2(acc, w, x):
    """acc[l] + sum_j w[4 l + j] * x[4 l + j] over 8 int32 lanes, w int8 (any), x int8 in [-127, 127]: |w| (unsigned)
    times x with w's sign (`vpsignb`), in vpmaddubsw's pair sums (2 * 128 * 127 < 2^15) and one vpmaddwd."""
    magnitude = T.reinterpret("uint8x32", T.call_llvm_pure_intrin("int8x32", "llvm.abs", w, T.bool(False)))
    signed = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", x, w)
    names = DOTS[("madd", 8)]
    pairs = T.call_llvm_pure_intrin("int16x16", names[0], magnitude, signed)
    return acc + T.call_llvm_pure_intrin("int32x8", names[1], pairs, T.broadcast(T.int16(1), 16))


def gemv_int8_dot_fits(bits: int, dot: str, tile_panels: int) -> bool:
    """Whether linear_panels_q's decode GEMV takes int8 activations with `dot` over `bits`-bit weights on that
    register budget (its ValueErrors' rule): int4 with any dot of the vector width, int8 with VNNI in zmm."""
    lanes = 16 if tile_panels > 1 else 8
    return (dot, lanes) in DOTS and (bits == 4 or (bits == 8 and dot == "vnni"))


def gemm_int8_dot_fits(bits: int, dot: str | None, tile_panels: int) -> bool:
    """Whether a prefill GEMM over `bits`-bit panels quantizes each row of x to int8 (gemm_panels_qx8): int4 with
    any dot of the vector width, int8 with VNNI in zmm or in ymm (AVX2, the sign trick)."""
    lanes = 16 if tile_panels > 1 else 8
    return (dot, lanes) in DOTS and (bits == 4 or (bits == 8 and (dot == "vnni" or lanes == 8)))


def int8_activations(fmt: WeightFormat, dot: str | None, tile_panels: int, *, prompt: bool) -> bool:
    """Whether a dense matrix in `fmt` (quant's panels, or a file's blocks in kquant's) is multiplied by x quantized
    to int8 per 32-block where the ISA's integer dot product is `dot`: by its prompt GEMM (`prompt`) or its decode
    GEMV. A file's blocks take any dot in both (kquant_ops.linear_panels_kq)."""
    if dot is None or not fmt.quantized:
        return False
    if fmt.kept_from_file:
        return True
    return (gemm_int8_dot_fits if prompt else gemv_int8_dot_fits)(fmt.bits, dot, tile_panels)


def check_dot(dot, lanes):
    if (dot, lanes) not in DOTS:
        raise ValueError(f"(dot, lanes) must be one of {sorted(DOTS)}, got {(dot, lanes)!r}")


def x_quantizer(K):
    """A macro quantize_x(x, i, xq, sx, xsum, j) quantizing row i of x[m, K] to int8 per 32-block, serially,
    into slot j of flat buffers: sx[j * nb + b] = max|x| / 127 over block b (fp32; 0 for a zero block),
    xq[j * K + k] = round(x * 127 / max|x|) in [-127, 127], xsum[j * nb + b] = the int32 sum of block b's xq
    (what an offset-stored weight's dot product takes off)."""
    B, nb = QUANT_BLOCK, K // QUANT_BLOCK

    @T.macro
    def quantize_x(x, i, xq, sx, xsum, j):
        amax = T.alloc_local((PANEL,), "float32")
        stat = T.alloc_local((2,), "float32")
        for kb in range(nb):
            for v in T.vectorized(PANEL):
                amax[v] = T.max(T.abs(x[i, kb * B + v]), T.abs(x[i, kb * B + PANEL + v]))
            stat[0] = amax[0]
            for v in range(1, PANEL):
                stat[0] = T.max(stat[0], amax[v])
            sx[j * nb + kb] = stat[0] / T.float32(127)
            stat[1] = T.if_then_else(stat[0] > T.float32(0), T.float32(127) / stat[0], T.float32(0))
            for v in T.vectorized(B):
                xq[j * K + kb * B + v] = T.Cast("int8", T.round(x[i, kb * B + v] * stat[1]))
            xsum[j * nb + kb] = 0
            for v in range(B):
                xsum[j * nb + kb] = xsum[j * nb + kb] + T.Cast("int32", xq[j * K + kb * B + v])

    return quantize_x


def gemv_panels_q4x8(name, K, N, *, sdtype="float16", bias=False, act="none", residual=False, dot="vnni", lanes=16,
                     group=None, has_min=False):
    """Decode y[1, N] = act(x[1, K] @ W + b) + res, W int4 quant panels, x quantized to int8 per 32-block.
    Args: x, w, ws, (b), (res), y (as gemv_panels_q). `dot`, `lanes`: "vnni", 16 needs a target with
    AVX512-VNNI; "madd", 16 AVX512BW; "madd", 8 AVX2.

    Per call (serial prologue): x's block scales sx = max|x| / 127, xq = round(x / sx), -8 * sum(xq) per block
    (the stored offset, folded into the integer sums' start) and xpat, xq's dwords laid out as the permuted
    weights' (with 16 lanes: lanes 0-7 k steps 0-3 of the vector, lanes 8-15 k steps 4-7). Per task and block,
    each vector of a panel (stored grouped: each dword one column pair's 4 k steps) is split into
    low and high nibbles and dotted with xpat into int32 accumulators; then acc += float(sum) * ws * sx, once
    per block; lanes l and l + 8 (16 lanes) are summed in the epilogue. int4a (`has_min`, ws [P, K / 32, 32]:
    the scales then the mins): the sums start at 0 (no offset) and each block adds m * sx * sum(xq) (x's block
    sum as quantized, xs) to the first k group's lanes.
    """
    B = QUANT_BLOCK
    _check(K, N, 4, K, "K", has_min)
    check_dot(dot, lanes)
    panels = -(-N // PANEL)
    group = group or _cpu.gemv_group(panels, X8_GEMV_PANELS)
    width = group * PANEL
    nb = K // B
    full = N % width == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    nbytes = 4 * lanes  # bytes per vector
    steps = nbytes // HALF  # k steps per vector
    kgroups = lanes // HALF  # 4-step k groups per vector (lanes l and l + 8 hold different ones)
    m15, m4 = T.broadcast(T.uint8(15), nbytes), T.broadcast(T.uint8(4), nbytes)
    offset = 0 if has_min else INT4_OFFSET
    quantize_x = x_quantizer(K)
    prefetch_next = stream_prefetcher(panels, group, K * HALF, ((0, B * HALF),))

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, K, HALF), "uint8"),
               ws: T.Buffer((panels, nb, PANEL * (1 + has_min)), sdtype), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        wf = T.decl_buffer((panels * K * HALF,), "uint8", data=w.data)
        xq = T.alloc_buffer((K,), "int8")
        xq32 = T.decl_buffer((K // 4,), "int32", data=xq.data)
        sx = T.alloc_buffer((nb,), "float32")
        xs = T.alloc_buffer((nb,), "float32")
        xc = T.alloc_buffer((nb, lanes), "int32")
        xpat = T.alloc_buffer((K // steps, lanes), "int32")
        xpat8 = T.decl_buffer((K // steps * nbytes,), "int8", data=xpat.data)
        xsum = T.alloc_buffer((nb,), "int32")
        quantize_x(x, 0, xq, sx, xsum, 0)
        for kb in range(nb):
            xs[kb] = sx[kb] * T.Cast("float32", xsum[kb])
            for v in T.vectorized(lanes):
                xc[kb, v] = T.if_then_else(v < HALF, -offset * xsum[kb], 0)
        for o in range(K // steps):
            for v in T.vectorized(lanes):
                xpat[o, v] = xq32[kgroups * o + v // HALF]
        for t in T.parallel(panels // group):
            acc = T.alloc_local((group, 2, lanes), "float32")
            part = T.alloc_local((group, 2, lanes), "int32")
            for g, h in T.grid(group, 2):
                for v in T.vectorized(lanes):
                    acc[g, h, v] = T.float32(0)
            for kb in range(nb):
                for g, h in T.grid(group, 2):
                    for v in T.vectorized(lanes):
                        part[g, h, v] = xc[kb, v]
                prefetch_next(wf, t, kb)
                for o in T.unroll(B // steps):
                    for g in T.unroll(group):
                        part[g, 0, T.ramp(0, 1, lanes)] = dot_u8s8(
                            dot, lanes, part[g, 0, T.ramp(0, 1, lanes)],
                            wf[T.ramp(((t * group + g) * K + kb * B + o * steps) * HALF, 1, nbytes)] & m15,
                            xpat8[T.ramp((kb * (B // steps) + o) * nbytes, 1, nbytes)])
                        part[g, 1, T.ramp(0, 1, lanes)] = dot_u8s8(
                            dot, lanes, part[g, 1, T.ramp(0, 1, lanes)],
                            wf[T.ramp(((t * group + g) * K + kb * B + o * steps) * HALF, 1, nbytes)] >> m4,
                            xpat8[T.ramp((kb * (B // steps) + o) * nbytes, 1, nbytes)])
                for g, h, kg in T.grid(group, 2, kgroups):
                    for c in T.vectorized(HALF):
                        acc[g, h, kg * HALF + c] = acc[g, h, kg * HALF + c] + T.Cast(
                            "float32", part[g, h, kg * HALF + c]) * (load_f32(ws[t * group + g, kb, h * HALF + c], sdtype)
                                                                     * sx[kb])
                if has_min:
                    for g, h in T.grid(group, 2):
                        for c in T.vectorized(HALF):
                            acc[g, h, c] = acc[g, h, c] + load_f32(ws[t * group + g, kb, PANEL + h * HALF + c],
                                                                   sdtype) * xs[kb]
            for g, h in T.grid(group, 2):
                for c in (T.vectorized if full else T.serial)(HALF):
                    if full or t * width + g * PANEL + h * HALF + c < N:
                        y[0, t * width + g * PANEL + h * HALF + c] = epilogue(
                            _sum_kgroups(acc, g, h, c, kgroups), b, res, 0, t * width + g * PANEL + h * HALF + c)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)


def gemv_panels_q8x8(name, K, N, *, sdtype="float16", bias=False, act="none", residual=False, group=None):
    """Decode y[1, N] = act(x[1, K] @ W + b) + res, W int8 quant panels, x quantized to int8 per 32-block, with
    AVX512-VNNI (vpdpbusd; int8 weights have no vpmaddubsw form: 255 * 127 * 2 overflows its int16 pairs).
    Args: x, w, ws, (b), (res), y (as gemv_panels_q).

    A vector of a panel is 4 k steps x 16 columns; a byte permute makes each dword one column's 4 k steps, and
    q ^ 0x80 (= q + 128, unsigned) is dotted with xq's 4 k steps broadcast to every lane (xpat, made once per
    call). The +128 is taken off in the block sums' start, -128 * sum(xq) over the block (xc); then acc +=
    float(sum) * ws * sx per block, as gemv_panels_q4x8.
    """
    B, lanes = QUANT_BLOCK, 16
    _check(K, N, 8, K, "K")
    panels = -(-N // PANEL)
    group = group or _cpu.gemv_group(panels, X8_GEMV_PANELS)
    width = group * PANEL
    nb = K // B
    full = N % width == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    nbytes, steps = 4 * lanes, 4  # bytes and k steps per vector
    perm = [tirx.IntImm("int32", PANEL * (e % steps) + e // steps) for e in range(nbytes)]
    flip = T.broadcast(T.uint8(128), nbytes)
    quantize_x = x_quantizer(K)
    prefetch_next = stream_prefetcher(panels, group, K * PANEL, ((0, B * PANEL),))

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, K, PANEL), "int8"),
               ws: T.Buffer((panels, nb, PANEL), sdtype), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        wf = T.decl_buffer((panels * K * PANEL,), "uint8", data=w.data)
        xq = T.alloc_buffer((K,), "int8")
        xq32 = T.decl_buffer((K // steps,), "int32", data=xq.data)
        sx = T.alloc_buffer((nb,), "float32")
        xpat = T.alloc_buffer((K // steps, lanes), "int32")
        xpat8 = T.decl_buffer((K // steps * nbytes,), "int8", data=xpat.data)
        xsum = T.alloc_buffer((nb,), "int32")
        quantize_x(x, 0, xq, sx, xsum, 0)
        for o in range(K // steps):
            for v in T.vectorized(lanes):
                xpat[o, v] = xq32[o]
        for t in T.parallel(panels // group):
            acc = T.alloc_local((group, lanes), "float32")
            part = T.alloc_local((group, lanes), "int32")
            for g in T.unroll(group):
                for v in T.vectorized(lanes):
                    acc[g, v] = T.float32(0)
            for kb in range(nb):
                for g in T.unroll(group):
                    for v in T.vectorized(lanes):
                        part[g, v] = -128 * xsum[kb]
                prefetch_next(wf, t, kb)
                for o in T.unroll(B // steps):
                    for g in T.unroll(group):
                        part[g, T.ramp(0, 1, lanes)] = dot_u8s8(
                            "vnni", lanes, part[g, T.ramp(0, 1, lanes)],
                            T.Shuffle([wf[T.ramp(((t * group + g) * K + kb * B + o * steps) * PANEL, 1, nbytes)]],
                                      perm) ^ flip,
                            xpat8[T.ramp((kb * (B // steps) + o) * nbytes, 1, nbytes)])
                for g in T.unroll(group):
                    for v in T.vectorized(lanes):
                        acc[g, v] = acc[g, v] + T.Cast("float32", part[g, v]) * (
                            load_f32(ws[t * group + g, kb, v], sdtype) * sx[kb])
            for g in T.unroll(group):
                for v in (T.vectorized if full else T.serial)(lanes):
                    if full or t * width + g * PANEL + v < N:
                        y[0, t * width + g * PANEL + v] = epilogue(acc[g, v], b, res, 0, t * width + g * PANEL + v)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)


X8_ROWS = 4  # gemm_panels_qx8: prompt rows per register tile (x 2 panels x 2 nibbles of int32 sums: 16 zmm)


def gemm_panels_qx8(name, K, N, *, bits, sdtype="float16", bias=False, act="none", residual=False, dot="vnni",
                    tile_panels=2, has_min=False, lanes=16):
    """Prefill y[m, N] = act(x[m, K] @ W + b) + res, W int4 or int8 quant panels, each row of x quantized to int8
    per 32-block (as the decode GEMVs do, and onnxruntime's accuracy_level 4 prefill), in integer dot products
    (`dot`, `lanes`: "vnni", 16 for int4 and int8; "madd", 16 (AVX512BW) for int4; "madd", 8 (AVX2) for both,
    int8 by the sign trick below).  Args: x, w, ws, (b), (res), y (as gemv_panels_q).

    Serial prologue: every row's xq, block scales and block sums (x_quantizer). Then per parallel task
    (`tile_panels` adjacent panels) and tile of X8_ROWS rows: per 32-block, each vector of a panel (int4: stored
    as its dwords are dotted; int8: permuted, in ymm once per task into a buffer) so each dword is one column's
    4 k steps (int4: split into nibbles, two k groups' pair sums added in int16 with "madd") is dotted with every
    row's xq dwords broadcast to the lanes (int4 in zmm: two 4-step k groups, lanes l and l + 8), into int32
    sums that start at the stored offset's -offset * sum(xq); then acc += float(sum) * ws * sx. The epilogue sums
    the k groups' lanes. int4a (`has_min`): the sums start at 0, and each block adds m * sx * sum(xq) (the row's
    block sum as quantized) to the first k group's lanes, as gemv_panels_q4x8. int8 in ymm (no VNNI:
    vpmaddubsw's unsigned operand would overflow its int16 pair sums as q + 128): |q| times xq with q's sign
    (`vpsignb`), 2 * 128 * 127 < 2^15, a column half (8 columns) per vector.
    """
    B = QUANT_BLOCK
    _check(K, N, bits, K, "K", has_min)
    check_dot(dot, lanes)
    if bits == 8 and (dot, lanes) not in (("vnni", 16), ("madd", 8)):
        raise ValueError("int8 weights take int8 activations with dot='vnni' in zmm or 'madd' in ymm only")
    m = row_dim(None)
    panels = -(-N // PANEL)
    TP = tile_panels if panels % tile_panels == 0 else 1
    MR = X8_ROWS
    nb = K // B
    full = N % PANEL == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    int4 = bits == 4
    signed = bits == 8 and lanes == 8  # int8 in ymm: the sign trick
    nbytes = 4 * lanes  # bytes per vector
    kbytes = HALF if int4 else PANEL  # bytes of a panel per k step
    steps = nbytes // kbytes if int4 else 4  # k steps per vector
    H = 2 if int4 or signed else 1  # int32 sums per panel: int4's nibbles, or int8's column halves in ymm
    kgroups = steps // 4  # 4-step k groups per vector (int4 in zmm: lanes 0-7 the first, 8-15 the second)
    CW = lanes // kgroups  # columns per sum vector
    offset = (0 if has_min else INT4_OFFSET) if int4 else (0 if signed else 128)  # int8 in zmm: q ^ 0x80 = q + 128
    perm = [tirx.IntImm("int32", PANEL * (e % 4) + e // 4) for e in range(64)]  # int8's (int4: stored so)
    halves = [[tirx.IntImm("int32", PANEL * (e % 4) + h * HALF + e // 4) for e in range(32)] for h in range(2)]
    m15, m4 = T.broadcast(T.uint8(15), nbytes), T.broadcast(T.uint8(4), nbytes)
    flip = T.broadcast(T.uint8(128), 64)
    quantize_x = x_quantizer(K)

    xbytes = [tirx.IntImm("int32", 4 * (e // 4 // CW) + e % 4) for e in range(nbytes)]  # byte -> its xq byte

    def xdwords(xq, row, k0):  # row's xq at k0 .. k0 + steps, each k group's 4 bytes over its lanes
        return T.Shuffle([xq[T.ramp(row * K + k0, 1, steps)]] * (nbytes // steps), xbytes)
        # (a shuffle has no more lanes than its operands: the copies only make up the width)

    def weights(wf, p, k0):  # a panel's vector at k0 (int8: 4 k steps, permuted to column dwords)
        if int4:
            return wf[T.ramp((p * K + k0) * kbytes, 1, nbytes)]
        return T.Shuffle([wf[T.ramp((p * K + k0) * kbytes, 1, 64)]], perm)

    def half_weights(wf, p, k0, h):  # int8 in ymm: column half h's 8 columns x 4 k steps at k0, as int8
        return T.reinterpret("int8x32", T.Shuffle([wf[T.ramp((p * K + k0) * kbytes, 1, 64)]], halves[h]))

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer((panels, K, kbytes), "uint8" if int4 else "int8"),
               ws: T.Buffer((panels, nb, PANEL * (1 + has_min)), sdtype), b: T.Buffer((N,), "float32"),
               res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        res = T.match_buffer(res_h, (m, N), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        wf = T.decl_buffer((panels * K * kbytes,), "uint8", data=w.data)
        xq = T.alloc_buffer((m * K,), "int8")
        sx = T.alloc_buffer((m * nb,), "float32")
        xsum = T.alloc_buffer((m * nb,), "int32")
        for i in range(m):
            quantize_x(x, i, xq, sx, xsum, i)
        for t in T.parallel(panels // TP):
            wc = T.alloc_buffer((TP * 2 * (K // 4) * 32 if signed else 1,), "int8")  # int8 in ymm: permuted once
            if signed:
                for g, kq in T.grid(TP, K // 4):
                    wc[T.ramp((g * 2 * (K // 4) + kq) * 32, 1, 32)] = half_weights(wf, t * TP + g, kq * 4, 0)
                    wc[T.ramp(((g * 2 + 1) * (K // 4) + kq) * 32, 1, 32)] = half_weights(wf, t * TP + g, kq * 4, 1)
            for io in range((m + MR - 1) // MR):
                acc = T.alloc_local((MR, TP, H, lanes), "float32")
                part = T.alloc_local((MR, TP, H, lanes), "int32")
                for r, g, h in T.grid(MR, TP, H):
                    for v in T.vectorized(lanes):
                        acc[r, g, h, v] = T.float32(0)
                for kb in range(nb):
                    for r, g, h in T.grid(MR, TP, H):
                        for v in T.vectorized(lanes):
                            part[r, g, h, v] = T.if_then_else(
                                v < CW, -offset * xsum[T.min(io * MR + r, m - 1) * nb + kb], 0)
                    if int4:
                        for o in T.unroll(B // steps // 2):
                            for g in T.unroll(TP):
                                for r in T.unroll(MR):
                                    part[r, g, 0, T.ramp(0, 1, lanes)] = dot2_u8s8(
                                        dot, lanes, part[r, g, 0, T.ramp(0, 1, lanes)],
                                        weights(wf, t * TP + g, kb * B + 2 * o * steps) & m15,
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + 2 * o * steps),
                                        weights(wf, t * TP + g, kb * B + (2 * o + 1) * steps) & m15,
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + (2 * o + 1) * steps))
                                    part[r, g, 1, T.ramp(0, 1, lanes)] = dot2_u8s8(
                                        dot, lanes, part[r, g, 1, T.ramp(0, 1, lanes)],
                                        weights(wf, t * TP + g, kb * B + 2 * o * steps) >> m4,
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + 2 * o * steps),
                                        weights(wf, t * TP + g, kb * B + (2 * o + 1) * steps) >> m4,
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + (2 * o + 1) * steps))
                    elif signed:
                        for o in T.unroll(B // steps):
                            for g in T.unroll(TP):
                                for r in T.unroll(MR):
                                    part[r, g, 0, T.ramp(0, 1, lanes)] = dot_s8s8_avx2(
                                        part[r, g, 0, T.ramp(0, 1, lanes)],
                                        wc[T.ramp(((g * 2 + 0) * (K // 4) + kb * (B // 4) + o) * 32, 1, 32)],
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + o * 4))
                                    part[r, g, 1, T.ramp(0, 1, lanes)] = dot_s8s8_avx2(
                                        part[r, g, 1, T.ramp(0, 1, lanes)],
                                        wc[T.ramp(((g * 2 + 1) * (K // 4) + kb * (B // 4) + o) * 32, 1, 32)],
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + o * 4))
                    else:
                        for o in T.unroll(B // steps):
                            for g in T.unroll(TP):
                                for r in T.unroll(MR):
                                    part[r, g, 0, T.ramp(0, 1, lanes)] = dot_u8s8(
                                        dot, lanes, part[r, g, 0, T.ramp(0, 1, lanes)],
                                        weights(wf, t * TP + g, kb * B + o * steps) ^ flip,
                                        xdwords(xq, T.min(io * MR + r, m - 1), kb * B + o * steps))
                    for r, g, h, kg in T.grid(MR, TP, H, kgroups):
                        for c in T.vectorized(CW):
                            acc[r, g, h, kg * CW + c] = acc[r, g, h, kg * CW + c] + T.Cast(
                                "float32", part[r, g, h, kg * CW + c]) * (
                                load_f32(ws[t * TP + g, kb, h * CW + c], sdtype)
                                * sx[T.min(io * MR + r, m - 1) * nb + kb])
                    if has_min:
                        for r, g, h in T.grid(MR, TP, H):
                            for c in T.vectorized(CW):
                                acc[r, g, h, c] = acc[r, g, h, c] + load_f32(ws[t * TP + g, kb, PANEL + h * CW + c],
                                                                             sdtype) * (
                                    sx[T.min(io * MR + r, m - 1) * nb + kb]
                                    * T.Cast("float32", xsum[T.min(io * MR + r, m - 1) * nb + kb]))
                for r in T.unroll(MR):
                    if io * MR + r < m:
                        for g, h in T.grid(TP, H):
                            for c in (T.vectorized if full else T.serial)(CW):
                                if full or (t * TP + g) * PANEL + h * CW + c < N:
                                    y[io * MR + r, (t * TP + g) * PANEL + h * CW + c] = epilogue(
                                        _sum_lanes(acc, r, g, h, c, kgroups, CW), b, res, io * MR + r,
                                        (t * TP + g) * PANEL + h * CW + c)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)


def _sum_lanes(acc, r, g, h, c, kgroups, width):
    """Column h * width + c of panel g, row r: the sum of its lanes c, c + width, ... (one per k group)."""
    total = acc[r, g, h, c]
    for kg in range(1, kgroups):
        total = total + acc[r, g, h, kg * width + c]
    return total


def _sum_kgroups(acc, g, h, c, kgroups):
    """Column h * 8 + c of panel g: the sum of its lanes c, c + 8, ... (one per 4-step k group of a vector)."""
    total = acc[g, h, c]
    for kg in range(1, kgroups):
        total = total + acc[g, h, kg * HALF + c]
    return total


# --------------------------------------------------------------------------------------------
# Prefill: cpu.gemm over quantized weights, dequantized into its per-task fp32 panels
# --------------------------------------------------------------------------------------------


def _int4(byte, high, offset=INT4_OFFSET):
    """The int4 weight q (stored q + offset: int4's 8, int4a's 0) in the low (high=0) or high (high=1) nibble of
    `byte`, as fp32. `high` may be an expression (a loop-dependent nibble)."""
    return T.Cast("float32", ((T.Cast("int32", byte) >> (high * 4)) & 15) - offset)


def _dequantized(value, ws, scale_at, min_at, sdtype, has_min):
    """value * the block's scale ws[scale_at] (+ its minimum ws[min_at] where it `has_min`), as fp32."""
    scaled = value * load_f32(ws[scale_at], sdtype)
    return scaled + load_f32(ws[min_at], sdtype) if has_min else scaled


def _int8(value):
    return T.Cast("float32", value)


def _check(K, N, bits, axis_len, axis, has_min=False):
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if has_min and bits != 4:
        raise ValueError("blocks with minimums (int4a) are 4-bit")
    if axis_len % QUANT_BLOCK or axis_len <= 0:
        raise ValueError(f"a {K}x{N} weight blocked along {axis} needs {axis} a multiple of {QUANT_BLOCK}")


def panels_weight(K, N, *, bits, sdtype="float16", has_min=False) -> _cpu.GemmWeight:
    """The quant panels layout (pack_panels) as a gemm operand: w [P, K, 16] int8 / [P, K, 8] uint8,
    ws [P, K / 32, 16] (int4a: [P, K / 32, 32], the scales then the mins); a task dequantizes its panels k step
    by k step (int8: one 64 B line of packed per k; int4: a k's bytes are 4 apart, kquant.grouped_byte)."""
    _check(K, N, bits, K, "K", has_min)
    panels, B = -(-N // PANEL), QUANT_BLOCK
    offset = 0 if has_min else INT4_OFFSET

    def make(tile_panels):
        @T.macro
        def pack(packed, w, ws, p):
            for q, k in T.grid(tile_panels, K):
                if bits == 8:
                    for v in T.vectorized(PANEL):
                        packed[q, k, v] = _int8(w[p * tile_panels + q, k, v]) * load_f32(
                            ws[p * tile_panels + q, k // B, v], sdtype)
                else:
                    wf = T.decl_buffer((panels * K * HALF,), "uint8", data=w.data)
                    for v in T.vectorized(HALF):
                        packed[q, k, v] = _dequantized(
                            _int4(wf[(p * tile_panels + q) * K * HALF + grouped_byte(k, v)], 0, offset), ws,
                            (p * tile_panels + q, k // B, v), (p * tile_panels + q, k // B, PANEL + v), sdtype, has_min)
                        packed[q, k, HALF + v] = _dequantized(
                            _int4(wf[(p * tile_panels + q) * K * HALF + grouped_byte(k, v)], 1, offset), ws,
                            (p * tile_panels + q, k // B, HALF + v), (p * tile_panels + q, k // B, PANEL + HALF + v),
                            sdtype, has_min)

        return pack

    wq = ((panels, K, PANEL if bits == 8 else HALF), "int8" if bits == 8 else "uint8")
    return _cpu.GemmWeight(wq, ((panels, K // B, PANEL * (1 + has_min)), sdtype), make)


def rows_weight(K, N, *, bits, sdtype="float16") -> _cpu.GemmWeight:
    """Quant rows of an [N, K] weight (pack_rows of W^T, one row per output: the FFN up rows) as a gemm operand:
    w [N, K] int8 / [N, K / 2] uint8, ws [N, K / 32]; panel column v is row n, dequantized along k (int4: byte
    16 b + i of a row holds k = 32 b + i and 32 b + 16 + i)."""
    _check(K, N, bits, K, "K")
    B = QUANT_BLOCK

    def make(tile_panels):
        @T.macro
        def pack(packed, w, ws, p):
            for q, v in T.grid(tile_panels, PANEL):
                n = T.min((p * tile_panels + q) * PANEL + v, N - 1)
                if bits == 8:
                    for k in range(K):
                        packed[q, k, v] = _int8(w[n, k]) * load_f32(ws[n, k // B], sdtype)
                else:
                    for kb, i in T.grid(K // B, B // 2):
                        packed[q, kb * B + i, v] = _int4(w[n, kb * (B // 2) + i], 0) * load_f32(ws[n, kb], sdtype)
                        packed[q, kb * B + B // 2 + i, v] = _int4(w[n, kb * (B // 2) + i], 1) * load_f32(
                            ws[n, kb], sdtype)

        return pack

    wq = ((N, K), "int8") if bits == 8 else ((N, K // 2), "uint8")
    return _cpu.GemmWeight(wq, ((N, K // B), sdtype), make)


def quantized_rows(R, C, *, bits, sdtype="float16", has_min=False) -> _cpu.QuantizedRows:
    """Quant rows of an [R, C] weight (pack_rows: blocks of 32 along each row) as an operand cpu.gemm_nt (the FFN
    up rows, [N, K]) and cpu.gemm_kn (the down rows, [K, N]) read in place: w [R, C] int8 / [R, C / 2] uint8,
    ws [R, C / 32] (int4a: [R, 2 C / 32], each block's scale and min), dequantized 16 elements at a time:
    elements c .. c + 15 of a row (c a multiple of 16) are half c // 16 % 2 of block c // 32 (int4: the low
    nibbles of its 16 bytes for the first half, the high ones for the second)."""
    _check(R, C, bits, C, "the row", has_min)
    B, per = QUANT_BLOCK, 1 + has_min
    offset = 0 if has_min else INT4_OFFSET

    def values(width):
        groups = T.unroll if width <= 4 * PANEL else T.serial  # (a whole row of K: a loop, not K / 16 copies)

        @T.macro
        def load(wv, i, w, ws, k, col):
            for g in groups(width // PANEL):
                for v in T.vectorized(PANEL):
                    if bits == 8:
                        wv[i, g * PANEL + v] = _int8(w[k, col + g * PANEL + v]) * load_f32(
                            ws[k, (col + g * PANEL) // B], sdtype)
                    else:
                        wv[i, g * PANEL + v] = _dequantized(
                            _int4(w[k, (col + g * PANEL) // B * PANEL + v], (col + g * PANEL) // PANEL % 2, offset),
                            ws, (k, (col + g * PANEL) // B * per), (k, (col + g * PANEL) // B * per + 1), sdtype,
                            has_min)

        return load

    wq = ((R, C), "int8") if bits == 8 else ((R, C // 2), "uint8")
    return _cpu.QuantizedRows(wq, ((R, C // B * per), sdtype), values)


def kn_weight(K, N, *, bits, sdtype="float16") -> _cpu.GemmWeight:
    """Quant rows of a [K, N] weight (pack_rows of W, one row per reduction index: the FFN down rows) as a gemm
    operand: w [K, N] int8 / [K, N / 2] uint8, ws [K, N / 32]. A 32-block of a row is two panels: panel pp
    reads the block pp // 2 (int4: the low nibbles of its 16 bytes for an even pp, the high ones for an odd)."""
    _check(K, N, bits, N, "N")
    B = QUANT_BLOCK

    def make(tile_panels):
        @T.macro
        def pack(packed, w, ws, p):
            for k, q in T.grid(K, tile_panels):
                pp = p * tile_panels + q
                for v in T.vectorized(PANEL):
                    if bits == 8:
                        packed[q, k, v] = _int8(w[k, pp * PANEL + v]) * load_f32(ws[k, pp // 2], sdtype)
                    else:
                        packed[q, k, v] = _int4(w[k, pp // 2 * PANEL + v], pp % 2) * load_f32(ws[k, pp // 2], sdtype)

        return pack

    wq = ((K, N), "int8") if bits == 8 else ((K, N // 2), "uint8")
    return _cpu.GemmWeight(wq, ((K, N // B), sdtype), make)


# --------------------------------------------------------------------------------------------
# The kernel makers (ops.linear_panels_q, ops.linear_rows_q, ops.linear_kn_q)
# --------------------------------------------------------------------------------------------


def linear_panels_q(name, K, N, *, rows, bits, sdtype="float16", bias: bool, act="none", residual=False,
                    tile_panels=1, int8_dot=None, has_min=False):
    """y[m, N] = act(x[m, K] @ W + b) + res, W in the quant panels layout (pack_panels; int8 or int4 by `bits`,
    scales in `sdtype`).  Args: x, w, ws, (b), (res), y. `tile_panels` is the ISA's register budget as for
    cpu.linear_panels (1: AVX2, 2: AVX-512), which also sizes the int4 decode tasks. Decode: gemv_panels_q, or
    with `int8_dot` ("vnni": AVX-512 with VNNI; "madd": AVX-512 or AVX2, int4 only) gemv_panels_q4x8 (int4) or
    gemv_panels_q8x8 (int8, vnni), x quantized to int8 per block (an error of ~5e-3 of max |y| on random data,
    as onnxruntime's accuracy_level 4); int8 weights with "madd" (AVX2) decode over fp32 x. Prefill: cpu.gemm
    over panels_weight, `tile_panels` per register tile; with `int8_dot`, gemm_panels_qx8 (zmm on AVX-512, ymm on
    AVX2; `gemm_int8_dot_fits`), each row of x quantized so (1.3-2.4x faster). `has_min`: int4a's blocks (bits
    4), every variant."""
    if int8_dot is not None and not (gemv_int8_dot_fits(bits, int8_dot, tile_panels)
                                     or gemm_int8_dot_fits(bits, int8_dot, tile_panels)):
        raise ValueError(f"int8 activations over int{bits} weights with {int8_dot!r} at tile_panels={tile_panels}: "
                         "int4 takes any dot of the vector width, int8 'vnni' (AVX512-VNNI) in zmm, or 'madd' in "
                         "ymm (AVX2) for prompts only")
    if rows == 1 and int8_dot is not None and gemv_int8_dot_fits(bits, int8_dot, tile_panels):
        wide = tile_panels > 1  # AVX-512: zmm vectors, X8_GEMV_PANELS panels per task; AVX2: ymm, 2
        cap = X8_GEMV_PANELS if wide else 2
        group = _cpu.gemv_group(-(-N // PANEL), cap)
        if bits == 8:
            return gemv_panels_q8x8(name, K, N, sdtype=sdtype, bias=bias, act=act, residual=residual, group=group)
        return gemv_panels_q4x8(name, K, N, sdtype=sdtype, bias=bias, act=act, residual=residual, dot=int8_dot,
                                lanes=16 if wide else 8, group=group, has_min=has_min)
    if rows == 1:  # 4 panels' accumulators and block sums fit AVX-512's 32 registers; in AVX2's 16 they spill:
        # 2 panels per task for int8, 1 for int4 (its 16-lane vectors are 2 ymm each)
        group = _cpu.gemv_group(-(-N // PANEL), QUANT_GEMV_PANELS if tile_panels > 1 else (2 if bits == 8 else 1))
        return gemv_panels_q(name, K, N, bits=bits, sdtype=sdtype, bias=bias, act=act, residual=residual, group=group,
                             has_min=has_min)
    row_dim(rows)
    if gemm_int8_dot_fits(bits, int8_dot, tile_panels):
        return gemm_panels_qx8(name, K, N, bits=bits, sdtype=sdtype, bias=bias, act=act, residual=residual,
                               dot=int8_dot, tile_panels=tile_panels, has_min=has_min,
                               lanes=16 if tile_panels > 1 else 8)
    return _cpu.gemm(name, K, N, layout=panels_weight(K, N, bits=bits, sdtype=sdtype, has_min=has_min), bias=bias,
                     act=act, residual=residual, tile_panels=tile_panels)


def linear_rows_q(name, K, N, *, rows, bits, sdtype="float16", act="none", tile_panels=1, has_min=False):
    """y[m, N] = act(x[m, K] @ W[N, K]^T + b), W quantized rows one per output neuron (quantized_rows; the FFN up
    rows, as neuron.linear_rows), read in place by cpu.gemm_nt.  Args: x, w, ws, b (zeros for bias-free models), y. Prefill only."""
    if rows is not None:
        raise ValueError("linear_rows_q runs in prefill only")
    return _cpu.gemm_nt(name, K, N, rows=quantized_rows(N, K, bits=bits, sdtype=sdtype, has_min=has_min), bias=True,
                        act=act, tile_panels=tile_panels)


def linear_kn_q(name, K, N, *, rows, bits, sdtype="float16", bias: bool, act="none", residual=False,
                tile_panels=1, skip_zero_rows=False, has_min=False):
    """y[m, N] = act(x[m, K] @ W[K, N] + b) + res, W quantized rows one per reduction index (quantized_rows; the FFN
    down rows), read in place by cpu.gemm_kn (`skip_zero_rows`: x a ReLU's output, rows only its zeros
    multiply are not read).  Args: x, w, ws, (b), (res), y. Prefill only (N a multiple of 32)."""
    if rows is not None:
        raise ValueError("linear_kn_q runs in prefill only")
    return _cpu.gemm_kn(name, K, N, rows=quantized_rows(K, N, bits=bits, sdtype=sdtype, has_min=has_min), bias=bias,
                        act=act, residual=residual, tile_panels=tile_panels, skip_zero_rows=skip_zero_rows)
