"""The sparsity demonstration (the README's second command): train a small OPT-ReLU model on the Python
standard library's sources, compile it for this CPU (dense and sparse), let it write code after a prompt, and
print the decode speed beside onnxruntime's on the same ONNX.

    python examples/relu_quickstart.py [--preset code|small|tiny] [--prompt "def fibonacci(n):"] [--tokens N]
                                  [--temperature 0.7] [--top-k 40] [--seed 0] [--train-threads N]

The first run trains the model (`code`, the default: a 2,048-token BPE and 3.7M parameters, 1,500 steps,
15.6 minutes on two threads of a 2-core machine; `tiny`: seconds, too briefly trained to write anything) and
builds the two artifacts, the sparse one training its predictors; all are cached, and later runs reuse
them. The model's tokenizer (examples/text_model.py) is written beside its ONNX and travels in the
artifacts, so step 3 streams text, as `picompile run ART -p TEXT` does, sampled from the sparse artifact;
then onnxruntime, fed the same tokens one decode step at a time, says whether it ranks the same token first
at each step and how far the chosen tokens' probabilities are from the artifact's. It prints:

    1. training an OPT-ReLU model (code) on the Python standard library's sources, or finding it in ...
       ... (vocabulary, held-out loss, learned FFN sparsity per layer)
    2. compiling it for --target cpu (TVM, LLVM, this CPU's vector ISA): dense, then sparse (profile, ...)
       ... (the two artifacts' paths)
    3. generation with the sparse artifact (temperature 0.7, top_k 40, seed 0), prompt 'def fibonacci(n):\n':
    ------------------------------------------------------------
    def fibonacci(n):
    <what the model writes>
    ------------------------------------------------------------
       onnxruntime on the ONNX model, fed the same tokens, ranks the same token first at 117 of 117 steps; ...
    4. decode speed against onnxruntime (same model, same threads), with the quality each speed has
    | engine | decode tok/s | vs onnxruntime | prefill 16 tokens (ms) | quality |
    | onnxruntime | 725.24 | 1.00x | 3.1 | reference |
    | picompile dense | 1661.15 | **2.29x** | 3.4 | top-1 1.000, KL 6.41e-13 |
    | picompile sparse | 2015.92 | **2.78x** | 3.9 | top-1 0.998, KL 1.95e-05, recall >= 0.990, ... |
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
    from passes.reference import OrtDecoder
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
    engine = Engine(artifacts["picompile sparse"])
    for token in generate_stream(engine, prompt, tokens, stop_ids=tokenizer.eos_ids, **sampling):
        generated.append(token)
        print(stream.push(token), end="", flush=True)
    print(stream.flush() + "\n" + "-" * 60)
    ours = step_probabilities(engine, prompt, generated)
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
    from picompile.evaluate import log_softmax

    decoder.reset()
    logits = [decoder.forward(prompt)[-1]] + [decoder.forward([token])[-1] for token in generated[:-1]]
    return np.exp(log_softmax(np.asarray(logits)))


if __name__ == "__main__":
    sys.exit(main())
