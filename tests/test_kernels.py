"""Tests of the CPU kernel library (passes/kernels/cpu.py) against numpy references.

All kernels are built once into one .so (module fixture) and called the way the runtime
calls them: tvm.runtime.load_module + tvm_ffi.from_dlpack on 64-byte aligned numpy arrays
(TVM's code assumes that alignment; plain numpy arrays can crash parallel kernels). Prefill
kernels get row slices buf[:m] of larger aligned buffers, as the runtime passes them.
"""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu
from passes.targets import CPU_ISAS
from kernel_reference import QK_NORM_EPS, act_ref, attention_ref, check_rope_kv_write, close, kname  # noqa: E402

MAX_ROWS = 8  # prefill buffers are allocated this tall and sliced to m rows
MAX_CTX = 20  # not a multiple of 8: exercises the padded score buffer
# (variant, m): decode always has m = 1; prefill is tried with 1, 3 and 7 rows
VARIANTS = [("d", 1), ("p", 1), ("p", 3), ("p", 7)]
ROWS = {"d": 1, "p": None}

LINEAR = {  # name: (K, N, bias, act, residual)
    "plain": (40, 72, False, "none", False),
    "relu": (40, 72, True, "relu", False),
    "gelu": (40, 72, True, "gelu", True),
    "silu": (40, 72, False, "silu", True),
    "gelu_tanh": (40, 72, True, "gelu_tanh", False),
    "tiles": (64, 128, True, "none", True),  # whole 64-column GEMV blocks / 6x16 GEMM tiles
    "narrow": (24, 36, True, "relu", False),  # N % 8 != 0: 4-lane vectors
    "group8": (24, 1020, True, "relu", True),  # decode over panels: 64 panels, 8 a task, the last padded
    "group4": (16, 570, False, "none", False),  # 36 panels: 4 a task (8 would leave 4.5 tasks)
}
WEIGHT_DTYPES = ("float32", "float16")
# LINEAR's configs of plain's shape that differ from it only in the epilogue: panel kernels of theirs are built in
# fp32 only, since the epilogue is the same code whatever the weights' storage or register tile
EPILOGUE_ONLY = ("relu", "gelu", "silu", "gelu_tanh")
# (storage, cfg, variant, m) of the panel kernels: "wide" (two-panel register tile) in prefill only, since decode's
# GEMV has no register tile (tile_panels does not reach it: its kernel would be the fp32 one)
PANEL_CASES = [(dtype, cfg, variant, m) for dtype in WEIGHT_DTYPES + ("wide",) for cfg in LINEAR
               for variant, m in VARIANTS
               if (dtype == "float32" or cfg not in EPILOGUE_ONLY) and (dtype != "wide" or variant == "p")]
GLU = {"silu": (40, "silu"), "gelu": (40, "gelu"), "gelu_tanh": (40, "gelu_tanh"), "relu36": (36, "relu")}
SPREAD = 2048  # the activation accuracy test's values
NORM_D = (36, 64)
HEADS = [(4, 2, 8), (4, 4, 16), (2, 1, 64)]  # (H, KVH, hd)
LONG_CTX = 600  # keys in several blocks of cpu.ATTENTION_BLOCK: the online softmax rescales between blocks
V = 50
GEMMA_HEADS, GEMMA_WINDOW, LONG_WINDOW = (4, 2, 8), 4, 200
EMBED_SCALE = float(np.float32(np.sqrt(3072)))  # Gemma 2 9B's sqrt(d_model), as a float32


# ---------------------------------------------------------------------------------- helpers


def aligned_empty(shape, dtype="float32", align=64):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + n].view(dtype).reshape(shape)


def aligned(a):
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def rand(rng, *shape, scale=1.0):
    return aligned((rng.standard_normal(shape) * scale).astype(np.float32))


def rows_buf(rng, m, *shape, scale=1.0):
    """A MAX_ROWS-tall aligned buffer and its first m rows (what the runtime passes)."""
    full = rand(rng, MAX_ROWS, *shape, scale=scale)
    return full, full[:m]


def call(lib, name, *args):
    lib[name](*[tvm_ffi.from_dlpack(a) if isinstance(a, np.ndarray) else a for a in args])












# ---------------------------------------------------------------------------------- fixture


def all_kernels():
    funcs = []
    for v, rows in ROWS.items():
        for cfg, (K, N, bias, act, res) in LINEAR.items():
            funcs.append(cpu.linear(kname("linear", cfg, v), K, N, rows=rows, bias=bias, act=act, residual=res))
        panels = dict.fromkeys((dtype, cfg) for dtype, cfg, variant, _ in PANEL_CASES if variant == v)
        for dtype, cfg in panels:
            K, N, bias, act, res = LINEAR[cfg]
            funcs.append(cpu.linear_panels(kname(f"panels_{dtype}", cfg, v), K, N, rows=rows,
                                           wdtype="float32" if dtype == "wide" else dtype, bias=bias, act=act,
                                           residual=res, tile_panels=2 if dtype == "wide" else 1))
        funcs.append(cpu.linear(kname("linear_float16", "gelu", v), 40, 72, rows=rows, bias=True, act="gelu",
                                residual=True, wdtype="float16"))
        for cfg, (F, act) in GLU.items():
            funcs.append(cpu.glu(kname("glu", cfg, v), F, rows=rows, act=act))
        for D in NORM_D:
            funcs.append(cpu.layer_norm(kname("ln", D, v), D, 1e-5, rows=rows))
            funcs.append(cpu.rms_norm(kname("rms", D, v), D, 1e-6, rows=rows))
        funcs.append(cpu.embed(kname("embed", "pos", v), V, 36, rows=rows, positions=MAX_CTX))
        funcs.append(cpu.embed(kname("embed", "nopos", v), V, 36, rows=rows, positions=None))
        for H, KVH, hd in HEADS:
            for rope in (True, False):
                funcs.append(
                    cpu.rope_kv_write(kname("rope", f"{H}_{KVH}_{hd}_{rope}", v), H, KVH, hd, MAX_CTX, rows=rows, rope=rope)
                )
                funcs.append(cpu.rope_kv_write(kname("rope", f"{H}_{KVH}_{hd}_{rope}_qknorm", v), H, KVH, hd, MAX_CTX,
                                                   rows=rows, rope=rope, qk_norm_eps=QK_NORM_EPS))
            funcs.append(
                cpu.attention(kname("attn", f"{H}_{KVH}_{hd}", v), H, KVH, hd, MAX_CTX, 1 / math.sqrt(hd), rows=rows)
            )
        funcs.append(cpu.attention(kname("attn", "long", v), 4, 1, 16, LONG_CTX, 0.25, rows=rows))
        # Gemma 2's: soft-capped scores, a sliding window (inside a vector of scores; across many)
        funcs.append(cpu.attention(kname("attn", "gemma", v), *GEMMA_HEADS, MAX_CTX, 0.3, rows=rows, softcap=2.0,
                                   window=GEMMA_WINDOW))
        funcs.append(cpu.attention(kname("attn", "long_window", v), 4, 1, 16, LONG_CTX, 0.25, rows=rows, softcap=50.0,
                                   window=LONG_WINDOW))
        for D in NORM_D:  # a post-norm with its residual
            funcs.append(cpu.rms_norm(kname("rms_res", D, v), D, 1e-6, rows=rows, residual=True))
        funcs.append(cpu.softcap(kname("softcap", V, v), V, 3.0, rows=rows))
        funcs.append(cpu.embed(kname("embed", "scaled", v), V, 36, rows=rows, positions=None, scale=EMBED_SCALE))
    funcs.append(cpu.glu("glu_spread_gelu_tanh", SPREAD, rows=1, act="gelu_tanh"))
    return funcs


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kernels") / "kernels.so")
    cpu.build(all_kernels(), CPU_ISAS["avx2"].llvm_target(), path)
    return path


@pytest.fixture(scope="module")
def lib(lib_path):
    return tvm.runtime.load_module(lib_path)


# ---------------------------------------------------------------------------------- interface


def test_interface():
    f = cpu.linear("lin", 40, 72, rows=None, bias=True, act="gelu", residual=True)
    assert str(f.attrs["global_symbol"]) == "lin"
    assert [p.name for p in f.params] == ["x", "w", "b", "res", "y"]
    e = cpu.embed("emb", V, 36, rows=1, positions=MAX_CTX)
    assert [p.name for p in e.params] == ["ids", "table", "pos_table", "start", "y"]
    assert str(e.params[3].ty) == "int64"  # scalar param; Var.dtype raises in 0.27
    r = cpu.rope_kv_write("rope", 4, 2, 8, MAX_CTX, rows=None, rope=True)
    assert [p.name for p in r.params] == ["qkv", "cos", "sin", "kcache", "vcache", "q", "start"]
    r = cpu.rope_kv_write("rope", 4, 2, 8, MAX_CTX, rows=None, rope=True, qk_norm_eps=QK_NORM_EPS)
    assert [p.name for p in r.params] == ["qkv", "cos", "sin", "q_norm", "k_norm", "kcache", "vcache", "q", "start"]
    a = cpu.attention("attn", 4, 2, 8, MAX_CTX, 0.3, rows=1)
    assert [p.name for p in a.params] == ["q", "kcache", "vcache", "out", "start"]
    with pytest.raises(ValueError):
        cpu.linear("bad", 8, 8, rows=2, bias=False)
    with pytest.raises(ValueError):
        cpu.glu("bad", 8, rows=1, act="tanh")


# ---------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("cfg", LINEAR)
def test_linear(lib, cfg, variant, m):
    K, N, bias, act, res = LINEAR[cfg]
    rng = np.random.default_rng(0)
    _, x = rows_buf(rng, m, K, scale=0.5)
    w = rand(rng, K, N, scale=0.5)
    b = rand(rng, N)
    _, r = rows_buf(rng, m, N)
    _, y = rows_buf(rng, m, N)
    args = [x, w] + ([b] if bias else []) + ([r] if res else []) + [y]
    call(lib, kname("linear", cfg, variant), *args)
    ref = x.astype(np.float64) @ w + (b if bias else 0)
    ref = act_ref(ref, act) + (r if res else 0)
    close(y, ref)


@pytest.mark.parametrize("dtype,cfg,variant,m", PANEL_CASES)
def test_linear_panels(lib, cfg, variant, m, dtype):
    """Panel-packed weights (the CPU's layout) in fp32 and fp16 storage, padded last panels included; "wide":
    the AVX-512 register tile of two panels (same code for any ISA; odd panel counts fall back to one)."""
    K, N, bias, act, res = LINEAR[cfg]
    kernel = kname(f"panels_{dtype}", cfg, variant)
    dtype = "float32" if dtype == "wide" else dtype
    rng = np.random.default_rng(0)
    _, x = rows_buf(rng, m, K, scale=0.5)
    w = (rng.standard_normal((K, N)) * 0.5).astype(dtype)
    b = rand(rng, N)
    _, r = rows_buf(rng, m, N)
    _, y = rows_buf(rng, m, N)
    packed = cpu.pack_panels(w)
    assert packed.shape == (-(-N // cpu.PANEL), K, cpu.PANEL) and packed.dtype == w.dtype
    args = [x, aligned(packed)] + ([b] if bias else []) + ([r] if res else []) + [y]
    call(lib, kernel, *args)
    ref = x.astype(np.float64) @ w.astype(np.float64) + (b if bias else 0)
    close(y, act_ref(ref, act) + (r if res else 0))


@pytest.mark.parametrize("variant,m", VARIANTS)
def test_linear_fp16_weights(lib, variant, m):
    """The [K, N] kernel with fp16 storage (sparse FFN rows in prefill)."""
    rng = np.random.default_rng(3)
    _, x = rows_buf(rng, m, 40, scale=0.5)
    w = aligned((rng.standard_normal((40, 72)) * 0.5).astype(np.float16))
    b = rand(rng, 72)
    _, r = rows_buf(rng, m, 72)
    _, y = rows_buf(rng, m, 72)
    call(lib, kname("linear_float16", "gelu", variant), x, w, b, r, y)
    close(y, act_ref(x.astype(np.float64) @ w.astype(np.float64) + b, "gelu") + r)


ROW_GEMMS = {  # name: (K, N, bias, act, residual): odd sizes (scalar k tails, partial neuron / column tiles)
    "odd": (37, 53, True, "relu", True),
    "small": (5, 3, True, "gelu", False),
    "even": (64, 48, False, "none", False),
    "wide": (40, 100, False, "silu", True),
}
ROW_GEMM_M = (1, 3, 7, 17)
ROW_GEMM_TILES = (1, 2)  # tile_panels: the AVX2 and AVX-512 register tiles (both run on an AVX2 target)


def blocked(cfg, dtype):
    """Whether gemm_kn is also built with small k blocks and column chunks for (cfg, dtype): in fp32 only (the
    storage changes the loads, not the blocking) and not for "small" (K = 5, N = 3: one block, one chunk, the
    kernel kn_ already is)."""
    return dtype == "float32" and cfg != "small"


def row_gemm_kernels():
    """gemm_nt and gemm_kn (the prefill GEMMs over the sparse FFN's row layouts), gemm_kn also with small k blocks
    and column chunks so that several of each run (`blocked`); and gemm_kn skipping zero rows, in the one flavour
    (fp32, one-panel tile) test_kn_gemm_skipping_zero_rows calls (the others were compiled and never run)."""
    funcs = []
    for cfg, (K, N, bias, act, res) in ROW_GEMMS.items():
        for dtype in WEIGHT_DTYPES:
            for tile in ROW_GEMM_TILES:
                flags = dict(wdtype=dtype, bias=bias, act=act, residual=res, tile_panels=tile)
                funcs.append(cpu.gemm_nt(f"nt_{cfg}_{dtype}_{tile}", K, N, **flags))
                funcs.append(cpu.gemm_kn(f"kn_{cfg}_{dtype}_{tile}", K, N, **flags))
                if blocked(cfg, dtype):
                    funcs.append(cpu.gemm_kn(f"kn_blocks_{cfg}_{dtype}_{tile}", K, N, columns=32, kb=5, **flags))
        funcs.append(cpu.gemm_kn(f"kn_skip_{cfg}_float32_1", K, N, wdtype="float32", bias=bias, act=act, residual=res,
                                 tile_panels=1, columns=32, kb=5, skip_zero_rows=True))
    return funcs


@pytest.fixture(scope="module")
def row_gemm_lib(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("row_gemms") / "row_gemms.so")
    cpu.build(row_gemm_kernels(), CPU_ISAS["avx2"].llvm_target(), path)
    return tvm.runtime.load_module(path)


@pytest.mark.parametrize("m", ROW_GEMM_M)
@pytest.mark.parametrize("tile", ROW_GEMM_TILES)
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("cfg", ROW_GEMMS)
def test_row_layout_gemms(row_gemm_lib, cfg, dtype, tile, m):
    """Prefill over weights read in place: gemm_nt over rows [N, K], gemm_kn over [K, N], against numpy; row
    slices of taller buffers, as the runtime passes them."""
    K, N, bias, act, res = ROW_GEMMS[cfg]
    rng = np.random.default_rng(m)
    tall = ROW_GEMM_M[-1] + 2
    x = rand(rng, tall, K, scale=0.5)[:m]
    w = (rng.standard_normal((K, N)) * 0.5).astype(dtype)
    b = rand(rng, N)
    r = rand(rng, tall, N)[:m]
    ref = act_ref(x.astype(np.float64) @ w.astype(np.float64) + (b if bias else 0), act) + (r if res else 0)
    kernels = [(f"nt_{cfg}_{dtype}_{tile}", w.T), (f"kn_{cfg}_{dtype}_{tile}", w)]
    kernels += [(f"kn_blocks_{cfg}_{dtype}_{tile}", w)] if blocked(cfg, dtype) else []
    for kernel, weight in kernels:
        y = rand(rng, tall, N)
        y[:] = np.nan
        args = [x, aligned(np.ascontiguousarray(weight))] + ([b] if bias else []) + ([r] if res else []) + [y[:m]]
        call(row_gemm_lib, kernel, *args)
        close(y[:m], ref)
        assert np.isnan(y[m:]).all(), f"{kernel} wrote past row {m}"


@pytest.mark.parametrize("m", ROW_GEMM_M)
@pytest.mark.parametrize("density", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("cfg", ROW_GEMMS)
def test_kn_gemm_skipping_zero_rows(row_gemm_lib, cfg, density, m):
    """gemm_kn with skip_zero_rows over an x of ReLU outputs: none, some and all of its columns nonzero."""
    K, N, bias, act, res = ROW_GEMMS[cfg]
    rng = np.random.default_rng(m)
    tall = ROW_GEMM_M[-1] + 2
    x = rand(rng, tall, K)[:m]
    x[...] = np.maximum(x, 0) * (rng.random((m, K)) < density)
    w = (rng.standard_normal((K, N)) * 0.5).astype(np.float32)
    b, r = rand(rng, N), rand(rng, tall, N)[:m]
    y = rand(rng, tall, N)
    y[:] = np.nan
    args = [x, aligned(w)] + ([b] if bias else []) + ([r] if res else []) + [y[:m]]
    call(row_gemm_lib, f"kn_skip_{cfg}_float32_1", *args)
    ref = act_ref(x.astype(np.float64) @ w + (b if bias else 0), act) + (r if res else 0)
    close(y[:m], ref)
    assert np.isnan(y[m:]).all()


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("cfg", GLU)
def test_glu(lib, cfg, variant, m):
    F, act = GLU[cfg]
    rng = np.random.default_rng(1)
    _, t = rows_buf(rng, m, 2 * F, scale=3.0)  # wide range: exercises exp/erf tails
    _, y = rows_buf(rng, m, F)
    call(lib, kname("glu", cfg, variant), t, y)
    t64 = t.astype(np.float64)
    close(y, act_ref(t64[:, :F], act) * t64[:, F:])


def test_gelu_tanh_accuracy(lib):
    """GELU (tanh), up = 1, on a spread of inputs against float64: within 1e-6 relative, or two ulps of its input
    where GELU amplifies an input's rounding more than that (kappa = |d ln f / d ln x|, which reaches 229 at
    x = -10, where f falls like exp(-0.07 x^3): no fp32 evaluation does better there)."""
    x = np.concatenate([np.linspace(-10, 10, SPREAD - 8), [-1e4, -30, -1e-6, 0, 1e-30, 1e-6, 30, 1e4]])
    x = x.astype(np.float32)
    t, y = aligned(np.concatenate([x, np.ones(SPREAD, np.float32)])[None]), aligned(np.zeros((1, SPREAD), np.float32))
    call(lib, "glu_spread_gelu_tanh", t, y)
    v = x.astype(np.float64)
    z = math.sqrt(8 / math.pi) * (v + 0.044715 * v**3)  # 2u: 0.5 (1 + tanh(u)) = sigmoid(2u), with no cancellation
    with np.errstate(over="ignore"):  # exp(-z) is inf at x = -1e4, where GELU is -0
        sigma = 1 / (1 + np.exp(-z))
    ref = v * sigma
    import torch  # ref is torch's definition (whose float64 form cancels for negative x, so is compared above -3)

    torch_ref = torch.nn.functional.gelu(torch.from_numpy(v), approximate="tanh").numpy()
    np.testing.assert_allclose(ref[v > -3], torch_ref[v > -3], rtol=1e-12, atol=1e-300)
    kappa = np.abs(1 + v * (1 - sigma) * math.sqrt(8 / math.pi) * (1 + 3 * 0.044715 * v**2))
    spread = np.abs(v) <= 10
    bound = (1e-6 + 2 * 2.0**-24 * kappa[spread]) * np.abs(ref[spread])
    assert (np.abs(y[0][spread] - ref[spread]) <= bound).all()
    assert y[0][x == 0] == 0 and np.array_equal(y[0][np.abs(v) >= 30] > 0, v[np.abs(v) >= 30] > 0)
    assert np.allclose(y[0][np.abs(v) >= 30], np.maximum(v[np.abs(v) >= 30], 0), rtol=1e-7, atol=1e-30)


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("D", NORM_D)
def test_layer_norm(lib, D, variant, m):
    rng = np.random.default_rng(2)
    _, x = rows_buf(rng, m, D)
    x += 3.0  # a non-zero mean
    g, b = rand(rng, D), rand(rng, D)
    _, y = rows_buf(rng, m, D)
    call(lib, kname("ln", D, variant), x, g, b, y)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    close(y, (x64 - mu) / np.sqrt(var + 1e-5) * g + b)


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("D", NORM_D)
def test_rms_norm(lib, D, variant, m):
    rng = np.random.default_rng(3)
    _, x = rows_buf(rng, m, D)
    g = rand(rng, D)
    _, y = rows_buf(rng, m, D)
    call(lib, kname("rms", D, variant), x, g, y)
    x64 = x.astype(np.float64)
    close(y, x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * g)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", VARIANTS)
def test_embed(lib, variant, m, start):
    rng = np.random.default_rng(4)
    ids_full = aligned(rng.integers(0, V, MAX_ROWS).astype(np.int64))
    ids = ids_full[:m]
    table, pos = rand(rng, V, 36), rand(rng, MAX_CTX, 36)
    _, y = rows_buf(rng, m, 36)
    call(lib, kname("embed", "pos", variant), ids, table, pos, start, y)
    close(y, table[ids] + pos[start : start + m], tol=1e-6)
    _, y2 = rows_buf(rng, m, 36)
    call(lib, kname("embed", "nopos", variant), ids, table, y2)
    np.testing.assert_array_equal(y2, table[ids])


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "H%d_KVH%d_hd%d" % h)
def test_rope_kv_write(lib, heads, variant, m, start, rope, qk_norm):
    H, KVH, hd = heads
    rng = np.random.default_rng(5)
    _, qkv = rows_buf(rng, m, (H + 2 * KVH) * hd)
    ang = rng.uniform(0, 2 * np.pi, (MAX_CTX, hd // 2))
    cos, sin = aligned(np.cos(ang).astype(np.float32)), aligned(np.sin(ang).astype(np.float32))
    norms = [aligned((1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)) for _ in range(2)] if qk_norm else None
    kc, vc = rand(rng, KVH, MAX_CTX, hd), rand(rng, KVH, MAX_CTX, hd)
    kc0, vc0 = kc.copy(), vc.copy()
    _, q = rows_buf(rng, m, H * hd)
    name = kname("rope", f"{H}_{KVH}_{hd}_{rope}{'_qknorm' if qk_norm else ''}", variant)
    call(lib, name, *([qkv] + ([cos, sin] if rope else []) + (norms or []) + [kc, vc, q, start]))

    check_rope_kv_write(qkv, cos, sin, kc, vc, kc0, vc0, q, heads, start, rope, norms)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "H%d_KVH%d_hd%d" % h)
def test_attention(lib, heads, variant, m, start):
    H, KVH, hd = heads
    scale = 1 / math.sqrt(hd)
    rng = np.random.default_rng(6)
    _, q = rows_buf(rng, m, H * hd, scale=2.0)  # peaked softmax: checks the max subtraction
    kc, vc = rand(rng, KVH, MAX_CTX, hd), rand(rng, KVH, MAX_CTX, hd)
    _, out = rows_buf(rng, m, H * hd)
    name = kname("attn", f"{H}_{KVH}_{hd}", variant)
    call(lib, name, q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, H, KVH, hd, scale))

    # causality: garbage in every cache entry after position start + i leaves rows <= i as they were
    base = out.copy()
    for i in range(m):
        kc2, vc2 = aligned(kc), aligned(vc)
        kc2[:, start + i + 1 :] = 1e3
        vc2[:, start + i + 1 :] = np.nan
        _, out2 = rows_buf(rng, m, H * hd)
        call(lib, name, q, kc2, vc2, out2, start)
        np.testing.assert_array_equal(out2[: i + 1], base[: i + 1])


@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 7)])
def test_attention_long_context(lib, variant, m):
    rng = np.random.default_rng(7)
    start = LONG_CTX - m - 3
    _, q = rows_buf(rng, m, 4 * 16)
    kc, vc = rand(rng, 1, LONG_CTX, 16), rand(rng, 1, LONG_CTX, 16)
    _, out = rows_buf(rng, m, 4 * 16)
    call(lib, kname("attn", "long", variant), q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, 4, 1, 16, 0.25))


@pytest.mark.parametrize("start", [0, 5, 12])
@pytest.mark.parametrize("variant,m", VARIANTS)
def test_attention_soft_capped_and_windowed(lib, variant, m, start):
    """Gemma 2's attention: softcap * tanh(s / softcap) of the scores, and a query at p attends to p - W + 1 .. p
    only: garbage before the window, as after p, leaves its row as it was."""
    H, KVH, hd = GEMMA_HEADS
    rng = np.random.default_rng(8)
    _, q = rows_buf(rng, m, H * hd, scale=3.0)  # scores beyond the cap
    kc, vc = rand(rng, KVH, MAX_CTX, hd), rand(rng, KVH, MAX_CTX, hd)
    _, out = rows_buf(rng, m, H * hd)
    name = kname("attn", "gemma", variant)
    call(lib, name, q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, H, KVH, hd, 0.3, softcap=2.0, window=GEMMA_WINDOW))
    base = out.copy()
    for i in range(m):
        first = max(0, start + i + 1 - GEMMA_WINDOW)
        kc2, vc2 = aligned(kc), aligned(vc)
        kc2[:, :first], vc2[:, :first] = 1e3, np.nan
        kc2[:, start + i + 1:], vc2[:, start + i + 1:] = 1e3, np.nan
        _, out2 = rows_buf(rng, m, H * hd)
        call(lib, name, q, kc2, vc2, out2, start)
        np.testing.assert_array_equal(out2[i], base[i])


@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 7)])
def test_attention_long_context_windowed(lib, variant, m):
    rng = np.random.default_rng(7)
    start = LONG_CTX - m - 3
    _, q = rows_buf(rng, m, 4 * 16, scale=4.0)
    kc, vc = rand(rng, 1, LONG_CTX, 16), rand(rng, 1, LONG_CTX, 16)
    _, out = rows_buf(rng, m, 4 * 16)
    call(lib, kname("attn", "long_window", variant), q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, 4, 1, 16, 0.25, softcap=50.0, window=LONG_WINDOW))


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("D", NORM_D)
def test_rms_norm_with_residual(lib, D, variant, m):
    rng = np.random.default_rng(3)
    _, x = rows_buf(rng, m, D)
    g = rand(rng, D)
    _, r = rows_buf(rng, m, D)
    _, y = rows_buf(rng, m, D)
    call(lib, kname("rms_res", D, variant), x, g, r, y)
    x64 = x.astype(np.float64)
    close(y, x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * g + r)


@pytest.mark.parametrize("variant,m", VARIANTS)
def test_softcap(lib, variant, m):
    """3 tanh(x / 3) over logits from 0 (where tanh's rounding matters most) to far past the cap."""
    rng = np.random.default_rng(10)
    _, x = rows_buf(rng, m, V, scale=4.0)
    x[0, :5] = [0.0, 1e-6, -1e-6, 200.0, -200.0]
    _, y = rows_buf(rng, m, V)
    call(lib, kname("softcap", V, variant), x, y)
    close(y, 3.0 * np.tanh(x.astype(np.float64) / 3.0), tol=1e-6)


@pytest.mark.parametrize("variant,m", VARIANTS)
def test_embed_scaled(lib, variant, m):
    rng = np.random.default_rng(4)
    ids = aligned(rng.integers(0, V, MAX_ROWS).astype(np.int64))[:m]
    table = rand(rng, V, 36)
    _, y = rows_buf(rng, m, 36)
    call(lib, kname("embed", "scaled", variant), ids, table, y)
    np.testing.assert_array_equal(y, table[ids] * np.float32(EMBED_SCALE))  # fp32, as transformers multiplies


# ---------------------------------------------------------------------------------- runtime path


def test_runtime_only_process(lib_path):
    """A fresh process with TVM_USE_RUNTIME_LIB=1 (no compiler) loads and runs the kernels."""
    script = textwrap.dedent(
        f"""
        import os
        os.environ["TVM_USE_RUNTIME_LIB"] = "1"
        import numpy as np, tvm_ffi, tvm.runtime
        lib = tvm.runtime.load_module({lib_path!r})

        def aligned_empty(shape, dtype="float32", align=64):
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raw = np.empty(n + align, np.uint8); off = (-raw.ctypes.data) % align
            return raw[off:off + n].view(dtype).reshape(shape)

        x, w, y = aligned_empty((8, 64)), aligned_empty((64, 128)), aligned_empty((8, 128))
        b, r = aligned_empty((128,)), aligned_empty((8, 128))
        rng = np.random.default_rng(0)
        for a in (x, w, b, r):
            a[...] = rng.standard_normal(a.shape)
        lib["linear_tiles_p"](*[tvm_ffi.from_dlpack(a) for a in (x[:5], w, b, r[:5], y[:5])])
        ref = x[:5].astype(np.float64) @ w + b + r[:5]
        assert np.allclose(y[:5], ref, rtol=1e-4, atol=1e-4)
        with open("/proc/self/maps") as f:
            assert "libtvm_compiler" not in f.read()
        print("ok")
        """
    )
    env = dict(os.environ, TVM_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
