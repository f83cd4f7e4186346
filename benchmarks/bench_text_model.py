"""The model trained on real text (examples/text_model.py): held-out perplexity of picompile dense and
sparse against onnxruntime, and their decode speed beside onnxruntime's.

    python benchmarks/bench_text_model.py [--preset small|tiny] [--threads 2] [--tokens 32] [--runs 3]
        [--prompt-len 16] [--max-context 256] [--target-recall 0.99] [--eval-seqs 8] [--calib-windows N]
        [--json PATH] [--record]

Trains the model once (or finds it in the cache: `cached_text_model`), builds it for `--target cpu` dense and
sparse with its calibration file (windows of the training files), evaluates each artifact on windows of the
held-out files (perplexity of onnxruntime and of the artifact, KL per position, top-1 agreement, predictor
recall and precision), then times greedy decoding alternately against onnxruntime. Unlike the synthetic
models, its sparsity and its predictability are what training gave it. `--calib-windows N` builds the sparse
artifact from the first N calibration windows only (of `context` tokens each; the hard case of issue 13 was
1,024 calibration tokens), without training again. `--preset tiny` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.bench_decode import add_run_arguments, parsed_run_arguments, QUALITY_COLUMNS, quality_cells  # noqa: E402 (stdlib only: TVM not yet)


def fewer_calibration_windows(files, count: int):
    """The model's files with calib.npy cut to its first `count` windows (written once beside the cache's
    models, not into the model's own directory, which stays as its maker wrote it)."""
    import dataclasses
    import os

    from examples.models import cache_dir, read_tokens, write_tokens

    windows = read_tokens(files.calib)
    if not 0 < count <= len(windows):
        raise SystemExit(f"--calib-windows must be in 1..{len(windows)}")
    path = cache_dir() / "calib" / f"{files.dir.name}-first{count}.npy"
    if not path.exists():  # written aside and renamed, so a killed run leaves no half file under this name
        part = write_tokens(path.with_name(f".{path.name}.{os.getpid()}.npy"), windows[:count])
        os.replace(part, path)
    return dataclasses.replace(files, calib=path)


def perplexity_table(summary: dict, qualities: dict) -> str:
    columns = ("engine", "decode tok/s", "vs onnxruntime", "held-out ppl", "onnxruntime ppl", "ppl change",
               *QUALITY_COLUMNS)
    rows = [f"| {' | '.join(columns)} |", "| --- " * len(columns) + "|"]
    for name, f in summary.items():
        q = qualities.get(name)
        speed = f"**{f['ratio']:.2f}x**" if "ratio" in f else "1.00x"
        if q is None:
            rows.append(f"| {name} | {f['decode_tokens_per_s']:.2f} | {speed} |" + " - |" * (len(columns) - 3))
            continue
        change = q["ppl_compiled"] / q["ppl_reference"] - 1
        rows.append(f"| {name} | {f['decode_tokens_per_s']:.2f} | {speed} | {q['ppl_compiled']:.3f} | "
                    f"{q['ppl_reference']:.3f} | {change * 100:+.2f}% | {quality_cells(q)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-recall", type=float, default=0.99, help="the sparse build's predictor recall")
    parser.add_argument("--eval-seqs", type=int, default=8, help="held-out windows to evaluate on")
    parser.add_argument("--calib-windows", type=int, default=None,
                        help="build from the first N calibration windows only (default: all of the preset's)")
    parser.add_argument("--train-threads", type=int, default=2, help="torch threads if the model must be trained")
    add_run_arguments(parser, preset="small", prompt_len=16)
    args = parsed_run_arguments(parser, argv)

    from examples.bench_decode import ensure_artifact, machine, measure, quality, record
    from examples.text_model import cached_text_model

    files = cached_text_model(args.preset, threads=args.train_threads, log=print)
    meta = json.loads(files.config.read_text())
    context = meta["hf_config"]["max_position_embeddings"]
    if args.calib_windows is not None:
        files = fewer_calibration_windows(files, args.calib_windows)
        meta["calib_tokens"] = args.calib_windows * context
    if args.max_context > context:
        print(f"--max-context {args.max_context} is past the {context} positions the model was trained on: using {context}")
        args.max_context = context
        if args.prompt_len + args.tokens > context:
            parser.error(f"--prompt-len + --tokens exceed the model's {context} positions")
    artifacts = {"picompile dense": ensure_artifact(files, "dense", args.max_context, rebuild=args.rebuild),
                 "picompile sparse": ensure_artifact(files, "sparse", args.max_context, dense=False, rebuild=args.rebuild,
                                                     target_recall=args.target_recall)}
    print(f"evaluating on {args.eval_seqs} held-out windows of {context} tokens")
    qualities = {name: quality(files, path, sequences=args.eval_seqs) for name, path in artifacts.items()}
    states = []
    summary = measure(files, artifacts, args.tokens, args.runs, args.threads, args.prompt_len, host_states=states)
    sparsity = meta["measured_sparsity"]["per_layer"]
    loss, vocabulary = meta["heldout_loss"], meta["tokenizer"]
    model_line = (f"Model: {meta['preset']}, {meta['num_params'] / 1e6:.2f}M params, {vocabulary['kind']} vocabulary of "
                  f"{vocabulary['vocab_size']}, trained "
                  f"{meta['training']['settings']['steps']} steps ({meta['training']['seconds']:.0f}s, "
                  f"{meta['training']['threads']} threads) on {meta['corpus']['train_files']} stdlib files; held-out "
                  f"loss {loss['untrained']:.3f} -> {loss['trained']:.3f} nats/token "
                  f"({loss.get('trained_per_byte', loss['trained']):.3f} nats/byte); "
                  f"learned FFN sparsity per layer {', '.join(f'{s:.3f}' for s in sparsity)} "
                  f"(top-20% share {', '.join(f'{s:.2f}' for s in meta['measured_sparsity']['top20_share'])}); "
                  f"{meta['calib_tokens']} calibration tokens.")
    text = perplexity_table(summary, qualities) + "\n\n" + model_line
    print(text)
    config = {"model": str(files.dir), "preset": meta["preset"], "params": meta["num_params"], "tokens": args.tokens,
              "runs": args.runs, "threads": args.threads, "prompt_len": args.prompt_len, "max_context": args.max_context,
              "target_recall": args.target_recall, "eval_seqs": args.eval_seqs, "machine": machine()}
    if args.json:
        args.json.write_text(json.dumps({"config": config, "summary": summary, "quality": qualities,
                                         "model": {k: meta[k] for k in ("heldout_loss", "measured_sparsity", "training",
                                                                        "corpus", "calib_tokens")}}, indent=1))
    if args.record:
        record(f"Text model, opt-{meta['preset']} ({meta['num_params'] / 1e6:.1f}M params, trained on the stdlib)",
               config, text, "benchmarks/bench_text_model.py", argv, host=states[-1].summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
