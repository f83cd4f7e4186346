"""Prefill GEMMs of a sparse FFN part: picompile's kernels for each weight layout against onnxruntime's MatMul on
the same shapes, alternated in one process.

The two GEMMs a sparse build runs a prompt through, per FFN part (issue 13):

  up    y[m, F] = relu(x[m, D] @ W_up + b), W_up stored as rows [F, D] (one row per neuron, what the sparse
        decode kernel gathers): `linear_rows`;
  down  y[m, D] = h[m, F] @ W_down, W_down stored as rows [F, D] = [K, N] ("kn"): `linear` prefill;

(`linear_rows` is now `cpu.gemm_nt`, which reads the rows in place; "(packing)" is `cpu.gemm`, which packs a
panel per call, linear_rows' kernel before and still `linear`'s; "kn (direct)" is `cpu.gemm_kn`, which reads w
in place, and "kn (skip 0 rows)" gemm_kn with skip_zero_rows, what a ReLU part's down now runs:
h is given zeros in all but a share `--union` of its columns, as a prompt's ReLU hidden values have)

each against onnxruntime MatMul (x @ W[K, N], the exported decoder's form) and picompile's panel GEMM over the
same matrix panel-packed (`linear_panels` prefill, the dense build's kernel: no per-call packing). Shapes default
to a 1B OPT's FFN (D=2048, F=8192), `--m` prompt rows (16 and 64), `--dtypes` weight storage (fp32, fp16, int8,
int4; the onnxruntime figure is fp32 always; a quantized dtype times its own kernels: "panels q", the dense
build's; up "rows q (packing)", linear_rows_q; down "kn q (packing)", gemm over kn_weight, what linear_kn_q ran
before gemm_kn read quantized rows in place, "kn q (direct)" and "kn q (skip 0 rows)", now linear_kn_q's). `--copies` distinct weight copies (default: enough for 256 MiB) so every call
streams its weight from memory. Calls alternate in blocks (a pause longer than TVM's pool spin between blocks);
prints milliseconds per call (median, p10) and GB/s of weight bytes, and each kernel's ratio to onnxruntime.

    python benchmarks/bench_prefill_gemm.py [--D 2048] [--F 8192] [--m 16,64] [--dtypes fp32,fp16] [--threads 2]
        [--rounds 15] [--isa avx512] [--kernels 'panels,rows (nt),...']
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

SETTLE = 0.3  # seconds between blocks (see bench_gemv_vs_ort.py)
QUANTIZED_LAYOUTS = {  # a quantized variant's layout -> (the matrix it stores: [K, N] or its transpose, the blocked axis)
    "qpanels": (False, 0), "qrows": (True, 1), "qkn": (False, 1)}


def ort_session(K: int, N: int, w: np.ndarray, threads: int, bias: np.ndarray | None, relu: bool):
    import onnx  # noqa: F401
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])
    nodes, inits, last = [helper.make_node("MatMul", ["x", "w"], ["t0"])], [numpy_helper.from_array(w, "w")], "t0"
    if bias is not None:  # the exported decoder's fc1: MatMul, Add, Relu
        nodes.append(helper.make_node("Add", [last, "b"], ["t1"]))
        inits.append(numpy_helper.from_array(bias, "b"))
        last = "t1"
    if relu:
        nodes.append(helper.make_node("Relu", [last], ["t2"]))
        last = "t2"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    graph = helper.make_graph(nodes, "gemm", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def kernel_variants(which: str, K: int, N: int, dtype: str, tile: int, dot: str | None = None):
    """{label: (PrimFunc, weight layout)} for one GEMM (`which`: "up" relu+bias, "down" plain) over weights
    stored as `dtype` (runtime.dtypes.WEIGHT_FORMATS)."""
    from passes.kernels import cpu, neuron, quant
    from runtime.dtypes import WEIGHT_FORMATS

    up = which == "up"
    fmt = WEIGHT_FORMATS[dtype]
    if fmt.quantized:  # the dense build's panels; up: linear_rows_q; down: the per-call packing gemm before gemm_kn
        q = dict(bits=fmt.bits, tile_panels=tile)
        name = f"{which}_{K}_{N}_{dtype}"
        out = {"panels q": (quant.linear_panels_q(f"qpanels_{name}", K, N, rows=None, bias=up, act="relu" if up else "none",
                                                  **q), "qpanels")}
        if dot:  # x rounded to int8 per block, integer dot products (the decode GEMVs' int8 activations)
            out["panels q x8"] = (quant.gemm_panels_qx8(f"qpanels8_{name}", K, N, bits=fmt.bits, bias=up,
                                                        act="relu" if up else "none", dot=dot, tile_panels=tile),
                                  "qpanels")
        if up:
            out["rows q (packing)"] = (cpu.gemm(f"qrowsp_{name}", K, N, layout=quant.rows_weight(K, N, bits=fmt.bits),
                                                bias=True, act="relu", tile_panels=tile), "qrows")
            out["rows q (nt)"] = (quant.linear_rows_q(f"qrows_{name}", K, N, rows=None, act="relu", **q), "qrows")
        else:
            out["kn q (packing)"] = (cpu.gemm(f"qknp_{name}", K, N, layout=quant.kn_weight(K, N, bits=fmt.bits),
                                              bias=False, tile_panels=tile), "qkn")
            out["kn q (direct)"] = (quant.linear_kn_q(f"qkn_{name}", K, N, rows=None, bias=False, **q), "qkn")
            out["kn q (skip 0 rows)"] = (quant.linear_kn_q(f"qknz_{name}", K, N, rows=None, bias=False,
                                                           skip_zero_rows=True, **q), "qkn")
        return out
    wdtype = fmt.storage
    flags = dict(bias=up, act="relu" if up else "none", wdtype=wdtype, tile_panels=tile)
    name = f"{which}_{K}_{N}_{wdtype}"
    out = {"panels": (cpu.linear_panels(f"panels_{name}", K, N, rows=None, **flags), "panels")}
    if up:  # linear_rows: gemm_nt; before it, gemm's "rows" layout (a panel packed per call)
        out["rows (nt)"] = (neuron.linear_rows(f"rows_{name}", K, N, rows=None, act="relu", wdtype=wdtype,
                                               tile_panels=tile), "rows")
        out["rows (packing)"] = (cpu.gemm(f"rowsp_{name}", K, N, layout="rows", **flags), "rows")
    else:  # linear prefill: gemm's "kn" layout; with skip_zero_rows (the sparse FFN's down) gemm_kn
        out["kn (direct)"] = (cpu.gemm_kn(f"kn_{name}", K, N, **flags), "kn")
        out["kn (packing)"] = (cpu.linear(f"knp_{name}", K, N, rows=None, bias=False, wdtype=wdtype, tile_panels=tile),
                               "kn")
        out["kn (skip 0 rows)"] = (cpu.linear(f"knz_{name}", K, N, rows=None, bias=False, wdtype=wdtype,
                                              tile_panels=tile, skip_zero_rows=True), "kn")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--D", type=int, default=2048)
    parser.add_argument("--F", type=int, default=8192)
    parser.add_argument("--m", default="16,64")
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--which", default="up,down")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--copies", type=int, default=0, help="weight copies (0: enough for 256 MiB of fp32)")
    parser.add_argument("--isa", default=None, help="a CPU_ISAS name (default: this machine's widest)")
    parser.add_argument("--kernels", default="", help="comma-separated labels to run (default all)")
    parser.add_argument("--union", type=float, default=0.35,
                        help="down: share of the hidden columns with a nonzero in some row (a 16-token prompt of the "
                             "1B OPT-ReLU: 0.26-0.45 per layer)")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    import tvm_ffi

    from passes.kernels import cpu, quant
    from passes.targets import CPU_ISAS, host_cpu_isa
    from runtime.artifact import aligned_empty
    from runtime.dtypes import WEIGHT_FORMATS

    isa = CPU_ISAS[args.isa] if args.isa else host_cpu_isa()
    dl = tvm_ffi.from_dlpack
    rng = np.random.default_rng(0)
    clock = time.perf_counter
    ms = [int(v) for v in args.m.split(",")]
    print(f"{args.threads} threads, {isa.name}, load average {os.getloadavg()[0]:.2f}")
    for which in args.which.split(","):
        K, N = (args.D, args.F) if which == "up" else (args.F, args.D)
        copies = args.copies or max(2, -(-(256 << 20) // (K * N * 4)))
        rows_f32 = [rng.standard_normal((K, N), dtype=np.float32) * np.float32(K ** -0.5) for _ in range(copies)]  # [K, N]
        bias = rng.standard_normal(N, dtype=np.float32) if which == "up" else None
        for dtype in args.dtypes.split(","):
            fmt = WEIGHT_FORMATS[dtype]
            variants = kernel_variants(which, K, N, dtype, isa.gemm_panels,
                                       isa.int8_dot if quant.gemv_int8_dot_fits(fmt.bits, isa.int8_dot, isa.gemm_panels)
                                       and fmt.quantized else None)
            if args.kernels:
                variants = {k: v for k, v in variants.items() if k in args.kernels.split(",")}
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "k.so")
                cpu.build([f for f, _ in variants.values()], isa.llvm_target(), path)
                lib = tvm.runtime.load_module(path)
            funcs = {label: lib[str(f.attrs["global_symbol"])] for label, (f, _) in variants.items()}
            weights = {}  # layout -> copies, each the kernel's weight arguments, stored in `dtype`, 64-byte aligned

            def stored(w, layout):
                if layout in QUANTIZED_LAYOUTS:
                    transposed, axis = QUANTIZED_LAYOUTS[layout]
                    pack = quant.pack_panels if layout == "qpanels" else quant.pack_rows
                    return pack(*quant.quantize(w.T if transposed else w, fmt, axis=axis), fmt)
                return [{"panels": lambda: cpu.pack_panels(w), "rows": lambda: w.T, "kn": lambda: w}[layout]()
                        .astype(fmt.storage)]

            for layout in {lay for _, lay in variants.values()}:
                arrs = []
                for w in rows_f32:
                    parts = []
                    for a in stored(w, layout):
                        b = aligned_empty(a.shape, a.dtype, huge=True)
                        b[...] = a
                        parts.append(b)
                    arrs.append(parts)
                weights[layout] = arrs
            reference_w = [quant.as_stored(w, fmt, axis=1 if which == "down" else 0) for w in rows_f32]
            sessions = [ort_session(K, N, w, args.threads, bias, which == "up") for w in rows_f32]
            ba = None
            if bias is not None:
                ba = aligned_empty((N,)); ba[...] = bias
            for m in ms:
                x = rng.standard_normal((m, K), dtype=np.float32)
                if which == "down":  # ReLU outputs; only a share `--union` of the neurons fired for any token
                    x = np.maximum(x, 0)
                    x[:, rng.random(K) >= args.union] = 0
                xa = aligned_empty((m, K)); xa[...] = x
                y = aligned_empty((m, N))
                expected = x.astype(np.float64) @ reference_w[0]
                if bias is not None:
                    expected = np.maximum(expected + bias, 0)
                calls = {"ort MatMul": lambda c, s=sessions: s[c].run(None, {"x": x})}
                for label, fn in funcs.items():
                    layout = variants[label][1]
                    extra = [dl(ba)] if bias is not None else []
                    calls[label] = (lambda c, fn=fn, ws=weights[layout], extra=extra:
                                    fn(dl(xa), *map(dl, ws[c]), *extra, dl(y)))
                    y[...] = np.nan
                    calls[label](0)
                    if not fmt.quantized or layout != "qpanels":  # (the panels block along K: other values)
                        np.testing.assert_allclose(y, expected, rtol=2e-3, atol=2e-3, err_msg=label)
                    elif label.endswith("x8"):  # int8 x: within its rounding of the float panels' product
                        assert np.abs(y - panels_y).max() < 2e-2 * np.abs(panels_y).max(), label
                    else:
                        panels_y = y.copy()
                for fn in calls.values():
                    for c in range(copies):
                        fn(c)
                samples = {label: [] for label in calls}
                block = max(copies, 4)
                for r in range(args.rounds):
                    for label, fn in calls.items():
                        time.sleep(SETTLE)
                        fn((r + 1) % copies)
                        for i in range(block):
                            began = clock()
                            fn((r + i) % copies)
                            samples[label].append(clock() - began)
                nbytes = int(K * N * fmt.bytes_per_weight)
                ort_ms = np.median(samples["ort MatMul"]) * 1e3
                print(f"{which} {K}x{N} m={m} weights {dtype} ({nbytes / 2**20:.0f} MiB, {copies} copies; "
                      f"onnxruntime fp32){f', union {args.union}' if which == 'down' else ''}, "
                      f"load {os.getloadavg()[0]:.2f}:")
                for label, t in samples.items():
                    med, p10 = np.median(t) * 1e3, np.percentile(t, 10) * 1e3
                    byts = K * N * 4 if label.startswith("ort") else nbytes
                    print(f"  {label:<16} median {med:7.2f} ms  p10 {p10:7.2f} ms  {byts / med / 1e6:6.1f} GB/s  "
                          f"{med / ort_ms:5.2f}x ort")
            del sessions, weights


if __name__ == "__main__":
    main()
