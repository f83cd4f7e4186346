"""The whole compilation on one screen: which passes run, in which order, and the build driver."""

from __future__ import annotations

import tempfile
from pathlib import Path

from passes.codegen import Codegen
from passes.import_onnx import Import, load
from passes.recognise import Recognise
from passes.schedule import Schedule

from . import artifact
from .pipeline import Context, Hook, Options, Pass, dump_ir, log_timing, run_passes, verify_onnx
from .targets import Target


def dense_pipeline() -> list[Pass]:
    return [Import(), Recognise(), Codegen(), Schedule()]


def pipeline(options: Options) -> list[Pass]:
    # The sparse passes (profile, partition, predict, lower) slot in between Recognise and Codegen.
    return dense_pipeline()


def build(model_path: Path, output: Path, target: Target, options: Options, *,
          dump_dir: Path | None = None, log=lambda message: None, verify: bool = False) -> Path:
    """Compile an ONNX decoder into an artifact directory; nothing is left at `output` if it fails."""
    model = load(model_path)
    hooks: list[Hook] = [log_timing]
    if dump_dir is not None:
        hooks.append(dump_ir(dump_dir))
    if verify:
        hooks.append(verify_onnx)
    with tempfile.TemporaryDirectory(prefix="picompile-build-") as workdir:
        ctx = Context(target=target, options=options, workdir=Path(workdir), log=log)
        lowered = run_passes(model, pipeline(options), ctx, hooks)
        return artifact.write(lowered, ctx, output, source=model_path)
