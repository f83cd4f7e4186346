"""The whole compilation on one screen: which passes run, in which order, and the build driver.

A build runs in two stages. The front passes lift the model and, unless --dense, decide its sparsity mode
(predictor for ReLU FFNs, threshold for SiLU/GELU ones: a fact about the model, recorded on the IR by the
sparsity pass); the mode then picks the rest. `pipeline(options, mode)` is the whole list for a mode,
exactly what a build in that mode runs, each pass given the options it reads as its fields.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import onnx_ir as ir

from passes import ir as pir
from passes import machine_rates, memory
from passes.awq import AWQ, AWQ_MIN_TOKENS, AWQ_TOKENS
from passes.compile import Compile
from passes.context import choose_context, trained_context
from passes.fuse import Fuse
from passes.handover import Handover
from passes.import_gguf import GGUFSource, ImportGGUF, rerounding_warning
from passes.import_onnx import Import, SourceQuantization, stored_weight_dtype
from passes.front_end import load
from passes.lower import LowerPredicted, LowerThresholded
from passes.partition import Partition
from passes.pipeline import (BuildTarget, Context, DumpIR, Hook, LogTiming, Options, Pass, ProgressBars, run_passes,
                             verify_onnx)
from passes.place import Place
from passes.plan_buffers import PlanBuffers
from passes.predict import Predict
from passes.profile import Profile
from passes.quality import QualityPlan
from passes.quantize import Quantize
from passes.recognise import Recognise
from passes.schedule import Schedule
from passes.select_kernels import SelectKernels
from passes.sparsity_mode import SparsityMode, sparsity_of
from passes.split_nodes import SplitNodes
from passes.targets import TARGETS, GpuBudget, Target, format_size
from passes.threshold import Threshold
from runtime.dtypes import AUTO_WEIGHT_DTYPE

from . import artifact

MODES = ("dense", "predictor", "threshold")


def front(options: Options, gguf: bool = False) -> list[Pass]:
    """What every build runs first: import (of a GGUF file's conversion where `gguf`), recognise and, unless
    --dense, the sparsity mode's choice."""
    passes = [ImportGGUF() if gguf else Import(), Recognise(), *([SplitNodes()] if options.nodes else [])]
    if not options.dense:
        passes.append(SparsityMode(requested=options.sparsity_mode, sparsity=options.sparsity))
    return passes


def rest(options: Options, mode: str, build: BuildTarget) -> list[Pass]:
    """What follows the front for `mode`: dense lowers every block as it is (an int8 / int4 one with awq
    profiles and scales channels first); predictor mode profiles, (awq) scales channels, trains predictors,
    places neurons and splits each FFN; threshold mode profiles, calibrates thresholds and
    lowers each FFN to thresholded ops (on the CPU: no placement); its levels (per linear input) and formats (per
    matrix) are the quality pass's, within --max-quality-loss. What the build is for (weight format, instruction
    set, GPU budget, context, quality budget) the passes read from `build` (`Context.build`), not their fields."""
    if (mode == "dense") != options.dense:
        raise ValueError(f"mode {mode!r} does not fit options.dense={options.dense}")
    profile = Profile(calib=options.calib, calib_tokens=options.calib_tokens, calib_samples=options.calib_samples,
                      tokenizer=options.tokenizer, seed=options.seed)
    awq = [AWQ(seed=options.seed)] if _activation_aware(options, build) else []
    # awq scales FFN inputs by their profiled magnitudes, so a dense build profiles for it alone: few tokens do
    # (no sampling unless asked, a warning only below AWQ_MIN_TOKENS)
    dense_profile = [Profile(calib=options.calib, calib_tokens=options.calib_tokens or AWQ_TOKENS,
                             calib_samples=options.calib_samples or 0, tokenizer=options.tokenizer,
                             seed=options.seed, wanted_tokens=AWQ_MIN_TOKENS, hold_out=False)] if awq else []
    # one placement of every block: a dense build's layers run dense, a sparse build's may (not with --all-neurons,
    # which checks the split, or --no-dense-fallback)
    partition = Partition(placement_batch=options.placement_batch, time_limit_s=options.placement_time_limit_s,
                          dense_ffns=options.dense_fallback and not options.all_neurons,
                          int8_dot=build.cpu_isa.int8_dot if options.int8_activations else None)
    sparse = {
        "dense": dense_profile + awq + [partition],
        "predictor": [profile, *awq,
                      Predict(target_recall=options.target_recall, param_share=options.predictor_param_share,
                              seed=options.seed, int8_activations=options.int8_activations),
                      QualityPlan(mode="predictor", lowest_recall=options.target_recall,
                                  int8_activations=options.int8_activations),
                      partition, LowerPredicted(all_neurons=options.all_neurons)],
        # --sparsity: one level for every FFN input (the threshold pass), measured; else a plan within the budget
        "threshold": [dataclasses.replace(profile, activations=options.sparsity is not None),
                      *([Threshold()] if options.sparsity is not None else []),
                      QualityPlan(method=options.quant_method, int8_activations=options.int8_activations),
                      LowerThresholded()],
    }[mode]
    return sparse + back(options, build, predictors=mode == "predictor")


def _activation_aware(options: Options, build: BuildTarget) -> bool:
    """Whether a build scales channels by their activations before it quantizes (--quant-method awq, int8 /
    int4 builds; the quantize pass refuses a method it does not know) of a model that did not come quantized in its
    own blocks (`keep_source_blocks`: their values are kept). Threshold mode never runs it: its kernels skip input
    channels by their magnitude, which a channel scale would change."""
    return options.quant_method == "awq" and build.weight_format.quantized and not build.keep_source_blocks


def back(options: Options, build: BuildTarget, predictors: bool = False) -> list[Pass]:
    """The back end, the same in every mode: fold the residuals, place each block on its device, quantize the
    CPU's matrices (int8 / int4 weights; the `predictors` of a float build), select its kernels, give each
    device its buffers, compile the kernels, order the calls."""
    quantized = build.weight_format.quantized or predictors
    quantize = [Quantize(method=options.quant_method)] if quantized else []
    # a model split across machines: the hand-over between stages, an op of the IR (passes/handover.py)
    handover = [Handover()] if options.nodes else []
    return [Fuse(), Place(), *handover, *quantize,
            SelectKernels(int8_activations=options.int8_activations, max_batch=options.max_batch),
            PlanBuffers(), Compile(), Schedule()]


def pipeline(options: Options, mode: str, target: Target = TARGETS["cpu"], gguf: bool = False) -> list[Pass]:
    """The whole compilation in `mode` ("dense", "predictor" or "threshold") for `target`: exactly the
    passes it runs (`gguf`: for a model loaded from a GGUF file), with `options`' weight dtype (not "auto").
    Which passes run does not depend on the GPU budget: `build` checks --vram-budget against the target it builds
    for, not here."""
    return front(options, gguf) + rest(options, mode, BuildTarget.resolve(options, target, gpu=GpuBudget(0)))


def mode_of(model: ir.Model, options: Options) -> str:
    """The mode of a model the front passes ran on: --dense, else what the sparsity pass recorded."""
    return "dense" if options.dense else sparsity_of(model).mode


def _warn_if_dequantized(model: ir.Model, ctx: Context) -> None:
    """A model that came block-quantized, built in a float format, keeps its values but not its size; built in a
    quantized format that cannot hold its blocks (asymmetric 4-bit ones in int4 or int8), it loses its values:
    say so. A GGUF file's: which of its matrices the build's format re-rounds, if any."""
    gguf = GGUFSource.of(model)
    if gguf is not None:
        line = rerounding_warning(gguf, ctx.build.weight_dtype, ctx.target.has_gpu, ctx.build.keep_source_blocks)
        if line is not None:
            ctx.warn(line)
        return
    source = SourceQuantization.of(model)
    if source is None:
        return
    bits = sorted({w.bits for w in source.weights})
    asymmetric = [w for w in source.weights if w.bits == 4 and not w.symmetric]
    keeps = "int4a" if asymmetric else f"int{bits[0]}"
    fmt = ctx.build.weight_format
    if not fmt.quantized:
        ctx.warn(f"the model's weights came {'/'.join(map(str, bits))}-bit quantized ({source.op}); this "
                 f"{fmt.name} build stores them dequantized, "
                 f"{'--weight-dtype ' + keeps + ' keeps their values' if len(bits) == 1 else ''}".rstrip(", "))
    elif asymmetric and not fmt.has_min:
        ctx.warn(f"{len(asymmetric)} of the model's 4-bit weights have zero points (a scale and a minimum per "
                 f"block); this {fmt.name} build re-rounds them to its own blocks (the quantize line "
                 "says by how much), --weight-dtype int4a keeps their values")


class ReleaseMappedPages(Hook):
    """After each pass, the pages of the user's memory-mapped weights that pass read leave the resident set
    (`passes.ir.release_mapped_pages`): the lifted IR's views into the file map them back when read."""

    def __init__(self, source: ir.Model):
        self.source = source

    def after_pass(self, index, compiler_pass, result, seconds, ctx):
        pir.release_mapped_pages(self.source)


def resolve_weight_dtype(options: Options, model: ir.Model, log=lambda message: None) -> Options:
    """`options` with weight_dtype "auto" replaced by the format the model stores its weights in (an fp16 file
    builds an fp16 artifact, not one twice its size); any other weight_dtype as it is."""
    if options.weight_dtype != AUTO_WEIGHT_DTYPE:
        return options
    gguf = GGUFSource.of(model)
    came_quantized = (gguf is not None and gguf.quantized()) or SourceQuantization.of(model) is not None
    resolved = dataclasses.replace(options, weight_dtype=gguf.weight_dtype() if gguf else stored_weight_dtype(model),
                                   keep_source_blocks=came_quantized)
    why = gguf.auto_reason() if gguf else "as the model stores its weights"
    log(f"weight dtype {resolved.weight_dtype} (auto: {why})")
    return resolved


def resolve_context(options: Options, model_path: Path, model: ir.Model, say=lambda message: None,
                    warn=lambda message: None, trained: tuple[int | None, str] | None = None,
                    gpu_bytes: int = 0) -> Options:
    """`options` with max_context None replaced by the model's trained context (`trained`, if read already: see
    `passes.context.trained_context`), capped by the KV memory budget (`passes.context`; `gpu_bytes`: a GPU
    target's budget); `say` gets the line naming the context, where it came from and its KV cache, `warn` what
    is wrong with an explicit one (past the trained context)."""
    choice = choose_context(model_path, model, options.max_context, trained, gpu_bytes)
    say(choice.line())
    warning = choice.warning()
    if warning is not None:
        warn(warning)
    return dataclasses.replace(options, max_context=choice.tokens)


def build(model_path: Path, output: Path, target: Target, options: Options, *,
          dump_dir: Path | None = None, log=lambda message: None, warn=None, verify: bool = False,
          passes: list[Pass] | None = None, progress: bool = False, say=None) -> Path:
    """Compile an ONNX decoder into an artifact directory; nothing is left at `output` if it fails, and an
    artifact already there stays whole until the new one replaces it. `progress` draws bars on stderr.
    `log` gets the passes' lines, `warn` (default: `log`) those the user should see anyway (`Context.warn`),
    `say` (default: `log`) the facts the user should see before the passes run (the context chosen).
    `passes` replaces the pipeline (run as given, in one stage)."""
    gpu = GpuBudget.resolve(target, options.vram_budget_bytes)  # refused before any work, not passes later
    artifact.check_output(output)
    memory.map_large_buffers()
    trained = trained_context(model_path)  # (a GGUF file's metadata: read before `load` drops the parsed reader)
    model = load(model_path)
    options = resolve_weight_dtype(options, model, log)
    options = resolve_context(options, model_path, model, say or log, warn or log, trained,
                              gpu.total_bytes if target.has_gpu else 0)
    # the cost model's CPU prices: this machine's kernels as measured (once per machine, cached)
    target = dataclasses.replace(target, cpu_rates=machine_rates.for_build(BuildTarget.cpu_isa_of(options, target),
                                                                           say or log))
    build_target = BuildTarget.resolve(options, target, gpu)  # what every pass reads: resolved once, here
    log(build_target.describe())
    hooks: list[Hook] = [ReleaseMappedPages(model), LogTiming()]  # released before -v reports what stayed
    if dump_dir is not None:
        hooks.append(DumpIR(dump_dir))
    if verify:
        hooks.append(verify_onnx)
    with tempfile.TemporaryDirectory(prefix="picompile-build-") as workdir, ProgressBars(progress) as bars:
        ctx = Context(target=target, build=build_target, workdir=Path(workdir), log=log, warnings=warn,
                      progress_bars=bars)
        hooks.append(bars)
        if passes is not None:
            lowered = run_passes(model, passes, ctx, hooks)
        else:
            first = front(options, gguf=GGUFSource.of(model) is not None)
            lifted = run_passes(model, first, ctx, hooks)
            if options.tokenizer is not None:  # before the long passes: another model's tokenizer is refused now
                from passes.tokenizer import check_vocabulary

                check_vocabulary(options.tokenizer, lifted.graph.initializers["embed.tokens"].shape[0])
            _warn_if_dequantized(lifted, ctx)
            lowered = run_passes(lifted, rest(options, mode_of(lifted, options), build_target), ctx, hooks,
                                 first=len(first))
        written = artifact.write(lowered, ctx, output, options, source=model_path)
    peak = memory.process_peak_bytes()
    if peak is not None:
        log(f"build peak memory {format_size(peak)} resident")
    return written
