"""Tests of the int8-activation prefill GEMM over blocks kept from a model file (passes/kernels/kquant_gemm.py)
against numpy, and of kquant_ops.linear_panels_kq's choice of it.

Random KBlocks (test_kquant_gemv.random_blocks) are packed with kquant.pack_panels and multiplied by each variant
this CPU runs (zmm "vnni" where /proc/cpuinfo has AVX512-VNNI, zmm "madd" where AVX512BW, ymm "madd" where AVX2;
the others skipped) at a symbolic row count: 1 and 3 rows (one row tile, codes built from the stored bytes), 5 and
130 (several tiles over the task buffer, the last partial), compared exactly (to ~1e-4 of max |y|) with x
quantized per row and 32-block as quant.int8_blocks does, and within int8's error of the exact product.
"""

import numpy as np
import pytest
import tvm

from kernel_reference import act_ref, int8_blocks_ref
from passes.kernels import kquant, kquant_ops
from passes.kernels.kquant_gemm import gemm_panels_kqx8
from passes.targets import CPU_ISAS
from runtime.dtypes import WEIGHT_FORMATS
from test_kernels import aligned, call
from test_kquant_gemv import has_isa, random_blocks

FORMATS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
SHAPES = {"pad": (256, 40), "wide": (512, 96)}  # (K, N): a padded last panel (1 panel a task); 2 panels a task
X8 = {("vnni", 16): "avx512vnni", ("madd", 16): "avx512", ("madd", 8): "avx2"}  # the CPU_ISAS entry to compile
ROWS = (1, 3, 5, 130)
EPILOGUE = ("q6_k", "wide", True)  # bias, gelu, residual: once
CASES = [(f, s, False) for f in FORMATS for s in SHAPES] + [EPILOGUE]


def kname(fmt, shape, epi):
    return f"kqx8_{fmt}_{shape}" + ("_epi" if epi else "")


def extra_args(epi):
    return dict(bias=True, act="gelu", residual=True) if epi else {}


@pytest.fixture(scope="module", params=list(X8), ids=lambda v: f"{v[0]}{v[1]}")
def lib(request):
    isa = X8[request.param]
    if not has_isa(isa):
        pytest.skip(f"this CPU has no {isa}")
    dot, lanes = request.param
    funcs = [gemm_panels_kqx8(kname(*cfg), *SHAPES[cfg[1]], fmt=WEIGHT_FORMATS[cfg[0]], dot=dot, lanes=lanes,
                              tile_panels=2 if lanes == 16 else 1, **extra_args(cfg[2])) for cfg in CASES]
    mod = tvm.IRModule({str(f.attrs["global_symbol"]): f for f in funcs})
    return tvm.compile(mod, target=tvm.target.Target(CPU_ISAS[isa].llvm_target()))


def near(y, ref, tol):
    scale = np.abs(ref).max()
    assert np.abs(y - ref).max() <= tol * scale, (np.abs(y - ref).max() / scale, tol)


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: kname(*c)[5:])
def test_int8_rows(lib, cfg):
    fmt, shape, epi = cfg
    K, N = SHAPES[shape]
    rng = np.random.default_rng(CASES.index(cfg))
    blocks = random_blocks(rng, WEIGHT_FORMATS[fmt], K, N)
    values, scales = (aligned(a) for a in kquant.pack_panels(blocks))
    w = blocks.dequantize().astype(np.float64)
    for m in ROWS:
        x = aligned((rng.standard_normal((m, K)) * rng.random((m, 1)) * 4).astype(np.float32))
        b = aligned(rng.standard_normal(N).astype(np.float32)) if epi else None
        r = aligned(rng.standard_normal((m, N)).astype(np.float32)) if epi else None
        y = aligned(np.full((m, N), np.nan, np.float32))
        call(lib, kname(*cfg), x, values, scales, *[a for a in (b, r) if a is not None], y)

        def ref(xv):
            pre = xv @ w + (0 if b is None else b)
            return act_ref(pre, "gelu" if epi else "none") + (0 if r is None else r)

        rounded = ref(int8_blocks_ref(x))  # per row and 32-block (the blocks never cross a row: K % 32 == 0)
        for i in range(m):  # each row against its own scale (rows differ in size)
            near(y[i], rounded[i], 1e-4)
        near(y, ref(x.astype(np.float64)), 2e-2)


def test_interface_and_choice():
    fmt = WEIGHT_FORMATS["q4_k"]
    f = gemm_panels_kqx8("k", 256, 40, fmt=fmt, bias=True, act="gelu", residual=True)
    assert [p.name for p in f.params] == ["x", "w", "ws", "b", "res", "y"]
    assert [p.name for p in gemm_panels_kqx8("k", 256, 40, fmt=fmt).params] == ["x", "w", "ws", "y"]
    with pytest.raises(ValueError):  # K not whole super-blocks
        gemm_panels_kqx8("k", 288, 40, fmt=fmt)
    with pytest.raises(ValueError):  # not a kept format
        gemm_panels_kqx8("k", 256, 40, fmt=WEIGHT_FORMATS["int4"])
    with pytest.raises(ValueError):
        gemm_panels_kqx8("k", 256, 40, fmt=fmt, dot="avx")

    def chosen(**kw):  # the prefill kernel's body mentions the task buffer of expanded codes only in kqx8
        g = kquant_ops.linear_panels_kq("k", 256, 40, rows=None, fmt="q4_k", bias=False, **kw)
        return "wc" in g.script()

    assert chosen(int8_dot="vnni", tile_panels=2)
    assert chosen(int8_dot="madd", tile_panels=2)
    assert chosen(int8_dot="madd", tile_panels=1)  # AVX2: ymm
    assert not chosen(tile_panels=2)  # fp32 activations: cpu.gemm over kq_panels_weight
