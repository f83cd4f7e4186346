"""Tests of the decode GEMVs over blocks kept from a model file (passes/kernels/kquant_gemv.py) against numpy.

Random KBlocks (random codes over the whole code range, random scales: fp16 d and m for one level, sub-scales
over their type's range with Q6_K's int8 ones negative too, fp16 D and Dmin for two levels) are packed with
kquant.pack_panels and multiplied by the kernels built for this CPU's instruction sets (the AVX-512 and VNNI
variants only where /proc/cpuinfo has them). The fp32 kernel is compared with x @ blocks.dequantize(); the int8
ones exactly (to ~1e-4 of max |y|) with x quantized as quant.int8_blocks does, and within int8's error of the
exact product.
"""

import numpy as np
import pytest
import tvm

from kernel_reference import act_ref, int8_blocks_ref
from passes.kernels import kquant
from passes.kernels.kquant_gemv import gemv_panels_kq, gemv_panels_kq_x8
from passes.targets import CPU_ISAS
from runtime.artifact import cpu_flags
from runtime.dtypes import WEIGHT_FORMATS
from test_kernels import aligned, call

FORMATS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
SHAPES = {"pad": (512, 40, None), "group4": (768, 120, 4)}  # (K, N, group): a padded last panel; 4 panels a task
# int8-activation variants: (dot, lanes) -> the CPU_ISAS entry whose target compiles them
X8 = {("vnni", 16): "avx512vnni", ("madd", 16): "avx512", ("madd", 8): "avx2"}
EPILOGUE = ("q4_k", "group4", True, "gelu", True)  # (format, shape, bias, act, residual): the epilogue, once


def has_isa(isa):
    return set(CPU_ISAS[isa].features) <= (cpu_flags() or set())


def kname(kind, fmt, shape, epi=False):
    return f"{kind}_{fmt}_{shape}" + ("_epi" if epi else "")


def random_blocks(rng, fmt, K, N):
    """KBlocks of a [K, N] matrix in `fmt` with random codes and scales."""
    codes = rng.integers(0, 1 << fmt.bits, (K, N)).astype(np.uint8)
    nbk = K // fmt.block
    if fmt.super_block:
        nsup = K // fmt.super_block
        sc = (rng.integers(-128, 128, (nbk, N)).astype(np.int8) if fmt.sub_scale == "int8"
              else rng.integers(0, 64, (nbk, N)).astype(np.uint8))
        D = (rng.random((nsup, N)) * 0.02 + 1e-3).astype(np.float16)
        if not fmt.has_min:
            return kquant.KBlocks(fmt, 0, codes, sc, None, D, None)
        mn = rng.integers(0, 64, (nbk, N)).astype(np.uint8)
        Dmin = (rng.random((nsup, N)) * 0.02).astype(np.float16)
        return kquant.KBlocks(fmt, 0, codes, sc, mn, D, Dmin)
    d = (rng.standard_normal((nbk, N)) * 0.05).astype(np.float16)
    m = (rng.standard_normal((nbk, N)) * 0.5).astype(np.float16) if fmt.has_min else None
    return kquant.KBlocks(fmt, 0, codes, d, m)


def kernel_args(cfg):
    fmt, shape, epi = cfg
    K, N, group = SHAPES[shape]
    extra = dict(bias=True, act=EPILOGUE[3], residual=True) if epi else {}
    return WEIGHT_FORMATS[fmt], K, N, group, extra


CASES = [(f, s, False) for f in FORMATS for s in SHAPES] + [(EPILOGUE[0], EPILOGUE[1], True)]


def build(funcs, isa):
    mod = tvm.IRModule({str(f.attrs["global_symbol"]): f for f in funcs})
    return tvm.compile(mod, target=tvm.target.Target(CPU_ISAS[isa].llvm_target()))


@pytest.fixture(scope="module", params=["avx512", "avx2"])
def fp32_lib(request):
    if not has_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    funcs = []
    for cfg in CASES:
        fmt, K, N, group, extra = kernel_args(cfg)
        funcs.append(gemv_panels_kq(kname("f32", *cfg), K, N, fmt=fmt, group=group, **extra))
    return build(funcs, request.param)


@pytest.fixture(scope="module", params=list(X8), ids=lambda v: f"{v[0]}{v[1]}")
def x8_lib(request):
    dot, lanes = request.param
    isa = X8[request.param]
    if not has_isa(isa):
        pytest.skip(f"this CPU has no {isa}")
    funcs = []
    for cfg in CASES:
        fmt, K, N, group, extra = kernel_args(cfg)
        funcs.append(gemv_panels_kq_x8(kname("x8", *cfg), K, N, fmt=fmt, dot=dot, lanes=lanes, group=group,
                                       **extra))
    return build(funcs, isa)


def run(lib, kind, cfg, seed=0):
    """(y, the exact reference, the reference with x rounded to int8 blocks)."""
    fmt, K, N, _, extra = kernel_args(cfg)
    rng = np.random.default_rng(seed)
    blocks = random_blocks(rng, fmt, K, N)
    values, scales = kquant.pack_panels(blocks)
    x = aligned(rng.standard_normal((1, K)).astype(np.float32))
    b = aligned(rng.standard_normal(N).astype(np.float32)) if extra else None
    r = aligned(rng.standard_normal((1, N)).astype(np.float32)) if extra else None
    y = aligned(np.full((1, N), np.nan, np.float32))
    call(lib, kname(kind, *cfg), x, aligned(values), aligned(scales), *[a for a in (b, r) if a is not None], y)
    w = blocks.dequantize().astype(np.float64)

    def ref(xv):
        pre = xv @ w + (0 if b is None else b)
        return act_ref(pre, extra.get("act", "none")) + (0 if r is None else r)

    return y, ref(x.astype(np.float64)), ref(int8_blocks_ref(x))


def near(y, ref, tol):
    scale = np.abs(ref).max()
    assert np.abs(y - ref).max() <= tol * scale, (np.abs(y - ref).max() / scale, tol)


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: kname("", *c)[1:])
def test_fp32_activations(fp32_lib, cfg):
    y, exact, _ = run(fp32_lib, "f32", cfg)
    near(y, exact, 1e-4)


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: kname("", *c)[1:])
def test_int8_activations(x8_lib, cfg):
    y, exact, rounded = run(x8_lib, "x8", cfg)
    near(y, rounded, 1e-4)
    near(y, exact, 2e-2)


def test_interface():
    fmt = WEIGHT_FORMATS["q4_k"]
    f = gemv_panels_kq_x8("k", 256, 40, fmt=fmt, bias=True, act="gelu", residual=True)
    assert [p.name for p in f.params] == ["x", "w", "ws", "b", "res", "y"]
    g = gemv_panels_kq("k", 256, 40, fmt=fmt)
    assert [p.name for p in g.params] == ["x", "w", "ws", "y"]
    with pytest.raises(ValueError):  # K not whole super-blocks
        gemv_panels_kq("k", 288, 40, fmt=fmt)
    with pytest.raises(ValueError):  # not a kept format
        gemv_panels_kq_x8("k", 256, 40, fmt=WEIGHT_FORMATS["int4"])
    with pytest.raises(ValueError):
        gemv_panels_kq_x8("k", 256, 40, fmt=fmt, dot="vnni", lanes=8)
