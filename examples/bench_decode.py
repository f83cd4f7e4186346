"""Decode speed of a picompile artifact beside onnxruntime on the same ONNX, same machine, same threads.

    python examples/bench_decode.py --family opt --preset small --tokens 64 --runs 3 [--record]

Runs alternate (onnxruntime, picompile, onnxruntime, ...) so machine drift cancels; the figures are the
medians. `--record` appends the table to BENCHMARKS.md with the date, machine and command. Artifacts are
cached per model, build options and compiler source (a changed compiler rebuilds them).

The helpers here (building, timing, quality, recording) serve benchmarks/bench_cpu_decode.py and
examples/quickstart.py too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Between engines: onnxruntime's and TVM's thread pools spin for a while after a call, and on a small machine
# a spinning pool steals a core from the next engine (see benchmarks/bench_kernels.py)
SETTLE_S = 0.5


def machine() -> str:
    from runtime.artifact import cpu_model_name

    return f"{cpu_model_name()}, {os.cpu_count()} cores, {platform.system()}"


def compiler_digest() -> str:
    """sha256 of the compiler's Python sources (the picompile and passes packages imported here)."""
    import passes
    import picompile

    digest = hashlib.sha256()
    for package in (picompile, passes):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{package.__name__}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def ensure_artifact(files, name: str, max_context: int, dense: bool = True, log=print, rebuild: bool = False,
                    target: str = "cpu", **options) -> Path:
    """Build a dense or sparse artifact of a made model, or reuse the one built before from the same model,
    target, build options (`options`: further pipeline Options fields) and compiler source. A tokenizer
    beside the model's ONNX goes into the artifact, as `picompile build` puts it."""
    from examples.models import cached_artifact, evict_artifacts
    from passes.pipeline import BuildTarget, Options
    from passes.targets import get_target
    from passes.front_end import find_tokenizer

    opts = Options(dense=dense, max_context=max_context, calib=files.calib,
                   **{"tokenizer": find_tokenizer(files.onnx), **options})
    # the ISA resolved, not the option: a default build is the build machine's
    isa = BuildTarget.cpu_isa_of(opts, get_target(target)).name
    key = json.dumps({"model": files.dir.name, "target": target, "options": dataclasses.asdict(opts), "cpu_isa": isa,
                      "compiler": compiler_digest()}, sort_keys=True, default=str)
    artifact = cached_artifact(f"{files.dir.name}-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pic")
    if rebuild or not (artifact / "manifest.json").exists():
        evict_artifacts(keep=artifact)
        started = time.perf_counter()
        # A child process: a 1B build holds GBs (IR, profile, torch) that a long-lived process would keep
        # from the engines measured next (two in-process builds then an eval ran a 23 GB machine out of memory).
        child = multiprocessing.get_context("spawn").Process(target=_build, args=(files.onnx, artifact, target, opts))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"building {artifact.name} failed (exit code {child.exitcode})")
        log(f"built {artifact.name} in {time.perf_counter() - started:.1f}s")
    return artifact


def _build(onnx: Path, artifact: Path, target: str, options) -> None:
    from picompile.compiler import build
    from passes.targets import get_target

    build(onnx, artifact, get_target(target), options, log=lambda message: print("   " + message, flush=True))


def time_decode(forward, reset, prompt, tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) for greedy generation of `tokens` tokens."""
    import numpy as np

    reset()
    started = time.perf_counter()
    logits = forward(prompt)[-1]
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(tokens):
        logits = forward(np.array([int(np.argmax(logits))], np.int64))[-1]
    return prefill, tokens / (time.perf_counter() - started)


def measure(files, artifacts: dict[str, Path], tokens: int, runs: int, threads: int, prompt_len: int = 16,
            each_run=None, baselines: dict[str, Path] | None = None, host_states: list | None = None) -> dict:
    """Decode tokens/s and prefill time per engine: onnxruntime, then each further onnxruntime model of
    `baselines` (name -> ONNX path, e.g. the model quantized), then each artifact, alternating per run after
    one untimed warm-up each (`each_run()`, if given, is called after each run's engines, to measure something
    else alternately). Then one profiled generation per artifact: the weight bytes a decoded token reads and
    the time per kernel class. Artifacts and baselines get their ratios against onnxruntime (`ratio`,
    `prefill_ratio`). The host's state around the timed runs is printed (and appended to `host_states`, for the
    caller's record)."""
    import numpy as np

    from benchmarks.host import HostState

    from passes.reference import OrtDecoder
    from runtime import Engine, generate

    engines = {"onnxruntime": OrtDecoder(files.onnx, threads=threads)}
    # with their KV cache, as the fp32 model runs: OrtDecoder feeds present.* back as past_key_values.*
    engines.update({name: OrtDecoder(path, threads=threads) for name, path in (baselines or {}).items()})
    engines.update({name: Engine(path) for name, path in artifacts.items()})
    vocab = engines[next(iter(artifacts))].vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, size=prompt_len)
    for engine in engines.values():  # untimed: thread pools start, first calls settle
        time_decode(engine.forward, engine.reset, prompt, 2)
    samples = {name: [] for name in engines}
    state = HostState.before()
    for _ in range(runs):
        for name, engine in engines.items():
            time.sleep(SETTLE_S)
            samples[name].append(time_decode(engine.forward, engine.reset, prompt, tokens))
        if each_run is not None:
            time.sleep(SETTLE_S)
            each_run()
    print(state.after().summary(), flush=True)
    if host_states is not None:
        host_states.append(state)
    summary = {}
    for name, runs_of in samples.items():
        summary[name] = {"decode_tokens_per_s": statistics.median(s[1] for s in runs_of),
                         "prefill_ms": 1000 * statistics.median(s[0] for s in runs_of)}
    base = summary["onnxruntime"]
    for name in [*(baselines or {}), *artifacts]:
        summary[name]["ratio"] = summary[name]["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        summary[name]["prefill_ratio"] = base["prefill_ms"] / summary[name]["prefill_ms"]
    for name in artifacts:
        profiled = generate(engines[name], prompt, max(tokens, 2), profile=True)
        summary[name].update({key: profiled[key] for key in ("weight_bytes_per_token", "profile_ms_per_token")})
    return summary


def quality(files, artifact: Path, sequences: int = 4, reference=None) -> dict:
    """Eval against onnxruntime on held-out tokens, and the predictors' recall (what a speed is worth).
    Pass one `reference` (an OrtDecoder) to evaluate several artifacts of a large model without loading it
    again for each."""
    import gc

    from picompile.evaluate import evaluate
    from passes.reference import OrtDecoder
    from passes.tokens import read_tokens
    from runtime import Engine

    engine = Engine(artifact)
    report = evaluate(engine, reference or OrtDecoder(files.onnx), read_tokens(files.heldout)[:sequences])
    report["ppl_change"] = report["ppl_compiled"] / report["ppl_reference"] - 1.0
    expected = engine.manifest.quality
    if expected is not None:  # what the build's quality pass expected on its held-out calibration tokens
        report.update(expected_ppl_change=expected.ppl_change, expected_kl=expected.kl)
    layers = engine.manifest.layers
    if layers and layers[0].predictor_recall is not None:
        report["recall_min"] = min(layer.predictor_recall for layer in layers)
        report["recall_mean"] = sum(layer.predictor_recall for layer in layers) / len(layers)
        report["precision_mean"] = sum(layer.predictor_precision or 0.0 for layer in layers) / len(layers)
        report["predicted_active_mean"] = sum(layer.predictor_active for layer in layers) / len(layers)
    del engine
    gc.collect()  # a 1B engine holds GBs: free it before the next one loads
    return report


def ort_quality(files, onnx_path: Path, max_context: int, sequences: int = 4, reference=None) -> dict:
    """quality() of another onnxruntime model of the same decoder (e.g. the model quantized) against
    onnxruntime on the source model: the same held-out sequences, cut to `max_context` tokens as an
    artifact's are, run through its KV cache (a short prefill, then one token per step)."""
    import gc

    from picompile.evaluate import evaluate
    from passes.reference import OrtDecoder
    from passes.tokens import read_tokens

    candidate = OrtDecoder(onnx_path)
    candidate.max_context = max_context  # what evaluate() cuts each sequence to (an Engine's own limit)
    report = evaluate(candidate, reference or OrtDecoder(files.onnx), read_tokens(files.heldout)[:sequences])
    del candidate
    gc.collect()
    return report


def quality_text(q: dict) -> str:
    """A quality() report in a few words ("reference" for none)."""
    if not q:
        return "reference"
    text = f"top-1 {q['top1_agreement']:.3f}, KL {q['kl_mean']:.2e}"
    if "ppl_change" in q:
        text += f", ppl {q['ppl_change'] * 100:+.2f}%"
    if "expected_kl" in q:
        text += f" (expected KL {q['expected_kl']:.2e}, ppl {q['expected_ppl_change'] * 100:+.2f}%)"
    if "recall_min" in q:
        text += (f", recall >= {q['recall_min']:.3f}, precision {q.get('precision_mean', 0.0):.2f}, "
                 f"{q['predicted_active_mean'] * 100:.1f}% predicted active")
    return text


QUALITY_COLUMNS = ("KL/position", "top-1", "recall min", "precision mean", "predicted active")


def quality_cells(q: dict) -> str:
    """A quality() report as the QUALITY_COLUMNS table cells (the predictor's three "-" for a dense build)."""
    predictor = ("- | - | -" if "recall_min" not in q else
                 f"{q['recall_min']:.3f} | {q.get('precision_mean', 0.0):.2f} | {q['predicted_active_mean'] * 100:.1f}%")
    return f"{q['kl_mean']:.2e} | {q['top1_agreement']:.3f} | {predictor}"


def table(config: dict, summary: dict, qualities: dict) -> str:
    rows = [f"| engine | decode tok/s | vs onnxruntime | prefill {config['prompt_len']} tokens (ms) | quality |",
            "| --- | --- | --- | --- | --- |"]
    for name, figures in summary.items():
        ratio = f"**{figures['ratio']:.2f}x**" if "ratio" in figures else "1.00x"
        text = quality_text(qualities.get(name, {}))
        rows.append(f"| {name} | {figures['decode_tokens_per_s']:.2f} | {ratio} | {figures['prefill_ms']:.1f} | {text} |")
    return "\n".join(rows)


def record(title: str, config: dict, text: str, script: str, argv=None, host: str | None = None) -> None:
    """Append a table to BENCHMARKS.md under `title`, with the date, the machine, how it was timed (`config`:
    threads, tokens, prompt_len, runs), the exact command and how busy the host was (`host`: a HostState's summary;
    without one, the load average as the table is written)."""
    if host is None:
        load = Path("/proc/loadavg").read_text().split()[0]
        host = f"host: load {load} on {os.cpu_count()} cores when recorded (not watched while timed)"
    command = f"python {script} " + " ".join(argv if argv is not None else sys.argv[1:])
    stamp = datetime.date.today().isoformat()
    details = (f"{config['threads']} threads; {config['tokens']} greedy tokens after a {config['prompt_len']}-token "
               f"prompt; median of {config['runs']} alternating runs.")
    with open(ROOT / "BENCHMARKS.md", "a") as f:
        f.write(f"\n### {title}, {stamp}\n\nMachine: {machine()}; {details}\nCommand: `{command}`\n{host.capitalize()}\n\n"
                f"{text}\n")


def add_run_arguments(parser: argparse.ArgumentParser, *, preset: str, tokens: int = 32, threads: int = 2,
                      prompt_len: int = 16) -> None:
    """The options every decode benchmark takes (model size, threads, run shape, caching, output), with the
    script's defaults; `parsed_run_arguments` checks them."""
    parser.add_argument("--preset", default=preset, help="model size preset of examples/models.py")
    parser.add_argument("--threads", type=int, default=threads, help="threads for every engine")
    parser.add_argument("--tokens", type=int, default=tokens, help="greedy tokens decoded per run")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs; figures are their medians")
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the artifacts even if cached")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--record", action="store_true", help="append the table to BENCHMARKS.md")


def parsed_run_arguments(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse, refuse a run shape that cannot be measured, and give picompile's kernels the threads
    onnxruntime gets (before TVM is imported, which reads it)."""
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.runs < 1 or args.prompt_len < 2:
        parser.error("--tokens must be at least 2, --runs at least 1, --prompt-len at least 2")
    if args.prompt_len + args.tokens > args.max_context:
        parser.error(f"--prompt-len + --tokens ({args.prompt_len + args.tokens}) exceed --max-context {args.max_context}")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    return args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="opt", choices=["opt", "llama"])
    parser.add_argument("--sparsity", type=float, default=None,
                        help="make a synthetic sparse model and also build the sparse artifact")
    add_run_arguments(parser, preset="small", tokens=64, threads=os.cpu_count())
    args = parsed_run_arguments(parser, argv)

    from examples.models import cached_model

    files = cached_model(args.family, preset=args.preset, sparsity=args.sparsity, log=print)
    params = json.loads(files.config.read_text())["num_params"]
    artifacts = {"picompile dense": ensure_artifact(files, "dense", args.max_context, rebuild=args.rebuild)}
    if args.sparsity is not None:
        artifacts["picompile sparse"] = ensure_artifact(files, "sparse", args.max_context, dense=False, rebuild=args.rebuild)
    qualities = {name: quality(files, path) for name, path in artifacts.items()}
    states = []
    summary = measure(files, artifacts, args.tokens, args.runs, args.threads, args.prompt_len, host_states=states)
    config = {"family": args.family, "preset": args.preset, "params": params, "tokens": args.tokens,
              "runs": args.runs, "threads": args.threads, "prompt_len": args.prompt_len, "sparsity": args.sparsity}
    text = table(config, summary, qualities)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"config": config, "summary": summary, "quality": qualities}, indent=1))
    if args.record:
        kind = f"synthetic {args.sparsity:.0%}-sparse" if args.sparsity is not None else "dense-random"
        record(f"Decode, {args.family}-{args.preset} ({params / 1e6:.0f}M params, {kind})", config, text,
               "examples/bench_decode.py", argv, host=states[-1].summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
