"""The whole compilation on one screen: which passes run, in which order, and the build driver."""

from __future__ import annotations

import tempfile
from pathlib import Path

from passes.compile import Compile
from passes.fuse import Fuse
from passes.import_onnx import Import, load
from passes.lower import Lower
from passes.partition import Partition
from passes.place import Place
from passes.plan_buffers import PlanBuffers
from passes.predict import Predict
from passes.profile import Profile
from passes.recognise import Recognise
from passes.schedule import Schedule
from passes.select_kernels import SelectKernels
from passes.sparsity_mode import SparsityMode
from passes.threshold import Threshold

from . import artifact
from .pipeline import Context, DumpIR, Hook, LogTiming, Options, Pass, ProgressBars, run_passes, verify_onnx
from .targets import Target, check_vram_budget


def pipeline(options: Options, target_cpu_isa: str = "avx2") -> list[Pass]:
    """The whole compilation. `--dense` stops after recognise and lowers every block densely. Otherwise
    sparsity-mode picks, per model, how decode skips FFN work: predictor mode (ReLU FFNs) runs predict and
    partition, threshold mode (SiLU/GELU FFNs) runs threshold; each of those passes leaves the IR alone in
    the other mode."""
    front = [Import(), Recognise()]
    sparse = [SparsityMode(), Profile(), Predict(), Threshold(), Partition(), Lower()]
    cpu_isa = options.cpu_isa or target_cpu_isa
    back = [Fuse(), Place(vram_budget_bytes=options.vram_budget_bytes, max_context=options.max_context),
            SelectKernels(max_context=options.max_context, weight_dtype=options.weight_dtype, cpu_isa=cpu_isa),
            PlanBuffers(), Compile(cpu_isa=cpu_isa), Schedule()]
    return front + ([] if options.dense else sparse) + back


def build(model_path: Path, output: Path, target: Target, options: Options, *,
          dump_dir: Path | None = None, log=lambda message: None, verify: bool = False,
          passes: list[Pass] | None = None, progress: bool = False) -> Path:
    """Compile an ONNX decoder into an artifact directory; nothing is left at `output` if it fails, and an
    artifact already there stays whole until the new one replaces it. `progress` draws bars on stderr."""
    check_vram_budget(target, options.vram_budget_bytes)  # refused before any work, not passes later
    artifact.check_output(output)
    model = load(model_path)
    passes = passes or pipeline(options, target.cpu_isa)
    hooks: list[Hook] = [LogTiming()]
    if dump_dir is not None:
        hooks.append(DumpIR(dump_dir))
    if verify:
        hooks.append(verify_onnx)
    with tempfile.TemporaryDirectory(prefix="picompile-build-") as workdir, \
            ProgressBars(progress, passes=len(passes)) as bars:
        ctx = Context(target=target, options=options, workdir=Path(workdir), log=log, progress_bars=bars)
        lowered = run_passes(model, passes, ctx, [*hooks, bars])
        return artifact.write(lowered, ctx, output, source=model_path)

