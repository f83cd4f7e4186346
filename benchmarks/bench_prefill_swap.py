"""Prefill of a sparse artifact with the prefill FFN kernels it was built with ("sparse old") and with this tree's
("sparse new": `linear_rows` and the [K, N] `linear` prefill kernels rebuilt from passes/kernels under the same
names and swapped into the loaded engine; built for AVX-512, the register tiles of tile_panels=2), against onnxruntime on the artifact's model (2 threads) and, if given,
a dense artifact; alternated run by run, medians; then per kernel class, each call timed alone.

Same weights and every other kernel unchanged, so the two sparse figures differ by the FFN prefill GEMMs alone
and no 30-minute rebuild is needed to compare them. Checks the logits of every engine against onnxruntime's.

    TVM_NUM_THREADS=2 PYTHONPATH=. python benchmarks/bench_prefill_swap.py SPARSE.pic RUNS [DENSE.pic]
        env: PROMPT=16 (prompt tokens), SKIP=1 (the down GEMM with skip_zero_rows, as select_kernels lowers it),
             ONNX=path of the model (default: the opt-1b benchmark model of /work/bench/cache)
"""
import os, sys, time, statistics, re, tempfile
os.environ.setdefault("TVM_NUM_THREADS", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np

art = sys.argv[1]; runs = int(sys.argv[2]); dense = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
L = int(os.environ.get("PROMPT", 16)); SKIP = bool(int(os.environ.get("SKIP", "1")))
onnx = os.environ.get("ONNX", "/work/bench/cache/models/opt-1b-964b5e198809/model.onnx")
prompt = np.random.default_rng(0).integers(0, 32000, size=L)

# new kernels, same names
from passes.kernels import cpu, neuron
from picompile.targets import CPU_ISAS
import tvm
from runtime import Engine
from picompile.reference import OrtDecoder
eng = Engine(art)
names = sorted({c.prefill for c in eng.calls if c.prefill and (c.prefill.startswith("linear_rows") or re.match(r"linear_k\d+_n\d+(_f16)?_prefill", c.prefill))})
funcs = []
for n in names:
    f16 = "_f16" in n
    wd = {"wdtype": "float16"} if f16 else {}
    K, N = map(int, re.match(r".*_k(\d+)_n(\d+)", n).groups())
    if n.startswith("linear_rows"):
        funcs.append(neuron.linear_rows(n, K, N, rows=None, act="relu", tile_panels=2, **wd))
    else:
        funcs.append(cpu.linear(n, K, N, rows=None, bias=False, tile_panels=2, skip_zero_rows=SKIP, **wd))
path = tempfile.mktemp(suffix=".so")
cpu.build(funcs, CPU_ISAS["avx512"].llvm_target(), path)
newlib = tvm.runtime.load_module(path)
old_k = {n: eng._kernels[n] for n in names}
new_k = {n: newlib[n] for n in names}
for f in new_k.values():
    f.release_gil = True
print("swapped:", names)
ort = OrtDecoder(onnx, threads=2)
engines = {"ort": None, "sparse old": old_k, "sparse new": new_k}
deng = Engine(dense) if dense else None
if deng: engines["dense"] = "dense"

def kclass(name):
    return re.sub(r"_k\d+|_n\d+|_d\d+|_v\d+|_h\d+|_kv\d+|_eps.*?_|_p\d", "", name)
calls_by_id = {c.id: c for c in eng.calls}
def run(label, profile=False):
    if label == "ort":
        ort.reset(); t = time.perf_counter(); out = ort.forward(prompt); return time.perf_counter() - t, out, None
    e = deng if label == "dense" else eng
    if label != "dense":
        eng._kernels.update(engines[label])
    e.reset()
    if not profile:
        t = time.perf_counter(); out = e.forward(prompt); return time.perf_counter() - t, out, None
    e.buffers["input_ids"][:L] = prompt
    prog = e._program("prefill", L); cb = {c.id: c for c in e.calls}
    per = {}
    for st in prog:
        b = time.perf_counter(); st.run(0); d = time.perf_counter() - b
        k = kclass(cb[st.name].prefill); per[k] = per.get(k, 0) + d
    return None, None, per
outs = {}
for label in engines:
    for _ in range(2):
        _, outs[label], _ = run(label)
for label in engines:
    if label != "ort":
        print(f"{label}: max |logits - ort| {np.abs(outs[label] - outs['ort']).max():.3g}")
print(f"sparse new vs old: max |diff| {np.abs(outs['sparse new'] - outs['sparse old']).max():.3g}")
samples = {k: [] for k in engines}; prof = {k: [] for k in engines if k != "ort"}
for r in range(runs):
    for label in engines:
        time.sleep(0.3); samples[label].append(run(label)[0])
    for label in prof:
        time.sleep(0.3); prof[label].append(run(label, True)[2])
o = statistics.median(samples["ort"])
print(f"{os.path.basename(art)}  prompt {L}  runs {runs}  load {os.getloadavg()[0]:.2f}")
for label, s in samples.items():
    m = statistics.median(s)
    print(f"  {label:<11} median {m*1e3:7.1f} ms  {m/o:5.2f}x ort   runs {[round(v*1e3) for v in s]}")
for label, ps in prof.items():
    print(f"  {label} per kernel class (median ms over {len(ps)} profiled runs):")
    for k in sorted(ps[0], key=lambda k: -statistics.median(p[k] for p in ps)):
        print(f"     {k:<44} {statistics.median(p[k] for p in ps)*1e3:7.2f}")
