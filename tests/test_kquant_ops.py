"""The CPU kernels over blocks kept from a model file (passes/kernels/kquant_ops.py: the prefill GEMM over kquant's
panels layout, the embedding gather over its rows layout) against numpy: `KBlocks.dequantize`'s matrix, random
blocks of every kept format (codes over their whole range, Q6_K's int8 sub-scales of both signs). The GEMM is
checked against the float64 product (its sums reassociate); the gather bit for bit (it computes each value as
dequantize does). Built once per CPU ISA this machine has (AVX2: one-panel GEMM tiles, AVX-512: two).
"""

import numpy as np
import pytest
import tvm

from kernel_reference import act_ref, kname
from passes.kernels import cpu, kquant_ops, ops
from passes.kernels.kquant import KBlocks, pack_panels, pack_rows
from passes.targets import CPU_ISAS
from runtime.artifact import cpu_flags
from runtime.dtypes import FILE_FORMATS, WEIGHT_FORMATS
from test_kernels import MAX_ROWS, aligned, call, rand, rows_buf

FORMATS = FILE_FORMATS
K, N, M = 512, 40, 5  # N: a padded last panel
GEMMS = {  # name: (N, bias, act, residual, tile_panels or None: the ISA's)
    "plain": (N, False, "none", False, None),
    "epi": (N, True, "gelu", True, None),  # bias, activation, residual
    "tiled": (64, True, "silu", False, 2),  # 4 panels: the two-panel register tile (and pack macro)
}
V, D, MAX_CTX = 50, 512, 20
EMBEDS = {"nopos": None, "pos": MAX_CTX}
ROWS = {"d": 1, "p": None}


def gemm_cases():
    """(format, configuration): every format plain; the others over two formats (one level with mins, Q6_K)."""
    return [(f, "plain") for f in FORMATS] + [(f, cfg) for f in ("q5_1", "q6_k", "q4_k") for cfg in GEMMS
                                              if cfg != "plain"]


def random_blocks(rng, fmt_name, shape, axis) -> KBlocks:
    """Random blocks of `fmt_name` for a matrix of `shape` blocked along `axis`: codes over the whole range; scales
    of ggml's sizes (fp16 d ~ 1e-2 either sign and m ~ -0.1 for one level; 6-bit sc, mn with fp16 D, Dmin ~ 1e-3
    for Q4_K / Q5_K; int8 sc of both signs for Q6_K)."""
    fmt = WEIGHT_FORMATS[fmt_name]
    codes = rng.integers(0, 1 << fmt.bits, shape).astype(np.uint8)

    def per(block):
        s = list(shape)
        s[axis] //= block
        return tuple(s)

    if not fmt.super_block:
        d = (rng.uniform(0.005, 0.02, per(fmt.block)) * rng.choice([-1, 1], per(fmt.block))).astype(np.float16)
        m = rng.uniform(-0.15, -0.05, per(fmt.block)).astype(np.float16) if fmt.has_min else None
        return KBlocks(fmt, axis, codes, d, m)
    sub, sup = per(fmt.block), per(fmt.super_block)
    if fmt.sub_scale == "int8":
        sc = rng.integers(-128, 128, sub).astype(np.int8)
    else:
        sc = rng.integers(0, 64, sub).astype(np.uint8)
    mn = rng.integers(0, 64, sub).astype(np.uint8) if fmt.has_min else None
    D_ = rng.uniform(2e-4, 2e-3, sup).astype(np.float16)
    Dmin = rng.uniform(2e-4, 2e-3, sup).astype(np.float16) if fmt.has_min else None
    return KBlocks(fmt, axis, codes, sc, mn, D_, Dmin)


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def lib(request, tmp_path_factory):
    isa = CPU_ISAS[request.param]
    if not set(isa.features) <= (cpu_flags() or set()):
        pytest.skip(f"this CPU has no {isa.name}")  # (its kernels would die of an illegal instruction)
    funcs = []
    for fmt, cfg in gemm_cases():
        n, bias, act, res, tp = GEMMS[cfg]
        funcs.append(ops.linear_panels_kq.cpu(kname(f"gemm{fmt}", cfg, "p"), K, n, rows=None, fmt=fmt, bias=bias,
                                              act=act, residual=res, tile_panels=tp or isa.gemm_panels))
    for fmt in FORMATS:
        for cfg, positions in EMBEDS.items():
            for v, rows in ROWS.items():
                funcs.append(ops.embed_kq.cpu(kname(f"embed{fmt}", cfg, v), V, D, rows=rows, positions=positions,
                                              fmt=fmt))
    path = str(tmp_path_factory.mktemp("kquant") / f"{isa.name}.so")
    cpu.build(funcs, isa.llvm_target(), path)
    return tvm.runtime.load_module(path)


def test_interface():
    f = kquant_ops.linear_panels_kq("g", K, N, rows=None, fmt="q4_k", bias=True, act="gelu", residual=True)
    assert [p.name for p in f.params] == ["x", "w", "ws", "b", "res", "y"]
    g = kquant_ops.linear_panels_kq("g", K, N, rows=None, fmt="q5_0", bias=False)
    assert [p.name for p in g.params] == ["x", "w", "ws", "y"]
    e = kquant_ops.embed_kq("e", V, D, rows=1, positions=MAX_CTX, fmt="q6_k")
    assert [p.name for p in e.params] == ["ids", "table_q", "table_s", "pos_table", "start", "y"]
    e = kquant_ops.embed_kq("e", V, D, rows=None, positions=None, fmt="q5_1")
    assert [p.name for p in e.params] == ["ids", "table_q", "table_s", "y"]
    with pytest.raises(ValueError):  # K-quants: whole super-blocks
        kquant_ops.linear_panels_kq("g", 128, N, rows=None, fmt="q4_k", bias=False)
    with pytest.raises(ValueError):  # not a kept format
        kquant_ops.linear_panels_kq("g", K, N, rows=None, fmt="int4", bias=False)
    with pytest.raises(TypeError):  # the format's name, not the object (specs are data)
        kquant_ops.embed_kq("e", V, D, rows=1, positions=None, fmt=WEIGHT_FORMATS["q5_0"])


@pytest.mark.parametrize("fmt,cfg", gemm_cases())
def test_gemm(lib, fmt, cfg):
    n, bias, act, res, _ = GEMMS[cfg]
    rng = np.random.default_rng(FORMATS.index(fmt))
    blocks = random_blocks(rng, fmt, (K, n), 0)
    w = blocks.dequantize().astype(np.float64)
    _, x = rows_buf(rng, M, K, scale=0.5)
    b = rand(rng, n) if bias else None
    _, r = rows_buf(rng, M, n) if res else (None, None)
    ys, y = rows_buf(rng, M, n)
    before = ys[M:].copy()
    call(lib, kname(f"gemm{fmt}", cfg, "p"),
         *[x, *(aligned(a) for a in pack_panels(blocks)), *(a for a in (b, r) if a is not None), y])
    want = act_ref(x.astype(np.float64) @ w + (0 if b is None else b), act) + (0 if r is None else r)
    scale = np.abs(want).max()
    assert scale > 0.1  # (the blocks' values matter)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * scale)
    np.testing.assert_array_equal(ys[M:], before)  # rows past m untouched


@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 1), ("p", 7)])
@pytest.mark.parametrize("cfg", EMBEDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_embed(lib, fmt, cfg, variant, m):
    positions = EMBEDS[cfg]
    rng = np.random.default_rng(40 + FORMATS.index(fmt))
    blocks = random_blocks(rng, fmt, (V, D), 1)
    table = blocks.dequantize()
    ids = aligned(rng.integers(0, V, MAX_ROWS).astype(np.int64))
    ids[min(1, m - 1)] = V + 3  # out of range: clamped to the last row
    y = aligned(np.full((MAX_ROWS, D), np.nan, np.float32))
    want = table[np.clip(ids[:m], 0, V - 1)]
    q, s = (aligned(a) for a in pack_rows(blocks))
    if positions:
        start = 3
        pos = aligned(rng.standard_normal((positions, D)).astype(np.float32))
        call(lib, kname(f"embed{fmt}", cfg, variant), ids[:m], q, s, pos, start, y[:m])
        want = want + pos[np.minimum(start + np.arange(m), positions - 1)]
    else:
        call(lib, kname(f"embed{fmt}", cfg, variant), ids[:m], q, s, y[:m])
    np.testing.assert_array_equal(y[:m], want)
    assert np.isnan(y[m:]).all()
