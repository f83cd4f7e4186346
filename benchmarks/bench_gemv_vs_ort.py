"""Dense decode GEMV: picompile's panel kernel against onnxruntime on the same matrix, alternated in one process.

For each shape K x N (default 2048x2048, the attention projections of a 1B OPT, and 2048x32000, its output
layer) and `--copies` distinct weight copies (so that every call streams from memory), alternating in blocks of
calls (a pool that spins after its calls would take a core from the other runtime's: onnxruntime's spinning is
off, and blocks are separated by a pause longer than TVM's spin):

  ort MatMul      a one-node ONNX model y[1, N] = x[1, K] @ W[K, N] (the form an exported decoder has),
  ort Gemm^T      y = x @ W^T with W stored [N, K] (transB=1; onnxruntime's fastest GEMV form here),
  picompile avx2 / avx512   `linear_panels` decode (panel-packed W) built for that ISA, reading
                  `--panels-per-task` panels in lockstep (default: the kernel's GEMV_PANELS; several values,
                  comma-separated, build one kernel each: "picompile avx512 p4", "... p8"),

over `--threads` threads (onnxruntime intra-op threads, TVM_NUM_THREADS). Prints GB/s of weight bytes read,
medians and 90th percentiles over calls, and each picompile kernel's ratio to onnxruntime's best form.

    python benchmarks/bench_gemv_vs_ort.py [--shapes 2048x2048,2048x32000] [--threads 2] [--rounds 30]
        [--panels-per-task 4,8]
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

SETTLE = 0.3  # seconds between blocks: longer than TVM's pool spins after a call (onnxruntime's does not spin)


def ort_session(kind: str, K: int, N: int, w: np.ndarray, threads: int):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])
    if kind == "MatMul":
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        init = numpy_helper.from_array(w, "w")
    else:
        node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)
        init = numpy_helper.from_array(np.ascontiguousarray(w.T), "w")
    graph = helper.make_graph([node], "gemv", [x], [y], [init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # see SETTLE
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2048x2048,2048x32000")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--copies", type=int, default=0, help="weight copies per shape (0: enough for 256 MiB)")
    parser.add_argument("--panels-per-task", default="", help="decode panels read in lockstep, comma-separated "
                        "(default: the kernel's own)")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels import cpu
    from passes.targets import CPU_ISAS
    from runtime.artifact import aligned_empty

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    groups = [int(g) for g in args.panels_per_task.split(",")] if args.panels_per_task else [None]
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for isa in ("avx2", "avx512"):
            for group in groups:
                label = isa if group is None else f"{isa} p{group}"
                path = os.path.join(tmp, f"{isa}-{group}.so")
                cpu.build([cpu.linear_panels(f"gemv_{K}_{N}", K, N, rows=1, bias=False, panels_per_task=group)
                           for K, N in shapes], CPU_ISAS[isa].llvm_target(), path)
                libs[label] = tvm.runtime.load_module(path)
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    clock = time.perf_counter
    print(f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    for K, N in shapes:
        copies = args.copies or max(2, -(-(256 << 20) // (K * N * 4)))
        weights = [rng.standard_normal((K, N), dtype=np.float32) for _ in range(copies)]
        x = rng.standard_normal((1, K), dtype=np.float32)
        xa = aligned_empty((1, K)); xa[...] = x
        y = aligned_empty((1, N))
        sessions = {kind: [ort_session(kind, K, N, w, args.threads) for w in weights] for kind in ("MatMul", "Gemm^T")}
        panels = []
        for w in weights:
            p = cpu.pack_panels(w)
            a = aligned_empty(p.shape, p.dtype, huge=True); a[...] = p
            panels.append(a)
        expected = x[0].astype(np.float64) @ weights[0]
        for isa, lib in libs.items():
            lib[f"gemv_{K}_{N}"](dl(xa), dl(panels[0]), dl(y))
            np.testing.assert_allclose(y[0], expected, rtol=1e-3, atol=1e-2)
        calls = {f"ort {kind}": (lambda c, s=s: s[c].run(None, {"x": x})) for kind, s in sessions.items()}
        for isa, lib in libs.items():
            calls[f"picompile {isa}"] = lambda c, f=lib[f"gemv_{K}_{N}"]: f(dl(xa), dl(panels[c]), dl(y))
        for fn in calls.values():
            for c in range(copies):
                fn(c)
        samples = {label: [] for label in calls}
        block = max(copies, 4)
        for r in range(args.rounds):
            for label, fn in calls.items():  # alternated block by block, each pool warm inside its block
                time.sleep(SETTLE)
                fn((r + 1) % copies)  # wakes the pool; not counted
                for i in range(block):
                    c = (r + i) % copies
                    began = clock()
                    fn(c)
                    samples[label].append(K * N * 4 / (clock() - began) / 1e9)
        print(f"{K}x{N} fp32 ({K * N * 4 / 2**20:.0f} MiB, {copies} copies):")
        for label, rates in samples.items():
            print(f"  {label:<18} median {np.median(rates):6.1f} GB/s   p90 {np.percentile(rates, 90):6.1f}")
        ort_best = max(np.median(samples["ort MatMul"]), np.median(samples["ort Gemm^T"]))
        ort_best90 = max(np.percentile(samples["ort MatMul"], 90), np.percentile(samples["ort Gemm^T"], 90))
        for isa in libs:
            rates = samples[f"picompile {isa}"]
            print(f"  picompile {isa} / onnxruntime's best form: median {np.median(rates) / ort_best:.2f}, "
                  f"p90 {np.percentile(rates, 90) / ort_best90:.2f}")
        del sessions, panels, weights


if __name__ == "__main__":
    main()
