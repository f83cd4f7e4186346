"""Quickstart: make a small synthetic 90%-sparse OPT-ReLU model, compile it for this CPU (dense and
sparse), generate tokens, and print the decode speed beside onnxruntime's on the same ONNX.

    python examples/quickstart.py [--preset small|tiny]

The first run makes the model (~2 min for `small`) and trains its predictors (~3 min); both are cached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model size preset of examples/models.py")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

    from examples.bench_decode import ensure_artifact, measure, quality, table
    from examples.models import cache_dir, cached_model
    from picompile.reference import OrtDecoder
    from runtime import Engine, generate

    say = lambda message: print("   " + message)  # noqa: E731
    print(f"1. making a synthetic 90%-sparse OPT-ReLU model ({args.preset}) in {cache_dir()}")
    files = cached_model("opt", preset=args.preset, sparsity=0.9, log=say)
    params = json.loads(files.config.read_text())["num_params"]
    say(f"{files.onnx} ({params / 1e6:.0f}M parameters)")
    print("2. compiling it for --target cpu (TVM, LLVM AVX2): dense, then sparse (profile, predictors, lowering)")
    artifacts = {"picompile dense": ensure_artifact(files, "dense", 256, log=say),
                 "picompile sparse": ensure_artifact(files, "sparse", 256, dense=False, log=say)}
    print("3. generating with the sparse artifact")
    prompt = [1, 20, 300, 4000]
    result = generate(Engine(artifacts["picompile sparse"]), prompt, args.tokens)
    say(f"prompt {prompt} -> {result['generated_ids']}")
    reference = OrtDecoder(files.onnx).greedy(prompt, args.tokens)
    same = sum(a == b for a, b in zip(reference, result["generated_ids"]))
    say(f"{same} of {args.tokens} greedy tokens equal onnxruntime's on the dense model")
    print("4. decode speed against onnxruntime (same model, same threads), with the quality each speed has")
    qualities = {name: quality(files, path) for name, path in artifacts.items()}
    summary = measure(files, artifacts, args.tokens, runs=3, threads=os.cpu_count())
    print(table({"prompt_len": 16}, summary, qualities))
    return 0


if __name__ == "__main__":
    sys.exit(main())
