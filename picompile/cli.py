"""The `picompile` command: build, run, chat, serve, eval, inspect.

Exit codes: 0 success; 2 bad input or usage (one `error:` line on stderr, no traceback); 1 internal error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

from passes.errors import PassError, UserError
from runtime.gate import KEY_VARIABLE, MAX_BODY_BYTES, MAX_REQUESTS
from runtime.manifest import Manifest
from passes.targets import CPU_ISAS
from runtime.dtypes import AUTO_WEIGHT_DTYPE, QUANT_METHODS, ROUNDABLE_FORMATS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        raise UserError(f"{self.prog}: {message}")


def _number(kind, accepts, expected: str):
    """An argparse type: `kind(text)`, refused unless finite and `accepts(value)`; `expected` says the range."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (math.isfinite(value) and accepts(value)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_unit_interval = _number(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
_sparsity = _number(float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")


def _non_negative(kind):
    return _number(kind, lambda v: v >= 0, f"a non-negative {kind.__name__}")


def _parser() -> argparse.ArgumentParser:
    from passes.targets import TARGETS

    parser = _Parser(prog="picompile", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    build = commands.add_parser("build", help="compile an ONNX decoder (or a GGUF file) into an artifact")
    build.add_argument("model", type=Path)
    build.add_argument("--target", default="cpu", help=f"one of {', '.join(TARGETS)}")
    build.add_argument("-o", "--output", type=Path, required=True)
    build.add_argument("--dense", action="store_true", help="no sparsity: compute every neuron")
    build.add_argument("--dump-ir", type=Path, help="write the IR after every pass into this directory")
    build.add_argument("--calib", type=Path,
                       help="calibration data for profiling (every token is profiled): token ids (.npy, or a file "
                            "of integers, one sequence per line), or text tokenized with the model's tokenizer: a "
                            "text file or a directory of .txt/.md/.py files")
    build.add_argument("--tokenizer", type=Path, metavar="DIR",
                       help="the model's tokenizer (a directory with tokenizer.json, as save_pretrained writes it), "
                            "copied into the artifact for `run -p` and `chat`; default: the one beside the ONNX file, "
                            "or a GGUF file's own")
    build.add_argument("--calib-tokens", type=_positive_int, default=None, metavar="N",
                       help="profile at most N calibration tokens (default: all of --calib; 4096 random tokens "
                            "without it)")
    build.add_argument("--calib-samples", type=_non_negative(int), default=None, metavar="N",
                       help="also profile N sequences sampled from the model itself (onnxruntime, temperature 1); "
                            "default: enough to bring a --calib that is small for the model's FFN width up to size; "
                            "0: none")
    build.add_argument("--vram-budget", help="GPU memory to use, e.g. 8GiB (default: the target's)")
    build.add_argument("--max-context", type=_positive_int, default=None, metavar="N",
                       help="the longest sequence (prompt and generated tokens) the artifact holds, the length of "
                            "its KV cache; default: the context the model was trained for (a GGUF file's "
                            "<arch>.context_length, config.json's max_position_embeddings beside an ONNX file; else "
                            "256), capped so that a sequence's KV cache takes at most a quarter of the memory "
                            "available beside the weights. The build prints the context it chose")
    build.add_argument("--max-batch", type=_non_negative(int), default=8, metavar="N",
                       help="CPU artifacts: decode up to N sequences in one batch step (a sparse layer reads the union "
                            "of their predicted neurons once); 0 or 1: no batch phase")
    build.add_argument("--all-neurons", action="store_true",
                       help="lower sparse but let every neuron through the predictor (checks the hot/cold split)")
    build.add_argument("--no-dense-fallback", action="store_true",
                       help="predictor mode: lower every layer sparse, even where the cost model expects the dense "
                            "FFN to be faster (at a high expected share of active neurons)")
    build.add_argument("--placement-batch", type=_positive_int, default=None,
                       help="neurons per placement ILP column (default: 64 per 8,192 neurons of the widest layer)")
    build.add_argument("--placement-time-limit", type=_non_negative(float), default=30.0, metavar="SECONDS",
                       help="time limit of the placement ILP; past it the best placement found is used and reported "
                            "as not optimal, with its gap (picompile inspect)")
    build.add_argument("--weight-dtype", choices=[AUTO_WEIGHT_DTYPE, *ROUNDABLE_FORMATS], default=AUTO_WEIGHT_DTYPE,
                       help="storage of the CPU's weight matrices: auto (default) keeps the model's own (fp16 for an "
                            "fp16 or bf16 file, int4/int8 for a MatMulNBits one, int4a for one with 4-bit zero points, "
                            "else fp32); fp16 halves the bytes a token reads; int8 and int4 store blocks of 32 integers "
                            "with an fp16 scale (Q8_0 / Q4_0), about 1/4 and 1/7 of fp32; int4a blocks of 32 4-bit "
                            "values with an fp16 scale and minimum (Q4_1), 1/6.4. Math stays fp32")
    build.add_argument("--quant-method", choices=list(QUANT_METHODS), default="awq",
                       help="int8/int4 builds: awq scales each FFN's input channels by their profiled magnitude before "
                            "rounding (activation-aware; folded into the norm, exact in floats), rtn rounds every weight "
                            "as it is")
    build.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=True,
                       help="quantized builds: int4 decode GEMVs (int8 ones too on CPUs with AVX512-VNNI) quantize their "
                            "input to int8 per block of 32 and use integer dot products, as llama.cpp's Q4_0 and onnxruntime's int4 do (~5e-3 relative error of a "
                            "layer's output, 1.3-1.9x faster); --no-int8-activations keeps fp32 inputs")
    build.add_argument("--cpu-isa", choices=list(CPU_ISAS), default=None,
                       help="instruction set of the CPU kernels (default: the widest this machine has: avx512vnni, avx512 "
                            "or avx2); the artifact then runs only on CPUs that have it: avx2 makes portable artifacts")
    build.add_argument("--target-recall", type=_unit_interval, default=0.99,
                       help="share of truly active neurons the predictors must let through (held-out tokens)")
    build.add_argument("--sparsity-mode", choices=["auto", "predictor", "threshold"], default="auto",
                       help="how decode skips FFN work: predictor (PowerInfer; ReLU FFNs), threshold (TEAL: drop "
                            "projection inputs of small magnitude; SiLU/GELU FFNs), auto: by the FFN activation")
    build.add_argument("--sparsity", type=_sparsity, default=None,
                       help="threshold mode: drop this share of every FFN projection's inputs, one level for all "
                            "(default: a level per linear input, attention's and the output layer's too, chosen within "
                            "--max-quality-loss)")
    build.add_argument("--max-quality-loss", type=_quality_budget, default=None, metavar="BUDGET",
                       help="what the build may give up for speed, measured on held-out calibration tokens against "
                            "the source model: a perplexity increase (1%%, the default; or 0.01) or a mean KL per "
                            "token (kl=0.01). Threshold mode picks its levels per linear input and, for "
                            "--weight-dtype int8/int4/int4a, a format per matrix within it: --weight-dtype int4 means "
                            "at most 4 bits, a matrix whose rounding costs too much stays int8 or fp16")
    build.add_argument("--nodes", type=_nodes, default=(), metavar="SPEC",
                       help="split the model across machines, a contiguous range of layers each, by their memory "
                            "and speed: 2x24GiB, 24GiB,16GiB, or a JSON file naming each node's memory, target "
                            "and Ray resources (docs/nodes.md); `run` / `serve` start one Ray actor per stage")
    chatter = build.add_mutually_exclusive_group()
    chatter.add_argument("-v", "--verbose", action="store_true",
                         help="print each pass with its time and node counts, and a failing pass's traceback")
    chatter.add_argument("-q", "--quiet", action="store_true",
                         help="no progress bars and no estimate: print only the `wrote PATH` line (and errors)")

    run = commands.add_parser("run", help="generate tokens with an artifact")
    run.add_argument("artifact", type=Path)
    prompt = run.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text (the artifact's tokenizer encodes it); the generated "
                                               "text is printed as it comes")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    _sampling_arguments(run)
    run.add_argument("--profile", action="store_true",
                     help="time per kernel class and weight bytes read per decoded token")
    run.add_argument("--emulate-gpu", action="store_true", help="run a GPU artifact's GPU part on a second CPU executor")
    _threads_argument(run)
    run.add_argument("--json", action="store_true")
    _stages_arguments(run)

    chat = commands.add_parser("chat", help="talk with an artifact's model: a user turn per line of stdin")
    chat.add_argument("artifact", type=Path)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    _sampling_arguments(chat, default_tokens=256)
    chat.add_argument("--emulate-gpu", action="store_true", help="run a GPU artifact's GPU part on a second CPU executor")
    _threads_argument(chat)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server for an artifact (the serve extra)")
    serve.add_argument("artifact", type=Path)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=_number(int, lambda v: 0 <= v <= 65535, "a port in [0, 65535]"), default=8000,
                       help="TCP port (0: any free one; the address is printed on stderr)")
    serve.add_argument("--parallel", type=_positive_int, default=1,
                       help="requests decoded at once, one KV cache (slot) each; their decode steps run as one batch "
                            "step where the artifact has a batch phase (build --max-batch)")
    serve.add_argument("--queue", type=_non_negative(int), default=16,
                       help="requests that may wait for a slot; past that the server answers 429 with Retry-After")
    serve.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                       help="prompt tokens prefilled a step, between the running requests' decode steps: a new "
                            "long prompt delays their next tokens by one such part (default: 128)")
    access = serve.add_argument_group("keys and limits (docs/serving.md)")
    access.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="ask every request but /health for 'Authorization: Bearer KEY' (repeat for more keys; "
                             f"also --api-key-file and the {KEY_VARIABLE} environment variable); 401 without")
    access.add_argument("--api-key-file", type=Path, default=None, metavar="FILE", help="keys, one per line")
    access.add_argument("--max-body-bytes", type=_positive_int, default=MAX_BODY_BYTES, metavar="N",
                        help=f"the largest request body taken (default {MAX_BODY_BYTES}); 413 past it")
    access.add_argument("--max-requests", type=_positive_int, default=MAX_REQUESTS, metavar="N",
                        help=f"requests answered at once, streams included (default {MAX_REQUESTS}); 429 past it")
    access.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web page origin allowed cross-origin requests (repeat; '*' for any); none by default")
    _threads_argument(serve)
    ray = serve.add_argument_group("replicas on Ray Serve (the ray extra; docs/serving.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: replicas of this server (each its own engine, --parallel slots "
                          "and --queue; --threads threads and CPUs, default 1) behind one address, replaced if they die")
    ray.add_argument("--replicas", type=_positive_int, default=None, metavar="N", help="a fixed count (default 1)")
    ray.add_argument("--min-replicas", type=_positive_int, default=None, metavar="A",
                     help="autoscale: at least A replicas (default 1), more as ongoing requests per replica pass --parallel")
    ray.add_argument("--max-replicas", type=_positive_int, default=None, metavar="B", help="autoscale: at most B replicas")
    ray.add_argument("--address", default=None, metavar="ADDR",
                     help="a running Ray cluster (its head's host:6379, or auto on one of its nodes); default: a Ray "
                          "instance of this process on this machine only. A model split across machines (build "
                          "--nodes) starts its stages there, with or without --ray")
    _stages_argument(serve)  # (serve's --address is the Ray group's)

    evaluate = commands.add_parser("eval", help="compare an artifact with onnxruntime on the source ONNX (or GGUF file)")
    evaluate.add_argument("artifact", type=Path)
    evaluate.add_argument("--reference", type=Path, required=True)
    evaluate.add_argument("--tokens", type=Path, required=True)
    evaluate.add_argument("--max-sequences", type=_positive_int, default=8)
    evaluate.add_argument("--baseline", type=Path, default=None, metavar="ARTIFACT",
                          help="a second artifact of the same model (say its dense build in the same weight dtype): "
                               "eval reports it against the reference too, and the artifact against it, so that the "
                               "error of sparsity and of the weights' precision show apart")
    evaluate.add_argument("--emulate-gpu", action="store_true", help="run a GPU artifact's GPU part on a second CPU executor")
    _threads_argument(evaluate)
    evaluate.add_argument("--json", action="store_true")

    calibrate = commands.add_parser("calibrate", help="measure this machine's CPU kernels again (builds price their "
                                                     "decode with the figures; measured once per machine otherwise)")
    calibrate.add_argument("--json", action="store_true")

    inspect = commands.add_parser("inspect", help="show what the compiler decided")
    inspect.add_argument("artifact", type=Path)
    inspect.add_argument("--json", action="store_true")
    inspect.add_argument("--report", type=Path,
                         help="also write a report: .html (self-contained, with plots) or .png (the plots)")
    return parser


def _sampling_arguments(command, default_tokens: int = 32) -> None:
    command.add_argument("-n", "--max-new-tokens", type=_positive_int, default=default_tokens)
    command.add_argument("--temperature", type=_non_negative(float), default=0.0)
    command.add_argument("--top-k", type=_non_negative(int), default=0)
    command.add_argument("--top-p", type=_unit_interval, default=1.0)
    command.add_argument("--seed", type=_non_negative(int), default=None)


def _quality_budget(text: str):
    from passes.budget import parse_budget

    try:
        return parse_budget(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--max-quality-loss ")) from None


def _nodes(text: str):
    from passes.nodes import parse_nodes

    try:
        return parse_nodes(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--nodes: ").removeprefix("--nodes ")) from None


def _build(args) -> int:
    from .compiler import build
    from passes.pipeline import Options
    from passes.targets import get_target, parse_size

    target = get_target(args.target)
    if args.dense and (args.sparsity is not None or args.sparsity_mode != "auto"):
        raise UserError("--dense computes every input of every FFN: drop --sparsity and --sparsity-mode, or --dense")
    from passes.front_end import find_tokenizer
    from passes.tokens import check_calibration

    tokenizer = find_tokenizer(args.model, args.tokenizer)
    if args.calib is not None:
        check_calibration(args.calib, tokenizer is not None)
    options = Options(dense=args.dense, max_context=args.max_context, calib=args.calib, tokenizer=tokenizer,
                      calib_tokens=args.calib_tokens, calib_samples=args.calib_samples,
                      vram_budget_bytes=parse_size(args.vram_budget) if args.vram_budget else None,
                      all_neurons=args.all_neurons, dense_fallback=not args.no_dense_fallback,
                      placement_batch=args.placement_batch,
                      placement_time_limit_s=args.placement_time_limit,
                      weight_dtype=args.weight_dtype, int8_activations=args.int8_activations,
                      max_batch=args.max_batch,
                      quant_method=args.quant_method,
                      target_recall=args.target_recall, cpu_isa=args.cpu_isa,
                      sparsity_mode=args.sparsity_mode, sparsity=args.sparsity, nodes=args.nodes,
                      **({"quality_budget": args.max_quality_loss} if args.max_quality_loss else {}))
    log = (lambda message: print(message, file=sys.stderr)) if args.verbose else (lambda message: None)
    from passes.pipeline import ProgressBars

    # warnings (say, too little calibration data) reach the user without -v; --quiet keeps them out
    warn = None if args.quiet else (lambda message: print(f"warning: {message}", file=sys.stderr))
    # the context chosen (and why) is printed before the passes run, without -v too
    say = log if args.quiet else (lambda message: print(message, flush=True))
    output = build(args.model, args.output, target, options, dump_dir=args.dump_ir, log=log, warn=warn,
                   verify=args.dump_ir is not None, progress=ProgressBars.enabled_for_stderr(args.quiet), say=say)
    print(f"wrote {output}")
    if args.quiet:
        return 0
    from passes.costmodel import Estimate

    from runtime import load_manifest

    manifest = load_manifest(output, check_hashes=False)  # just written
    if manifest.sparsity is not None:
        print(f"sparsity: {manifest.sparsity.describe()}")
    for line in Estimate(**manifest.estimate).lines(target):
        print(line)
    if manifest.placement and target.has_gpu:
        from passes.partition import PlacementReport

        print(f"  placement: {PlacementReport.from_json(manifest.placement).choice()}")
    if manifest.quality is not None:
        print(manifest.quality.line())
    return 0


def _threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="kernel threads: N for every step; default: measured as it runs, per kind of step, "
                             "among the cores this process may use (fewer where other work keeps cores busy)")


def _stages_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", choices=("ray", "local"), default=None,
                        help="a model split across machines (build --nodes): its stages as Ray actors (ray, the "
                             "default) or all in this process (local)")


def _stages_arguments(parser: argparse.ArgumentParser) -> None:
    """`run`'s --stages and --address."""
    _stages_argument(parser)
    parser.add_argument("--address", default=None, metavar="ADDR",
                        help="with --stages ray: the Ray cluster whose nodes offer the stages' resources (its head's "
                             "host:6379); default: a Ray instance of this process on this machine only")


def _split_stages(path: Path) -> list:
    """The stages of a model split across machines (build --nodes); [] for an unsplit artifact (or none at `path`:
    loading it says what is wrong)."""
    from runtime import ArtifactError, load_manifest

    try:
        return load_manifest(path, check_hashes=False).stages
    except ArtifactError:
        return []


def _stages_engine(args, slots: int = 1):
    """`run` / `serve`: a split artifact's stages as Ray actors on a local Ray instance or the cluster at --address
    (runtime/ray_stages.py), or with --stages local all in this process; an unsplit artifact's engine. Returns the
    engine and what stops it (None: nothing to stop)."""
    stages = _split_stages(args.artifact)
    if args.stages is not None and not stages:
        raise UserError(f"--stages: {args.artifact} is not split across machines (built without --nodes)")
    if not stages or args.stages == "local":
        if args.address is not None and not getattr(args, "ray", False):
            raise UserError("--address starts the stages of a model split across machines (build --nodes) on a Ray "
                            "cluster" + ("" if stages else f"; {args.artifact} is not split") +
                            ("" if not stages else "; --stages local runs them in this process"))
        return _engine(args.artifact, getattr(args, "emulate_gpu", False), slots, args.threads), None
    try:
        from runtime import ray_stages
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "ray":
            raise
        raise UserError(f"{args.artifact} is split across machines (build --nodes): running its stages needs the ray "
                        "extra (ray is not installed): pip install -e '.[ray]' (or --stages local: all in this process)"
                        ) from None
    from runtime import ArtifactError

    local = args.address is None
    try:
        if local:
            ray_stages.start_local(stages)
        else:
            ray_stages.connect(args.address)
        pipeline = ray_stages.Pipeline(args.artifact, slots=slots, threads=args.threads or 1,
                                       code_path=str(Path(ray_stages.__file__).resolve().parents[1]) if local else None,
                                       emulate_gpu=getattr(args, "emulate_gpu", False))
    except (ArtifactError, ray_stages.StageFailed, ConnectionError, RuntimeError, ValueError) as error:
        ray_stages.stop()
        raise UserError(f"the stages of {args.artifact} could not start on Ray: {error}") from None
    print(f"{len(stages)} stages on Ray ({'this machine' if local else args.address}): "
          + ", ".join(f"{stage.name} {stage.layers_text()}" for stage in stages),
          file=sys.stderr, flush=True)
    return pipeline, ray_stages.stop


def _engine(path: Path, emulate_gpu: bool = False, slots: int = 1, threads: int | None = None):
    from runtime import ArtifactError, Engine

    try:
        return Engine(path, emulate_gpu=emulate_gpu, slots=slots, threads=threads)
    except ArtifactError as error:
        raise UserError(str(error)) from None


def _text_tokenizer(path: Path, needed_by: str | None):
    """The artifact's tokenizer (None without one); `needed_by` (an option or command) makes its absence an error."""
    from runtime import ArtifactError
    from runtime.text import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except ArtifactError as error:
        raise UserError(str(error)) from None
    if tokenizer is None and needed_by is not None:
        raise UserError(f"this artifact has no tokenizer, which {needed_by} needs: rebuild it with the model's "
                        "tokenizer.json beside the ONNX file or --tokenizer DIR, or use --prompt-ids")
    return tokenizer


def _check_prompt(prompt: list[int], max_new_tokens: int, engine, what: str) -> None:
    if max(prompt) >= engine.vocab_size:
        raise UserError(f"{what}: id {max(prompt)} is outside the vocabulary (size {engine.vocab_size})")
    if len(prompt) + max_new_tokens > engine.max_context:
        raise UserError(f"prompt ({len(prompt)}) + -n ({max_new_tokens}) exceed the artifact's max context "
                        f"{engine.max_context}; rebuild with a larger --max-context")


def _sampling(args) -> dict:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}


def _stream_text(tokens, tokenizer) -> list[int]:
    """Write the text of `tokens` (an iterator of ids) to stdout as each piece completes, and a line end
    unless the text ends with one; return the ids."""
    stream, generated, written = tokenizer.stream(), [], ""
    for token in tokens:
        generated.append(token)
        piece = stream.push(token)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()  # the reader sees each piece now, not when a buffer fills
            written = piece
    rest = stream.flush()
    sys.stdout.write(rest + ("" if (rest or written).endswith("\n") else "\n"))
    sys.stdout.flush()
    return generated


def _print_speed(result: dict) -> None:
    cached = result.get("prompt_cached_tokens", 0)
    reused = f" ({cached} prompt tokens from the cache)" if cached else ""
    print(f"prefill {result['prefill_ms']:.1f} ms{reused}, decode {result['decode_tokens_per_s']:.1f} tokens/s",
          file=sys.stderr)


def _run(args) -> int:
    from runtime.sampling import GenerationStats, generate_stream, profile_per_token, timings

    from passes.tokens import parse_ids

    text = args.prompt is not None
    ids = None if text else parse_ids(args.prompt_ids, "--prompt-ids")  # refused before the artifact is read
    tokenizer = _text_tokenizer(args.artifact, "-p" if text else None)  # with ids, it names the EOS ids
    prompt = tokenizer.encode(args.prompt) if text else ids
    if not prompt:
        raise UserError("-p: the prompt is empty (the tokenizer makes no tokens of it)")
    if args.profile and args.stages != "local" and _split_stages(args.artifact):
        raise UserError("--profile times the kernels of this process; a split artifact's stages run as Ray actors: "
                        "add --stages local to profile them in one process")
    engine, stop = _stages_engine(args)
    try:
        _check_prompt(prompt, args.max_new_tokens, engine, "-p" if text else "--prompt-ids")
        stats = GenerationStats()
        tokens = generate_stream(engine, prompt, args.max_new_tokens, **_sampling(args), profile=args.profile,
                                 stats=stats, stop_ids=tokenizer.eos_ids if tokenizer else ())
        generated = _stream_text(tokens, tokenizer) if text and not args.json else list(tokens)
    finally:
        if stop is not None:
            stop()
    result = {"prompt_ids": prompt, "generated_ids": generated, **timings(stats)}
    if text:
        result.update(prompt=args.prompt, text=tokenizer.decode(generated))
    if args.profile:
        result.update(profile_per_token(stats.profile))
        expected = _expected_ms_by_role(engine)
        if expected is not None:
            result["expected_ms_per_token"] = expected
            result["expected_decode_tokens_per_s"] = 1000 / sum(expected.values())
    if args.json:
        print(json.dumps(result))
    else:
        if not text:
            print(" ".join(map(str, result["generated_ids"])))
        _print_speed(result)
        by_role, gbs = result.get("weight_bytes_per_token_by_role", {}), result.get("weight_gbs_by_role", {})
        expected = result.get("expected_ms_per_token", {})
        for role, ms in result.get("profile_ms_per_token", {}).items():
            reads = (f"  {by_role[role] / 2**20:9.3f} MiB/token at {gbs[role]:5.1f} GB/s" if role in gbs else "")
            priced = f"  (expected {expected[role]:.3f})" if role in expected else ""
            print(f"  {role:<10} {ms:8.3f} ms/token{reads}{priced}", file=sys.stderr)
        if "expected_decode_tokens_per_s" in result:
            print(f"  expected   {result['expected_decode_tokens_per_s']:.1f} tok/s on this machine's kernels as last "
                  f"measured (picompile calibrate), measured {result['decode_tokens_per_s']:.1f}", file=sys.stderr)
        if "weight_bytes_per_token" in result:
            print(f"  weights    {result['weight_bytes_per_token'] / 2**20:8.3f} MiB/token "
                  f"({result['weight_bytes_per_token']:.0f} bytes), {result['weight_gbs_kernels']:.1f} GB/s over "
                  f"kernel time, {result['weight_gbs_wall']:.1f} GB/s over wall time", file=sys.stderr)
    return 0


def _chat(args) -> int:
    """A user turn per line of stdin (a terminal or a pipe) until its end; each turn the whole conversation
    goes through the chat prompt, and the prefill runs from where the cache's earlier turns end (the prefix
    cache: `Engine.resume`)."""
    from runtime.sampling import GenerationStats, generate_stream, timings

    tokenizer = _text_tokenizer(args.artifact, "chat")
    engine = _engine(args.artifact, args.emulate_gpu, threads=args.threads)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    terminal = sys.stdin.isatty()
    for turn, line in enumerate(_lines(sys.stdin, "> " if terminal else None)):
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = tokenizer.chat_ids(messages)
        except ValueError as error:
            raise UserError(str(error)) from None
        room = engine.max_context - len(prompt)
        if room < 1:
            raise UserError(f"the conversation ({len(prompt)} tokens) fills the artifact's max context "
                            f"{engine.max_context}: start a new chat, or rebuild with a larger --max-context")
        _check_prompt(prompt, 0, engine, "the chat prompt")
        sampling = {**_sampling(args), "seed": None if args.seed is None else args.seed + turn}
        stats = GenerationStats()
        tokens = generate_stream(engine, prompt, min(args.max_new_tokens, room), **sampling, stats=stats,
                                 stop_ids=tokenizer.eos_ids)
        generated = _stream_text(tokens, tokenizer)
        messages.append({"role": "assistant", "content": tokenizer.decode(generated)})
        _print_speed(timings(stats))
    return 0


def _lines(stream, prompt: str | None):
    """The lines of `stream` without their line ends, `prompt` written to stderr before each (a terminal's)."""
    while True:
        if prompt:
            print(prompt, end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line:
            return
        yield line.rstrip("\r\n")


def _serve(args) -> int:
    if args.ray:
        return _serve_ray(args)
    ray_options = [option for option, value in (("--replicas", args.replicas), ("--min-replicas", args.min_replicas),
                                                ("--max-replicas", args.max_replicas), ("--address", args.address))
                   if value is not None and not (option == "--address" and _split_stages(args.artifact))]
    if ray_options:
        raise UserError(f"{ray_options[0]} needs --ray")
    try:
        from runtime import serve
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in ("starlette", "uvicorn"):
            raise
        raise UserError(f"picompile serve needs the serve extra ({missing} is not installed): "
                        "pip install 'picompile[serve]'") from None
    policy = _policy(args)  # (a bad key file refused before the artifact loads)
    engine, stop = _stages_engine(args, slots=args.parallel)
    try:
        return _serve_engine(args, serve, engine, policy)
    finally:
        if stop is not None:
            stop()


def _policy(args):
    """`serve`'s keys and limits (runtime/gate.py's Policy) from its options and the environment."""
    from runtime.gate import Policy, read_keys

    try:
        keys = read_keys(args.api_key, args.api_key_file)
    except ValueError as error:
        raise UserError(str(error)) from None
    return Policy(api_keys=keys, max_body_bytes=args.max_body_bytes, max_requests=args.max_requests,
                  cors_origins=tuple(args.cors_origin))


def _serve_engine(args, serve, engine, policy) -> int:
    app = serve.create_app(engine, parallel=args.parallel, queue=args.queue, policy=policy,
                           prefill_chunk=args.prefill_chunk)
    try:
        sock = serve.bind(args.host, args.port)
    except OSError as error:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None
    host, port = sock.getsockname()[:2]
    keys = f", {len(policy.api_keys)} API keys" if policy.api_keys else ""
    print(f"serving {args.artifact} on http://{host}:{port} ({args.parallel} slots, queue {args.queue}{keys}); "
          "Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        serve.make_server(app).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down for: the normal way to stop
        pass
    return 0


def _serve_ray(args) -> int:
    """`serve --ray`: runtime/ray_serve.py's replicas on a local Ray instance (or the cluster at --address) until
    Ctrl-C or SIGTERM, which remove them (and stop a local instance)."""
    import signal
    import time

    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None):
        raise UserError("--replicas fixes the count; --min-replicas/--max-replicas autoscale: give one or the other")
    if args.min_replicas is not None and args.max_replicas is None:
        raise UserError("--min-replicas needs --max-replicas (autoscaling's upper bound)")
    if args.max_replicas is not None and args.max_replicas < (args.min_replicas or 1):
        raise UserError(f"--max-replicas {args.max_replicas} is below --min-replicas {args.min_replicas or 1}")
    if args.port == 0:
        raise UserError("--ray needs a fixed --port: Ray Serve's HTTP proxy binds it")
    policy = _policy(args)
    if _split_stages(args.artifact):
        raise UserError(f"{args.artifact} is split across machines (build --nodes): serve it without --ray; its stages "
                        "run as Ray actors (--address joins a cluster)")
    try:
        from runtime import ray_serve
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in ("ray", "starlette", "uvicorn"):
            raise
        raise UserError(f"picompile serve --ray needs the ray extra ({missing} is not installed): "
                        "pip install 'picompile[ray]'") from None
    from runtime import ArtifactError
    from runtime.artifact import load_manifest
    from runtime.serve import bind

    artifact = args.artifact.resolve()
    try:  # the replicas load it; a bad path fails here, before Ray starts
        load_manifest(artifact, check_hashes=False)
    except ArtifactError as error:
        raise UserError(str(error)) from None
    local = args.address is None
    if local:  # Serve's proxy binds the port later, in another process: a port in use is refused here
        try:
            bind(args.host, args.port).close()
        except OSError as error:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None
    threads = args.threads or 1
    autoscale = args.max_replicas is not None
    deployment = ray_serve.Deployment(
        str(artifact), parallel=args.parallel, queue=args.queue, prefill_chunk=args.prefill_chunk, threads=threads,
        replicas=None if autoscale else (args.replicas or 1), min_replicas=args.min_replicas or 1,
        max_replicas=args.max_replicas, replica_cpus=float(threads), policy=policy,
        code_path=str(Path(ray_serve.__file__).resolve().parents[1]) if local else None)
    replicas = f"{deployment.min_replicas}-{deployment.max_replicas}" if autoscale else str(deployment.replicas)
    started = False
    try:
        try:
            if local:
                most = deployment.max_replicas if autoscale else deployment.replicas
                ray_serve.start_local(args.host, args.port, cpus=max(os.cpu_count() or 1, most * threads))
            else:
                ray_serve.connect(args.address, args.host, args.port)
            started = True
            # both stop it as Ctrl-C does (set after ray.init, which sets its own), SIGINT too where it came
            # ignored (a shell's background job): Python then leaves it ignored
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            ray_serve.deploy(deployment)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise UserError(f"Ray Serve could not start the replicas: {error}") from None
        print(f"serving {args.artifact} on http://{args.host}:{args.port} through Ray Serve ({replicas} replicas of "
              f"{args.parallel} slots, queue {args.queue}, {threads} threads each); Ctrl-C stops",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if started:
            ray_serve.stop(local)
    return 0


def _eval(args) -> int:
    from .evaluate import ArtifactReference, check_reference, evaluate, reference_for
    from passes.tokens import read_tokens

    sequences = read_tokens(args.tokens)[: args.max_sequences]
    top = max(int(s.max()) for s in sequences)
    vocab = check_reference(args.reference)  # a decoder LM, as build checks a model; its embedding table's rows
    if top >= vocab:
        raise UserError(f"{args.tokens} holds token id {top}, outside the vocabulary of the reference "
                        f"{args.reference} ({vocab} tokens)")
    engine = _engine(args.artifact, args.emulate_gpu, threads=args.threads)
    if vocab != engine.vocab_size:
        raise UserError(f"the reference {args.reference} has a vocabulary of {vocab} tokens but the artifact "
                        f"{args.artifact} has {engine.vocab_size}: eval compares an artifact with the model it was "
                        "built from")
    with tempfile.TemporaryDirectory(prefix="picompile-eval-") as workdir:  # a layered reference's parts
        reference = reference_for(args.reference, [s[: engine.max_context] for s in sequences], Path(workdir))
        report = evaluate(engine, reference, sequences)
        if args.baseline is not None:
            baseline = _engine(args.baseline, args.emulate_gpu, threads=args.threads)
            if baseline.vocab_size != engine.vocab_size:
                raise UserError(f"the baseline {args.baseline} has a vocabulary of {baseline.vocab_size} tokens but "
                                f"{args.artifact} has {engine.vocab_size}: a baseline is another build of the same "
                                "model")
            for name, found in (("baseline", evaluate(baseline, reference, sequences)),
                                ("vs_baseline", evaluate(engine, ArtifactReference(baseline), sequences))):
                report.update({f"{name}.{key}": value for key, value in found.items()
                               if key in ("kl_mean", "top1_agreement", "max_abs_logit_diff", "ppl_compiled")})
    report["ppl_change"] = report["ppl_compiled"] / report["ppl_reference"] - 1.0
    expected = engine.manifest.quality
    if expected is not None:  # what the build measured on its held-out calibration tokens, beside what eval measures
        report.update(expected_ppl_change=expected.ppl_change, expected_kl=expected.kl, expected_top1=expected.top1)
        if expected.ppl_low is not None:
            report.update(expected_ppl_low=expected.ppl_low, expected_ppl_high=expected.ppl_high)
    sparsity = engine.manifest.sparsity
    if sparsity is not None:
        report["sparsity_mode"] = sparsity.mode
        if sparsity.sparsity is not None:
            report["sparsity"] = float(sparsity.sparsity)
    threshold = sparsity is not None and sparsity.mode == "threshold"
    keys = ({key: key for key in ("threshold_in", "threshold_down", "sparsity_in", "sparsity_down")} if threshold else
            {"recall": "predictor_recall", "precision": "predictor_precision", "active": "predictor_active"})
    report["layers"] = [{"layer": layer.layer, **{key: getattr(layer, source) for key, source in keys.items()}}
                        for layer in engine.manifest.layers]
    if args.json:
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        if key != "layers":
            print(f"{key:<20} {value:.6g}" if isinstance(value, float) else f"{key:<20} {value}")
    for layer in report["layers"]:
        if threshold:  # the shares dropped were measured on held-out profiled tokens at build time
            print(f"layer {layer['layer']:<3} gate/up inputs |x| > {layer['threshold_in']:.4g} (drops "
                  f"{layer['sparsity_in']:.3f})  down inputs |h| > {layer['threshold_down']:.4g} (drops "
                  f"{layer['sparsity_down']:.3f})")
        else:
            print(f"layer {layer['layer']:<3} predictor recall {layer['recall']:.4f}  precision {layer['precision']:.4f}  "
                  f"predicted active {layer['active']:.3f}")
    return 0


def _stage_facts(manifest, calls) -> list[dict]:
    """`inspect`'s stages of a split model: each stage's manifest entry, its calls, the weight bytes its calls read
    (its own file's) and its hand-overs to the next stage (the call and the bytes a token sends)."""
    from runtime.calls import Role
    from runtime.dtypes import nbytes

    facts = []
    for index, stage in enumerate(manifest.stages):
        mine = [call for call in calls if call.stage == index]
        weights = {name for call in mine for name in call.buffers()
                   if manifest.buffers.get(name) is not None and manifest.buffers[name].kind == "weight"}
        handovers = []
        for call in (call for call in mine if call.role is Role.HANDOVER):
            source = manifest.buffers[call.reads()[0]]
            handovers.append({"call": call.id, "bytes_per_token": nbytes([1, *source.shape[1:]], source.dtype)})
        facts.append({"index": index, **stage.to_json(), "calls": len(mine), "handovers": handovers,
                      "weight_bytes_read": sum(nbytes(manifest.buffers[n].shape, manifest.buffers[n].dtype)
                                               for n in weights)})
    return facts


def _machine_target(manifest):
    """The artifact's target priced at this machine's kernel rates as last measured (`picompile calibrate`); None
    where they were not measured here, or the artifact's kernels are for another instruction set."""
    import dataclasses

    from passes import machine_rates
    from passes.targets import get_cpu_isa, get_target

    rates = machine_rates.cached(get_cpu_isa(manifest.target.cpu_isa)) if manifest.target.cpu_isa else None
    return None if rates is None else dataclasses.replace(get_target(manifest.target.name), cpu_rates=rates)


def _estimate_here(artifact: Path, manifest) -> float | None:
    """The cost model's expected decode of the artifact's calls on this machine's measured kernel rates (None: not
    measured here)."""
    from passes import costmodel

    target, schedule = _machine_target(manifest), artifact / "schedule.json"
    if target is None or not schedule.is_file():
        return None
    return costmodel.estimate(manifest, json.loads(schedule.read_text()), target).picompile_tokens_per_s


def _expected_ms_by_role(engine) -> dict[str, float] | None:
    """The cost model's decode milliseconds of each call role of `engine`'s artifact on this machine's measured
    kernel rates (None: not measured here): what `run --profile` prints beside the measured."""
    from passes import costmodel

    if not isinstance(getattr(engine, "manifest", None), Manifest):  # (a split artifact's stages: not priced here)
        return None
    target = _machine_target(engine.manifest)
    if target is None:
        return None
    layers = {layer.layer: layer for layer in engine.manifest.layers}
    expected: dict[str, float] = {}
    for call in engine.calls:
        if call.decode and not call.runtime_own:
            seconds = costmodel.call_seconds(call, engine.manifest.buffers, layers, target)
            expected[call.role.value] = expected.get(call.role.value, 0.0) + 1000 * seconds
    return expected


def _inspect(args) -> int:
    from runtime import ArtifactError, load_manifest
    from runtime.verify import check_files

    try:
        manifest = load_manifest(args.artifact)
        scheduled = check_files(args.artifact, manifest).calls  # what it shows agrees with the files
    except ArtifactError as error:
        raise UserError(str(error)) from None
    from runtime.artifact import format_size
    from runtime.calls import decode_weight_reads
    from runtime.dtypes import nbytes

    from .report import with_shares

    calls: dict[str, int] = {}
    devices: dict[str, int] = {}
    decode_reads: dict[str, dict[str, int]] = {}  # role -> fixed bytes, and bytes per selected entry
    for call in scheduled:
        calls[call.role.value] = calls.get(call.role.value, 0) + 1
        devices[call.device] = devices.get(call.device, 0) + 1
        if call.decode and not call.runtime_own:
            reads = decode_weight_reads(call, manifest.buffers)
            entry = decode_reads.setdefault(call.role.value, {"fixed_bytes": 0, "bytes_per_selected": 0})
            entry["fixed_bytes"] += reads.fixed
            entry["bytes_per_selected"] += reads.per_selected + reads.per_nonzero
    kernels = sorted({name for call in scheduled if not call.runtime_own
                      for name in (call.decode, call.prefill, call.batch) if name})

    weight_bytes = sum(nbytes(b.shape, b.dtype) for b in manifest.buffers.values() if b.kind == "weight")
    # --json: the manifest's sections as the file spells them, with inspect's own figures
    shown = manifest.to_json()
    info = {"target": shown["target"], "model": shown["model"], "options": shown["options"],
            "calls_per_token": calls, "calls_per_device": devices, "decode_weight_reads": decode_reads,
            "kernels": kernels, "weight_bytes": weight_bytes, "devices": shown["devices"],
            "layers": [with_shares(layer) for layer in manifest.layers],
            "placement": shown["placement"],
            "estimate": manifest.estimate, "expected_here_tokens_per_s": _estimate_here(args.artifact, manifest),
            "calibration": shown["calibration"],
            "quantization": shown["quantization"],
            "tokenizer": _tokenizer_facts(args.artifact, manifest)}
    if manifest.stages:  # a model split across machines: each stage's calls, and the hand-overs between them
        info["stages"] = _stage_facts(manifest, scheduled)
    if args.json:
        print(json.dumps(info))
        return _write_report(args, manifest, [])
    lines: list[str] = []
    say = lines.append  # the text goes to stdout and into the report
    say(f"target      {manifest.target.name}")
    for key, value in shown["model"].items():
        say(f"{key:<12}{value}")
    say(f"weights     {weight_bytes / 2**20:.1f} MiB")
    say("calls/token " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))
    say("devices     " + ", ".join(f"{k} {v} calls" for k, v in sorted(devices.items()))
        + (f" ({manifest.devices.rule})" if manifest.devices is not None and manifest.devices.rule else ""))
    say("decode reads " + ", ".join(
        f"{role} {format_size(entry['fixed_bytes'])}"
        + (f" + {format_size(entry['bytes_per_selected'])}/selected" if entry["bytes_per_selected"] else "")
        for role, entry in sorted(decode_reads.items())))
    say(f"kernels     {len(kernels)}: " + ", ".join(kernels))
    for stage in info.get("stages", []):
        say(f"stage {stage['index']}     {stage['name']}: {manifest.stages[stage['index']].layers_text()}, "
            f"target {stage['target']}, resources {stage['resources'] or 'none'}, {stage['calls']} calls, weights "
            f"{format_size(stage['weight_bytes_read'])}"
            + "".join(f"; hands over {h['bytes_per_token']} B/token ({h['call']})" for h in stage["handovers"]))
    found = info["tokenizer"]
    say("tokenizer   none: run and chat take token ids only (--prompt-ids)" if found is None else
        f"tokenizer   {found['vocab_size']} tokens, BOS {found['bos_id']}, EOS "
        f"{', '.join(map(str, found['eos_ids'])) or 'none'}, "
        f"{'a chat template' if found['chat_template'] else 'no chat template (plain turns)'}; "
        + ", ".join(found["files"]))
    if manifest.estimate:
        from passes.costmodel import Estimate
        from passes.targets import get_target

        for line in Estimate(**manifest.estimate).lines(get_target(manifest.target.name)):
            say(line)
        here = _estimate_here(args.artifact, manifest)
        if here is not None:
            say(f"  on this machine's kernels as last measured (picompile calibrate): {here:.1f} tok/s")
    if manifest.placement:
        from passes.partition import PlacementReport

        placement = PlacementReport.from_json(manifest.placement)
        plan = placement.plan
        gap = "unknown" if placement.gap is None else f"{placement.gap * 100:.3f}%"
        say(f"placement   {placement.status}, gap {gap}; GPU {placement.used_bytes / 2**20:.1f} of "
            f"{placement.budget_bytes / 2**20:.1f} MiB: {plan.attention.count('gpu')} attention "
            f"blocks, {sum(placement.gpu_neurons)} sparse FFN neurons, {plan.ffn.count('gpu')} "
            f"dense FFNs, embedding {plan.embed.upper()}, output layer {plan.head.upper()}")
        say(f"            expected {1 / placement.expected_step_s:.1f} tok/s, layer offload "
            f"({placement.layer_offload_layers} layers) {1 / placement.layer_offload_step_s:.1f}: "
            f"{placement.choice()}")
        for stage in placement.stages or []:  # a split build: each node's card
            say(f"            {stage.name}: GPU {stage.used_bytes / 2**20:.2f} of "
                f"{stage.budget_bytes / 2**20:.2f} MiB, {stage.expected_step_s * 1e3:.3f} ms a token ({stage.chosen})")
    if manifest.sparsity is not None:
        say(f"sparsity    {manifest.sparsity.describe()}")
    calibration = manifest.calibration
    if calibration is not None:
        sampled = calibration.sampled_sequences
        say(f"calibration {calibration.tokens} tokens: {calibration.given_tokens} from {calibration.source}"
            + (f", {sampled} sequences of {calibration.sequence_tokens} sampled from the model" if sampled else "")
            + ("" if calibration.tokens >= calibration.wanted_tokens else
               f" (small: {calibration.wanted_tokens} wanted)"))
    quantized = manifest.quantization
    if quantized is not None:
        say(f"{quantized.scope or 'weights':<10} {quantized.matrices} matrices in {quantized.format} ({quantized.method}, blocks of "
            f"{quantized.block}): {format_size(quantized.bytes)} from {format_size(quantized.float32_bytes)} "
            f"fp32, mean relative error {quantized.mean_relative_error:.4f}"
            + (f"; {len(quantized.kept_in_floats)} kept in fp16 (not whole blocks)" if quantized.kept_in_floats else "")
            + "".join(f"; {n} in {name} by the quality plan" for name, n in (quantized.planned_formats or {}).items())
            + (f"; {len(quantized.planned_floats)} in fp16 by the quality plan" if quantized.planned_floats
               else ""))
        channels = quantized.channel_scales or {}  # (the AWQ pass's report, as it wrote it)
        scaled = [layer for layer in channels.get("layers", []) if layer["alpha"] > 0]
        if scaled:
            say(f"           awq channel scales on {len(scaled)} of {len(channels['layers'])} FFN inputs: "
                f"up-projection error {channels['error_ratio']:.3f}x the unscaled one's")
    if manifest.quality is not None:
        expected = manifest.quality
        say(f"quality     {expected.line().removeprefix('expected quality: ')}{'' if expected.met else ' (MISSED)'}")
        say(f"            plan: {expected.plan}")
        if expected.gave_up:
            say(f"            {expected.gave_up}")
        # per knob: its level, stored format, the KL it alone adds and its decode microseconds (against dense)
        for line in expected.layer_lines():
            say(f"            {line}")
    if info["layers"] and "threshold_in" in info["layers"][0]:
        # each linear input's threshold (- where it stays dense) and share dropped on held-out calibration tokens,
        # and each matrix's stored format (qkv / o / gate+up / down: the quality plan's choices)
        formats = {(c.layer, c.site): c.format for c in (manifest.quality.choices or ())} if manifest.quality else {}
        say(f"{'layer':>5} {'t_qkv':>9} {'drops':>6} {'t_o':>9} {'drops':>6} {'t_in':>9} {'drops':>6} "
            f"{'t_down':>9} {'drops':>6}  formats qkv/o/up/down")
        for layer in info["layers"]:
            cells = []
            for site in ("qkv", "o", "in", "down"):
                t = layer.get(f"threshold_{site}", -1.0)
                cells.append(f"{'-' if t < 0 else f'{t:.4g}':>9} {layer.get(f'sparsity_{site}', 0.0):>6.3f}")
            shown = [formats.get((layer["layer"], site), "?") for site in ("qkv", "o", "in", "down")]
            say(f"{layer['layer']:>5} {' '.join(cells)}  {'/'.join(shown)}")
    elif info["layers"]:
        # active shares: true = fired on the profiled tokens (1 - sparsity), predicted = what decode computes
        say(f"{'layer':>5} {'sparsity':>8} {'hot80%':>7} {'gpu':>6} {'cpu':>6} {'rank':>5} {'recall':>7} "
            f"{'precision':>9} {'true active':>11} {'predicted':>9} {'pred/true':>9} {'ffn':>6}")
        for layer in info["layers"]:
            ratio = layer.get("active_ratio")
            say(f"{layer['layer']:>5} {layer.get('sparsity', 0):>8.3f} {layer.get('hot80_share', 0) * 100:>6.1f}% "
                f"{layer['gpu_neurons']:>6} {layer['cpu_neurons']:>6} {layer.get('predictor_rank', 0):>5} "
                f"{layer.get('predictor_recall', 0):>7.4f} {layer.get('predictor_precision', 0):>9.4f} "
                f"{layer.get('true_active', 0):>11.3f} {layer.get('predictor_active', 0):>9.3f} "
                f"{'-' if ratio is None else f'{ratio:.2f}x':>9} {layer.get('ffn', 'sparse'):>6}")
        for layer in info["layers"]:
            if layer.get("ffn") == "dense":
                say(f"  layer {layer['layer']} FFN lowered dense: {layer['dense_reason']}")
    sys.stdout.write("".join(line + "\n" for line in lines))
    return _write_report(args, manifest, lines)


def _tokenizer_facts(artifact: Path, manifest: Manifest) -> dict | None:
    """What inspect shows of the artifact's tokenizer, read from its files (None: it has none)."""
    tokenizer = _text_tokenizer(artifact, None)
    if tokenizer is None:
        return None
    from runtime.text import TOKENIZER_DIR

    return {"files": sorted(f for f in manifest.files if f.startswith(TOKENIZER_DIR + "/")),
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_ids": sorted(tokenizer.eos_ids),
            "chat_template": tokenizer.chat_template is not None}


def _write_report(args, manifest: Manifest, lines: list[str]) -> int:
    if args.report is not None:
        from .report import write_report

        write_report(args.artifact, manifest, args.report, lines)
        print(f"wrote {args.report}", file=sys.stderr)
    return 0


def _calibrate(args) -> int:
    from passes import machine_rates

    rates = machine_rates.calibrate()
    if rates.busy:
        print("warning: other programs took a core while this machine was measured: the figures are not cached "
              "(measure again when it is quiet)", file=sys.stderr)
    if args.json:
        print(json.dumps(rates.to_json(), indent=1))
    else:
        print("\n".join(rates.lines()))
        if not rates.busy:
            print(f"saved {machine_rates.cache_path(rates.key)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = _parser().parse_args(argv)
        code = {"build": _build, "run": _run, "chat": _chat, "serve": _serve, "eval": _eval,
                "inspect": _inspect, "calibrate": _calibrate}[args.command](args)
        sys.stdout.flush()  # a reader that left shows up here, in the handler below, rather than at exit
        return code
    except UserError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        print(f"error: {'; '.join(lines)}", file=sys.stderr)  # one line, whatever a library put in the message
        return 2
    except PassError as error:  # a bug or a failing tool inside a pass: named by pass (and layer)
        if isinstance(error.error, MemoryError):  # the machine's limit, not a bug: like the up-front refusals
            print(f"error: out of memory in {error.where}; free memory, build on a larger machine or choose a "
                  "smaller --max-context", file=sys.stderr)
            return 2
        if getattr(args, "verbose", False) or os.environ.get("PICOMPILE_TRACEBACK"):
            traceback.print_exception(error.error)
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 2
    except BrokenPipeError:  # whoever read stdout stopped (`| head`): not an error, and nothing more to print
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 0
    except Exception as error:  # a bug outside the passes: exit 1, one line
        if os.environ.get("PICOMPILE_TRACEBACK"):
            raise
        from runtime.artifact import first_line

        message = first_line(error)
        print(f"error: internal error: {type(error).__name__}: {message} (a picompile bug: please report it; "
              "PICOMPILE_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 1

if __name__ == "__main__":
    sys.exit(main())
