"""A model file's blocks as the compiler holds them (passes/file_blocks.py): a FileMatrix is the file's rows, in
their blocks, joined, taken, transposed and split into runs without changing a value, its float face is exactly
ggml's dequantization, and its pages leave the resident set once read."""

import numpy as np
import pytest

from passes.file_blocks import FileMatrix, FileRows, FileTensor
from passes.formats import ggml
from runtime.dtypes import WEIGHT_FORMATS
from tests.ggml_encode import encode

RNG = np.random.default_rng(0)


def _rows(kind: str, rows: int, columns: int = 256) -> tuple[FileRows, np.ndarray]:
    raw = encode(kind, (0.1 * RNG.standard_normal((rows, columns))).astype(np.float32))
    import gguf

    return FileRows(kind, raw, columns), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])


def test_a_joined_matrix_is_its_parts_side_by_side_and_transposes():
    q, q_values = _rows("Q4_K", 48)
    v, v_values = _rows("Q6_K", 16)
    matrix = FileMatrix((q, v), transposed=True)
    assert matrix.shape == (256, 64)
    assert np.array_equal(np.asarray(matrix), np.concatenate([q_values, v_values]).T)
    assert np.array_equal(np.asarray(matrix.T), np.concatenate([q_values, v_values]))
    joined = FileMatrix.join([FileMatrix((q,), True), FileMatrix((v,), True)])
    assert joined == matrix
    tensor = FileTensor(matrix, name="w")  # the ONNX float face: exactly the file's values
    assert tensor.shape.dims == (256, 64) and np.array_equal(tensor.numpy(), np.asarray(matrix))


def test_parts_in_different_formats_are_stored_in_one_that_holds_both_or_run_by_run():
    q5, _ = _rows("Q5_0", 8)
    q8, _ = _rows("Q8_0", 8)
    k4, _ = _rows("Q4_K", 8)
    k6, _ = _rows("Q6_K", 8)
    assert FileMatrix((q5, q8), True).stored_format() == WEIGHT_FORMATS["int8"]  # int8 holds Q5_0's blocks
    mixed = FileMatrix((k4, k4, k6), True)
    assert mixed.stored_format() is None
    runs = mixed.runs()
    assert [(run.stored_format().name, run.shape) for run in runs] == [("q4_k", (256, 16)), ("q6_k", (256, 8))]
    assert np.array_equal(np.concatenate([np.asarray(run) for run in runs], axis=1), np.asarray(mixed))
    widened = FileMatrix((q5, q8), True).blocks()  # Q5_0's codes as int8 values, the same scales
    assert widened.fmt.name == "int8" and np.array_equal(widened.dequantize(), np.asarray(FileMatrix((q5, q8), True)))


def test_taking_rows_keeps_their_blocks_and_order():
    a, a_values = _rows("Q5_K", 10)
    b, b_values = _rows("Q5_K", 6)
    matrix = FileMatrix((a, b), transposed=False)
    index = np.array([1, 4, 9, 10, 15])
    taken = matrix.take(index)
    assert np.array_equal(np.asarray(taken), np.concatenate([a_values, b_values])[index])
    assert np.array_equal(taken.blocks().dequantize(), np.asarray(taken))
    single = FileMatrix((a,), transposed=False).take(np.array([7, 2]))  # one part: any order
    assert np.array_equal(np.asarray(single), a_values[[7, 2]])
    with pytest.raises(ValueError):
        matrix.take(np.array([10, 1]))  # across parts: ascending only
    with pytest.raises(ValueError):
        matrix.take(np.array([3, 16]))


@pytest.mark.parametrize("transposed", [False, True])
def test_dequantizing_in_chunks_keeps_every_value(transposed, monkeypatch):
    """FileMatrix.dequantize decodes each part a chunk of rows at a time (a transposed matrix's in runs of
    TRANSPOSED_ROWS): chunks that split parts unevenly, taken rows among them, change no value."""
    from passes import file_blocks

    monkeypatch.setattr(ggml, "CHUNK_VALUES", 3 * 256)
    monkeypatch.setattr(file_blocks, "TRANSPOSED_ROWS", 2)
    a, a_values = _rows("Q4_K", 11)
    b, b_values = _rows("Q6_K", 5)
    c, c_values = _rows("Q8_0", 7)
    values = np.concatenate([a_values, b_values, c_values])
    matrix = FileMatrix((a, b, c), transposed)
    assert np.array_equal(np.asarray(matrix), values.T if transposed else values)
    index = np.array([0, 3, 4, 8, 10, 12, 13, 17, 20, 22])
    taken = matrix.take(index)
    assert np.array_equal(np.asarray(taken), values[index].T if transposed else values[index])


def test_the_blocks_pages_leave_the_resident_set(tmp_path):
    raw = encode("Q4_K", RNG.standard_normal((2048, 256)).astype(np.float32))
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r").reshape(raw.shape)
    part = FileRows("Q4_K", mapped[1024:], 256)
    assert np.array_equal(ggml.decode("Q4_K", part.selected(), 256).dequantize(),
                          ggml.decode("Q4_K", raw[1024:], 256).dequantize())
    assert part.release() >= part.raw.nbytes  # (whole pages, from the one the rows start in)
    assert FileRows("Q4_K", raw, 256).release() == 0  # not a mapping: nothing to release


def test_a_file_matrix_rounded_across_its_blocks_is_rounded_not_searched(monkeypatch):
    """Blocking rounds a file matrix across its blocks' axis (a thinned matrix's rows) by the rule: no format
    holds it exactly there, so no format is searched for one (Q8_0 blocks across their axis stay int8 rounded to
    nearest); along its axis a Q8_0 matrix's own blocks are still found again."""
    from passes.blocking import Blocking
    from passes.kernels import quant

    q8, values = _rows("Q8_0", 64)
    held = FileMatrix((q8,), transposed=False)  # the file's [64, 256]: blocks along axis 1
    int4 = WEIGHT_FORMATS["int4"]
    blocking = Blocking(int4, "awq", came_quantized=True, keep_source_blocks=True)
    expected = quant.quantize(values, int4, 0)
    with monkeypatch.context() as patched:  # no grid is tested, no format searched
        patched.setattr(quant, "on_grid", lambda *a: pytest.fail("searched a grid across the file's blocks"))
        patched.setattr(quant, "quantize_asymmetric", lambda *a, **k: pytest.fail("searched int4a"))
        blocks, used, _ = blocking.blocks(values, int4, 0, held)  # across: int4 by the rule
    assert used is int4 and all(np.array_equal(a, b) for a, b in zip(blocks, expected))
    blocks, used, _ = blocking.blocks(values, int4, 1, held)  # along: Q8_0's blocks are int8's exactly
    assert used.name == "int8" and np.array_equal(quant.dequantize(*blocks, 1), values)
