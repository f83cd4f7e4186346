"""ggml's tensor types (the GGUF file's `tensor_type`s) as data, and the readers of the block types picompile keeps.

`GGML_TYPES` is the one table: each type's block (weights per block), type_size (bytes per block) and the
`runtime.dtypes.WEIGHT_FORMATS` format that keeps it, with whether that format holds its values bit for bit.

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

import numpy as np

from runtime.dtypes import WEIGHT_FORMATS, WeightFormat

from ..kernels.kquant import KBlocks


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: `block` weights take `type_size` bytes; `format` names the picompile weight format
    its matrices are kept in (None: none holds it), `exact` whether that format holds its values bit for bit."""

    name: str  # ggml's spelling (GGMLQuantizationType's member name)
    block: int
    type_size: int
    format: str | None = None
    exact: bool = False

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


GGML_TYPES: dict[str, GGMLType] = {
    t.name: t
    for t in [
        GGMLType("F32", 1, 4, "fp32", exact=True),
        GGMLType("F16", 1, 2, "fp16", exact=True),
        GGMLType("BF16", 1, 2),  # fp16 holds neither its range nor all its values
        GGMLType("F64", 1, 8),
        GGMLType("I8", 1, 1),
        GGMLType("I16", 1, 2),
        GGMLType("I32", 1, 4),
        GGMLType("I64", 1, 8),
        GGMLType("Q8_0", 32, 34, "int8", exact=True),
        GGMLType("Q4_0", 32, 18, "int4", exact=True),
        GGMLType("Q4_1", 32, 20, "int4a", exact=True),
        GGMLType("Q5_0", 32, 22, "q5_0", exact=True),
        GGMLType("Q5_1", 32, 24, "q5_1", exact=True),
        GGMLType("Q8_1", 32, 40),
        GGMLType("Q2_K", 256, 84),
        GGMLType("Q3_K", 256, 110),
        GGMLType("Q4_K", 256, 144, "q4_k", exact=True),
        GGMLType("Q5_K", 256, 176, "q5_k", exact=True),
        GGMLType("Q6_K", 256, 210, "q6_k", exact=True),
        GGMLType("Q8_K", 256, 292),
        GGMLType("IQ2_XXS", 256, 66),
        GGMLType("IQ2_XS", 256, 74),
        GGMLType("IQ2_S", 256, 82),
        GGMLType("IQ3_XXS", 256, 98),
        GGMLType("IQ3_S", 256, 110),
        GGMLType("IQ1_S", 256, 50),
        GGMLType("IQ1_M", 256, 56),
        GGMLType("IQ4_NL", 32, 18),
        GGMLType("IQ4_XS", 256, 136),
        GGMLType("TQ1_0", 256, 54),
        GGMLType("TQ2_0", 256, 66),
        GGMLType("MXFP4", 32, 17),
        GGMLType("NVFP4", 64, 36),
        GGMLType("Q1_0", 128, 18),
    ]
}
LEGACY_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # read into picompile's own blocks (decode_legacy)
KEPT_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # read into KBlocks (decode)


def _blocks(type_name: str, raw: np.ndarray, columns: int) -> np.ndarray:
    """raw uint8 [rows, row_bytes] -> [rows, blocks per row, type_size], checked against the table."""
    t = GGML_TYPES[type_name]
    if columns % t.block:
        raise ValueError(f"{type_name} rows hold whole blocks of {t.block}; {columns} columns do not")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = columns // t.block
    if raw.ndim != 2 or raw.shape[1] != n * t.type_size:
        raise ValueError(f"{type_name} rows of {columns} columns take {n * t.type_size} bytes; got {raw.shape}")
    return raw.reshape(raw.shape[0], n, t.type_size)


def _fp16(fields: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] fp16."""
    return np.ascontiguousarray(fields).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2 n]: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _rows(a: np.ndarray) -> np.ndarray:
    """[rows, blocks, per block] -> [rows, blocks * per block]."""
    return np.ascontiguousarray(a.reshape(a.shape[0], -1))


def _qh_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's [..., 4] qh bytes -> [..., 32] bits (bit i: element i's fifth bit)."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _decode_q5_01(type_name: str, b: np.ndarray) -> KBlocks:
    """Q5_0: [d][qh][qs]; Q5_1: [d][m][qh][qs]."""
    has_min = type_name == "Q5_1"
    at = 4 if has_min else 2
    codes = _nibbles(b[..., at + 4:]) | (_qh_bits32(b[..., at: at + 4]) << 4)
    mins = _fp16(b[..., 2:4]) if has_min else None
    return KBlocks(WEIGHT_FORMATS[GGML_TYPES[type_name].format], 1, _rows(codes), _fp16(b[..., 0:2]).copy(),
                   None if mins is None else mins.copy())


def _unpack_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> (sc, mn) uint8 [..., 8] (6 bits each): bytes 0..3 hold sc 0..3
    (bits 0..5) and bits 4..5 of sc 4..7 (bits 6..7); bytes 4..7 the same for mn; bytes 8..11 the low four bits
    of sc 4..7 (low nibble) and mn 4..7 (high nibble)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's qs [..., 128] -> the low four bits of the 256 codes (per 64-chunk: low nibbles, then high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(chunks).reshape(*qs.shape[:-1], 256)


def _decode_q45_k(type_name: str, b: np.ndarray) -> KBlocks:
    """Q4_K: [d][dmin][scales 12][qs 128]; Q5_K: [d][dmin][scales 12][qh 32][qs 128]."""
    sc, mn = _unpack_scale_min(b[..., 4:16])
    if type_name == "Q5_K":
        qh = b[..., 16:48]
        high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8 (i), 32 (l)]
        codes = _k_low_nibbles(b[..., 48:]) | (high.reshape(*qh.shape[:-1], 256) << 4)
    else:
        codes = _k_low_nibbles(b[..., 16:])
    return KBlocks(WEIGHT_FORMATS[GGML_TYPES[type_name].format], 1, _rows(codes), _rows(sc), _rows(mn),
                   _fp16(b[..., 0:2]).copy(), _fp16(b[..., 2:4]).copy())


def _decode_q6_k(b: np.ndarray) -> KBlocks:
    """Q6_K: [ql 128][qh 64][scales int8 16][d fp16]."""
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]  # [..., h, s, b]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]  # [..., h, k, l]
    codes = (ql & 0x0F).reshape(*lead, 256) | ((qh & 0x03).reshape(*lead, 256) << 4)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return KBlocks(WEIGHT_FORMATS["q6_k"], 1, _rows(codes), _rows(sc), None, _fp16(b[..., 208:210]).copy())


def decode(type_name: str, raw: np.ndarray, columns: int) -> KBlocks:
    """The KBlocks (blocked along axis 1) of a matrix's raw rows of `type_name` blocks: uint8 [rows, row_bytes],
    each row `columns` weights (the file's [rows, columns] orientation). For the kept types (KEPT_TYPES)."""
    if type_name not in KEPT_TYPES:
        why = "decode_legacy reads it" if type_name in LEGACY_TYPES else "no picompile format keeps it"
        raise ValueError(f"decode reads {', '.join(KEPT_TYPES)}; {type_name} is not one ({why})")
    b = _blocks(type_name, raw, columns)
    if type_name in ("Q5_0", "Q5_1"):
        return _decode_q5_01(type_name, b)
    if type_name in ("Q4_K", "Q5_K"):
        return _decode_q45_k(type_name, b)
    return _decode_q6_k(b)


def decode_legacy(type_name: str, raw: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q int8 [rows, columns], scales fp16 [rows, columns / 32], mins fp16 or None) of raw Q8_0 / Q4_0 / Q4_1 rows,
    in picompile's convention for int8 / int4 / int4a blocks along axis 1 (`WeightFormat.dequantize`): Q8_0's q as
    stored; Q4_0's q = nibble - 8 in [-8, 7]; Q4_1's q = nibble in [0, 15] with the file's m as the minimum."""
    if type_name not in LEGACY_TYPES:
        raise ValueError(f"decode_legacy reads {', '.join(LEGACY_TYPES)}; not {type_name}")
    b = _blocks(type_name, raw, columns)
    scales = _fp16(b[..., 0:2]).copy()
    if type_name == "Q8_0":
        return _rows(np.ascontiguousarray(b[..., 2:]).view(np.int8)), scales, None
    if type_name == "Q4_0":
        return _rows(_nibbles(b[..., 2:]).astype(np.int8) - np.int8(8)), scales, None
    return _rows(_nibbles(b[..., 4:]).astype(np.int8)), scales, _fp16(b[..., 2:4]).copy()
