"""The neuron-aware kernels (passes/kernels/neuron.py) against numpy: empty, partial and full index sets."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron
from passes.targets import CPU_ISAS
from kernel_reference import aligned

D, N = 36, 24  # odd sizes: 4-lane vectors, no multiple of 8
FN = 2 * neuron.FFN_TASKS * neuron.ROW_GROUP + 13  # sparse_ffn's neurons: a task's share is whole groups of rows
# read in lockstep and a tail
FUSED = {"relu": (False, "relu", "float32"), "gated_relu_f16": (True, "relu", "float16"),
         "gated_silu": (True, "silu", "float32")}  # sparse_ffn variants: (gated, activation, weight dtype)
ACT = {"relu": lambda v: np.maximum(v, 0), "silu": lambda v: v / (1 + np.exp(-v))}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select", N, rows=1),
             neuron.sparse_up("up", D, N, rows=1, gated=False, act="relu"),
             neuron.sparse_up("up_gated", D, N, rows=1, gated=True, act="silu"),
             neuron.sparse_down("down", N, D, rows=1),
             neuron.merge("merge", D, 2, rows=None, bias=True, residual=True),
             neuron.linear_rows("rows", D, N, rows=None, act="relu"),
             neuron.linear_rows("rows_f16", D, N, rows=None, act="none", wdtype="float16")]
    funcs += [neuron.sparse_ffn(f"ffn_{name}", D, FN, rows=1, gated=gated, act=act, wdtype=dtype)
              for name, (gated, act, dtype) in FUSED.items()]
    path = tmp_path_factory.mktemp("neuron") / "neuron.so"
    cpu.build(funcs, CPU_ISAS["avx2"].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *arrays):
    lib[name](*[tvm_ffi.from_dlpack(a) for a in arrays])


@pytest.mark.parametrize("threshold", [np.inf, 0.3, -np.inf])  # no neuron, some, every neuron
def test_sparse_ffn_part(lib, threshold):
    rng = np.random.default_rng(0)
    scores = aligned(rng.standard_normal((1, N)).astype(np.float32))
    index, count = aligned(np.full((1, N), -7, np.int32)), aligned(np.zeros((1, 1), np.int32))
    call(lib, "select", scores, aligned(np.array([min(max(threshold, -3e38), 3e38)], np.float32)), index, count)
    expected = np.nonzero(scores[0] > threshold)[0]
    k = int(count[0, 0])
    assert k == len(expected) and np.array_equal(index[0, :k], expected)

    x = aligned(rng.standard_normal((1, D)).astype(np.float32))
    w, b = aligned(rng.standard_normal((N, D)).astype(np.float32)), aligned(rng.standard_normal(N).astype(np.float32))
    hidden = aligned(np.full((1, N), 99.0, np.float32))
    call(lib, "up", x, index, count, w, b, hidden)
    np.testing.assert_allclose(hidden[0, :k], np.maximum(w[expected] @ x[0] + b[expected], 0), atol=1e-5)
    assert np.all(hidden[0, k:] == 99.0)  # nothing written past the active neurons

    w2, b2 = aligned(rng.standard_normal((2 * N, D)).astype(np.float32)), aligned(rng.standard_normal(2 * N).astype(np.float32))
    call(lib, "up_gated", x, index, count, w2, b2, hidden)
    gate = w2[expected] @ x[0] + b2[expected]
    up = w2[N + expected] @ x[0] + b2[N + expected]
    np.testing.assert_allclose(hidden[0, :k], gate / (1 + np.exp(-gate)) * up, atol=1e-4)

    down, out = aligned(rng.standard_normal((N, D)).astype(np.float32)), aligned(np.full((1, D), 5.0, np.float32))
    call(lib, "down", hidden, index, count, down, out)
    np.testing.assert_allclose(out[0], hidden[0, :k] @ down[expected], atol=1e-4)


def test_uncached_rows_rotate(lib):
    """Different weight copies per call (rows not in cache) give the same answers as numpy."""
    rng = np.random.default_rng(1)
    index, count = aligned(np.zeros((1, N), np.int32)), aligned(np.array([[5]], np.int32))
    index[0, :5] = [1, 4, 9, 16, 23]
    x, b = aligned(rng.standard_normal((1, D)).astype(np.float32)), aligned(np.zeros(N, np.float32))
    for _ in range(4):
        w, hidden = aligned(rng.standard_normal((N, D)).astype(np.float32)), aligned(np.zeros((1, N), np.float32))
        call(lib, "up", x, index, count, w, b, hidden)
        np.testing.assert_allclose(hidden[0, :5], np.maximum(w[index[0, :5]] @ x[0], 0), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_prefill_kernels(lib, rows):
    rng = np.random.default_rng(2)
    big = lambda *shape: aligned(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    x, w, b, y = big(8, D), big(N, D), big(N), big(8, N)
    call(lib, "rows", x[:rows], w, b, y[:rows])
    np.testing.assert_allclose(y[:rows], np.maximum(x[:rows] @ w.T + b, 0), atol=1e-4)
    res, p1, p2, bias, out = big(8, D), big(8, D), big(8, D), big(D), big(8, D)
    call(lib, "merge", res[:rows], p1[:rows], p2[:rows], bias, out[:rows])
    np.testing.assert_allclose(out[:rows], (res + p1 + p2 + bias)[:rows], atol=1e-5)


def fired():
    return aligned(np.zeros((1, FN), np.int32))


def fused_reference(x, up, b, down, rows, gated, act):
    """(hidden, out) of a sparse FFN part over the given rows, in float64."""
    x, up, down = x.astype(np.float64), up.astype(np.float64), down.astype(np.float64)
    hidden = ACT[act](up[rows] @ x[0] + b[rows])
    if gated:
        hidden = hidden * (up[FN + rows] @ x[0] + b[FN + rows])
    return hidden, hidden @ down[rows]


@pytest.mark.parametrize("count", [0, 1, 9, FN // 2, FN])  # no neuron, one, some (under a group a task), many, every
@pytest.mark.parametrize("variant", FUSED)
def test_fused_sparse_ffn(lib, variant, count):
    gated, act, dtype = FUSED[variant]
    rng = np.random.default_rng(count)
    x = aligned(rng.standard_normal((1, D)).astype(np.float32))
    up = aligned(rng.standard_normal(((2 if gated else 1) * FN, D)).astype(dtype))
    b = aligned(rng.standard_normal((2 if gated else 1) * FN).astype(np.float32))
    down = aligned(rng.standard_normal((FN, D)).astype(dtype))
    index = aligned(np.zeros((1, FN), np.int32))
    index[0, :count] = np.sort(rng.choice(FN, count, replace=False))
    hidden, scratch = aligned(np.full((1, FN), 99.0, np.float32)), aligned(np.zeros((neuron.FFN_TASKS, D), np.float32))
    out = aligned(np.full((1, D), np.nan, np.float32))
    call(lib, f"ffn_{variant}", x, index, aligned(np.array([[count]], np.int32)), up, b, down, hidden, fired(), scratch, out)
    want_hidden, want_out = fused_reference(x, up, b, down, index[0, :count], gated, act)
    np.testing.assert_allclose(hidden[0, :count], want_hidden, rtol=1e-4, atol=1e-4)
    assert np.all(hidden[0, count:] == 99.0)  # nothing written past the active neurons
    np.testing.assert_allclose(out[0], want_out, rtol=1e-4, atol=1e-4)  # count 0: exactly zero
    if act == "relu" and count > 1:
        assert (want_hidden == 0).any()  # the skipped rows were exercised


def test_fused_sparse_ffn_uncached_rotating_rows(lib):
    """Fresh weight copies and index sets every call (rows never in cache), as in decode."""
    rng = np.random.default_rng(5)
    x = aligned(rng.standard_normal((1, D)).astype(np.float32))
    b = aligned(np.zeros(FN, np.float32))
    scratch = aligned(np.zeros((neuron.FFN_TASKS, D), np.float32))
    for call_number in range(6):
        up, down = (aligned(rng.standard_normal((FN, D)).astype(np.float32)) for _ in range(2))
        count = 3 + 3 * call_number
        index = aligned(np.zeros((1, FN), np.int32))
        index[0, :count] = np.sort(rng.choice(FN, count, replace=False))
        hidden, out = aligned(np.zeros((1, FN), np.float32)), aligned(np.zeros((1, D), np.float32))
        call(lib, "ffn_relu", x, index, aligned(np.array([[count]], np.int32)), up, b, down, hidden, fired(), scratch, out)
        np.testing.assert_allclose(out[0], fused_reference(x, up, b, down, index[0, :count], False, "relu")[1],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 7])
def test_rows_gemm_fp16(lib, rows):
    rng = np.random.default_rng(6)
    x = aligned(rng.standard_normal((8, D)).astype(np.float32))
    w, b = aligned(rng.standard_normal((N, D)).astype(np.float16)), aligned(rng.standard_normal(N).astype(np.float32))
    y = aligned(np.zeros((8, N), np.float32))
    call(lib, "rows_f16", x[:rows], w, b, y[:rows])
    np.testing.assert_allclose(y[:rows], x[:rows] @ w.astype(np.float64).T + b, rtol=1e-4, atol=1e-4)
