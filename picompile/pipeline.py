"""The pass manager: passes run in order over the IR; one callback hook sees the IR between passes.

A pass is a small object with a `name` and one `apply(model, ctx) -> PassResult` method. Printing
(`--dump-ir`), timing (`-v`) and verification all hang off the same hook, `after_pass`.
The pass lists themselves live in `picompile.compiler`, one screen to read the whole compilation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .targets import CpuIsa, Target, get_cpu_isa

__all__ = ["Context", "Pass", "PassResult", "run_passes", "dump_ir", "log_timing", "verify_onnx"]


@dataclass
class Options:
    """What the user asked for on the command line (or the Python API)."""

    dense: bool = False
    max_context: int = 256
    calib: Path | None = None
    vram_budget_bytes: int | None = None  # overrides the target's GPU memory
    calib_tokens: int = 4096  # how many calibration tokens the profile pass runs
    placement_batch: int = 64  # neurons per ILP variable (sorted by frequency, then grouped)
    placement_time_limit_s: float = 30.0
    predictor_param_share: float = 0.10  # cap on all predictors together, as a share of the model's parameters
    target_recall: float = 0.99  # the threshold of each predictor is set to reach this on held-out tokens
    all_neurons: bool = False  # lower sparse but let every neuron pass the predictor (checks the split)
    weight_dtype: str = "fp32"  # storage of the CPU's weight matrices: fp32 or fp16 (converted in registers)
    cpu_isa: str | None = None  # the CPU kernels' instruction set (targets.CPU_ISAS); None: the target's
    # How decode skips FFN work: "predictor" (PowerInfer: a trained predictor picks the neurons, for ReLU FFNs),
    # "threshold" (TEAL: inputs of each projection below a calibrated magnitude are dropped, for SiLU/GELU
    # FFNs) or "auto" (by the model's FFN activation; passes.sparsity_mode).
    sparsity_mode: str = "auto"
    sparsity: float | None = None  # threshold mode: share of each projection's inputs dropped (None: the default)
    seed: int = 0


@dataclass
class Context:
    """What passes share besides the IR: the target, the options, and files bound for the artifact."""

    target: Target
    options: Options = field(default_factory=Options)
    # Files a pass produces for the artifact (kernel libraries, plots): relative path -> bytes on disk.
    artifact_files: dict[str, Path] = field(default_factory=dict)
    # Profiled activations, too large for the IR: layer -> (FFN inputs [tokens, d_model] float32,
    # active neurons [tokens, ffn] bool). Written by the profile pass, read by the predict and threshold passes.
    profile: dict[int, tuple] = field(default_factory=dict)
    # The sparsity mode in force (set by the sparsity pass from Options.sparsity_mode): "predictor" or
    # "threshold", with the sparsity (threshold mode) and the reason it was chosen.
    sparsity: dict = field(default_factory=dict)
    # The imported (pre-recognise) model, which the reference executor runs while profiling.
    source: object | None = None
    workdir: Path | None = None
    log: Callable[[str], None] = lambda message: None

    @property
    def cpu_isa(self) -> CpuIsa:
        return get_cpu_isa(self.options.cpu_isa or self.target.cpu_isa)


class Pass(Protocol):
    name: str

    def apply(self, model: ir.Model, ctx: Context) -> PassResult: ...


Hook = Callable[[int, Pass, PassResult, float, Context], None]


def run_passes(model: ir.Model, passes: list[Pass], ctx: Context, hooks: list[Hook] = ()) -> ir.Model:
    for index, compiler_pass in enumerate(passes):
        started = time.perf_counter()
        result = compiler_pass.apply(model, ctx)
        seconds = time.perf_counter() - started
        model = result.model
        for hook in hooks:
            hook(index, compiler_pass, result, seconds, ctx)
    return model


def dump_ir(directory: Path) -> Hook:
    """Write the IR after each pass as NN-name.onnx plus NN-name.txt (readable, weights left out)."""

    def hook(index: int, compiler_pass: Pass, result: PassResult, seconds: float, ctx: Context) -> None:
        stem = f"{index:02d}-{compiler_pass.name}"
        pir.save(result.model, directory / f"{stem}.onnx")
        (directory / f"{stem}.txt").write_text(pir.to_text(result.model))

    return hook


def log_timing(index: int, compiler_pass: Pass, result: PassResult, seconds: float, ctx: Context) -> None:
    changed = "changed" if result.modified else "unchanged"
    ctx.log(f"pass {index:02d} {compiler_pass.name:<10} {seconds * 1000:9.1f} ms  {changed}, "
            f"{len(result.model.graph)} nodes")


def verify_onnx(index: int, compiler_pass: Pass, result: PassResult, seconds: float, ctx: Context) -> None:
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
