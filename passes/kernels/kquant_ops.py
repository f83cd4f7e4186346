"""The CPU kernels over blocks kept from a model file (ggml's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) other than the decode
GEMVs (`kquant_gemv`) and the int8-activation prefill GEMM (`kquant_gemm`, AVX-512): the prefill GEMM's weight
operand over `kquant`'s panels layout (`kq_panels_weight`, which `cpu.gemm` dequantizes into its per-task fp32
panels), the embedding gather over `kquant`'s rows layout
(`embed_kq`), and the makers `ops` registers (`linear_panels_kq`, `embed_kq`).

A value is read as `kquant`'s module doc defines it: the code c = low nibble | the high bits << 4,
q = c - fmt.offset; d = fp16 d (one level) or float(D) * float(sc) (two levels: sc uint8, Q6_K's int8); m = fp16 m
or -(float(Dmin) * float(mn)); the value is float32 q * d, then + m where the format has mins (bit for bit
`KBlocks.dequantize`: the products of 4- and 5-bit codes are exact, so no fused multiply-add changes a value).
The scales buffers are bytes; their fields are read through `T.decl_buffer` views (uint8, int8, float16) of them at
the layouts' byte offsets (the rows' `_fields`, the panels' records `kquant.PanelScales`).

Makers take the format by its name (`fmt`: a `runtime.dtypes.WEIGHT_FORMATS` key): kernel specs are JSON data.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from runtime.dtypes import FILE_FORMATS, WEIGHT_FORMATS, WeightFormat

from . import cpu as _cpu, kquant_gemm, kquant_gemv
from .compute import clamp_index, drop_params, row_dim, scaled_row
from .cpu import PANEL
from .kquant import PanelScales, grouped_byte, high_rows, panel_scale_bytes
from .quant import QUANT_GEMV_PANELS, X8_GEMV_PANELS

HALF = PANEL // 2  # a panel's k step: bytes holding columns v (low nibble) and v + 8 (high)
ROW_BLOCK = 32  # the rows layout's nibbles come in Q4_0's 32-element groups, whatever the format's block
ROW_LANES = ROW_BLOCK // 2  # embed_kq's vectors: one half of such a group (the low or the high nibbles)


def kq_format(fmt: str) -> WeightFormat:
    """The kept format named `fmt` (the makers' argument)."""
    if not isinstance(fmt, str):
        raise TypeError(f"fmt is a format's name (kernel specs are data), got {fmt!r}")
    if fmt not in FILE_FORMATS:
        raise ValueError(f"{fmt!r} is not a format kept from a file; these kernels read {', '.join(FILE_FORMATS)}")
    return WEIGHT_FORMATS[fmt]


def _check_length(fmt: WeightFormat, length: int, what: str):
    whole = fmt.super_block or fmt.block
    if length <= 0 or length % whole or length % ROW_BLOCK:
        raise ValueError(f"{fmt.name} blocks need {what} a positive multiple of {max(whole, ROW_BLOCK)}, got {length}")


@dataclass(frozen=True)
class _Fields:
    """Byte offsets of a row's scales record's fields (`cols` 1: the rows layout), each [n, cols]:
    one level: d fp16 (`scale`), m fp16 (`min`); two levels: sc (`scale`) and mn (`min`) one byte each, D fp16
    (`sup`), Dmin fp16 (`sup_min`). `size`: the record's bytes."""

    scale: int
    min: int
    sup: int
    sup_min: int
    size: int


def _fields(fmt: WeightFormat, length: int, cols: int) -> _Fields:
    nb = length // fmt.block
    if fmt.super_block:
        nsb = length // fmt.super_block
        sup = fmt.per_block * nb * cols
        return _Fields(0, nb * cols, sup, sup + nsb * cols * 2, sup + fmt.per_block * nsb * cols * 2)
    return _Fields(0, nb * cols * 2, 0, 0, fmt.per_block * nb * cols * 2)


def _code(low_byte, shift, plane_bytes, bit):
    """The code (int32) of a value: the nibble of `low_byte` at `shift` (0 or 4), then plane j's bit `bit` of
    plane_bytes[j] as bit 4 + j."""
    code = (T.Cast("int32", low_byte) >> shift) & 15
    for j, plane in enumerate(plane_bytes):
        code = code | (((T.Cast("int32", plane) >> bit) & 1) << (4 + j))
    return code


def _panel_code(w, w32, p, K, k, half, v, fmt: WeightFormat):
    """The code (int32) of panel p's value at row k, column half * 8 + v in the panels layout (w [P, bytes], w32
    its flat uint32 view): the nibble (half 0 low, 1 high), then `fmt`'s bits - 4 high bits from its record's
    byte (kquant.high_slot) as bits 4 ..: the nibbles' byte where kquant.grouped_byte puts it; the high bits', 4
    apart over v, read as the dwords (column v's 4 rows, contiguous over v) and shifted to row k % 4's byte."""
    code = (T.Cast("int32", w[p, grouped_byte(k, v)]) >> (half * 4)) & 15
    h = fmt.bits - 4
    if h:
        HR = high_rows(fmt)
        vbytes = K * HALF + h * K * 2
        dword = w32[(p * vbytes + K * HALF + k // HR * 64 + k % 8 // 4 * 32) // 4 + v]
        high = T.Cast("int32", (dword >> T.Cast("uint32", 8 * (k % 4) + h * (2 * (k % HR // 8) + half)))
                      & T.uint32((1 << h) - 1))
        code = code | (high << 4)
    return code


def _value(fmt: WeightFormat, code, views, base, fields: _Fields, blk, sblk):
    """The float32 value of `code`: views (u8, i8, f16) of the scales, `base` the record's first byte (even),
    `blk` (`sblk`) the element's index in a [n, cols] field of blocks (super-blocks): block * cols + column."""
    if fmt.super_block:
        return _value_at(fmt, code, views, base + fields.scale + blk, base + fields.min + blk,
                         base + fields.sup + 2 * sblk, base + fields.sup_min + 2 * sblk)
    return _value_at(fmt, code, views, base + fields.scale + 2 * blk, base + fields.min + 2 * blk, None, None)


def _value_at(fmt: WeightFormat, code, views, scale, mn, sup, sup_min):
    """The float32 value of `code`: views (u8, i8, f16) of the scales and the byte offsets of its fields there
    (fp16 ones even): the block's d (one level) or sc, its m or mn, the super-block's D and Dmin (two levels)."""
    u8, i8, f16 = views
    q = T.Cast("float32", code - fmt.offset)
    if fmt.super_block:
        subs = i8 if fmt.sub_scale == "int8" else u8
        d = T.Cast("float32", f16[sup // 2]) * T.Cast("float32", subs[scale])
        value = q * d
        if fmt.has_min:
            m = T.Cast("float32", f16[sup_min // 2]) * T.Cast("float32", u8[mn])
            value = value - m  # (x - y is x + (-y) exactly: KBlocks' + -(Dmin mn))
        return value
    value = q * T.Cast("float32", f16[scale // 2])
    if fmt.has_min:
        value = value + T.Cast("float32", f16[mn // 2])
    return value


def _panel_fields(at: PanelScales, base, blk, col):
    """_value_at's byte offsets of block `blk`'s scales for column `col` of the panel whose record starts at
    `base` (kquant.PanelScales)."""
    item = at.item
    sup = blk // at.rows if at.two else None
    return (base + at.scale(blk) + col * item, base + at.min(blk) + col * item,
            None if sup is None else base + at.sup(sup) + 2 * col,
            None if sup is None else base + at.sup_min(sup) + 2 * col)


# --------------------------------------------------------------------------------------------
# Prefill: cpu.gemm over kq panels, dequantized into its per-task fp32 panels
# --------------------------------------------------------------------------------------------


def kq_panels_weight(K, N, *, fmt: str) -> _cpu.GemmWeight:
    """`kquant`'s panels layout (pack_panels) as a gemm operand: w uint8 [P, K * 8 + (bits - 4) * K * 2], ws uint8
    [P, panel_scale_bytes]; a task dequantizes its tile_panels panels into fp32 [tile_panels, K, 16] k step by k
    step (per k: its nibbles' bytes, the high bits' bytes of its record (kquant.high_slot), the block's scales)."""
    f = kq_format(fmt)
    _check_length(f, K, "K")
    panels = -(-N // PANEL)
    vbytes = K * 8 + (f.bits - 4) * K * 2
    sbytes = panel_scale_bytes(f, K)
    at = PanelScales(f, K)
    B = f.block

    def make(tile_panels):
        @T.macro
        def pack(packed, w, ws, p):
            su8 = T.decl_buffer((panels * sbytes,), "uint8", data=ws.data)
            si8 = T.decl_buffer((panels * sbytes,), "int8", data=ws.data)
            sf16 = T.decl_buffer((panels * sbytes // 2,), "float16", data=ws.data)
            w32 = T.decl_buffer((panels * vbytes // 4,), "uint32", data=w.data)
            for q, k in T.grid(tile_panels, K):
                for h in T.unroll(2):
                    for v in T.vectorized(HALF):
                        packed[q, k, h * HALF + v] = _value_at(
                            f,
                            _panel_code(w, w32, p * tile_panels + q, K, k, h, v, f),
                            (su8, si8, sf16), *_panel_fields(at, (p * tile_panels + q) * sbytes, k // B,
                                                             h * HALF + v))

        return pack

    return _cpu.GemmWeight(((panels, vbytes), "uint8"), ((panels, sbytes), "uint8"), make)


# --------------------------------------------------------------------------------------------
# The embedding gather over kq rows
# --------------------------------------------------------------------------------------------


def embed_kq(name, V, D, *, rows, positions: int | None, fmt: str, scale: float = 1.0):
    """y[i] = table[ids[i]] (+ pos_table[start + i]) over a table in `kquant`'s rows layout (pack_rows: values
    uint8 [V, D / 2 + (bits - 4) * D / 8], scales bytes [V, panel_scale_bytes(fmt, D) / 16]), each looked-up row
    dequantized (times `scale`, Gemma's sqrt(d_model)); ids and positions clamped to the tables. Args: ids, table_q,
    table_s, (pos_table, start), y.
    Vectors of half a 32-group (16 lanes): the low or the high nibbles of 16 consecutive bytes."""
    f = kq_format(fmt)
    _check_length(f, D, "D")
    m = row_dim(rows)
    loop = T.parallel if rows is None else T.serial
    vbytes = D // 2 + (f.bits - 4) * D // 8
    fields = _fields(f, D, 1)
    sbytes = fields.size
    assert sbytes * PANEL == panel_scale_bytes(f, D)
    planes, groups = f.bits - 4, D // ROW_BLOCK
    B, S = f.block, f.super_block or 1
    npos = positions or 1

    def position(pos, start, i, j, value):
        return value + pos[clamp_index(start + i, npos), j] if positions else value

    @T.prim_func
    def kernel(ids_h: T.handle, table_q: T.Buffer((V, vbytes), "uint8"), table_s: T.Buffer((V, sbytes), "uint8"),
               pos_table: T.Buffer((npos, D), "float32"), start: T.int64, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        ids = T.match_buffer(ids_h, (m,), "int64")
        y = T.match_buffer(y_h, (m, D), "float32")
        su8 = T.decl_buffer((V * sbytes,), "uint8", data=table_s.data)
        si8 = T.decl_buffer((V * sbytes,), "int8", data=table_s.data)
        sf16 = T.decl_buffer((V * sbytes // 2,), "float16", data=table_s.data)
        for i in loop(m):
            for g, h in T.grid(groups, 2):
                for v in T.vectorized(ROW_LANES):
                    y[i, g * ROW_BLOCK + h * ROW_LANES + v] = position(
                        pos_table, start, i, g * ROW_BLOCK + h * ROW_LANES + v, scaled_row(_value(
                            f,
                            _code(table_q[clamp_index(ids[i], V), g * ROW_LANES + v], h * 4,
                                  [table_q[clamp_index(ids[i], V),
                                           D // 2 + j * (D // 8) + g * 4 + h * 2 + v // 8] for j in range(planes)],
                                  v % 8),
                            (su8, si8, sf16), clamp_index(ids[i], V) * sbytes, fields,
                            g * (ROW_BLOCK // B) + h * (ROW_LANES // B), g * ROW_BLOCK // S), scale))

    unused = [] if positions else ["pos_table", "start"]
    return drop_params(kernel, unused).with_attr("global_symbol", name)


# --------------------------------------------------------------------------------------------
# The makers (ops.linear_panels_kq, ops.embed_kq)
# --------------------------------------------------------------------------------------------


def linear_panels_kq(name, K, N, *, rows, fmt: str, bias: bool, act="none", residual=False, tile_panels=1,
                     int8_dot=None):
    """y[m, N] = act(x[m, K] @ W + b) + res, W in `kquant`'s panels layout (pack_panels) of the kept format named
    `fmt`.  Args: x, w, ws, (b), (res), y. Decode (rows 1): `kquant_gemv`'s gemv_panels_kq, or with `int8_dot`
    gemv_panels_kq_x8 (x quantized to int8 blocks; 16 lanes under AVX-512's budget, tile_panels > 1, else 8).
    Prefill: with `int8_dot`, kquant_gemm.gemm_panels_kqx8, each row of x quantized to int8 blocks (zmm tiles of
    `tile_panels` panels, or ymm on AVX2); else cpu.gemm over kq_panels_weight, `tile_panels` per register tile
    (1: AVX2, 2: AVX-512), which dequantizes every weight to fp32."""
    f = kq_format(fmt)
    _check_length(f, K, "K")
    wide = tile_panels > 1
    if rows == 1:
        panels = -(-N // PANEL)
        if int8_dot is not None:
            group = _cpu.gemv_group(panels, X8_GEMV_PANELS if wide else 2)
            return kquant_gemv.gemv_panels_kq_x8(name, K, N, fmt=f, bias=bias, act=act, residual=residual,
                                                 dot=int8_dot, lanes=16 if wide else 8, group=group)
        group = _cpu.gemv_group(panels, QUANT_GEMV_PANELS if wide else 1)
        return kquant_gemv.gemv_panels_kq(name, K, N, fmt=f, bias=bias, act=act, residual=residual, group=group)
    row_dim(rows)
    if int8_dot is not None:
        return kquant_gemm.gemm_panels_kqx8(name, K, N, fmt=f, bias=bias, act=act, residual=residual, dot=int8_dot,
                                            tile_panels=tile_panels, lanes=16 if wide else 8)
    return _cpu.gemm(name, K, N, layout=kq_panels_weight(K, N, fmt=fmt), bias=bias, act=act, residual=residual,
                     tile_panels=tile_panels)
