"""Quantized decode GEMV: picompile's kernels over quant panels against onnxruntime's MatMulNBits and our fp16
panel GEMV, on the same matrix, alternated in one process.

For each shape K x N (default: 2048x2048, 2048x8192, 8192x2048, 2048x32000: a 1B decoder's projections, FFN and
output layer) and enough distinct weight copies per variant that every call streams from memory (`--mib` of
that variant's bytes), alternating in blocks of calls separated by a pause (as bench_gemv_vs_ort):

  ort int4            MatMulNBits (com.microsoft, bits 4, block 32, symmetric, accuracy_level 4: int8
                      activations), our int4 quantization in its layout, fp32 scales
  picompile fp16      `linear_panels` decode, fp16 panels (the float baseline)
  picompile int8      `linear_panels_q` decode, int8 panels, fp16 scales
  picompile int4      `linear_panels_q` decode, int4 panels, fp16 scales
  picompile int4a     `linear_panels_q` decode, int4a panels (asymmetric blocks, GGUF's Q4_1: fp16 scales and
                      mins, 0.625 bytes a weight against int4's 0.5625)
  picompile int4 x8 madd / vnni   the same with int8 activations (x quantized per 32-block), the block sums
                      integer dot products: vpmaddubsw + vpmaddwd (zmm under avx512, ymm under avx2), or vpdpbusd
                      (AVX512-VNNI: built for the avx512vnni ISA, where this CPU has it); int4a x8 likewise

over `--threads` threads (onnxruntime intra-op threads, TVM_NUM_THREADS), kernels built for `--isa` (default: this
machine's). Checks every variant against a float64 reference of the dequantized matrix first and reports its
worst error relative to max |y|. Prints medians over calls: microseconds per call, GB/s of weight bytes read
(scales included), and time relative to ort int4 and to picompile fp16 (below 1: faster); and the best time of
one copy called again and again (in cache where it fits: compute, not memory), as a markdown table.

    python benchmarks/bench_quant_gemv.py [--shapes 2048x2048,...] [--threads 2] [--rounds 15] [--isa avx512]
        [--formats int4,int4a] [--no-ort]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

WARM_CALLS = 8  # per round and variant: the same copy repeated, its best time (compute where the copy fits in cache)
SETTLE = 0.3  # seconds between blocks: longer than TVM's pool spins after a call (onnxruntime's does not spin)
SHAPES = "2048x2048,2048x8192,8192x2048,2048x32000"


def ort_int4_session(q: np.ndarray, scales: np.ndarray, threads: int):
    """A one-node MatMulNBits model of the int4 (q [K, N] in [-8, 7], scales [K / 32, N]) matrix."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    K, N = q.shape
    blocks = K // 32
    # MatMulNBits' B: [N, K / 32, 16] bytes, byte j of a block = q[2j] + 8 | (q[2j + 1] + 8) << 4 (zero point 8)
    stored = (q.T.astype(np.int16) + 8).astype(np.uint8).reshape(N, blocks, 16, 2)
    b = np.ascontiguousarray(stored[..., 0] | (stored[..., 1] << 4))
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=32, accuracy_level=4)
    graph = helper.make_graph(
        [node], "gemv_q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        [numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(np.ascontiguousarray(scales.T.astype(np.float32)).reshape(-1), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # see SETTLE
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mib", type=int, default=256, help="weight bytes per variant and shape, in copies")
    parser.add_argument("--isa", default=None, help="CPU_ISAS entry to build for (default: this machine's)")
    parser.add_argument("--formats", default="int8,int4,int4a", help="picompile's weight formats to run")
    parser.add_argument("--no-ort", action="store_true", help="leave onnxruntime's MatMulNBits out")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels import cpu, quant
    from passes.targets import CPU_ISAS, host_cpu_isa
    from runtime.artifact import aligned_copy, aligned_empty, cpu_flags
    from runtime.dtypes import WEIGHT_FORMATS

    isa = CPU_ISAS[args.isa] if args.isa else host_cpu_isa()
    vnni_isa = CPU_ISAS["avx512vnni"]
    vnni = isa.gemm_panels == vnni_isa.gemm_panels and set(vnni_isa.features) <= (cpu_flags() or set())
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    formats = args.formats.split(",")
    variants = formats + [f"{name} x8 {dot}" for dot in ["madd"] + (["vnni"] if vnni else []) for name in formats
                          if WEIGHT_FORMATS[name].bits == 4]
    funcs = {"base": [], "vnni": []}
    for K, N in shapes:
        funcs["base"].append(cpu.linear_panels(f"fp16_{K}_{N}", K, N, rows=1, wdtype="float16", bias=False))
        for v in variants:
            dot = v.split()[-1] if " x8 " in v else None
            fmt = WEIGHT_FORMATS[v.split()[0]]
            funcs["vnni" if dot == "vnni" else "base"].append(quant.linear_panels_q(
                f"{v.replace(' ', '_')}_{K}_{N}", K, N, rows=1, bits=fmt.bits, bias=False, int8_dot=dot,
                tile_panels=isa.gemm_panels, **({"has_min": True} if fmt.has_min else {})))
    targets = {"base": isa.llvm_target(), "vnni": vnni_isa.llvm_target()}
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for part, fs in funcs.items():
            if fs:
                path = os.path.join(tmp, f"{part}.so")
                cpu.build(fs, targets[part], path)
                libs[part] = tvm.runtime.load_module(path)

    def kernel(symbol):
        return libs["vnni" if "vnni" in symbol else "base"][symbol]
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    clock = time.perf_counter

    print(f"{args.threads} threads, kernels for {isa.name}, load average {os.getloadavg()[0]:.2f}")
    rows = []
    for K, N in shapes:
        x = rng.standard_normal((1, K), dtype=np.float32)
        xa = aligned_empty((1, K))
        xa[...] = x
        y = aligned_empty((1, N))
        w0 = rng.standard_normal((K, N), dtype=np.float32)
        q4 = quant.quantize(w0, WEIGHT_FORMATS["int4"], axis=0)
        bytes_per = {"ort int4": K * N / 2 + K * N / 32 * 4, "picompile fp16": K * N * 2}
        for v in variants:
            bytes_per[f"picompile {v}"] = K * N * WEIGHT_FORMATS[v.split()[0]].bytes_per_weight
        copies = {label: max(2, -(-(args.mib << 20) // int(n))) for label, n in bytes_per.items()}
        # distinct copies: the first from w0 (checked), the rest a cheap perturbation of its quantized values
        calls, errors = {}, {}

        def variant_copies(label, make):
            return [make(c) for c in range(copies[label])]

        def shuffled(q, c):  # another matrix of the same statistics: rotate the columns
            return np.roll(q, 17 * c, axis=1)

        sessions = [] if args.no_ort else variant_copies(
            "ort int4", lambda c: ort_int4_session(shuffled(q4[0], c), shuffled(q4[1], c), args.threads))
        if sessions:
            calls["ort int4"] = lambda c, s=sessions: s[c].run(None, {"x": x})[0]
        fp16 = variant_copies("picompile fp16",
                              lambda c: aligned_copy(cpu.pack_panels(np.roll(w0, 17 * c, axis=1).astype(np.float16))))
        f = kernel(f"fp16_{K}_{N}")
        calls["picompile fp16"] = lambda c, f=f, w=fp16: (f(dl(xa), dl(w[c]), dl(y)), y)[1]
        refs = {"picompile fp16": x[0].astype(np.float64) @ w0.astype(np.float16).astype(np.float64)}
        for v in variants:
            fmt = WEIGHT_FORMATS[v.split()[0]]
            q, *per_block = q4 if fmt.name == "int4" else quant.quantize(w0, fmt, axis=0)
            refs[f"picompile {v}"] = x[0].astype(np.float64) @ quant.dequantize(q, per_block[0], 0,
                                                                               *per_block[1:]).astype(np.float64)
            packed = variant_copies(f"picompile {v}", lambda c: [aligned_copy(a) for a in quant.pack_panels(
                shuffled(q, c), shuffled(per_block[0], c), fmt, *[shuffled(a, c) for a in per_block[1:]])])
            f = kernel(f"{v.replace(' ', '_')}_{K}_{N}")
            calls[f"picompile {v}"] = lambda c, f=f, w=packed: (f(dl(xa), dl(w[c][0]), dl(w[c][1]), dl(y)), y)[1]
        refs["ort int4"] = x[0].astype(np.float64) @ quant.dequantize(*q4, 0).astype(np.float64)
        for label, fn in calls.items():
            got = np.array(fn(0)).reshape(-1)
            errors[label] = np.abs(got - refs[label]).max() / np.abs(refs[label]).max()
            for c in range(copies[label]):
                fn(c)
        samples = {label: [] for label in calls}
        warm = {label: [] for label in calls}  # copy 0 again and again: in cache where it fits (L3: 32 MiB here)
        for r in range(args.rounds):
            for label, fn in calls.items():  # alternated block by block, each pool warm inside its block
                time.sleep(SETTLE)
                n = copies[label]
                fn((r + 1) % n)  # wakes the pool; not counted
                for i in range(max(n, 8)):
                    began = clock()
                    fn((r + i) % n)
                    samples[label].append(clock() - began)
                for i in range(WARM_CALLS):
                    began = clock()
                    fn(0)
                    warm[label].append(clock() - began)
        base = {label: np.median(samples[label]) if label in samples else np.nan
                for label in ("ort int4", "picompile fp16")}
        for label, times in samples.items():
            t = np.median(times)
            rows.append((f"{K}x{N}", label, t * 1e6, bytes_per[label] / t / 1e9, t / base["ort int4"],
                         t / base["picompile fp16"], np.min(warm[label]) * 1e6, errors[label], copies[label]))
        del sessions, fp16, calls
    print()
    print("| K x N | kernel | us / call | GB/s | time / ort int4 | time / picompile fp16 | best us, warm"
          " | max err / max abs y | copies |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape, label, us, gbs, r_ort, r_fp16, best, err, n in rows:
        print(f"| {shape} | {label} | {us:.1f} | {gbs:.1f} | {r_ort:.2f} | {r_fp16:.2f} | {best:.1f} | {err:.1e} | {n} |")


if __name__ == "__main__":
    main()
