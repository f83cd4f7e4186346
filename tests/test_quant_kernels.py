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
from passes.targets import CPU_ISAS
from runtime.artifact import cpu_flags
from runtime.dtypes import WEIGHT_FORMATS
from test_kernels import MAX_ROWS, aligned, call, rand, rows_buf

FORMATS = ("int8", "int4", "int4a")  # int4a: asymmetric blocks (a scale and a min per block, GGUF's Q4_1)
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


# int4a (built for every ISA: compile time) over a few configurations: odd sizes, fp32 scales, padded panels
INT4A = {"gelu", "f32", "group4", "relu", "res", "skip"}


def cases(table, formats=FORMATS):
    """(format, configuration) pairs of a table: every one for int8 and int4, INT4A's for int4a."""
    return [(fmt, cfg) for fmt in formats for cfg in table if fmt != "int4a" or cfg in INT4A]


def _fmt(name):
    return WEIGHT_FORMATS[name]


def fmt_args(name):
    """A format's kernel arguments, as select-kernels passes them (`Lowering.quant_tag`)."""
    fmt = _fmt(name)
    return {"bits": fmt.bits, **({"has_min": True} if fmt.has_min else {})}


def x8_kernels(dot, isa, fmt="int4", variants=("d", "p")):
    """int8-activation kernels: decode GEMVs ("d") and prefill GEMMs ("p")."""
    tile = CPU_ISAS[isa].gemm_panels
    return [ops.linear_panels_q.cpu(kname(f"x8{dot}{fmt}", cfg, v), K, N, rows=rows, sdtype=sdtype, bias=bias,
                                    act=act, residual=res, int8_dot=dot, tile_panels=tile, **fmt_args(fmt))
            for _, cfg in cases(X8, [fmt]) for v, rows in ROWS.items() if v in variants
            for K, N, bias, act, res, sdtype in [X8[cfg]]]


def all_kernels(isa):
    funcs = x8_kernels("madd", isa) + x8_kernels("madd", isa, "int4a")
    if CPU_ISAS[isa].gemm_panels == 1:  # AVX2: int8 weights' prompt GEMM over int8 activations (no such GEMV)
        funcs += x8_kernels("madd", isa, "int8", variants=("p",))
    for fmt, cfg in cases(PANELS):
        K, N, bias, act, res, sdtype, tp = PANELS[cfg]
        for v, rows in ROWS.items():
            funcs.append(ops.linear_panels_q.cpu(kname(f"panels{fmt}", cfg, v), K, N, rows=rows, sdtype=sdtype,
                                                 bias=bias, act=act, residual=res, tile_panels=tp, **fmt_args(fmt)))
    for fmt, cfg in cases(ROWS_Q):
        K, N, act, sdtype, tp = ROWS_Q[cfg]
        funcs.append(ops.linear_rows_q.cpu(kname(f"rows{fmt}", cfg, "p"), K, N, rows=None, sdtype=sdtype, act=act,
                                           tile_panels=tp, **fmt_args(fmt)))
    for fmt, cfg in cases(KN_Q):
        K, N, bias, act, res, sdtype, tp, skip = KN_Q[cfg]
        funcs.append(ops.linear_kn_q.cpu(kname(f"kn{fmt}", cfg, "p"), K, N, rows=None, sdtype=sdtype, bias=bias,
                                         act=act, residual=res, tile_panels=tp, skip_zero_rows=skip, **fmt_args(fmt)))
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
    cpu.build(x8_kernels("vnni", "avx512") + x8_kernels("vnni", "avx512", "int8") + x8_kernels("vnni", "avx512", "int4a"),
              CPU_ISAS["avx512vnni"].llvm_target(), path)
    return tvm.runtime.load_module(path)


def quantized(rng, shape, fmt, axis, sdtype):
    """A random matrix's blocks along `axis`, (q, scales (, mins)) (in `sdtype`), and its dequantized float64
    matrix (off-centre, so that an asymmetric format's mins matter)."""
    q, *per_block = quant.quantize(rng.standard_normal(shape) * 0.5 + 0.2, _fmt(fmt), axis=axis)
    blocks = (q, *(a.astype(sdtype) for a in per_block))
    return blocks, quant.dequantize(*blocks[:2], axis, *blocks[2:]).astype(np.float64)


def packed(pack, blocks, fmt):
    """`pack` (quant.pack_panels / pack_rows) of `quantized`'s blocks."""
    return pack(*blocks[:2], _fmt(fmt), *blocks[2:])


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
    with pytest.raises(ValueError):  # int8 weights in zmm: VNNI only
        quant.linear_panels_q("q", 64, 40, rows=1, bits=8, bias=False, int8_dot="madd", tile_panels=2)
    # int8 weights with "madd" in ymm (AVX2): prompts over int8 x (the sign trick), decode over fp32 x
    decode, prompt = (quant.linear_panels_q("q", 64, 40, rows=rows, bits=8, bias=False, int8_dot="madd").script()
                      for rows in (1, None))
    assert "psign" not in decode and "xq" not in decode and "psign" in prompt
    with pytest.raises(ValueError):  # minimums: 4-bit blocks only
        quant.linear_panels_q("q", 64, 40, rows=1, bits=8, bias=False, has_min=True)


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("fmt,cfg", cases(PANELS))
def test_linear_panels_q(lib, fmt, cfg, variant, m):
    K, N, bias, act, res, sdtype, _ = PANELS[cfg]
    rng = np.random.default_rng(_fmt(fmt).bits)
    blocks, w = quantized(rng, (K, N), fmt, 0, sdtype)
    _, x = rows_buf(rng, m, K, scale=0.5)
    y, b, r = run(lib, kname(f"panels{fmt}", cfg, variant), x, packed(quant.pack_panels, blocks, fmt), bias, res, N,
                  m, rng)
    close(y, expected(x, w, b, r, act))


@pytest.mark.parametrize("variant,m", PREFILL)
@pytest.mark.parametrize("fmt,cfg", cases(ROWS_Q))
def test_linear_rows_q(lib, fmt, cfg, variant, m):
    K, N, act, sdtype, _ = ROWS_Q[cfg]
    rng = np.random.default_rng(10 + _fmt(fmt).bits)
    blocks, w = quantized(rng, (N, K), fmt, 1, sdtype)  # one row per output neuron, blocks along K
    _, x = rows_buf(rng, m, K, scale=0.5)
    y, b, _ = run(lib, kname(f"rows{fmt}", cfg, variant), x, packed(quant.pack_rows, blocks, fmt), True, False, N, m,
                  rng)
    close(y, expected(x, w.T, b, None, act))


@pytest.mark.parametrize("variant,m", PREFILL)
@pytest.mark.parametrize("fmt,cfg", cases(KN_Q))
def test_linear_kn_q(lib, fmt, cfg, variant, m):
    K, N, bias, act, res, sdtype, _, skip = KN_Q[cfg]
    rng = np.random.default_rng(20 + _fmt(fmt).bits)
    blocks, w = quantized(rng, (K, N), fmt, 1, sdtype)  # one row per reduction index, blocks along N
    _, x = rows_buf(rng, m, K, scale=0.5)
    if skip:  # a ReLU's output, two thirds of its columns zero in every row
        x[...] = np.maximum(x, 0) * (np.arange(K) % 3 == 0)
    y, b, r = run(lib, kname(f"kn{fmt}", cfg, variant), x, packed(quant.pack_rows, blocks, fmt), bias, res, N, m, rng)
    close(y, expected(x, w, b, r, act))


def test_rows_untouched(lib):
    """Prefill writes rows [0, m) of its output and nothing past them (the runtime passes slices)."""
    K, N, bias, act, res, sdtype, _ = PANELS["gelu"]
    rng = np.random.default_rng(5)
    blocks, _ = quantized(rng, (K, N), "int4", 0, sdtype)
    xs, x = rows_buf(rng, 3, K)
    ys, y = rows_buf(rng, 3, N)
    before = ys[3:].copy()
    call(lib, kname("panelsint4", "gelu", "p"), x, *[aligned(a) for a in packed(quant.pack_panels, blocks, "int4")],
         rand(rng, N),
         rows_buf(rng, 3, N)[1], y)
    np.testing.assert_array_equal(ys[3:], before)
    assert ys.shape[0] == MAX_ROWS


def x8_reference(x, w):
    """x quantized as the kernel does (per 32-block, scale max|x| / 127, fp32) times the dequantized matrix."""
    return int8_blocks_ref(x, quant.QUANT_BLOCK) @ w


def check_int8_activations(lib, dot, cfg, fmt="int4", variant="d", m=1):
    K, N, bias, act, res, sdtype = X8[cfg]
    rng = np.random.default_rng(30)
    blocks, w = quantized(rng, (K, N), fmt, 0, sdtype)
    _, x = rows_buf(rng, m, K, scale=0.5)
    y, b, r = run(lib, kname(f"x8{dot}{fmt}", cfg, variant), x, packed(quant.pack_panels, blocks, fmt), bias, res, N,
                  m, rng)
    pre = x8_reference(x, w) + (0 if b is None else b)
    close(y, act_ref(pre, act) + (0 if r is None else r))
    exact = expected(x, w, b, r, act)
    assert np.abs(y - exact).max() <= 2e-2 * np.abs(exact).max()


X8_FORMATS = ("int4", "int4a")  # the weight formats whose int8-activation kernels take "madd"


@pytest.mark.parametrize("fmt,cfg", cases(X8, X8_FORMATS))
def test_int8_activations_madd(lib, cfg, fmt):
    """int4 / int4a decode with int8 activations (vpmaddubsw; zmm under AVX-512's budget, ymm under AVX2's):
    exact against x quantized the same way (int4a's mins times x's block sums as quantized), and within int8's
    error of the float product."""
    check_int8_activations(lib, "madd", cfg, fmt)


@pytest.mark.parametrize("fmt,cfg", cases(X8, X8_FORMATS))
def test_int8_activations_vnni(vnni_lib, cfg, fmt):
    check_int8_activations(vnni_lib, "vnni", cfg, fmt)


PREFILL_ROWS = [1, 5, 9]  # int8-activation prefill GEMMs: partial and whole 4-row register tiles


@pytest.mark.parametrize("m", PREFILL_ROWS)
@pytest.mark.parametrize("fmt,cfg", cases(X8))
def test_int8_activation_prefill_gemm_madd(lib, cfg, fmt, m):
    """Prompts' GEMMs over int4 / int4a panels with each row of x rounded to int8 blocks (vpmaddubsw, in zmm and
    ymm), and over int8 panels in ymm (AVX2: |q| times x with q's sign): exact against x quantized the same way,
    over odd row counts and padded panels. (int8 in zmm takes VNNI: test_int8_weights_int8_activations_vnni.)"""
    if fmt == "int8" and not lib.implements_function(kname(f"x8madd{fmt}", cfg, "p")):
        pytest.skip("int8 weights in zmm take VNNI")
    check_int8_activations(lib, "madd", cfg, fmt, variant="p", m=m)


@pytest.mark.parametrize("m", PREFILL_ROWS)
@pytest.mark.parametrize("fmt,cfg", cases(X8))
def test_int8_activation_prefill_gemm_vnni(vnni_lib, cfg, fmt, m):
    """The same with vpdpbusd, over int4, int4a and int8 panels."""
    check_int8_activations(vnni_lib, "vnni", cfg, fmt, variant="p", m=m)


@pytest.mark.parametrize("cfg", X8)
def test_int8_weights_int8_activations_vnni(vnni_lib, cfg):
    """int8 weights with int8 activations (vpdpbusd over q ^ 0x80): exact against x quantized the same way."""
    check_int8_activations(vnni_lib, "vnni", cfg, "int8")
