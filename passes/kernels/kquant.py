"""Blocks kept from a model file (ggml's Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K): the sub-block form the
compiler holds them in, and the layouts the CPU's kernels read them in.

A format of this family (`runtime.dtypes.WeightFormat.kept_from_file`) stores `bits`-bit unsigned codes c (q + offset)
in blocks of `fmt.block` weights along one axis; a block's value is x = d q (+ m), where
- one level (Q5_0, Q5_1): d (and m) are fp16 per block;
- two levels (the K-quants, `fmt.super_block` 256): d = D sc and m = -(Dmin mn), sc (mn) an integer per block in
  `fmt.sub_scale` and D (Dmin) fp16 per super-block.
The float32 value is d * q, then + m, with d = D * sc and m = -(Dmin * mn) in float32 (all exact products): bit for
bit what ggml's dequantization (and the `gguf` package's) computes.

`KBlocks` holds a matrix so: codes unpacked (uint8, shaped like the matrix) and the scales per block (per
super-block) shaped like it with the block axis divided. It is packed for the kernels (`pack_panels`,
`pack_rows`) into two buffers, values and scales, as the quant layouts are:

* panels (`pack_panels`): a dense linear's [K, N] weight, blocks along K (axis 0), panels of PANEL = 16 columns
  (P = ceil(N / 16); padded columns have codes `offset`, so q = 0, and zero scales). Per panel the values are
  uint8 [K * 8 + (bits - 4) * K * 2]: first the low nibbles in groups of 4 rows [K / 4, 8, 4] (byte 4 v + j of
  group g: row 4 g + j's column v's c & 15 in the low nibble, column v + 8's in the high one), so that a dword is
  one column pair's 4 consecutive k steps (`group_rows`, as int4's panels), as the int8-activation kernels dot
  them: they load a vector with no shuffle; then the high bits c >> 4 (`bits - 4` = h of them
  a code) in records of 64 bytes, one per HR = 32 / h rows (`high_rows`: Q6_K 16, the 5-bit formats 32), in the
  same permuted order: byte e of record r holds 8 / h slots, slot i (bits h i .. h i + h - 1) the
  high bits of the code at row HR r + 8 (i // 2) + 4 (e // 32) + e % 4, column (e // 4) % 8 + 8 (i % 2). So a
  permuted 64-byte vector of nibbles (8 k steps from row 8 o of a record, nibble half n) takes its high bits
  from the record's 64 bytes with one shift (right by h (2 o + n) - 4, left where negative) and a mask
  (`high_slot`); a 32-byte one (4 k steps) from the record's half 32 ((row % 8) // 4). Per panel the scales are
  bytes in records, one a block (one level) or super-block (two levels), so that a kernel streams them in one
  run (`PanelScales`): one level d fp16 [16], then m fp16 [16] where it has mins (32 or 64 bytes); two levels
  sc [256 / S, 16] (S the block, 32 or Q6_K's 16; one byte each), mn [256 / S, 16] where it has mins, D fp16
  [16], Dmin fp16 [16] where it has mins (Q4_K, Q5_K 320 bytes, Q6_K 288).
* rows (`pack_rows`): an [R, C] weight whose rows kernels read whole (the embedding table), blocks along the row
  (axis 1). Per row the values are uint8 [C / 2 + (bits - 4) * C / 8]: the low nibbles in Q4_0's order (byte
  16 b + i: element 32 b + i in the low nibble, 32 b + 16 + i in the high one), then the planes [C / 8] (plane j,
  byte t: bit s is bit 4 + j of element 8 t + s); the scales as bytes, field after field (not in records):
  d [C / 32] (m) fp16, or sc [C / S] (mn) bytes then D [C / 256] (Dmin) fp16.
* columns (`pack_columns`): a [K, N] linear's weight, blocks along K (axis 0), whose rows (one a input channel,
  N codes: the file's column k) a column-sparse kernel reads only for the inputs it keeps. Per row the values are
  uint8 [N / 2 + (bits - 4) * COLUMN_PLANE_BYTES(N)]: the low nibbles in Q4_0's order (as the rows layout), then
  (bits - 4) planes of high bits: plane j, byte 32 g + i, bit s is bit 4 + j of element 32 (8 g + s) + i (one
  32-byte load a 32-element group of nibbles, one constant shift). The scales are records, one a super-block
  (two levels) or block (one level) of K, in a [K / (super-block or block), record bytes] buffer: two levels sc
  [256 / S, N] (one byte each), mn [256 / S, N] where it has mins, D fp16 [N], Dmin fp16 [N] where it has mins;
  one level d fp16 [N], m fp16 [N] where it has mins (`ColumnScales`). A kernel reads a block's record row only
  where it keeps one of the block's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.dtypes import WeightFormat

PANEL = 16  # columns per panel (cpu.PANEL)
COLUMN_GROUP = 256  # elements of a columns-layout row whose high bits share a 32-byte run of each plane
DEQUANTIZE_CHUNK = 1 << 19  # values KBlocks.dequantize computes at a time (measured fastest: 2 MiB of floats)


@dataclass(frozen=True)
class KBlocks:
    """A matrix in a block format, blocked along `axis`: codes [.., ..] uint8 (c = q + fmt.offset, unpacked; int8's
    bytes are q);
    `scales` (and `mins`) per block: fp16 (one level) or fmt.sub_scale integers (two levels), shaped like the
    matrix with the block axis divided by fmt.block; `super_scales` (`super_mins`) fp16 per super-block (two levels)."""

    fmt: WeightFormat
    axis: int
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None
    super_scales: np.ndarray | None = None
    super_mins: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def block_scales(self) -> np.ndarray:
        """d per block, float32 (D * sc for two levels: exact)."""
        if self.fmt.super_block:
            per = self.fmt.super_block // self.fmt.block
            return np.repeat(self.super_scales.astype(np.float32), per, axis=self.axis) * self.scales.astype(np.float32)
        return self.scales.astype(np.float32)

    def block_mins(self) -> np.ndarray | None:
        """m per block, float32 (-(Dmin * mn) for two levels: exact), or None."""
        if not self.fmt.has_min:
            return None
        if self.fmt.super_block:
            per = self.fmt.super_block // self.fmt.block
            return -(np.repeat(self.super_mins.astype(np.float32), per, axis=self.axis) * self.mins.astype(np.float32))
        return self.mins.astype(np.float32)

    def values(self) -> np.ndarray:
        """The signed q, int8 shaped like the matrix (int8 blocks: their bytes, which are q)."""
        if self.fmt.bits == 8:
            return self.codes.view(np.int8)
        return (self.codes.astype(np.int16) - self.fmt.offset).astype(np.int8)

    def dequantize(self, out: np.ndarray | None = None) -> np.ndarray:
        """The float32 matrix the blocks stand for: d * q, + m where the format has mins (see the module doc); into
        `out` (C-contiguous float32, shaped like the matrix) where given. Lines along axis 0 at a time (`_chunks`): each
        chunk's q, products and sums stay in the core's cache."""
        out = np.empty(self.shape, np.float32) if out is None else out
        if out.shape != self.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"dequantize writes a C-contiguous float32 {self.shape}, not {out.dtype} {out.shape}")
        for lines in self._chunks():
            self._lines(lines)._dequantize_into(out[lines])
        return out

    def _chunks(self) -> list[slice]:
        """Ranges of lines along axis 0 of about DEQUANTIZE_CHUNK values (whole super-blocks where axis 0 is
        blocked)."""
        rows, columns = self.shape
        unit = (self.fmt.super_block or self.fmt.block) if self.axis == 0 else 1
        step = max(1, DEQUANTIZE_CHUNK // (columns * unit)) * unit
        return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]

    def _lines(self, lines: slice) -> "KBlocks":
        """The blocks of `lines` along axis 0 (views; whole super-blocks where axis 0 is blocked)."""
        def cut(a, per):
            if a is None:
                return None
            return a[lines] if self.axis == 1 else a[lines.start // per: lines.stop // per]
        return KBlocks(self.fmt, self.axis, self.codes[lines], cut(self.scales, self.fmt.block),
                       cut(self.mins, self.fmt.block), cut(self.super_scales, self.fmt.super_block),
                       cut(self.super_mins, self.fmt.super_block))

    def _dequantize_into(self, out: np.ndarray) -> None:
        """dequantize, into `out` (the scales broadcast over a [.., blocks, block, ..] view: no matrix-sized
        copies of them)."""
        block, (rows, columns) = self.fmt.block, self.shape
        if self.fmt.bits == 8:
            q = self.codes.view(np.int8)
        elif self.fmt.offset:
            # c - offset in the bytes (wrapping to the int8 q: exact), not in float32 (a quarter of the work); the
            # float operations are unchanged: float32(q) * d, then + m
            q = np.subtract(self.codes, np.uint8(self.fmt.offset)).view(np.int8)
        else:
            q = self.codes
        np.copyto(out, q)
        if self.axis == 0:
            blocked, per_block = out.reshape(rows // block, block, columns), (slice(None), None, slice(None))
        else:
            blocked, per_block = out.reshape(rows, columns // block, block), (slice(None), slice(None), None)
        blocked *= self.block_scales()[per_block]
        mins = self.block_mins()
        if mins is not None:
            blocked += mins[per_block]

    def take(self, index: np.ndarray, axis: int) -> "KBlocks":
        """The matrix's lines `index` along the axis that is not blocked (whole blocks move)."""
        if axis == self.axis:
            raise ValueError("only whole lines across the blocks can be taken")
        pick = lambda a: None if a is None else np.take(a, index, axis=axis)  # noqa: E731
        return KBlocks(self.fmt, self.axis, pick(self.codes), pick(self.scales), pick(self.mins),
                       pick(self.super_scales), pick(self.super_mins))

    @property
    def T(self) -> "KBlocks":  # noqa: N802 (numpy's spelling)
        flip = lambda a: None if a is None else np.ascontiguousarray(a.T)  # noqa: E731
        return KBlocks(self.fmt, 1 - self.axis, flip(self.codes), flip(self.scales), flip(self.mins),
                       flip(self.super_scales), flip(self.super_mins))

    @staticmethod
    def concatenate(parts: list["KBlocks"], axis: int) -> "KBlocks":
        """Matrices of one format side by side along the axis that is not blocked."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.axis != first.axis for p in parts) or axis == first.axis:
            raise ValueError("kept blocks join only in one format, across their blocks")
        join = lambda name: (None if getattr(first, name) is None  # noqa: E731
                             else np.concatenate([getattr(p, name) for p in parts], axis=axis))
        return KBlocks(first.fmt, first.axis, join("codes"), join("scales"), join("mins"), join("super_scales"),
                       join("super_mins"))


def high_rows(fmt: WeightFormat) -> int:
    """Rows of the panels layout's 64-byte records of high bits (32 / (bits - 4))."""
    return 32 // (fmt.bits - 4)


def _high_slots(h: int) -> tuple[np.ndarray, np.ndarray]:
    """(row in the record, column) of slot i of byte e of a record of `h`-bit high bits, each [8 / h, 64]."""
    i, e = np.meshgrid(np.arange(8 // h), np.arange(64), indexing="ij")
    return 8 * (i // 2) + 4 * (e // 32) + e % 4, (e // 4) % 8 + 8 * (i % 2)


def high_slot(h: int, row: int, half: int) -> tuple[int, int]:
    """(byte shift s, slot i) of the high bits of a permuted vector of nibbles starting at `row` of a record
    (a multiple of 4), nibble half `half`: its 64-byte (32-byte) vector of high bits is the record's bytes from
    s (0 or 32 (row % 8) // 4), and slot i is bits h i ..: shifted right by h i - 4 (left where negative), masked
    by ((1 << h) - 1) << 4, it is the codes' bits 4 .. 4 + h - 1."""
    return 32 * (row % 8 // 4), 2 * (row // 8) + half


def _scale_bytes(blocks: KBlocks) -> list[np.ndarray]:
    """The per-block arrays in the layouts' order, shaped [blocks along the axis, columns] (axis 0's orientation)."""
    t = (lambda a: a) if blocks.axis == 0 else (lambda a: a.T)
    if blocks.fmt.super_block:
        parts = [blocks.scales, blocks.mins, blocks.super_scales, blocks.super_mins]
    else:
        parts = [blocks.scales, blocks.mins]
    return [np.ascontiguousarray(t(a)) for a in parts if a is not None]


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """[n, columns] of 1- or 2-byte elements -> uint8 [n, columns, itemsize]."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], a.shape[1], a.dtype.itemsize)


class PanelScales:
    """Where a panel's scales are in its row of pack_panels' scales buffer: records of `rows` blocks (two levels: a
    super-block's, one level: a block's), `record` bytes each, fields in the order sub-scales / scales [rows, 16],
    (mins [rows, 16]), then two levels: D [16] fp16, (Dmin [16] fp16). Byte offsets (ints or TIR expressions of
    the block b, the super-block s) of a field's 16 columns in the panel's row."""

    def __init__(self, fmt: WeightFormat, K: int):
        self.fmt = fmt
        self.two = bool(fmt.super_block)
        self.rows = fmt.super_block // fmt.block if self.two else 1
        self.item = 1 if self.two else 2  # bytes of a per-block field's element
        per = self.rows * PANEL * self.item  # bytes of a per-block field in a record
        self.min_at = per
        self.sup_at = fmt.per_block * per
        self.sup_min_at = self.sup_at + PANEL * 2
        self.record = self.sup_at + (fmt.per_block * PANEL * 2 if self.two else 0)
        self.row = K // (fmt.super_block or fmt.block) * self.record
        assert self.row == panel_scale_bytes(fmt, K)

    def fields(self):
        """(offset in a record, blocks a record, itemsize) of each field, in order."""
        out = [(0, self.rows, self.item)] + ([(self.min_at, self.rows, self.item)] if self.fmt.has_min else [])
        if self.two:
            out += [(self.sup_at, 1, 2)] + ([(self.sup_min_at, 1, 2)] if self.fmt.has_min else [])
        return out

    def scale(self, b):
        """The block's d (one level, fp16) or sc (two levels, bytes)."""
        return b // self.rows * self.record + b % self.rows * PANEL * self.item

    def min(self, b):
        return self.scale(b) + self.min_at

    def sup(self, s):
        """The super-block's D (fp16)."""
        return s * self.record + self.sup_at

    def sup_min(self, s):
        return s * self.record + self.sup_min_at


def group_rows(nibbles: np.ndarray) -> np.ndarray:
    """Panels' bytes [P, K, 8] (row k, byte v: columns v and v + 8) in groups of 4 rows, [P, K / 4, 8, 4] in the
    same shape: the order the kq panels (and quant's int4 panels) store, a dword one column pair's 4 rows."""
    P, K, width = nibbles.shape
    return np.ascontiguousarray(nibbles.reshape(P, K // 4, 4, width).transpose(0, 1, 3, 2)).reshape(P, K, width)


def grouped_byte(k, v):
    """Where `group_rows` puts row k's byte v (columns v and v + 8) in a panel: k's 4-row group, then v's dword,
    then k's byte in it; the offset from the panel's first nibble byte (numbers or TIR expressions)."""
    return k // 4 * (4 * (PANEL // 2)) + 4 * v + k % 4


def ungroup_rows(grouped: np.ndarray) -> np.ndarray:
    """The [P, K, 8] bytes `group_rows` grouped."""
    P, K, width = grouped.shape
    return np.ascontiguousarray(grouped.reshape(P, K // 4, width, 4).transpose(0, 1, 3, 2)).reshape(P, K, width)


def pack_panels(blocks: KBlocks) -> tuple[np.ndarray, np.ndarray]:
    """(values uint8 [P, K * 8 + (bits - 4) * K * 2], scales uint8 [P, bytes]) of a [K, N] matrix blocked along K
    (see the module doc)."""
    if blocks.axis != 0:
        raise ValueError("the panels layout takes a [K, N] matrix blocked along K (axis 0)")
    fmt = blocks.fmt
    K, N = blocks.shape
    P = -(-N // PANEL)
    codes = np.full((K, P * PANEL), fmt.offset, np.uint8)
    codes[:, :N] = blocks.codes
    panels = codes.reshape(K, P, PANEL).transpose(1, 0, 2)  # [P, K, 16]
    low = panels & 0x0F
    nibbles = group_rows(low[..., :8] | (low[..., 8:] << 4)).reshape(P, K * 8)
    planes = []
    if fmt.bits > 4:
        h, HR = fmt.bits - 4, high_rows(fmt)
        rows, cols = _high_slots(h)
        high = (panels >> 4).reshape(P, K // HR, HR, PANEL)[:, :, rows, cols]  # [P, records, slots, 64]
        shifts = (h * np.arange(8 // h, dtype=np.uint8))[None, None, :, None]
        planes.append((high << shifts).sum(2, dtype=np.uint8).reshape(P, -1))
    values = np.ascontiguousarray(np.concatenate([nibbles, *planes], axis=1))
    nrec = K // (fmt.super_block or fmt.block)
    scale_parts = []
    for a in _scale_bytes(blocks):
        padded = np.zeros((a.shape[0], P * PANEL), a.dtype)
        padded[:, :N] = a
        per_panel = padded.reshape(nrec, a.shape[0] // nrec, P, PANEL).transpose(2, 0, 1, 3)  # [P, rec, rows, 16]
        scale_parts.append(np.ascontiguousarray(per_panel).view(np.uint8).reshape(P, nrec, -1))
    return values, np.ascontiguousarray(np.concatenate(scale_parts, axis=2).reshape(P, -1))


def pack_rows(blocks: KBlocks) -> tuple[np.ndarray, np.ndarray]:
    """(values uint8 [R, C / 2 + (bits - 4) * C / 8], scales uint8 [R, bytes]) of an [R, C] matrix blocked along
    its rows (see the module doc)."""
    if blocks.axis != 1:
        raise ValueError("the rows layout takes a matrix blocked along its rows (axis 1)")
    fmt = blocks.fmt
    R, C = blocks.shape
    low = (blocks.codes & 0x0F).reshape(R, C // 32, 2, 16)
    nibbles = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(R, C // 2)
    planes = []
    for j in range(fmt.bits - 4):
        bit = ((blocks.codes >> (4 + j)) & 1).reshape(R, C // 8, 8)
        planes.append((bit << np.arange(8, dtype=np.uint8)[None, None, :]).sum(2, dtype=np.uint8))
    values = np.ascontiguousarray(np.concatenate([nibbles, *planes], axis=1))
    scales = np.concatenate([np.ascontiguousarray(a.T).view(np.uint8).reshape(R, -1) for a in _scale_bytes(blocks)],
                            axis=1)
    return values, np.ascontiguousarray(scales)


def panel_scale_bytes(fmt: WeightFormat, K: int) -> int:
    """Bytes of one panel's scales (pack_panels' second buffer's row)."""
    if fmt.super_block:
        return fmt.per_block * (K // fmt.block * PANEL + K // fmt.super_block * PANEL * 2)
    return fmt.per_block * K // fmt.block * PANEL * 2


def unpack_panels(values: np.ndarray, scales: np.ndarray, fmt: WeightFormat, K: int, N: int) -> KBlocks:
    """The KBlocks `pack_panels` packed (the inverse, for tests and references)."""
    P = values.shape[0]
    nib = ungroup_rows(values[:, : K * 8].reshape(P, K, 8))
    codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.uint8)  # [P, K, 16]
    if fmt.bits > 4:
        h, HR = fmt.bits - 4, high_rows(fmt)
        rows, cols = _high_slots(h)
        record = values[:, K * 8: K * 8 + h * K * 2].reshape(P, K // HR, 1, 64)
        shifts = (h * np.arange(8 // h, dtype=np.uint8))[None, None, :, None]
        high = np.zeros((P, K // HR, HR, PANEL), np.uint8)
        high[:, :, rows, cols] = (record >> shifts) & ((1 << h) - 1)
        codes |= high.reshape(P, K, PANEL) << 4
    codes = codes.transpose(1, 0, 2).reshape(K, P * PANEL)[:, :N]
    arrays, layout = [], PanelScales(fmt, K)
    nrec = K // (fmt.super_block or fmt.block)
    records = scales.reshape(P, nrec, layout.record)
    dtypes = ([fmt.sub_scale] * fmt.per_block + [fmt.scale_dtype] * fmt.per_block if fmt.super_block
              else [fmt.scale_dtype] * fmt.per_block)
    for (at, rows, item), dtype in zip(layout.fields(), dtypes):
        part = np.ascontiguousarray(records[:, :, at: at + rows * PANEL * item]).view(dtype)  # [P, rec, rows * 16]
        arrays.append(part.reshape(P, nrec * rows, PANEL).transpose(1, 0, 2).reshape(nrec * rows, P * PANEL)[:, :N])
    if fmt.super_block:
        sc, mn, d, dm = arrays if fmt.has_min else (arrays[0], None, arrays[1], None)
        return KBlocks(fmt, 0, codes, sc, mn, d, dm)
    return KBlocks(fmt, 0, codes, arrays[0], arrays[1] if fmt.has_min else None)


def unpack_rows(values: np.ndarray, scales: np.ndarray, fmt: WeightFormat) -> KBlocks:
    """The KBlocks `pack_rows` packed (the inverse, for tests and references)."""
    R = values.shape[0]
    C = values.shape[1] * 8 // (4 + (fmt.bits - 4))  # C / 2 nibble bytes + (bits - 4) C / 8 plane bytes
    nib = values[:, : C // 2].reshape(R, C // 32, 16)
    codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(R, C).astype(np.uint8)
    for j in range(fmt.bits - 4):
        plane = values[:, C // 2 + j * C // 8: C // 2 + (j + 1) * C // 8]
        bits = (plane[:, :, None] >> np.arange(8, dtype=np.uint8)) & 1
        codes |= (bits.reshape(R, C) << (4 + j)).astype(np.uint8)
    arrays, at = [], 0
    layout = ([(C // fmt.block, fmt.sub_scale)] * fmt.per_block + [(C // fmt.super_block, fmt.scale_dtype)] * fmt.per_block
              if fmt.super_block else [(C // fmt.block, fmt.scale_dtype)] * fmt.per_block)
    for n, dtype in layout:
        size = n * np.dtype(dtype).itemsize
        arrays.append(np.ascontiguousarray(scales[:, at: at + size]).view(dtype).reshape(R, n))
        at += size
    if fmt.super_block:
        sc, mn, d, dm = arrays if fmt.has_min else (arrays[0], None, arrays[1], None)
        return KBlocks(fmt, 1, codes, sc, mn, d, dm)
    return KBlocks(fmt, 1, codes, arrays[0], arrays[1] if fmt.has_min else None)


def scale_byte_dtype(fmt: WeightFormat) -> str:
    """The type a scales buffer's bytes are read as (`T.decl_buffer` views): the per-block integers' (Q6_K's int8
    sub-scales), else uint8."""
    return fmt.sub_scale or "uint8"


def column_plane_bytes(N: int) -> int:
    """Bytes of one plane of high bits of a columns-layout row of N codes (32 a group of COLUMN_GROUP elements,
    the last group's too)."""
    return -(-N // COLUMN_GROUP) * 32


def column_row_bytes(fmt: WeightFormat, N: int) -> int:
    """Bytes of one row (one input channel) of pack_columns' values."""
    return N // 2 + (fmt.bits - 4) * column_plane_bytes(N)


class ColumnScales:
    """pack_columns' scales records: one a super-block (two levels) or block (one level) of K, `record` bytes, its
    fields' byte offsets: two levels sc [per, N] bytes (`scale`), mn [per, N] (`min`), D [N] fp16 (`sup`), Dmin [N]
    fp16 (`sup_min`); one level d [N] fp16 (`scale`), m [N] fp16 (`min`). `per`: blocks a record."""

    def __init__(self, fmt: WeightFormat, N: int):
        self.fmt, self.N = fmt, N
        self.two = bool(fmt.super_block)
        self.per = fmt.super_block // fmt.block if self.two else 1
        item = 1 if self.two else 2
        self.scale = 0
        self.min = self.per * N * item
        self.sup = fmt.per_block * self.per * N * item
        self.sup_min = self.sup + 2 * N
        self.record = self.sup + (fmt.per_block * 2 * N if self.two else 0)


def pack_columns(blocks: KBlocks) -> tuple[np.ndarray, np.ndarray]:
    """(values uint8 [K, column_row_bytes], scales uint8 [K / (super-block or block), record]) of a [K, N] matrix
    blocked along K (see the module doc)."""
    if blocks.axis != 0:
        raise ValueError("the columns layout takes a [K, N] matrix blocked along K (axis 0)")
    fmt = blocks.fmt
    K, N = blocks.shape
    if N % 32:
        raise ValueError(f"the columns layout needs N a multiple of 32, got {N}")
    low = (blocks.codes & 0x0F).reshape(K, N // 32, 2, 16)
    nibbles = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(K, N // 2)
    planes = []
    groups = -(-N // COLUMN_GROUP)
    for j in range(fmt.bits - 4):
        bit = np.zeros((K, groups * 8, 32), np.uint8)  # [K, 32-element block, i]
        bit[:, : N // 32] = ((blocks.codes >> (4 + j)) & 1).reshape(K, N // 32, 32)
        bit = bit.reshape(K, groups, 8, 32) << np.arange(8, dtype=np.uint8)[None, None, :, None]
        planes.append(bit.sum(2, dtype=np.uint8).reshape(K, groups * 32))
    values = np.ascontiguousarray(np.concatenate([nibbles, *planes], axis=1))
    at = ColumnScales(fmt, N)
    records = K // (fmt.super_block or fmt.block)
    fields = []
    for a in _scale_bytes(blocks):  # [blocks or super-blocks along K, N]
        fields.append(_as_bytes(a).reshape(records, -1))  # a record's blocks of the field, side by side
    scales = np.ascontiguousarray(np.concatenate(fields, axis=1))
    assert scales.shape[1] == at.record
    return values, scales


def unpack_columns(values: np.ndarray, scales: np.ndarray, fmt: WeightFormat, N: int) -> KBlocks:
    """The KBlocks `pack_columns` packed (the inverse, for tests and references)."""
    K = values.shape[0]
    nib = values[:, : N // 2].reshape(K, N // 32, 16)
    codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(K, N).astype(np.uint8)
    PB = column_plane_bytes(N)
    for j in range(fmt.bits - 4):
        plane = values[:, N // 2 + j * PB: N // 2 + (j + 1) * PB].reshape(K, PB // 32, 1, 32)
        bits = (plane >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1  # [K, groups, 8, 32]
        codes |= (bits.reshape(K, -1)[:, :N] << (4 + j)).astype(np.uint8)
    at = ColumnScales(fmt, N)
    records = scales.shape[0]
    if at.two:
        layout = [(at.per, fmt.sub_scale)] * fmt.per_block + [(1, fmt.scale_dtype)] * fmt.per_block
    else:
        layout = [(1, fmt.scale_dtype)] * fmt.per_block
    arrays, offset = [], 0
    for n, dtype in layout:
        size = n * N * np.dtype(dtype).itemsize
        arrays.append(np.ascontiguousarray(scales[:, offset: offset + size]).view(dtype).reshape(records * n, N))
        offset += size
    if at.two:
        sc, mn, d, dm = arrays if fmt.has_min else (arrays[0], None, arrays[1], None)
        return KBlocks(fmt, 0, codes, sc, mn, d, dm)
    return KBlocks(fmt, 0, codes, arrays[0], arrays[1] if fmt.has_min else None)
