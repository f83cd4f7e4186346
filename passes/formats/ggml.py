"""ggml's tensor types (the GGUF file's `tensor_type`s) as data, and the readers of the block types picompile keeps.

`GGML_TYPES` is the one table: each type's block (weights per block), type_size (bytes per block), the
`runtime.dtypes.WEIGHT_FORMATS` format that keeps it with whether that format holds its values bit for bit, the
`--weight-dtype` values a build keeps its values exactly in, and the format `--weight-dtype auto` stores a file
of mostly this type in. A type no `--weight-dtype` holds, not even fp32, is one picompile does not read.

`decode` reads a matrix's raw rows of Q5_0, Q5_1, Q4_K, Q5_K or Q6_K blocks into `KBlocks` (blocked along the row,
axis 1: ggml's orientation); `decode_legacy` reads Q8_0, Q4_0 and Q4_1 rows into the (q, scales, mins) of
picompile's int8 / int4 / int4a blocks. Both are vectorized over blocks and their dequantized values equal ggml's
(and the `gguf` package's) bit for bit. Element order inside a block is ggml's:

* Q5_0 / Q5_1 (32): [d fp16] [m fp16 (Q5_1)] [qh uint32 LE] [qs 16]: element i < 16 is qs[i]'s low nibble,
  element 16 + i its high nibble; bit 4 of element i is bit i of qh.
* Q4_K (256): [d fp16] [dmin fp16] [scales 12] [qs 128]: chunk j (64 elements) is qs[32 j: 32 j + 32], low
  nibbles elements 0..31 of the chunk (sub-block 2 j), high nibbles 32..63 (sub-block 2 j + 1); the eight 6-bit
  sc and mn packed as `_unpack_scale_min` reads them.
* Q5_K (256): [d] [dmin] [scales 12] [qh 32] [qs 128]: the low nibbles as Q4_K's; bit 4 of element 32 i + l is
  bit i of qh[l].
* Q6_K (256): [ql 128] [qh 64] [scales int8 16] [d fp16]: half h (128 elements): element 128 h + 64 s + b's low
  four bits are ql[64 h + b] >> 4 s; element 128 h + 32 k + l's high two bits are qh[32 h + l] >> 2 k.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from runtime.dtypes import WEIGHT_FORMATS, WeightFormat

from ..kernels.kquant import KBlocks


# --weight-dtype auto for a file whose matrices are mostly of a type no picompile format holds (Q2_K, Q3_K, the IQ
# types): int8 keeps them closest at their size
AUTO_FALLBACK = "int8"


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: `block` weights take `type_size` bytes; `format` names the picompile weight format
    its matrices are kept in (None: none holds it), `exact` whether that format holds its values bit for bit;
    `exact_in` the --weight-dtype values whose builds keep every value of it (fp32 for every type picompile
    reads: the values it dequantizes to are float32's); `auto` --weight-dtype auto's format where it is not
    `format`."""

    name: str  # ggml's spelling (GGMLQuantizationType's member name)
    block: int
    type_size: int
    format: str | None = None
    exact: bool = False
    exact_in: tuple[str, ...] = ()
    auto: str | None = None

    @property
    def bytes_per_weight(self) -> float:
        """The file's own bytes per weight (its share of the block's scales included)."""
        return self.type_size / self.block

    def kept_format(self) -> WeightFormat | None:
        """The picompile format this type's matrices are kept in, or None."""
        return None if self.format is None else WEIGHT_FORMATS[self.format]

    @property
    def kept_in_blocks(self) -> bool:
        """Whether this is a block type a picompile format holds exactly (its matrices stay in the file's blocks)."""
        return self.block > 1 and self.exact and self.format is not None

    @property
    def read(self) -> bool:
        """Whether picompile reads tensors of this type (the others are refused)."""
        return "fp32" in self.exact_in

    @property
    def auto_format(self) -> str | None:
        """The format --weight-dtype auto stores a file of mostly this type in: the one that keeps it (a float
        type's own, BF16's fp16); None where no picompile format holds it (auto then takes AUTO_FALLBACK)."""
        return self.auto or (self.format if self.exact else None)


FP32_ONLY = ("fp32",)  # of the --weight-dtype values only fp32 keeps it: its values dequantized, exactly


GGML_TYPES: dict[str, GGMLType] = {
    t.name: t
    for t in [
        # an int4a build keeps a float matrix in floats; int8 holds Q5_0's and int4's symmetric 32-blocks; a type
        # without exact_in is one the gguf package does not dequantize (a file holding one is refused)
        GGMLType("F32", 1, 4, "fp32", exact=True, exact_in=("fp32", "int4a")),
        GGMLType("F16", 1, 2, "fp16", exact=True, exact_in=("fp32", "fp16", "int4a")),
        # BF16: fp16 holds neither its range nor all its values, but is auto's choice at its size
        GGMLType("BF16", 1, 2, exact_in=("fp32", "int4a"), auto="fp16"),
        GGMLType("F64", 1, 8),
        GGMLType("I8", 1, 1),
        GGMLType("I16", 1, 2),
        GGMLType("I32", 1, 4),
        GGMLType("I64", 1, 8),
        GGMLType("Q8_0", 32, 34, "int8", exact=True, exact_in=("fp32", "int8")),
        GGMLType("Q4_0", 32, 18, "int4", exact=True, exact_in=("fp32", "int8", "int4", "int4a")),
        GGMLType("Q4_1", 32, 20, "int4a", exact=True, exact_in=("fp32", "int4a")),
        GGMLType("Q5_0", 32, 22, "q5_0", exact=True, exact_in=("fp32", "int8")),
        GGMLType("Q5_1", 32, 24, "q5_1", exact=True, exact_in=FP32_ONLY),
        GGMLType("Q8_1", 32, 40),
        GGMLType("Q2_K", 256, 84, exact_in=FP32_ONLY),
        GGMLType("Q3_K", 256, 110, exact_in=FP32_ONLY),
        GGMLType("Q4_K", 256, 144, "q4_k", exact=True, exact_in=FP32_ONLY),
        GGMLType("Q5_K", 256, 176, "q5_k", exact=True, exact_in=FP32_ONLY),
        GGMLType("Q6_K", 256, 210, "q6_k", exact=True, exact_in=FP32_ONLY),
        GGMLType("Q8_K", 256, 292),
        GGMLType("IQ2_XXS", 256, 66, exact_in=FP32_ONLY),
        GGMLType("IQ2_XS", 256, 74, exact_in=FP32_ONLY),
        GGMLType("IQ2_S", 256, 82, exact_in=FP32_ONLY),
        GGMLType("IQ3_XXS", 256, 98, exact_in=FP32_ONLY),
        GGMLType("IQ3_S", 256, 110, exact_in=FP32_ONLY),
        GGMLType("IQ1_S", 256, 50, exact_in=FP32_ONLY),
        GGMLType("IQ1_M", 256, 56, exact_in=FP32_ONLY),
        GGMLType("IQ4_NL", 32, 18, exact_in=FP32_ONLY),
        GGMLType("IQ4_XS", 256, 136, exact_in=FP32_ONLY),
        GGMLType("TQ1_0", 256, 54, exact_in=FP32_ONLY),
        GGMLType("TQ2_0", 256, 66, exact_in=FP32_ONLY),
        GGMLType("MXFP4", 32, 17, exact_in=FP32_ONLY),
        GGMLType("NVFP4", 64, 36, exact_in=FP32_ONLY),
        GGMLType("Q1_0", 128, 18),
    ]
}


def type_named(name: str) -> GGMLType:
    """The table's row of ggml type `name` (a name it lacks reads as a type nothing holds and picompile does not
    read)."""
    return GGML_TYPES.get(name) or GGMLType(name, 1, 0)


LEGACY_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # read into picompile's own blocks (decode_legacy)
KEPT_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # read into KBlocks (decode)


# How the decoders stay fast in numpy: a ufunc pays a fixed cost (~10 ns) per pass of its innermost loop, so an
# operation over a block's runs of 16..64 bytes costs more than its bytes do. So they (1) decode rows a chunk at a
# time, into outputs allocated once (a chunk's intermediates stay in the core's cache); (2) move a block's runs of
# bytes as single items (numpy's void dtype: one element a run, long loops); and (3) do the bit work on whole rows
# of uint64 words, eight codes at a time, with per-word shift counts held in a row-long pattern (one loop a row).
# Every shift is by at most 7 and masked per byte, so no bit leaves its byte: the byte order of the words does not
# matter.
CHUNK_VALUES = 1 << 18  # values a chunk (the size measured fastest: its codes and floats stay in L2 / L3)

# Masks of each byte of a uint64: bits 0..3, bit 0, bits 0..1
_LOW4, _BIT0, _LOW2 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101), np.uint64(0x0303030303030303)
# ... and of a uint32's bytes (Q4_K / Q5_K's scale fields): bits 0..5, 0..3, 4..5
_LOW6, _LOW4_32, _BITS45 = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)
# byte -> its eight bits as bytes 0 / 16 (bit i at byte i, moved to a code's bit 4), the eight bytes as one uint64
_BITS_AT_4 = np.ascontiguousarray(
    (((np.arange(256)[:, None] >> np.arange(8)) & 1) << 4).astype(np.uint8)).view(np.uint64)[:, 0]


def _blocks(type_name: str, raw: np.ndarray, columns: int) -> np.ndarray:
    """raw uint8 [rows, row_bytes] -> [rows, blocks per row, type_size], checked against the table."""
    t = GGML_TYPES[type_name]
    if columns % t.block:
        raise ValueError(f"{type_name} rows hold whole blocks of {t.block}; {columns} columns do not")
    raw = np.asarray(raw)
    n = columns // t.block
    if raw.ndim != 2 or raw.shape[1] != n * t.type_size:
        raise ValueError(f"{type_name} rows of {columns} columns take {n * t.type_size} bytes; got {raw.shape}")
    if raw.dtype != np.uint8 or raw.strides[1] != 1:
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return raw.reshape(raw.shape[0], n, t.type_size)


def _row_chunks(rows: int, columns: int) -> list[slice]:
    """Consecutive row ranges of about CHUNK_VALUES values."""
    step = max(1, CHUNK_VALUES // columns)
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _fp16(fields: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] fp16 (a view)."""
    return fields.view(np.float16)[..., 0]


def _runs(a: np.ndarray) -> np.ndarray:
    """Bytes [..., L] as [..., 1] items of L bytes (a view: numpy then moves a run as one element)."""
    return a.view(np.dtype((np.void, a.shape[-1])))


def _words(rows: np.ndarray) -> np.ndarray:
    """A C-contiguous uint8 [rows, ...] as uint64 words [rows, bytes / 8] (a view)."""
    return rows.reshape(rows.shape[0], -1).view(np.uint64)


@lru_cache(maxsize=None)
def _row_shifts(per_block: tuple[int, ...], words: int) -> np.ndarray:
    """A row's uint64 shift counts: `per_block` (one a word of a block) repeated over the row's `words`."""
    row = np.tile(np.array(per_block, np.uint64), words // len(per_block))
    row.flags.writeable = False
    return row


def _fields(runs: np.ndarray, out: np.ndarray, shifts: tuple[int, ...], mask: np.uint64) -> np.ndarray:
    """Bit fields of runs of bytes, each in its own copy of the run: each run [..., L] copied k times into out uint8
    [rows, ..., k, L] (a C-contiguous chunk); then each of out's words shifted right by its count in `shifts` (the
    counts of one block's words, repeated along the row) and masked, keeping of each byte the field its word's
    count picks. Returns out as words."""
    _runs(out)[..., 0] = _runs(runs)  # (broadcast over the k copies)
    words = _words(out)
    np.right_shift(words, _row_shifts(shifts, words.shape[1]), out=words)
    words &= mask
    return words


def _nibbles_into(runs: np.ndarray, out: np.ndarray) -> None:
    """Runs of bytes [..., L] -> out [rows, ..., 2, L] (a C-contiguous chunk): each run's low nibbles, then its high
    ones."""
    words = out.shape[-1] // 8
    _fields(runs, out, (0,) * words + (4,) * words, _LOW4)


def _empty(fmt: WeightFormat, rows: int, columns: int) -> KBlocks:
    """Uninitialized KBlocks of an [rows, columns] matrix blocked along its rows."""
    per_block = columns // fmt.block
    if fmt.super_block:
        sub = np.dtype(fmt.sub_scale)
        per_super = columns // fmt.super_block
        return KBlocks(fmt, 1, np.empty((rows, columns), np.uint8), np.empty((rows, per_block), sub),
                       np.empty((rows, per_block), sub) if fmt.has_min else None,
                       np.empty((rows, per_super), np.float16),
                       np.empty((rows, per_super), np.float16) if fmt.has_min else None)
    return KBlocks(fmt, 1, np.empty((rows, columns), np.uint8), np.empty((rows, per_block), np.float16),
                   np.empty((rows, per_block), np.float16) if fmt.has_min else None)


def _row_view(blocks: KBlocks, rows: slice) -> KBlocks:
    """The KBlocks of `rows` (views: filling them fills `blocks`)."""
    cut = lambda a: None if a is None else a[rows]  # noqa: E731
    return KBlocks(blocks.fmt, blocks.axis, blocks.codes[rows], cut(blocks.scales), cut(blocks.mins),
                   cut(blocks.super_scales), cut(blocks.super_mins))


def _fill_q5_01(b: np.ndarray, out: KBlocks) -> None:
    """Q5_0: [d][qh][qs]; Q5_1: [d][m][qh][qs]."""
    rows, n = b.shape[:2]
    at = 4 if out.mins is not None else 2
    out.scales[...] = _fp16(b[..., 0:2])
    if out.mins is not None:
        out.mins[...] = _fp16(b[..., 2:4])
    _nibbles_into(b[..., at + 4:], out.codes.reshape(rows, n, 2, 16))
    # qh's byte k holds bit 4 of codes 8 k .. 8 k + 7: one table look-up (of a contiguous copy) is those 8 bytes
    qh = np.ascontiguousarray(_runs(b[..., at: at + 4])).view(np.uint8)
    _words(out.codes).reshape(rows, n, 4)[...] |= _BITS_AT_4[qh]


def _unpack_scale_min(s: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> sc, mn uint8 [..., 8] (6 bits each): bytes 0..3 hold sc 0..3
    (bits 0..5) and bits 4..5 of sc 4..7 (bits 6..7); bytes 4..7 the same for mn; bytes 8..11 the low four bits
    of sc 4..7 (low nibble) and mn 4..7 (high nibble). On the three groups of four bytes as uint32 words (four
    fields at once, one word a block: long loops, where bytes would loop four at a time)."""
    d, m, md = (s.view(np.uint32)[..., i] for i in range(3))
    sc, mn = sc.view(np.uint32), mn.view(np.uint32)  # [..., 2]: fields 0..3, 4..7
    np.bitwise_and(d, _LOW6, out=sc[..., 0])
    np.bitwise_or(md & _LOW4_32, (d >> 2) & _BITS45, out=sc[..., 1])
    np.bitwise_and(m, _LOW6, out=mn[..., 0])
    np.bitwise_or((md >> 4) & _LOW4_32, (m >> 2) & _BITS45, out=mn[..., 1])


def _or_high_bits(codes: np.ndarray, runs: np.ndarray, copies: int, shifts: tuple[int, ...], mask: np.uint64) -> None:
    """codes (uint8 [rows, columns]) |= their bits 4 up, which runs of qh bytes [rows, ..., L] hold as fields:
    `_fields` of `copies` copies of each run, in the codes' order ([rows, ..., copies, L]), moved up to bit 4."""
    spread = np.empty((*runs.shape[:-1], copies, runs.shape[-1]), np.uint8)
    high = _fields(runs, spread, shifts, mask)
    high <<= np.uint64(4)
    _words(codes)[...] |= high


def _fill_q45_k(b: np.ndarray, out: KBlocks) -> None:
    """Q4_K: [d][dmin][scales 12][qs 128]; Q5_K: [d][dmin][scales 12][qh 32][qs 128]."""
    rows, n = b.shape[:2]
    out.super_scales[...] = _fp16(b[..., 0:2])
    out.super_mins[...] = _fp16(b[..., 2:4])
    _unpack_scale_min(b[..., 4:16], out.scales.reshape(rows, n, 8), out.mins.reshape(rows, n, 8))
    five = out.fmt.bits == 5
    # chunk j of 64 codes: the low nibbles of qs[32 j: 32 j + 32], then their high nibbles
    _nibbles_into(b[..., 48 if five else 16:].reshape(rows, n, 4, 32), out.codes.reshape(rows, n, 4, 2, 32))
    if five:  # bit 4 of code 32 i + l is bit i of qh[l]: copy i of qh, shifted right by i
        _or_high_bits(out.codes, b[..., 16:48], 8, tuple(i for i in range(8) for _ in range(4)), _BIT0)


def _fill_q6_k(b: np.ndarray, out: KBlocks) -> None:
    """Q6_K: [ql 128][qh 64][scales int8 16][d fp16]."""
    rows, n = b.shape[:2]
    out.scales.reshape(rows, n, 16)[...] = b[..., 192:208].view(np.int8)
    out.super_scales[...] = _fp16(b[..., 208:210])
    # half h, s: codes 128 h + 64 s + j's low four bits are ql[64 h + j] >> 4 s
    _nibbles_into(b[..., 0:128].reshape(rows, n, 2, 64), out.codes.reshape(rows, n, 2, 2, 64))
    # code 128 h + 32 k + l's bits 4..5 are qh[32 h + l] >> 2 k: copy k of qh's half h, shifted right by 2 k
    shifts = tuple(2 * k for k in range(4) for _ in range(4)) * 2  # [h, k, word]
    _or_high_bits(out.codes, b[..., 128:192].reshape(rows, n, 2, 32), 4, shifts, _LOW2)


_FILL = {"Q5_0": _fill_q5_01, "Q5_1": _fill_q5_01, "Q4_K": _fill_q45_k, "Q5_K": _fill_q45_k, "Q6_K": _fill_q6_k}


def decode(type_name: str, raw: np.ndarray, columns: int) -> KBlocks:
    """The KBlocks (blocked along axis 1) of a matrix's raw rows of `type_name` blocks: uint8 [rows, row_bytes],
    each row `columns` weights (the file's [rows, columns] orientation). For the kept types (KEPT_TYPES)."""
    if type_name not in KEPT_TYPES:
        why = "decode_legacy reads it" if type_name in LEGACY_TYPES else "no picompile format keeps it"
        raise ValueError(f"decode reads {', '.join(KEPT_TYPES)}; {type_name} is not one ({why})")
    b = _blocks(type_name, raw, columns)
    out = _empty(WEIGHT_FORMATS[GGML_TYPES[type_name].format], b.shape[0], columns)
    for rows in _row_chunks(b.shape[0], columns):
        _FILL[type_name](b[rows], _row_view(out, rows))
    return out


def decode_legacy(type_name: str, raw: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q int8 [rows, columns], scales fp16 [rows, columns / 32], mins fp16 or None) of raw Q8_0 / Q4_0 / Q4_1 rows,
    in picompile's convention for int8 / int4 / int4a blocks along axis 1 (`WeightFormat.dequantize`): Q8_0's q as
    stored; Q4_0's q = nibble - 8 in [-8, 7]; Q4_1's q = nibble in [0, 15] with the file's m as the minimum."""
    if type_name not in LEGACY_TYPES:
        raise ValueError(f"decode_legacy reads {', '.join(LEGACY_TYPES)}; not {type_name}")
    b = _blocks(type_name, raw, columns)
    rows, n = b.shape[:2]
    scales = _fp16(b[..., 0:2]).copy()
    mins = _fp16(b[..., 2:4]).copy() if type_name == "Q4_1" else None
    q = np.empty((rows, n, 32), np.int8)
    if type_name == "Q8_0":
        _runs(q.view(np.uint8))[...] = _runs(b[..., 2:])
        return q.reshape(rows, columns), scales, None
    codes = q.view(np.uint8).reshape(rows, n, 2, 16)  # element i: byte i's low nibble, 16 + i: its high nibble
    for r in _row_chunks(rows, columns):
        _nibbles_into(b[r, :, 4 if mins is not None else 2:], codes[r])
        if type_name == "Q4_0":
            codes[r] -= np.uint8(8)  # (wraps to the int8 nibble - 8)
    return q.reshape(rows, columns), scales, mins
