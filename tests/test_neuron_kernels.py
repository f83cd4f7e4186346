"""The neuron-aware kernels (passes/kernels/neuron.py) against numpy: empty, partial and full index sets."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron
from runtime.artifact import aligned_empty

D, N = 36, 24  # odd sizes: 4-lane vectors, no multiple of 8


def aligned(array):
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select", N, rows=1),
             neuron.sparse_up("up", D, N, rows=1, gated=False, act="relu"),
             neuron.sparse_up("up_gated", D, N, rows=1, gated=True, act="silu"),
             neuron.sparse_down("down", N, D, rows=1),
             neuron.merge("merge", D, 2, rows=None, bias=True, residual=True),
             neuron.linear_rows("rows", D, N, rows=None, act="relu")]
    path = tmp_path_factory.mktemp("neuron") / "neuron.so"
    cpu.build(funcs, cpu.CPU_TARGET, str(path))
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
