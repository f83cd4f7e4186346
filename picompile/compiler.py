"""The whole compilation on one screen: which passes run, in which order, and the build driver."""

from __future__ import annotations

import tempfile
from pathlib import Path

from passes.codegen import Codegen
from passes.import_onnx import Import, load
from passes.lower import Lower
from passes.partition import Partition
from passes.predict import Predict
from passes.profile import Profile
from passes.recognise import Recognise
from passes.schedule import Schedule
from passes.sparsity_mode import SparsityMode
from passes.threshold import Threshold

from . import artifact
from .pipeline import Context, Hook, Options, Pass, dump_ir, log_timing, run_passes, verify_onnx
from .targets import Target


def pipeline(options: Options) -> list[Pass]:
    """The whole compilation. `--dense` stops after recognise and lowers every block densely. Otherwise
    sparsity-mode picks, per model, how decode skips FFN work: predictor mode (ReLU FFNs) runs predict and
    partition, threshold mode (SiLU/GELU FFNs) runs threshold; each of those passes leaves the IR alone in
    the other mode."""
    front = [Import(), Recognise()]
    sparse = [SparsityMode(), Profile(), Predict(), Threshold(), Partition(), Lower()]
    back = [Codegen(), Schedule()]
    return front + ([] if options.dense else sparse) + back


def build(model_path: Path, output: Path, target: Target, options: Options, *,
          dump_dir: Path | None = None, log=lambda message: None, verify: bool = False,
          passes: list[Pass] | None = None) -> Path:
    """Compile an ONNX decoder into an artifact directory; nothing is left at `output` if it fails."""
    model = load(model_path)
    hooks: list[Hook] = [log_timing]
    if dump_dir is not None:
        hooks.append(dump_ir(dump_dir))
    if verify:
        hooks.append(verify_onnx)
    with tempfile.TemporaryDirectory(prefix="picompile-build-") as workdir:
        ctx = Context(target=target, options=options, workdir=Path(workdir), log=log)
        lowered = run_passes(model, passes or pipeline(options), ctx, hooks)
        return artifact.write(lowered, ctx, output, source=model_path)
