"""Threshold sparsity (TEAL-style) for SiLU/GELU FFNs: the kernels against numpy, the calibration, the
mode choice, and tiny LLaMA-SwiGLU builds against onnxruntime (sparsity 0) and against a torch model
thresholded the same way (sparsity 0.5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron
from passes.threshold import calibrate, hidden_of
from runtime.artifact import aligned_empty

K, N = 40, 48  # K rows (input channels), N columns: gated -> 24 outputs; 40 is no multiple of the row group
ACT = {"none": lambda v: v, "silu": lambda v: v / (1 + np.exp(-v))}
COLUMN_KERNELS = {  # name -> (gated, act, bias, weight dtype)
    "cols": (False, "none", False, "float32"),
    "cols_gated_silu": (True, "silu", False, "float32"),
    "cols_gated_silu_f16": (True, "silu", False, "float16"),
    "cols_relu_bias_f16": (False, "relu", True, "float16"),
}


def aligned(array):
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select_abs", K, rows=1, magnitude=True)]
    funcs += [neuron.sparse_columns(name, K, N, rows=1, gated=gated, act=act, bias=bias, wdtype=dtype)
              for name, (gated, act, bias, dtype) in COLUMN_KERNELS.items()]
    path = tmp_path_factory.mktemp("threshold") / "threshold.so"
    cpu.build(funcs, cpu.CPU_TARGET, str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *arrays):
    lib[name](*[tvm_ffi.from_dlpack(a) for a in arrays])


@pytest.mark.parametrize("threshold", [np.inf, 0.7, -1.0])  # no channel passes, some, every one
@pytest.mark.parametrize("kernel", sorted(COLUMN_KERNELS))
def test_select_and_column_sparse_gemv(lib, threshold, kernel):
    gated, act, bias, dtype = COLUMN_KERNELS[kernel]
    rng = np.random.default_rng(1)
    x = aligned(rng.standard_normal((1, K)).astype(np.float32))
    index, count = aligned(np.full((1, K), -7, np.int32)), aligned(np.full((1, 1), -7, np.int32))
    call(lib, "select_abs", x, aligned(np.array([min(threshold, 3e38)], np.float32)), index, count)
    kept = np.nonzero(np.abs(x[0]) > threshold)[0]
    k = int(count[0, 0])
    assert k == len(kept) and np.array_equal(index[0, :k], kept)

    w = aligned(rng.standard_normal((K, N)).astype(dtype))
    b = aligned(rng.standard_normal(N).astype(np.float32))
    scratch = aligned(np.full((neuron.COLUMN_TASKS, N), 5.0, np.float32))  # stale partial sums must not leak
    y = aligned(np.full((1, N // 2 if gated else N), 99.0, np.float32))
    call(lib, kernel, x, index, count, w, *([b] if bias else []), scratch, y)
    pre = x[0, kept] @ w[kept].astype(np.float32) + (b if bias else 0)  # only the kept rows count
    actf = ACT.get(act, lambda v: np.maximum(v, 0))
    expected = actf(pre[: N // 2]) * pre[N // 2:] if gated else actf(pre)
    np.testing.assert_allclose(y[0], expected, atol=1e-4, rtol=1e-5)


def test_calibration_reaches_the_sparsity_on_held_out_tokens():
    """Thresholds fitted on some tokens drop the asked share of the inputs of other tokens, for gate/up and down."""
    rng = np.random.default_rng(0)
    tokens, d, f = 4000, 32, 96
    scale = np.exp(rng.standard_normal(d)).astype(np.float32)  # channels of very different magnitudes
    x = (rng.standard_normal((tokens, d)) * scale).astype(np.float32)
    w_up = (rng.standard_normal((d, 2 * f)) * 0.2).astype(np.float32)
    for sparsity in (0.25, 0.5):
        c = calibrate(x, w_up, None, "silu", True, sparsity)
        assert abs(c.sparsity_in - sparsity) < 0.02 and abs(c.sparsity_down - sparsity) < 0.02, (sparsity, c)
        # independent check on fresh tokens from the same distribution
        fresh = (rng.standard_normal((2000, d)) * scale).astype(np.float32)
        assert abs(np.mean(np.abs(fresh) <= c.threshold_in) - sparsity) < 0.02
        h = hidden_of(np.where(np.abs(fresh) > c.threshold_in, fresh, 0), w_up, None, "silu", True)
        assert abs(np.mean(np.abs(h) <= c.threshold_down) - sparsity) < 0.02
    zero = calibrate(x, w_up, None, "silu", True, 0.0)
    assert zero.sparsity_in == 0.0 and zero.sparsity_down == 0.0
