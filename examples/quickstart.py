"""Quickstart: train a small OPT-ReLU model on the Python standard library's sources, compile it for this
CPU (dense and sparse), let it write code after a prompt, and print the decode speed beside onnxruntime's on
the same ONNX.

    python examples/quickstart.py [--preset small|tiny] [--prompt "def fibonacci(n):"] [--tokens N]

The first run trains the model on one thread (`small`: 3.3M parameters, about 10 minutes of one idle core,
as measured in examples/text_model.py; `tiny`: seconds, too briefly trained to write code) and builds the
two artifacts, the sparse one training its predictors; all are cached, and later runs reuse them. The
model's tokenizer (bytes, examples/text_model.py) is written beside its ONNX and travels in the artifacts,
so step 3 streams text, as `picompile run ART -p TEXT` does. It prints (`--preset tiny`, a 2-core machine
loaded by other jobs; the tiny model's "code" is spaces):

    1. training an OPT-ReLU model (tiny) on the Python standard library's sources, or finding it in ...
       ... (held-out loss, learned FFN sparsity per layer)
    2. compiling it for --target cpu (TVM, LLVM, this CPU's vector ISA): dense, then sparse (profile, ...)
       ... (the two artifacts' paths)
    3. greedy generation with the sparse artifact, prompt 'def fibonacci(n):\n':
    ------------------------------------------------------------
    def fibonacci(n):
    <what the model writes>
    ------------------------------------------------------------
       the first 45 of its 45 tokens (bytes) equal onnxruntime's greedy ones on the ONNX model
    4. decode speed against onnxruntime (same model, same threads), with the quality each speed has
    | engine | decode tok/s | vs onnxruntime | prefill 16 tokens (ms) | quality |
    | onnxruntime | 1803.73 | 1.00x | 0.9 | reference |
    | picompile dense | 3430.82 | **1.90x** | 1.5 | top-1 1.000, KL 5.88e-15 |
    | picompile sparse | 4136.67 | **2.29x** | 5.1 | top-1 1.000, KL 5.88e-15, recall >= 0.990, ... |
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPEED_PROMPT_LEN = 16  # the random prompt the speed table times (examples/bench_decode.py measure)
PROMPT = "def fibonacci(n):\n"

from examples.text_model import TEXT_PRESETS, cached_text_model  # noqa: E402  (after the path above)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="code", choices=sorted(TEXT_PRESETS),
                        help="text model preset of examples/text_model.py")
    parser.add_argument("--prompt", default=PROMPT, help="the code the model continues")
    parser.add_argument("--tokens", type=int, default=160,
                        help="tokens to generate at most (fewer if the model's context is shorter)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-threads", type=int, default=os.cpu_count(), help="torch threads for training")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

    from examples.bench_decode import ensure_artifact, measure, quality, table
    from examples.models import cache_dir
    from picompile.reference import OrtDecoder
    from runtime import Engine, generate_stream
    from runtime.text import load_tokenizer

    say = lambda message: print("   " + message, flush=True)  # noqa: E731
    context = TEXT_PRESETS[args.preset]["context"]
    print(f"1. training an OPT-ReLU model ({args.preset}) on the Python standard library's sources, or finding "
          f"it in {cache_dir()}", flush=True)
    files = cached_text_model(args.preset, threads=args.train_threads, log=say)
    meta = json.loads(files.config.read_text())
    loss = meta["heldout_loss"]
    say(f"{files.onnx} ({meta['num_params']:,} parameters, {meta['tokenizer']['kind']} vocabulary of "
        f"{meta['tokenizer']['vocab_size']}, held-out loss {loss.get('trained_per_byte', loss['trained']):.2f} "
        f"nats/byte, learned FFN sparsity per layer "
        f"{', '.join(f'{s:.2f}' for s in files.layer_sparsity)})")
    print("2. compiling it for --target cpu (TVM, LLVM, this CPU's vector ISA): dense, then sparse "
          "(profile, predictors, lowering)", flush=True)
    artifacts = {"picompile dense": ensure_artifact(files, "dense", context, log=say),
                 "picompile sparse": ensure_artifact(files, "sparse", context, dense=False, log=say)}
    for name, path in artifacts.items():
        say(f"{name}: {path}")

    sampling = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    how = "greedy" if args.temperature <= 0 else ", ".join(f"{k} {v}" for k, v in sampling.items())
    print(f"3. generation with the sparse artifact ({how}), prompt {args.prompt!r}:", flush=True)
    tokenizer = load_tokenizer(artifacts["picompile sparse"])
    prompt = tokenizer.encode(args.prompt)
    tokens = max(1, min(args.tokens, context - len(prompt)))
    stream, generated = tokenizer.stream(), []
    print("-" * 60 + "\n" + args.prompt, end="", flush=True)
    for token in generate_stream(Engine(artifacts["picompile sparse"]), prompt, tokens,
                                 stop_ids=tokenizer.eos_ids, **sampling):
        generated.append(token)
        print(stream.push(token), end="", flush=True)
    print(stream.flush() + "\n" + "-" * 60)
    ours = step_probabilities(Engine(artifacts["picompile sparse"]), prompt, generated)
    theirs = step_probabilities(OrtDecoder(files.onnx), prompt, generated)
    same_first = int((ours.argmax(1) == theirs.argmax(1)).sum())
    rows = np.arange(len(generated))
    gap = float(np.abs(ours[rows, generated] - theirs[rows, generated]).max())
    say(f"onnxruntime on the ONNX model, fed the same tokens, ranks the same token first at {same_first} of "
        f"{len(generated)} steps; the chosen tokens' probabilities differ by at most {gap:.4f}")

    print("4. decode speed against onnxruntime (same model, same threads), with the quality each speed has",
          flush=True)
    qualities = {name: quality(files, path) for name, path in artifacts.items()}
    summary = measure(files, artifacts, min(64, context - SPEED_PROMPT_LEN), runs=3, threads=os.cpu_count(),
                      prompt_len=SPEED_PROMPT_LEN)
    print(table({"prompt_len": SPEED_PROMPT_LEN}, summary, qualities))
    return 0


def step_probabilities(decoder, prompt: list[int], generated: list[int]) -> np.ndarray:
    """The next-token probabilities [len(generated), vocab] that `decoder` (an Engine or an OrtDecoder: reset,
    forward) gives at each generation step, fed the prompt, then the generated tokens one decode step at a
    time (the path the text came from)."""
    decoder.reset()
    logits = [decoder.forward(prompt)[-1]] + [decoder.forward([token])[-1] for token in generated[:-1]]
    scores = np.asarray(logits, np.float64)
    weights = np.exp(scores - scores.max(1, keepdims=True))
    return weights / weights.sum(1, keepdims=True)


if __name__ == "__main__":
    sys.exit(main())
