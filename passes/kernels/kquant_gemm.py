"""The prefill GEMM over blocks kept from a model file (ggml's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in kquant's panels
layout with int8 activations: quant.gemm_panels_qx8's form for the kq panels.

W [K, N] is `kquant.pack_panels`' two buffers (values uint8 [P, K * 8 + (bits - 4) * K * 2], scales uint8
[P, kquant.panel_scale_bytes]; see kquant_gemv's module doc). A weight is d (c - offset) (+ m), c the full code
(low nibble | the high bits << 4), d = D sc and m = -(Dmin mn) for the K-quants.

`gemm_panels_kqx8`: each row of x quantized to int8 per 32-block (quant.x_quantizer, in parallel over the rows),
with its int32 sums per sub-block of the format (Q6_K's 16, else 32). Per parallel task (`tile_panels` adjacent
panels) the panels' full codes are expanded once into a task buffer, a 64-byte vector per panel and 4 k steps:
dword l column l's 4 codes (built from the two nibble halves' vectors kquant_gemv.gemv_panels_kq_x8 builds, the
high bits OR'ed in, by one two-source byte shuffle). Then per tile of KQ_X8_ROWS rows and sub-block they are
dotted (u8 codes < 64 times s8: "vnni" vpdpbusd or "madd" vpmaddubsw's pair sums, 2 * 63 * 127 < 2^15) with the
row's 4 xq bytes broadcast to every lane, into int32 sums (one vector per row and panel: its 16 columns) that
start at -offset * sum(xq) over the sub-block; then acc += float(sum) * d * sx, and where the format has mins
acc += m * sx * sum(xq): one conversion and two or three float operations per 16 columns and sub-block. The
epilogue writes each accumulator's 16 columns as they are.

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
from .quant import HALF, check_dot, dot_u8s8, x_quantizer

# prompt rows per register tile: x 2 panels, 8 zmm of int32 sums and 8 of float sums. Measured on Zen 4, 128 rows,
# one thread: 3 to 5 rows within noise of each other (Q4_K K 1536 / N 17920 and N 2048, Q6_K K 8960 / N 1536), 6
# slower; 4 divides the usual prompt lengths.
KQ_X8_ROWS = 4


def gemm_panels_kqx8(name, K, N, *, fmt: WeightFormat, bias=False, act="none", residual=False, dot="vnni",
                     tile_panels=2):
    """Prefill y[m, N] = act(x[m, K] @ W + b) + res, W in kquant's panels layout (`fmt`: q5_0, q5_1, q4_k, q5_k,
    q6_k), each row of x quantized to int8 per 32-block, in zmm integer dot products (`dot` "vnni": AVX512-VNNI;
    "madd": AVX512BW).  Args: x, w, ws, (b), (res), y. See the module doc."""
    _check_kq(K, N, fmt)
    lanes = 16
    check_dot(dot, lanes)
    m = row_dim(None)
    B, SB = QUANT_BLOCK, fmt.block
    SPB = B // SB  # sub-blocks per 32-block of x (Q6_K: 2)
    nb, nsub = K // B, K // SB
    planes = fmt.bits - 4
    panels = -(-N // PANEL)
    TP = tile_panels if panels % tile_panels == 0 else 1
    MR = KQ_X8_ROWS
    full = N % PANEL == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    VB = K * 8 + planes * K * 2  # value bytes per panel
    scales = _Scales(fmt, K)
    SBY = scales.row
    nbytes, steps = 4 * lanes, 8  # bytes and k steps per panel vector (nibble half h: columns h * 8 .. + 8)
    CW = HALF  # columns per nibble half
    KV = K // steps  # panel vectors per panel and nibble half
    KQ = K // 4  # task-buffer vectors per panel: 16 columns x 4 k steps each
    GS = SB // 4  # 4-step k groups per sub-block
    m15, m4 = T.broadcast(T.uint8(15), nbytes), T.broadcast(T.uint8(4), nbytes)
    HR = high_rows(fmt) if planes else B
    offset = fmt.offset
    quantize_x = x_quantizer(K)
    # a panel vector's dwords are (lane l) column h * 8 + l % 8 at k steps 4 (l // 8) ..: k group j of the 16
    # columns is lanes 8 j .. 8 j + 8 of half 0's vector then of half 1's
    regroup = [[tirx.IntImm("int32", (e // 32) * nbytes + 32 * j + e % 32) for e in range(nbytes)]
               for j in range(2)]
    xdword = [tirx.IntImm("int32", e % 4) for e in range(nbytes)]

    def codes(wf, p, k0, h):
        """Panel p's codes at k0 (a multiple of 8), nibble half h, permuted to column dwords."""
        nib = wf[T.ramp(p * VB + k0 * HALF, 1, nbytes)]  # (stored permuted)
        c = (nib & m15) if h == 0 else (nib >> m4)
        if planes:
            c = c | high_bits(wf, p * VB + K * HALF, fmt, k0 // HR, k0 % HR, h, nbytes)
        return c

    def xbroadcast(xq, row, k):  # row's xq at k .. k + 4 in every lane
        return T.Shuffle([xq[T.ramp(row * K + k, 1, 4)]] * lanes, xdword)

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
            wc = T.alloc_buffer((TP * KQ * nbytes,), "uint8")
            for g, kv in T.grid(TP, KV):
                wc[T.ramp((g * KQ + kv * 2) * nbytes, 1, nbytes)] = T.Shuffle(
                    [codes(wf, t * TP + g, kv * steps, 0), codes(wf, t * TP + g, kv * steps, 1)], regroup[0])
                wc[T.ramp((g * KQ + kv * 2 + 1) * nbytes, 1, nbytes)] = T.Shuffle(
                    [codes(wf, t * TP + g, kv * steps, 0), codes(wf, t * TP + g, kv * steps, 1)], regroup[1])
            ds = T.alloc_buffer((nsub * TP * lanes,), "float32")  # d per lane (the panel's column)
            ms = T.alloc_buffer((nsub * TP * lanes,), "float32")  # m per lane
            for sb, g, v in T.grid(nsub, TP, lanes):
                ds[(sb * TP + g) * lanes + v] = scales.d(wsb, wsh, t * TP + g, sb, v)
                if fmt.has_min:
                    ms[(sb * TP + g) * lanes + v] = scales.m(wsb, wsh, t * TP + g, sb, v)
            for io in range((m + MR - 1) // MR):
                acc = T.alloc_local((MR, TP, lanes), "float32")
                part = T.alloc_local((MR, TP, lanes), "int32")
                for r, g in T.grid(MR, TP):
                    for v in T.vectorized(lanes):
                        acc[r, g, v] = T.float32(0)
                for sb in range(nsub):
                    for r, g in T.grid(MR, TP):
                        part[r, g, T.ramp(0, 1, lanes)] = T.broadcast(
                            -offset * ssum[T.min(io * MR + r, m - 1) * nsub + sb], lanes)
                    for q in T.unroll(GS):
                        for g in T.unroll(TP):
                            for r in T.unroll(MR):
                                part[r, g, T.ramp(0, 1, lanes)] = dot_u8s8(
                                    dot, lanes, part[r, g, T.ramp(0, 1, lanes)],
                                    wc[T.ramp((g * KQ + sb * GS + q) * nbytes, 1, nbytes)],
                                    xbroadcast(xq, T.min(io * MR + r, m - 1), sb * SB + q * 4))
                    for r, g in T.grid(MR, TP):
                        for v in T.vectorized(lanes):
                            acc[r, g, v] = acc[r, g, v] + T.Cast("float32", part[r, g, v]) * (
                                ds[(sb * TP + g) * lanes + v] * sx[T.min(io * MR + r, m - 1) * nb + sb // SPB])
                    if fmt.has_min:
                        for r, g in T.grid(MR, TP):
                            for v in T.vectorized(lanes):
                                acc[r, g, v] = acc[r, g, v] + ms[(sb * TP + g) * lanes + v] * (
                                    sx[T.min(io * MR + r, m - 1) * nb + sb // SPB] * T.Cast(
                                        "float32", ssum[T.min(io * MR + r, m - 1) * nsub + sb]))
                for r in T.unroll(MR):
                    if io * MR + r < m:
                        for g in range(TP):
                            for c in (T.vectorized if full else T.serial)(lanes):
                                if full or (t * TP + g) * PANEL + c < N:
                                    y[io * MR + r, (t * TP + g) * PANEL + c] = epilogue(
                                        acc[r, g, c], b, res, io * MR + r, (t * TP + g) * PANEL + c)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)
