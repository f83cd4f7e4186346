"""Block-quantized weights: the quantization rules (numpy) and the layouts the CPU's kernels read them in.

The formats are `runtime.dtypes.WEIGHT_FORMATS`' int8 and int4: one scale per QUANT_BLOCK consecutive weights
along one axis of the matrix (`axis`). A matrix is quantized once (`quantize`: integer values, unpacked, and
their scales, both shaped like the matrix with the block axis divided by the block) and packed into the layout
of the kernel that reads it:

* rows (`pack_rows`): a row-major [R, C] weight whose rows kernels read whole (the gathered FFN rows, one per
  neuron; the embedding table), blocks along the row (axis 1). int8: q [R, C] int8; int4: q [R, C/2] uint8,
  byte 16 b + i of a row holding its element 32 b + i in the low nibble and 32 b + 16 + i in the high one
  (Q4_0's order), each as q + 8. Scales [R, C / 32].
* panels (`pack_panels`): a dense linear's [K, N] weight, blocks along the reduction axis K (axis 0), cut
  into panels of PANEL columns like `cpu.pack_panels`. int8: q [P, K, 16] int8; int4: q [P, K, 8] uint8,
  byte v holding column v of the panel in the low nibble and column v + 8 in the high one, each as q + 8.
  Scales [P, K / 32, 16]. Padded columns are 0 with scale 0.

A quantized axis must be a whole number of blocks (`quantizable`); other weights stay in floats.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import INT4_OFFSET, QUANT_BLOCK, WeightFormat

from .cpu import PANEL


def quantizable(shape, axis: int, block: int = QUANT_BLOCK) -> bool:
    """Whether a matrix of `shape` can be blocked along `axis`."""
    return len(shape) == 2 and shape[axis] % block == 0 and shape[axis] > 0


def _blocked(w: np.ndarray, axis: int, block: int) -> np.ndarray:
    """`w` as [.., blocks, block] with the blocks of `axis` on the last two axes (a view when axis is 1)."""
    if not quantizable(w.shape, axis, block):
        raise ValueError(f"a {list(w.shape)} weight is not a whole number of {block}-blocks along axis {axis}")
    moved = w if axis == 1 else w.T
    return moved.reshape(moved.shape[0], -1, block)


def quantize(w: np.ndarray, fmt: WeightFormat, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest block quantization of the matrix `w` along `axis`: (q, scales), q int8 shaped like w
    (int8: [-127, 127]; int4: [-8, 7]), scales in fmt.scale_dtype shaped like w with `axis` divided by the
    block. q * scales (each scale repeated over its block) is the dequantized weight (`dequantize`)."""
    blocks = _blocked(np.asarray(w, np.float32), axis, fmt.block)
    if fmt.bits == 8:
        scale = np.abs(blocks).max(axis=-1) / 127.0
        low, high = -127, 127
    elif fmt.bits == 4:  # the block's largest-magnitude weight maps to -8 exactly (Q4_0, MatMulNBits symmetric)
        pick = np.abs(blocks).argmax(axis=-1)
        scale = np.take_along_axis(blocks, pick[..., None], axis=-1)[..., 0] / -8.0
        low, high = -8, 7
    else:
        raise ValueError(f"{fmt.name} is not a block-quantized format")
    scale = scale.astype(fmt.scale_dtype)
    stored = scale.astype(np.float32)[..., None]  # round with the scale as stored, so q * scale is exact
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(stored == 0, 0, np.rint(blocks / stored))
    q = np.clip(q, low, high).astype(np.int8).reshape(blocks.shape[0], -1)
    return (q, scale) if axis == 1 else (np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T))


def dequantize(q: np.ndarray, scales: np.ndarray, axis: int) -> np.ndarray:
    """The float32 matrix that `quantize`'s (q, scales) stand for."""
    block = q.shape[axis] // scales.shape[axis]
    return q.astype(np.float32) * np.repeat(scales.astype(np.float32), block, axis=axis)


def pack_rows(q: np.ndarray, scales: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    """(q, scales) of a matrix quantized along its rows (axis 1) in the rows layout (see the module doc)."""
    if fmt.bits == 8:
        return np.ascontiguousarray(q, np.int8), np.ascontiguousarray(scales)
    rows, columns = q.shape
    blocks = (q.astype(np.int16) + INT4_OFFSET).astype(np.uint8).reshape(rows, columns // fmt.block, 2, fmt.block // 2)
    packed = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)
    return np.ascontiguousarray(packed.reshape(rows, columns // 2)), np.ascontiguousarray(scales)


def unpack_rows(packed: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """The int8 values of `pack_rows`' q (the inverse, for tests and references)."""
    if fmt.bits == 8:
        return packed.astype(np.int8)
    rows, half = packed.shape
    blocks = packed.reshape(rows, -1, fmt.block // 2)
    low, high = (blocks & 0xF).astype(np.int8), (blocks >> 4).astype(np.int8)
    return (np.concatenate([low, high], axis=-1) - INT4_OFFSET).reshape(rows, 2 * half).astype(np.int8)


def pack_panels(q: np.ndarray, scales: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    """(q, scales) of a [K, N] matrix quantized along K (axis 0) in the panels layout (see the module doc)."""
    K, N = q.shape
    panels = -(-N // PANEL)
    padded_q = np.zeros((K, panels * PANEL), np.int8)
    padded_q[:, :N] = q
    padded_s = np.zeros((K // fmt.block, panels * PANEL), scales.dtype)
    padded_s[:, :N] = scales
    q_panels = padded_q.reshape(K, panels, PANEL).transpose(1, 0, 2)
    s_panels = np.ascontiguousarray(padded_s.reshape(-1, panels, PANEL).transpose(1, 0, 2))
    if fmt.bits == 8:
        return np.ascontiguousarray(q_panels), s_panels
    stored = (q_panels.astype(np.int16) + INT4_OFFSET).astype(np.uint8)
    half = PANEL // 2
    return np.ascontiguousarray(stored[..., :half] | (stored[..., half:] << 4)), s_panels
