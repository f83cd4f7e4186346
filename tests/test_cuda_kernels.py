"""Tests of the CUDA kernel library (passes/kernels/cuda.py).

Without a GPU (any machine with nvcc): every kernel, decode and prefill variants, is built for each of
sm_75, sm_80, sm_89 and sm_90 into ONE module per arch (one nvcc run each); the exported .so must
embed a fatbin holding SASS for the arch plus its PTX, with every kernel in it; the generated module
source must be CUDA with one __global__ kernel per function; and every CUDA kernel must have the
signature of its CPU twin (the same ops.KernelOp's cpu maker).

With a GPU (``tvm.cuda(0).exist``): every kernel is run through ``tvm.runtime.load_module`` of the
exported library and compared with numpy, and a fresh runtime-only process loads and runs the
library. These tests skip cleanly elsewhere; ``scripts/gpu_check.sh`` runs them on a GPU machine. Without a
GPU, PICOMPILE_CUDA_EMULATE=1 runs the same numpy checks on the CUDA source through ``cuda_emulator`` (g++ on
the CPU; ~1 minute), all but the runtime-only process test.
"""

import functools
import math
import os
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

# TVM's own CUDA lookup follows the nvcc on PATH, which may be a wrapper script.
if "CUDA_PATH" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_PATH"] = "/usr/local/cuda"

import tvm  # noqa: E402

from passes.kernels import cuda, ops  # noqa: E402
from passes.targets import CUDA_ARCHS, CUDA_HOST_ISA, cuda_target  # noqa: E402
from kernel_reference import (QK_NORM_EPS, act_ref, attention_ref, check_rope_kv_write, close,  # noqa: E402
                              fatbin_entries, kname)

if cuda.nvcc_path() is None or not os.path.isdir(os.environ.get("CUDA_PATH", "/usr/local/cuda")):
    pytest.skip("nvcc / the CUDA toolkit is not installed (set CUDA_PATH)", allow_module_level=True)

ARCHS = ["sm_75", "sm_80", "sm_89", "sm_90"]
# the archs this file builds its kernel set for (nvcc takes 15-30 s an arch): the oldest and the default card's;
# test_cuda_quant_kernels.py builds its own set for the targets' other two (sm_80, sm_90)
BUILT_ARCHS = ["sm_75", "sm_89"]
MAX_ROWS = 8  # extra rows of every GPU allocation behind a kernel argument (see make_gpu_runner)
MAX_CTX = 20
VARIANTS = [("d", 1), ("p", 1), ("p", 3), ("p", 7)]
ROWS = {"d": 1, "p": None}

LINEAR = {  # name: (K, N, bias, act, residual)
    "plain": (40, 72, False, "none", False),
    "relu": (40, 72, True, "relu", False),
    "gelu": (40, 72, True, "gelu", True),
    "silu": (40, 72, False, "silu", True),
    "gelu_tanh": (40, 72, True, "gelu_tanh", False),
    "tiles": (64, 128, True, "none", True),  # whole 64x64 GEMM tiles, 4 GEMV blocks
    "narrow": (24, 36, True, "relu", False),  # k-stage of 8, a partial column tile
    "deep": (300, 200, True, "none", True),  # many k-stages (k-stage 4), 4 column tiles, tail
}
LINEAR_ROWS = {"relu": (40, 72, "relu"), "none": (36, 100, "none"), "deep": (300, 130, "silu")}
GLU = {"silu": (40, "silu"), "gelu": (40, "gelu"), "gelu_tanh": (40, "gelu_tanh"), "relu36": (36, "relu")}
NORM_D = (36, 64, 600)  # 600: several elements per thread and several warps per row
HEADS = [(4, 2, 8), (4, 4, 16), (2, 1, 64), (2, 1, 136)]  # (H, KVH, hd); 136: 2 dims per thread
LONG_CTX = 600  # several 128-key softmax chunks
V = 50
GEMMA_HEADS, GEMMA_WINDOW, LONG_WINDOW = (4, 2, 8), 4, 200
EMBED_SCALE = float(np.float32(np.sqrt(3072)))  # Gemma 2 9B's sqrt(d_model), as a float32
MERGE = {"res2b": (36, 2, True, True), "res1": (36, 1, False, True), "p2b": (40, 2, True, False)}
SELECT_N = (100, 3000)  # 3000: 1024 threads with 3 positions each
UP = {  # name: (D, n, gated, act)
    "gated": (40, 100, True, "silu"),  # float4 lanes, a partial 128-float run
    "plain": (256, 100, False, "relu"),  # whole runs
    "odd": (130, 50, True, "gelu"),  # D % 4 != 0: scalar lanes
}
DOWN = {"small": (100, 40), "wide": (100, 300)}  # (n, D)


# ---------------------------------------------------------------------------------- kernel set




class _Makers:
    """``make.X`` is ops.X's maker for one device."""

    def __init__(self, device):
        self.device = device

    def __getattr__(self, op):
        return getattr(getattr(ops, op), self.device)


def all_kernels(gpu=True):
    """The test kernel set: CUDA kernels, or (gpu=False) their CPU twins (the same ops' cpu makers)."""
    make = _Makers("cuda" if gpu else "cpu")
    funcs = []
    for v, rows in ROWS.items():
        for cfg, (K, N, bias, act, res) in LINEAR.items():
            funcs.append(make.linear(kname("linear", cfg, v), K, N, rows=rows, bias=bias, act=act, residual=res))
        for cfg, (F, act) in GLU.items():
            funcs.append(make.glu(kname("glu", cfg, v), F, rows=rows, act=act))
        for D in NORM_D:
            funcs.append(make.layer_norm(kname("ln", D, v), D, 1e-5, rows=rows))
            funcs.append(make.rms_norm(kname("rms", D, v), D, 1e-6, rows=rows))
        funcs.append(make.embed(kname("embed", "pos", v), V, 36, rows=rows, positions=MAX_CTX))
        funcs.append(make.embed(kname("embed", "nopos", v), V, 36, rows=rows, positions=None))
        for H, KVH, hd in HEADS:
            for rope in (True, False):
                funcs.append(
                    make.rope_kv_write(kname("rope", f"{H}_{KVH}_{hd}_{rope}", v), H, KVH, hd, MAX_CTX, rows=rows, rope=rope)
                )
                funcs.append(make.rope_kv_write(kname("rope", f"{H}_{KVH}_{hd}_{rope}_qknorm", v), H, KVH, hd, MAX_CTX,
                                                   rows=rows, rope=rope, qk_norm_eps=QK_NORM_EPS))
            funcs.append(
                make.attention(kname("attn", f"{H}_{KVH}_{hd}", v), H, KVH, hd, MAX_CTX, 1 / math.sqrt(hd), rows=rows)
            )
        funcs.append(make.attention(kname("attn", "long", v), 4, 1, 16, LONG_CTX, 0.25, rows=rows))
        # Gemma 2's: soft-capped scores, a sliding window (inside one 128-key chunk; starting inside a later one)
        funcs.append(make.attention(kname("attn", "gemma", v), *GEMMA_HEADS, MAX_CTX, 0.3, rows=rows, softcap=2.0,
                                    window=GEMMA_WINDOW))
        funcs.append(make.attention(kname("attn", "long_window", v), 4, 1, 16, LONG_CTX, 0.25, rows=rows,
                                    softcap=50.0, window=LONG_WINDOW))
        for D in NORM_D:  # a post-norm with its residual
            funcs.append(make.rms_norm(kname("rms_res", D, v), D, 1e-6, rows=rows, residual=True))
        funcs.append(make.softcap(kname("softcap", V, v), V, 3.0, rows=rows))
        funcs.append(make.embed(kname("embed", "scaled", v), V, 36, rows=rows, positions=None, scale=EMBED_SCALE))
        for cfg, (D, parts, bias, res) in MERGE.items():
            funcs.append(make.merge(kname("merge", cfg, v), D, parts, rows=rows, bias=bias, residual=res))
    for cfg, (K, N, act) in LINEAR_ROWS.items():
        funcs.append(make.linear_rows(kname("linrows", cfg, "p"), K, N, rows=None, act=act))
    for n in SELECT_N:
        funcs.append(make.select(kname("select", n, "d"), n, rows=1))
        funcs.append(make.select(kname("select_abs", n, "d"), n, rows=1, magnitude=True))
    for cfg, (D, n, gated, act) in UP.items():
        funcs.append(make.sparse_up(kname("up", cfg, "d"), D, n, rows=1, gated=gated, act=act))
    for cfg, (n, D) in DOWN.items():
        funcs.append(make.sparse_down(kname("down", cfg, "d"), n, D, rows=1))
    if gpu:
        # the grid-stride loop of sparse_up: a 2-block grid walking 100 neurons (16 per pass)
        saved = cuda.UP_MAX_BLOCKS
        cuda.UP_MAX_BLOCKS = 2
        try:
            funcs.append(cuda.sparse_up(kname("up", "stride", "d"), 40, 100, rows=1, gated=False, act="none"))
        finally:
            cuda.UP_MAX_BLOCKS = saved
    return funcs


@functools.cache
def cuda_kernels():
    """The test kernel set, made when a test first needs it: not while collecting, which every xdist worker does
    whichever worker runs this file."""
    return all_kernels()


# ---------------------------------------------------------------------------------- builds

_BUILDS = {}  # arch -> (path, facts, seconds)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-kernels")


def built(arch, build_dir):
    """The kernel set built for ``arch`` (once per session)."""
    if arch not in _BUILDS:
        path = str(build_dir / f"kernels_{arch}.so")
        began = time.perf_counter()
        facts = cuda.build(cuda_kernels(), arch, path)
        _BUILDS[arch] = (path, facts, time.perf_counter() - began)
    return _BUILDS[arch]


@pytest.mark.parametrize("arch", BUILT_ARCHS)
def test_build_embeds_binary(arch, build_dir):
    path, facts, seconds = built(arch, build_dir)
    kernels = cuda_kernels()
    print(f"{arch}: {len(kernels)} kernels built in {seconds:.1f} s (nvcc {facts['nvcc_seconds']:.1f} s)")
    assert os.path.getsize(path) > 0
    assert facts["arch"] == arch and facts["kernels"] == len(kernels)
    assert facts["binary_format"] == "fatbin"
    fmt, code = cuda.read_packed_cuda(path)
    assert fmt == "fatbin"
    sm = int(arch[3:])
    entries = fatbin_entries(code)
    assert {(kind, s) for kind, s, _ in entries} == {(2, sm), (1, sm)}  # SASS for the arch + its PTX
    (elf,) = [payload for kind, _, payload in entries if kind == 2]
    assert elf[:4] == b"\x7fELF" and struct.unpack_from("<H", elf, 18)[0] == 190  # EM_CUDA
    missing = [str(f.attrs["global_symbol"]) for f in kernels if f"{f.attrs['global_symbol']}_kernel".encode() not in elf]
    assert not missing, f"kernels missing from the {arch} cubin: {missing}"


def test_module_source_is_cuda():
    """What nvcc compiles: CUDA C++ with one __global__ kernel (at least) per PrimFunc."""
    kernels = cuda_kernels()
    source = cuda.cuda_source(kernels, "sm_80")
    assert source.count('extern "C" __global__ void __launch_bounds__') >= 2 * len(kernels)  # decl + def
    missing = [str(f.attrs["global_symbol"]) for f in kernels if f" {f.attrs['global_symbol']}_kernel(" not in source]
    assert not missing, missing


def test_nvcc_flags():
    flags = cuda.nvcc_flags("sm_89")
    assert "--fatbin" in flags
    assert "arch=compute_89,code=sm_89" in flags and "arch=compute_89,code=compute_89" in flags
    assert cuda_target("sm_90") == {"kind": "cuda", "arch": "sm_90", "host": CUDA_HOST_ISA.llvm_target()}
    assert CUDA_HOST_ISA.llvm_target()["mcpu"] == "haswell"
    assert CUDA_ARCHS == tuple(ARCHS)  # the GPU targets' archs are the ones these tests know
    with pytest.raises(ValueError):
        cuda_target("80")


def test_same_signatures_as_cpu_kernels():
    """Same names, argument order, shapes and dtypes as the CPU kernels (each op's cpu maker)."""

    def dim(d):
        return d.name if hasattr(d, "name") else int(d)  # symbolic m, or a constant of any int type

    def signature(f):
        sig = []
        for p in f.params:
            shape = getattr(p, "shape", None)
            if shape is None:
                sig.append((p.name, "scalar", str(p.ty)))
            else:
                sig.append((p.name, tuple(dim(d) for d in shape), str(p.dtype)))
        return sig

    gpu = {str(f.attrs["global_symbol"]): signature(f) for f in cuda_kernels()}
    host = {str(f.attrs["global_symbol"]): signature(f) for f in all_kernels(gpu=False)}
    for name, sig in host.items():
        assert gpu[name] == sig, name
    assert any(kind == "scalar" and ty == "int64" for sig in gpu.values() for _, kind, ty in sig)  # start


def _kernel_body(source, name):
    start = source.index(f" {name}_kernel(", source.index(f" {name}_kernel(") + 1)  # the definition, after the declaration
    end = source.find('extern "C"', start)
    return source[start : end if end != -1 else None]


def test_indexing_kernels_bound_their_inputs():
    """The CUDA kernels that index with an input clamp it as the CPU ones do (tested on the CPU in
    test_kernel_bounds.py): token ids and positions to their tables, counts and indices to their buffers."""
    indexing = [f for f in cuda_kernels() if str(f.attrs["global_symbol"]).startswith(("embed_", "up_", "down_"))]
    source = cuda.cuda_source(indexing, "sm_80")
    for f in indexing:
        name = str(f.attrs["global_symbol"])
        body = _kernel_body(source, name)
        clamps = body.count("max(min(")
        wanted = 2 if name.startswith("embed_pos") else 1  # ids (and start); count (and the indices)
        assert clamps >= wanted, (name, clamps)


def test_interface_errors():
    with pytest.raises(ValueError):
        cuda.linear("bad", 8, 8, rows=2, bias=False)
    with pytest.raises(ValueError):
        cuda.glu("bad", 8, rows=1, act="tanh")
    with pytest.raises(ValueError):
        cuda.select("bad", 8, rows=None)
    with pytest.raises(ValueError):
        cuda.linear_rows("bad", 8, 8, rows=1)


# ---------------------------------------------------------------------------------- GPU runs


def gpu_present():
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no CUDA runtime at all
        return False


def gpu_arch():
    """The listed arch to build for this GPU: its own, else the newest older one (PTX JIT)."""
    cc = int(tvm.cuda(0).compute_version.replace(".", ""))
    listed = sorted(int(a[3:]) for a in ARCHS)
    usable = [a for a in listed if a <= cc]
    return f"sm_{usable[-1] if usable else listed[0]}"


def make_gpu_runner(kernels, lib_path):
    """call(name, *args): numpy arrays go to the GPU and come back after the call (in place).

    Each array is passed the way the runtime passes activations: as a view of its first rows
    in a taller GPU allocation (``buf[:m]``), whose extra rows are poisoned with NaN / -1.
    """
    lib = tvm.runtime.load_module(lib_path)
    dev = tvm.cuda(0)

    def to_device(a):
        tall = np.full((a.shape[0] + MAX_ROWS,) + a.shape[1:], np.nan if a.dtype.kind == "f" else -1, a.dtype)
        tall[: a.shape[0]] = a
        base = tvm.runtime.tensor(tall, device=dev)
        return base, base._create_view(a.shape)

    def call(name, *args):
        placed = [to_device(a) if isinstance(a, np.ndarray) else (None, a) for a in args]
        lib[name](*[view for _, view in placed])
        dev.sync()
        for a, (base, _) in zip(args, placed):
            if base is not None:
                back = base.numpy()
                a[...] = back[: a.shape[0]]
                tail = back[a.shape[0] :]
                assert (np.isnan(tail).all() if a.dtype.kind == "f" else (tail == -1).all()), f"{name} wrote out of bounds"

    return call


@pytest.fixture(scope="module")
def run(build_dir):
    if not gpu_present():
        if os.environ.get("PICOMPILE_CUDA_EMULATE") == "1":  # opt-in: the CUDA source run on the CPU (cuda_emulator)
            import cuda_emulator

            return cuda_emulator.Emulated(cuda_kernels(), workdir=str(build_dir)).runner(extra_rows=MAX_ROWS)
        pytest.skip("no CUDA GPU here (tvm.cuda(0).exist is false)")
    path, _, _ = built(gpu_arch(), build_dir)
    return make_gpu_runner(cuda_kernels(), path)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)










@pytest.mark.parametrize("variant,m", VARIANTS + [("p", 70)])
@pytest.mark.parametrize("cfg", LINEAR)
def test_linear(run, cfg, variant, m):
    K, N, bias, act, res = LINEAR[cfg]
    rng = np.random.default_rng(0)
    x, w, b = rand(rng, m, K, scale=0.5), rand(rng, K, N, scale=0.5), rand(rng, N)
    r, y = rand(rng, m, N), rand(rng, m, N)
    run(kname("linear", cfg, variant), *([x, w] + ([b] if bias else []) + ([r] if res else []) + [y]))
    ref = act_ref(x.astype(np.float64) @ w + (b if bias else 0), act) + (r if res else 0)
    close(y, ref)


@pytest.mark.parametrize("m", [1, 3, 70])
@pytest.mark.parametrize("cfg", LINEAR_ROWS)
def test_linear_rows(run, cfg, m):
    K, N, act = LINEAR_ROWS[cfg]
    rng = np.random.default_rng(8)
    x, w, b, y = rand(rng, m, K, scale=0.5), rand(rng, N, K, scale=0.5), rand(rng, N), rand(rng, m, N)
    run(kname("linrows", cfg, "p"), x, w, b, y)
    close(y, act_ref(x.astype(np.float64) @ w.T + b, act))


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("cfg", GLU)
def test_glu(run, cfg, variant, m):
    F, act = GLU[cfg]
    rng = np.random.default_rng(1)
    t, y = rand(rng, m, 2 * F, scale=3.0), rand(rng, m, F)
    run(kname("glu", cfg, variant), t, y)
    t64 = t.astype(np.float64)
    close(y, act_ref(t64[:, :F], act) * t64[:, F:])


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("D", NORM_D)
def test_layer_norm(run, D, variant, m):
    rng = np.random.default_rng(2)
    x = rand(rng, m, D) + 3.0  # a non-zero mean
    g, b, y = rand(rng, D), rand(rng, D), rand(rng, m, D)
    run(kname("ln", D, variant), x, g, b, y)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    close(y, (x64 - mu) / np.sqrt(var + 1e-5) * g + b)


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("D", NORM_D)
def test_rms_norm(run, D, variant, m):
    rng = np.random.default_rng(3)
    x, g, y = rand(rng, m, D), rand(rng, D), rand(rng, m, D)
    run(kname("rms", D, variant), x, g, y)
    x64 = x.astype(np.float64)
    close(y, x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * g)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", VARIANTS)
def test_embed(run, variant, m, start):
    rng = np.random.default_rng(4)
    ids = rng.integers(0, V, m).astype(np.int64)
    table, pos, y = rand(rng, V, 36), rand(rng, MAX_CTX, 36), rand(rng, m, 36)
    run(kname("embed", "pos", variant), ids, table, pos, start, y)
    close(y, table[ids] + pos[start : start + m], tol=1e-6)
    y2 = rand(rng, m, 36)
    run(kname("embed", "nopos", variant), ids, table, y2)
    np.testing.assert_array_equal(y2, table[ids])


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("cfg", MERGE)
def test_merge(run, cfg, variant, m):
    D, parts, bias, res = MERGE[cfg]
    rng = np.random.default_rng(9)
    r, ps, b, out = rand(rng, m, D), [rand(rng, m, D) for _ in range(parts)], rand(rng, D), rand(rng, m, D)
    run(kname("merge", cfg, variant), *(([r] if res else []) + ps + ([b] if bias else []) + [out]))
    close(out, sum(p.astype(np.float64) for p in ps) + (b if bias else 0) + (r if res else 0), tol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "H%d_KVH%d_hd%d" % h)
def test_rope_kv_write(run, heads, variant, m, start, rope, qk_norm):
    H, KVH, hd = heads
    rng = np.random.default_rng(5)
    qkv = rand(rng, m, (H + 2 * KVH) * hd)
    ang = rng.uniform(0, 2 * np.pi, (MAX_CTX, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    norms = [(1 + 0.3 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2)] if qk_norm else None
    kc, vc = rand(rng, KVH, MAX_CTX, hd), rand(rng, KVH, MAX_CTX, hd)
    kc0, vc0 = kc.copy(), vc.copy()
    q = rand(rng, m, H * hd)
    run(kname("rope", f"{H}_{KVH}_{hd}_{rope}{'_qknorm' if qk_norm else ''}", variant),
        *([qkv] + ([cos, sin] if rope else []) + (norms or []) + [kc, vc, q, start]))
    check_rope_kv_write(qkv, cos, sin, kc, vc, kc0, vc0, q, heads, start, rope, norms)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "H%d_KVH%d_hd%d" % h)
def test_attention(run, heads, variant, m, start):
    H, KVH, hd = heads
    rng = np.random.default_rng(6)
    q = rand(rng, m, H * hd, scale=2.0)  # peaked softmax: checks the max subtraction
    kc, vc = rand(rng, KVH, MAX_CTX, hd), rand(rng, KVH, MAX_CTX, hd)
    out = rand(rng, m, H * hd)
    name = kname("attn", f"{H}_{KVH}_{hd}", variant)
    run(name, q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, H, KVH, hd, 1 / math.sqrt(hd)))
    # causality: garbage in every cache entry after position start + i leaves rows <= i as they were
    base = out.copy()
    for i in range(m):
        kc2, vc2 = kc.copy(), vc.copy()
        kc2[:, start + i + 1 :] = 1e3
        vc2[:, start + i + 1 :] = np.nan
        out2 = rand(rng, m, H * hd)
        run(name, q, kc2, vc2, out2, start)
        np.testing.assert_array_equal(out2[: i + 1], base[: i + 1])


@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 7)])
def test_attention_long_context(run, variant, m):
    rng = np.random.default_rng(7)
    start = LONG_CTX - m - 3
    q, kc, vc, out = rand(rng, m, 64), rand(rng, 1, LONG_CTX, 16), rand(rng, 1, LONG_CTX, 16), rand(rng, m, 64)
    run(kname("attn", "long", variant), q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, 4, 1, 16, 0.25))


@pytest.mark.parametrize("start", [0, 5, 12])
@pytest.mark.parametrize("variant,m", VARIANTS)
def test_attention_soft_capped_and_windowed(run, variant, m, start):
    """Gemma 2's attention: softcap * tanh(s / softcap) of the scores, and a query at p attends to p - W + 1 .. p
    only: garbage before the window, as after p, leaves its row as it was."""
    H, KVH, hd = GEMMA_HEADS
    rng = np.random.default_rng(8)
    q = rand(rng, m, H * hd, scale=3.0)  # scores beyond the cap
    kc, vc = rand(rng, KVH, MAX_CTX, hd), rand(rng, KVH, MAX_CTX, hd)
    out = rand(rng, m, H * hd)
    name = kname("attn", "gemma", variant)
    run(name, q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, H, KVH, hd, 0.3, softcap=2.0, window=GEMMA_WINDOW))
    base = out.copy()
    for i in range(m):
        first = max(0, start + i + 1 - GEMMA_WINDOW)
        kc2, vc2 = kc.copy(), vc.copy()
        kc2[:, :first], vc2[:, :first] = 1e3, np.nan
        kc2[:, start + i + 1:], vc2[:, start + i + 1:] = 1e3, np.nan
        out2 = rand(rng, m, H * hd)
        run(name, q, kc2, vc2, out2, start)
        np.testing.assert_array_equal(out2[i], base[i])


@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 7)])
def test_attention_long_context_windowed(run, variant, m):
    rng = np.random.default_rng(7)
    start = LONG_CTX - m - 3
    q, kc, vc = rand(rng, m, 64, scale=4.0), rand(rng, 1, LONG_CTX, 16), rand(rng, 1, LONG_CTX, 16)
    out = rand(rng, m, 64)
    run(kname("attn", "long_window", variant), q, kc, vc, out, start)
    close(out, attention_ref(q, kc, vc, start, 4, 1, 16, 0.25, softcap=50.0, window=LONG_WINDOW))


@pytest.mark.parametrize("variant,m", VARIANTS)
@pytest.mark.parametrize("D", NORM_D)
def test_rms_norm_with_residual(run, D, variant, m):
    rng = np.random.default_rng(3)
    x, g, r, y = rand(rng, m, D), rand(rng, D), rand(rng, m, D), rand(rng, m, D)
    run(kname("rms_res", D, variant), x, g, r, y)
    x64 = x.astype(np.float64)
    close(y, x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * g + r)


@pytest.mark.parametrize("variant,m", VARIANTS)
def test_softcap(run, variant, m):
    rng = np.random.default_rng(10)
    x, y = rand(rng, m, V, scale=4.0), rand(rng, m, V)
    x[0, :5] = [0.0, 1e-6, -1e-6, 200.0, -200.0]
    run(kname("softcap", V, variant), x, y)
    close(y, 3.0 * np.tanh(x.astype(np.float64) / 3.0), tol=1e-6)


@pytest.mark.parametrize("variant,m", VARIANTS)
def test_embed_scaled(run, variant, m):
    rng = np.random.default_rng(4)
    ids = rng.integers(0, V, m).astype(np.int64)
    table, y = rand(rng, V, 36), rand(rng, m, 36)
    run(kname("embed", "scaled", variant), ids, table, y)
    np.testing.assert_array_equal(y, table[ids] * np.float32(EMBED_SCALE))


@pytest.mark.parametrize("frac", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("n", SELECT_N)
def test_select(run, n, frac):
    rng = np.random.default_rng(10)
    scores = rand(rng, 1, n)
    thr = np.array([np.quantile(scores, 1 - frac) if frac < 1 else -np.inf], np.float32)
    if frac == 0.0:
        thr[0] = scores.max()  # nothing strictly above
    idx = np.full((1, n), -7, np.int32)
    count = np.full((1, 1), -1, np.int32)
    run(kname("select", n, "d"), scores, thr, idx, count)
    want = np.nonzero(scores[0] > thr[0])[0]
    assert count[0, 0] == len(want)
    np.testing.assert_array_equal(idx[0, : len(want)], want)
    assert (idx[0, len(want) :] == -7).all()


def _active(rng, n, count):
    idx = np.zeros((1, n), np.int32)
    idx[0, :count] = rng.permutation(n)[:count]
    return idx, np.array([[count]], np.int32)


@pytest.mark.parametrize("count_frac", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("cfg", list(UP) + ["stride"])
def test_sparse_up(run, cfg, count_frac):
    D, n, gated, act = UP.get(cfg, (40, 100, False, "none"))
    rng = np.random.default_rng(11)
    count = int(n * count_frac)
    idx, cnt = _active(rng, n, count)
    width = 2 * n if gated else n
    x, w, b = rand(rng, 1, D), rand(rng, width, D, scale=0.3), rand(rng, width)
    h = np.full((1, n), 7.0, np.float32)
    run(kname("up", cfg, "d"), x, idx, cnt, w, b, h)
    rows = idx[0, :count]
    pre = w[rows].astype(np.float64) @ x[0] + b[rows]
    ref = act_ref(pre, act)
    if gated:
        ref = ref * (w[n + rows].astype(np.float64) @ x[0] + b[n + rows])
    close(h[0, :count], ref)
    assert (h[0, count:] == 7.0).all()


@pytest.mark.parametrize("count_frac", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("cfg", DOWN)
def test_sparse_down(run, cfg, count_frac):
    n, D = DOWN[cfg]
    rng = np.random.default_rng(12)
    count = int(n * count_frac)
    idx, cnt = _active(rng, n, count)
    h, w, out = rand(rng, 1, n), rand(rng, n, D, scale=0.3), rand(rng, 1, D)
    run(kname("down", cfg, "d"), h, idx, cnt, w, out)
    rows = idx[0, :count]
    close(out[0], h[0, :count].astype(np.float64) @ w[rows] if count else np.zeros(D))


@pytest.mark.parametrize("start", [MAX_CTX + 5, -3])
def test_embed_out_of_range(run, start):
    """Ids past the table and positions past the positions table are clamped (the runner's NaN rows behind
    every buffer would show a read outside it)."""
    rng = np.random.default_rng(13)
    ids = np.array([-1, V, 10**12, 3], np.int64)
    table, pos, y = rand(rng, V, 36), rand(rng, MAX_CTX, 36), rand(rng, 4, 36)
    run(kname("embed", "pos", "p"), ids, table, pos, start, y)
    close(y, table[np.clip(ids, 0, V - 1)] + pos[np.clip(start + np.arange(4), 0, MAX_CTX - 1)], tol=1e-6)


@pytest.mark.parametrize("count", [-3, 150, 2**31 - 1])
def test_sparse_out_of_range(run, count):
    """Counts past the index buffer and indices past the weight rows are clamped, as on the CPU."""
    rng = np.random.default_rng(14)
    n = 100
    idx = rng.choice([-5, n, n + 100, 2**31 - 1, -(2**31), 0, 7, n - 1], (1, n)).astype(np.int32)
    cnt = np.array([[count]], np.int32)
    rows = np.clip(idx[0, : min(max(count, 0), n)], 0, n - 1)
    D = UP["gated"][0]
    x, w, b, h = rand(rng, 1, D), rand(rng, 2 * n, D, scale=0.3), rand(rng, 2 * n), np.full((1, n), 7.0, np.float32)
    run(kname("up", "gated", "d"), x, idx, cnt, w, b, h)
    gate = w[rows].astype(np.float64) @ x[0] + b[rows]
    close(h[0, : len(rows)], act_ref(gate, "silu") * (w[n + rows].astype(np.float64) @ x[0] + b[n + rows]))
    D = DOWN["small"][1]
    down, out = rand(rng, n, D, scale=0.3), rand(rng, 1, D)
    run(kname("down", "small", "d"), h, idx, cnt, down, out)
    close(out[0], h[0, : len(rows)].astype(np.float64) @ down[rows] if len(rows) else np.zeros(D))


def test_runtime_only_process(run, build_dir):
    """A fresh process with TVM_USE_RUNTIME_LIB=1 (no compiler, no NVRTC) loads the library and runs a
    kernel: the device code comes from the embedded fatbin, nothing is compiled at load time."""
    if not gpu_present():
        pytest.skip("needs a GPU (the emulation runs no CUDA runtime)")
    path, _, _ = built(gpu_arch(), build_dir)
    script = textwrap.dedent(
        f"""
        import os
        os.environ["TVM_USE_RUNTIME_LIB"] = "1"
        from pathlib import Path
        import numpy as np, tvm, tvm.runtime
        from tvm.base import _LOADED_LIBS
        from tvm_ffi.libinfo import load_lib_ctypes
        # TVM 0.27's runtime-only mode does not autoload the CUDA sidecar library: load it here
        if "tvm_runtime_cuda" not in _LOADED_LIBS:
            _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
                "tvm", "tvm_runtime_cuda", "RTLD_LOCAL",
                extra_lib_paths=[Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent])
        lib = tvm.runtime.load_module({path!r})
        assert [m.kind for m in lib.imports] == ["cuda"]
        dev = tvm.cuda(0)
        rng = np.random.default_rng(0)
        x, w, b, r = (rng.standard_normal(s).astype(np.float32) for s in ((5, 64), (64, 128), (128,), (5, 128)))
        args = [tvm.runtime.tensor(a, device=dev) for a in (x, w, b, r, np.zeros((5, 128), np.float32))]
        lib["linear_tiles_p"](*args)
        ref = x.astype(np.float64) @ w + b + r
        assert np.allclose(args[-1].numpy(), ref, rtol=1e-4, atol=1e-4)
        with open("/proc/self/maps") as f:
            maps = f.read()
        assert "libtvm_compiler" not in maps and "libnvrtc" not in maps
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
