"""Tests of the CPU kernels over block-quantized weights (passes/kernels/quant.py) against numpy references.

References are float64 products with `quant.dequantize`'s matrix, so they test the kernels' arithmetic and
their reading of the layouts (pack_panels, pack_rows), not the quantization error. The kernels are built once
per CPU ISA (module fixture; the AVX-512 one runs only where the CPU has it) and called as the runtime calls
them (64-byte aligned arrays, prefill rows as slices buf[:m] of taller buffers; see test_kernels).
"""

import numpy as np
import pytest
import tvm

from kernel_reference import act_ref, close, int8_blocks_ref, kname
from passes.kernels import cpu, ops, quant
from picompile.targets import CPU_ISAS
from runtime.artifact import cpu_flags
from runtime.dtypes import WEIGHT_FORMATS
from test_kernels import MAX_ROWS, aligned, call, rand, rows_buf

BITS = (8, 4)
VARIANTS = [("d", 1), ("p", 1), ("p", 3), ("p", 7)]
PREFILL = [("p", 1), ("p", 3), ("p", 7)]
ROWS = {"d": 1, "p": None}

PANELS = {  # name: (K, N, bias, act, residual, sdtype, tile_panels)
    "plain": (32, 40, False, "none", False, "float16", 1),  # one block, a padded last panel
    "gelu": (96, 72, True, "gelu", True, "float16", 1),  # three blocks
    "f32": (96, 40, True, "relu", False, "float32", 1),  # float32 scales
    "wide": (64, 96, True, "none", True, "float16", 2),  # the AVX-512 GEMM tile (two panels)
    "group4": (64, 500, True, "silu", True, "float16", 2),  # decode: 4 panels per task, padded columns
    "group2": (32, 256, False, "none", False, "float32", 2),  # decode: 2 panels per task, no padding
    "budget1": (32, 512, True, "none", False, "float16", 1),  # AVX2's budget: int8 2 panels per task, int4 1
}
ROWS_Q = {  # up rows [N, K]: (K, N, act, sdtype, tile_panels)
    "relu": (96, 40, "relu", "float16", 1),
    "f32": (32, 72, "none", "float32", 2),
}
X8 = {  # int4 decode with int8 activations: (K, N, bias, act, residual, sdtype)
    "gelu": (96, 72, True, "gelu", True, "float16"),
    "group4": (64, 500, True, "silu", True, "float16"),
    "f32": (32, 256, False, "none", False, "float32"),
    "group8": (32, 1020, True, "relu", False, "float16"),  # 64 panels: int8 with VNNI 8 a task, int4 4; padded
}
KN_Q = {  # down rows [K, N]: (K, N, bias, act, residual, sdtype, tile_panels, skip_zero_rows)
    "plain": (40, 96, False, "none", False, "float16", 2, False),
    "res": (24, 32, True, "gelu", True, "float32", 1, False),
    "skip": (72, 64, False, "none", True, "float16", 2, True),  # x a ReLU's output: its zero columns' rows unread
    "skip_avx2": (40, 96, True, "none", False, "float32", 1, True),
}


def _fmt(bits):
    return WEIGHT_FORMATS[f"int{bits}"]


def x8_kernels(dot, isa, bits=4):
    """int8-activation kernels: decode GEMVs ("d"), and on AVX-512 prefill GEMMs ("p")."""
    tile = CPU_ISAS[isa].gemm_panels
    return [ops.linear_panels_q.cpu(kname(f"x8{dot}{bits}", cfg, v), K, N, rows=rows, bits=bits, sdtype=sdtype,
                                    bias=bias, act=act, residual=res, int8_dot=dot, tile_panels=tile)
            for cfg, (K, N, bias, act, res, sdtype) in X8.items() for v, rows in ROWS.items() if v == "d" or tile > 1]


def all_kernels(isa):
    funcs = x8_kernels("madd", isa)
    for bits in BITS:
        for cfg, (K, N, bias, act, res, sdtype, tp) in PANELS.items():
            for v, rows in ROWS.items():
                funcs.append(ops.linear_panels_q.cpu(kname(f"panels{bits}", cfg, v), K, N, rows=rows, bits=bits,
                                                     sdtype=sdtype, bias=bias, act=act, residual=res, tile_panels=tp))
        for cfg, (K, N, act, sdtype, tp) in ROWS_Q.items():
            funcs.append(ops.linear_rows_q.cpu(kname(f"rows{bits}", cfg, "p"), K, N, rows=None, bits=bits,
                                               sdtype=sdtype, act=act, tile_panels=tp))
        for cfg, (K, N, bias, act, res, sdtype, tp, skip) in KN_Q.items():
            funcs.append(ops.linear_kn_q.cpu(kname(f"kn{bits}", cfg, "p"), K, N, rows=None, bits=bits, sdtype=sdtype,
                                             bias=bias, act=act, residual=res, tile_panels=tp, skip_zero_rows=skip))
    return funcs


@pytest.fixture(scope="module", params=["avx2", "avx512"])  # (avx512vnni: vnni_lib, its int8 dots only)
def lib(request, tmp_path_factory):
    isa = CPU_ISAS[request.param]
    if not set(isa.features) <= (cpu_flags() or set()):
        pytest.skip(f"this CPU has no {isa.name}")
    path = str(tmp_path_factory.mktemp("quant") / f"{isa.name}.so")
    cpu.build(all_kernels(isa.name), isa.llvm_target(), path)
    return tvm.runtime.load_module(path)


@pytest.fixture(scope="module")
def vnni_lib(tmp_path_factory):
    if not set(CPU_ISAS["avx512vnni"].features) <= (cpu_flags() or set()):
        pytest.skip("this CPU has no AVX512-VNNI")
    path = str(tmp_path_factory.mktemp("quant") / "vnni.so")
    cpu.build(x8_kernels("vnni", "avx512") + x8_kernels("vnni", "avx512", bits=8), CPU_ISAS["avx512vnni"].llvm_target(),
              path)
    return tvm.runtime.load_module(path)


def quantized(rng, shape, bits, axis, sdtype):
    """A random matrix's (q, scales) along `axis` (the scales in `sdtype`) and its dequantized float64 matrix."""
    fmt = _fmt(bits)
    q, s = quant.quantize(rng.standard_normal(shape) * 0.5, fmt, axis=axis)
    s = s.astype(sdtype)
    return q, s, quant.dequantize(q, s, axis).astype(np.float64)


def expected(x, w, b, r, act):
    ref = x.astype(np.float64) @ w + (0 if b is None else b)
    return act_ref(ref, act) + (0 if r is None else r)


def run(lib, name, x, weights, bias, res, N, m, rng):
    b = rand(rng, N) if bias else None
    _, r = rows_buf(rng, m, N) if res else (None, None)
    _, y = rows_buf(rng, m, N)
    call(lib, name, *([x] + [aligned(a) for a in weights] + [a for a in (b, r) if a is not None] + [y]))
    return y, b, r


def test_interface():
    f = quant.linear_panels_q("q", 64, 40, rows=1, bits=4, bias=True, act="gelu", residual=True)
    assert [p.name for p in f.params] == ["x", "w", "ws", "b", "res", "y"]
    g = quant.linear_panels_q("q", 64, 40, rows=None, bits=8, bias=False)
    assert [p.name for p in g.params] == ["x", "w", "ws", "y"]
    assert [p.name for p in quant.linear_rows_q("q", 64, 40, rows=None, bits=4).params] == ["x", "w", "ws", "b", "y"]
    with pytest.raises(ValueError):
        quant.linear_panels_q("q", 40, 40, rows=1, bits=4, bias=False)  # K not whole blocks
    with pytest.raises(ValueError):
        quant.linear_kn_q("q", 40, 40, rows=None, bits=4, bias=False)  # N not whole blocks
    with pytest.raises(ValueError):
        quant.linear_rows_q("q", 64, 40, rows=1, bits=4)  # prefill only
    with pytest.raises(ValueError):
        quant.linear_panels_q("q", 64, 40, rows=1, bits=3, bias=False)
    with pytest.raises(ValueError):  # VNNI in zmm only
        quant.linear_panels_q("q", 64, 40, rows=1, bits=4, bias=False, int8_dot="vnni", tile_panels=1)
    with pytest.raises(ValueError):  # int8 weights: VNNI only
        quant.linear_panels_q("q", 64, 40, rows=1, bits=8, bias=False, int8_dot="madd", tile_panels=2)


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("cfg", PANELS)
@pytest.mark.parametrize("bits", BITS)
def test_linear_panels_q(lib, bits, cfg, variant, m):
    K, N, bias, act, res, sdtype, _ = PANELS[cfg]
    rng = np.random.default_rng(bits)
    q, s, w = quantized(rng, (K, N), bits, 0, sdtype)
    _, x = rows_buf(rng, m, K, scale=0.5)
    y, b, r = run(lib, kname(f"panels{bits}", cfg, variant), x, quant.pack_panels(q, s, _fmt(bits)), bias, res, N, m,
                  rng)
    close(y, expected(x, w, b, r, act))


@pytest.mark.parametrize("variant,m", PREFILL)
@pytest.mark.parametrize("cfg", ROWS_Q)
@pytest.mark.parametrize("bits", BITS)
def test_linear_rows_q(lib, bits, cfg, variant, m):
    K, N, act, sdtype, _ = ROWS_Q[cfg]
    rng = np.random.default_rng(10 + bits)
    q, s, w = quantized(rng, (N, K), bits, 1, sdtype)  # one row per output neuron, blocks along K
    _, x = rows_buf(rng, m, K, scale=0.5)
    y, b, _ = run(lib, kname(f"rows{bits}", cfg, variant), x, quant.pack_rows(q, s, _fmt(bits)), True, False, N, m, rng)
    close(y, expected(x, w.T, b, None, act))


@pytest.mark.parametrize("variant,m", PREFILL)
@pytest.mark.parametrize("cfg", KN_Q)
@pytest.mark.parametrize("bits", BITS)
def test_linear_kn_q(lib, bits, cfg, variant, m):
    K, N, bias, act, res, sdtype, _, skip = KN_Q[cfg]
    rng = np.random.default_rng(20 + bits)
    q, s, w = quantized(rng, (K, N), bits, 1, sdtype)  # one row per reduction index, blocks along N
    _, x = rows_buf(rng, m, K, scale=0.5)
    if skip:  # a ReLU's output, two thirds of its columns zero in every row
        x[...] = np.maximum(x, 0) * (np.arange(K) % 3 == 0)
    y, b, r = run(lib, kname(f"kn{bits}", cfg, variant), x, quant.pack_rows(q, s, _fmt(bits)), bias, res, N, m, rng)
    close(y, expected(x, w, b, r, act))


def test_rows_untouched(lib):
    """Prefill writes rows [0, m) of its output and nothing past them (the runtime passes slices)."""
    K, N, bias, act, res, sdtype, _ = PANELS["gelu"]
    rng = np.random.default_rng(5)
    q, s, _ = quantized(rng, (K, N), 4, 0, sdtype)
    xs, x = rows_buf(rng, 3, K)
    ys, y = rows_buf(rng, 3, N)
    before = ys[3:].copy()
    call(lib, kname("panels4", "gelu", "p"), x, *[aligned(a) for a in quant.pack_panels(q, s, _fmt(4))], rand(rng, N),
         rows_buf(rng, 3, N)[1], y)
    np.testing.assert_array_equal(ys[3:], before)
    assert ys.shape[0] == MAX_ROWS


def x8_reference(x, w):
    """x quantized as the kernel does (per 32-block, scale max|x| / 127, fp32) times the dequantized matrix."""
    return int8_blocks_ref(x, quant.QUANT_BLOCK) @ w


def check_int8_activations(lib, dot, cfg, bits=4, variant="d", m=1):
    K, N, bias, act, res, sdtype = X8[cfg]
    rng = np.random.default_rng(30)
    q, s, w = quantized(rng, (K, N), bits, 0, sdtype)
    _, x = rows_buf(rng, m, K, scale=0.5)
    y, b, r = run(lib, kname(f"x8{dot}{bits}", cfg, variant), x, quant.pack_panels(q, s, _fmt(bits)), bias, res, N,
                  m, rng)
    pre = x8_reference(x, w) + (0 if b is None else b)
    close(y, act_ref(pre, act) + (0 if r is None else r))
    exact = expected(x, w, b, r, act)
    assert np.abs(y - exact).max() <= 2e-2 * np.abs(exact).max()


@pytest.mark.parametrize("cfg", X8)
def test_int8_activations_madd(lib, cfg):
    """int4 decode with int8 activations (vpmaddubsw; zmm under AVX-512's budget, ymm under AVX2's): exact
    against x quantized the same way, and within int8's error of the float product."""
    check_int8_activations(lib, "madd", cfg)


@pytest.mark.parametrize("cfg", X8)
def test_int8_activations_vnni(vnni_lib, cfg):
    check_int8_activations(vnni_lib, "vnni", cfg)


PREFILL_ROWS = [1, 5, 9]  # int8-activation prefill GEMMs: partial and whole 4-row register tiles


@pytest.mark.parametrize("m", PREFILL_ROWS)
@pytest.mark.parametrize("cfg", X8)
def test_int8_activation_prefill_gemm_madd(lib, cfg, m):
    """Prompts' GEMMs over int4 panels with each row of x rounded to int8 blocks (vpmaddubsw, AVX-512's zmm
    only: the AVX2 module has none): exact against x quantized the same way, over odd row counts and padded
    panels."""
    if not lib.implements_function(kname("x8madd4", cfg, "p")):
        pytest.skip("no int8-activation prefill GEMM on AVX2")
    check_int8_activations(lib, "madd", cfg, variant="p", m=m)


@pytest.mark.parametrize("m", PREFILL_ROWS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("cfg", X8)
def test_int8_activation_prefill_gemm_vnni(vnni_lib, cfg, bits, m):
    """The same with vpdpbusd, over int4 and int8 panels."""
    check_int8_activations(vnni_lib, "vnni", cfg, bits=bits, variant="p", m=m)


@pytest.mark.parametrize("cfg", X8)
def test_int8_weights_int8_activations_vnni(vnni_lib, cfg):
    """int8 weights with int8 activations (vpdpbusd over q ^ 0x80): exact against x quantized the same way."""
    check_int8_activations(vnni_lib, "vnni", cfg, bits=8)
