"""Decode GEMVs over blocks kept from a model file (ggml's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in kquant's panels layout.

W [K, N] is `kquant.pack_panels`' two buffers: values uint8 [P, K * 8 + (bits - 4) * K * 2] (per panel the low
nibbles in groups of 4 rows, then the codes' high bits in 64-byte records of kquant.high_rows rows, both in the
permuted vectors' byte order: see kquant's module doc) and scales uint8 [P, kquant.panel_scale_bytes] in records
(kquant.PanelScales; one level a block's: d fp16 [16] (then m); two levels a super-block's: sc [256 / S, 16] (then
mn), D fp16 [16] (then Dmin)). A weight is d (c - offset) (+ m), d = D sc and m = -(Dmin mn) for two levels.

* `gemv_panels_kq_x8`: x quantized to int8 per 32-block (quant.x_quantizer, as gemv_panels_q4x8), integer dot
  products of the full codes c = nibble | high bits << 4 with xq: a vector of nibbles is loaded as stored (each
  dword one column's 4 k steps), and its high bits are its record's bytes (in the same order) shifted by a
  constant in 16-bit lanes and masked (`high_bits`), OR'ed into the codes: one dot per vector and nibble half
  for any code width (u8 codes < 64 times s8: vpmaddubsw's pair sums 2 * 63 * 127 < 2^15). The offset (Q5_0's
  16, Q6_K's 32) is taken off in the integer sums' start, -offset * sum(xq) over the sub-block.
  Per sub-block the two nibble halves' sums (and their k groups' lanes) become one int32 vector of the panel's 16
  columns (two shuffles and an add), scaled in 16-lane fp32: one level acc += float(sum) * d * sx (+ m * xs, xs
  = sx * sum(xq)); two levels the super-block's sums asb += float(sum) * float(sc) * sx (Q6_K: its two 16-row
  sub-blocks summed with their sc first, sx once a 32-block) and amn += float(mn) * xs, then once a super-block
  acc += asb * D - amn * Dmin (D, Dmin converted once a super-block). The task's accumulators are alloc_buffer
  (stack, kept in registers), not alloc_local (in a parallel loop a workspace allocation, read and written
  through memory every block).
* `gemv_panels_kq`: fp32 activations (as quant._gemv_q4: two k steps per 16-lane vector, fp32 FMAs of the
  decoded codes, the offset folded into the sub-block sums' start).

Args of both: x, w, ws, (b), (res), y, as quant.gemv_panels_q4x8.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from runtime.dtypes import QUANT_BLOCK, WeightFormat

from . import cpu as _cpu
from .compute import drop_params
from .cpu import PANEL
from .kquant import PanelScales, high_rows, high_slot, scale_byte_dtype
from .quant import (HALF, QUANT_GEMV_PANELS, X8_GEMV_PANELS, check_dot, dot_u8s8, pair_controls, pair_of_group,
                    stream_prefetcher, x_quantizer)


def _check_kq(K, N, fmt: WeightFormat):
    if not fmt.kept_from_file or fmt.bits not in (4, 5, 6) or fmt.block not in (16, 32):
        raise ValueError(f"{fmt.name} is not a format kept from a file (q5_0, q5_1, q4_k, q5_k, q6_k)")
    whole = fmt.super_block or QUANT_BLOCK
    if K <= 0 or K % whole or N <= 0:
        raise ValueError(f"a {K}x{N} {fmt.name} weight needs K a positive multiple of {whole}")


class _Scales:
    """Where a panel's scales are in the scales buffer (flat views: bytes `u8`/`i8` and fp16 `f16`), as TIR
    expressions of the panel p, the sub-block sb and the column col (kquant.PanelScales' records)."""

    def __init__(self, fmt: WeightFormat, K: int):
        self.fmt, self.K = fmt, K
        self.at = PanelScales(fmt, K)
        self.row = self.at.row  # bytes per panel
        self.two = bool(fmt.super_block)
        self.per_super = fmt.super_block // fmt.block if self.two else 0
        self.byte_dtype = scale_byte_dtype(fmt)  # the type the buffer's per-block bytes (`wsb`) are read as

    def d(self, wsb, wsh, p, sb, col):
        """The sub-block's scale d as fp32."""
        if self.two:
            sc = T.Cast("float32", wsb[p * self.row + self.at.scale(sb) + col])
            return sc * T.Cast("float32", wsh[p * (self.row // 2) + self.at.sup(sb // self.per_super) // 2 + col])
        return T.Cast("float32", wsh[p * (self.row // 2) + self.at.scale(sb) // 2 + col])

    def m(self, wsb, wsh, p, sb, col):
        """The sub-block's minimum m as fp32 (formats with mins)."""
        if self.two:
            mn = T.Cast("float32", wsb[p * self.row + self.at.min(sb) + col])
            return -(T.Cast("float32", wsh[p * (self.row // 2) + self.at.sup_min(sb // self.per_super) // 2 + col])
                     * mn)
        return T.Cast("float32", wsh[p * (self.row // 2) + self.at.min(sb) // 2 + col])


def high_bits(wf, start, fmt: WeightFormat, rec, row, half, nbytes):
    """The high bits (<< 4) of the codes of a vector of nibbles (stored grouped, kquant.group_rows; nbytes 64: 8
    k steps, 32: 4) from row `row` (a multiple of nbytes // 8; an expression of unrolled loops', so the shifts fold to
    constants) of high-bit record `rec` of the panel whose high bits start at wf[start], nibble half `half`
    (kquant.high_slot): one load, one shift (in 16-bit lanes: the mask drops what crosses bytes) and a mask."""
    h = fmt.bits - 4
    at, slot = high_slot(h, row, half)
    raw = wf[T.ramp(start + rec * 64 + (at if nbytes == 32 else 0), 1, nbytes)]
    w16 = T.reinterpret(f"uint16x{nbytes // 2}", raw)
    left, right = T.max(4 - h * slot, 0), T.max(h * slot - 4, 0)
    w16 = (w16 << T.broadcast(T.Cast("uint16", left), nbytes // 2)) >> T.broadcast(T.Cast("uint16", right),
                                                                                    nbytes // 2)
    return T.reinterpret(f"uint8x{nbytes}", w16) & T.broadcast(T.uint8(((1 << h) - 1) << 4), nbytes)


def gemv_panels_kq_x8(name, K, N, *, fmt: WeightFormat, bias=False, act="none", residual=False, dot="vnni",
                      lanes=16, group=None):
    """Decode y[1, N] = act(x[1, K] @ W + b) + res, W in kquant's panels layout (`fmt`: q5_0, q5_1, q4_k, q5_k,
    q6_k), x quantized to int8 per 32-block.  Args: x, w, ws, (b), (res), y. `dot`, `lanes` as
    quant.gemv_panels_q4x8 ("vnni", 16: AVX512-VNNI; "madd", 16: AVX512BW; "madd", 8: AVX2). See the module doc."""
    _check_kq(K, N, fmt)
    check_dot(dot, lanes)
    B, SB = QUANT_BLOCK, fmt.block
    SPB = B // SB  # sub-blocks per 32-block of x (Q6_K: 2)
    nb, nsub = K // B, K // SB
    planes = fmt.bits - 4
    panels = -(-N // PANEL)
    group = group or _cpu.gemv_group(panels, X8_GEMV_PANELS)
    width = group * PANEL
    full = N % width == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    VB = K * 8 + planes * K * 2  # value bytes per panel
    scales = _Scales(fmt, K)
    SBY = scales.row
    nbytes = 4 * lanes
    steps = nbytes // HALF  # k steps per vector (8 or 4)
    kgroups = lanes // HALF
    VS = SB // steps  # vectors per sub-block
    m15, m4 = T.broadcast(T.uint8(15), nbytes), T.broadcast(T.uint8(4), nbytes)
    HR = high_rows(fmt) if planes else B
    offset = fmt.offset
    quantize_x = x_quantizer(K)
    prefetch_next = stream_prefetcher(panels, group, VB, ((0, B * HALF), (K * HALF, planes * 64)))

    def codes(wf, p, kb, kin, nib_half):
        """The permuted vector's codes at row kb * 32 + kin (kin static) (nibble half `nib_half`: 0 low, 1 high)."""
        nib = wf[T.ramp(p * VB + (kb * B + kin) * HALF, 1, nbytes)]
        c = (nib & m15) if nib_half == 0 else ((nib >> m4) & m15)
        if planes:
            c = c | high_bits(wf, p * VB + K * HALF, fmt, kb * (B // HR) + kin // HR, kin % HR, nib_half, nbytes)
        return c

    two = bool(fmt.super_block)
    per_sup = (fmt.super_block or B) // B  # 32-blocks per super-block (one level: 1)
    nsup = nb // per_sup
    REC, MIN, SUP, SUP_MIN = scales.at.record, scales.at.min_at, scales.at.sup_at, scales.at.sup_min_at

    def byte_field(wsb, p, rec, at):
        """Panel p's 16 bytes at byte `at` of scales record `rec` (sc, mn), as fp32."""
        return T.Cast(f"float32x{PANEL}", wsb[T.ramp(p * SBY + rec * REC + at, 1, PANEL)])

    def half_field(wsh, p, rec, at):
        """Panel p's 16 fp16 at byte `at` of scales record `rec` (d, m; D, Dmin), as fp32."""
        return T.Cast(f"float32x{PANEL}", wsh[T.ramp(p * (SBY // 2) + (rec * REC + at) // 2, 1, PANEL)])

    def columns(part, g):
        """Panel g's 16 columns' int32 sums: each half's lanes of its k groups added (lanes c, c + 8, ...)."""
        total = None
        for kg in range(kgroups):
            sel = [tirx.IntImm("int32", h * lanes + kg * HALF + c) for h in range(2) for c in range(HALF)]
            v = T.Shuffle([part[g, 0, T.ramp(0, 1, lanes)], part[g, 1, T.ramp(0, 1, lanes)]], sel)
            total = v if total is None else total + v
        return total

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, VB), "uint8"),
               ws: T.Buffer((panels, SBY), "uint8"), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        wf = T.decl_buffer((panels * VB,), "uint8", data=w.data)
        wsb = T.decl_buffer((panels * SBY,), scales.byte_dtype, data=ws.data)
        wsh = T.decl_buffer((panels * SBY // 2,), "float16", data=ws.data)
        xq = T.alloc_buffer((K,), "int8")
        xq32 = T.decl_buffer((K // 4,), "int32", data=xq.data)
        sx = T.alloc_buffer((nb,), "float32")
        xsum = T.alloc_buffer((nb,), "int32")
        ssum = T.alloc_buffer((nsub,), "int32")
        xs = T.alloc_buffer((nsub,), "float32")
        xc = T.alloc_buffer((nsub, lanes), "int32")
        xpat = T.alloc_buffer((K // steps, lanes), "int32")
        xpat8 = T.decl_buffer((K // steps * nbytes,), "int8", data=xpat.data)
        quantize_x(x, 0, xq, sx, xsum, 0)
        for sb in range(nsub):
            ssum[sb] = 0
            for v in range(SB):
                ssum[sb] = ssum[sb] + T.Cast("int32", xq[sb * SB + v])
            xs[sb] = sx[sb // SPB] * T.Cast("float32", ssum[sb])
            for v in T.vectorized(lanes):
                xc[sb, v] = T.if_then_else(v < HALF, -offset * ssum[sb], 0)
        for o in range(K // steps):
            for v in T.vectorized(lanes):
                xpat[o, v] = xq32[kgroups * o + v // HALF]
        for t in T.parallel(panels // group):
            acc = T.alloc_buffer((group, PANEL), "float32")
            asb = T.alloc_buffer((group, PANEL), "float32")  # two levels: the super-block's sums, times sx and sc
            amn = T.alloc_buffer((group, PANEL), "float32")  # two levels with mins: sum of mn * xs over it
            blk = T.alloc_buffer((group, PANEL), "float32")  # the 32-block's sum, times sc (Q6_K: two sub-blocks)
            part = T.alloc_buffer((group, 2, lanes), "int32")
            for g in T.unroll(group):
                acc[g, T.ramp(0, 1, PANEL)] = T.broadcast(T.float32(0), PANEL)
            for sup in range(nsup):
                if two:
                    for g in T.unroll(group):
                        asb[g, T.ramp(0, 1, PANEL)] = T.broadcast(T.float32(0), PANEL)
                        if fmt.has_min:
                            amn[g, T.ramp(0, 1, PANEL)] = T.broadcast(T.float32(0), PANEL)
                for kq in range(per_sup):
                    prefetch_next(wf, t, sup * per_sup + kq)
                    for u in T.unroll(SPB):
                        for g, h in T.grid(group, 2):
                            for v in T.vectorized(lanes):
                                part[g, h, v] = xc[(sup * per_sup + kq) * SPB + u, v]
                        for o in T.unroll(VS):
                            for g in T.unroll(group):
                                part[g, 0, T.ramp(0, 1, lanes)] = dot_u8s8(
                                    dot, lanes, part[g, 0, T.ramp(0, 1, lanes)],
                                    codes(wf, t * group + g, sup * per_sup + kq,
                                          (u * VS + o) * steps, 0),
                                    xpat8[T.ramp(((sup * per_sup + kq) * (B // steps) + u * VS + o) * nbytes, 1,
                                                 nbytes)])
                                part[g, 1, T.ramp(0, 1, lanes)] = dot_u8s8(
                                    dot, lanes, part[g, 1, T.ramp(0, 1, lanes)],
                                    codes(wf, t * group + g, sup * per_sup + kq,
                                          (u * VS + o) * steps, 1),
                                    xpat8[T.ramp(((sup * per_sup + kq) * (B // steps) + u * VS + o) * nbytes, 1,
                                                 nbytes)])
                        for g in T.unroll(group):
                            if two:
                                if u == 0:
                                    blk[g, T.ramp(0, 1, PANEL)] = T.Cast(f"float32x{PANEL}", columns(part, g)) * (
                                        byte_field(wsb, t * group + g, sup, (kq * SPB + u) * PANEL))
                                else:
                                    blk[g, T.ramp(0, 1, PANEL)] = blk[g, T.ramp(0, 1, PANEL)] + T.Cast(
                                        f"float32x{PANEL}", columns(part, g)) * (
                                        byte_field(wsb, t * group + g, sup, (kq * SPB + u) * PANEL))
                                if fmt.has_min:
                                    amn[g, T.ramp(0, 1, PANEL)] = amn[g, T.ramp(0, 1, PANEL)] + byte_field(
                                        wsb, t * group + g, sup, MIN + (kq * SPB + u) * PANEL) * T.broadcast(
                                        xs[(sup * per_sup + kq) * SPB + u], PANEL)
                            else:
                                acc[g, T.ramp(0, 1, PANEL)] = acc[g, T.ramp(0, 1, PANEL)] + T.Cast(
                                    f"float32x{PANEL}", columns(part, g)) * (half_field(
                                        wsh, t * group + g, sup * per_sup + kq, 0) * T.broadcast(
                                        sx[sup * per_sup + kq], PANEL))
                                if fmt.has_min:
                                    acc[g, T.ramp(0, 1, PANEL)] = acc[g, T.ramp(0, 1, PANEL)] + half_field(
                                        wsh, t * group + g, sup * per_sup + kq, MIN) * T.broadcast(
                                        xs[sup * per_sup + kq], PANEL)
                    if two:
                        for g in T.unroll(group):
                            asb[g, T.ramp(0, 1, PANEL)] = asb[g, T.ramp(0, 1, PANEL)] + blk[
                                g, T.ramp(0, 1, PANEL)] * T.broadcast(sx[sup * per_sup + kq], PANEL)
                if two:
                    for g in T.unroll(group):
                        acc[g, T.ramp(0, 1, PANEL)] = acc[g, T.ramp(0, 1, PANEL)] + asb[
                            g, T.ramp(0, 1, PANEL)] * half_field(wsh, t * group + g, sup, SUP)
                        if fmt.has_min:
                            acc[g, T.ramp(0, 1, PANEL)] = acc[g, T.ramp(0, 1, PANEL)] - amn[
                                g, T.ramp(0, 1, PANEL)] * half_field(wsh, t * group + g, sup, SUP_MIN)
            for g in T.unroll(group):
                for c in (T.vectorized if full else T.serial)(PANEL):
                    if full or t * width + g * PANEL + c < N:
                        y[0, t * width + g * PANEL + c] = epilogue(acc[g, c], b, res, 0, t * width + g * PANEL + c)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)


def gemv_panels_kq(name, K, N, *, fmt: WeightFormat, bias=False, act="none", residual=False, group=None):
    """Decode y[1, N] = act(x[1, K] @ W + b) + res, W in kquant's panels layout (`fmt`), fp32 activations.
    Args: x, w, ws, (b), (res), y.

    As quant._gemv_q4: a 16-lane vector is two k steps (lanes 0-7 row k, 8-15 row k + 1), against
    xp = x[k] x8 ++ x[k + 1] x8 (made once per call). A 4-step group's 32 bytes of nibbles are stored permuted
    (kquant's panels); its codes (nibble half: the low codes of columns 0-7 or the high ones of 8-15, OR'ed with
    the group's high bits, half a record shifted and masked as `high_bits`) are put in the k pairs' order by two
    shuffles a group. Per sub-block the fp32 sums start at -offset * sum(x) (lanes: the even and the odd k) and
    acc += sum * d (+ m * sum(x) where the format has mins); lanes l and l + 8 are summed in the epilogue."""
    _check_kq(K, N, fmt)
    SB = fmt.block
    nsub = K // SB
    planes = fmt.bits - 4
    panels = -(-N // PANEL)
    group = group or _cpu.gemv_group(panels, QUANT_GEMV_PANELS)
    width = group * PANEL
    full = N % width == 0
    epilogue = _cpu._epilogue(act, bias, residual)
    VB = K * 8 + planes * K * 2
    scales = _Scales(fmt, K)
    SBY = scales.row
    m15, m4 = T.broadcast(T.uint8(15), 32), T.broadcast(T.uint8(4), 32)
    HR = high_rows(fmt) if planes else SB
    factor = T.float32(-fmt.offset)

    def codes(wf, ctls, p, sb, j4, q, nib_half):
        """Codes of the k pair at row sb * SB + 4 j4 + 2 q (q a Python 0 or 1) as 16 lanes: the low nibbles'
        columns (0-7) or the high ones' (8-15); lanes 8-15 the second row. The 4-step group's codes (nibbles and
        high bits, both stored grouped) are put in the pairs' order by quant.pair_of_group."""
        nib = wf[T.ramp(p * VB + (sb * SB + 4 * j4) * HALF, 1, 32)]
        c = (nib & m15) if nib_half == 0 else (nib >> m4)
        if planes:
            c = c | high_bits(wf, p * VB + K * HALF, fmt, sb * (SB // HR) + 4 * j4 // HR, 4 * j4 % HR, nib_half, 32)
        return pair_of_group(c, ctls, q)

    @T.prim_func
    def kernel(x: T.Buffer((1, K), "float32"), w: T.Buffer((panels, VB), "uint8"),
               ws: T.Buffer((panels, SBY), "uint8"), b: T.Buffer((N,), "float32"),
               res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        wf = T.decl_buffer((panels * VB,), "uint8", data=w.data)
        wsb = T.decl_buffer((panels * SBY,), scales.byte_dtype, data=ws.data)
        wsh = T.decl_buffer((panels * SBY // 2,), "float16", data=ws.data)
        xp = T.alloc_buffer((K // 2, PANEL), "float32")
        xsm = T.alloc_buffer((nsub, PANEL), "float32")
        ctl = T.alloc_buffer((16,), "int32")
        ctl8 = T.decl_buffer((64,), "int8", data=ctl.data)
        pair_controls(ctl, ctl8)
        for j in range(K // 2):
            for v in T.vectorized(PANEL):
                xp[j, v] = x[0, 2 * j + v // HALF]
        for sb in range(nsub):
            for v in T.vectorized(PANEL):
                xsm[sb, v] = T.float32(0)
            for j in range(SB // 2):
                for v in T.vectorized(PANEL):
                    xsm[sb, v] = xsm[sb, v] + xp[sb * (SB // 2) + j, v]
        for t in T.parallel(panels // group):
            acc = T.alloc_local((group, 2, PANEL), "float32")
            part = T.alloc_local((group, 2, PANEL), "float32")
            for g, h in T.grid(group, 2):
                for v in T.vectorized(PANEL):
                    acc[g, h, v] = T.float32(0)
            for sb in range(nsub):
                for g, h in T.grid(group, 2):
                    for v in T.vectorized(PANEL):
                        part[g, h, v] = factor * xsm[sb, v]
                for j in T.unroll(SB // 4):
                    for g in T.unroll(group):
                        part[g, 0, T.ramp(0, 1, PANEL)] = part[g, 0, T.ramp(0, 1, PANEL)] + xp[
                            sb * (SB // 2) + 2 * j + 0, T.ramp(0, 1, PANEL)] * codes(
                                wf, (ctl, ctl8), t * group + g, sb, j, 0, 0)
                        part[g, 1, T.ramp(0, 1, PANEL)] = part[g, 1, T.ramp(0, 1, PANEL)] + xp[
                            sb * (SB // 2) + 2 * j + 0, T.ramp(0, 1, PANEL)] * codes(
                                wf, (ctl, ctl8), t * group + g, sb, j, 0, 1)
                        part[g, 0, T.ramp(0, 1, PANEL)] = part[g, 0, T.ramp(0, 1, PANEL)] + xp[
                            sb * (SB // 2) + 2 * j + 1, T.ramp(0, 1, PANEL)] * codes(
                                wf, (ctl, ctl8), t * group + g, sb, j, 1, 0)
                        part[g, 1, T.ramp(0, 1, PANEL)] = part[g, 1, T.ramp(0, 1, PANEL)] + xp[
                            sb * (SB // 2) + 2 * j + 1, T.ramp(0, 1, PANEL)] * codes(
                                wf, (ctl, ctl8), t * group + g, sb, j, 1, 1)
                for g, h, half in T.grid(group, 2, 2):
                    for c in T.vectorized(HALF):
                        acc[g, h, half * HALF + c] = acc[g, h, half * HALF + c] + part[g, h, half * HALF + c] * (
                            scales.d(wsb, wsh, t * group + g, sb, h * HALF + c))
                if fmt.has_min:
                    for g, h, half in T.grid(group, 2, 2):
                        for c in T.vectorized(HALF):
                            acc[g, h, half * HALF + c] = acc[g, h, half * HALF + c] + xsm[sb, half * HALF + c] * (
                                scales.m(wsb, wsh, t * group + g, sb, h * HALF + c))
            for g, h in T.grid(group, 2):
                for c in (T.vectorized if full else T.serial)(HALF):
                    if full or t * width + g * PANEL + h * HALF + c < N:
                        y[0, t * width + g * PANEL + h * HALF + c] = epilogue(
                            acc[g, h, c] + acc[g, h, HALF + c], b, res, 0, t * width + g * PANEL + h * HALF + c)

    unused = ([] if bias else ["b"]) + ([] if residual else ["res"])
    return drop_params(kernel, unused).with_attr("global_symbol", name)
