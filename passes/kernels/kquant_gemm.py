"""The prefill GEMM over blocks kept from a model file (ggml's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in kquant's panels
layout with int8 activations: quant.gemm_panels_qx8's form for the kq panels.

W [K, N] is `kquant.pack_panels`' two buffers (values uint8 [P, K * 8 + (bits - 4) * K * 2], scales uint8 [P,
kquant.panel_scale_bytes]; see kquant_gemv's module doc). A weight is d (c - offset) (+ m), c the full code (low
nibble | the high bits << 4), d = D sc and m = -(Dmin mn) for the K-quants.

`gemm_panels_kqx8`: each row of x quantized to int8 per 32-block (quant.x_quantizer, in parallel over the rows),
with its int32 sums per sub-block of the format (Q6_K's 16, else 32). Per parallel task (`tile_panels` adjacent
panels) the panels' full codes are expanded once into a task buffer, a vector per column group (`lanes` columns: a
panel in zmm, a nibble half's 8 columns in ymm) and 4 k steps: dword l column l's 4 codes, the high bits OR'ed in
(zmm: built from the two nibble halves' vectors kquant_gemv.gemv_panels_kq_x8 builds, by one two-source byte
shuffle; ymm: a nibble half's 32 stored bytes are that vector as they are). Then per tile of KQ_X8_ROWS rows and
sub-block they are dotted (u8 codes < 64 times s8: "vnni" vpdpbusd or "madd" vpmaddubsw's pair sums of two k groups
added in int16, 4 * 63 * 127 < 2^15) with the row's 4 xq bytes broadcast to every lane, into int32 sums (one vector
per row and column group) that start at -offset * sum(xq) over the sub-block; then acc += float(sum) * d * sx, and
where the format has mins acc += m * sx * sum(xq): one conversion and two or three float operations per vector and
sub-block. The epilogue writes each accumulator's columns as they are. A GEMM of at most KQ_X8_ROWS rows (a batch
step's) skips the task buffer: each vector's codes are built from the stored bytes where they are dotted, in one
tile of KQ_X8_ROWS rows (half that for at most half as many rows).

Args: x [m, K], w, ws, (b), (res [m, N]), y [m, N] (m symbolic), as quant.gemm_panels_qx8.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from runtime.dtypes import QUANT_BLOCK, WeightFormat

from . import cpu as _cpu
from .compute import drop_params, row_dim
from .cpu import PANEL
from .kquant import high_rows
from .kquant_gemv import _check_kq, _Scales, high_bits
from .quant import HALF, check_dot, dot2_u8s8, x_quantizer

# prompt rows per register tile: x 2 panels, 8 zmm of int32 sums and 8 of float sums. Measured on Zen 4, 128 rows,
# one thread: 3 to 5 rows within noise of each other (Q4_K K 1536 / N 17920 and N 2048, Q6_K K 8960 / N 1536), 6
# slower; 4 divides the usual prompt lengths. In ymm (x a panel's 2 halves), on Zen 3, 2 threads: 2 and 4 rows
# level, 3 and 5 slower, 2 panels a task slower (Q4_K 4096 x 14336, Q6_K 14336 x 4096, Q5_0 896 x 9728).
KQ_X8_ROWS = 4


def gemm_panels_kqx8(name, K, N, *, fmt: WeightFormat, bias=False, act="none", residual=False, dot="vnni",
                     tile_panels=2, lanes=16):
    """Prefill y[m, N] = act(x[m, K] @ W + b) + res, W in kquant's panels layout (`fmt`: q5_0, q5_1, q4_k, q5_k,
    q6_k), each row of x quantized to int8 per 32-block, in integer dot products (`dot`, `lanes`: "vnni", 16:
    AVX512-VNNI; "madd", 16: AVX512BW; "madd", 8: AVX2).  Args: x, w, ws, (b), (res), y. See the module doc."""
    _check_kq(K, N, fmt)
    check_dot(dot, lanes)
    m = row_dim(None)
    B, SB = QUANT_BLOCK, fmt.block
    SPB = B // SB  # sub-blocks per 32-block of x (Q6_K: 2)
    nb, nsub = K // B, K // SB
    planes = fmt.bits - 4
    panels = -(-N // PANEL)
    TP = tile_panels if panels % tile_panels == 0 else 1
    HP = PANEL // lanes  # column groups (one sum vector's columns) per panel: 1 in zmm, the 2 nibble halves in ymm
    CG = TP * HP  # column groups per task
    MR = KQ_X8_ROWS
    full = N % PANEL == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    VB = K * 8 + planes * K * 2  # value bytes per panel
    scales = _Scales(fmt, K)
    SBY = scales.row
    nbytes = 4 * lanes
    KQ = K // 4  # task-buffer vectors per column group: its columns x 4 k steps each
    GS = SB // 4  # 4-step k groups per sub-block
    HR = high_rows(fmt) if planes else B
    offset = fmt.offset
    quantize_x = x_quantizer(K)
    # a stored 64-byte panel vector's dwords are (lane l) column h * 8 + l % 8 at k steps 4 (l // 8) ..: k group j
    # of the 16 columns is lanes 8 j .. 8 j + 8 of half 0's vector then of half 1's (in ymm, a 32-byte load at a
    # 4-step k group is one half's 8 columns as they are)
    regroup = [[tirx.IntImm("int32", (e // 32) * 64 + 32 * j + e % 32) for e in range(64)] for j in range(2)]
    xdword = [tirx.IntImm("int32", e % 4) for e in range(nbytes)]

    def codes(wf, p, k0, h, width):
        """Panel p's codes at k0 (a multiple of width // 8), nibble half h (a number, or an unrolled loop's
        expression), `width` bytes (stored grouped)."""
        nib = wf[T.ramp(p * VB + k0 * HALF, 1, width)]
        if isinstance(h, int):
            c = (nib & T.broadcast(T.uint8(15), width)) if h == 0 else (nib >> T.broadcast(T.uint8(4), width))
        else:
            c = (nib >> T.broadcast(T.Cast("uint8", 4 * h), width)) & T.broadcast(T.uint8(15), width)
        if planes:
            c = c | high_bits(wf, p * VB + K * HALF, fmt, k0 // HR, k0 % HR, h, width)
        return c

    def xbroadcast(xq, row, k):  # row's xq at k .. k + 4 in every lane
        return T.Shuffle([xq[T.ramp(row * K + k, 1, 4)]] * lanes, xdword)

    def panel(t, c):  # task t's column group c's panel
        return t * TP + c // HP

    def column(t, c, v):  # lane v of task t's column group c: its column of y
        return panel(t, c) * PANEL + (c % HP) * lanes + v

    def from_file(wf, wc, t, c, pair, j):  # column group c's codes at 4-step k group 2 pair + j, from the stored bytes
        if HP == 1:
            p = panel(t, c)
            return T.Shuffle([codes(wf, p, pair * 8, 0, 64), codes(wf, p, pair * 8, 1, 64)], regroup[j])
        return codes(wf, panel(t, c), pair * 8 + j * 4, c % HP, nbytes)

    def slot(c, pair, j):  # the task buffer's vector of column group c at 4-step k group 2 pair + j
        return T.ramp((c * KQ + pair * 2 + j) * nbytes, 1, nbytes)

    def from_buffer(wf, wc, t, c, pair, j):  # ... from the task buffer `expand` filled
        return wc[slot(c, pair, j)]

    @T.macro
    def expand(wf, wc, t):  # the task's full codes into its buffer, column group by group, as from_file builds them
        for g, pair in T.grid(TP, K // 8):
            for h in T.unroll(HP):
                wc[slot(g * HP + h, pair, 0)] = from_file(wf, wc, t, g * HP + h, pair, 0)
                wc[slot(g * HP + h, pair, 1)] = from_file(wf, wc, t, g * HP + h, pair, 1)

    @T.macro
    def row_tile(wf, wc, ds, ms, xq, sx, ssum, y, b, res, t, io, operand, R):  # rows io * R .. io * R + R of task t's
        # columns
        acc = T.alloc_local((R, CG, lanes), "float32")
        part = T.alloc_local((R, CG, lanes), "int32")
        for r, c in T.grid(R, CG):
            for v in T.vectorized(lanes):
                acc[r, c, v] = T.float32(0)
        for sb in range(nsub):
            for r, c in T.grid(R, CG):
                part[r, c, T.ramp(0, 1, lanes)] = T.broadcast(
                    -offset * ssum[T.min(io * R + r, m - 1) * nsub + sb], lanes)
            for q in T.unroll(GS // 2):
                for c in T.unroll(CG):
                    for r in T.unroll(R):
                        part[r, c, T.ramp(0, 1, lanes)] = dot2_u8s8(
                            dot, lanes, part[r, c, T.ramp(0, 1, lanes)],
                            operand(wf, wc, t, c, sb * GS // 2 + q, 0),
                            xbroadcast(xq, T.min(io * R + r, m - 1), sb * SB + q * 8),
                            operand(wf, wc, t, c, sb * GS // 2 + q, 1),
                            xbroadcast(xq, T.min(io * R + r, m - 1), sb * SB + q * 8 + 4))
            for r, c in T.grid(R, CG):
                for v in T.vectorized(lanes):
                    acc[r, c, v] = acc[r, c, v] + T.Cast("float32", part[r, c, v]) * (
                        ds[(sb * CG + c) * lanes + v] * sx[T.min(io * R + r, m - 1) * nb + sb // SPB])
            if fmt.has_min:
                for r, c in T.grid(R, CG):
                    for v in T.vectorized(lanes):
                        acc[r, c, v] = acc[r, c, v] + ms[(sb * CG + c) * lanes + v] * (
                            sx[T.min(io * R + r, m - 1) * nb + sb // SPB] * T.Cast(
                                "float32", ssum[T.min(io * R + r, m - 1) * nsub + sb]))
        for r in T.unroll(R):
            if io * R + r < m:
                for c in range(CG):
                    for v in (T.vectorized if full else T.serial)(lanes):
                        if full or column(t, c, v) < N:
                            y[io * R + r, column(t, c, v)] = epilogue(acc[r, c, v], b, res, io * R + r,
                                                                       column(t, c, v))

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer((panels, VB), "uint8"), ws: T.Buffer((panels, SBY), "uint8"),
               b: T.Buffer((N,), "float32"), res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        res = T.match_buffer(res_h, (m, N), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        wf = T.decl_buffer((panels * VB,), "uint8", data=w.data)
        wsb = T.decl_buffer((panels * SBY,), scales.byte_dtype, data=ws.data)
        wsh = T.decl_buffer((panels * SBY // 2,), "float16", data=ws.data)
        xq = T.alloc_buffer((m * K,), "int8")
        sx = T.alloc_buffer((m * nb,), "float32")
        xsum = T.alloc_buffer((m * nb,), "int32")
        ssum = T.alloc_buffer((m * nsub,), "int32")
        for i in T.parallel(m):
            quantize_x(x, i, xq, sx, xsum, i)
            for sb in range(nsub):
                ssum[i * nsub + sb] = 0
                for v in range(SB):
                    ssum[i * nsub + sb] = ssum[i * nsub + sb] + T.Cast("int32", xq[i * K + sb * SB + v])
        for t in T.parallel(panels // TP):
            wc = T.alloc_buffer((CG * KQ * nbytes,), "uint8")
            if m > MR:
                expand(wf, wc, t)
            ds = T.alloc_buffer((nsub * CG * lanes,), "float32")  # d per lane (its column)
            ms = T.alloc_buffer((nsub * CG * lanes,), "float32")  # m per lane
            for sb, c in T.grid(nsub, CG):
                for v in T.vectorized(lanes):
                    ds[(sb * CG + c) * lanes + v] = scales.d(wsb, wsh, panel(t, c), sb, (c % HP) * lanes + v)
                if fmt.has_min:
                    for v in T.vectorized(lanes):
                        ms[(sb * CG + c) * lanes + v] = scales.m(wsb, wsh, panel(t, c), sb, (c % HP) * lanes + v)
            if m > MR:  # rows in several tiles: each vector's codes expanded once, then read per tile
                for io in range((m + MR - 1) // MR):
                    row_tile(wf, wc, ds, ms, xq, sx, ssum, y, b, res, t, io, from_buffer, MR)
            elif m > MR // 2:  # one tile (a batch step's few rows): codes built where they are dotted
                row_tile(wf, wc, ds, ms, xq, sx, ssum, y, b, res, t, T.int64(0), from_file, MR)
            else:
                row_tile(wf, wc, ds, ms, xq, sx, ssum, y, b, res, t, T.int64(0), from_file, MR // 2)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)
