"""The prefill GEMM over blocks kept from a model file (ggml's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in kquant's panels
layout with int8 activations: quant.gemm_panels_qx8's form for the kq panels.

W [K, N] is `kquant.pack_panels`' two buffers (values uint8 [P, K * 8 + (bits - 4) * K * 2], scales uint8
[P, kquant.panel_scale_bytes]; see kquant_gemv's module doc). A weight is d (c - offset) (+ m), c the full code
(low nibble | the high bits << 4), d = D sc and m = -(Dmin mn) for the K-quants.

`gemm_panels_kqx8`: each row of x quantized to int8 per 32-block (quant.x_quantizer, in parallel over the rows),
with its int32 sums per sub-block of the format (Q6_K's 16, else 32). Per parallel task (`tile_panels` adjacent
panels) the panels' full codes are expanded once into a task buffer (per 8 k steps and nibble half, the 64 bytes
kquant_gemv.gemv_panels_kq_x8 builds: each dword one column's 4 k steps, the high bits OR'ed in), then per tile
of KQ_X8_ROWS rows and sub-block they are dotted (u8 codes < 64 times s8: "vnni" vpdpbusd or "madd" vpmaddubsw's
pair sums, 2 * 63 * 127 < 2^15) with each row's xq dwords broadcast to the lanes (two 4-step k groups, lanes l and
l + 8), into int32 sums that start at -offset * sum(xq) over the sub-block; then acc += float(sum) * d * sx, and
where the format has mins acc += m * sx * sum(xq). The epilogue sums the k groups' lanes.

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
from .quant import HALF, _sum_lanes, _vector_perm, check_dot, dot_u8s8, x_quantizer

# prompt rows per register tile: x 2 panels x 2 nibble halves, 12 zmm of int32 sums and 12 of float sums (the
# int32 sums are folded into the float ones per sub-block, so both stay in registers: quant.X8_ROWS' 4 rows
# make 32 and spill). Measured on Zen 4, 128 rows, one thread: 3 rows 1.15-1.2x as fast as 4 for Q4_K
# (K 1536 / N 17920, K 8960 / N 1536), about even for Q6_K; 2 rows between them.
KQ_X8_ROWS = 3


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
    nbytes, steps = 4 * lanes, 8  # bytes and k steps per vector
    kgroups, CW = 2, HALF  # 4-step k groups per vector (lanes 0-7, 8-15), columns per sum vector
    VS = SB // steps  # vectors per sub-block
    KV = K // steps  # vectors per panel and nibble half
    perm = [tirx.IntImm("int32", i) for i in _vector_perm(lanes)]
    m15, m4 = T.broadcast(T.uint8(15), nbytes), T.broadcast(T.uint8(4), nbytes)
    HR = high_rows(fmt) if planes else B
    offset = fmt.offset
    sub_scale = fmt.sub_scale or "uint8"
    quantize_x = x_quantizer(K)
    xbytes = [tirx.IntImm("int32", 4 * (e // 4 // CW) + e % 4) for e in range(nbytes)]  # byte -> its xq byte

    def codes(wf, p, k0, h):
        """Panel p's codes at k0 (a multiple of 8), nibble half h, permuted to column dwords."""
        nib = T.Shuffle([wf[T.ramp(p * VB + k0 * HALF, 1, nbytes)]], perm)
        c = (nib & m15) if h == 0 else (nib >> m4)
        if planes:
            c = c | high_bits(wf, p * VB + K * HALF, fmt, k0 // HR, k0 % HR, h, nbytes)
        return c

    low = T.Shuffle([T.broadcast(T.int32(-1), lanes), T.broadcast(T.int32(0), lanes)],
                    [tirx.IntImm("int32", v if v < CW else lanes + v) for v in range(lanes)])

    def first_kgroup(value):  # value in the first k group's lanes (0-7), 0 in the others
        return T.broadcast(value, lanes) & low if offset else T.broadcast(T.int32(0), lanes)

    def xdwords(xq, row, k0):  # row's xq at k0 .. k0 + 8, each 4-step k group's 4 bytes over its lanes
        return T.Shuffle([xq[T.ramp(row * K + k0, 1, steps)]] * (nbytes // steps), xbytes)

    @T.prim_func
    def kernel(x_h: T.handle, w: T.Buffer((panels, VB), "uint8"), ws: T.Buffer((panels, SBY), "uint8"),
               b: T.Buffer((N,), "float32"), res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m, K), "float32")
        res = T.match_buffer(res_h, (m, N), "float32")
        y = T.match_buffer(y_h, (m, N), "float32")
        wf = T.decl_buffer((panels * VB,), "uint8", data=w.data)
        wsb = T.decl_buffer((panels * SBY,), sub_scale, data=ws.data)
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
            wc = T.alloc_buffer((TP * KV * 2 * nbytes,), "uint8")
            for g, kv in T.grid(TP, KV):
                wc[T.ramp((g * KV + kv) * 2 * nbytes, 1, nbytes)] = codes(wf, t * TP + g, kv * steps, 0)
                wc[T.ramp(((g * KV + kv) * 2 + 1) * nbytes, 1, nbytes)] = codes(wf, t * TP + g, kv * steps, 1)
            ds = T.alloc_buffer((nsub * TP * 2 * lanes,), "float32")  # d per lane (column h * 8 + lane % 8)
            ms = T.alloc_buffer((nsub * TP * 2 * lanes,), "float32")  # m in the first k group's lanes, else 0
            for sb, g, h, v in T.grid(nsub, TP, 2, lanes):
                ds[((sb * TP + g) * 2 + h) * lanes + v] = scales.d(wsb, wsh, t * TP + g, sb, h * CW + v % CW)
                if fmt.has_min:
                    ms[((sb * TP + g) * 2 + h) * lanes + v] = T.if_then_else(
                        v < CW, scales.m(wsb, wsh, t * TP + g, sb, h * CW + v % CW), T.float32(0))
            for io in range((m + MR - 1) // MR):
                acc = T.alloc_local((MR, TP, 2, lanes), "float32")
                part = T.alloc_local((MR, TP, 2, lanes), "int32")
                for r, g, h in T.grid(MR, TP, 2):
                    for v in T.vectorized(lanes):
                        acc[r, g, h, v] = T.float32(0)
                for kb in range(nb):
                    for u in T.unroll(SPB):
                        for r, g, h in T.grid(MR, TP, 2):
                            part[r, g, h, T.ramp(0, 1, lanes)] = first_kgroup(
                                -offset * ssum[T.min(io * MR + r, m - 1) * nsub + kb * SPB + u])
                        for o in T.unroll(VS):
                            for g in T.unroll(TP):
                                for r in T.unroll(MR):
                                    for h in T.unroll(2):
                                        part[r, g, h, T.ramp(0, 1, lanes)] = dot_u8s8(
                                            dot, lanes, part[r, g, h, T.ramp(0, 1, lanes)],
                                            wc[T.ramp(((g * KV + (kb * SPB + u) * VS + o) * 2 + h) * nbytes, 1,
                                                      nbytes)],
                                            xdwords(xq, T.min(io * MR + r, m - 1), kb * B + (u * VS + o) * steps))
                        for r, g, h in T.grid(MR, TP, 2):
                            for v in T.vectorized(lanes):
                                acc[r, g, h, v] = acc[r, g, h, v] + T.Cast("float32", part[r, g, h, v]) * (
                                    ds[(((kb * SPB + u) * TP + g) * 2 + h) * lanes + v]
                                    * sx[T.min(io * MR + r, m - 1) * nb + kb])
                        if fmt.has_min:
                            for r, g, h in T.grid(MR, TP, 2):
                                for v in T.vectorized(lanes):
                                    acc[r, g, h, v] = acc[r, g, h, v] + ms[
                                        (((kb * SPB + u) * TP + g) * 2 + h) * lanes + v] * (
                                        sx[T.min(io * MR + r, m - 1) * nb + kb] * T.Cast(
                                            "float32", ssum[T.min(io * MR + r, m - 1) * nsub + kb * SPB + u]))
                for r in T.unroll(MR):
                    if io * MR + r < m:
                        for g, h in T.grid(TP, 2):
                            for c in (T.vectorized if full else T.serial)(CW):
                                if full or (t * TP + g) * PANEL + h * CW + c < N:
                                    y[io * MR + r, (t * TP + g) * PANEL + h * CW + c] = epilogue(
                                        _sum_lanes(acc, r, g, h, c, kgroups, CW), b, res, io * MR + r,
                                        (t * TP + g) * PANEL + h * CW + c)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)
