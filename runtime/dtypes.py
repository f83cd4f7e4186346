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
    ]
}
BY_SAFETENSORS: dict[str, DType] = {dtype.safetensors: dtype for dtype in DTYPES.values()}
# The command line's names of the weight storage types (--weight-dtype) and what they are stored as.
WEIGHT_DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16"}


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
