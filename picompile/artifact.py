"""The artifact writer: a directory, written under a temporary name and renamed only when complete.

Layout (format version 2):
  manifest.json         format, version, target, model facts, buffers, every file with its sha256, and
                        `manifest_sha256`, the digest of the rest of the manifest (canonical JSON)
  schedule.json         the kernel-call DAG (networkx node-link JSON)
  kernels/cpu.so        TVM-generated CPU kernels
  kernels/signatures.json  each kernel's argument shapes and types (the runtime checks the buffers against them)
  weights/cpu.safetensors
  tokenizer/            the model's tokenizer files, when the build found them (runtime/text.py reads them)
The runtime (`runtime/`) reads it without importing any of the compiler.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
from dataclasses import asdict
import shutil
import struct
import tempfile
from pathlib import Path

import onnx_ir as ir
import numpy as np

from passes import costmodel
from passes import ir as pir
from passes.errors import UserError
from passes.kernel_ir import Buffers
from passes.partition import PlacementReport
from passes.pipeline import Context, Options
from passes.schedule import CallSchedule
from passes.select_kernels import BatchPhase
from runtime import dtypes
from runtime.artifact import FORMAT, FORMAT_VERSION, seal_manifest, sha256  # the reader defines the format
from runtime.calls import schedule_calls
from runtime.manifest import IO, Buffer, BuildOptions, Manifest, ModelFacts, TargetFacts, TokenizerListing
from runtime.text import TOKENIZER_DIR

from . import __version__


def write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file written tensor by tensor from the arrays as they are (safetensors' own writer first
    joins every tensor's bytes in memory: a second copy of the model's weights)."""
    header, offset = {}, 0
    for name, array in tensors.items():
        dtype = dtypes.get_dtype(array.dtype.name)
        header[name] = {"dtype": dtype.safetensors, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the format asks
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in tensors.values():
            f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))


def _model_facts(buffers: dict, schedule: dict, max_batch: int, source: Path | None) -> ModelFacts:
    logits = buffers["logits"]["shape"]
    caches = sorted(b for b in buffers if buffers[b]["kind"] == "cache")
    # the KV caches' length ([heads, max_context, head_dim]); the logits hold a step's rows, at most that
    return ModelFacts(vocab_size=logits[1], max_context=buffers[caches[0]]["shape"][1], num_layers=len(caches) // 2,
                      num_calls=len(schedule["nodes"]), max_batch=max_batch, source=str(source) if source else None)


def _weights_by_device(schedule: dict, buffers: dict, split: bool = False) -> dict[str, list[str]]:
    """Each weight goes to the file of every device whose calls read it (the CPU's when unused): file name (without
    .safetensors) -> its weights. A model split across machines (`split`) has a file per stage and device,
    `stage{k}.{device}`, so that each machine reads (and checks) only its own weights; a weight two stages read (a
    tied embedding and output layer) is in both."""
    devices: dict[str, set[str]] = {}
    for call in schedule_calls(schedule):
        for name in call.buffers():
            if buffers.get(name, {}).get("kind") == "weight":
                devices.setdefault(name, set()).add(f"stage{call.stage}.{call.device}" if split else call.device)
    by_device: dict[str, list[str]] = {}
    for name, info in buffers.items():
        if info["kind"] == "weight":
            for device in sorted(devices.get(name, {"stage0.cpu" if split else "cpu"})):
                by_device.setdefault(device, []).append(name)
    return by_device


def check_output(output: Path) -> None:
    """Building replaces `output` whole: refuse unless it is absent, an empty directory, or an artifact."""
    output = Path(output)
    for parent in output.parents:  # the nearest existing ancestor must be a directory to build in
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UserError(f"output {output} cannot be made: {parent} is a file, not a directory; choose another -o")
            break
    if output.is_symlink() or (output.exists() and not output.is_dir()):
        raise UserError(f"output {output} is a file, not an artifact directory; choose another -o")
    if output.is_dir() and any(output.iterdir()) and not (output / "manifest.json").is_file():
        raise UserError(f"output {output} is a directory that is not a picompile artifact; refusing to replace it")


def write(model: ir.Model, ctx: Context, output: Path, options: Options, source: Path | None = None) -> Path:
    # the passes' facts the manifest carries (imported here: `inspect --report` imports this module for
    # current_umask, and must not load torch with the quality pass)
    from passes.lower import layers_of
    from passes.place import devices_of
    from passes.profile import calibration_of
    from passes.quality import quality_of
    from passes.quantize import quantization_of
    from passes.sparsity_mode import KEY as SPARSITY_KEY, sparsity_of
    from passes.split_nodes import NodeSplit

    check_output(output)
    cpu_isa = ctx.build.cpu_isa
    buffers, schedule = Buffers.of(model).entries, CallSchedule.of(model).node_link
    placed = PlacementReport.of(model)
    split = NodeSplit.of(model)  # a model split across machines (--nodes), else None
    output = Path(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # no permission, a read-only file system, ...
        raise UserError(f"output {output} cannot be made: creating {output.parent} failed "
                        f"({error.strerror or type(error).__name__})") from None
    staging = _staging_dir(output)
    try:
        (staging / "weights").mkdir()
        for device, names in _weights_by_device(schedule, buffers, split=split is not None).items():
            weights = {name: pir.const_array(model.graph.initializers[name]) for name in names}
            write_safetensors(weights, staging / "weights" / f"{device}.safetensors")
        for relative, path in ctx.artifact_files.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, staging / relative)
        (staging / "schedule.json").write_text(json.dumps(schedule))
        if options.tokenizer is not None:
            (staging / TOKENIZER_DIR).mkdir()
            for name in options.tokenizer.names:
                shutil.copyfile(options.tokenizer.directory / name, staging / TOKENIZER_DIR / name)
        files = {str(p.relative_to(staging)): sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        manifest = Manifest(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            picompile_version=__version__,
            target=TargetFacts(name=ctx.target.name, cpu_isa=cpu_isa.name, cpu_features=list(cpu_isa.features),
                               cuda_arch=ctx.target.cuda_arch),
            model=_model_facts(buffers, schedule, BatchPhase.of(model).max_batch, source),
            options=BuildOptions(dense=options.dense, max_context=options.max_context, weight_dtype=options.weight_dtype),
            sparsity=sparsity_of(model) if SPARSITY_KEY in model.metadata_props else None,
            io=IO(inputs=["input_ids", "start"], outputs=["logits"]),
            buffers={name: Buffer.from_json(info) for name, info in buffers.items()},
            layers=layers_of(model),
            calibration=calibration_of(model),
            quantization=quantization_of(model),
            quality=quality_of(model),
            placement=placed.to_json() if placed is not None else {},
            devices=devices_of(model),
            tokenizer=(TokenizerListing(source=str(options.tokenizer.directory),
                                        files=[f"{TOKENIZER_DIR}/{name}" for name in options.tokenizer.names])
                       if options.tokenizer is not None else None),
            files=files,
        )
        manifest.stages = split.stages if split is not None else []
        manifest.estimate = asdict(costmodel.estimate(manifest, schedule, ctx.target,
                                                      placed.prices() if placed is not None else None))
        (staging / "manifest.json").write_text(json.dumps(seal_manifest(manifest.to_json()), indent=1))
        _replace_dir(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _staging_dir(output: Path) -> Path:
    """A new, empty `.NAME.tmp-PID-XXXX` beside the output: same file system (so renames are atomic), hidden,
    never a valid artifact (no manifest until complete), and it names its builder so a later build can
    tell a dead build's leftovers from a running one's."""
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.parent))
    os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp makes it private; the artifact is an ordinary directory
    return staging


def current_umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):  # old kernel, or a file system without it
        return False
    raise OSError(error, os.strerror(error), str(b))


def _replace_dir(staging: Path, output: Path) -> None:
    """Put the finished artifact in place. An existing one is exchanged with the staging directory in one
    atomic step, so a build killed at any moment leaves the old artifact or the new one at `output`, never
    neither and never a mix; the old one, now under the staging name, is then deleted. Where the exchange
    is unsupported (not Linux, or the file system lacks it) the fallback is two renames, with a window of
    microseconds in which `output` is absent (the old artifact is then in `.NAME.old-*`)."""
    if not output.exists():
        os.rename(staging, output)  # atomic; fails rather than merge if another build got there first
    elif _exchange(staging, output):
        shutil.rmtree(staging, ignore_errors=True)
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-{os.getpid()}-", dir=output.parent))
        os.rmdir(old)
        os.rename(output, old)
        os.rename(staging, output)
        shutil.rmtree(old, ignore_errors=True)
    remove_stale(output)


def remove_stale(output: Path) -> list[Path]:
    """Delete what killed builds of `output` left beside it (`.NAME.tmp-PID-*`, `.NAME.old-PID-*` whose
    process is gone); a running build's staging directory is left alone. Returns what was removed."""
    removed = []
    for path in output.parent.glob(f".{glob.escape(output.name)}.*-*-*"):
        kind, _, rest = path.name[len(output.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
