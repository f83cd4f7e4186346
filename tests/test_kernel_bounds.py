"""Indexing kernels stay inside their buffers whatever ids, positions, indices or counts they are given.

The CPU kernels that index with an input (embed: token ids and start; the sparse kernels: the selected
indices and their count) get out-of-range values. Every buffer they read sits between rows of NaN (and the
index buffer is followed by more out-of-range indices), every buffer they write between sentinels, so a read
outside a buffer shows up as NaN in the results and a write as a changed sentinel. The results must equal
the reference computed with the inputs clamped: ids and indices to the rows they index, counts to [0, n].
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi

from kernel_reference import act_ref, close
from passes.kernels import cpu, neuron, ops
from passes.targets import CPU_ISAS
from runtime.artifact import aligned_empty

D = 48  # 192-byte rows: a row offset keeps a view 64-byte aligned
N = 24  # neurons of a sparse FFN part; rows (input channels) of the column-sparse weight
V, P = 50, 20  # embedding rows, position rows
PAD = 2  # guard rows (or elements) on each side of a buffer
SENTINEL = 12345.0
BAD_INDICES = [-5, N, N + 100, 3, 2**31 - 1, -(2**31), 0, N - 1]
BAD_COUNTS = [N + 50, -3, 2**31 - 1, N]
SPARSE_FFN = {"relu": (False, "relu"), "gated_silu": (True, "silu")}  # name: (gated, act)
COLUMNS = {"plain": (False, "none", False), "gated_bias": (True, "silu", True)}  # name: (gated, act, bias)
COLUMN_WIDTH = 32  # columns of the column-sparse weight (gated: 16 outputs)


def guarded(array, fill):
    """``array`` copied into the middle of an aligned allocation whose PAD rows on each side hold ``fill``;
    returns (view, whole allocation)."""
    rows = array.shape[0]
    whole = aligned_empty((rows + 2 * PAD,) + array.shape[1:], array.dtype)
    whole[...] = fill
    whole[PAD : PAD + rows] = array
    return whole[PAD : PAD + rows], whole


def guarded_row(values, fill):
    """A [1, n] buffer (index lists, outputs) in a longer aligned 1-D allocation: the n values, then PAD * 16
    elements of ``fill``; returns (view, whole allocation)."""
    values = np.asarray(values)
    whole = aligned_empty((values.size + PAD * 16,), values.dtype)
    whole[...] = fill
    whole[: values.size] = values
    return whole[: values.size].reshape(1, values.size), whole


def nan_rows(rng, rows, cols):
    return guarded(rng.standard_normal((rows, cols)).astype(np.float32), np.nan)[0]


def index_list(rng):
    """N out-of-range and in-range indices, followed in memory by more out-of-range ones."""
    values = np.array(BAD_INDICES * (N // len(BAD_INDICES)), np.int32)
    rng.shuffle(values)
    view, whole = guarded_row(values, 0)
    whole[N:] = N + 7  # what an unbounded count would read next
    return view


def count_of(value):
    return guarded_row(np.array([value], np.int32), 0)[0]


def output(cols):
    view, whole = guarded_row(np.zeros(cols, np.float32), SENTINEL)
    return view, whole, cols


def untouched(out):
    _, whole, cols = out
    assert (whole[cols:] == SENTINEL).all(), "a kernel wrote past its output"


def clamped(idx, count, rows):
    """The rows a bounded kernel visits: the first clamp(count, 0, n) indices, each clamped to the rows."""
    return np.clip(idx[0, : min(max(count, 0), idx.shape[1])], 0, rows - 1).astype(np.int64)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = []
    for v, rows in (("d", 1), ("p", None)):
        funcs.append(ops.embed.cpu(f"embed_pos_{v}", V, D, rows=rows, positions=P))
        funcs.append(ops.embed.cpu(f"embed_nopos_{v}", V, D, rows=rows, positions=None))
    funcs += [ops.sparse_up.cpu("up", D, N, rows=1, gated=False, act="relu"),
              ops.sparse_up.cpu("up_gated", D, N, rows=1, gated=True, act="silu"),
              ops.sparse_down.cpu("down", N, D, rows=1)]
    funcs += [ops.sparse_ffn.cpu(f"ffn_{name}", D, N, rows=1, gated=gated, act=act)
              for name, (gated, act) in SPARSE_FFN.items()]
    funcs += [ops.sparse_columns.cpu(f"columns_{name}", N, COLUMN_WIDTH, rows=1, gated=gated, act=act, bias=bias)
              for name, (gated, act, bias) in COLUMNS.items()]
    path = tmp_path_factory.mktemp("bounds") / "bounds.so"
    cpu.build(funcs, CPU_ISAS["avx2"].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *args):
    lib[name](*[tvm_ffi.from_dlpack(a) if isinstance(a, np.ndarray) else a for a in args])


@pytest.mark.parametrize("start", [-3, 0, P - 2, P + 5, 2**40])
@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 1), ("p", 6)])
def test_embed_clamps_ids_and_positions(lib, variant, m, start):
    rng = np.random.default_rng(0)
    ids = guarded_row(np.array([-1, V, 10**12, -(2**63), 7, V - 1][:m], np.int64), 0)[0][0]
    table, pos = nan_rows(rng, V, D), nan_rows(rng, P, D)
    y = guarded(np.zeros((m, D), np.float32), SENTINEL)
    call(lib, f"embed_pos_{variant}", ids, table, pos, start, y[0])
    rows, positions = np.clip(ids, 0, V - 1), np.clip(start + np.arange(m), 0, P - 1)
    close(y[0], table[rows] + pos[positions], tol=1e-6)
    call(lib, f"embed_nopos_{variant}", ids, table, y[0])
    np.testing.assert_array_equal(y[0], table[rows])
    assert (y[1][:PAD] == SENTINEL).all() and (y[1][PAD + m :] == SENTINEL).all()


@pytest.mark.parametrize("count", BAD_COUNTS)
def test_sparse_up_and_down_bound_count_and_indices(lib, count):
    rng = np.random.default_rng(1)
    idx, cnt = index_list(rng), count_of(count)
    rows = clamped(idx, count, N)
    x = guarded_row(rng.standard_normal(D).astype(np.float32), np.nan)[0]
    w, b = nan_rows(rng, N, D), guarded_row(rng.standard_normal(N).astype(np.float32), np.nan)[0][0]
    h = output(N)
    call(lib, "up", x, idx, cnt, w, b, h[0])
    close(h[0][0, : len(rows)], np.maximum(w[rows] @ x[0] + b[rows], 0))
    untouched(h)

    w2, b2 = nan_rows(rng, 2 * N, D), guarded_row(rng.standard_normal(2 * N).astype(np.float32), np.nan)[0][0]
    call(lib, "up_gated", x, idx, cnt, w2, b2, h[0])
    gate, up = w2[rows] @ x[0] + b2[rows], w2[N + rows] @ x[0] + b2[N + rows]
    close(h[0][0, : len(rows)], act_ref(gate.astype(np.float64), "silu") * up)
    untouched(h)

    down, out = nan_rows(rng, N, D), output(D)
    call(lib, "down", h[0], idx, cnt, down, out[0])
    close(out[0][0], h[0][0, : len(rows)] @ down[rows] if len(rows) else np.zeros(D))
    untouched(out)


@pytest.mark.parametrize("count", BAD_COUNTS)
@pytest.mark.parametrize("variant", SPARSE_FFN)
def test_sparse_ffn_bounds_count_and_indices(lib, variant, count):
    gated, act = SPARSE_FFN[variant]
    rng = np.random.default_rng(2)
    idx, cnt = index_list(rng), count_of(count)
    rows = clamped(idx, count, N)
    width = (2 if gated else 1) * N
    x = guarded_row(rng.standard_normal(D).astype(np.float32), np.nan)[0]
    up, down = nan_rows(rng, width, D), nan_rows(rng, N, D)
    b = guarded_row(rng.standard_normal(width).astype(np.float32), np.nan)[0][0]
    h, fired = output(N), guarded_row(np.zeros(N, np.int32), -1)
    scratch, out = guarded(np.zeros((neuron.FFN_TASKS, D), np.float32), SENTINEL), output(D)
    call(lib, f"ffn_{variant}", x, idx, cnt, up, b, down, h[0], fired[0], scratch[0], out[0])
    hidden = act_ref((up[rows] @ x[0] + b[rows]).astype(np.float64), act)
    if gated:
        hidden = hidden * (up[N + rows] @ x[0] + b[N + rows])
    close(h[0][0, : len(rows)], hidden)
    close(out[0][0], hidden @ down[rows] if len(rows) else np.zeros(D))
    untouched(h)
    untouched(out)
    assert (fired[1][N:] == -1).all()
    assert (scratch[1][:PAD] == SENTINEL).all() and (scratch[1][PAD + neuron.FFN_TASKS :] == SENTINEL).all()


@pytest.mark.parametrize("count", BAD_COUNTS)
@pytest.mark.parametrize("variant", COLUMNS)
def test_sparse_columns_bounds_count_and_indices(lib, variant, count):
    gated, act, bias = COLUMNS[variant]
    rng = np.random.default_rng(3)
    idx, cnt = index_list(rng), count_of(count)  # N rows (input channels) here
    rows = clamped(idx, count, N)
    v = guarded_row(rng.standard_normal(N).astype(np.float32), np.nan)[0]
    w = nan_rows(rng, N, COLUMN_WIDTH)
    b = guarded_row(rng.standard_normal(COLUMN_WIDTH).astype(np.float32), np.nan)[0][0]
    scratch = guarded(np.zeros((neuron.COLUMN_TASKS, COLUMN_WIDTH), np.float32), SENTINEL)
    outputs = COLUMN_WIDTH // 2 if gated else COLUMN_WIDTH
    y = output(outputs)
    call(lib, f"columns_{variant}", v, idx, cnt, w, *([b] if bias else []), scratch[0], y[0])
    pre = v[0, rows].astype(np.float64) @ w[rows] + (b if bias else 0)
    half = COLUMN_WIDTH // 2
    close(y[0][0], act_ref(pre[:half], act) * pre[half:] if gated else act_ref(pre, act))
    untouched(y)
    assert (scratch[1][:PAD] == SENTINEL).all() and (scratch[1][PAD + neuron.COLUMN_TASKS :] == SENTINEL).all()
