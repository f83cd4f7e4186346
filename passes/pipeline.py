"""The pass manager: passes run in order over the IR; one callback hook sees the IR between passes.

A pass is a small dataclass with a `name`, the options it reads as its fields, and one
`apply(model, ctx) -> PassResult` method. Printing (`--dump-ir`, with its index of node counts), the pass
list and timing (`-v`), verification and progress bars all hang off the one hook mechanism,
`Hook.before_passes` / `before_pass` / `after_pass`. An exception escaping a pass comes out as a
`PassError` that names the pass and the layer (`ctx.layer`). A pass states what it needs of the IR and what it
makes hold (`requires` / `adds`: `Fact`s), and `run_passes` checks both, and every graph against the declared
ops (`passes.ops`), in every build.
The pass lists themselves live in `picompile.compiler`, one screen to read the whole compilation.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from dataclasses import InitVar, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from . import memory
from . import ops
from .budget import DEFAULT_BUDGET, QualityBudget
from .errors import PassError, UserError
from .targets import CpuIsa, GpuBudget, Target, format_size, get_cpu_isa, host_cpu_isa
from .tokenizer import TokenizerFiles
from runtime.dtypes import AUTO_WEIGHT_DTYPE, WEIGHT_FORMATS, WeightFormat

__all__ = ["Options", "BuildTarget", "Context", "Fact", "Hook", "Pass", "PassResult", "ProgressBars", "run_passes",
           "DumpIR", "LogTiming", "verify_onnx", "describe_pass", "op_counts", "describe_change"]


@dataclass
class Options:
    """What the user asked for on the command line (or the Python API). No pass reads it: `compiler.pipeline`
    gives each pass the options it reads as its fields, whose defaults are these."""

    dense: bool = False
    # the KV cache's length (tokens); None: the model's trained context capped by the KV memory budget, or 256
    # (passes.context; the command line's default, resolved by `compiler.build`)
    max_context: int | None = 256
    calib: Path | None = None  # token ids, or text read with `tokenizer` (passes.tokens.read_calibration)
    tokenizer: TokenizerFiles | None = None  # the model's, copied into the artifact (passes.tokenizer)
    vram_budget_bytes: int | None = None  # overrides the target's GPU memory
    calib_tokens: int | None = None  # cap on the calibration tokens the profile pass runs (None: every one given)
    # Sequences the profile pass samples from the model itself to add to --calib (None: "auto", enough to reach
    # passes.profile.MIN_TOKENS_PER_NEURON tokens per FFN neuron when a --calib file falls short; 0: none)
    calib_samples: int | None = None
    placement_batch: int | None = None  # neurons per ILP column (sorted by frequency, then grouped); None: by width
    placement_time_limit_s: float = 30.0
    predictor_param_share: float = 0.10  # cap on all predictors together, as a share of the model's parameters
    target_recall: float = 0.99  # the threshold of each predictor is set to reach this on held-out tokens
    all_neurons: bool = False  # lower sparse but let every neuron pass the predictor (checks the split)
    dense_fallback: bool = True  # predictor mode: placement may run a layer dense (where the cost model prices it lower)
    # storage of the CPU's weight matrices: fp32, fp16 (converted in registers), int8, int4, int4a, or "auto"
    # (runtime.dtypes.AUTO_WEIGHT_DTYPE, the command line's default: as the model file stores them; `compiler.build`
    # resolves it from the model)
    weight_dtype: str = "fp32"
    # set where "auto" chose weight_dtype from a quantized model: its matrices in other blocks than that format (a
    # Q4_1 file's Q8_0 embedding) keep their own blocks (passes.quantize), not re-rounded
    keep_source_blocks: bool = False
    # int4 decode GEMVs quantize their input to int8 per block of 32 and take integer dot products (as llama.cpp's
    # Q4_0 and onnxruntime's accuracy_level 4 do): an error of ~5e-3 of the output, 1.3-1.9x faster
    int8_activations: bool = True
    # quantized builds: "awq" scales each FFN's input channels by its profiled activations before rounding
    # (passes.awq), "rtn" rounds every weight to the nearest step as it is
    quant_method: str = "awq"
    cpu_isa: str | None = None  # the CPU kernels' instruction set (targets.CPU_ISAS); None: the target's, else the build machine's
    # How decode skips FFN work: "predictor" (PowerInfer: a trained predictor picks the neurons, for ReLU FFNs),
    # "threshold" (TEAL: inputs of each projection below a calibrated magnitude are dropped, for SiLU/GELU
    # FFNs) or "auto" (by the model's FFN activation; passes.sparsity_mode).
    sparsity_mode: str = "auto"
    # threshold mode: the share of each FFN projection's inputs dropped, one level for all (None: a level per linear
    # input, chosen within quality_budget by passes.quality)
    sparsity: float | None = None
    quality_budget: QualityBudget = DEFAULT_BUDGET  # --max-quality-loss: what sparsity and formats may cost
    # sequences one batch step decodes together (CPU artifacts: runtime Engine.forward_batch); below 2: no batch phase
    max_batch: int = 8
    seed: int = 0
    nodes: tuple = ()  # --nodes: the machines the model is split across (passes.nodes.Node); () one machine


@dataclass(frozen=True)
class BuildTarget:
    """What the build is for, resolved once from the options and the target before the passes run
    (`resolve`): the passes read it from `Context.build` and never derive it again."""

    target: Target
    weight_format: WeightFormat  # the CPU's weight matrices (--weight-dtype, "auto" resolved against the model)
    keep_source_blocks: bool  # Options.keep_source_blocks: a quantized model's other blocks stay as they came
    cpu_isa: CpuIsa  # the CPU kernels' instruction set
    gpu: GpuBudget  # what placement may fill (total 0 without a GPU)
    max_context: int  # the KV cache's length, and of the sequences the build profiles
    quality_budget: QualityBudget  # --max-quality-loss
    nodes: tuple = ()  # --nodes (passes.nodes.Node, in pipeline order); (): one machine

    @classmethod
    def resolve(cls, options: Options, target: Target, gpu: GpuBudget | None = None) -> "BuildTarget":
        """The build target of `options` for `target`. The weight dtype must be resolved already ("auto" needs
        the model: `picompile.compiler.resolve_weight_dtype`); `gpu`, where the driver checked the budget
        before loading the model, is that budget; else --vram-budget is checked here."""
        if options.weight_dtype == AUTO_WEIGHT_DTYPE:
            raise ValueError("weight_dtype 'auto' is resolved from the model first (resolve_weight_dtype)")
        if options.max_context is None:
            raise ValueError("max_context None is resolved from the model first (resolve_context)")
        return cls(target, WEIGHT_FORMATS[options.weight_dtype], options.keep_source_blocks,
                   cls.cpu_isa_of(options, target),
                   gpu if gpu is not None else GpuBudget.resolve(target, options.vram_budget_bytes),
                   options.max_context, options.quality_budget, cls.nodes_of(options, target))

    @staticmethod
    def cpu_isa_of(options: Options, target: Target) -> CpuIsa:
        """The CPU kernels' instruction set: --cpu-isa, else the target's, else the build machine's widest."""
        name = options.cpu_isa or target.cpu_isa
        return get_cpu_isa(name) if name else host_cpu_isa()

    @staticmethod
    def nodes_of(options: Options, target: Target) -> tuple:
        """--nodes, each node checked against the target: a node's card is the build's GPU target (the kernels
        are compiled once, for it) or none; a node with a card needs a build for that card."""
        for node in options.nodes:
            if node.target != "cpu" and node.target != target.name:
                raise UserError(f"--nodes: node {node.name} has a {node.target} and the build targets {target.name}; "
                                f"build with --target {node.target} (the nodes' cards must be one kind: the GPU "
                                "kernels are compiled once), or give the node no card")
        return tuple(options.nodes)

    def describe(self) -> str:
        """One line for -v: 'build for rtx4090: int4 weights, avx512 CPU kernels, GPU budget 1.0 MiB (5% reserve),
        context 256, quality budget ...'."""
        gpu = (f", GPU budget {format_size(self.gpu.total_bytes)} ({self.gpu.reserve_fraction:.0%} reserve)"
               if self.target.has_gpu else "")
        return (f"build for {self.target.name}: {self.weight_dtype} weights"
                f"{' (keeping the source blocks)' if self.keep_source_blocks else ''}, {self.cpu_isa.name} CPU kernels"
                f"{gpu}, context {self.max_context}, quality budget {self.quality_budget.describe()}"
                + (f", split across {len(self.nodes)} nodes" if self.nodes else ""))

    @property
    def weight_dtype(self) -> str:
        """The CPU's weight format by its command-line name."""
        return self.weight_format.name


@dataclass
class Context:
    """What passes share that is not a fact about the model: the target, the working directory, the log,
    progress bars and files bound for the artifact. Facts ride on the IR (`passes.ir`)."""

    target: Target
    # Files a pass produces for the artifact (kernel libraries, plots): relative path -> bytes on disk.
    artifact_files: dict[str, Path] = field(default_factory=dict)
    workdir: Path | None = None
    log: Callable[[str], None] = lambda message: None
    # Where `warn` sends lines the user should see without -v (the CLI: stderr); None: to `log` like the rest
    warnings: Callable[[str], None] | None = None
    progress_bars: "ProgressBars | None" = None  # None: no bars
    build: BuildTarget | None = None  # what the build is for; None: resolved from `options` (default Options())
    options: InitVar[Options | None] = None  # only to resolve `build` (a pass never reads the options)

    def __post_init__(self, options: Options | None) -> None:
        if self.build is None:
            self.build = BuildTarget.resolve(options or Options(), self.target)
        elif options is not None:
            raise ValueError("a Context takes a resolved build or the options to resolve it from, not both")
        if self.build.target != self.target:
            raise ValueError(f"the build is for target {self.build.target.name}, the context's is {self.target.name}")

    def warn(self, message: str) -> None:
        """A line about the build the user should act on (say, too little calibration data), shown even
        without -v: to `warnings` where set, else logged."""
        (self.warnings or self.log)(message)

    def progress(self, description: str, total: int | None = None):
        """A progress bar for a pass's loop: `with ctx.progress("predict: training", layers) as advance:`
        then `advance()` per step (from any thread). A no-op where bars are off."""
        return (self.progress_bars or ProgressBars(False)).task(description, total)

    @staticmethod
    @contextlib.contextmanager
    def layer(index: int) -> Iterator[None]:
        """Work on one layer: an exception escaping the block is marked with the layer, which the pass
        manager's `PassError` then names (a mark on the exception, so it works from worker threads)."""
        try:
            yield
        except Exception as error:
            if getattr(error, "picompile_layer", None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    error.picompile_layer = index
            raise


@dataclass(frozen=True)
class Fact:
    """What a pass needs of the IR before it runs (its `requires`) or makes hold of it (its `adds`), as a check
    of the IR itself, so a pipeline built by hand (tests, `build(passes=...)`) is checked as the compiler's is.
    Each fact lives beside the pass that adds it (`added_by`)."""

    name: str
    added_by: str
    holds: Callable[[ir.Model], bool] = field(compare=False)


class FactError(ValueError):
    """A pass ran without a fact it requires, or did not make hold one it declares it adds."""


class Pass(Protocol):
    name: str
    # what the pass needs of the IR before it runs, and makes hold (class attributes; run_passes checks both)
    requires: tuple[Fact, ...] = ()
    adds: tuple[Fact, ...] = ()

    def apply(self, model: ir.Model, ctx: Context) -> PassResult: ...


def describe_pass(compiler_pass: Pass) -> str:
    """'partition(vram_budget_bytes=None, max_context=64, ...)': the pass's name and its fields."""
    settings = fields(compiler_pass) if is_dataclass(compiler_pass) else ()
    return f"{compiler_pass.name}({', '.join(f'{f.name}={getattr(compiler_pass, f.name)!r}' for f in settings)})"


class Hook:
    """Sees every pass: `before_passes` the list about to run (numbered from `first`), `before_pass` the
    IR going in, `after_pass` the result and the pass's seconds. The one way to watch a compilation:
    --dump-ir, -v, verification and the progress bars are hooks."""

    def before_passes(self, first: int, passes: list[Pass], ctx: Context) -> None:
        pass

    def before_pass(self, index: int, compiler_pass: Pass, model: ir.Model, ctx: Context) -> None:
        pass

    def after_pass(self, index: int, compiler_pass: Pass, result: PassResult, seconds: float, ctx: Context) -> None:
        pass


def run_passes(model: ir.Model, passes: list[Pass], ctx: Context, hooks: list[Hook] = (), first: int = 0) -> ir.Model:
    """Run `passes` in order, numbered from `first` (a build runs its pipeline in two stages, see
    `picompile.compiler.build`). An exception escaping a pass (TVM's, HiGHS's, torch's, a bug) comes out as a
    `PassError` naming the pass and, where the pass said which one it was in (`ctx.layer`), the layer;
    a `UserError` (bad input) passes through as it is. Each pass's `requires` are checked before it runs, its
    `adds` after, and the IR it returns against the declared ops (`passes.ops`): a `PassError` naming the
    pass and what is missing or wrong."""
    for hook in hooks:
        hook.before_passes(first, passes, ctx)
    for index, compiler_pass in enumerate(passes, first):
        missing = [fact for fact in getattr(compiler_pass, "requires", ()) if not fact.holds(model)]
        if missing:
            raise PassError(compiler_pass.name, None, FactError(
                "requires " + ", ".join(f"{fact.name} (added by {fact.added_by})" for fact in missing)
                + ", which the IR does not hold: a pass it needs did not run before it"))
        for hook in hooks:
            hook.before_pass(index, compiler_pass, model, ctx)
        started = time.perf_counter()
        try:
            result = compiler_pass.apply(model, ctx)
        except (UserError, PassError):
            raise
        except Exception as error:
            raise PassError(compiler_pass.name, getattr(error, "picompile_layer", None), error) from error
        seconds = time.perf_counter() - started
        model = result.model
        _check_result(compiler_pass, model)
        for hook in hooks:
            hook.after_pass(index, compiler_pass, result, seconds, ctx)
    return model


def _check_result(compiler_pass: Pass, model: ir.Model) -> None:
    """The IR a pass returned holds what the pass declares it adds, and every picompile op in it fits its
    declaration (a walk over the nodes: cheap enough for every build)."""
    unmet = [fact.name for fact in getattr(compiler_pass, "adds", ()) if not fact.holds(model)]
    if unmet:
        raise PassError(compiler_pass.name, None, FactError(
            f"declares it adds {', '.join(unmet)}, which the IR it returned does not hold"))
    for node, problems in ops.bad_nodes(model):
        layer = node.attributes.get("layer")
        layer = layer.value if layer is not None and layer.type == ir.AttributeType.INT else None
        raise PassError(compiler_pass.name, layer, ops.OpError(node, problems))


def op_counts(model: ir.Model) -> Counter:
    """Nodes of the main graph by op type (`domain.op` outside the default domain)."""
    return Counter(f"{node.domain}.{node.op_type}" if node.domain else node.op_type for node in model.graph)


def describe_change(before: Counter, after: Counter) -> str:
    """'212 -> 9 nodes (-MatMul 24, +picompile.FFN 2, ...)': node counts and the op types that changed."""
    changes = []
    for op in sorted(set(before) | set(after)):
        delta = after[op] - before[op]
        if delta:
            changes.append(f"{'+' if delta > 0 else '-'}{op} {abs(delta)}")
    detail = f" ({', '.join(changes)})" if changes else " (same op types)"
    return f"{sum(before.values())} -> {sum(after.values())} nodes{detail}"


class _CountNodes(Hook):
    """Remembers the op counts going into each pass (passes change the model in place)."""

    before: Counter = Counter()

    def before_pass(self, index, compiler_pass, model, ctx):
        self.before = op_counts(model)


class DumpIR(_CountNodes):
    """Write the IR after each pass as NN-name.onnx plus NN-name.txt (readable, weights left out), and
    list the passes in index.txt, one line each with its time and the node counts before and after."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def after_pass(self, index, compiler_pass, result, seconds, ctx):
        stem = f"{index:02d}-{compiler_pass.name}"
        pir.save(result.model, self.directory / f"{stem}.onnx")
        (self.directory / f"{stem}.txt").write_text(pir.to_text(result.model))
        change = describe_change(self.before, op_counts(result.model))
        with open(self.directory / "index.txt", "w" if index == 0 else "a") as index_file:
            index_file.write(f"{stem}.onnx  {compiler_pass.name}: {change}; {seconds * 1000:.1f} ms\n")


class LogTiming(_CountNodes):
    """-v: the passes about to run with their fields, then each pass with its time, what it did to the graph and
    its memory: the process's peak resident set during the pass and what stayed resident after it."""

    def before_passes(self, first, passes, ctx):
        for index, compiler_pass in enumerate(passes, first):
            ctx.log(f"plan {index:02d} {describe_pass(compiler_pass)}")

    def before_pass(self, index, compiler_pass, model, ctx):
        super().before_pass(index, compiler_pass, model, ctx)
        memory.reset_peak()

    def after_pass(self, index, compiler_pass, result, seconds, ctx):
        changed = describe_change(self.before, op_counts(result.model)) if result.modified else "unchanged"
        ctx.log(f"pass {index:02d} {compiler_pass.name:<10} {seconds * 1000:9.1f} ms  {changed}{_memory_note()}")


def _memory_note() -> str:
    """'; memory peak 1.20 GiB, 0.90 GiB after' (nothing where the OS does not say)."""
    peak, now = memory.peak_resident_bytes(), memory.resident_bytes()
    if peak is None or now is None:
        return ""
    # the two are read one after the other (and the kernel's high-water mark lags): a peak is at least what is now
    return f"; memory peak {format_size(max(peak, now))}, {format_size(now)} after"


class _VerifyOnnx(Hook):
    def after_pass(self, index, compiler_pass, result, seconds, ctx):
        """Every stage must stay a valid ONNX model (custom-domain ops are allowed)."""
        import onnx

        proto = ir.to_proto(result.model)
        # The check is about structure: weights become declared inputs, so their bytes need not be read.
        weights = list(proto.graph.initializer)
        del proto.graph.initializer[:]
        proto.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in weights)
        try:
            onnx.checker.check_model(proto, full_check=False)
        except onnx.checker.ValidationError as error:
            raise AssertionError(f"pass {compiler_pass.name} produced invalid ONNX: {error}") from error


verify_onnx = _VerifyOnnx()


class ProgressBars(Hook):
    """Progress bars on stderr (rich): one line for the passes, one per long loop inside a pass
    (`Context.progress`). Off (every call a no-op) unless `enabled`; `enabled_for_stderr` decides that
    from the terminal, --quiet and PICOMPILE_PROGRESS."""

    def __init__(self, enabled: bool, passes: int = 0, file=None):
        self.enabled = enabled
        self._passes = passes
        self._file = file
        self._progress = None
        self._pass_task = None

    @staticmethod
    def enabled_for_stderr(quiet: bool = False) -> bool:
        """Bars only where someone watches: stderr is a terminal and not --quiet. PICOMPILE_PROGRESS=1
        forces them on (0 off) whatever the terminal, e.g. for a test or a log that wants them."""
        forced = os.environ.get("PICOMPILE_PROGRESS", "")
        if quiet:
            return False
        if forced in ("0", "1"):
            return forced == "1"
        return sys.stderr.isatty()

    def __enter__(self) -> "ProgressBars":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

            forced = os.environ.get("PICOMPILE_PROGRESS") == "1"
            console = Console(file=self._file or sys.stderr, force_terminal=True if forced else None)
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), console=console)
            self._progress.start()
            if self._passes:
                self._pass_task = self._progress.add_task("passes", total=self._passes)
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    @contextlib.contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        """A bar for one loop; yields `advance(steps=1)` (thread-safe). total None: a spinner with the time."""
        if self._progress is None:
            yield lambda steps=1: None
            return
        task = self._progress.add_task(description, total=total)
        yield lambda steps=1: self._progress.advance(task, steps)
        # done (a failure leaves the bar where it stopped): full bar, the spinner stops
        self._progress.update(task, total=total or 1, completed=total or 1)

    def before_passes(self, first, passes, ctx):
        # a build learns its later passes from the sparsity mode: the bar grows to the passes known
        self._passes = max(self._passes, first + len(passes))
        if self._pass_task is not None:
            self._progress.update(self._pass_task, total=self._passes)
        elif self._progress is not None and self._passes:
            self._pass_task = self._progress.add_task("passes", total=self._passes)

    def before_pass(self, index, compiler_pass, model, ctx):
        if self._pass_task is not None:
            self._progress.update(self._pass_task, description=f"pass {compiler_pass.name}")

    def after_pass(self, index, compiler_pass, result, seconds, ctx):
        if self._pass_task is not None:
            self._progress.advance(self._pass_task)
