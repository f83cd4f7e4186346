"""Run TVM's generated CUDA C++ on the CPU, to check the CUDA kernels' numbers on a machine without a GPU.

Opt-in (``PICOMPILE_CUDA_EMULATE=1``, see test_cuda_quant_kernels.py); a test aid, not a simulator. The
kernel source is ``cuda.cuda_source``'s, compiled by g++ against a small prelude: one std::thread per CUDA
thread, the blocks of a grid one after another (so ``__shared__`` arrays are function statics), barriers
for ``__syncthreads``, warp shuffles through per-warp slots and barriers, ``half`` as ``_Float16``. The
launch extents and the kernel's scalar arguments are read from the host function TVM lowers (its
``call_ffi_kernel``), evaluated for the call's ``m`` / ``start``. What it checks: the index arithmetic, the
predicates, the reductions and the layouts a kernel computes, with every thread's code as TVM wrote it. What
it cannot: timing, races between blocks, memory-model or alignment faults, launch limits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import tvm

from passes.kernels import cuda

PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>
using std::max; using std::min;
using half = _Float16;
struct alignas(8) half4 { half x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
struct Dim { int x, y, z; };
thread_local Dim threadIdx, blockIdx;
thread_local int emu_lane, emu_warp;
#define __global__
#define __launch_bounds__(n)
static std::barrier<>* emu_block;
static std::vector<std::barrier<>*> emu_warps;
static int emu_warp_size[64];
static double emu_slots[64][32];
inline void __syncthreads() { emu_block->arrive_and_wait(); }
inline unsigned __activemask() { return 0xffffffffu; }
template <class T> T emu_from(T v, int src) {  // every lane of the warp posts, then reads lane src
  emu_slots[emu_warp][emu_lane] = (double)v;
  emu_warps[emu_warp]->arrive_and_wait();
  T r = (src >= 0 && src < emu_warp_size[emu_warp]) ? (T)emu_slots[emu_warp][src] : v;
  emu_warps[emu_warp]->arrive_and_wait();
  return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src, int width) {
  return emu_from(v, (emu_lane & ~(width - 1)) + (src % width));
}
template <class T> T __shfl_down_sync(unsigned, T v, int d, int width) {
  return emu_from(v, (emu_lane % width) + d >= width ? emu_lane : emu_lane + d);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int m, int width) { return emu_from(v, emu_lane ^ m); }
static void emu_launch(int gx, int gy, int gz, int tx, int ty, int tz, const std::function<void()>& body) {
  int n = tx * ty * tz;
  for (int bz = 0; bz < gz; ++bz) for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) {
    std::barrier<> block(n);
    emu_block = &block;
    std::vector<std::barrier<>*> warps;
    for (int w = 0; w * 32 < n; ++w) {
      emu_warp_size[w] = std::min(32, n - w * 32);
      warps.push_back(new std::barrier<>(emu_warp_size[w]));
    }
    emu_warps = warps;
    std::vector<std::thread> threads;
    for (int t = 0; t < n; ++t) threads.emplace_back([&, t, bx, by, bz] {
      threadIdx = {t % tx, t / tx % ty, t / (tx * ty)};
      blockIdx = {bx, by, bz};
      emu_lane = t % 32;
      emu_warp = t / 32;
      body();
    });
    for (auto& th : threads) th.join();
    for (auto* w : warps) delete w;
  }
}
"""

_SIGNATURE = re.compile(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)_kernel\((.*?)\) \{')


def available() -> bool:
    return shutil.which("g++") is not None


def _split_args(text):
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += (ch in "([") - (ch in ")]")
        cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _host_launch(func, target):
    """(kernel call arguments, launch tags, let bindings) of the lowered host function, as TVMScript text."""
    name = str(func.attrs["global_symbol"])
    passes = tvm.tirx.get_default_tir_pipeline(target)[0]
    with target:
        text = passes(tvm.IRModule({name: func.with_attr("target", target)})).script()
    host = text[: text.index(f"def {name}_kernel(")]
    lets = dict(re.findall(r"(cse_v\d+): T\.let\[T\.int64\] = (.+)", host))
    call = re.search(rf'T\.call_ffi_kernel\("{name}_kernel", (.*?), launch_params=\[(.*?)\]', host)
    return _split_args(call.group(1)), [t.strip().strip('"') for t in call.group(2).split(",")], lets


def _evaluate(expr, env, lets):
    local = dict(env)
    for var in set(re.findall(r"cse_v\d+", expr)):
        local[var] = _evaluate(lets[var], env, lets)
    expr = re.sub(r"T\.int(64|32)\(", "(", expr).replace("T.max(", "max(").replace("T.min(", "min(")
    return int(eval(expr, {"max": max, "min": min}, local))  # noqa: S307 - TVM's own index expressions


class Emulated:
    """The kernels of ``funcs`` compiled for the CPU; ``call(name, *args)`` takes the PrimFunc's arguments
    (numpy arrays, contiguous, written in place; Python ints for scalars)."""

    def __init__(self, funcs, workdir=None):
        funcs = list(funcs)
        source = cuda.cuda_source(funcs, "sm_86")
        body = source[source.index('extern "C" __global__') :].replace("__shared__ alignas(64)", "alignas(64) static")
        wrappers, self.source_params = [], {}
        for name, args in _SIGNATURE.findall(body):
            casts, names = [], []
            for i, param in enumerate(a.strip() for a in args.split(",")):
                typ, pname = param.replace("__restrict__", "").rsplit(None, 1)
                typ = typ.strip()
                names.append(pname)
                casts.append(f"({typ})a[{i}]" if "*" in typ else f"*({typ}*)a[{i}]")
            self.source_params[name] = names
            wrappers.append(f'extern "C" void run_{name}(void** a, int gx, int gy, int gz, int tx, int ty, int tz) '
                            f'{{ emu_launch(gx, gy, gz, tx, ty, tz, [&] {{ {name}_kernel({", ".join(casts)}); }}); }}')
        code = PRELUDE + body + "\n" + "\n".join(wrappers) + "\n"
        workdir = workdir or tempfile.mkdtemp(prefix="picompile-cuda-emu-")
        key = hashlib.sha1(code.encode()).hexdigest()[:12]
        src, lib = os.path.join(workdir, f"emu_{key}.cpp"), os.path.join(workdir, f"emu_{key}.so")
        if not os.path.exists(lib):
            with open(src, "w") as f:
                f.write(code)
            done = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", lib, src],
                                  capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"g++ failed on the emulated CUDA source:\n{done.stderr[:4000]}")
        self.lib = ctypes.CDLL(lib)
        target = cuda._target("sm_86")
        self.funcs = {str(f.attrs["global_symbol"]): f for f in funcs}
        self.launches = {name: _host_launch(f, target) for name, f in self.funcs.items()}

    def __contains__(self, name):
        return name in self.funcs

    def call(self, name, *args, rows=None):
        """Run kernel ``name``; the prefill row count m is read off the arrays (or given as ``rows``)."""
        func = self.funcs[name]
        by_name, env = {}, {}
        for param, value in zip(func.params, args):
            (by_name if isinstance(value, np.ndarray) else env)[param.name] = value
            for axis, dim in enumerate(getattr(param, "shape", None) or []):
                if isinstance(dim, tvm.tirx.Var) and isinstance(value, np.ndarray):  # the symbolic row count m
                    env[dim.name] = value.shape[axis]
        if rows is not None:
            env["m"] = rows
        call_args, tags, lets = self.launches[name]
        names = self.source_params[name]
        extents = {tag: _evaluate(expr, env, lets) for tag, expr in zip(tags, call_args[len(names) :])}
        keep, pointers = [], []
        for i, pname in enumerate(names):
            array = by_name.get(pname[:-4]) if pname.endswith("_ptr") else None
            if array is not None:
                assert array.flags.c_contiguous, pname
                pointers.append(ctypes.c_void_p(array.ctypes.data))
            else:
                keep.append(ctypes.c_int64(_evaluate(call_args[i], env, lets)))
                pointers.append(ctypes.cast(ctypes.pointer(keep[-1]), ctypes.c_void_p))
        argv = (ctypes.c_void_p * len(pointers))(*pointers)
        dims = [extents.get(t, 1) for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y",
                                             "threadIdx.z")]
        self.lib[f"run_{name}"](argv, *dims)

    def runner(self, extra_rows: int = 4):
        """call(name, *args) as the GPU tests' runners: each array is passed as the first rows of a taller copy
        whose extra rows are poisoned (NaN, or the integer type's max) and must come back unchanged."""

        def poison(dtype):
            return np.nan if dtype.kind == "f" else np.iinfo(dtype).max

        def call(name, *args):
            talls = []
            for a in args:
                tall = None
                if isinstance(a, np.ndarray):
                    tall = np.full((a.shape[0] + extra_rows,) + a.shape[1:], poison(a.dtype), a.dtype)
                    tall[: a.shape[0]] = a
                talls.append(tall)
            self.call(name, *[a if t is None else t[: a.shape[0]] for a, t in zip(args, talls)])
            for a, tall in zip(args, talls):
                if tall is not None:
                    a[...] = tall[: a.shape[0]]
                    tail = tall[a.shape[0] :]
                    ok = np.isnan(tail).all() if a.dtype.kind == "f" else (tail == poison(a.dtype)).all()
                    assert ok, f"{name} wrote outside an argument"

        call.device = "emulated"
        return call
