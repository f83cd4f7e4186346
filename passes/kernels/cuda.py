"""CUDA kernels for picompile (the GPU half of PowerInfer-style execution), generated with TVM 0.27.

The same kernels as ``passes.kernels.cpu`` and ``passes.kernels.neuron`` (``ops`` pairs them): same
arguments in the same order, same contracts (``compute``'s: fp32 arithmetic, row-major, ``rows=1`` decode variant,
``rows=None`` prefill variant with a symbolic int64 ``m``, int64 scalar ``start``, int32 index and
count buffers, indices from inputs clamped to their buffers), only the schedules differ: the TE kernels
are ``compute``'s definitions scheduled here, with exp / erf from ``compute.NATIVE``; the TVMScript
kernels, whose loops are their schedule, call ``compute``'s shared math.

Every loop is bound to ``blockIdx`` / ``threadIdx`` or runs serially inside one thread; buffers live in GPU
memory (the runtime passes DLPack tensors on the CUDA device, prefill row slices ``buf[:m]`` included).

Schedules, in short (each function's docstring says more):

* elementwise (``glu``, ``embed``, ``merge``): the (row, column) space flattened, 256 threads a block;
* norms: one block per row, the row statistics as block-wide cross-thread reductions (TVM emits warp
  shuffles plus a shared-memory step across warps);
* ``linear`` decode (GEMV, w is [K, N]): 32 columns per block on ``threadIdx.x`` (every warp reads a
  coalesced 128-byte run of a row of w), the K loop split over 16 ``threadIdx.y`` groups whose
  partial sums meet in shared memory;
* ``linear`` prefill and ``linear_rows`` (GEMM): 64 x 64 output tiles per block, 16 x 16 threads
  each owning a 4 x 4 register tile, x and w staged through shared memory 16 k-steps at a time;
* ``sparse_up``: one warp per active neuron (lanes over D, float4 loads, warp-shuffle all-reduce),
  a fixed grid walking the data-dependent neuron count in a grid-stride loop;
* ``sparse_down``: 32 columns per block on ``threadIdx.x``, the active rows split over 16
  ``threadIdx.y`` groups, partial sums added in shared memory;
* weights: fp32 or fp16 (``wdtype``: fp16 converted to fp32 as it is loaded or staged), or block-quantized
  int8 / int4 in ``quant``'s rows layout (``linear_qrows``, ``embed_q``, ``sparse_up_q``,
  ``sparse_down_q``; see their section): a thread takes 4 consecutive bytes of a row per step (one 32-bit
  load), a warp a coalesced 128-byte run; ``linear_qrows`` decode is a warp per output row (W^T stored
  [N, K], llama.cpp's GPU matvec layout) with a warp-shuffle reduction, its prefill the tiled GEMM with the
  weights dequantized into shared memory;
* ``select``: one block, an ordered parallel compaction (count per thread segment, block prefix sum,
  scatter);
* ``attention``: one block per (head, row), 128 threads: one key per thread for the scores, online
  (chunked) softmax, then one output dim per thread for the weighted sum of values;
* ``rope_kv_write``: one block per row, threads over (head, dim) pairs (a q / k norm's sums of squares
  first, a head per thread, meeting in shared memory).

``build`` compiles the device code with nvcc at build time (a fatbin holding SASS for the arch and PTX
for newer GPUs) and embeds that binary in the exported .so, so loading it needs only TVM's runtime
(``libtvm_runtime`` + ``libtvm_runtime_cuda``, which itself links ``libcudart.so.13``) and the CUDA
driver (one that supports CUDA 13), no compiler and no NVRTC. Note: with ``TVM_USE_RUNTIME_LIB=1``
TVM 0.27 does not load ``libtvm_runtime_cuda`` by itself (its backend autoload is skipped in
runtime-only mode); a runtime-only process must load it before ``load_module``, e.g.
``tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=[<tvm/lib>])``,
or the load fails with "ffi.Module.load_from_bytes.cuda is not registered".

Why the embedding is done by hand (TVM 0.27): ``target.build.cuda`` hands CUDA *source* to the CUDA
module factory; without a loadable CUDA runtime (no ``libcuda``, e.g. a build machine) TVM keeps a
placeholder module whose saved format is ``"cuda"`` (source), which the loader on the GPU machine would
JIT-compile through the Python callback ``tvm_callback_cuda_compile`` (Python + NVRTC/nvcc needed at
load time). ``tvm_callback_cuda_compile`` is consulted only when the real CUDA runtime is loaded in
the building process. So ``build`` (a) overrides that callback while compiling, so that a build on a
GPU machine also uses our nvcc flags, and (b) packs the module tree itself (``export_library``'s
``fpack_imports`` hook), writing the CUDA module's record as format ``"fatbin"`` with the nvcc output
as code; ``cuModuleLoadData`` loads that directly.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import struct
import subprocess
import tempfile
import time

import tvm
import tvm_ffi
from tvm.script import tirx as T

from ..targets import cuda_target

from . import compute
from .compute import clamp_count, clamp_index, drop_params, glu_unit, load_f32, rope_high, rope_low, row_dim

MATH = compute.NATIVE  # CUDA's own expf / erff: one thread per element, nothing to vectorise

WARP = 32
EW_THREADS = 256  # elementwise kernels: threads per block
NORM_THREADS = 256  # norms: most threads per row (one block per row)
GEMV_TX, GEMV_TY = 32, 16  # decode linear: columns per block x K-split groups
GEMV_UNROLL = 8  # decode linear: k steps per unrolled group (loads in flight per thread)
TILE_T, TILE_R, TILE_K = 16, 4, 16  # prefill GEMM: 16x16 threads, 4x4 outputs each, k-steps per stage
UP_WARPS = 8  # sparse_up: warps (neurons in flight) per block
UP_MAX_BLOCKS = 1024  # sparse_up: grid cap; the grid-stride loop covers the rest
DOWN_TX, DOWN_TY = 32, 16  # sparse_down: columns per block x row groups
ATTN_THREADS = 128  # attention: threads per (head, row) block = keys per softmax chunk
ROPE_THREADS = 128  # rope_kv_write: threads per row
SELECT_MAX_THREADS = 1024  # select: one block


def _ceil_div(a, b):
    return (a + b - 1) // b


def _pow2_at_least(n):
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _decode_only(kernel, rows):
    if rows != 1:
        raise ValueError(f"{kernel} runs in decode only")


def _prefill_only(kernel, rows):
    if rows is not None:
        raise ValueError(f"{kernel} runs in prefill only")


# --------------------------------------------------------------------------------------------
# Scheduling steps shared by the TE kernels
# --------------------------------------------------------------------------------------------


def _elementwise(sch, block, threads=EW_THREADS):
    """Flatten the block's loops and cut them into blocks of ``threads`` threads.

    Consecutive threads take consecutive elements of a row, so loads and stores coalesce; a
    symbolic row count just makes the block count symbolic (the tail is predicated).
    """
    fused = sch.fuse(*sch.get_loops(block))
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _row_threads(D):
    """Threads for one row of D elements: whole warps, at most NORM_THREADS."""
    return min(NORM_THREADS, _ceil_div(D, WARP) * WARP)


def _row_reductions(sch, reductions, out, D):
    """One block per row: the row statistics (``reductions``) as block-wide reductions, then ``out``.

    Each reduction's loop is split so that thread t sums elements t, t + T, ... (coalesced) and the
    thread loop is bound to threadIdx.x: TVM lowers that to an in-thread sum plus a cross-thread
    all-reduce (warp shuffles, shared memory across warps). The statistics are written to shared
    memory, where every thread of the row reads them in the elementwise pass.
    """
    threads = _row_threads(D)
    out_block = sch.get_sblock(out)
    row, col = sch.get_loops(out_block)
    sch.bind(row, "blockIdx.x")
    _, tx = sch.split(col, [None, threads])
    sch.bind(tx, "threadIdx.x")
    for name in reversed(reductions):  # consumers first, so every compute_at finds its consumer
        block = sch.get_sblock(name)
        sch.compute_at(block, row)
        sch.set_scope(block, 0, "shared")
        _, t = sch.split(sch.get_loops(block)[-1], [None, threads])
        sch.bind(t, "threadIdx.x")


def _gemv(sch, K):
    """Decode ``acc[1, N] = x @ w`` with w [K, N]: a K-split GEMV, epilogue fused.

    Block = GEMV_TX (32) columns x GEMV_TY (16) K-groups (fewer when 16 does not divide K).
    Thread (ty, tx) sums rows k = ty, ty + 16, ... of column n (rfactor over the K split), 8 rows
    per unrolled step so 8 independent loads are in flight; each warp streams a coalesced
    128-byte run of every row it visits. A decode GEMV is bound by memory latency x parallelism,
    hence the K split: N/32 blocks of 16 warps each. The partial sums of a column meet in a
    shared-memory reduction and the ty = 0 thread applies the epilogue (bias, activation,
    residual) and stores y.
    """
    block = sch.get_sblock("acc")
    _, _, k = sch.get_loops(block)
    # the K-groups must divide K: rfactor drops the bound check of a partial split (TVM 0.27)
    # and leave each thread at least two rows, or the serial k loop is folded away (small K: predictors)
    groups = max([g for g in (GEMV_TY, 8, 4, 2) if g <= GEMV_TY and K % g == 0 and K // g >= 2] or [1])
    _, ky = sch.split(k, [None, groups])
    partial = sch.rfactor(ky, 0)
    _, n, ky = sch.get_loops(block)
    bx, tx = sch.split(n, [None, GEMV_TX])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.bind(ky, "threadIdx.y")
    sch.compute_at(partial, tx)
    sch.set_scope(partial, 0, "local")
    sch.set_scope(block, 0, "local")
    ky_partial, *_, k_serial = _loops_below(sch, partial, tx)
    sch.bind(ky_partial, "threadIdx.y")
    _, k_unrolled = sch.split(k_serial, [None, min(GEMV_UNROLL, K // groups)])
    sch.unroll(k_unrolled)  # independent loads of w in flight together
    sch.reverse_compute_at(sch.get_sblock("y"), tx)


def _loops_below(sch, block, outer):
    """The loops of ``block`` nested inside the loop ``outer`` (after a compute_at)."""
    loops = sch.get_loops(block)
    target = sch.get(outer)
    for pos, loop in enumerate(loops):
        if sch.get(loop).same_as(target):
            return loops[pos + 1 :]
    raise ValueError("loop not found above the block")


def _tile_bk(K):
    """Largest k-step per shared-memory stage that divides K (no k tail)."""
    return max(b for b in (16, 8, 4, 2, 1) if b <= TILE_K and K % b == 0)


def _gemm_tile(rows):
    """The tile that ``compute.linear`` pads a prefill GEMM's operands to (none for the decode GEMV)."""
    return TILE_T * TILE_R if rows is None else None


def _gemm(sch, K, w_rows):
    """Prefill ``acc = x_tile @ w_tile``: shared-memory tiled GEMM, epilogue fused per thread.

    Block tile (16*4) x (16*4) outputs; thread (ty, tx) owns rows ty*4 .. ty*4+3 and columns
    tx*4 .. tx*4+3 in registers. Per k-stage the block cooperatively copies the x tile [64, BK]
    and the w tile ([BK, 64], or [64, BK] for row-major weights) into shared memory (consecutive
    threads, consecutive addresses; the zero padding of ``compute.linear`` is applied in this copy),
    then every thread does 4 x 4 x BK FMAs out of shared memory (x values are warp broadcasts;
    the row-major w tile, read across its rows by threadIdx.x, gets one float of padding per row
    via storage_align so those reads spread over the banks). The epilogue stores only rows < m
    and columns < N.
    """
    bk = _tile_bk(K)
    block = sch.get_sblock("acc")
    i, n, k = sch.get_loops(block)
    bi, ti, ri = sch.split(i, [None, TILE_T, TILE_R])
    bn, tn, rn = sch.split(n, [None, TILE_T, TILE_R])
    ko, ki = sch.split(k, [None, bk])
    sch.reorder(bi, bn, ti, tn, ko, ki, ri, rn)
    sch.bind(bi, "blockIdx.y")
    sch.bind(bn, "blockIdx.x")
    sch.bind(ti, "threadIdx.y")
    sch.bind(tn, "threadIdx.x")
    for name in ("x_tile", "w_tile"):
        stage = sch.get_sblock(name)
        sch.set_scope(stage, 0, "shared")
        sch.compute_at(stage, ko)
        fused = sch.fuse(*sch.get_loops(stage)[-2:])
        _, ty, tx = sch.split(fused, [None, TILE_T, TILE_T])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        if name == "w_tile" and w_rows and bk > 1:
            # [64 neurons, BK] read by threadIdx.x along the rows: pad each row by one float
            sch.storage_align(stage, 0, axis=0, factor=bk, offset=1)
    sch.set_scope(block, 0, "local")
    sch.reverse_compute_at(sch.get_sblock("y"), tn)
    sch.decompose_reduction(block, ko)
    for loop in (ki, ri, rn):
        sch.unroll(loop)


# --------------------------------------------------------------------------------------------
# TE kernels
# --------------------------------------------------------------------------------------------


def linear(name, K, N, *, rows, bias: bool, act="none", residual=False, wdtype="float32"):
    """y[m, N] = act(x[m, K] @ w[K, N] + b) + res.  Args: x, w, (b), (res), y; w in ``wdtype`` (fp32 or fp16,
    converted to fp32 where it is read: in the GEMV's loads, in the GEMM's shared-memory staging).

    Decode: K-split GEMV (``_gemv``). Prefill: shared-memory tiled GEMM (``_gemm``).
    """
    args = compute.linear(K, N, rows, bias=bias, act=act, residual=residual, math=MATH, wdtype=wdtype,
                          tile=_gemm_tile(rows))
    sch = compute.schedule(name, args)
    if rows == 1:
        _gemv(sch, K)
    else:
        _gemm(sch, K, w_rows=False)
    return sch.mod[name]


def glu(name, F, *, rows, act):
    """y[m, F] = act(t[:, :F]) * t[:, F:] (gate first, then up).  Args: t, y.  Elementwise."""
    sch = compute.schedule(name, compute.glu(F, rows, act=act, math=MATH))
    _elementwise(sch, sch.get_sblock("y"))
    return sch.mod[name]


def layer_norm(name, D, eps, *, rows):
    """y = (x - mean) / sqrt(var + eps) * g + b, biased variance (two-pass).  Args: x, g, b, y.

    One block per row: the sum, then the sum of squared deviations, as block reductions.
    """
    sch = compute.schedule(name, compute.layer_norm(D, eps, rows))
    _row_reductions(sch, ["total", "sq"], "y", D)
    return sch.mod[name]


def rms_norm(name, D, eps, *, rows):
    """y = x / sqrt(mean(x^2) + eps) * g.  Args: x, g, y.  One block per row."""
    sch = compute.schedule(name, compute.rms_norm(D, eps, rows))
    _row_reductions(sch, ["sq"], "y", D)
    return sch.mod[name]


def embed(name, V, D, *, rows, positions: int | None, wdtype="float32"):
    """y[i] = table[ids[i]] (+ pos_table[start + i]).  Args: ids, table (``wdtype``), (pos_table, start), y.

    Elementwise over (row, column): a gather of whole table rows, coalesced along the row.
    """
    sch = compute.schedule(name, compute.embed(V, D, rows, positions=positions, wdtype=wdtype))
    _elementwise(sch, sch.get_sblock("y"))
    return sch.mod[name]


def merge(name, D, parts: int, *, rows, bias: bool, residual: bool):
    """out = res + p_1 (+ p_2) + b.  Args: (res), p_1 (, p_2), (b), out; all [m, D] except b [D]."""
    sch = compute.schedule(name, compute.merge(D, parts, rows, bias=bias, residual=residual))
    _elementwise(sch, sch.get_sblock("y"))
    return sch.mod[name]


def linear_rows(name, K, N, *, rows, act="none", wdtype="float32"):
    """y[m, N] = act(x[m, K] @ w[N, K]^T + b), for weights stored one row per output neuron.

    Args: x, w (``wdtype``), b (zeros for bias-free models), y. Prefill only: the tiled GEMM of ``linear``
    with the w tile read as [64 neurons, BK] runs of weight rows.
    """
    _prefill_only("linear_rows", rows)
    args = compute.linear(K, N, rows, bias=True, act=act, residual=False, math=MATH, wdtype=wdtype, w_rows=True,
                          tile=_gemm_tile(rows))
    sch = compute.schedule(name, args)
    _gemm(sch, K, w_rows=True)
    return sch.mod[name]


# --------------------------------------------------------------------------------------------
# TVMScript kernels: data-dependent loops (count, causal bounds), in-place cache writes. Per device
# because the loops are the schedule: thread blocks, shared memory and warp shuffles here, where the
# CPU's walk vectors in one thread per row or neuron; the math they share is compute's.
# --------------------------------------------------------------------------------------------


def _vec_width(n):
    """float4 loads when a contiguous run of n floats allows it (TVM emits float4 accesses)."""
    return 4 if n % 4 == 0 else 1


def rope_kv_write(name, H, KVH, hd, max_ctx, *, rows, rope: bool, qk_norm_eps: float | None = None):
    """Split qkv rows, rotate q and k (rotate-half RoPE), write q and the KV cache in place.

    Args: qkv[m, (H+2KVH)*hd], (cos, sin [max_ctx, hd/2]), (q_norm, k_norm [hd]), kcache, vcache
    [KVH, max_ctx, hd], q[m, H*hd], start. Row i goes to cache position start + i; other positions are
    untouched. One block per row, ROPE_THREADS threads striding over the (head, dim) pairs of q, then of k,
    then over the v elements; consecutive threads touch consecutive addresses. With `qk_norm_eps` (Qwen3) each
    q and k head is first RMS-normalised over its hd values (x * 1/rms * w[j]): thread t sums the squares of
    head t (and t + ROPE_THREADS, ...) serially, the factors meet in shared memory, then the rotation reads the
    normed values (H + KVH heads of at most a few hundred values: a row's few KB, read twice).
    """
    if hd % 2:
        raise ValueError("rope_kv_write needs an even head dim")
    M = row_dim(rows)
    half = hd // 2
    width = (H + 2 * KVH) * hd
    K0, V0 = H * hd, (H + KVH) * hd  # column offsets of the k and v heads in a qkv row
    nt = ROPE_THREADS
    q_steps = _ceil_div(H * half, nt)  # rotations: one (d, d + half) pair per thread and step
    k_steps = _ceil_div(KVH * half, nt)
    qc_steps = _ceil_div(H * hd, nt)  # plain copies
    v_steps = _ceil_div(KVH * hd, nt)
    h_steps = _ceil_div(H + KVH, nt)  # the norm: one head's sum of squares per thread and step
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
        for i in T.thread_binding(M, thread="blockIdx.x"):
            for t in T.thread_binding(nt, thread="threadIdx.x"):
                factor = T.alloc_shared((H + KVH,), "float32")  # each q, then k, head's 1/rms (with a norm only)
                p = start + i
                if norm:
                    acc = T.alloc_local((1,), "float32")
                    for s in range(h_steps):
                        if s * nt + t < H + KVH:  # the q heads, then the k heads: contiguous in a qkv row
                            acc[0] = T.float32(0)
                            for d in range(hd):
                                acc[0] = acc[0] + qkv[i, (s * nt + t) * hd + d] * qkv[i, (s * nt + t) * hd + d]
                            factor[s * nt + t] = compute.head_norm_scale(acc[0], hd, eps)
                    T.tvm_storage_sync("shared")
                if rope:
                    for s in range(q_steps):
                        if s * nt + t < H * half:
                            h = (s * nt + t) // half
                            d = (s * nt + t) % half
                            q[i, h * hd + d] = rope_low(
                                qk(qkv[i, h * hd + d], factor[h], q_norm[d]),
                                qk(qkv[i, h * hd + half + d], factor[h], q_norm[half + d]), cos[p, d], sin[p, d])
                            q[i, h * hd + half + d] = rope_high(
                                qk(qkv[i, h * hd + d], factor[h], q_norm[d]),
                                qk(qkv[i, h * hd + half + d], factor[h], q_norm[half + d]), cos[p, d], sin[p, d])
                    for s in range(k_steps):
                        if s * nt + t < KVH * half:
                            h = (s * nt + t) // half
                            d = (s * nt + t) % half
                            kcache[h, p, d] = rope_low(
                                qk(qkv[i, K0 + h * hd + d], factor[H + h], k_norm[d]),
                                qk(qkv[i, K0 + h * hd + half + d], factor[H + h], k_norm[half + d]),
                                cos[p, d], sin[p, d])
                            kcache[h, p, half + d] = rope_high(
                                qk(qkv[i, K0 + h * hd + d], factor[H + h], k_norm[d]),
                                qk(qkv[i, K0 + h * hd + half + d], factor[H + h], k_norm[half + d]),
                                cos[p, d], sin[p, d])
                else:
                    for s in range(qc_steps):
                        if s * nt + t < H * hd:
                            q[i, s * nt + t] = qk(qkv[i, s * nt + t], factor[(s * nt + t) // hd],
                                                  q_norm[(s * nt + t) % hd])
                    for s in range(v_steps):
                        if s * nt + t < KVH * hd:
                            kcache[(s * nt + t) // hd, p, (s * nt + t) % hd] = qk(
                                qkv[i, K0 + s * nt + t], factor[H + (s * nt + t) // hd], k_norm[(s * nt + t) % hd])
                for s in range(v_steps):
                    if s * nt + t < KVH * hd:
                        vcache[(s * nt + t) // hd, p, (s * nt + t) % hd] = qkv[i, V0 + s * nt + t]

    # one kernel for every variant: the tables a variant never reads leave its signature
    kernel = drop_params(kernel, ([] if rope else ["cos", "sin"]) + ([] if norm else ["q_norm", "k_norm"]))
    return kernel.with_attr("global_symbol", name)


def attention(name, H, KVH, hd, max_ctx, scale, *, rows):
    """Causal grouped-query attention over the KV cache.

    Args: q[m, H*hd], kcache, vcache [KVH, max_ctx, hd], out[m, H*hd], start.
    Query head h reads kv head h // (H // KVH); row i (position start + i) attends keys
    0 .. start + i. One block per (head, row) pair (blockIdx.x = head, blockIdx.y = row), 128
    threads, keys taken 128 at a time (online softmax, so neither shared memory nor registers
    grow with the context):
      1. thread t scores key c*128 + t: s = q . k (q pre-scaled, in shared memory; float4 loads);
      2. the chunk's max and exp-sum by block tree reductions in shared memory; the running
         max, sum and output are rescaled by exp(old max - new max);
      3. thread t owns output dims t, t + 128, ...: o += p_j * v_j over the chunk's keys
         (consecutive threads read consecutive v elements).
    Keys past the causal bound are never read (their scores are -inf, their values skipped).
    """
    if H % KVH:
        raise ValueError("H must be a multiple of KVH")
    M = row_dim(rows)
    group = H // KVH
    nt = ATTN_THREADS
    levels = int(math.log2(nt))
    dims = _ceil_div(hd, nt)  # output dims per thread
    vw = _vec_width(hd)
    scale = float(scale)

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
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for i in T.thread_binding(M, thread="blockIdx.y"):
                for t in T.thread_binding(nt, thread="threadIdx.x"):
                    qs = T.alloc_shared((hd,), "float32")
                    ps = T.alloc_shared((nt,), "float32")  # the chunk's probabilities
                    red = T.alloc_shared((nt,), "float32")  # tree reduction scratch
                    st = T.alloc_local((5,), "float32")  # run max, run sum, own score, new max, rescale
                    dot = T.alloc_local((vw,), "float32")
                    o = T.alloc_local((dims,), "float32")
                    n_keys = start + i + 1
                    g = h // group
                    for e in range(dims):
                        if e * nt + t < hd:
                            qs[e * nt + t] = q[i, h * hd + e * nt + t] * T.float32(scale)
                        o[e] = T.float32(0)
                    st[0] = T.float32(compute.NEG_INF)
                    st[1] = T.float32(0)
                    T.tvm_storage_sync("shared")
                    for c in range((n_keys + nt - 1) // nt):
                        # 1. this thread's score
                        st[2] = T.float32(compute.NEG_INF)
                        if c * nt + t < n_keys:
                            for v in T.vectorized(vw):
                                dot[v] = T.float32(0)
                            for d0 in range(hd // vw):
                                for v in T.vectorized(vw):
                                    dot[v] = dot[v] + qs[d0 * vw + v] * kcache[g, c * nt + t, d0 * vw + v]
                            st[2] = dot[0]
                            for v in range(1, vw):
                                st[2] = st[2] + dot[v]
                        # 2. chunk max -> new running max
                        red[t] = st[2]
                        T.tvm_storage_sync("shared")
                        for lv in range(levels):
                            if t < T.shift_right(nt, lv + 1):
                                red[t] = T.max(red[t], red[t + T.shift_right(nt, lv + 1)])
                            T.tvm_storage_sync("shared")
                        st[3] = T.max(st[0], red[0])
                        T.tvm_storage_sync("shared")
                        # probabilities and their sum
                        st[2] = MATH.exp(st[2] - st[3])
                        ps[t] = st[2]
                        red[t] = st[2]
                        T.tvm_storage_sync("shared")
                        for lv in range(levels):
                            if t < T.shift_right(nt, lv + 1):
                                red[t] = red[t] + red[t + T.shift_right(nt, lv + 1)]
                            T.tvm_storage_sync("shared")
                        st[4] = MATH.exp(st[0] - st[3])
                        st[1] = st[1] * st[4] + red[0]
                        st[0] = st[3]
                        # 3. weighted values of the chunk's (causally visible) keys
                        for e in range(dims):
                            if e * nt + t < hd:
                                o[e] = o[e] * st[4]
                                for j in range(T.min(nt, n_keys - c * nt)):
                                    o[e] = o[e] + ps[j] * vcache[g, c * nt + j, e * nt + t]
                        T.tvm_storage_sync("shared")  # ps and red are rewritten by the next chunk
                    for e in range(dims):
                        if e * nt + t < hd:
                            out[i, h * hd + e * nt + t] = o[e] / st[1]

    return kernel.with_attr("global_symbol", name)


# --------------------------------------------------------------------------------------------
# Neuron-aware kernels (neuron.py's operators)
# --------------------------------------------------------------------------------------------


def select(name, n, *, rows, magnitude: bool = False):
    """idx[0, :count] = the positions i with scores[0, i] > threshold[0] (with `magnitude`:
    |scores[0, i]| > threshold[0]), ascending.

    Args: scores[1, n], threshold[1], idx[1, n] int32, count[1, 1] int32. One block doing an
    ordered parallel compaction: thread t owns the contiguous segment [t*E, (t+1)*E); it counts its
    passing positions, a block-wide inclusive prefix sum (Hillis-Steele in shared memory) turns the
    counts into output offsets, and each thread writes its segment's positions from its offset, in
    order. Two reads of scores, one scan of log2(threads) steps.
    """
    _decode_only("select", rows)
    nt = min(SELECT_MAX_THREADS, max(WARP, _pow2_at_least(n)))
    seg = _ceil_div(n, nt)
    levels = int(math.log2(nt))

    @T.prim_func
    def kernel(scores: T.Buffer((1, n), "float32"), threshold: T.Buffer((1,), "float32"),
               idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.thread_binding(nt, thread="threadIdx.x"):
            offsets = T.alloc_shared((nt,), "int32")
            mine = T.alloc_local((3,), "int32")  # own count, scan value, write cursor
            thr = T.alloc_local((1,), "float32")
            thr[0] = threshold[0]
            mine[0] = 0
            for e in range(seg):
                if t * seg + e < n:
                    if compute.passes_threshold(scores[0, t * seg + e], thr[0], magnitude):
                        mine[0] = mine[0] + 1
            offsets[t] = mine[0]
            T.tvm_storage_sync("shared")
            for lv in range(levels):
                mine[1] = offsets[t]
                if t >= T.shift_left(1, lv):
                    mine[1] = mine[1] + offsets[t - T.shift_left(1, lv)]
                T.tvm_storage_sync("shared")
                offsets[t] = mine[1]
                T.tvm_storage_sync("shared")
            mine[2] = offsets[t] - mine[0]  # exclusive prefix: where this segment's positions go
            for e in range(seg):
                if t * seg + e < n:
                    if compute.passes_threshold(scores[0, t * seg + e], thr[0], magnitude):
                        idx[0, mine[2]] = T.Cast("int32", t * seg + e)
                        mine[2] = mine[2] + 1
            if t == nt - 1:
                count[0, 0] = offsets[t]

    return kernel.with_attr("global_symbol", name)


def sparse_up(name, D, n, *, rows, gated: bool, act: str, wdtype="float32"):
    """Gathered-row GEMV over the active neurons.

    Args: x[1, D], idx[1, n], count[1, 1], w[(2 if gated) n, D] (gate rows, then up rows),
    b[(2 if gated) n] (zeros for bias-free models), h[1, n]; w in ``wdtype`` (fp16: half4 loads, converted to
    fp32 in registers). One warp per active neuron: lane l
    reads floats 4l .. 4l+3 of every 128-float run of the neuron's row (float4, coalesced) and of
    x, then a warp-shuffle all-reduce (xor butterfly) gives every lane the dot product; lane 0
    applies bias and activation and stores h[k]. The count lives on the GPU, so the grid is fixed
    (UP_WARPS neurons per block, at most UP_MAX_BLOCKS blocks) and warps stride over k < count.
    """
    _decode_only("sparse_up", rows)
    actf = compute.activation(act, MATH)
    width = 2 * n if gated else n
    vw = _vec_width(D)
    chunks = _ceil_div(D, WARP * vw)
    exact = D % (WARP * vw) == 0
    blocks = min(UP_MAX_BLOCKS, _ceil_div(n, UP_WARPS))
    stride = blocks * UP_WARPS
    full_mask = 0xFFFFFFFF

    @T.prim_func
    def kernel(x: T.Buffer((1, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((width, D), wdtype), b: T.Buffer((width,), "float32"), h: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for wy in T.thread_binding(UP_WARPS, thread="threadIdx.y"):
                for lane in T.thread_binding(WARP, thread="threadIdx.x"):
                    acc = T.alloc_local((2, vw), "float32")
                    tot = T.alloc_local((2,), "float32")
                    active = clamp_count(count[0, 0], n)
                    for it in range((active + stride - 1) // stride):
                        if it * stride + bx * UP_WARPS + wy < active:  # uniform across the warp
                            k = it * stride + bx * UP_WARPS + wy
                            row = clamp_index(idx[0, k], n)
                            for v in T.vectorized(vw):
                                acc[0, v] = T.float32(0)
                                acc[1, v] = T.float32(0)
                            for c in range(chunks):
                                if exact or (c * WARP + lane) * vw < D:
                                    for v in T.vectorized(vw):
                                        acc[0, v] = acc[0, v] + (
                                            load_f32(w[row, (c * WARP + lane) * vw + v], wdtype)
                                            * x[0, (c * WARP + lane) * vw + v]
                                        )
                                        if gated:
                                            acc[1, v] = acc[1, v] + (
                                                load_f32(w[n + row, (c * WARP + lane) * vw + v], wdtype)
                                                * x[0, (c * WARP + lane) * vw + v]
                                            )
                            tot[0] = acc[0, 0]
                            tot[1] = acc[1, 0]
                            for v in range(1, vw):
                                tot[0] = tot[0] + acc[0, v]
                                tot[1] = tot[1] + acc[1, v]
                            for lv in range(5):  # xor butterfly: 16, 8, 4, 2, 1
                                tot[0] = tot[0] + T.tvm_warp_shuffle_xor(
                                    T.uint32(full_mask), tot[0], T.shift_right(16, lv), WARP, WARP
                                )
                                if gated:
                                    tot[1] = tot[1] + T.tvm_warp_shuffle_xor(
                                        T.uint32(full_mask), tot[1], T.shift_right(16, lv), WARP, WARP
                                    )
                            if lane == 0:
                                if gated:
                                    h[0, k] = glu_unit(actf, tot[0] + b[row], tot[1] + b[n + row])
                                else:
                                    h[0, k] = actf(tot[0] + b[row])

    return kernel.with_attr("global_symbol", name)


def sparse_down(name, n, D, *, rows, wdtype="float32"):
    """out[0, :] = sum over k < count of h[0, k] * w[idx[0, k], :].

    Args: h[1, n], idx[1, n], count[1, 1], w[n, D] (``wdtype``), out[1, D]. Block = DOWN_TX (32) columns x
    DOWN_TY (16) row groups: thread (ty, tx) accumulates column c = block*32 + tx over the active
    rows k = ty, ty + 16, ... (each warp reads a coalesced 128-byte run of a weight row per step);
    the 16 partial sums of a column are added in shared memory and stored by the ty = 0 thread.
    """
    _decode_only("sparse_down", rows)
    blocks = _ceil_div(D, DOWN_TX)

    @T.prim_func
    def kernel(h: T.Buffer((1, n), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((n, D), wdtype), out: T.Buffer((1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(DOWN_TY, thread="threadIdx.y"):
                for tx in T.thread_binding(DOWN_TX, thread="threadIdx.x"):
                    part = T.alloc_shared((DOWN_TY, DOWN_TX), "float32")
                    acc = T.alloc_local((1,), "float32")
                    acc[0] = T.float32(0)
                    active = clamp_count(count[0, 0], n)
                    if bx * DOWN_TX + tx < D:
                        for it in range((active + DOWN_TY - 1) // DOWN_TY):
                            if it * DOWN_TY + ty < active:
                                row = clamp_index(idx[0, it * DOWN_TY + ty], n)
                                acc[0] = acc[0] + h[0, it * DOWN_TY + ty] * load_f32(w[row, bx * DOWN_TX + tx], wdtype)
                    part[ty, tx] = acc[0]
                    T.tvm_storage_sync("shared")
                    if ty == 0:
                        if bx * DOWN_TX + tx < D:
                            for r in range(1, DOWN_TY):
                                acc[0] = acc[0] + part[r, tx]
                            out[0, bx * DOWN_TX + tx] = acc[0]

    return kernel.with_attr("global_symbol", name)


# --------------------------------------------------------------------------------------------
# Block-quantized weights: ``passes.kernels.quant``'s rows layout (blocks of 32 along each row; int8 q [R, C]
# int8, int4 q [R, C/2] uint8 with byte 16 b + i holding weights 32 b + i (low nibble) and 32 b + 16 + i
# (high), each + 8; scales [R, C/32] in fp16 or fp32). Every GPU reader gives a thread 4 consecutive bytes of
# a row (one 32-bit load): int8, 4 weights of a block (8 threads a block); int4, 8 weights, 4 low and 4 high
# nibbles (4 threads a block). A warp thus covers a coalesced 128-byte run of a row per step, 4 (int8) or 8
# (int4) blocks, and each thread applies its block's scale once to its 4 or 8 products.
# --------------------------------------------------------------------------------------------

QROW_BYTES = 4  # bytes of a quantized row per thread and step
QGEMV_WARPS = 4  # linear_qrows decode: output rows (one warp each) per block
QGEMV_UNROLL = 4  # linear_qrows decode: 128-byte runs per unrolled step (loads in flight per lane)


def _qrow_geometry(bits):
    """(threads per block of 32 weights, blocks per warp step, weights per thread and step) of quant rows."""
    per_block = compute.QUANT_BLOCK * bits // 8 // QROW_BYTES
    return per_block, WARP // per_block, QROW_BYTES * 8 // bits


def _qrow_columns(bits, blk, part):
    """The weight columns of the (up to) 8 values a thread takes from bytes 4 ``part`` .. of block ``blk``:
    value e is weight 32 blk + 4 part + e (int8); int4: e < 4 the low nibbles, e >= 4 the high ones (+16)."""
    if bits == 8:
        return lambda e: blk * compute.QUANT_BLOCK + part * QROW_BYTES + e
    return lambda e: blk * compute.QUANT_BLOCK + part * QROW_BYTES + e % QROW_BYTES + e // QROW_BYTES * 16


def _qrow_value(bits, qv, e):
    """Value e (see _qrow_columns) of a thread's 4 loaded bytes ``qv``, as fp32 (no scale)."""
    if bits == 8:
        return tvm.tirx.Cast("float32", qv[e])
    # e is an unrolled loop's variable: the shift (0 or 4) is a constant once unrolled
    nibble = tvm.tirx.shift_right(qv[e % QROW_BYTES], tvm.tirx.Cast("uint8", e // QROW_BYTES * 4))
    return tvm.tirx.Cast("float32", tvm.tirx.bitwise_and(nibble, tvm.tirx.const(15, "uint8"))) - compute.f32(8.0)


def _qgemv(sch, K, N, bits):
    """Decode ``acc[1, N] = x @ W`` over W^T's quant rows [N, K]: one warp per output row (llama.cpp's
    GPU matvec), QGEMV_WARPS rows per block.

    The reduction axes (kb, kh, ki: k = 32 kb + 16 kh + ki, ki = 4 j + v) are split so that lane (b', j)
    (int8: (b', h, j)) owns
    bytes 4 lane .. 4 lane + 3 of each 128-byte run of the row: those bytes are staged into registers by one
    vectorised 32-bit load (cache_read; x by float4 loads), QGEMV_UNROLL runs unrolled so their loads are in
    flight together; the lane sums its products of every run, and the lanes' partial sums
    meet in a warp-shuffle all-reduce (threadIdx.x-bound reduction); lane 0 applies the epilogue and stores
    y. A row shorter than a whole run (K not a multiple of 128 weights for int8, 256 for int4) leaves lanes
    idle rather than predicated: the run is cut to the blocks that divide K.

    Not measured (no GPU where this was written). A known cost: every warp reads x in fp32 from L1 / L2, 16
    bytes of x per 4 weight bytes for int8 and 32 for int4, so int4 may run into L1 bandwidth before DRAM's;
    llama.cpp quantizes x to int8 once per call (q8_1) and uses dp4a, the step to take if it does.
    """
    per_block, blocks_per_step, _ = _qrow_geometry(bits)
    nb = K // compute.QUANT_BLOCK
    bl = max(b for b in (blocks_per_step, 4, 2, 1) if b <= blocks_per_step and nb % b == 0)
    block = sch.get_sblock("acc")
    _, n, kblock, h, ki = sch.get_loops(block)
    ko, kb = sch.split(kblock, [None, bl])
    kj, kv = sch.split(ki, [None, QROW_BYTES])
    if bits == 4:  # both nibbles of a byte in one lane: h below the lane
        sch.reorder(ko, kb, kj, h, kv)
        lane = sch.fuse(kb, kj)
    else:
        lane = sch.fuse(kb, h, kj)
    bx, ty = sch.split(n, [None, QGEMV_WARPS])
    sch.reorder(bx, ty, lane, ko)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    steps = nb // bl  # runs of the row per lane
    unroll = max(u for u in (QGEMV_UNROLL, 2, 1) if steps % u == 0)
    _, ku = sch.split(ko, [None, unroll])  # several runs' loads in flight per lane
    staged = sch.cache_read(block, 1, "local")  # read buffer 1 is w (x, w, ws, ...): one 32-bit load
    sch.compute_at(staged, ku)
    sch.vectorize(sch.get_loops(staged)[-1])
    x_staged = sch.cache_read(block, 0, "local")  # x: float4 loads (int4: one per half-block)
    sch.compute_at(x_staged, h if bits == 4 else ku)
    sch.vectorize(sch.get_loops(x_staged)[-1])
    sch.unroll(ku)
    if bits == 4:
        sch.unroll(h)
    sch.unroll(kv)
    sch.set_scope(block, 0, "local")
    sch.reverse_compute_at(sch.get_sblock("y"), ty)


def _refuse_min(has_min: bool) -> None:
    """The GPU has no kernels over asymmetric blocks (int4a): it stores its weights in fp16
    (`sizes.GPU_WEIGHT_FORMAT`), so none is asked for; a caller that does gets this one error."""
    if has_min:
        raise ValueError("int4a (4-bit blocks with a scale and a minimum) has no CUDA kernels: the GPU stores its "
                         "weights in fp16")


def linear_qrows(name, K, N, *, rows, bits: int, sdtype="float16", bias: bool, act="none", residual=False,
                 has_min: bool = False):
    """y[m, N] = act(x[m, K] @ W + b) + res with W^T [N, K] in the quant rows layout (blocks along K).

    Args: x, w [N, K (int8) or K/2 (int4)], ws [N, K/32] (``sdtype``), (b), (res), y. Decode: warp-per-row
    GEMV (``_qgemv``). Prefill: the tiled GEMM of ``linear_rows`` (``_gemm``), the weights dequantized to fp32
    as they are staged into shared memory.
    """
    _refuse_min(has_min)
    args = compute.linear_qrows(K, N, rows, bias=bias, act=act, residual=residual, math=MATH, bits=bits,
                                sdtype=sdtype, tile=_gemm_tile(rows))
    sch = compute.schedule(name, args)
    if rows == 1:
        _qgemv(sch, K, N, bits)
    else:
        _gemm(sch, K, w_rows=True)
    return sch.mod[name]


def linear_rows_q(name, K, N, *, rows, bits: int, sdtype="float16", act="none", has_min: bool = False):
    """``linear_rows`` over quant rows, the GPU twin of ``quant.linear_rows_q`` (the FFN up rows, prefill):
    y[m, N] = act(x @ W[N, K]^T + b).  Args: x, w [N, K or K/2], ws [N, K/32], b, y. ``linear_qrows``' GEMM."""
    _refuse_min(has_min)
    _prefill_only("linear_rows_q", rows)
    return linear_qrows(name, K, N, rows=rows, bits=bits, sdtype=sdtype, bias=True, act=act)


def linear_kn_q(name, K, N, *, rows, bits: int, sdtype="float16", bias: bool, act="none", residual=False,
                has_min: bool = False):
    """y[m, N] = act(x[m, K] @ W[K, N] + b) + res with W stored as quant rows one per reduction index (blocks
    along N: the FFN down rows), the GPU twin of ``quant.linear_kn_q``.  Args: x, w [K, N or N/2], ws [K, N/32],
    (b), (res), y. Prefill only: ``linear``'s tiled GEMM, the weights dequantized as they are staged."""
    _refuse_min(has_min)
    _prefill_only("linear_kn_q", rows)
    args = compute.linear_kn_qrows(K, N, rows, bias=bias, act=act, residual=residual, math=MATH, bits=bits,
                                   sdtype=sdtype, tile=_gemm_tile(rows))
    sch = compute.schedule(name, args)
    _gemm(sch, K, w_rows=False)
    return sch.mod[name]


def embed_q(name, V, D, *, rows, positions: int | None, bits: int, sdtype="float16", has_min: bool = False):
    """``embed`` over a quant-rows table (blocks along D): ``compute.embed_q``, the CPU's ``embed_q``'s definition.
    Args: ids, table_q, table_s, (pos_table, start), y. Elementwise over (row, column), like ``embed``: each
    thread dequantizes the weight it stores.
    """
    _refuse_min(has_min)
    sch = compute.schedule(name, compute.embed_q(V, D, rows, positions=positions, bits=bits, sdtype=sdtype))
    _elementwise(sch, sch.get_sblock("y"))
    return sch.mod[name]


def sparse_up_q(name, D, n, *, rows, gated: bool, act: str, bits: int, sdtype="float16", has_min: bool = False):
    """``sparse_up`` over quant rows: the gathered gate / up rows [(2 if gated) n, D] as (q, scales).

    Args: x[1, D], idx[1, n], count[1, 1], w[(2 if gated) n, D or D/2], ws[(2 if gated) n, D/32],
    b[(2 if gated) n], h[1, n]. One warp per active neuron, as ``sparse_up``: lane l loads bytes 4l .. 4l+3 of
    each 128-byte run of the neuron's row (one 32-bit load), sums their 4 (int8) or 8 (int4) products with x,
    scales the sum by its block's scale; a warp-shuffle all-reduce, then lane 0 stores h[k]. Fixed grid,
    warps striding over k < count.
    """
    _refuse_min(has_min)
    _decode_only("sparse_up_q", rows)
    actf = compute.activation(act, MATH)
    width = 2 * n if gated else n
    per_block, blocks_per_step, values = _qrow_geometry(bits)
    nb = D // compute.QUANT_BLOCK
    qw = compute.quant_width(D, bits)
    storage = compute.quant_storage(bits)
    compute.qrows_check_sdtype(sdtype)
    steps = _ceil_div(nb, blocks_per_step)
    exact = nb % blocks_per_step == 0
    blocks = min(UP_MAX_BLOCKS, _ceil_div(n, UP_WARPS))
    stride = blocks * UP_WARPS
    full_mask = 0xFFFFFFFF
    rows_read = 2 if gated else 1

    @T.prim_func
    def kernel(x: T.Buffer((1, D), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((width, qw), storage), ws: T.Buffer((width, nb), sdtype),
               b: T.Buffer((width,), "float32"), h: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for wy in T.thread_binding(UP_WARPS, thread="threadIdx.y"):
                for lane in T.thread_binding(WARP, thread="threadIdx.x"):
                    qv = T.alloc_local((QROW_BYTES,), storage)
                    xv = T.alloc_local((values,), "float32")
                    part = T.alloc_local((1,), "float32")
                    tot = T.alloc_local((2,), "float32")
                    active = clamp_count(count[0, 0], n)
                    for it in range((active + stride - 1) // stride):
                        if it * stride + bx * UP_WARPS + wy < active:  # uniform across the warp
                            k = it * stride + bx * UP_WARPS + wy
                            row = clamp_index(idx[0, k], n)
                            tot[0] = T.float32(0)
                            tot[1] = T.float32(0)
                            for c in range(steps):
                                blk = c * blocks_per_step + lane // per_block
                                if exact or blk < nb:
                                    # the x values of this lane's weights, float4 loads, shared by gate and up
                                    for r in T.unroll(values // QROW_BYTES):
                                        for v in T.vectorized(QROW_BYTES):
                                            xv[r * QROW_BYTES + v] = x[0, blk * compute.QUANT_BLOCK + r * 16
                                                                       + lane % per_block * QROW_BYTES + v]
                                    for g in T.unroll(rows_read):  # gate row, then up row (g = 1)
                                        for v in T.vectorized(QROW_BYTES):
                                            qv[v] = w[g * n + row, c * WARP * QROW_BYTES + lane * QROW_BYTES + v]
                                        part[0] = T.float32(0)
                                        for e in T.unroll(values):
                                            part[0] = part[0] + xv[e] * _qrow_value(bits, qv, e)
                                        tot[g] = tot[g] + part[0] * load_f32(ws[g * n + row, blk], sdtype)
                            for lv in range(5):  # xor butterfly: 16, 8, 4, 2, 1
                                tot[0] = tot[0] + T.tvm_warp_shuffle_xor(
                                    T.uint32(full_mask), tot[0], T.shift_right(16, lv), WARP, WARP
                                )
                                if gated:
                                    tot[1] = tot[1] + T.tvm_warp_shuffle_xor(
                                        T.uint32(full_mask), tot[1], T.shift_right(16, lv), WARP, WARP
                                    )
                            if lane == 0:
                                if gated:
                                    h[0, k] = glu_unit(actf, tot[0] + b[row], tot[1] + b[n + row])
                                else:
                                    h[0, k] = actf(tot[0] + b[row])

    return kernel.with_attr("global_symbol", name)


def sparse_down_q(name, n, D, *, rows, bits: int, sdtype="float16", has_min: bool = False):
    """``sparse_down`` over quant rows: out[0, :] = sum over k < count of h[0, k] * W[idx[0, k], :].

    Args: h[1, n], idx[1, n], count[1, 1], w[n, D or D/2], ws[n, D/32], out[1, D]. Block = 32 threads
    (threadIdx.x) x DOWN_TY (16) row groups; a block covers one 128-byte run of every row (128 columns for
    int8, 256 for int4): thread tx loads bytes 4 tx .. 4 tx + 3 of the run of each active row k = ty, ty + 16,
    ... and adds (h[k] * scale) times its 4 or 8 values to as many column sums; the 16 row groups' sums meet
    in shared memory and the ty = 0 threads store them.
    """
    _refuse_min(has_min)
    _decode_only("sparse_down_q", rows)
    per_block, blocks_per_step, values = _qrow_geometry(bits)
    nb = D // compute.QUANT_BLOCK
    qw = compute.quant_width(D, bits)
    storage = compute.quant_storage(bits)
    compute.qrows_check_sdtype(sdtype)
    grid = _ceil_div(nb, blocks_per_step)
    exact = nb % blocks_per_step == 0

    @T.prim_func
    def kernel(h: T.Buffer((1, n), "float32"), idx: T.Buffer((1, n), "int32"), count: T.Buffer((1, 1), "int32"),
               w: T.Buffer((n, qw), storage), ws: T.Buffer((n, nb), sdtype), out: T.Buffer((1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for ty in T.thread_binding(DOWN_TY, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    part = T.alloc_shared((DOWN_TY, values, WARP), "float32")  # [.., tx] last: no bank conflicts
                    acc = T.alloc_local((values,), "float32")
                    qv = T.alloc_local((QROW_BYTES,), storage)
                    coef = T.alloc_local((1,), "float32")
                    blk = bx * blocks_per_step + tx // per_block
                    for e in T.unroll(values):
                        acc[e] = T.float32(0)
                    active = clamp_count(count[0, 0], n)
                    if exact or blk < nb:
                        for it in range((active + DOWN_TY - 1) // DOWN_TY):
                            if it * DOWN_TY + ty < active:
                                row = clamp_index(idx[0, it * DOWN_TY + ty], n)
                                for v in T.vectorized(QROW_BYTES):
                                    qv[v] = w[row, bx * WARP * QROW_BYTES + tx * QROW_BYTES + v]
                                coef[0] = h[0, it * DOWN_TY + ty] * load_f32(ws[row, blk], sdtype)
                                for e in T.unroll(values):
                                    acc[e] = acc[e] + coef[0] * _qrow_value(bits, qv, e)
                    for e in T.unroll(values):
                        part[ty, e, tx] = acc[e]
                    T.tvm_storage_sync("shared")
                    if ty == 0:
                        if exact or blk < nb:
                            for e in T.unroll(values):
                                for r in range(1, DOWN_TY):
                                    acc[e] = acc[e] + part[r, e, tx]
                                out[0, _qrow_columns(bits, blk, tx % per_block)(e)] = acc[e]

    return kernel.with_attr("global_symbol", name)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _target(arch):
    """passes.targets' CUDA target for ``arch`` as a tvm Target (the host given apart, as TVM takes it)."""
    spec = cuda_target(arch)
    host = spec.pop("host")
    return tvm.target.Target(spec, host=host)


def _ir_module(funcs):
    mod = {}
    for f in funcs:
        symbol = str(f.attrs["global_symbol"])
        if symbol in mod:
            raise ValueError(f"duplicate kernel name {symbol!r}")
        mod[symbol] = f
    return tvm.IRModule(mod)


def nvcc_path() -> str | None:
    """The real nvcc: ``$CUDA_PATH/bin/nvcc`` (the nvcc on PATH may be a wrapper), else PATH's."""
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def nvcc_flags(arch: str) -> list[str]:
    """SASS for ``arch`` plus its PTX (the driver JIT-compiles the PTX on newer GPUs), in a fatbin.

    No --use_fast_math: the kernels already call the fast intrinsics where TVM chooses them, and
    divisions / square roots stay IEEE so results track the CPU kernels.
    """
    cc = arch[3:]
    return [
        "--fatbin",
        "-O3",
        "-std=c++17",
        "-gencode", f"arch=compute_{cc},code=sm_{cc}",
        "-gencode", f"arch=compute_{cc},code=compute_{cc}",
    ]


def compile_cuda(source: str, arch: str) -> bytes:
    """nvcc ``source`` (TVM's generated CUDA C++) to a fatbin for ``arch``."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit or set CUDA_PATH")
    with tempfile.TemporaryDirectory(prefix="picompile-nvcc-") as tmp:
        src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.fatbin")
        with open(src, "w") as f:
            f.write(source)
        done = subprocess.run([nvcc, *nvcc_flags(arch), "-o", out, src], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{done.stdout}\n{done.stderr}")
        with open(out, "rb") as f:
            return f.read()


@contextlib.contextmanager
def _nvcc_callback(arch, compiled):
    """Route ``tvm_callback_cuda_compile`` to our nvcc while compiling, then restore the old one.

    TVM calls it only where the CUDA runtime is loaded (a GPU machine); each call appends
    (source, binary, seconds) to ``compiled``.
    """
    name = "tvm_callback_cuda_compile"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)

    def callback(code, *_):
        began = time.perf_counter()
        binary = compile_cuda(code, arch)
        compiled.append((code, binary, time.perf_counter() - began))
        return bytearray(binary)

    tvm_ffi.register_global_func(name, callback, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)


def _compile(funcs, arch):
    """tvm.compile for the CUDA target: (host module, CUDA source, binary or None, nvcc seconds)."""
    compiled = []
    with _nvcc_callback(arch, compiled):
        lib = tvm.compile(_ir_module(funcs), target=_target(arch))
    cuda_mods = [m for m in lib.mod.imports if m.kind == "cuda"]
    if len(cuda_mods) != 1:
        raise RuntimeError(f"expected one CUDA device module, got {[m.kind for m in lib.mod.imports]}")
    if compiled:  # a GPU machine: TVM already ran nvcc through the callback
        if len(compiled) != 1:
            raise RuntimeError(f"expected one CUDA compilation, got {len(compiled)}")
        source, binary, seconds = compiled[0]
        return lib, source, binary, seconds
    return lib, cuda_mods[0].inspect_source("cuda"), None, 0.0


def cuda_source(funcs, arch: str) -> str:
    """The CUDA C++ that TVM generates for ``funcs`` (what ``build`` hands to nvcc)."""
    return _compile(funcs, arch)[1]


# -- the packed module tree (what export_library embeds as __tvm_ffi__library_bin) -------------
# Layout (src/target/codegen.cc, include/tvm/support/serializer.h; little endian): u64 blob size;
# the import tree as two u64 vectors (u64 count + items); then per module group a string key ("_lib"
# for the host code) followed, for every other key, by that module's SaveToBytes as a string.
# Strings and arrays are a u64 count + items. A CUDA module's SaveToBytes is [fmt string]
# [Map<String, FunctionInfo>][code string]; FunctionInfo = name string, arg types (4-byte DLDataType
# array), launch parameter tags (string array), extra arg tags (int32 array).


def _u64(buf, pos):
    return struct.unpack_from("<Q", buf, pos)[0], pos + 8


def _read_str(buf, pos):
    n, pos = _u64(buf, pos)
    if pos + n > len(buf):
        raise ValueError("truncated string in a packed module")
    return bytes(buf[pos : pos + n]), pos + n


def _write_str(data):
    return struct.pack("<Q", len(data)) + data


def _parse_blob(blob):
    """Split a packed import blob into (import tree bytes, [(key, payload or None)])."""
    size, pos = _u64(blob, 0)
    if size != len(blob) - 8:
        raise ValueError("packed module blob has an unexpected size header")
    start = pos
    for _ in range(2):  # import_tree_row_ptr, import_tree_child_indices
        count, pos = _u64(blob, pos)
        pos += 8 * count
    tree = blob[start:pos]
    records = []
    while pos < len(blob):
        key, pos = _read_str(blob, pos)
        payload = None
        if key != b"_lib":
            payload, pos = _read_str(blob, pos)
        records.append((key.decode(), payload))
    return tree, records


def _split_cuda_record(payload):
    """(fmt, function-info bytes, code) of a CUDA module's SaveToBytes."""
    fmt, pos = _read_str(payload, 0)
    fmap_start = pos
    entries, pos = _u64(payload, pos)
    for _ in range(entries):
        _, pos = _read_str(payload, pos)  # key
        _, pos = _read_str(payload, pos)  # FunctionInfo.name
        n, pos = _u64(payload, pos)  # arg_types
        pos += 4 * n
        n, pos = _u64(payload, pos)  # launch_param_tags
        for _ in range(n):
            _, pos = _read_str(payload, pos)
        n, pos = _u64(payload, pos)  # arg_extra_tags
        pos += 4 * n
    fmap = payload[fmap_start:pos]
    code, pos = _read_str(payload, pos)
    if pos != len(payload):
        raise ValueError("unexpected CUDA module record layout")
    return fmt.decode(), fmap, code


def _rewrite_blob(blob, old_code, binary, fmt="fatbin"):
    """``blob`` with the CUDA module's (fmt, code) replaced by (``fmt``, ``binary``)."""
    tree, records = _parse_blob(blob)
    out = [tree]
    replaced = 0
    for key, payload in records:
        out.append(_write_str(key.encode()))
        if payload is None:
            continue
        if key == "cuda":
            _, fmap, code = _split_cuda_record(payload)
            if code != old_code:
                raise ValueError("the CUDA module does not hold the code that was compiled")
            payload = _write_str(fmt.encode()) + fmap + _write_str(binary)
            replaced += 1
        out.append(_write_str(payload))
    if replaced != 1:
        raise ValueError(f"expected one CUDA module in the packed blob, found {replaced}")
    body = b"".join(out)
    return struct.pack("<Q", len(body)) + body


def read_packed_cuda(path: str) -> tuple[str, bytes]:
    """(fmt, code) of the CUDA module embedded in an exported library, read without loading it.

    The packed blob is the ``__tvm_ffi__library_bin`` symbol of the .so (found via its ELF
    symbol table); this is what TVM's loader deserializes on the GPU machine.
    """
    with open(path, "rb") as f:
        elf = f.read()
    data = _elf_symbol(elf, b"__tvm_ffi__library_bin")
    size = struct.unpack_from("<Q", data, 0)[0]
    _, records = _parse_blob(data[: size + 8])
    for key, payload in records:
        if key == "cuda":
            fmt, _, code = _split_cuda_record(payload)
            return fmt, code
    raise ValueError(f"no CUDA module in {path}")


def _elf_symbol(elf, name):
    """The bytes of a defined symbol in a 64-bit little-endian ELF file (.symtab or .dynsym)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    # section header: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    for sh in sections:
        if sh[1] not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], sh[9]):
            st_name, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", elf, off)
            end = elf.index(b"\0", strtab[4] + st_name)
            if elf[strtab[4] + st_name : end] == name and 0 < shndx < len(sections):
                sec = sections[shndx]
                return elf[sec[4] + value - sec[3] : sec[4] + value - sec[3] + size]
    raise ValueError(f"symbol {name.decode()} not found")


def build(funcs, arch: str, path: str) -> dict:
    """Compile ``funcs`` for ``arch`` (e.g. "sm_80") into one shared library at ``path``.

    The device code is compiled with nvcc now (``nvcc_flags``: SASS for the arch + its PTX, one
    fatbin) and embedded; the library loads with TVM's runtime and the CUDA driver alone.
    Returns facts: arch, kernels (PrimFuncs built), binary_format, binary_bytes, nvcc_seconds.
    """
    funcs = list(funcs)
    lib, source, binary, nvcc_seconds = _compile(funcs, arch)
    if "__global__" not in source:
        raise RuntimeError("TVM produced no CUDA kernels")
    # the code TVM's CUDA module holds now: the source (no CUDA runtime here) or the callback's binary
    old_code = source.encode() if binary is None else bytes(binary)
    if binary is None:
        began = time.perf_counter()
        binary = compile_cuda(source, arch)
        nvcc_seconds = time.perf_counter() - began
    pack_blob = tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")
    codegen_blob = tvm_ffi.get_global_func("codegen.codegen_blob")

    def pack_imports(mod, is_system_lib, prefix, workspace_dir):
        """export_library's packing step, with the CUDA module's code replaced by the fatbin."""
        blob = _rewrite_blob(bytes(pack_blob(mod).numpy().tobytes()), old_code, binary)
        obj = os.path.join(workspace_dir, f"{prefix}devc.o")
        host_target = mod.get_function("_get_target_string")()
        codegen_blob(blob, is_system_lib, host_target, prefix).write_to_file(obj)
        return obj

    lib.export_library(path, fpack_imports=pack_imports)
    return {
        "arch": arch,
        "kernels": len(funcs),
        "binary_format": "fatbin",
        "binary_bytes": len(binary),
        "nvcc_seconds": round(nvcc_seconds, 3),
    }
