"""The CPU kernels over block-quantized rows (neuron.sparse_ffn_q, cpu.embed_q) against numpy references built
from quant.dequantize in float64: int8 and int4, float16 and float32 scales, both CPU instruction sets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron, quant
from picompile.targets import CPU_ISAS
from runtime.dtypes import WEIGHT_FORMATS
from kernel_reference import act_ref, aligned

N = 37  # neurons: no multiple of 8 (uneven task slices)
FUSED = {  # name: (D, bits, gated, activation, scale dtype); D = 96: 3 blocks (one dot chain, a prefetch a block)
    "int8_relu": (96, 8, False, "relu", "float16"),
    "int4_relu": (96, 4, False, "relu", "float32"),
    "int8_gelu": (96, 8, False, "gelu", "float32"),
    "int8_gated_silu": (96, 8, True, "silu", "float32"),
    "int4_gated_silu": (96, 4, True, "silu", "float16"),
    "int4_gated_relu": (96, 4, True, "relu", "float16"),
    "int4_wide_relu": (256, 4, False, "relu", "float16"),  # 8 blocks: 4 chains, 4 int4 blocks a line
    "int8_wide_gated_gelu": (256, 8, True, "gelu", "float16"),  # 2 int8 blocks a line
}
V, MAX_CTX, MAX_ROWS = 50, 20, 8
EMBED = {"int8_pos": (96, 8, MAX_CTX, "float16"), "int4_pos": (96, 4, MAX_CTX, "float32"),
         "int4_nopos": (64, 4, None, "float16"), "int8_nopos": (64, 8, None, "float32")}
ROWS = {"d": 1, "p": None}


def fmt(bits, sdtype):
    return replace(WEIGHT_FORMATS["int8" if bits == 8 else "int4"], scale_dtype=sdtype)


@pytest.fixture(scope="module", params=sorted(CPU_ISAS))
def lib(request, tmp_path_factory):
    funcs = [neuron.sparse_ffn_q(f"ffn_{name}", D, N, rows=1, gated=gated, act=act, bits=bits, sdtype=sdtype)
             for name, (D, bits, gated, act, sdtype) in FUSED.items()]
    funcs += [cpu.embed_q(f"embed_{name}_{v}", V, D, rows=rows, positions=positions, bits=bits, sdtype=sdtype)
              for name, (D, bits, positions, sdtype) in EMBED.items() for v, rows in ROWS.items()]
    path = tmp_path_factory.mktemp(f"quant_{request.param}") / "quant.so"
    cpu.build(funcs, CPU_ISAS[request.param].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *args):
    lib[name](*[tvm_ffi.from_dlpack(a) if isinstance(a, np.ndarray) else a for a in args])


def quantized(rng, shape, bits, sdtype):
    """(packed q, scales, the float64 matrix they stand for) of a random matrix, rows layout."""
    w = rng.standard_normal(shape).astype(np.float32)
    q, scales = quant.quantize(w, fmt(bits, sdtype), axis=1)
    packed, scales = quant.pack_rows(q, scales, fmt(bits, sdtype))
    return aligned(packed), aligned(scales), quant.dequantize(q, scales, axis=1).astype(np.float64)


def fused_reference(x, up, b, down, rows, gated, act):
    """(hidden, out) of a sparse FFN part over the given (clamped) rows, in float64."""
    hidden = act_ref(up[rows] @ x[0] + b[rows], act)
    if gated:
        hidden = hidden * (up[N + rows] @ x[0] + b[N + rows])
    return hidden, hidden @ down[rows]


def indices(rng, count, messy):
    """count sorted distinct neurons; with `messy`, duplicates and out-of-range entries (the kernel clamps)."""
    index = aligned(np.zeros((1, N), np.int32))
    index[0, :count] = np.sort(rng.choice(N, count, replace=False))
    if messy and count > 3:
        index[0, 1] = index[0, 0]
        index[0, 2], index[0, 3] = -5, N + 100
    return index


@pytest.mark.parametrize("count,messy", [(0, False), (1, False), (17, False), (17, True), (N, False)])
@pytest.mark.parametrize("variant", FUSED)
def test_sparse_ffn_q(lib, variant, count, messy):
    D, bits, gated, act, sdtype = FUSED[variant]
    rng = np.random.default_rng(count + 100 * messy)
    x = aligned(rng.standard_normal((1, D)).astype(np.float32))
    up_q, up_s, up = quantized(rng, ((2 if gated else 1) * N, D), bits, sdtype)
    down_q, down_s, down = quantized(rng, (N, D), bits, sdtype)
    b = aligned(rng.standard_normal((2 if gated else 1) * N).astype(np.float32))
    index = indices(rng, count, messy)
    hidden, scratch = aligned(np.full((1, N), 99.0, np.float32)), aligned(np.zeros((neuron.FFN_TASKS, D), np.float32))
    fired, out = aligned(np.zeros((1, N), np.int32)), aligned(np.full((1, D), np.nan, np.float32))
    call(lib, f"ffn_{variant}", x, index, aligned(np.array([[count]], np.int32)), up_q, up_s, b, down_q, down_s,
         hidden, fired, scratch, out)
    rows = np.clip(index[0, :count], 0, N - 1)
    want_hidden, want_out = fused_reference(x.astype(np.float64), up, b, down, rows, gated, act)
    np.testing.assert_allclose(hidden[0, :count], want_hidden, rtol=1e-4, atol=1e-4)
    assert np.all(hidden[0, count:] == 99.0)  # nothing written past the selected neurons
    np.testing.assert_allclose(out[0], want_out, rtol=1e-4, atol=1e-4)  # count 0: exactly zero
    if act == "relu" and count > 1:
        assert (want_hidden == 0).any()  # the skipped rows were exercised


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 1), ("p", 7)])
@pytest.mark.parametrize("table", EMBED)
def test_embed_q(lib, table, variant, m, start):
    D, bits, positions, sdtype = EMBED[table]
    rng = np.random.default_rng(4 + start)
    ids = aligned(rng.integers(0, V, MAX_ROWS).astype(np.int64))
    ids[1] = V + 3  # out of range: clamped to the last row
    q, scales, dense = quantized(rng, (V, D), bits, sdtype)
    y = aligned(np.full((MAX_ROWS, D), np.nan, np.float32))
    want = dense[np.clip(ids[:m], 0, V - 1)]
    if positions:
        pos = aligned(rng.standard_normal((positions, D)).astype(np.float32))
        call(lib, f"embed_{table}_{variant}", ids[:m], q, scales, pos, start, y[:m])
        want = want + pos[start:start + m]
    else:
        call(lib, f"embed_{table}_{variant}", ids[:m], q, scales, y[:m])
    np.testing.assert_allclose(y[:m], want, rtol=1e-6, atol=1e-6)
