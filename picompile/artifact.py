"""The artifact writer: a directory, written under a temporary name and renamed only when complete.

Layout (format version 1):
  manifest.json         format, version, target, model facts, buffers, every file with its sha256
  schedule.json         the kernel-call DAG (networkx node-link JSON)
  kernels/cpu.so        TVM-generated CPU kernels
  weights/cpu.safetensors
The runtime (`runtime/`) reads it without importing any of the compiler.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
import shutil
import tempfile
from pathlib import Path

import onnx_ir as ir
import safetensors.numpy

from runtime.artifact import FORMAT, FORMAT_VERSION, sha256  # the reader defines the format

from . import __version__, costmodel
from . import ir as pir
from .pipeline import Context


def _model_facts(buffers: dict, schedule: dict) -> dict:
    logits = buffers["logits"]["shape"]
    caches = sorted(b for b in buffers if buffers[b]["kind"] == "cache")
    return {"vocab_size": logits[1], "max_context": logits[0], "num_layers": len(caches) // 2,
            "num_calls": len(schedule["nodes"])}


def _weights_by_device(schedule: dict, buffers: dict) -> dict[str, list[str]]:
    """Each weight goes to the file of every device whose calls read it (the CPU's when unused)."""
    devices: dict[str, set[str]] = {}
    for node in schedule["nodes"]:
        for arg in node["args"]:
            if buffers.get(arg, {}).get("kind") == "weight":
                devices.setdefault(arg, set()).add(node["device"])
    by_device: dict[str, list[str]] = {}
    for name, info in buffers.items():
        if info["kind"] == "weight":
            for device in sorted(devices.get(name, {"cpu"})):
                by_device.setdefault(device, []).append(name)
    return by_device


def write(model: ir.Model, ctx: Context, output: Path, source: Path | None = None) -> Path:
    buffers = json.loads(model.metadata_props["picompile.buffers"])
    schedule = json.loads(model.metadata_props["picompile.schedule"])
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        (staging / "weights").mkdir()
        for device, names in _weights_by_device(schedule, buffers).items():
            weights = {name: pir.const_array(model.graph.initializers[name]) for name in names}
            safetensors.numpy.save_file(weights, str(staging / "weights" / f"{device}.safetensors"))
        for relative, path in ctx.artifact_files.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, staging / relative)
        (staging / "schedule.json").write_text(json.dumps(schedule))
        files = {str(p.relative_to(staging)): sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "picompile_version": __version__,
            "target": {"name": ctx.target.name, "cpu_isa": ctx.cpu_isa.name, "cpu_features": list(ctx.cpu_isa.features),
                       "cuda_arch": ctx.target.cuda_arch},
            "model": {**_model_facts(buffers, schedule), "source": str(source) if source else None},
            "options": {"dense": ctx.options.dense, "max_context": ctx.options.max_context},
            "sparsity": json.loads(model.metadata_props.get("picompile.sparsity", "{}")),
            "io": {"inputs": ["input_ids", "start"], "outputs": ["logits"]},
            "buffers": buffers,
            "layers": json.loads(model.metadata_props.get("picompile.layers", "[]")),
            "placement": json.loads(model.metadata_props.get("picompile.placement", "{}")),
            "files": files,
        }
        manifest["estimate"] = asdict(costmodel.estimate(manifest, schedule, ctx.target, ctx.options.vram_budget_bytes))
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _replace_dir(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _replace_dir(staging: Path, output: Path) -> None:
    """Put the finished artifact in place; an existing one is swapped out, never left half-replaced."""
    if not output.exists():
        os.rename(staging, output)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.rmdir(old)
    os.rename(output, old)
    os.rename(staging, output)
    shutil.rmtree(old, ignore_errors=True)
