"""Threshold sparsity over quantized weights and attention inputs: the column-sparse kernel over quantized rows
(neuron.sparse_columns_q: int8, int4 and int4a, fp16 and fp32 scales, decode and batch, bias, GLU and residual
epilogues) against numpy, and tiny SwiGLU builds whose thresholded matrices are quantized, whose attention
inputs are thresholded, and whose FFNs mix dense and sparse projections, against a numpy reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron, quant
from picompile.targets import CPU_ISAS
from runtime.dtypes import WEIGHT_FORMATS
from kernel_reference import aligned

K, N, BATCH = 40, 128, 3  # K input channels (no multiple of the row group), N = 4 blocks (gated: 2 a half)
ACT = {"none": lambda v: v, "silu": lambda v: v / (1 + np.exp(-v))}
QUANT_COLUMNS = {  # name -> (format, scale dtype, gated, act, bias, residual, rows)
    "int8_plain": ("int8", "float16", False, "none", False, False, 1),
    "int8_gated_silu_bias": ("int8", "float32", True, "silu", True, False, 1),
    "int4_residual_bias": ("int4", "float16", False, "none", True, True, 1),
    "int4_gated_silu": ("int4", "float32", True, "silu", False, False, 1),
    "int4a_gated_silu": ("int4a", "float16", True, "silu", False, False, 1),
    "int4a_residual": ("int4a", "float32", False, "none", False, True, 1),
    "int4_gated_silu_batch": ("int4", "float16", True, "silu", False, False, None),
    "int4a_residual_batch": ("int4a", "float16", False, "none", True, True, None),
    "int8_batch": ("int8", "float32", False, "none", False, False, None),
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select_abs", K, rows=1, magnitude=True),
             neuron.sparse_columns("f32_residual", K, N, rows=1, residual=True, bias=True)]
    for name, (fmt, sdtype, gated, act, bias, residual, rows) in QUANT_COLUMNS.items():
        f = WEIGHT_FORMATS[fmt]
        funcs.append(neuron.sparse_columns_q(name, K, N, rows=rows, bits=f.bits, sdtype=sdtype, has_min=f.has_min,
                                             gated=gated, act=act, bias=bias, residual=residual,
                                             max_batch=BATCH if rows is None else 1))
    path = tmp_path_factory.mktemp("threshold-quant") / "kernels.so"
    cpu.build(funcs, CPU_ISAS["avx2"].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *arrays):
    lib[name](*[tvm_ffi.from_dlpack(a) for a in arrays])


def selected(lib, x, threshold):
    """select_abs over the union of x's rows (one row at a time, as the union is what a batch step selects)."""
    index, count = aligned(np.full((1, K), -7, np.int32)), aligned(np.full((1, 1), -7, np.int32))
    union = np.abs(x).max(axis=0, keepdims=True).astype(np.float32)
    call(lib, "select_abs", aligned(union), aligned(np.array([threshold], np.float32)), index, count)
    kept = np.nonzero(union[0] > threshold)[0]
    assert int(count[0, 0]) == len(kept) and np.array_equal(index[0, :len(kept)], kept)
    return index, count, kept


@pytest.mark.parametrize("threshold", [np.inf, 0.7, -1.0])  # no channel kept, some, every one
@pytest.mark.parametrize("kernel", sorted(QUANT_COLUMNS))
def test_column_sparse_gemv_over_quantized_rows(lib, kernel, threshold):
    fmt_name, sdtype, gated, act, bias, residual, rows = QUANT_COLUMNS[kernel]
    fmt = replace(WEIGHT_FORMATS[fmt_name], scale_dtype=sdtype)
    rng = np.random.default_rng(3)
    m = BATCH if rows is None else 1
    out = N // 2 if gated else N
    x = aligned(rng.standard_normal((m, K)).astype(np.float32))
    index, count, kept = selected(lib, x, min(threshold, 3e38))
    w = rng.standard_normal((K, N)).astype(np.float32) + (0.3 if fmt.has_min else 0)  # (mins away from 0)
    q, scales, *mins = quant.quantize(w, fmt, axis=1)
    values, packed_scales = quant.pack_rows(q, scales, fmt, *mins)
    w_stored = quant.dequantize(q, scales, 1, *mins).astype(np.float64)
    b = aligned(rng.standard_normal(N).astype(np.float32))
    res = aligned(rng.standard_normal((m, out)).astype(np.float32))
    scratch = aligned(np.full((neuron.COLUMN_TASKS, BATCH * N if rows is None else N), 5.0, np.float32))
    y = aligned(np.full((m, out), 99.0, np.float32))
    call(lib, kernel, x, index, count, aligned(values), aligned(packed_scales), *([b] if bias else []),
         *([res] if residual else []), scratch, y)
    pre = x[:, kept].astype(np.float64) @ w_stored[kept] + (b if bias else 0)  # the union's rows, each row's x
    actf = ACT[act]
    expected = actf(pre[:, :out]) * pre[:, out:] if gated else actf(pre)
    expected = expected + (res if residual else 0)
    np.testing.assert_allclose(y, expected, atol=2e-4 * max(1.0, np.abs(expected).max()), rtol=1e-4)


def test_column_sparse_gemv_residual_epilogue_over_floats(lib):
    rng = np.random.default_rng(4)
    x = aligned(rng.standard_normal((1, K)).astype(np.float32))
    index, count, kept = selected(lib, x, 0.5)
    w, b = aligned(rng.standard_normal((K, N)).astype(np.float32)), aligned(rng.standard_normal(N).astype(np.float32))
    res = aligned(rng.standard_normal((1, N)).astype(np.float32))
    y = aligned(np.zeros((1, N), np.float32))
    call(lib, "f32_residual", x, index, count, w, b, res, aligned(np.zeros((neuron.COLUMN_TASKS, N), np.float32)), y)
    np.testing.assert_allclose(y[0], x[0, kept] @ w[kept] + b + res[0], atol=1e-4, rtol=1e-5)
