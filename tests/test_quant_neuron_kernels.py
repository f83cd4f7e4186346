"""The CPU kernels over block-quantized rows (neuron.sparse_ffn_q, cpu.embed_q) against numpy references built
from quant.dequantize in float64: int8, int4 and int4a, float16 and float32 scales, both CPU instruction sets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron, quant
from passes.targets import CPU_ISAS
from runtime.artifact import cpu_flags
from runtime.dtypes import WEIGHT_FORMATS
from kernel_reference import act_ref, aligned, int8_blocks_ref

N = 37  # neurons: no multiple of 8 (uneven task slices)
FUSED = {  # name: (D, bits, gated, activation, scale dtype); D = 96: 3 blocks (one dot chain, a prefetch a block)
    "int8_relu": (96, "int8", False, "relu", "float16"),
    "int4_relu": (96, "int4", False, "relu", "float32"),
    "int8_gelu": (96, "int8", False, "gelu", "float32"),
    "int8_gated_silu": (96, "int8", True, "silu", "float32"),
    "int4_gated_silu": (96, "int4", True, "silu", "float16"),
    "int4_gated_relu": (96, "int4", True, "relu", "float16"),
    "int4_wide_relu": (256, "int4", False, "relu", "float16"),  # 8 blocks: 4 chains, 4 int4 blocks a line
    "int8_wide_gated_gelu": (256, "int8", True, "gelu", "float16"),  # 2 int8 blocks a line
    "int4a_gated_relu": (128, "int4a", True, "relu", "float32"),  # asymmetric blocks, mins beside the scales: 4 chains
}
INT8_DOT = {  # sparse_ffn_q with int8_dot: (D, bits, gated, activation, scale dtype, dot)
    "int4_relu": (256, "int4", False, "relu", "float16", "madd"),  # zmm: 2 vectors (2 chains); ymm: 4
    "int4_gated_silu": (128, "int4", True, "silu", "float32", "madd"),  # zmm: 1 vector; ymm: 2
    "int4_wide_gated_gelu": (1024, "int4", True, "gelu", "float16", "madd"),  # zmm: 8 vectors, 2 steps of 4 chains
    "int4a_gated_silu": (128, "int4a", True, "silu", "float32", "madd"),
}
INT8_VNNI = {  # AVX512-VNNI only (the avx512vnni ISA)
    "int4_relu": (256, "int4", False, "relu", "float16", "vnni"),
    "int4_gated_silu": (128, "int4", True, "silu", "float32", "vnni"),
    "int8_relu": (192, "int8", False, "relu", "float16", "vnni"),  # int8: 2 blocks a zmm; 3 vectors (1 chain)
    "int8_gated_gelu": (256, "int8", True, "gelu", "float32", "vnni"),
    "int4a_relu": (256, "int4a", False, "relu", "float16", "vnni"),
}
V, MAX_CTX, MAX_ROWS = 50, 20, 8
EMBED = {"int8_pos": (96, "int8", MAX_CTX, "float16"), "int4_pos": (96, "int4", MAX_CTX, "float32"),
         "int4_nopos": (64, "int4", None, "float16"), "int8_nopos": (64, "int8", None, "float32"),
         "int4a_pos": (96, "int4a", MAX_CTX, "float16")}
ROWS = {"d": 1, "p": None}


def fmt(name, sdtype):
    return replace(WEIGHT_FORMATS[name], scale_dtype=sdtype)


def fmt_args(name):
    """A format's kernel arguments, as select-kernels passes them (`Lowering.quant_tag`)."""
    f = WEIGHT_FORMATS[name]
    return {"bits": f.bits, **({"has_min": True} if f.has_min else {})}


@pytest.fixture(scope="module", params=["avx2", "avx512"])  # (avx512vnni: vnni_lib, its int8 dots only)
def lib(request, tmp_path_factory):
    if not set(CPU_ISAS[request.param].features) <= (cpu_flags() or set()):
        pytest.skip(f"this CPU has no {request.param}")  # (its kernels would die of an illegal instruction)
    funcs = [neuron.sparse_ffn_q(f"ffn_{name}", D, N, rows=1, gated=gated, act=act, sdtype=sdtype, **fmt_args(form))
             for name, (D, form, gated, act, sdtype) in FUSED.items()]
    funcs += [cpu.embed_q(f"embed_{name}_{v}", V, D, rows=rows, positions=positions, sdtype=sdtype, **fmt_args(form))
              for name, (D, form, positions, sdtype) in EMBED.items() for v, rows in ROWS.items()]
    funcs += [neuron.sparse_ffn_q(f"ffn8_{name}", D, N, rows=1, gated=gated, act=act, sdtype=sdtype, **fmt_args(form),
                                  int8_dot=dot, tile_panels=CPU_ISAS[request.param].gemm_panels)
              for name, (D, form, gated, act, sdtype, dot) in INT8_DOT.items()]
    path = tmp_path_factory.mktemp(f"quant_{request.param}") / "quant.so"
    cpu.build(funcs, CPU_ISAS[request.param].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


@pytest.fixture(scope="module")
def vnni_lib(tmp_path_factory):
    if not set(CPU_ISAS["avx512vnni"].features) <= (cpu_flags() or set()):
        pytest.skip("this CPU has no AVX512-VNNI")
    funcs = [neuron.sparse_ffn_q(f"ffn8_{name}", D, N, rows=1, gated=gated, act=act, sdtype=sdtype, **fmt_args(form),
                                 int8_dot=dot, tile_panels=CPU_ISAS["avx512"].gemm_panels)
             for name, (D, form, gated, act, sdtype, dot) in INT8_VNNI.items()]
    path = str(tmp_path_factory.mktemp("quant_vnni") / "vnni.so")
    cpu.build(funcs, CPU_ISAS["avx512vnni"].llvm_target(), path)
    return tvm.runtime.load_module(path)


def call(lib, name, *args):
    lib[name](*[tvm_ffi.from_dlpack(a) if isinstance(a, np.ndarray) else a for a in args])


class Dense(np.ndarray):
    """A dequantized float64 matrix, with `magnitude`: what a kernel's sums over it run over, elementwise (|w|;
    int4a's |d q| + |m|: its kernels sum the two parts apart)."""

    magnitude: np.ndarray


def quantized(rng, shape, form, sdtype):
    """(packed q, scales, the `Dense` matrix they stand for) of a random matrix, rows layout (int4a: off-centre,
    so that the mins matter)."""
    w = rng.standard_normal(shape).astype(np.float32) + (0.3 if WEIGHT_FORMATS[form].has_min else 0)
    q, scales, *mins = quant.quantize(w, fmt(form, sdtype), axis=1)
    packed, stored = quant.pack_rows(q, scales, fmt(form, sdtype), *mins)
    dense = quant.dequantize(q, scales, 1, *mins).astype(np.float64).view(Dense)
    dense.magnitude = np.abs(quant.dequantize(q, scales, 1).astype(np.float64)) + (
        np.abs(quant.dequantize(np.ones_like(q), mins[0], 1)) if mins else 0)
    return aligned(packed), aligned(stored), dense


def fused_reference(x, up, b, down, rows, gated, act):
    """(hidden, out) of a sparse FFN part over the given (clamped) rows, in float64, and their magnitudes: what
    the fp32 sums run over, |x| . |w| (+ |b|) for the dot products, and for out the products |h| |down| summed,
    with |h|'s own error (its magnitude) carried through. An fp32 sum's rounding error is bounded relative to its
    magnitude, not to its value: a sum of large terms that cancel (out of a gated GELU, whose |h| reaches tens)
    misses a 1e-4 relative tolerance of the value while exact to 1e-6 of the magnitude."""
    up_abs, down_abs = up.magnitude, down.magnitude
    up, down = np.asarray(up), np.asarray(down)
    pre = up[rows] @ x[0] + b[rows]
    size = up_abs[rows] @ np.abs(x[0]) + np.abs(b[rows])
    hidden, hidden_size = act_ref(pre, act), size
    if gated:
        second = up[N + rows] @ x[0] + b[N + rows]
        second_size = up_abs[N + rows] @ np.abs(x[0]) + np.abs(b[N + rows])
        # d(act(g) u) = act'(g) u dg + act(g) du, |act'| <= 1.13 for relu, silu, gelu: the product's error scale
        hidden_size = 1.13 * size * np.abs(second) + np.abs(act_ref(pre, act)) * second_size
        hidden = hidden * second
    out_size = (np.abs(hidden) + hidden_size) @ down_abs[rows]
    return hidden, hidden @ down[rows], hidden_size, out_size


def check_fused(hidden, out, count, want, tol):
    """The kernel's hidden and out within `tol` of the magnitudes `fused_reference` returns (so count 0's out must
    be exactly 0), and nothing written past the selected neurons."""
    want_hidden, want_out, hidden_size, out_size = want
    assert np.all(np.abs(hidden[0, :count] - want_hidden) <= tol * hidden_size), \
        np.max(np.abs(hidden[0, :count] - want_hidden) / np.maximum(hidden_size, 1e-30), initial=0)
    assert np.all(hidden[0, count:] == 99.0)
    assert np.all(np.abs(out[0] - want_out) <= tol * out_size), \
        np.max(np.abs(out[0] - want_out) / np.maximum(out_size, 1e-30), initial=0)


def run_fused(lib, kernel, D, form, gated, sdtype, count, messy):
    """Random weights and inputs through `kernel`: (x, dequantized up, b, down, rows, hidden, out)."""
    rng = np.random.default_rng(count + 100 * messy)
    x = aligned(rng.standard_normal((1, D)).astype(np.float32))
    up_q, up_s, up = quantized(rng, ((2 if gated else 1) * N, D), form, sdtype)
    down_q, down_s, down = quantized(rng, (N, D), form, sdtype)
    b = aligned(rng.standard_normal((2 if gated else 1) * N).astype(np.float32))
    index = indices(rng, count, messy)
    hidden, scratch = aligned(np.full((1, N), 99.0, np.float32)), aligned(np.zeros((neuron.FFN_TASKS, D), np.float32))
    fired, out = aligned(np.zeros((1, N), np.int32)), aligned(np.full((1, D), np.nan, np.float32))
    call(lib, kernel, x, index, aligned(np.array([[count]], np.int32)), up_q, up_s, b, down_q, down_s,
         hidden, fired, scratch, out)
    return x, up, b, down, np.clip(index[0, :count], 0, N - 1), hidden, out


def indices(rng, count, messy):
    """count sorted distinct neurons; with `messy`, duplicates and out-of-range entries (the kernel clamps)."""
    index = aligned(np.zeros((1, N), np.int32))
    index[0, :count] = np.sort(rng.choice(N, count, replace=False))
    if messy and count > 3:
        index[0, 1] = index[0, 0]
        index[0, 2], index[0, 3] = -5, N + 100
    return index


COUNTS = [(0, False), (1, False), (17, False), (17, True), (N, False)]


@pytest.mark.parametrize("count,messy", COUNTS)
@pytest.mark.parametrize("variant", FUSED)
def test_sparse_ffn_q(lib, variant, count, messy):
    """fp32 arithmetic: within 1e-6 of the sums' magnitudes (D <= 256 terms of rounding 6e-8 each: ~sqrt(D) eps)."""
    D, form, gated, act, sdtype = FUSED[variant]
    x, up, b, down, rows, hidden, out = run_fused(lib, f"ffn_{variant}", D, form, gated, sdtype, count, messy)
    want = fused_reference(x.astype(np.float64), up, b, down, rows, gated, act)
    check_fused(hidden, out, count, want, 1e-6)
    if act == "relu" and count > 1:
        assert (want[0] == 0).any()  # the skipped rows were exercised


def check_int8_dot(lib, table, variant, count, messy):
    """Against x quantized as the kernel does (int8_blocks_ref): the integer sums are exact, the rest fp32, so
    within 1e-6 of the magnitudes (D <= 1024); and within int8 x's error (3e-2 of them) of the float64 x."""
    D, form, gated, act, sdtype, _ = table[variant]
    x, up, b, down, rows, hidden, out = run_fused(lib, f"ffn8_{variant}", D, form, gated, sdtype, count, messy)
    check_fused(hidden, out, count, fused_reference(int8_blocks_ref(x), up, b, down, rows, gated, act), 1e-6)
    check_fused(hidden, out, count, fused_reference(x.astype(np.float64), up, b, down, rows, gated, act), 3e-2)


@pytest.mark.parametrize("count,messy", COUNTS)
@pytest.mark.parametrize("variant", INT8_DOT)
def test_sparse_ffn_q_int8_dot(lib, variant, count, messy):
    """int8_dot="madd": zmm (vpmaddubsw 512) under avx512, ymm under avx2."""
    check_int8_dot(lib, INT8_DOT, variant, count, messy)


@pytest.mark.parametrize("count,messy", COUNTS)
@pytest.mark.parametrize("variant", INT8_VNNI)
def test_sparse_ffn_q_int8_dot_vnni(vnni_lib, variant, count, messy):
    check_int8_dot(vnni_lib, INT8_VNNI, variant, count, messy)


def test_sparse_ffn_q_int8_dot_refusals():
    with pytest.raises(ValueError):  # int8 rows: vnni only
        neuron.sparse_ffn_q("k", 256, N, rows=1, gated=False, act="relu", bits=8, int8_dot="madd", tile_panels=2)
    with pytest.raises(ValueError):  # 96 int4 weights: 48 bytes, no whole zmm
        neuron.sparse_ffn_q("k", 96, N, rows=1, gated=False, act="relu", bits=4, int8_dot="madd", tile_panels=2)
    with pytest.raises(ValueError):  # no ymm vnni
        neuron.sparse_ffn_q("k", 256, N, rows=1, gated=False, act="relu", bits=4, int8_dot="vnni", tile_panels=1)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 1), ("p", 7)])
@pytest.mark.parametrize("table", EMBED)
def test_embed_q(lib, table, variant, m, start):
    D, form, positions, sdtype = EMBED[table]
    rng = np.random.default_rng(4 + start)
    ids = aligned(rng.integers(0, V, MAX_ROWS).astype(np.int64))
    ids[1] = V + 3  # out of range: clamped to the last row
    q, scales, dense = quantized(rng, (V, D), form, sdtype)
    y = aligned(np.full((MAX_ROWS, D), np.nan, np.float32))
    want = dense[np.clip(ids[:m], 0, V - 1)]
    if positions:
        pos = aligned(rng.standard_normal((positions, D)).astype(np.float32))
        call(lib, f"embed_{table}_{variant}", ids[:m], q, scales, pos, start, y[:m])
        want = want + pos[start:start + m]
    else:
        call(lib, f"embed_{table}_{variant}", ids[:m], q, scales, y[:m])
    np.testing.assert_allclose(y[:m], np.asarray(want), rtol=1e-6, atol=1e-6)
