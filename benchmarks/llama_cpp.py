"""llama.cpp as the measuring peer (issue 32): its binaries, built from source by scripts/build_llama_cpp.sh
under ~/.cache/picompile/llama.cpp, run and parsed. Never a dependency of picompile.

    from llama_cpp import find, bench, perplexity, tokenize, quantize
    llama = find()                                   # LlamaCppMissing (with the one-line build hint) if absent
    bench(llama, "model.gguf", threads=2)            # BenchFigures: prompt and decode tokens/s (llama-bench)
    perplexity(llama, "model.gguf", "text.txt", threads=2, ctx=512, chunks=8)
    tokenize(llama, "model.gguf", "Hello world")     # ids, as llama.cpp's tokenizer makes them
    quantize(llama, "in.gguf", "out.gguf", "Q8_0", threads=2)
    converter()                                      # its convert_hf_to_gguf.py (the tests' converter), or None

Every binary runs with the AMX permission refused (LD_PRELOAD of the build script's noamx.so: on Xeons that
advertise AMX but fault on its tile instructions, llama-bench otherwise exits 139; harmless elsewhere), with
OMP_WAIT_POLICY=passive (spinning OpenMP threads collapse on shared cores: 2.7 tok/s instead of 45) and with
the thread count given explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

BUILD_HINT = "build it with scripts/build_llama_cpp.sh (llama.cpp from the llama-cpp-python sdist; minutes, niced)"
TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-tokenize")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32", "Q4_K_M", "Q5_K_M", "Q6_K")


class LlamaCppMissing(RuntimeError):
    """llama.cpp's binaries (or the AMX shim) are not built here."""


class LlamaCppFailed(RuntimeError):
    """A llama.cpp binary failed or printed what cannot be parsed."""


def default_root() -> Path:
    return Path(os.environ.get("PICOMPILE_LLAMA_CPP_DIR", Path.home() / ".cache" / "picompile" / "llama.cpp"))


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    """Where the binaries are, and how every one of them is run."""

    bin_dir: Path
    shim: Path
    wait_policy: str = "passive"  # OMP_WAIT_POLICY: passive, or active (spinning: a peer measured at its best tries both)

    def tool(self, name: str) -> Path:
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise LlamaCppMissing(f"{path} is missing: {BUILD_HINT}")
        return path

    @property
    def source(self) -> str:
        """Which llama.cpp: the build script's one line (its commit, as the sdist pins it); llama-bench's own
        build_commit reads "unknown" in a build from the sdist, which has no git history."""
        try:
            return (self.bin_dir.parent / "llama.cpp-source.txt").read_text().strip()
        except OSError:
            return "llama.cpp (source unknown)"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(p for p in (str(self.shim), env.get("LD_PRELOAD", "")) if p)
        env["OMP_WAIT_POLICY"] = self.wait_policy
        return env

    def run(self, name: str, args: list[str], *, input: str | None = None,
            timeout: float = 1800) -> subprocess.CompletedProcess:
        """Run a tool; its stdout and stderr (text). Fails with the tool's last stderr lines (and the AMX hint for exit 139)."""
        command = [str(self.tool(name)), *map(str, args)]
        done = subprocess.run(command, input=input, capture_output=True, text=True, env=self.env(),
                              timeout=timeout, errors="replace")
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            hint = ""
            if done.returncode in (139, -11, 132, -4):  # SIGSEGV / SIGILL
                hint = f" (a fault: was {self.shim} preloaded? on a CPU whose AMX faults it must be)"
            raise LlamaCppFailed(f"{name} exited {done.returncode}{hint}:\n{tail}")
        return done


def converter(root: str | Path | None = None) -> Path | None:
    """llama.cpp's own convert_hf_to_gguf.py in the source the build script unpacked under `root` (the newest
    version there; its gguf-py beside it), or None where there is none (the tests that convert with it skip)."""
    root = Path(root) if root is not None else default_root()
    found = sorted(root.glob("src-*/convert_hf_to_gguf.py"),
                   key=lambda path: [int(n) if n.isdigit() else n for n in re.split(r"[.-]", path.parent.name)])
    return found[-1] if found else None


def find(root: str | Path | None = None) -> LlamaCpp:
    """The built binaries under `root` (default ~/.cache/picompile/llama.cpp, or $PICOMPILE_LLAMA_CPP_DIR)."""
    root = Path(root) if root is not None else default_root()
    llama = LlamaCpp(bin_dir=root / "current" / "bin", shim=root / "noamx.so")
    missing = [t for t in TOOLS if not os.access(llama.bin_dir / t, os.X_OK)]
    if missing or not llama.shim.is_file():
        raise LlamaCppMissing(f"llama.cpp is not built in {root} (missing: {', '.join(missing or ['noamx.so'])}): "
                              f"{BUILD_HINT}")
    return llama


# ------------------------------------------------------------------------------------------------- llama-bench

@dataclasses.dataclass(frozen=True)
class BenchFigures:
    """llama-bench's averages over its repetitions (it runs one untimed warm-up first)."""

    prompt_tokens_per_s: float | None     # -p n_prompt tokens in one batch
    decode_tokens_per_s: float | None     # -n n_gen tokens one at a time, from an empty context
    prompt_stddev: float | None
    decode_stddev: float | None
    n_prompt: int
    n_gen: int
    threads: int
    repetitions: int
    build: str                            # llama.cpp's build commit and number
    model_type: str                       # e.g. "llama ?B Q4_1"


def bench(llama: LlamaCpp, model: str | Path, threads: int, n_prompt: int = 64, n_gen: int = 32,
          repetitions: int = 3, decode_depth: int = 0, extra: tuple[str, ...] = ()) -> BenchFigures:
    """llama-bench -m model -t threads -p n_prompt -n n_gen -r repetitions -o json, parsed. With
    `decode_depth`, generation is timed after that many tokens in the KV cache (-d: as a decode after a prompt
    is), in a second invocation, so that prompt processing is still timed from an empty cache."""
    common = ["-m", model, "-t", threads, "-r", repetitions, "-o", "json", *extra]
    if not decode_depth:
        out = llama.run("llama-bench", [*common, "-p", n_prompt, "-n", n_gen]).stdout
        return parse_bench_json(out, threads=threads, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions)
    prompt = parse_bench_json(llama.run("llama-bench", [*common, "-p", n_prompt, "-n", 0]).stdout, threads=threads,
                              n_prompt=n_prompt, n_gen=0, repetitions=repetitions)
    decode = parse_bench_json(llama.run("llama-bench", [*common, "-p", 0, "-n", n_gen, "-d", decode_depth]).stdout,
                              threads=threads, n_prompt=0, n_gen=n_gen, repetitions=repetitions)
    return dataclasses.replace(prompt, decode_tokens_per_s=decode.decode_tokens_per_s,
                               decode_stddev=decode.decode_stddev, n_gen=n_gen)


def parse_bench_json(text: str, *, threads: int, n_prompt: int, n_gen: int, repetitions: int) -> BenchFigures:
    """llama-bench's JSON: one entry per test; the prompt test has n_gen 0, the generation test n_prompt 0."""
    try:
        entries = json.loads(text[text.index("["):])
    except ValueError as error:
        raise LlamaCppFailed(f"llama-bench printed no JSON list: {error}: {text[:200]!r}") from None
    prompt = next((e for e in entries if e.get("n_gen") == 0 and e.get("n_prompt", 0) > 0), None)
    decode = next((e for e in entries if e.get("n_prompt") == 0 and e.get("n_gen", 0) > 0), None)
    if prompt is None and decode is None:
        raise LlamaCppFailed(f"llama-bench's JSON has no prompt or generation test: {entries!r:.300}")
    first = prompt or decode
    return BenchFigures(
        prompt_tokens_per_s=prompt and float(prompt["avg_ts"]), decode_tokens_per_s=decode and float(decode["avg_ts"]),
        prompt_stddev=prompt and float(prompt.get("stddev_ts", 0.0)),
        decode_stddev=decode and float(decode.get("stddev_ts", 0.0)),
        n_prompt=n_prompt, n_gen=n_gen, threads=threads, repetitions=repetitions,
        build=f"{first.get('build_commit', '?')} ({first.get('build_number', '?')})",
        model_type=str(first.get("model_type", "?")))


# -------------------------------------------------------------------------------------------- llama-perplexity

@dataclasses.dataclass(frozen=True)
class PerplexityFigures:
    ppl: float
    ppl_error: float        # llama.cpp's +/- (its estimate of the mean's standard error, in ppl units)
    chunks: int
    ctx: int
    scored: int             # tokens scored: chunks * (ctx - 1 - ctx // 2)


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"(?:computing over|calculating perplexity over) (\d+) chunks, n_ctx=(\d+)")


def perplexity(llama: LlamaCpp, model: str | Path, text_file: str | Path, threads: int, ctx: int = 512,
               chunks: int | None = None, batch: int | None = None) -> PerplexityFigures:
    """llama-perplexity over `text_file`: its tokens (the whole file tokenized once, as `tokenize(...,
    parse_special=False)` makes them) cut into windows of `ctx`, each scored on its second half (see
    perplexity_windows). `--no-escape`: the file's bytes as they are (llama.cpp drops one trailing newline)."""
    args = ["-m", model, "-f", text_file, "-t", threads, "-c", ctx, "-b", batch or ctx, "--no-escape"]
    if chunks is not None:
        args += ["--chunks", chunks]
    done = llama.run("llama-perplexity", args)
    return parse_perplexity(done.stdout + done.stderr)  # it logs its estimate to stderr


_KLD = re.compile(r"Mean\s+KLD:\s+([0-9.eE+-]+)")


def kl_divergence(llama: LlamaCpp, base: str | Path, model: str | Path, text_file: str | Path, threads: int,
                  ctx: int, chunks: int, logits_file: str | Path) -> float:
    """llama-perplexity's mean KL divergence of `model`'s next-token distributions from `base`'s, on the windows
    `perplexity` scores: `base`'s logits saved to `logits_file` (--kl-divergence-base), then compared."""
    common = ["-f", text_file, "-t", threads, "-c", ctx, "-b", ctx, "--no-escape", "--chunks", chunks,
              "--kl-divergence-base", logits_file]
    llama.run("llama-perplexity", ["-m", base, *common])
    done = llama.run("llama-perplexity", ["-m", model, *common, "--kl-divergence"])
    found = _KLD.search(done.stdout + done.stderr)
    if found is None:
        raise LlamaCppFailed("llama-perplexity --kl-divergence printed no mean KLD")
    return float(found.group(1))


def parse_perplexity(text: str) -> PerplexityFigures:
    final = _FINAL.search(text)
    shape = _CHUNKS.search(text)
    if final is None or shape is None:
        raise LlamaCppFailed(f"llama-perplexity printed no final estimate: ...{text[-400:]!r}")
    chunks, ctx = int(shape.group(1)), int(shape.group(2))
    return PerplexityFigures(ppl=float(final.group(1)), ppl_error=float(final.group(2)), chunks=chunks, ctx=ctx,
                             scored=chunks * (ctx - 1 - ctx // 2))


def perplexity_windows(ids: list[int], ctx: int, chunks: int | None, bos: int | None):
    """The windows llama-perplexity scores (tools/perplexity/perplexity.cpp): window i is ids[i*ctx:(i+1)*ctx]
    (whole windows only), its first token replaced by BOS when the model adds one; the logits at positions
    ctx//2 .. ctx-2 are scored against the next token. Yields (window, first scored position)."""
    count = len(ids) // ctx
    if chunks is not None:
        count = min(count, chunks)
    for i in range(count):
        window = list(ids[i * ctx:(i + 1) * ctx])
        if bos is not None:
            window[0] = bos
        yield window, ctx // 2


# ---------------------------------------------------------------------------------------------- llama-tokenize

def tokenize(llama: LlamaCpp, model: str | Path, text: str, *, add_bos: bool = True,
             parse_special: bool = True) -> list[int]:
    """`text`'s ids by llama.cpp's tokenizer: as the model asks (BOS if its add_bos_token says so) unless
    add_bos=False, special tokens' text parsed as them unless parse_special=False (llama-perplexity does not
    parse them). The text goes through stdin, byte for byte (--no-escape)."""
    args = ["-m", model, "--stdin", "--ids", "--no-escape", "--log-disable"]
    if not add_bos:
        args.append("--no-bos")
    if not parse_special:
        args.append("--no-parse-special")
    out = llama.run("llama-tokenize", args, input=text).stdout
    lines = [line for line in out.splitlines() if line.startswith("[")]
    if not lines:
        raise LlamaCppFailed(f"llama-tokenize printed no id list: {out[-200:]!r}")
    return [int(v) for v in json.loads(lines[-1])]


# ---------------------------------------------------------------------------------------------- llama-quantize

def quantize(llama: LlamaCpp, source: str | Path, target: str | Path, qtype: str, threads: int) -> Path:
    """llama-quantize --allow-requantize source target qtype threads; skipped when `target` exists (written
    under a temporary name and renamed, so a file that exists is whole)."""
    target = Path(target)
    if target.exists():
        return target
    if qtype.upper() not in QUANT_TYPES:
        raise ValueError(f"unknown llama-quantize type {qtype!r}; one of {', '.join(QUANT_TYPES)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    llama.run("llama-quantize", ["--allow-requantize", source, partial, qtype.upper(), threads])
    partial.rename(target)
    return target


def derived_file(source: str | Path, qtype: str, directory: str | Path | None = None) -> Path:
    """Where quantize() puts `source` in `qtype`: ~/.cache/picompile/gguf/<stem without its type>.<qtype>.gguf."""
    source = Path(source)
    stem = source.stem
    for known in QUANT_TYPES:  # SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct
        if stem.upper().endswith("." + known):
            stem = stem[: -len(known) - 1]
            break
    directory = Path(directory) if directory is not None else Path.home() / ".cache" / "picompile" / "gguf"
    return directory / f"{stem}.{qtype.upper()}.gguf"
