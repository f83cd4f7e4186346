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

from . import artifact
from .pipeline import Context, Hook, Options, Pass, dump_ir, log_timing, run_passes, verify_onnx
from .errors import UserError
from .targets import Target, check_vram_budget


def pipeline(options: Options) -> list[Pass]:
    """The whole compilation. `--dense` stops after recognise and lowers every block densely."""
    front = [Import(), Recognise()]
    sparse = [Profile(), Predict(), Partition(), Lower()]
    back = [Codegen(), Schedule()]
    return front + ([] if options.dense else sparse) + back


def build(model_path: Path, output: Path, target: Target, options: Options, *,
          dump_dir: Path | None = None, log=lambda message: None, verify: bool = False,
          passes: list[Pass] | None = None) -> Path:
    """Compile an ONNX decoder into an artifact directory; nothing is left at `output` if it fails."""
    check_vram_budget(target, options.vram_budget_bytes)  # refused before any work, not passes later
    _check_output(Path(output))
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


def _check_output(output: Path) -> None:
    """The artifact replaces `output` when done: refuse a path that holds something else (a file, a directory
    of the user's) rather than swap it out and delete it."""
    if output.exists() and not (output.is_dir() and (output / "manifest.json").is_file()):
        kind = "a directory that is not a picompile artifact" if output.is_dir() else "a file"
        raise UserError(f"-o {output} is {kind}; choose a new path (an existing artifact is replaced)")
