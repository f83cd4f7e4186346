"""The GPU's weight formats: fp16 weights in the float CUDA kernels, and the kernels over block-quantized weights
in ``passes.kernels.quant``'s rows layout (``ops.linear_qrows``, ``linear_rows_q``, ``linear_kn_q``, ``embed_q``,
``sparse_up_q``, ``sparse_down_q``).

Everywhere: the CPU twins of the quantized kernels (the same ops' cpu makers) against numpy (weights
quantized by ``quant.quantize`` / ``pack_rows``, references over ``quant.dequantize``). With nvcc (no GPU
needed): the CUDA set (quantized and fp16 variants) built for each of sm_75, sm_86, sm_89 and sm_90 into ONE
module per arch (one nvcc run each): the fatbin holds SASS for the arch plus its PTX and every kernel; the
module source has one __global__ kernel per function; every CUDA kernel has its CPU twin's signature. With a
GPU (``tvm.cuda(0).exist``): the same numpy checks run on the CUDA kernels. With PICOMPILE_CUDA_EMULATE=1 (and
g++): the same checks on the CUDA kernels' generated source run on the CPU by ``cuda_emulator`` (~1 minute).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time

import numpy as np
import pytest

if "CUDA_PATH" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_PATH"] = "/usr/local/cuda"  # TVM's CUDA lookup follows the nvcc on PATH, maybe a wrapper

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402

from passes.kernels import cpu, cuda, ops, quant  # noqa: E402
from passes.targets import CPU_ISAS  # noqa: E402
from runtime.dtypes import WEIGHT_FORMATS  # noqa: E402
from kernel_reference import act_ref, aligned, close, fatbin_entries  # noqa: E402

ARCHS = ["sm_75", "sm_86", "sm_89", "sm_90"]
BUILT_ARCHS = ["sm_80", "sm_90"]  # built here (nvcc 10-25 s an arch); test_cuda_kernels.py builds sm_75 and sm_89
BITS = (8, 4)
V = 50  # embedding rows
MAX_CTX = 20
QLINEAR = {  # name: (K, N, bias, act, residual)
    "runs": (256, 72, True, "silu", True),  # whole 128-byte runs for int8 and int4, 18 GEMV blocks
    "short": (96, 70, False, "none", False),  # 3 blocks a row: idle lanes; N tails (4-row GEMV block, GEMM tile)
}
QKN = {"bias": (50, 96, True, True), "wide": (40, 288, False, False)}  # linear_kn_q: (K, N, bias, residual)
QUP = {"gated": (96, 50, True, "silu"), "plain": (256, 40, False, "relu")}  # (D, n, gated, act)
QDOWN = {"small": (50, 96), "wide": (40, 288)}  # (n, D); 288 = 9 blocks: a partial last run
QEMBED = {"pos": (64, MAX_CTX, "d"), "nopos": (96, None, "p")}  # (D, positions, variant)
F16_LINEAR = (40, 72, True, "gelu", True)
F16_UP = {"gated": (40, 50, True, "silu"), "odd": (130, 30, False, "relu")}  # 130: scalar (not half4) lanes
ROWS = {"d": 1, "p": None}


def kn(*parts):
    return "_".join(str(p) for p in parts)


def fmt(bits, sdtype="float16"):
    return dataclasses.replace(WEIGHT_FORMATS[f"int{bits}"], scale_dtype=sdtype)


# ---------------------------------------------------------------------------------- kernel sets


def quant_kernels(device):
    """The quantized kernels: ops' makers for ``device`` ("cpu" or "cuda"), the same arguments for both."""
    make = lambda op: getattr(getattr(ops, op), device)  # noqa: E731
    funcs = []
    for bits in BITS:
        for cfg, (K, N, bias, act, res) in QLINEAR.items():
            for v, rows in ROWS.items():
                funcs.append(make("linear_qrows")(kn("lq", bits, cfg, v), K, N, rows=rows, bits=bits, bias=bias,
                                                  act=act, residual=res))
        for cfg, (D, n, gated, act) in QUP.items():
            funcs.append(make("sparse_up_q")(kn("upq", bits, cfg), D, n, rows=1, gated=gated, act=act, bits=bits))
        for cfg, (n, D) in QDOWN.items():
            funcs.append(make("sparse_down_q")(kn("downq", bits, cfg), n, D, rows=1, bits=bits))
        for cfg, (D, positions, v) in QEMBED.items():
            funcs.append(make("embed_q")(kn("embq", bits, cfg, v), V, D, rows=ROWS[v], positions=positions,
                                             bits=bits))
        funcs.append(make("linear_rows_q")(kn("lrq", bits, "p"), 96, 70, rows=None, bits=bits, act="silu"))
        for cfg, (K, N, bias, res) in QKN.items():
            funcs.append(make("linear_kn_q")(kn("lknq", bits, cfg, "p"), K, N, rows=None, bits=bits, bias=bias,
                                             act="relu" if bias else "none", residual=res))
    # fp32 scales, one of each kind
    K, N, bias, act, res = QLINEAR["short"]
    for v, rows in ROWS.items():
        funcs.append(make("linear_qrows")(kn("lq", 4, "s32", v), K, N, rows=rows, bits=4, sdtype="float32",
                                          bias=True, act="relu", residual=True))
    funcs.append(make("sparse_up_q")(kn("upq", 8, "s32"), 96, 50, rows=1, gated=True, act="gelu", bits=8,
                                     sdtype="float32"))
    funcs.append(make("sparse_down_q")(kn("downq", 4, "s32"), 50, 96, rows=1, bits=4, sdtype="float32"))
    funcs.append(make("embed_q")(kn("embq", 8, "s32", "p"), V, 64, rows=None, positions=MAX_CTX, bits=8,
                                     sdtype="float32"))
    return funcs


def f16_kernels(device):
    """The float kernels that read a weight matrix, with fp16 weights."""
    make = lambda op: getattr(getattr(ops, op), device)  # noqa: E731
    K, N, bias, act, res = F16_LINEAR
    funcs = [make("linear")(kn("lf16", v), K, N, rows=rows, bias=bias, act=act, residual=res, wdtype="float16")
             for v, rows in ROWS.items()]
    funcs.append(make("linear_rows")("lrf16_p", 40, 72, rows=None, act="relu", wdtype="float16"))
    funcs += [make("embed")(kn("embf16", v), V, 36, rows=rows, positions=MAX_CTX, wdtype="float16")
              for v, rows in ROWS.items()]
    funcs += [make("sparse_up")(kn("upf16", cfg), D, n, rows=1, gated=gated, act=act, wdtype="float16")
              for cfg, (D, n, gated, act) in F16_UP.items()]
    funcs.append(make("sparse_down")("downf16", 50, 40, rows=1, wdtype="float16"))
    return funcs


def gpu_kernels():
    funcs = quant_kernels("cuda") + f16_kernels("cuda")
    saved = cuda.UP_MAX_BLOCKS  # sparse_up_q's grid-stride loop: a 2-block grid walking 50 neurons (16 a pass)
    cuda.UP_MAX_BLOCKS = 2
    try:
        funcs.append(cuda.sparse_up_q("upq_4_stride", 96, 50, rows=1, gated=False, act="none", bits=4))
    finally:
        cuda.UP_MAX_BLOCKS = saved
    return funcs


def signature(f):
    def dim(d):
        return d.name if hasattr(d, "name") else int(d)

    return [(p.name, "scalar", str(p.ty)) if getattr(p, "shape", None) is None
            else (p.name, tuple(dim(d) for d in p.shape), str(p.dtype)) for p in f.params]


def test_same_signatures_as_cpu_twins():
    """Every CUDA kernel here has its CPU twin's parameters: names, order, shapes, dtypes."""
    gpu = {str(f.attrs["global_symbol"]): signature(f) for f in quant_kernels("cuda") + f16_kernels("cuda")}
    host = {str(f.attrs["global_symbol"]): signature(f) for f in quant_kernels("cpu") + f16_kernels("cpu")}
    assert gpu.keys() == host.keys()
    for name, sig in host.items():
        assert gpu[name] == sig, name
    lq = dict((p, (shape, dt)) for p, shape, dt in host["lq_4_runs_d"])
    assert lq["w"] == ((72, 128), "uint8") and lq["ws"] == ((72, 8), "float16")
    assert dict((p, dt) for p, _, dt in host["lf16_d"])["w"] == "float16"


def test_interface_errors():
    with pytest.raises(ValueError):
        cuda.linear_qrows("bad", 100, 8, rows=1, bits=4, bias=False)  # K not whole blocks
    with pytest.raises(ValueError):
        cuda.sparse_up_q("bad", 64, 8, rows=1, gated=False, act="relu", bits=2)
    with pytest.raises(ValueError):
        cuda.sparse_down_q("bad", 8, 64, rows=1, bits=8, sdtype="bfloat16")
    with pytest.raises(ValueError):
        cuda.sparse_down_q("bad", 8, 64, rows=None, bits=8)


# ---------------------------------------------------------------------------------- runners


def make_cpu_runner(lib):
    def call(name, *args):
        placed = [aligned(a) if isinstance(a, np.ndarray) else a for a in args]
        lib[name](*[tvm_ffi.from_dlpack(a) if isinstance(a, np.ndarray) else a for a in placed])
        for a, p in zip(args, placed):
            if isinstance(a, np.ndarray):
                a[...] = p

    call.device = "cpu"
    return call


def gpu_present():
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no CUDA runtime at all
        return False


def poison(dtype):
    return np.nan if dtype.kind == "f" else np.iinfo(dtype).max


def make_gpu_runner(lib):
    """Arrays go to the GPU as views of taller, poisoned allocations; their poisoned rows must come back
    unchanged (no write outside an argument)."""
    dev = tvm.cuda(0)

    def call(name, *args):
        placed = []
        for a in args:
            if not isinstance(a, np.ndarray):
                placed.append((None, a))
                continue
            tall = np.full((a.shape[0] + 4,) + a.shape[1:], poison(a.dtype), a.dtype)
            tall[: a.shape[0]] = a
            base = tvm.runtime.tensor(tall, device=dev)
            placed.append((base, base._create_view(a.shape)))
        lib[name](*[view for _, view in placed])
        dev.sync()
        for a, (base, _) in zip(args, placed):
            if base is not None:
                back = base.numpy()
                a[...] = back[: a.shape[0]]
                tail = back[a.shape[0]:]
                assert (np.isnan(tail).all() if a.dtype.kind == "f" else (tail == poison(a.dtype)).all()), name

    call.device = "gpu"
    return call


_BUILDS = {}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-quant")


def built(arch, build_dir):
    """The CUDA set built for ``arch``, once per session: (path, facts, seconds, kernels)."""
    if arch not in _BUILDS:
        funcs = gpu_kernels()
        path = str(build_dir / f"quant_{arch}.so")
        began = time.perf_counter()
        facts = cuda.build(funcs, arch, path)
        _BUILDS[arch] = (path, facts, time.perf_counter() - began, funcs)
    return _BUILDS[arch]


@pytest.fixture(scope="module", params=["cpu", "gpu", "emulated"])
def run(request, build_dir):
    """call(name, *args) on the CPU twins, then (where a GPU is) on the CUDA kernels, then (opt-in) on the CUDA
    kernels' source emulated on the CPU."""
    if request.param == "emulated":
        import cuda_emulator

        if os.environ.get("PICOMPILE_CUDA_EMULATE") != "1" or not cuda_emulator.available():
            pytest.skip("CUDA emulation is opt-in: PICOMPILE_CUDA_EMULATE=1 (needs g++)")
        return cuda_emulator.Emulated(gpu_kernels(), workdir=str(build_dir)).runner()
    if request.param == "cpu":
        path = build_dir / "quant_cpu.so"
        if not path.exists():
            cpu.build(quant_kernels("cpu") + f16_kernels("cpu"), CPU_ISAS["avx2"].llvm_target(), str(path))
        return make_cpu_runner(tvm.runtime.load_module(str(path)))
    if not gpu_present():
        pytest.skip("no CUDA GPU here (tvm.cuda(0).exist is false)")
    _require_nvcc()
    cc = int(tvm.cuda(0).compute_version.replace(".", ""))
    usable = [a for a in ARCHS if int(a[3:]) <= cc]
    path = built(usable[-1] if usable else ARCHS[0], build_dir)[0]
    return make_gpu_runner(tvm.runtime.load_module(path))


def _require_nvcc():
    if cuda.nvcc_path() is None or not os.path.isdir(os.environ.get("CUDA_PATH", "/usr/local/cuda")):
        pytest.skip("nvcc / the CUDA toolkit is not installed (set CUDA_PATH)")


# ---------------------------------------------------------------------------------- builds (no GPU needed)


@pytest.mark.parametrize("arch", BUILT_ARCHS)
def test_build_embeds_binary(arch, build_dir):
    _require_nvcc()
    path, facts, seconds, funcs = built(arch, build_dir)
    print(f"{arch}: {len(funcs)} kernels built in {seconds:.1f} s (nvcc {facts['nvcc_seconds']:.1f} s)")
    assert facts["binary_format"] == "fatbin" and facts["kernels"] == len(funcs)
    fmt_, code = cuda.read_packed_cuda(path)
    assert fmt_ == "fatbin"
    sm = int(arch[3:])
    entries = fatbin_entries(code)
    assert {(kind, s) for kind, s, _ in entries} == {(2, sm), (1, sm)}  # SASS for the arch + its PTX
    (elf,) = [payload for kind, _, payload in entries if kind == 2]
    assert elf[:4] == b"\x7fELF" and struct.unpack_from("<H", elf, 18)[0] == 190  # EM_CUDA
    missing = [str(f.attrs["global_symbol"]) for f in funcs if f"{f.attrs['global_symbol']}_kernel".encode() not in elf]
    assert not missing, f"kernels missing from the {arch} cubin: {missing}"


def test_module_source_is_cuda():
    """One __global__ kernel per PrimFunc (declaration + definition); the quantized readers use 32-bit loads
    of their row bytes and warp shuffles where the docstrings say so."""
    _require_nvcc()
    funcs = gpu_kernels()
    source = cuda.cuda_source(funcs, "sm_86")
    names = [str(f.attrs["global_symbol"]) for f in funcs]
    assert source.count('extern "C" __global__ void __launch_bounds__') == 2 * len(funcs)
    for name in names:
        assert source.count(f" {name}_kernel(") == 2, name
        body = source[source.rindex(f" {name}_kernel(") :]
        body = body[: body.find('extern "C"') if 'extern "C"' in body else None]
        if name.startswith(("lq_", "upq_", "downq_")) and name.endswith(("_d", "_runs", "_gated", "_plain", "_small",
                                                                          "_wide", "_s32", "_stride")):
            assert "*(int*)(" in body or "*(uint*)(" in body, f"{name}: no 32-bit loads of the row bytes"
        if name.startswith(("lq_",)) and name.endswith("_d") or name.startswith("upq_"):
            assert "__shfl" in body, f"{name}: no warp shuffle"
        if name.startswith(("upq_", "downq_", "embq_")):  # counts, indices, token ids clamped (as in the CPU's)
            assert body.count("max(min(") >= (2 if name.startswith("embq_") and "nopos" not in name else 1), name


# ---------------------------------------------------------------------------------- numerics (CPU twins, GPU)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def quantized(rng, rows, cols, bits, sdtype="float16", scale=0.3):
    """(q, scales) of a random [rows, cols] matrix in the rows layout, and the fp32 matrix they stand for."""
    f = fmt(bits, sdtype)
    q, s = quant.quantize(rand(rng, rows, cols, scale=scale), f, axis=1)
    packed, scales = quant.pack_rows(q, s, f)
    return packed, scales, quant.dequantize(q, s, axis=1)


def _active(rng, n, count):
    idx = np.zeros((1, n), np.int32)
    idx[0, :count] = rng.permutation(n)[:count]
    return idx, np.array([[count]], np.int32)


def _linear_cases():
    cases = [(bits, cfg, "float16") for bits in BITS for cfg in QLINEAR] + [(4, "s32", "float32")]
    return [pytest.param(*c, id=kn(*c[:2])) for c in cases]


@pytest.mark.parametrize("m", [1, 3, 70])
@pytest.mark.parametrize("bits,cfg,sdtype", _linear_cases())
def test_linear_qrows(run, bits, cfg, sdtype, m):
    K, N, bias, act, res = QLINEAR["short"] if cfg == "s32" else QLINEAR[cfg]
    if cfg == "s32":
        bias, act, res = True, "relu", True
    rng = np.random.default_rng(bits)
    w_q, w_s, w = quantized(rng, N, K, bits, sdtype)  # W^T [N, K]
    x, b, r, y = rand(rng, m, K, scale=0.5), rand(rng, N), rand(rng, m, N), rand(rng, m, N)
    name = kn("lq", bits, cfg, "d" if m == 1 else "p")
    run(name, *([x, w_q, w_s] + ([b] if bias else []) + ([r] if res else []) + [y]))
    close(y, act_ref(x.astype(np.float64) @ w.T + (b if bias else 0), act) + (r if res else 0))
    if m == 1:  # the prefill kernel takes a single row too
        y1 = rand(rng, 1, N)
        run(kn("lq", bits, cfg, "p"), *([x, w_q, w_s] + ([b] if bias else []) + ([r] if res else []) + [y1]))
        close(y1, y, tol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 70])
@pytest.mark.parametrize("bits", BITS)
def test_linear_rows_q(run, bits, m):
    """The quantized FFN parts' prefill GEMMs: up rows W [N, K] (linear_rows_q), down rows W [K, N] (linear_kn_q)."""
    rng = np.random.default_rng(30 + bits)
    w_q, w_s, w = quantized(rng, 70, 96, bits)
    x, b, y = rand(rng, m, 96, scale=0.5), rand(rng, 70), rand(rng, m, 70)
    run(kn("lrq", bits, "p"), x, w_q, w_s, b, y)
    close(y, act_ref(x.astype(np.float64) @ w.T + b, "silu"))
    for cfg, (K, N, bias, res) in QKN.items():
        d_q, d_s, d = quantized(rng, K, N, bits)  # W [K, N], blocks along N
        x2, b2, r2, y2 = rand(rng, m, K, scale=0.5), rand(rng, N), rand(rng, m, N), rand(rng, m, N)
        run(kn("lknq", bits, cfg, "p"), *([x2, d_q, d_s] + ([b2] if bias else []) + ([r2] if res else []) + [y2]))
        close(y2, act_ref(x2.astype(np.float64) @ d + (b2 if bias else 0), "relu" if bias else "none")
              + (r2 if res else 0))


def _up_cases():
    return [pytest.param(bits, cfg, id=kn(bits, cfg)) for bits in BITS for cfg in QUP] + [
        pytest.param(8, "s32", id="8_s32"), pytest.param(4, "stride", id="4_stride")]


@pytest.mark.parametrize("count_frac", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("bits,cfg", _up_cases())
def test_sparse_up_q(run, bits, cfg, count_frac):
    if cfg == "stride" and run.device == "cpu":
        pytest.skip("a GPU schedule variant (its grid), no CPU twin")
    D, n, gated, act = {"s32": (96, 50, True, "gelu"), "stride": (96, 50, False, "none")}.get(cfg) or QUP[cfg]
    sdtype = "float32" if cfg == "s32" else "float16"
    rng = np.random.default_rng(11)
    count = int(n * count_frac)
    idx, cnt = _active(rng, n, count)
    width = 2 * n if gated else n
    w_q, w_s, w = quantized(rng, width, D, bits, sdtype)
    x, b = rand(rng, 1, D), rand(rng, width)
    h = np.full((1, n), 7.0, np.float32)
    run(kn("upq", bits, cfg), x, idx, cnt, w_q, w_s, b, h)
    rows = idx[0, :count]
    ref = act_ref(w[rows].astype(np.float64) @ x[0] + b[rows], act)
    if gated:
        ref = ref * (w[n + rows].astype(np.float64) @ x[0] + b[n + rows])
    close(h[0, :count], ref)
    assert (h[0, count:] == 7.0).all()


@pytest.mark.parametrize("count_frac", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("bits,cfg", [pytest.param(b, c, id=kn(b, c)) for b in BITS for c in QDOWN]
                         + [pytest.param(4, "s32", id="4_s32")])
def test_sparse_down_q(run, bits, cfg, count_frac):
    n, D = (50, 96) if cfg == "s32" else QDOWN[cfg]
    sdtype = "float32" if cfg == "s32" else "float16"
    rng = np.random.default_rng(12)
    count = int(n * count_frac)
    idx, cnt = _active(rng, n, count)
    w_q, w_s, w = quantized(rng, n, D, bits, sdtype)
    h, out = rand(rng, 1, n), rand(rng, 1, D)
    run(kn("downq", bits, cfg), h, idx, cnt, w_q, w_s, out)
    rows = idx[0, :count]
    close(out[0], h[0, :count].astype(np.float64) @ w[rows] if count else np.zeros(D))


@pytest.mark.parametrize("count", [-3, 150])
def test_sparse_q_out_of_range(run, count):
    """Counts past the index buffer and indices past the rows are clamped, as in the float kernels."""
    rng = np.random.default_rng(14)
    D, n = 96, 50
    idx = rng.choice([-5, n, n + 100, 2**31 - 1, -(2**31), 0, 7, n - 1], (1, n)).astype(np.int32)
    rows = np.clip(idx[0, : min(max(count, 0), n)], 0, n - 1)
    w_q, w_s, w = quantized(rng, 2 * n, D, 4)
    x, b, h = rand(rng, 1, D), rand(rng, 2 * n), np.full((1, n), 7.0, np.float32)
    run("upq_4_gated", x, idx, np.array([[count]], np.int32), w_q, w_s, b, h)
    gate = w[rows].astype(np.float64) @ x[0] + b[rows]
    close(h[0, : len(rows)], act_ref(gate, "silu") * (w[n + rows].astype(np.float64) @ x[0] + b[n + rows]))
    d_q, d_s, down = quantized(rng, n, D, 4)
    out = rand(rng, 1, D)
    run("downq_4_small", h, idx, np.array([[count]], np.int32), d_q, d_s, out)
    close(out[0], h[0, : len(rows)].astype(np.float64) @ down[rows] if len(rows) else np.zeros(D))


@pytest.mark.parametrize("bits,cfg,sdtype", [pytest.param(b, c, "float16", id=kn(b, c)) for b in BITS for c in QEMBED]
                         + [pytest.param(8, "s32", "float32", id="8_s32")])
def test_embed_q(run, bits, cfg, sdtype):
    D, positions, variant = (64, MAX_CTX, "p") if cfg == "s32" else QEMBED[cfg]
    rng = np.random.default_rng(4)
    m = 1 if variant == "d" else 5
    ids = np.array([3, -1, V + 7, 0, V - 1][:m], np.int64)  # out-of-range ids are clamped
    t_q, t_s, table = quantized(rng, V, D, bits, sdtype)
    y = rand(rng, m, D)
    want = table[np.clip(ids, 0, V - 1)]
    if positions:
        pos, start = rand(rng, positions, D), 4
        run(kn("embq", bits, cfg, variant), ids, t_q, t_s, pos, start, y)
        want = want + pos[start : start + m]
    else:
        run(kn("embq", bits, cfg, variant), ids, t_q, t_s, y)
    close(y, want, tol=1e-6)


# fp16 weights (math in fp32): the references use the fp16 values as fp32


@pytest.mark.parametrize("m", [1, 3, 70])
def test_linear_f16(run, m):
    K, N, bias, act, res = F16_LINEAR
    rng = np.random.default_rng(20)
    w = rand(rng, K, N, scale=0.5).astype(np.float16)
    x, b, r, y = rand(rng, m, K, scale=0.5), rand(rng, N), rand(rng, m, N), rand(rng, m, N)
    run(kn("lf16", "d" if m == 1 else "p"), x, w, b, r, y)
    close(y, act_ref(x.astype(np.float64) @ w.astype(np.float64) + b, act) + r)
    wr, y2 = rand(rng, 72, 40, scale=0.5).astype(np.float16), rand(rng, m, 72)
    run("lrf16_p", x, wr, b, y2)
    close(y2, act_ref(x.astype(np.float64) @ wr.astype(np.float64).T + b, "relu"))


@pytest.mark.parametrize("variant,m", [("d", 1), ("p", 5)])
def test_embed_f16(run, variant, m):
    rng = np.random.default_rng(21)
    ids = rng.integers(0, V, m).astype(np.int64)
    table, pos, y = rand(rng, V, 36).astype(np.float16), rand(rng, MAX_CTX, 36), rand(rng, m, 36)
    run(kn("embf16", variant), ids, table, pos, 2, y)
    close(y, table[ids].astype(np.float32) + pos[2 : 2 + m], tol=1e-6)


@pytest.mark.parametrize("count_frac", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("cfg", F16_UP)
def test_sparse_f16(run, cfg, count_frac):
    D, n, gated, act = F16_UP[cfg]
    rng = np.random.default_rng(22)
    count = int(n * count_frac)
    idx, cnt = _active(rng, n, count)
    width = 2 * n if gated else n
    w, b, x = rand(rng, width, D, scale=0.3).astype(np.float16), rand(rng, width), rand(rng, 1, D)
    h = np.full((1, n), 7.0, np.float32)
    run(kn("upf16", cfg), x, idx, cnt, w, b, h)
    rows = idx[0, :count]
    w64 = w.astype(np.float64)
    ref = act_ref(w64[rows] @ x[0] + b[rows], act)
    if gated:
        ref = ref * (w64[n + rows] @ x[0] + b[n + rows])
    close(h[0, :count], ref)
    n2, D2 = 50, 40
    idx2, cnt2 = _active(rng, n2, int(n2 * count_frac))
    down, hh, out = rand(rng, n2, D2, scale=0.3).astype(np.float16), rand(rng, 1, n2), rand(rng, 1, D2)
    run("downf16", hh, idx2, cnt2, down, out)
    r2 = idx2[0, : cnt2[0, 0]]
    close(out[0], hh[0, : len(r2)].astype(np.float64) @ down[r2].astype(np.float64) if len(r2) else np.zeros(D2))
