"""Writers of ggml's block types, for tests: `encode_blocks` (KBlocks -> raw rows, the exact inverse of
`passes.formats.ggml.decode`), `encode_legacy` (the inverse of `decode_legacy`) and `encode` (float32 weights ->
valid raw rows of any type the decoders read). The `gguf` package quantizes the one-level types but not the
K-quants: theirs here is round to nearest after a small search per sub-block, not llama.cpp's, but a sensible
encoding with small error."""

from __future__ import annotations

import gguf
import numpy as np

from passes.formats.ggml import GGML_TYPES, KEPT_TYPES, LEGACY_TYPES
from passes.kernels.kquant import KBlocks

_BY_FORMAT = {GGML_TYPES[name].format: name for name in KEPT_TYPES}


def _fp16_bytes(a: np.ndarray) -> np.ndarray:
    """fp16 [rows, n] -> uint8 [rows, n, 2]."""
    return np.ascontiguousarray(a.astype(np.float16)).view(np.uint8).reshape(*a.shape, 2)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 2 n] low-four-bit codes -> [..., n] bytes: the first half in the low nibbles, the second in the high."""
    n = codes.shape[-1] // 2
    return (codes[..., :n] & 0x0F) | ((codes[..., n:] & 0x0F) << 4)


def _bits_to_bytes(bits: np.ndarray) -> np.ndarray:
    """[..., 8 (i), n] bits -> [..., n] bytes (bit i of byte l: bits[..., i, l])."""
    return (bits.astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(sc, mn) [..., 8] 6-bit -> Q4_K's 12 scale bytes (the inverse of ggml._unpack_scale_min)."""
    d = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    m = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    md = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=-1).astype(np.uint8)


def encode_blocks(blocks: KBlocks) -> np.ndarray:
    """Raw rows uint8 [rows, row_bytes] of a matrix in a kept format blocked along axis 1."""
    if blocks.axis != 1:
        raise ValueError("ggml's rows are blocked along axis 1")
    name = _BY_FORMAT[blocks.fmt.name]
    t = GGML_TYPES[name]
    rows, columns = blocks.shape
    n = columns // t.block
    c = blocks.codes.astype(np.uint8).reshape(rows, n, t.block)
    if name in ("Q5_0", "Q5_1"):
        qh = np.ascontiguousarray(((c >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(
            -1, dtype=np.uint32).astype("<u4")
        parts = [_fp16_bytes(blocks.scales)]
        if name == "Q5_1":
            parts.append(_fp16_bytes(blocks.mins))
        parts += [qh[..., None].view(np.uint8), _pack_nibbles(c)]
    elif name in ("Q4_K", "Q5_K"):
        sc = blocks.scales.reshape(rows, n, 8)
        mn = blocks.mins.reshape(rows, n, 8)
        parts = [_fp16_bytes(blocks.super_scales), _fp16_bytes(blocks.super_mins), _pack_scale_min(sc, mn)]
        if name == "Q5_K":
            parts.append(_bits_to_bytes(((c >> 4) & 1).reshape(rows, n, 8, 32)))
        parts.append(_pack_nibbles(c.reshape(rows, n, 4, 64)).reshape(rows, n, 128))
    else:  # Q6_K
        halves = c.reshape(rows, n, 2, 128)
        low = (halves & 0x0F).reshape(rows, n, 2, 2, 64)  # [h, s, b]
        ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(rows, n, 128)
        high = (halves >> 4).reshape(rows, n, 2, 4, 32)  # [h, k, l]
        qh = (high << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(-2, dtype=np.uint8).reshape(rows, n, 64)
        sc = np.ascontiguousarray(blocks.scales.astype(np.int8)).view(np.uint8).reshape(rows, n, 16)
        parts = [ql, qh, sc, _fp16_bytes(blocks.super_scales)]
    parts = [p.reshape(rows, n, -1) for p in parts]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(rows, n * t.type_size))


def encode_legacy(type_name: str, q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None) -> np.ndarray:
    """Raw Q8_0 / Q4_0 / Q4_1 rows of picompile's (q, scales, mins) blocks along axis 1 (`decode_legacy`'s inverse)."""
    if type_name not in LEGACY_TYPES:
        raise ValueError(f"encode_legacy writes {', '.join(LEGACY_TYPES)}; not {type_name}")
    rows, columns = q.shape
    n = columns // 32
    q = q.reshape(rows, n, 32)
    parts = [_fp16_bytes(scales)]
    if type_name == "Q8_0":
        parts.append(np.ascontiguousarray(q.astype(np.int8)).view(np.uint8))
    else:
        if type_name == "Q4_1":
            parts.append(_fp16_bytes(mins))
        nib = (q.astype(np.int16) + (8 if type_name == "Q4_0" else 0)).astype(np.uint8)
        parts.append(_pack_nibbles(nib))
    parts = [p.reshape(rows, n, -1) for p in parts]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(rows, -1))


def _fit_asymmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (last axis) a scale s >= 0 and a minimum m >= 0 so that x ~ s q - m, q in [0, nmax]: round to
    nearest over a range shrunk or grown a little (llama.cpp's make_qkx2 candidates), each refit by least squares;
    the best one."""
    lo = np.minimum(x.min(-1), 0.0)
    hi = x.max(-1)
    span = np.where(hi > lo, hi - lo, 1.0)
    best_s, best_m = (hi - lo) / nmax, -lo
    best_err = ((np.clip(np.rint((x - lo[..., None]) / np.where(best_s > 0, best_s, 1)[..., None]), 0, nmax)
                 * best_s[..., None] + lo[..., None] - x) ** 2).sum(-1)
    n = x.shape[-1]
    for step in range(21):
        iscale = (nmax - 1.0 + 0.1 * step) / span
        q = np.clip(np.rint(iscale[..., None] * (x - lo[..., None])), 0, nmax)
        sq, sqq, sx, sqx = q.sum(-1), (q * q).sum(-1), x.sum(-1), (q * x).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 0
        s = np.where(ok, (n * sqx - sq * sx) / np.where(ok, det, 1), 0.0)
        b = np.where(ok, (sqq * sx - sq * sqx) / np.where(ok, det, 1), lo)
        pos = b > 0  # the minimum must not exceed zero: refit the scale alone
        s = np.where(pos, sqx / np.where(sqq > 0, sqq, 1), s)
        b = np.where(pos, 0.0, b)
        s = np.maximum(s, 0.0)
        err = ((q * s[..., None] + b[..., None] - x) ** 2).sum(-1)
        better = err < best_err
        best_s, best_m, best_err = np.where(better, s, best_s), np.where(better, -b, best_m), np.minimum(err, best_err)
    return best_s, best_m


def _fit_symmetric(x: np.ndarray, nmax: int) -> np.ndarray:
    """Per sub-block (last axis) a signed scale s so that x ~ s q, q in [-nmax, nmax - 1]: the largest-magnitude
    weight at -nmax (llama.cpp's make_qx_quants), its multiplier searched a little, each refit by least squares."""
    amax = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    safe = np.where(amax != 0, amax, 1.0)
    best_s, best_err = np.zeros_like(amax), (x * x).sum(-1)
    for step in range(-9, 10):
        iscale = -(nmax + 0.1 * step) / safe
        q = np.clip(np.rint(iscale[..., None] * x), -nmax, nmax - 1)
        qq = (q * q).sum(-1)
        s = np.where(qq > 0, (q * x).sum(-1) / np.where(qq > 0, qq, 1), 0.0)
        err = ((q * s[..., None] - x) ** 2).sum(-1)
        better = err < best_err
        best_s, best_err = np.where(better, s, best_s), np.minimum(err, best_err)
    return best_s


def _super(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block (last axis: its sub-blocks' scales) an fp16 D and integers round(value / D), |.| <= levels."""
    top = np.abs(values).max(-1)
    D = (top / levels).astype(np.float16)
    D32 = D.astype(np.float32)
    ints = np.rint(values / np.where(D32 > 0, D32, 1)[..., None]) * (D32 > 0)[..., None]
    return D, np.clip(ints, -levels - 1, levels)


def _encode_k(type_name: str, w: np.ndarray) -> KBlocks:
    """The KBlocks a Q4_K / Q5_K / Q6_K encoding of w [rows, columns] keeps."""
    fmt = GGML_TYPES[type_name].kept_format()
    rows, columns = w.shape
    sub = w.reshape(rows, columns // 256, 256 // fmt.block, fmt.block).astype(np.float64)
    lo_q, hi_q = fmt.levels
    if type_name == "Q6_K":
        D, sc = _super(_fit_symmetric(sub, -lo_q), 127)
        d = D.astype(np.float32)[..., None] * sc
        q = np.clip(np.rint(sub / np.where(d != 0, d, 1)[..., None]) * (d != 0)[..., None], lo_q, hi_q)
        return KBlocks(fmt, 1, (q + fmt.offset).astype(np.uint8).reshape(rows, columns),
                       sc.astype(np.int8).reshape(rows, -1), None, D)
    s, m = _fit_asymmetric(sub, hi_q)
    D, sc = _super(s, 63)
    Dmin, mn = _super(m, 63)
    d = D.astype(np.float32)[..., None] * sc
    dm = Dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.rint((sub + dm[..., None]) / np.where(d > 0, d, 1)[..., None]) * (d > 0)[..., None], 0, hi_q)
    return KBlocks(fmt, 1, q.astype(np.uint8).reshape(rows, columns), sc.astype(np.uint8).reshape(rows, -1),
                   mn.astype(np.uint8).reshape(rows, -1), D, Dmin)


def encode(type_name: str, w: np.ndarray) -> np.ndarray:
    """Raw rows uint8 [rows, row_bytes] of w float32 [rows, columns] in `type_name` (K-quants: `_encode_k`; the
    one-level types: the gguf package's quantizer, llama.cpp's reference rounding)."""
    w = np.asarray(w, np.float32)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return encode_blocks(_encode_k(type_name, w))
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, type_name))
