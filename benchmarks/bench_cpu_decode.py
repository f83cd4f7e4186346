"""CPU decode suite: onnxruntime (fp32 and int4), picompile dense and picompile sparse on a synthetic ~1B
OPT-ReLU model, with the memory bandwidth each reaches and the quality each speed comes at.

    python benchmarks/bench_cpu_decode.py [--preset 1b] [--sparsity 0.9] [--threads 2] [--tokens 32] [--runs 3]
        [--prompt-len 128] [--max-context 256] [--target-recall 0.99] [--dtypes fp32,fp16,int8,int4]
        [--cpu-isa avx2|avx512|avx512vnni] [--ort-int4 | --no-ort-int4]
        [--family | --predictability family|easy,hard|0.95,... --calib-tokens 1024,4096] [--json PATH] [--record]

The benchmark family (issue 13): `--predictability` takes level names of examples/models.py's
PREDICTABILITY_LEVELS, numbers, or `family` (every level), and `--calib-tokens` the calibration file sizes
(multiples of 64 tokens); each (predictability, calibration size) pair is one family member, a model of its own
(the same weights for one predictability: only its calib.npy differs). Without either option the run is the
one model it always was (the maker's default predictability and 4,096 calibration tokens). Members of one
predictability share onnxruntime and the dense artifacts; the report gives, per member, the sparse build's
speed, bytes/token, eval KL per position and top-1 against onnxruntime, and the predictors' recall and
precision (the manifest's per-layer figures). `--family` is examples/models.py's FAMILY sweep: every level
at each of its calibration sizes (1,024 and 4,096 tokens). `--preset tiny` is a smoke run (a minute or two
per member here).

One run makes the model (or reuses it from the cache, keyed by its config hash), builds it for `--target cpu`
dense and sparse for each weight dtype of `--dtypes` (`runtime.dtypes.WEIGHT_FORMATS`: fp32, fp16 and the
block-quantized int8 and int4; or reuses the builds: they are cached by model, build options and the
compiler's source, so a changed compiler rebuilds), evaluates each artifact against onnxruntime on held-out
tokens, then alternates runs (onnxruntime, onnxruntime int4, dense, sparse, [dense fp16, sparse fp16],
memory bandwidth, onnxruntime, ...) so that machine drift cancels, and reports medians:

- decode tokens/s and the prefill time of a `--prompt-len` prompt, each beside onnxruntime's (fp32, same
  thread count), and each picompile artifact's decode speed beside onnxruntime int4's too;
- the machine's copy bandwidth (np.copyto of a 512 MiB buffer over `--threads` threads, GB/s of bytes
  copied; the memory traffic is twice that) and, for context, its read bandwidth (a sum over that buffer);
- per artifact: the weight bytes a decoded token reads (the runtime's profile), the effective bandwidth
  (bytes/token x tokens/s) and its share of the copy bandwidth;
- per weight dtype: the limit ratio (dense bytes/token over sparse bytes/token), the achieved ratio (sparse
  tokens/s over dense tokens/s) and the achieved ratio as a share of the limit.

onnxruntime int4 (on by default; `--no-ort-int4` leaves it out) is the second baseline, made here and cached
beside the model (a directory keyed by its recipe, ORT_INT4_RECIPE, and onnxruntime's version, so a changed
recipe makes it again): the model's Gemms rewritten as MatMul + Add and a tied output layer's Transpose
folded (onnxruntime's quantizer takes MatMul weights that are initializers only), then every MatMul weight,
the output layer's included, quantized by onnxruntime's MatMulNBitsQuantizer to 4 bits, round to
nearest, symmetric, blocks of 32 along K, float32 scales, accuracy_level 4 (its int8-activation CPU kernels).
It decodes with its KV cache, as the fp32 model does; its quality row is its eval KL per position and top-1
against onnxruntime fp32, on the artifacts' held-out sequences.

`--json PATH` writes every figure; `--record` appends the table to BENCHMARKS.md with the date, the machine
and the exact command.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.bench_decode import add_run_arguments, parsed_run_arguments, QUALITY_COLUMNS, quality_cells  # noqa: E402 (stdlib only: TVM not yet)
from passes.targets import CPU_ISAS  # noqa: E402 (numpy only)
from runtime.dtypes import WEIGHT_FORMATS  # noqa: E402 (numpy only)

# The weight dtypes `--dtypes` takes and the element type each stores its weight matrices in (int4: packed
# two to a uint8): runtime.dtypes is their one home.
DTYPES = tuple(WEIGHT_FORMATS)
NUMPY_DTYPES = {name: fmt.storage for name, fmt in WEIGHT_FORMATS.items()}
BANDWIDTH_MIB = 512  # far larger than any L3 here (32 MiB)
ORT_INT4 = "onnxruntime int4"  # the second baseline's engine name
# How it is made (examples/models.ort_quantize_nbits); its cache key, with onnxruntime's version. Bump
# "rewrite" when examples/models.matmul_weights_as_initializers changes what it writes.
ORT_INT4_RECIPE = {"bits": 4, "block_size": 32, "symmetric": True, "accuracy_level": 4, "rewrite": 2,
                   "algorithm": "MatMulNBitsQuantizer DEFAULT (round to nearest)",
                   "ops": "every MatMul of a constant weight (Gemm as MatMul + Add, tied head transposed)"}


class Bandwidth:
    """Samples the machine's memory bandwidth over `threads` threads, once per call: np.copyto of a buffer
    far larger than L3 (GB/s of bytes copied) and a sum over it (GB/s read); the best of `reps` each."""

    def __init__(self, threads: int, mib: int = BANDWIDTH_MIB, reps: int = 3):
        self.threads, self.elements, self.reps = threads, (mib << 20) // 4, reps
        self.copy: list[float] = []
        self.read: list[float] = []

    def __call__(self) -> None:
        import numpy as np

        source = np.ones(self.elements, np.float32)
        target = np.zeros_like(source)  # both written once, so no page faults inside the timing
        parts = [slice(i * self.elements // self.threads, (i + 1) * self.elements // self.threads)
                 for i in range(self.threads)]
        with ThreadPoolExecutor(self.threads) as pool:  # numpy releases the GIL in both loops
            def rate(work) -> float:
                best = 0.0
                for _ in range(self.reps):
                    started = time.perf_counter()
                    list(pool.map(work, parts))
                    best = max(best, source.nbytes / (time.perf_counter() - started) / 1e9)
                return best

            self.copy.append(rate(lambda part: np.copyto(target[part], source[part])))
            self.read.append(rate(lambda part: source[part].sum()))

    def summary(self) -> dict:
        return {"copy_gbs": statistics.median(self.copy), "read_gbs": statistics.median(self.read),
                "copy_samples_gbs": self.copy, "read_samples_gbs": self.read,
                "buffer_mib": self.elements * 4 >> 20, "threads": self.threads}


def engine_name(kind: str, dtype: str, member: str = "") -> str:
    return f"picompile {kind}" + ("" if dtype == "fp32" else f" {dtype}") + (f" ({member})" if member else "")


def weight_dtypes(artifact: Path) -> list[str]:
    """The element types of an artifact's weight buffers (quantized weights: their integers and scales)."""
    from runtime import load_manifest

    manifest = load_manifest(artifact, check_hashes=False)
    return sorted({b.dtype for b in manifest.buffers.values() if b.kind == "weight"})


def ort_int4_model(files, log=print) -> Path:
    """The onnxruntime int4 baseline of a made model (see the module doc), made once into a directory beside
    the model keyed by ORT_INT4_RECIPE and onnxruntime's version. Made in a child process: quantizing a 1B
    model holds its fp32 weights several times over, which this process would keep from the engines."""
    import hashlib
    import multiprocessing

    import onnxruntime

    from examples.models import build_cached

    recipe = {**ORT_INT4_RECIPE, "onnxruntime": onnxruntime.__version__}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]

    def make(work: Path) -> None:
        started = time.perf_counter()
        child = multiprocessing.get_context("spawn").Process(target=_quantize, args=(files.onnx, work / "model.onnx"))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"quantizing {files.onnx} with onnxruntime failed (exit code {child.exitcode})")
        (work / "config.json").write_text(json.dumps({"source": str(files.onnx), "recipe": recipe}, indent=1))
        log(f"made {ORT_INT4} ({files.dir.name}/ort-int4-{key}) in {time.perf_counter() - started:.1f}s")

    return build_cached(files.dir / f"ort-int4-{key}", make, log) / "model.onnx"


def _quantize(source: Path, target: Path) -> None:
    from examples.models import ort_quantize_nbits

    r = ORT_INT4_RECIPE
    ort_quantize_nbits(source, target, bits=r["bits"], block_size=r["block_size"], symmetric=r["symmetric"],
                       accuracy_level=r["accuracy_level"])


def _quality_budget(text: str):
    from picompile.cli import _quality_budget as parsed  # the build's own parsing and error

    return parsed(text)


def accepted_weight_dtypes() -> list[str]:
    """The --weight-dtype values `picompile build` accepts now (its parser's choices): int8 and int4 are
    WEIGHT_FORMATS before the compiler builds them, so the run stops before it makes anything."""
    from picompile.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in commands.choices["build"]._actions if "--weight-dtype" in a.option_strings)
    return list(option.choices or DTYPES)


def build_all(members: dict[str, object], args) -> dict[str, Path]:
    """Dense and sparse artifacts for each weight dtype, in the order the runs alternate. `members` maps a
    label ("" for a lone model) to the ModelFiles of one predictability; the first one's dense artifacts
    serve all (the same weights: only the calibration file differs, and a dense build uses it for nothing
    that changes its arithmetic), each gets its own sparse ones."""
    from examples.bench_decode import ensure_artifact

    artifacts = {}
    first = next(iter(members.values()))
    for dtype in args.dtypes:
        for kind in ("dense", "sparse"):
            options = {"weight_dtype": dtype, "cpu_isa": args.cpu_isa}
            if kind == "sparse":
                options["target_recall"] = args.target_recall
                if args.max_quality_loss is not None:
                    options["quality_budget"] = args.max_quality_loss
            for label, files in (members.items() if kind == "sparse" else [("", first)]):
                try:
                    path = ensure_artifact(files, f"{kind}-{dtype}", args.max_context, dense=kind == "dense",
                                           rebuild=args.rebuild, **options)
                except RuntimeError as error:  # the child's own error or traceback is above
                    raise SystemExit(f"error: picompile could not build the {kind} {dtype} artifact of "
                                     f"{files.dir.name} ({error}); its message is above") from None
                if NUMPY_DTYPES[dtype] not in weight_dtypes(path):
                    print(f"warning: {path.name} was built with weight_dtype={dtype} but stores {weight_dtypes(path)} "
                          "weights (the compiler does not apply that option)")
                artifacts[engine_name(kind, dtype, label)] = path
    return artifacts


def byte_agreement(artifacts: dict[str, Path]) -> dict[str, dict]:
    """Per artifact, after a prompt and 3 decode steps: how many decode calls the cost model and the runtime
    count the same weight bytes for (both read the calls' facts), and which do not agree."""
    from passes import costmodel
    from runtime import Engine

    agreement = {}
    for name, path in artifacts.items():
        engine = Engine(path)
        engine.forward([1, 2, 3, 4])
        wrong: set[str] = set()
        for token in (5, 6, 7):
            engine.forward([token])
            wrong |= set(costmodel.byte_disagreements(engine))
        agreement[name] = {"calls": len(engine.decode_steps), "disagree": sorted(wrong)}
        del engine
        gc.collect()
    return agreement


def derive(summary: dict, bandwidth: dict, dtypes, labels=("",)) -> dict:
    """Effective bandwidth per artifact (into `summary`) and, per dtype (and member label), the sparse/dense
    limit and achieved ratios."""
    for figures in summary.values():
        if "weight_bytes_per_token" in figures:
            figures["effective_gbs"] = figures["weight_bytes_per_token"] * figures["decode_tokens_per_s"] / 1e9
            figures["copy_bandwidth_share"] = figures["effective_gbs"] / bandwidth["copy_gbs"]
    ratios = {}
    for dtype in dtypes:
        for label in labels:
            dense, sparse = summary[engine_name("dense", dtype)], summary[engine_name("sparse", dtype, label)]
            limit = dense["weight_bytes_per_token"] / sparse["weight_bytes_per_token"]
            achieved = sparse["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
            ratios[dtype + (f" ({label})" if label else "")] = {
                "limit_ratio": limit, "achieved_ratio": achieved, "share_of_limit": achieved / limit,
                "dense": engine_name("dense", dtype), "sparse": engine_name("sparse", dtype, label)}
    return ratios


def int4_ratios(summary: dict, artifacts) -> None:
    """Each artifact's decode and prefill speed over onnxruntime int4's (into `summary`), where it ran."""
    base = summary.get(ORT_INT4)
    for name in artifacts if base is not None else ():
        summary[name]["ratio_ort_int4"] = summary[name]["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        summary[name]["prefill_ratio_ort_int4"] = base["prefill_ms"] / summary[name]["prefill_ms"]


def placement_check(summary: dict, artifacts: dict[str, Path]) -> str:
    """Placement's own price of each artifact's decode step (the manifest's `placement.expected_step_s`, from the
    target's bandwidths and the calls' fixed costs) beside the measured speed: how far the cost model that chooses
    the plan is from the machine."""
    from passes.partition import PlacementReport
    from runtime import load_manifest

    parts = []
    for name, path in artifacts.items():
        placed = load_manifest(path, check_hashes=False).placement
        expected = PlacementReport.from_json(placed).expected_step_s if placed else None
        if expected and name in summary:
            measured = summary[name]["decode_tokens_per_s"]
            parts.append(f"{name} expected {1 / expected:.1f} tok/s, measured {measured:.1f} ({measured * expected:.2f}x)")
    return ("Placement's cost model against this run: " + "; ".join(parts) + ".") if parts else ""


def report(config: dict, summary: dict, qualities: dict, bandwidth: dict, ratios: dict) -> str:
    from examples.bench_decode import quality_text

    int4 = ORT_INT4 in summary
    rows = [f"| engine | decode tok/s | vs onnxruntime |{' vs onnxruntime int4 |' if int4 else ''} prefill "
            f"{config['prompt_len']} tokens (ms) | vs onnxruntime | weights MiB/token | effective GB/s | of copy bandwidth "
            "| quality |",
            "| --- " * (10 if int4 else 9) + "|"]
    for name, f in summary.items():
        speed = f"**{f['ratio']:.2f}x**" if "ratio" in f else "1.00x"
        over_int4 = ""
        if int4:
            over_int4 = (f" {f['ratio_ort_int4']:.2f}x |" if "ratio_ort_int4" in f else
                         " 1.00x |" if name == ORT_INT4 else " - |")
        prefill = f"{f['prefill_ratio']:.2f}x" if "prefill_ratio" in f else "1.00x"
        traffic = "- | - | -"
        if "weight_bytes_per_token" in f:
            traffic = (f"{mib(f['weight_bytes_per_token'])} | {f['effective_gbs']:.1f} | "
                       f"{f['copy_bandwidth_share'] * 100:.0f}%")
        rows.append(f"| {name} | {f['decode_tokens_per_s']:.2f} | {speed} |{over_int4} {f['prefill_ms']:.1f} | {prefill} | "
                    f"{traffic} | {quality_text(qualities.get(name, {}))} |")
    lines = ["\n".join(rows), "",
             f"Memory bandwidth ({bandwidth['threads']} threads, {bandwidth['buffer_mib']} MiB, median of "
             f"{plural(len(bandwidth['copy_samples_gbs']), 'run')}): copy {bandwidth['copy_gbs']:.1f} GB/s (bytes copied), "
             f"read {bandwidth['read_gbs']:.1f} GB/s."]
    for dtype, r in ratios.items():
        dense, sparse = summary[r["dense"]], summary[r["sparse"]]
        lines.append(f"Sparse over dense ({dtype} weights): limit {r['limit_ratio']:.2f}x "
                     f"({mib(dense['weight_bytes_per_token'])} / {mib(sparse['weight_bytes_per_token'])} MiB per token), achieved {r['achieved_ratio']:.2f}x = {r['share_of_limit'] * 100:.0f}% of the limit.")
    if int4:
        r = config["ort_int4"]
        lines.append(f"{ORT_INT4}: every MatMul weight (Gemms as MatMul + Add, the output layer too) in MatMulNBits, {r['bits']}-bit, "
                     f"{'symmetric' if r['symmetric'] else 'asymmetric'}, block {r['block_size']}, round to nearest, "
                     f"accuracy_level {r['accuracy_level']} (onnxruntime {r['onnxruntime']}); quality against onnxruntime fp32.")
    return "\n".join(lines)


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def mib(nbytes: float) -> str:
    value = nbytes / 2**20
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _dtypes(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(DTYPES)}, got {text!r}")
    return list(dict.fromkeys(dtypes))


def _predictabilities(text: str) -> list:
    """`family`, level names and/or numbers in [0, 1], comma-separated -> predictability values."""
    from examples.models import PREDICTABILITY_LEVELS

    values = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "family":
            values += PREDICTABILITY_LEVELS.values()
        elif item in PREDICTABILITY_LEVELS:
            values.append(PREDICTABILITY_LEVELS[item])
        else:
            try:
                value = float(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r} is neither a number nor one of family, "
                                                 f"{', '.join(PREDICTABILITY_LEVELS)}") from None
            if not 0 <= value <= 1:
                raise argparse.ArgumentTypeError(f"predictability {value} is not in [0, 1]")
            values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("expected at least one predictability")
    return list(dict.fromkeys(values))


def _calib_tokens(text: str) -> list[int]:
    from examples.models import TOKEN_DEFAULTS

    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    step = TOKEN_DEFAULTS["seq_len"]
    if not values or any(v < step or v % step for v in values):
        raise argparse.ArgumentTypeError(f"calibration sizes must be positive multiples of {step} tokens (sequences of {step})")
    return list(dict.fromkeys(values))


def member_overrides(predictability, calib_tokens) -> dict:
    """cached_model overrides of one family member; the maker's defaults are left out, so that the default
    member is the very model (and cache entry) the suite measured before it had a family."""
    from examples.models import SYNTH_DEFAULTS, TOKEN_DEFAULTS

    over = {}
    if predictability is not None and predictability != SYNTH_DEFAULTS["predictability"]:
        over["predictability"] = predictability
    if calib_tokens is not None:
        seqs = calib_tokens // TOKEN_DEFAULTS["seq_len"]
        if seqs != TOKEN_DEFAULTS["n_seqs"]:
            over["calib_seqs"] = seqs
    return over


def member_label(predictability, calib_tokens, family: bool) -> str:
    """"" for the lone default model, else e.g. "p=0.6, calib 1024" (what the member's engines are called)."""
    from examples.models import SYNTH_DEFAULTS, TOKEN_DEFAULTS

    if not family:
        return ""
    p = SYNTH_DEFAULTS["predictability"] if predictability is None else predictability
    c = TOKEN_DEFAULTS["n_seqs"] * TOKEN_DEFAULTS["seq_len"] if calib_tokens is None else calib_tokens
    return f"p={p:g}, calib {c}"


def family_table(rows: list[dict]) -> str:
    """One row per family member: its sparse build's speed, traffic and quality (fp32 or the first dtype)."""
    int4 = any(r.get("vs_ort_int4") is not None for r in rows)
    columns = ("predictability", "calib tokens", "sparse tok/s", "vs dense", "vs onnxruntime",
               *(["vs onnxruntime int4"] if int4 else []), "MiB/token", *QUALITY_COLUMNS)
    lines = [f"| {' | '.join(columns)} |", "| --- " * len(columns) + "|"]
    for r in rows:
        over_int4 = (f" {r['vs_ort_int4']:.2f}x |" if r.get("vs_ort_int4") is not None else " - |") if int4 else ""
        lines.append(f"| {r['predictability']:g} | {r['calib_tokens']} | {r['tokens_per_s']:.2f} | {r['vs_dense']:.2f}x "
                     f"| {r['vs_onnxruntime']:.2f}x |{over_int4} {mib(r['bytes_per_token'])} | {quality_cells(r['quality'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.9, help="synthetic FFN sparsity (power-law hot set)")
    parser.add_argument("--target-recall", type=float, default=0.99, help="the sparse build's predictor recall")
    parser.add_argument("--dtypes", type=_dtypes, default=["fp32"],
                        help=f"weight dtypes to build dense and sparse artifacts in ({', '.join(DTYPES)}), e.g. fp32,int4")
    parser.add_argument("--ort-int4", action=argparse.BooleanOptionalAction, default=True,
                        help="also time onnxruntime on the model quantized to int4 (MatMulNBits; made once, cached "
                             "beside the model) and give every artifact its ratio against it")
    parser.add_argument("--max-quality-loss", type=_quality_budget, default=None, metavar="BUDGET",
                        help="the sparse builds' quality budget, as `picompile build --max-quality-loss` takes it "
                             "(default: the build's, perplexity +1%%)")
    parser.add_argument("--cpu-isa", choices=list(CPU_ISAS), default=None,
                        help="instruction set of the CPU kernels (default: the build's, this machine's widest; "
                             "onnxruntime picks its own at run time)")
    parser.add_argument("--predictability", type=_predictabilities, default=None,
                        help="family members' predictability: 'family' (every level), level names "
                             "(examples/models.py PREDICTABILITY_LEVELS) or numbers, comma-separated")
    parser.add_argument("--calib-tokens", type=_calib_tokens, default=None,
                        help="calibration file sizes in tokens (multiples of 64), comma-separated, e.g. 1024,4096")
    parser.add_argument("--family", action="store_true",
                        help="the whole FAMILY sweep of examples/models.py: every level x its calibration sizes")
    add_run_arguments(parser, preset="1b", prompt_len=128)  # --threads also sets the bandwidth probe's
    args = parsed_run_arguments(parser, argv)
    if args.family:
        from examples.models import FAMILY, TOKEN_DEFAULTS

        if args.predictability is not None or args.calib_tokens is not None:
            parser.error("--family is every level at every calibration size: give it alone, or the two lists")
        args.predictability = list(FAMILY["levels"].values())
        args.calib_tokens = [seqs * TOKEN_DEFAULTS["seq_len"] for seqs in FAMILY["calib_seqs"]]
    accepted = accepted_weight_dtypes()
    refused = [d for d in args.dtypes if d not in accepted]
    if refused:  # before a model is made: a 1B model's builds take minutes
        parser.error(f"picompile build does not accept --weight-dtype {', '.join(refused)} yet "
                     f"(it accepts {', '.join(accepted)})")

    from examples.bench_decode import machine, measure, ort_quality, quality, record
    from examples.models import SYNTH_DEFAULTS, TOKEN_DEFAULTS, cached_models
    from passes.reference import OrtDecoder

    family = args.predictability is not None or args.calib_tokens is not None
    levels = args.predictability or [None]
    sizes = args.calib_tokens or [None]
    texts, results, rows, params, hosts = [], [], [], None, []
    for level in levels:
        labels = [member_label(level, size, family) for size in sizes]
        specs = [dict(family="opt", preset=args.preset, sparsity=args.sparsity, **member_overrides(level, size))
                 for size in sizes]
        members = dict(zip(labels, cached_models(specs, log=print)))
        files = next(iter(members.values()))
        params = json.loads(files.config.read_text())["num_params"]
        # one per predictability: the members share their weights (only calib.npy differs)
        int4_model = ort_int4_model(files) if args.ort_int4 else None
        artifacts = build_all(members, args)
        print(f"evaluating {len(artifacts)} artifacts{f' and {ORT_INT4}' if int4_model else ''} against onnxruntime "
              "on held-out tokens")
        reference = OrtDecoder(files.onnx)
        qualities = {name: quality(files, path, reference=reference) for name, path in artifacts.items()}
        if int4_model is not None:
            qualities[ORT_INT4] = ort_quality(files, int4_model, args.max_context, reference=reference)
        del reference
        gc.collect()
        agreement = byte_agreement(artifacts)
        for name, counts in agreement.items():
            print(f"{name}: the cost model and the runtime count the same weight bytes for "
                  f"{counts['calls'] - len(counts['disagree'])} of {counts['calls']} decode calls"
                  + (f" (not: {', '.join(counts['disagree'])})" if counts["disagree"] else ""))
        print(f"timing: {plural(args.runs, 'alternating run')} of {args.tokens} tokens after a {args.prompt_len}-token prompt")
        probe = Bandwidth(args.threads)
        states = []
        summary = measure(files, artifacts, args.tokens, args.runs, args.threads, args.prompt_len, each_run=probe,
                          baselines={ORT_INT4: int4_model} if int4_model else None, host_states=states)
        hosts.append(states[-1].summary())
        int4_ratios(summary, artifacts)
        bandwidth = probe.summary()
        ratios = derive(summary, bandwidth, args.dtypes, labels)
        config = {"family": "opt", "preset": args.preset, "params": params, "sparsity": args.sparsity,
                  "predictability": SYNTH_DEFAULTS["predictability"] if level is None else level,
                  "calib_tokens": [json.loads(m.config.read_text()).get("calib_tokens") for m in members.values()],
                  "threads": args.threads, "tokens": args.tokens, "runs": args.runs, "prompt_len": args.prompt_len,
                  "max_context": args.max_context, "target_recall": args.target_recall, "dtypes": args.dtypes,
                  "cpu_isa": args.cpu_isa, "machine": machine(),
                  "ort_int4": ({**ORT_INT4_RECIPE, "onnxruntime": _ort_version(), "model": str(int4_model)}
                               if int4_model else None)}
        text = report(config, summary, qualities, bandwidth, ratios)
        text += "\nByte counts, cost model against runtime (every decode call, 3 steps): " + "; ".join(
            f"{name} {c['calls'] - len(c['disagree'])}/{c['calls']} agree" for name, c in agreement.items()) + "."
        check = placement_check(summary, artifacts)
        text += f"\n{check}" if check else ""
        if family:
            text = f"Predictability {config['predictability']:g}:\n\n" + text
        print(text)
        texts.append(text)
        for label, size, member in zip(labels, sizes, members.values()):
            sparse, dense = engine_name("sparse", args.dtypes[0], label), engine_name("dense", args.dtypes[0])
            rows.append({"predictability": config["predictability"],
                         "calib_tokens": json.loads(member.config.read_text()).get("calib_tokens")
                         or TOKEN_DEFAULTS["n_seqs"] * TOKEN_DEFAULTS["seq_len"],
                         "dtype": args.dtypes[0], "model": str(member.dir),
                         "tokens_per_s": summary[sparse]["decode_tokens_per_s"],
                         "vs_dense": summary[sparse]["decode_tokens_per_s"] / summary[dense]["decode_tokens_per_s"],
                         "vs_onnxruntime": summary[sparse]["ratio"],
                         "vs_ort_int4": summary[sparse].get("ratio_ort_int4"),
                         "bytes_per_token": summary[sparse]["weight_bytes_per_token"], "quality": qualities[sparse]})
        results.append({"config": config, "summary": summary, "quality": qualities, "bandwidth": bandwidth,
                        "sparse_vs_dense": ratios, "byte_agreement": agreement,
                        "artifacts": {name: {"path": str(path), "weight_dtypes": weight_dtypes(path)}
                                      for name, path in artifacts.items()}})
    if family:
        table = family_table(rows)
        print(f"\nThe family (sparse {args.dtypes[0]} builds, target recall {args.target_recall}):\n\n{table}")
        texts.append(f"The family (sparse {args.dtypes[0]} builds, target recall {args.target_recall}):\n\n{table}")
    if args.json:
        payload = results[0] if not family else {"members": rows, "runs": results}
        args.json.write_text(json.dumps(payload, indent=1))
    if args.record:
        what = (f"benchmark family, predictability {', '.join(f'{r:g}' for r in dict.fromkeys(x['predictability'] for x in rows))}"
                if family else f"synthetic {args.sparsity:.0%}-sparse")
        record(f"CPU decode suite, opt-{args.preset} ({params / 1e6:.0f}M params, {what})",
               results[-1]["config"], "\n\n".join(texts), "benchmarks/bench_cpu_decode.py", argv, host="; ".join(hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
