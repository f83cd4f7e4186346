"""machine_rates: how fast this machine's CPU kernels read each weight format, measured once and cached.

The cost model prices a decode step by the bytes its calls read. One bandwidth for every kernel is wrong two ways:
machines differ (a 2-core Zen 4 streams ~38 GB/s, a 2-core Zen 3 ~17), and kernels differ (a K-quant GEMV unpacks
codes and two levels of scales, a column-sparse kernel starts a new stream per row it gathers). So the build
machine's kernels are timed once: select-kernels' own `Lowering` lowers the dense decode GEMV of every weight
format, at three shapes (`SHAPES`), and the threshold call (select, then the column-sparse GEMV over
the kept rows) of every format a column kernel reads, at two kept shares (`COLUMN_KEPT`); they are compiled for the
build's instruction set and each timed over enough copies of its weights that every call streams them from
memory (`STREAM_BYTES`), on every core this process may use (the runtime's default start on a quiet machine).
Each kind's points give its figures (`KernelRate`, fitted by non-negative least squares): bytes per second, a
fixed cost per call (`call_s`: waking the workers and their barrier, for a threshold call also the select and the
partial sums), which is most of a small matrix's time, and a cost per unit of work (`unit_s`): a GEMV's output column (each
panel's setup and stores, which a matrix of a short K and many outputs, an output layer, pays most), a threshold
call's kept row (a new stream; timed at two row lengths, `COLUMN_SHAPES`, and on an FFN input's gated wide rows,
`GATED_COLUMN_SHAPES`), or over a file's own blocks each block's outputs (`costmodel.column_units`).

The figures are cached per machine (`machine_key`: the CPU's model name, the instruction set, the cores, the
kernels' sources) under `$PICOMPILE_CACHE/machine/`; `picompile calibrate` measures again. A build on another
instruction set than the machine's (--cpu-isa) cannot time its kernels here, and prices with the target's
bandwidth; so does every build where PICOMPILE_MEASURED_RATES=0 (the tests: plans must not depend on the
machine that runs them), and a build whose measurement found other programs on a core (`CpuRates.busy`: such
figures are distorted, and not cached). A build measures in a child process (`measured_apart`), so that the
timing copies and the thread pool stay out of its own memory and process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.artifact import aligned_copy, aligned_zeros, cpu_model_name
from runtime.calls import Call, Role
from runtime.dtypes import FILE_FORMATS, WEIGHT_FORMATS, WeightFormat

from . import costmodel
from .cache import cache_dir
from .targets import CpuIsa, CpuRates, KernelRate, host_cpu_isa

# [K, N] of the timed GEMVs: a 1-3B model's projection, a small model's, and an output layer's short K and wide N
SHAPES = ((2048, 2048), (512, 1024), (512, 16384))
# [K, N] of the timed threshold calls: rows of 2048 and of 512 values (a row's stream starts cold: short rows cost more
# a byte, a small model's down projection's most)
COLUMN_SHAPES = ((2048, 2048), (4096, 512))
# [K, N] of the timed gated threshold calls (gate | up: N outputs' sums, their GLU): an FFN input's short K and wide
# N, whose partial sums outgrow the caches a narrow matrix's fit in (a Zen 5's q5_0 at 896 x 9728 took about its
# dense GEMV's time at half its inputs kept, where the two narrow shapes priced it at 0.84)
GATED_COLUMN_SHAPES = ((1024, 8192),)
STREAM_BYTES = 64 << 20  # weight bytes cycled through per measurement, at least (and 3x the last-level cache)
ROUNDS = 5  # rounds of one call per copy, in each pass
PASSES = 3  # passes over every kernel: a shared machine's bandwidth drifts over seconds; medians over all rounds
COLUMN_KEPT = (0.2, 0.6)  # the kept shares a threshold call is timed at (its fixed cost and its per-byte rate)
COLUMN_FORMATS = ("fp32", "fp16", "int8", "int4", "int4a", *FILE_FORMATS)  # the formats column kernels read rows of
ENABLED_ENV = "PICOMPILE_MEASURED_RATES"


def machine_key(isa: CpuIsa, threads: int) -> str:
    """Names the machine the rates hold for: its CPU model, the instruction set the kernels use, the cores, and the
    kernels' sources (a change to a kernel may change its rate)."""
    model = cpu_model_name()
    kernels = hashlib.sha256()
    for source in sorted((Path(__file__).parent / "kernels").glob("*.py")):
        kernels.update(source.read_bytes())
    kernels.update(Path(__file__).read_bytes())
    digest = hashlib.sha256(f"{model}|{isa.name}|{threads}|{kernels.hexdigest()}".encode()).hexdigest()[:12]
    return f"{isa.name}-{threads}c-{digest}"


def cache_path(key: str) -> Path:
    return cache_dir("machine") / f"{key}.json"


def enabled() -> bool:
    return os.environ.get(ENABLED_ENV, "1") != "0"


def for_build(isa: CpuIsa, log=lambda message: None) -> CpuRates | None:
    """The rates a build on this machine prices its CPU kernels with: cached, else measured now (once per machine);
    None where they cannot be measured here (kernels for another instruction set) or are turned off."""
    if not enabled() or isa.name != host_cpu_isa().name:
        return None
    rates = cached(isa)
    if rates is None:  # never measured here, another version's, or torn
        log("measuring this machine's CPU kernels once (cached; `picompile calibrate` measures again)")
        try:
            rates = measured_apart(isa)
        except (RuntimeError, ValueError, KeyError) as error:  # the build goes on, priced as before
            log(f"{error}: this build prices with the target's bandwidth")
            return None
        if rates.busy:  # a core taken by other work distorts every figure (a scheduler slice per parallel call)
            log("the machine was busy while measured: this build prices with the target's bandwidth, and the next "
                "measures again")
            return None
    return rates


def measured_apart(isa: CpuIsa) -> CpuRates:
    """`calibrate(isa)` in a child process: its kernels, thread pool and timing copies stay out of the build's."""
    out = subprocess.run([sys.executable, "-m", "passes.machine_rates", isa.name], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"measuring the machine's kernels failed: {out.stderr.strip().splitlines()[-1:]}")
    return CpuRates.from_json(json.loads(out.stdout))


def cached(isa: CpuIsa) -> CpuRates | None:
    """This machine's rates for kernels of `isa` as last measured, None where there are none."""
    path = cache_path(machine_key(isa, _threads()))
    try:
        return CpuRates.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibrate(isa: CpuIsa | None = None, shapes: tuple[tuple[int, int], ...] = SHAPES,
              column_shapes: tuple[tuple[int, int], ...] = COLUMN_SHAPES,
              gated_column_shapes: tuple[tuple[int, int], ...] = GATED_COLUMN_SHAPES, stream_bytes: int | None = None,
              rounds: int = ROUNDS, save: bool = True) -> CpuRates:
    """Time every format's decode GEMV and threshold call on this machine (see the module's docstring); cached
    unless `save` is False. Each kernel streams `stream_bytes` of weight copies a round (default: STREAM_BYTES, at
    least three times the last-level cache, so that every call reads from memory)."""
    from runtime.threads import CpuReading, free_cores_since

    isa = isa or host_cpu_isa()
    threads = _threads()
    reading = CpuReading.now()
    bench = _Bench(isa)
    for shape in shapes:
        for name in WEIGHT_FORMATS:
            bench.add_gemv(name, shape)
    for name in COLUMN_FORMATS:
        for shape in column_shapes:
            bench.add_columns(name, shape)
        for shape in gated_column_shapes:
            bench.add_columns(name, shape, gated=True)
    if stream_bytes is None:
        stream_bytes = max(STREAM_BYTES, 3 * last_level_cache_bytes())
    rates = bench.run(threads, stream_bytes, rounds, machine_key(isa, threads))
    if free_cores_since(reading, threads) < threads:  # other programs took a core meanwhile: figures of the moment
        rates = dataclasses.replace(rates, busy=True)
    if save and not rates.busy:  # (a busy machine's are used by the build that measured them, not kept)
        keep(rates)
    return rates


def keep(rates: CpuRates) -> Path:
    """Cache `rates` for later builds on this machine (written whole, then renamed)."""
    path = cache_path(rates.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(rates.to_json(), indent=1))
    temporary.replace(path)
    return path


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 0 where unknown."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def _threads() -> int:
    from runtime.threads import usable_cores

    return usable_cores()


@dataclass
class _Timed:
    """One measurement: the decode calls it runs in order, the weight buffers it streams, and how its seconds
    become a rate (`kind`: gemv or columns; `kept`: the threshold's share of inputs kept)."""

    kind: str
    format: str
    calls: list[Call]
    weights: list[str]
    read_bytes: float
    kept: float | None = None
    units: float = 0  # a GEMV's output columns, a threshold call's kept rows


class _Bench:
    """The kernels to time, lowered as a build lowers them."""

    def __init__(self, isa: CpuIsa):
        from .select_kernels import Lowering, _Walker

        self.isa = isa
        self.low = Lowering(max_context=8, prefill_rows=8, gemm_panels=isa.gemm_panels, int8_dot=isa.int8_dot)
        self.walker = _Walker(self.low)
        self.rng = np.random.default_rng(0)
        self.timed: list[_Timed] = []

    def x(self, k: int) -> str:
        """The input row of width k (random, filled before the timing)."""
        return self.low.activation(f"x.k{k}", k)

    def _matrix(self, name: str, fmt: WeightFormat, shape: tuple[int, int], axis: int = 0) -> str:
        """A random [K, N] matrix stored in `fmt` (quantized: blocked along `axis`, K for a dense GEMV's panels, N
        for the rows a column kernel gathers), registered with the lowering as a build registers it."""
        k, n = shape
        if fmt.kept_from_file:  # the file's own blocks: bytes whose every fp16 field is a normal number
            from .file_blocks import FileMatrix, FileRows
            from .formats import ggml

            ggml_type = next(t for t in ggml.GGML_TYPES.values() if t.format == fmt.name and t.kept_in_blocks)
            raw = self.rng.integers(0x20, 0x3C, (n, k // ggml_type.block * ggml_type.type_size), dtype=np.uint8)
            self.low.kept[name] = FileMatrix((FileRows(ggml_type.name, raw, k),), transposed=True)
        elif fmt.quantized:
            from .quantize import QuantizedMatrix

            low, high = fmt.levels
            values = self.rng.integers(low, high + 1, (k, n), dtype=np.int8)
            blocks = (k // fmt.block, n) if axis == 0 else (k, n // fmt.block)
            scales = (self.rng.random(blocks) * 0.01 + 0.001).astype(fmt.scale_dtype)
            mins = -scales if fmt.has_min else None
            self.low.quantized[name] = QuantizedMatrix(values, scales, axis, fmt, mins)
        else:
            self.low.weight(name, (self.rng.standard_normal((k, n)) * 0.02).astype(fmt.storage), fmt.storage)
        return name

    def _new_calls(self, before: int) -> list[Call]:
        return [call for call in self.low.program.calls[before:] if call.decode]

    def add_gemv(self, name: str, shape: tuple[int, int]) -> None:
        k, n = shape
        weight = self._matrix(f"w.gemv.{name}.{k}x{n}", WEIGHT_FORMATS[name], shape)
        before = len(self.low.program.calls)
        self.low.linear(self.x(k), weight, None, self.low.activation(f"y.n{n}", n), f"gemv.{name}.{k}x{n}",
                        Role.FFN_UP, phases=("decode",))
        calls = self._new_calls(before)
        self.timed.append(_Timed("gemv", name, calls, *self._weights(calls), units=n))

    def add_columns(self, name: str, shape: tuple[int, int], gated: bool = False) -> None:
        k, n = shape
        tag = f"{k}x{n}{'_gated' if gated else ''}"
        out = n // 2 if gated else n
        for kept in COLUMN_KEPT:
            weight = self._matrix(f"w.columns.{name}.{kept}.{tag}", WEIGHT_FORMATS[name], shape, axis=1)
            before = len(self.low.program.calls)
            threshold = float(np.quantile(np.abs(self.rng.standard_normal(1 << 16)), 1 - kept))
            self.walker.thresholded_linear(f"columns.{name}.{kept}.{tag}", "up", self.x(k), weight, None,
                                           self.low.activation(f"y.n{out}", out), threshold, Role.FFN_UP,
                                           glu=gated, act="silu" if gated else "none")
            calls = self._new_calls(before)
            weights, whole = self._weights(calls)
            units = costmodel.column_units(name, whole, k, kept)
            self.timed.append(_Timed("columns", name, calls, weights, whole * kept, kept, units=units))

    def _weights(self, calls: list[Call]) -> tuple[list[str], float]:
        """The weight buffers `calls` read, and their bytes."""
        buffers = self.low.buffers
        names = sorted({arg.buffer for call in calls for arg in call.args
                        if buffers.get(arg.buffer, {}).get("kind") == "weight" and not arg.buffer.endswith("threshold_up")})
        return names, float(sum(self.low.weights[n].nbytes for n in names))

    def run(self, threads: int, stream_bytes: int, rounds: int, key: str) -> CpuRates:
        from runtime.threads import prepare_pool_environment, thread_pool

        prepare_pool_environment()
        import tvm
        import tvm_ffi

        from .compile import _make
        from .kernels import cpu

        program = self.low.program
        names = sorted({call.decode for timed in self.timed for call in timed.calls})
        with tempfile.TemporaryDirectory(prefix="picompile-rates-") as directory:
            library_path = str(Path(directory) / "rates.so")
            cpu.build([_make(program.kernels[name], name, "cpu") for name in names], self.isa.llvm_target(),
                      library_path)
            library = tvm.runtime.load_module(library_path)
        thread_pool(tvm_ffi).use(threads)
        arrays: dict[str, np.ndarray] = {}
        for name, info in program.buffers.items():
            if info["kind"] == "weight":
                arrays[name] = aligned_copy(program.weights.pop(name))  # (the lowering's copy dropped)
            else:
                arrays[name] = aligned_zeros([1, *info["shape"][1:]] if info["kind"] == "activation" else info["shape"],
                                             info["dtype"])
        for name in arrays:
            if name.startswith("x.k"):
                arrays[name][...] = self.rng.standard_normal(arrays[name].shape)
        dl = tvm_ffi.from_dlpack
        pairs: dict[tuple[str, str], list[_Timed]] = {}
        for timed in self.timed:
            pairs.setdefault((timed.kind, timed.format), []).append(timed)
        samples: dict[tuple[str, str], list[list[float]]] = {key: [[] for _ in pair] for key, pair in pairs.items()}
        for _, (kind_format, pair) in itertools.product(range(PASSES), pairs.items()):
            # a pair at a time (only its copies held), its points alternated; every pair in each of PASSES passes
            bound = []
            for timed in pair:
                copies = max(2, -(-stream_bytes // max(int(timed.read_bytes / (timed.kept or 1.0)), 1)))
                sets = [{n: arrays[n] for n in timed.weights}] + [
                    {n: aligned_copy(arrays[n]) for n in timed.weights} for _ in range(copies - 1)]
                bound.append([[(library[call.decode], [dl(weights.get(arg.buffer, arrays[arg.buffer]))
                                                       for arg in call.args]) for call in timed.calls]
                              for weights in sets])
            for round_ in range(rounds + 1):  # the first round warms up (pages, the pool's workers): not counted
                for index, copies in enumerate(bound):
                    started = time.perf_counter()
                    for steps in copies:
                        for function, args in steps:
                            function(*args)
                    if round_:
                        samples[kind_format][index].append((time.perf_counter() - started) / len(copies))
            del bound
        gemv, columns = {}, {}
        for (kind, name), pair in pairs.items():
            points = [(timed.read_bytes, timed.units, statistics.median(times))
                      for timed, times in zip(pair, samples[(kind, name)])]
            (gemv if kind == "gemv" else columns)[name] = fitted(points)
        return CpuRates(key, threads, gemv, columns)


def fitted(points: list[tuple[float, int, float]]) -> KernelRate:
    """The rate through (bytes, units, seconds) points: seconds = call_s + bytes / rate + units * unit_s,
    by least squares with no term negative (each subset of the fixed terms tried; the bytes' term always kept)."""
    data = np.array(points, np.float64)
    best = None
    for call in (True, False):
        for per_column in (True, False):
            terms = [data[:, 0]] + ([np.ones(len(data))] if call else []) + ([data[:, 1]] if per_column else [])
            design = np.stack(terms, axis=1)
            if np.linalg.matrix_rank(design) < design.shape[1]:
                continue
            coefficients = np.linalg.lstsq(design, data[:, 2], rcond=None)[0]
            if np.any(coefficients <= 0):
                continue
            residual = float(np.sum((design @ coefficients - data[:, 2]) ** 2))
            if best is None or residual < best[0]:
                values = iter(coefficients[1:])
                best = (residual, KernelRate(1.0 / coefficients[0], next(values) if call else 0.0,
                                             next(values) if per_column else 0.0))
    if best is None:  # (the bytes' term alone is always positive: points of positive seconds)
        return KernelRate(float(data[:, 0].sum() / data[:, 2].sum()))
    return best[1]


if __name__ == "__main__":  # measured_apart's child: the figures as JSON on stdout
    from .targets import get_cpu_isa

    print(json.dumps(calibrate(get_cpu_isa(sys.argv[1])).to_json()))
