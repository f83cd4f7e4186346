"""The runtime stays thin: numpy and TVM's runtime/FFI only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np

from runtime.sampling import sample

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"picompile", "passes", "torch", "onnx", "onnxruntime", "onnxscript", "onnx_ir", "highspy",
             "networkx", "safetensors", "transformers", "examples"}


def test_runtime_sources_import_nothing_forbidden():
    for path in (ROOT / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{path.name} imports {name}"
                if top == "tvm":  # tvm.base: the runtime's loaded libraries (to load libtvm_runtime_cuda beside them)
                    assert name in ("tvm.runtime", "tvm.base"), f"{path.name} imports {name}: only tvm.runtime is allowed"


BLOCK_FORBIDDEN = "import sys\nfor name in %r: sys.modules[name] = None  # as on a machine without them\n" % sorted(FORBIDDEN)


def run_without_compiler_stack(code: str) -> str:
    """Run code in a fresh interpreter where every forbidden package fails to import."""
    result = subprocess.run([sys.executable, "-c", BLOCK_FORBIDDEN + code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_runtime_loads_tvm_runtime_without_compiler_library():
    out = run_without_compiler_stack("import runtime, runtime.engine as e; e._tvm_runtime(); import tvm.base; "
                                     "print(sorted(tvm.base._LOADED_LIBS))")
    assert out.strip() == "['tvm_runtime']"  # not libtvm_compiler.so (~260 MB)


def test_a_placement_report_is_read_after_the_runtime_loaded_tvm():
    """Benchmarks and tools read an artifact's `PlacementReport` after the engine ran it, in a process where TVM
    is its runtime library alone: partition must import there (it priced the quality plan's formats by importing
    the quality pass, whose TVM script parser then failed: `cannot import name 'TCol'`)."""
    code = ("import runtime.engine as e; e._tvm_runtime()\n"
            "from passes.partition import PlacementReport\n"
            "import tvm.base; print(sorted(tvm.base._LOADED_LIBS))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['tvm_runtime']"


def test_cuda_probe_loads_the_cuda_runtime_library_only():
    """Looking for a GPU loads libtvm_runtime_cuda.so (or fails for want of the NVIDIA driver, as here) and
    never the compiler library."""
    out = run_without_compiler_stack(
        "import runtime.engine as e, runtime.device as d; e._tvm_runtime()\n"
        "try:\n    d.load_cuda_runtime(); print('loaded')\nexcept (OSError, RuntimeError) as error: print('no driver:', error)\n"
        "maps = open('/proc/self/maps').read(); print('compiler' if 'libtvm_compiler' in maps else 'no compiler')\n"
        "print('cuda runtime mapped' if 'libtvm_runtime_cuda' in maps else 'cuda runtime not mapped')")
    lines = out.strip().splitlines()
    assert lines[1] == "no compiler", out
    if lines[0] == "loaded":  # a machine with the driver: the library is in the process
        assert lines[2] == "cuda runtime mapped", out
    else:  # no libcuda.so.1: the load failed, and the error names what is missing
        assert "libcuda" in lines[0] or "libcudart" in lines[0], out


def test_text_reads_the_tokenizer_and_chat_template_without_the_compiler_stack(tmp_path):
    """runtime/text.py needs `tokenizers` (and jinja2 for a chat template) only: transformers is blocked here."""
    from text_tokenizers import CHAT_TEMPLATE, write_byte_tokenizer

    directory = write_byte_tokenizer(tmp_path / "tokenizer", chat_template=CHAT_TEMPLATE)
    out = run_without_compiler_stack(
        f"from runtime.text import TextTokenizer\nt = TextTokenizer({str(directory)!r})\n"
        "ids = t.encode('caf\u00e9'); s = t.stream(); text = ''.join(s.push(i) for i in ids) + s.flush()\n"
        "print(ids, repr(text), repr(t.chat_prompt([{'role': 'user', 'content': 'hi'}])))")
    assert out.strip() == "[256, 99, 97, 102, 195, 169] 'caf\u00e9' '<s><|user|>hi\\n<|assistant|>'"


def test_importing_the_runtime_does_not_import_the_server_stack():
    """The serve extra (Starlette, uvicorn) is imported by runtime/serve.py alone, which the runtime never imports."""
    out = run_without_compiler_stack("import sys, runtime, runtime.scheduler\n"
                                     "print(sorted(m for m in ('starlette', 'uvicorn', 'runtime.serve') "
                                     "if m in sys.modules))")
    assert out.strip() == "[]"


def test_greedy_is_argmax_and_sampling_respects_top_k_and_top_p():
    logits = np.array([0.0, 3.0, 1.0, 2.5, -1.0])
    assert sample(logits, None) == 1
    rng = np.random.default_rng(0)
    draws = {sample(logits, rng, temperature=1.0, top_k=2) for _ in range(200)}
    assert draws == {1, 3}
    rng = np.random.default_rng(0)
    # p(1) ~ 0.55, p(3) ~ 0.33: top_p=0.5 keeps only the most likely token
    assert {sample(logits, rng, temperature=1.0, top_p=0.5) for _ in range(50)} == {1}
    a = [sample(logits, np.random.default_rng(7), temperature=2.0) for _ in range(5)]
    b = [sample(logits, np.random.default_rng(7), temperature=2.0) for _ in range(5)]
    assert a == b


def test_weights_are_aligned_and_advised_onto_huge_pages():
    """aligned_empty(huge=True), which read_safetensors uses for weights: large arrays in their own 2 MiB aligned
    mapping advised MADV_HUGEPAGE (backed by huge pages where THP allows it), small ones as before; both usable
    like any array and freed with it."""
    import gc
    from pathlib import Path as _Path

    from runtime.artifact import HUGE_MIN_BYTES, HUGE_PAGE, aligned_empty, huge_pages_in

    big = aligned_empty((HUGE_MIN_BYTES // 4 + 16,), np.float32, huge=True)
    small = aligned_empty((1000,), np.float32, huge=True)
    assert big.ctypes.data % HUGE_PAGE == 0 and small.ctypes.data % 64 == 0
    big[...] = 1.5
    small[...] = 2.5
    assert big.sum() == 1.5 * big.size and small.sum() == 2.5 * small.size
    thp = _Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert huge_pages_in(big) > 0
    del big, small
    gc.collect()
