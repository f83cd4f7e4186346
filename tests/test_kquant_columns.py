"""The column-sparse kernels over blocks kept from a model file (passes/kernels/kquant_columns.py) and their layout
(`kquant.pack_columns`) against numpy: random blocks of every kept format (codes over their whole range, Q6_K's
int8 sub-scales of both signs), the sum over the kept inputs of `KBlocks.dequantize`'s rows in float64 (the kernels
factor each block's scales out of its sum: they reassociate). Decode over ascending, unordered, empty and full
index lists; a batch step's rows; the prefill GEMM over the same layout with a tail tile of rows.
"""

import numpy as np
import pytest

from kernel_reference import act_ref
from passes.kernels import cpu, kquant_ops, ops
from passes.kernels.kquant import column_row_bytes, pack_columns, unpack_columns
from passes.kernels.kquant_columns import scratch_columns
from passes.kernels.neuron import COLUMN_TASKS
from passes.targets import host_cpu_isa
from runtime.dtypes import FILE_FORMATS, WEIGHT_FORMATS
from test_kernels import aligned, call, rand
from test_kquant_ops import random_blocks

FORMATS = FILE_FORMATS
K, N = 512, 288  # N: a last group of high bits with 1 of its 8 blocks (288 = 256 + 32)
GATED_N = 320  # gate | up halves of 160
CHUNKED_N = 640  # in chunks of 8 groups: 2 octets, then 4 groups that go with the last chunk
BATCH = 3


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    import tvm

    funcs = []
    for fmt in FORMATS:
        funcs.append(ops.sparse_columns_kq.cpu(f"col_{fmt}", K, N, rows=1, fmt=fmt))
        funcs.append(ops.linear_columns_kq.cpu(f"gemm_{fmt}", K, N, rows=None, fmt=fmt, bias=True, act="silu",
                                               residual=True))
    funcs.append(ops.sparse_columns_kq.cpu("col_gated", K, GATED_N, rows=1, fmt="q4_k", gated=True, act="silu",
                                           bias=True))
    funcs.append(ops.sparse_columns_kq.cpu("col_res", K, N, rows=1, fmt="q6_k", residual=True))
    funcs.append(ops.sparse_columns_kq.cpu("col_batch", K, N, rows=None, fmt="q5_0", max_batch=BATCH))
    funcs.append(ops.sparse_columns_kq.cpu("col_chunks", K, CHUNKED_N, rows=1, fmt="q6_k", residual=True,
                                           chunk_groups=8))
    funcs.append(ops.sparse_columns_kq.cpu("col_chunks_batch", K, CHUNKED_N, rows=None, fmt="q4_k", gated=True,
                                           act="silu", max_batch=BATCH, chunk_groups=8))
    path = str(tmp_path_factory.mktemp("kq_columns") / "lib.so")
    cpu.build(funcs, host_cpu_isa().llvm_target(), path)
    return tvm.runtime.load_module(path)


def _blocks(fmt, n=N, seed=0):
    return random_blocks(np.random.default_rng(seed + FORMATS.index(fmt)), fmt, (K, n), 0)


def _index(kept):
    idx = np.zeros((1, K), np.int32)
    idx[0, :len(kept)] = kept
    return aligned(idx), aligned(np.array([[len(kept)]], np.int32))


def _packed(blocks):
    return [aligned(a) for a in pack_columns(blocks)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_columns_round_trips_and_holds_the_files_bytes(fmt):
    blocks = _blocks(fmt)
    values, scales = pack_columns(blocks)
    back = unpack_columns(values, scales, WEIGHT_FORMATS[fmt], N)
    for field in ("codes", "scales", "mins", "super_scales", "super_mins"):
        a, b = getattr(blocks, field), getattr(back, field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=field)
    assert values.shape == (K, column_row_bytes(WEIGHT_FORMATS[fmt], N))
    # whole groups of high bits: the file's bytes a weight, but for 6-bit sub-scales unpacked to bytes (+3%)
    whole = _blocks(fmt, 1024)
    size = sum(a.nbytes for a in pack_columns(whole))
    assert size <= WEIGHT_FORMATS[fmt].bytes_per_weight * K * 1024 * 1.03


KEPT_SETS = {
    "ascending": lambda rng: np.sort(rng.choice(K, K // 3, replace=False)),
    "unordered": lambda rng: rng.choice(K, K // 3, replace=False),  # blocks revisited: each visit taken in
    "one": lambda rng: np.array([K - 1]),
    "none": lambda rng: np.array([], np.int64),
    "all": lambda rng: np.arange(K),
}


@pytest.mark.parametrize("kept", KEPT_SETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_sums_the_kept_inputs_rows(lib, fmt, kept):
    rng = np.random.default_rng(7)
    blocks = _blocks(fmt)
    rows = KEPT_SETS[kept](rng)
    v = rand(rng, 1, K)
    idx, count = _index(rows)
    scratch = aligned(np.full((COLUMN_TASKS, scratch_columns(N)), np.nan, np.float32))  # (it zeroes its own)
    y = aligned(np.full((1, N), np.nan, np.float32))
    call(lib, f"col_{fmt}", v, idx, count, *_packed(blocks), scratch, y)
    want = v[0, rows].astype(np.float64) @ blocks.dequantize()[rows].astype(np.float64)
    scale = max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-6 * scale)


def test_decode_epilogues_gated_and_residual(lib):
    rng = np.random.default_rng(3)
    rows = np.sort(rng.choice(K, K // 2, replace=False))
    v = rand(rng, 1, K)
    idx, count = _index(rows)
    gated = _blocks("q4_k", GATED_N)
    b = rand(rng, GATED_N)
    scratch = aligned(np.zeros((COLUMN_TASKS, scratch_columns(GATED_N)), np.float32))
    y = aligned(np.zeros((1, GATED_N // 2), np.float32))
    call(lib, "col_gated", v, idx, count, *_packed(gated), b, scratch, y)
    pre = v[0, rows].astype(np.float64) @ gated.dequantize()[rows] + b
    half = GATED_N // 2
    want = act_ref(pre[:half], "silu") * pre[half:]
    np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-6 * np.abs(want).max())

    blocks = _blocks("q6_k")
    res = rand(rng, 1, N)
    scratch = aligned(np.zeros((COLUMN_TASKS, scratch_columns(N)), np.float32))
    y = aligned(np.zeros((1, N), np.float32))
    call(lib, "col_res", v, idx, count, *_packed(blocks), res, scratch, y)
    want = v[0, rows].astype(np.float64) @ blocks.dequantize()[rows] + res[0]
    np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_a_batch_step_sums_each_sequences_rows_over_the_union(lib):
    rng = np.random.default_rng(5)
    blocks = _blocks("q5_0")
    rows = np.sort(rng.choice(K, K // 4, replace=False))
    v = rand(rng, BATCH, K)
    idx, count = _index(rows)
    scratch = aligned(np.zeros((COLUMN_TASKS, scratch_columns(N, BATCH)), np.float32))
    y = aligned(np.zeros((BATCH, N), np.float32))
    call(lib, "col_batch", v, idx, count, *_packed(blocks), scratch, y)
    want = v[:, rows].astype(np.float64) @ blocks.dequantize()[rows].astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("kept", ["ascending", "unordered"])
def test_outputs_in_chunks_walk_the_kept_rows_once_a_chunk(lib, kept):
    """Chunks of 8 groups over 640 outputs (two, the last with the 4 groups left), decode with a residual and a
    gated batch step: each chunk's blocks taken in through their scales as whole rows are."""
    rng = np.random.default_rng(11)
    rows = KEPT_SETS[kept](rng)
    idx, count = _index(rows)
    blocks = _blocks("q6_k", CHUNKED_N)
    v, res = rand(rng, 1, K), rand(rng, 1, CHUNKED_N)
    scratch = aligned(np.full((COLUMN_TASKS, scratch_columns(CHUNKED_N)), np.nan, np.float32))
    y = aligned(np.full((1, CHUNKED_N), np.nan, np.float32))
    call(lib, "col_chunks", v, idx, count, *_packed(blocks), res, scratch, y)
    want = v[0, rows].astype(np.float64) @ blocks.dequantize()[rows] + res[0]
    np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-6 * np.abs(want).max())

    gated = _blocks("q4_k", CHUNKED_N)
    v = rand(rng, BATCH, K)
    scratch = aligned(np.full((COLUMN_TASKS, scratch_columns(CHUNKED_N, BATCH)), np.nan, np.float32))
    y = aligned(np.full((BATCH, CHUNKED_N // 2), np.nan, np.float32))
    call(lib, "col_chunks_batch", v, idx, count, *_packed(gated), scratch, y)
    pre = v[:, rows].astype(np.float64) @ gated.dequantize()[rows]
    half = CHUNKED_N // 2
    want = act_ref(pre[:, :half], "silu") * pre[:, half:]
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 6])  # 6: a whole tile of 4 rows and a tail of 2
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_gemm_over_the_columns_layout(lib, fmt, m):
    rng = np.random.default_rng(11)
    blocks = _blocks(fmt)
    full = rand(rng, 8, K)
    x = full[:m]
    b, res = rand(rng, N), rand(rng, 8, N)[:m]
    ys = aligned(np.full((8, N), 5.0, np.float32))
    call(lib, f"gemm_{fmt}", x, *_packed(blocks), b, res, ys[:m])
    want = act_ref(x.astype(np.float64) @ blocks.dequantize().astype(np.float64) + b, "silu") + res
    np.testing.assert_allclose(ys[:m], want, rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_array_equal(ys[m:], 5.0)  # rows past m untouched


def test_interface_and_refusals():
    from passes.kernels.kquant_columns import linear_columns_kq, sparse_columns_kq

    f = sparse_columns_kq("c", K, N, rows=1, fmt="q4_k", bias=True, residual=True)
    assert [p.name for p in f.params] == ["v", "idx", "count", "w", "ws", "b", "res", "scratch", "y"]
    g = linear_columns_kq("g", K, N, rows=None, fmt="q6_k")
    assert [p.name for p in g.params] == ["x", "w", "ws", "y"]
    with pytest.raises(ValueError):  # K-quants: whole super-blocks of K
        sparse_columns_kq("c", 128, N, rows=1, fmt="q4_k")
    with pytest.raises(ValueError):  # N in whole 32-element groups
        sparse_columns_kq("c", K, 40, rows=1, fmt="q5_0")
    with pytest.raises(ValueError):  # not a kept format
        sparse_columns_kq("c", K, N, rows=1, fmt="int4")
    with pytest.raises(ValueError):  # decode and batch steps only / prefill only
        sparse_columns_kq("c", K, N, rows=4, fmt="q5_0")
    with pytest.raises(ValueError):
        linear_columns_kq("g", K, N, rows=1, fmt="q5_0")
