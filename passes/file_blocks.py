"""Weight matrices kept in a model file's own blocks, from the memory-mapped file to the kernels' layouts.

A GGUF file's block-quantized tensors never become a float copy: the front end gives each matrix of the graph a
`FileTensor`, an ONNX float tensor whose values are computed from the file's blocks only when a pass reads them
(one matrix at a time, then dropped) and which carries the blocks themselves as a `FileMatrix`: which rows of
which tensors of the file, in which order, transposed or not. Recognise joins them as it joins float weights
(q, k and v side by side; gate beside up), the quantize pass stores them in the format that holds them exactly
(`stored_format`) without rounding anything, and select-kernels packs them straight from the file's bytes.

Orientation: the file stores a linear's weight as [N, K], one row per output, blocked along K. A `FileMatrix`
with `transposed` is the [K, N] the IR computes with (column n is file row n); without, it is the file's [R, C]
(the embedding table, whose rows are gathered).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from runtime.dtypes import WEIGHT_FORMATS, WeightFormat

from .formats import ggml
from .kernels.kquant import KBlocks

# Formats a matrix whose parts came in different symmetric 32-blocks is stored in: each holds the others exactly
# (q5_0's and int4's codes are int8 values with the same fp16 scale), so joined parts keep their values.
JOINS_IN_INT8 = ("int8", "int4", "q5_0")
# Least rows of a transposed matrix FileMatrix.dequantize decodes at a time (the length of the float runs it writes
# across the output: 64 are 256 bytes, whole cache lines; fewer cost more in numpy's per-run overhead)
TRANSPOSED_ROWS = 64


@dataclass(frozen=True)
class FileRows:
    """Rows of one tensor of the file, in its blocks: `raw` uint8 [rows, row bytes] (a view of the memory-mapped
    file), its ggml type, its columns, and which of its rows in which order (`index`; None: all, as stored)."""

    ggml_type: str
    raw: np.ndarray
    columns: int
    index: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.raw.shape[0] if self.index is None else len(self.index)

    @property
    def format(self) -> WeightFormat:
        return WEIGHT_FORMATS[ggml.GGML_TYPES[self.ggml_type].format]

    def selected(self) -> np.ndarray:
        return self.raw if self.index is None else self.raw[self.index]

    def release(self) -> int:
        """Drop the rows' pages of the memory-mapped file from this process's resident set (they stay in the page
        cache and map back when read): a build reads each matrix's blocks once, to decode or pack them, and need
        not hold the file resident beside what it made of them. Returns the bytes released."""
        root = self.raw  # the memmap over the whole mapping (its views carry its mmap too, not its start)
        while isinstance(root.base, np.ndarray):
            root = root.base
        mapping = getattr(root, "_mmap", None)
        if not isinstance(mapping, mmap.mmap):
            return 0
        # numpy maps from the offset rounded down to the allocation granularity; the array starts past that
        start = (self.raw.__array_interface__["data"][0] - root.__array_interface__["data"][0]
                 + (root.offset or 0) % mmap.ALLOCATIONGRANULARITY)
        begin = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(start + self.raw.nbytes, len(mapping))
        mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        return end - begin


@dataclass(frozen=True)
class FileMatrix:
    """A weight matrix made of rows of the file's tensors (`parts`, stacked in order), in the file's blocks."""

    parts: tuple[FileRows, ...]
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = sum(p.rows for p in self.parts), self.parts[0].columns
        return (columns, rows) if self.transposed else (rows, columns)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def block_axis(self) -> int:
        """The axis the file's blocks run along: K of a transposed [K, N], else along each row."""
        return 0 if self.transposed else 1

    dtype = np.dtype(np.float32)  # what the matrix is to a pass that computes with it

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def T(self) -> "FileMatrix":  # noqa: N802 (numpy's spelling)
        return replace(self, transposed=not self.transposed)

    def take(self, index: np.ndarray) -> "FileMatrix":
        """The matrix of the file rows `index` (columns of a transposed matrix, else rows), in that order (across
        parts: ascending, as the parts are stacked)."""
        index = np.asarray(index)
        if len(self.parts) > 1 and np.any(np.diff(index) < 0):
            raise ValueError("a file matrix of several parts takes its rows in ascending order")
        starts = np.cumsum([0] + [p.rows for p in self.parts])
        parts = []
        for part, start, end in zip(self.parts, starts[:-1], starts[1:]):
            mine = index[(index >= start) & (index < end)] - start
            if len(mine):
                rows = mine if part.index is None else part.index[mine]
                parts.append(replace(part, index=rows))
        if sum(p.rows for p in parts) != len(index):
            raise ValueError(f"rows {index.min()}..{index.max()} reach past the matrix's {starts[-1]}")
        return FileMatrix(tuple(parts), self.transposed)

    @staticmethod
    def join(matrices: list["FileMatrix"]) -> "FileMatrix":
        """Matrices side by side along their file rows (the IR's concatenation of [K, N]s along N)."""
        if len({m.transposed for m in matrices}) != 1 or len({m.parts[0].columns for m in matrices}) != 1:
            raise ValueError("file matrices join only in one orientation and one width")
        return FileMatrix(tuple(p for m in matrices for p in m.parts), matrices[0].transposed)

    def stored_format(self) -> WeightFormat | None:
        """The format that holds every value exactly, in the file's own blocks where there is one format; None
        where the parts' formats have no common exact one (then it is stored run by run: `runs`)."""
        formats = {p.format.name for p in self.parts}
        if len(formats) == 1:
            return WEIGHT_FORMATS[formats.pop()]
        if formats <= set(JOINS_IN_INT8):
            return WEIGHT_FORMATS["int8"]
        return None

    def runs(self) -> list["FileMatrix"]:
        """The matrix as runs of consecutive parts of one format (a linear whose parts no one format holds is
        stored and computed run by run: q and k in Q4_K, v in Q6_K)."""
        runs: list[list[FileRows]] = []
        for part in self.parts:
            if runs and runs[-1][-1].format == part.format:
                runs[-1].append(part)
            else:
                runs.append([part])
        return [FileMatrix(tuple(run), self.transposed) for run in runs]

    def blocks(self) -> KBlocks:
        """The matrix in its stored format's blocks, oriented as the matrix (blocked along K: axis 0 where
        transposed, else along each row)."""
        fmt = self.stored_format()
        if fmt is None:
            raise ValueError("the matrix's parts have no common exact format")
        parts = [_decode(p) for p in self.parts]
        parts = [b if b.fmt == fmt else _widened(b, fmt) for b in parts]
        joined = parts[0] if len(parts) == 1 else KBlocks.concatenate(parts, axis=0)
        return joined.T if self.transposed else joined

    def dequantize(self) -> np.ndarray:
        """The float32 matrix: exactly the file's values (ggml's dequantization). Each part a chunk of rows at a
        time, into the one output, so that a chunk's codes and floats stay in the core's cache; a transposed
        matrix's chunk is transposed as codes (bytes: a quarter of the floats' traffic) and dequantized in the
        output's orientation, then copied across it in runs of TRANSPOSED_ROWS."""
        out = np.empty(self.shape, np.float32)
        at = 0
        for part in self.parts:
            step = max(1, ggml.CHUNK_VALUES // part.columns)
            if self.transposed:  # (whole runs of TRANSPOSED_ROWS)
                step = max(1, step // TRANSPOSED_ROWS) * TRANSPOSED_ROWS
            for start in range(0, part.rows, step):
                rows = slice(start, min(start + step, part.rows))
                blocks = _decode(part, rows, release=False)
                here = slice(at + rows.start, at + rows.stop)
                if self.transposed:
                    out[:, here] = blocks.T.dequantize()
                else:
                    blocks.dequantize(out=out[here])
            part.release()
            at += part.rows
        return out

    def __array__(self, dtype=None, copy=None):
        array = self.dequantize()
        return array if dtype is None else array.astype(dtype)


def _decode(part: FileRows, rows: slice = slice(None), release: bool = True) -> KBlocks:
    """A part's rows (`rows` of them) in their format's blocks, blocked along each row (ggml's legacy types as
    picompile's int8, int4 and int4a blocks: q, fp16 scales and mins); `release`: then drop the part's pages."""
    fmt = part.format
    raw = part.raw[rows] if part.index is None else part.raw[part.index[rows]]
    if fmt.kept_from_file:
        blocks = ggml.decode(part.ggml_type, raw, part.columns)
    else:
        q, scales, mins = ggml.decode_legacy(part.ggml_type, raw, part.columns)
        codes = q.view(np.uint8)
        if fmt.offset:
            codes += np.uint8(fmt.offset)  # (q + offset wraps to the unsigned code; q is ours to change)
        blocks = KBlocks(fmt, 1, codes, scales, mins)
    if release:
        part.release()  # (decoded into new arrays)
    return blocks


def _widened(blocks: KBlocks, fmt: WeightFormat) -> KBlocks:
    """Symmetric 32-blocks with fp16 scales in `fmt` (int8), values unchanged."""
    if fmt.name != "int8" or blocks.fmt.name not in JOINS_IN_INT8 or blocks.fmt.has_min:
        raise ValueError(f"{blocks.fmt.name} blocks are not held exactly by {fmt.name}")
    codes = (blocks.values().astype(np.int16) + fmt.offset).astype(np.int8).view(np.uint8)
    return KBlocks(fmt, blocks.axis, codes, blocks.scales)


class FileTensor(ir.LazyTensor):
    """An ONNX float32 tensor whose values are the file's blocks dequantized when read (never kept), carrying
    the blocks (`matrix`)."""

    def __init__(self, matrix: FileMatrix, name: str | None = None):
        super().__init__(lambda: ir.tensor(matrix.dequantize()), ir.DataType.FLOAT, ir.Shape(list(matrix.shape)), name=name)
        self.matrix = matrix


def file_matrix(value: ir.Value | None, any_formats: bool = False) -> FileMatrix | None:
    """The file matrix a value's constant is, where the front end gave it one and it holds in one exact format
    (`any_formats`: or in runs of its parts' own formats)."""
    tensor = None if value is None else value.const_value
    if isinstance(tensor, FileTensor) and (any_formats or tensor.matrix.stored_format() is not None):
        return tensor.matrix
    return None
