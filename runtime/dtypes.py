"""Element types of the artifact's buffers: the one home of a dtype's name, size and file codes.

The compiler (kernel selection, the cost model, placement) and the runtime (allocation, weight files, byte
counts) all ask here; nothing else writes down that a float16 is two bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # the manifest's spelling, numpy's name
    itemsize: int  # bytes per element
    safetensors: str  # the safetensors header's code

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.name)


DTYPES: dict[str, DType] = {
    dtype.name: dtype
    for dtype in [
        DType("float32", 4, "F32"),
        DType("float16", 2, "F16"),
        DType("int32", 4, "I32"),
        DType("int64", 8, "I64"),
        DType("int8", 1, "I8"),  # int8 block-quantized weights
        DType("uint8", 1, "U8"),  # int4 block-quantized weights, two to a byte
    ]
}
BY_SAFETENSORS: dict[str, DType] = {dtype.safetensors: dtype for dtype in DTYPES.values()}


@dataclass(frozen=True)
class WeightFormat:
    """How a weight matrix is stored: a --weight-dtype. Float formats hold one element per weight; block-
    quantized ones (`block` > 0) hold `bits`-bit integers in `storage` (int4: two to a uint8) and one scale
    in `scale_dtype` per `block` consecutive weights along the axis a kernel reads contiguously (the
    reduction axis of a dense linear, the row of a gathered one; `passes.kernels.quant` has the layouts).
    Symmetric ones (int8, int4) round to nearest with one rule, Q4_0's and MatMulNBits'
    symmetric one: scale = the block's largest-magnitude weight / -2^(bits-1), q in [-2^(bits-1), 2^(bits-1) - 1],
    stored as q + `offset` (int4: + 8). Asymmetric ones (`has_min`: int4a, GGUF's Q4_1) also hold a minimum m
    per block, in `scale_dtype` beside its scale (the layouts store each block's d and m together): x = d * q + m,
    q in [0, 2^bits - 1] stored as it is (`dequantize`)."""

    name: str  # the command line's spelling
    storage: str  # the element type of the stored values (a DTYPES name)
    bits: int = 0  # bits per quantized weight (0: a float format)
    block: int = 0  # weights per scale (0: no scales)
    scale_dtype: str = "float16"
    has_min: bool = False  # asymmetric blocks: each also holds a minimum m (x = d q + m), in scale_dtype
    offset: int = 0  # what a stored integer exceeds q by (int4: 8, so that the nibble is unsigned)
    # Two-level scales (ggml's K-quants): a block's scale (and min) is an integer of `sub_scale` (uint8 / int8) times
    # one fp16 `scale_dtype` value per `super_block` weights: d = D * sc, m = -(Dmin * mn). 0: one level.
    super_block: int = 0
    sub_scale: str = ""

    @property
    def kept_from_file(self) -> bool:
        """Whether the format only keeps a model file's own blocks (5- and 6-bit codes, two-level scales:
        `passes.formats`): the kernels read it, no rounding rule of picompile's writes it."""
        return self.bits in (5, 6) or self.super_block > 0

    @property
    def per_block(self) -> int:
        """Values in scale_dtype per block: its scale, and its minimum where it has one."""
        return 2 if self.has_min else 1

    @property
    def quantized(self) -> bool:
        return self.block > 0

    @property
    def bytes_per_weight(self) -> float:
        """Stored bytes per weight, its share of a scale included: what every byte count prices a weight at."""
        if not self.quantized:
            return float(itemsize(self.storage))
        if self.super_block:
            return (self.bits / 8 + self.per_block * itemsize(self.sub_scale) / self.block
                    + self.per_block * itemsize(self.scale_dtype) / self.super_block)
        return self.bits / 8 + self.per_block * itemsize(self.scale_dtype) / self.block

    @property
    def levels(self) -> tuple[int, int]:
        """The smallest and the largest q."""
        if self.has_min:
            return 0, (1 << self.bits) - 1
        return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1

    def dequantize(self, q: np.ndarray, scales: np.ndarray, axis: int, mins: np.ndarray | None = None) -> np.ndarray:
        """The float32 matrix this format's blocks stand for (`dequantize_blocks`); mins exactly where it has them."""
        if self.has_min != (mins is not None):
            raise ValueError(f"{self.name} blocks {'take' if self.has_min else 'have no'} minimums")
        return dequantize_blocks(q, scales, axis, mins)


def dequantize_blocks(q: np.ndarray, scales: np.ndarray, axis: int, mins: np.ndarray | None = None) -> np.ndarray:
    """The float32 matrix blocks stand for (q unpacked, shaped like the matrix; scales and mins shaped like it
    with `axis` divided by the block): q * d, or with minimums (q * d) + m in float32 (the one definition of an
    asymmetric block's values: the import writes them so, the quantize pass checks its blocks against them; a
    kernel's sums reassociate)."""
    block = q.shape[axis] // scales.shape[axis]
    out = q.astype(np.float32) * np.repeat(scales.astype(np.float32), block, axis=axis)
    if mins is not None:
        out += np.repeat(mins.astype(np.float32), block, axis=axis)
    return out


QUANT_BLOCK = 32  # weights per scale (Q8_0 / Q4_0, MatMulNBits' default)
INT4_OFFSET = 8  # int4 values are stored as q + 8, in [0, 15]
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    fmt.name: fmt
    for fmt in [
        WeightFormat("fp32", "float32"),
        WeightFormat("fp16", "float16"),
        WeightFormat("int8", "int8", bits=8, block=QUANT_BLOCK),
        WeightFormat("int4", "uint8", bits=4, block=QUANT_BLOCK, offset=INT4_OFFSET),
        WeightFormat("int4a", "uint8", bits=4, block=QUANT_BLOCK, has_min=True),  # GGUF's Q4_1
        # kept from GGUF files as they are (passes.formats.ggml maps each ggml type; passes.kernels.kquant reads them)
        WeightFormat("q5_0", "uint8", bits=5, block=QUANT_BLOCK, offset=16),
        WeightFormat("q5_1", "uint8", bits=5, block=QUANT_BLOCK, has_min=True),
        WeightFormat("q4_k", "uint8", bits=4, block=32, has_min=True, super_block=256, sub_scale="uint8"),
        WeightFormat("q5_k", "uint8", bits=5, block=32, has_min=True, super_block=256, sub_scale="uint8"),
        WeightFormat("q6_k", "uint8", bits=6, block=16, offset=32, super_block=256, sub_scale="int8"),
    ]
}
# The formats a build may round float weights into (--weight-dtype's choices besides auto)
ROUNDABLE_FORMATS = tuple(name for name, fmt in WEIGHT_FORMATS.items() if not fmt.kept_from_file)
# The formats that only keep a model file's own blocks (passes.kernels.kquant's kernels read them)
FILE_FORMATS = tuple(name for name, fmt in WEIGHT_FORMATS.items() if fmt.kept_from_file)
# --weight-dtype's default: the format the model file stores its weights in (`compiler.resolve_weight_dtype`)
AUTO_WEIGHT_DTYPE = "auto"
# How a build rounds float weights into the quantized formats (--quant-method): "awq" scales FFN input channels
# by their profiled magnitude first (the compiler's passes.awq), "rtn" rounds each weight as it is.
QUANT_METHODS = ("awq", "rtn")
# The float formats' names and element types (the quantized ones store integers and scales).
WEIGHT_DTYPES: dict[str, str] = {name: fmt.storage for name, fmt in WEIGHT_FORMATS.items() if not fmt.quantized}


def get_dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown element type {name!r}; known: {', '.join(DTYPES)}") from None


def itemsize(name: str) -> int:
    return get_dtype(name).itemsize


def nbytes(shape, dtype: str) -> int:
    """Bytes of a dense array of `shape` in `dtype` (the one formula: quantized blocks will change it here)."""
    return math.prod(int(d) for d in shape) * itemsize(dtype)
