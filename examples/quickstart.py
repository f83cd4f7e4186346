"""Quickstart: make a small synthetic OPT-ReLU model, compile it for this CPU, generate tokens, and
print the decode speed beside onnxruntime's on the same ONNX.

    python examples/quickstart.py [--preset small]
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

    from examples.bench_decode import ensure_artifact, measure, table
    from examples.models import cached_model
    from picompile.reference import OrtDecoder
    from runtime import Engine, generate

    print(f"1. making a synthetic OPT-ReLU model ({args.preset}) in {os.environ.get('PICOMPILE_CACHE', '~/.cache/picompile')}")
    files = cached_model("opt", preset=args.preset, log=lambda m: print("   " + m))
    params = json.loads(files.config.read_text())["num_params"]
    print(f"   {files.onnx} ({params / 1e6:.0f}M parameters)")
    print("2. compiling it for --target cpu (TVM, LLVM AVX2)")
    artifact = ensure_artifact(files, "dense", max_context=256, log=lambda m: print("   " + m))
    print("3. generating")
    engine = Engine(artifact)
    prompt = [1, 20, 300, 4000]
    result = generate(engine, prompt, args.tokens)
    print(f"   prompt {prompt} -> {result['generated_ids']}")
    same = OrtDecoder(files.onnx).greedy(prompt, args.tokens) == result["generated_ids"]
    print(f"   onnxruntime's greedy tokens are {'the same' if same else 'DIFFERENT'}")
    print("4. decode speed against onnxruntime (same model, same threads)")
    summary = measure(files, {"picompile dense": artifact}, args.tokens, runs=3, threads=os.cpu_count())
    print(table({"prompt_len": 16}, summary, {}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
