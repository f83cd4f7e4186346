"""blocking: the blocks a weight matrix is stored in, by one rule that the quantize pass writes with and the
quality pass's reference computes with (so the quality a build expects is that of the values its kernels read).

The rule, for a model and a build (`Blocking.of`):
- the build's format takes the source's scale type where every weight of the model came quantized in it
  (MatMulNBits with float32 scales: `format`);
- a model that came quantized (MatMulNBits, or a GGUF file with block-quantized tensors) keeps its values:
  blocks on the format's grid keep their integers and scales, asymmetric ones are found again (`exact`), and no
  scale is fitted; else --quant-method awq fits each symmetric block's scale (`quant.quantize`'s fit_scales);
- with `keep_source_blocks` (auto's build of a quantized model) a matrix whose blocks the format does not hold
  exactly is stored in the first format that does (`SOURCE_FORMATS`, fewest bytes first: a Q4_1 file's Q8_0
  embedding in int8), not re-rounded; in int4a a matrix in no 4-bit blocks stays in floats.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from runtime.dtypes import QUANT_BLOCK, WEIGHT_FORMATS, WeightFormat

from .file_blocks import FileMatrix
from .import_gguf import GGUFSource
from .import_onnx import SourceQuantization
from .kernels import quant

KEPT_FORMATS_ROUND_TO = "int8"  # where float values planned in a file's own format (q4_k, ...) are rounded into
# Where a model's matrix is in other blocks than the build's format: the formats tried, fewest bytes first.
SOURCE_FORMATS = tuple(sorted((f for f in WEIGHT_FORMATS.values() if f.quantized and not f.kept_from_file),
                             key=lambda f: f.bytes_per_weight))


@dataclass(frozen=True)
class Blocking:
    format: WeightFormat  # the build's, with the source's scale type where the model came in it
    method: str  # --quant-method ("awq": fitted scales)
    came_quantized: bool = False
    group: int = 1  # the source's asymmetric blocks along K, in QUANT_BLOCKs (MatMulNBits' 64, 128: 2, 4)
    keep_source_blocks: bool = False

    @classmethod
    def of(cls, model: ir.Model, fmt: WeightFormat, method: str, keep_source_blocks: bool = False) -> "Blocking":
        source = SourceQuantization.of(model) if fmt.quantized else None
        gguf = GGUFSource.of(model)
        came_quantized = source is not None or (gguf is not None and gguf.quantized())
        group = _source_group(source) if fmt.quantized and source is not None else 1
        return cls(_source_format(source, fmt), method, came_quantized, group, keep_source_blocks)

    def format_for(self, planned: str | None) -> WeightFormat:
        """The format a matrix is stored in: `planned` (the quality plan's, by name) where given, with the
        build's scale type where both are blocks; else the build's."""
        if planned is None:
            return self.format
        fmt = WEIGHT_FORMATS[planned]
        return replace(fmt, scale_dtype=self.format.scale_dtype) if fmt.quantized and self.format.quantized else fmt

    def kept(self, held: FileMatrix | None, fmt: WeightFormat, axis: int, thinned: bool = False) -> WeightFormat | None:
        """The format a matrix the model file stores in blocks (`held`) is stored in as it is, where it is: blocked
        along the axis its kernels read (a linear's K, a table's rows), planned in blocks, and either in the planned
        format or in a build that keeps the file's blocks (--weight-dtype auto). `thinned`: a threshold thins the
        linear's input, so a column-sparse kernel gathers its rows (`axis` 1); the file's blocks along K serve it
        where they are a file's own format (`kquant_columns` reads them). None: it is rounded into `fmt` (in
        `rounding_format`) like any float matrix."""
        if held is None or not fmt.quantized:
            return None
        stored = held.stored_format()
        if stored is None:
            return None
        columns = thinned and axis == 1 and held.block_axis == 0 and stored.kept_from_file
        if held.block_axis != axis and not columns:
            return None
        return stored if self.keep_source_blocks or stored.name == fmt.name else None

    def kept_in_runs(self, held: FileMatrix | None, fmt: WeightFormat, axis: int) -> bool:
        """Whether a file matrix whose parts no one format holds (q and k in Q4_K, v in Q6_K) is stored run by run
        in the parts' own blocks (`FileMatrix.runs`): in a build that keeps the file's blocks, read along them."""
        return (held is not None and fmt.quantized and self.keep_source_blocks
                and held.block_axis == axis and held.stored_format() is None)

    @staticmethod
    def rounding_format(fmt: WeightFormat) -> WeightFormat:
        """The format float values planned in `fmt` are rounded into: `fmt`, or for a format only a file's blocks
        are kept in (q4_k, ...: no rounding rule writes it) KEPT_FORMATS_ROUND_TO."""
        return WEIGHT_FORMATS[KEPT_FORMATS_ROUND_TO] if fmt.kept_from_file else fmt

    def blocks(self, array: np.ndarray, fmt: WeightFormat, axis: int,
               held: FileMatrix | None = None) -> tuple[tuple | None, WeightFormat, int]:
        """(blocks, the format they are in, source blocks re-rounded) of a weight matrix stored in the blocked
        format `fmt`; blocks None where an int4a build keeps a matrix in no 4-bit blocks in floats. `held`: the
        file's blocks the values are (`array` dequantizes them)."""
        exact = self.came_quantized
        # a file's blocks are on a grid along their own axis only: across it (a thinned Q4_K matrix's rows) no
        # format holds them, and trying every format on such a matrix took 4x its rounding (a 1.5B's path end: 90 s)
        on_grid = exact and (held is None or held.block_axis == axis)
        group = self.group if axis == 0 else 1
        if fmt.has_min:
            q, scales, mins, missed, unlike = quant.quantize_asymmetric(array, fmt, axis, exact=exact, group=group)
            blocks, holds = (None if unlike else (q, scales, mins)), not unlike and not missed
        else:
            fit = self.method == "awq" and not self.came_quantized
            blocks = quant.quantize(array, fmt, axis, fit_scales=fit, keep_grid=on_grid)
            missed = 0
            holds = not on_grid or relative_error(array, quant.dequantize(*blocks, axis)) == 0.0
        if on_grid and not holds and self.keep_source_blocks:
            for other in SOURCE_FORMATS:
                if other.name == fmt.name or not quant.quantizable(array.shape, axis, other.block):
                    continue
                if other.has_min:
                    q, scales, mins, left, unlike = quant.quantize_asymmetric(array, other, axis, exact=True, group=group)
                    if not unlike and not left:
                        return (q, scales, mins), other, 0
                else:
                    candidate = quant.quantize(array, other, axis, keep_grid=True)
                    if relative_error(array, quant.dequantize(*candidate, axis)) == 0.0:
                        return candidate, other, 0
        return blocks, fmt, missed


def relative_error(w: np.ndarray, approx: np.ndarray) -> float:
    """||w - approx|| / ||w||: how much of the matrix the rounding changed."""
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - approx)) / norm if norm else 0.0


def _source_format(source: SourceQuantization | None, fmt: WeightFormat) -> WeightFormat:
    """`fmt`, with the source's scale type where every weight of the model came quantized in it (bits, block,
    symmetric; int4a: with zero points, in the type import wrote its blocks' scales and mins in)."""
    if source is None or not source.weights:
        return fmt
    if fmt.has_min:
        asymmetric = [w for w in source.weights if not w.symmetric and w.bits == fmt.bits
                      and w.block_size % fmt.block == 0]
        if asymmetric and any(w.block_dtype == "float32" for w in asymmetric):
            return replace(fmt, scale_dtype="float32")
        return fmt
    if all(w.symmetric and w.bits == fmt.bits and w.block_size == fmt.block for w in source.weights):
        scale_types = {w.scale_dtype for w in source.weights}
        if scale_types == {"float32"}:
            return replace(fmt, scale_dtype="float32")
    return fmt


def _source_group(source: SourceQuantization) -> int:
    """How many QUANT_BLOCKs along K one block of the model's asymmetric 4-bit weights spans (MatMulNBits'
    block_size / 32), where they all have one block size that is a multiple of it; else 1."""
    sizes = {w.block_size for w in source.weights if w.bits == 4 and not w.symmetric}
    size = sizes.pop() if len(sizes) == 1 else 0
    return size // QUANT_BLOCK if size and size % QUANT_BLOCK == 0 else 1
