"""Helpers for scripts/gpu_check.sh's whole-model checks (they run on a CPU too; GPU_CHECK_CPU=1 uses them there).

    python scripts/gpu_check.py model FAMILY PRESET[:KEY=VALUE,...]
                                                            -> "name onnx calib heldout weight_bytes" (makes or reuses the
                                                               model; KEY=VALUE override config fields, e.g. layers)
    python scripts/gpu_check.py devices ARTIFACT            -> the devices its calls run on, e.g. "cpu gpu"
    python scripts/gpu_check.py budgets ARTIFACT            -> "vram_24gb vram_11gb": --vram-budget values (bytes)
                                                               emulating those cards, from a GPU build's placement
    python scripts/gpu_check.py check-eval EVAL_JSON        -> one line; exit 1 if max diff > 1e-3 or top-1 < 0.99
    python scripts/gpu_check.py table WORKDIR LABEL...      -> the decode speed table of WORKDIR/LABEL.{pic,run.json,eval.json}
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_LOGIT_DIFF = 1e-3  # all-neurons builds compute every neuron: only float rounding may differ
MIN_TOP1 = 0.99
# The share of the FFN weights a card holds once the dense part (attention, embeddings, head), the KV cache and
# the reserve are in: for LLaMA(ReGLU)-13B in fp16 (dense ~9 GB, FFN ~17 GB), a 24 GB card keeps ~80% of the
# FFN on the GPU and an 11 GB card ~6%. The emulated budgets give the small model the same shares.
CARD_FFN_SHARES = {"24GB": 0.80, "11GB": 0.06}


def model(family: str, spec: str) -> str:
    import onnx

    from examples.models import cached_model

    preset, _, overrides = spec.partition(":")
    fields = {key: json.loads(value) for key, _, value in (item.partition("=") for item in overrides.split(",") if item)}
    files = cached_model(family, preset=preset, sparsity=0.9, **fields)
    graph = onnx.load(str(files.onnx), load_external_data=False).graph
    weight_bytes = sum(math.prod(t.dims) * 4 for t in graph.initializer if len(t.dims) >= 2)  # the fp32 matrices
    layers = fields.get("num_hidden_layers")
    name = f"{preset}-{layers}L" if layers else preset if not fields else f"{preset}-custom"
    return f"{name} {files.onnx} {files.calib} {files.heldout} {weight_bytes}"


def devices(artifact: str) -> str:
    from runtime.calls import schedule_calls

    schedule = json.loads((Path(artifact) / "schedule.json").read_text())
    return " ".join(sorted({call.device for call in schedule_calls(schedule)}))


def budgets(artifact: str) -> str:
    """The --vram-budget (bytes) that leaves each card's FFN share after the dense part, KV cache and reserve,
    as partition computes them (budget = vram - dense - kv - reserve_fraction x vram), from a build that holds
    the whole model on the GPU: its GPU weights read by FFN calls are the FFN's bytes, the others and the KV
    caches the fixed part."""
    from passes.partition import PlacementReport
    from runtime import load_manifest
    from runtime.calls import Role, schedule_calls
    from runtime.dtypes import nbytes

    directory = Path(artifact)
    manifest = load_manifest(directory, check_hashes=False)
    calls = [call for call in schedule_calls(json.loads((directory / "schedule.json").read_text()))
             if call.device == "gpu"]
    size = lambda name: nbytes(manifest.buffers[name].shape, manifest.buffers[name].dtype)  # noqa: E731
    weights = lambda roles: {name for call in calls if call.role in roles for name in call.buffers()  # noqa: E731
                             if manifest.buffers[name].kind == "weight"}
    ffn_roles = {Role.FFN, Role.FFN_UP, Role.FFN_DOWN}  # the neurons' rows; predictors stay with the fixed part
    ffn = weights(ffn_roles)
    fixed = (sum(size(name) for name in weights(set(Role) - ffn_roles) - ffn)
             + sum(size(name) for name, info in manifest.buffers.items() if info.kind == "cache"))
    report = PlacementReport.from_json(manifest.placement)
    reserve_fraction = report.reserve_bytes / report.vram_bytes
    return " ".join(str(math.ceil((fixed + share * sum(size(name) for name in ffn)) / (1 - reserve_fraction)))
                    for share in CARD_FFN_SHARES.values())


def check_eval(path: str) -> int:
    report = json.loads(Path(path).read_text())
    diff, top1 = report["max_abs_logit_diff"], report["top1_agreement"]
    ok = diff <= MAX_LOGIT_DIFF and top1 >= MIN_TOP1
    print(f"{'ok' if ok else 'FAILED'}: max |logit diff| {diff:.2e} (limit {MAX_LOGIT_DIFF:g}), top-1 {top1:.4f} "
          f"(limit {MIN_TOP1}), KL {report['kl_mean']:.2e}, {report['positions']} positions")
    return 0 if ok else 1


def table(workdir: str, labels: list[str]) -> str:
    """One row per build: its placement, decode tokens/s measured (best of the runs) and estimated, quality."""
    rows = [("build", "target", "VRAM budget", "GPU weights", "FFN activity on GPU", "devices", "decode tok/s",
             "estimate", "top-1", "KL")]
    from passes.partition import PlacementReport
    from runtime import load_manifest
    from runtime.artifact import format_size
    from runtime.calls import schedule_calls
    from runtime.dtypes import nbytes

    for label in labels:
        base = Path(workdir) / label
        manifest = load_manifest(base.with_suffix(".pic"), check_hashes=False)
        schedule = json.loads((base.with_suffix(".pic") / "schedule.json").read_text())
        gpu_args = {name for call in schedule_calls(schedule) if call.device == "gpu" for name in call.buffers()}
        runs = [json.loads(line) for line in base.with_suffix(".run.json").read_text().splitlines() if line.strip()]
        quality = json.loads(base.with_suffix(".eval.json").read_text())
        placement = PlacementReport.from_json(manifest.placement) if manifest.placement else None
        estimate = manifest.estimate or {}
        gpu_bytes = sum(nbytes(info.shape, info.dtype) for name, info in manifest.buffers.items()
                        if info.kind == "weight" and name in gpu_args)
        rows.append((label, manifest.target.name,
                     format_size(placement.vram_bytes) if placement and manifest.target.cuda_arch else "-",
                     format_size(gpu_bytes), f"{placement.activation_share if placement else 0:.1%}",
                     devices(str(base.with_suffix(".pic"))),
                     f"{max(run['decode_tokens_per_s'] for run in runs):.1f}",
                     f"{estimate.get('picompile_tokens_per_s', 0):.1f}",
                     f"{quality['top1_agreement']:.4f}", f"{quality['kl_mean']:.2e}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)) for row in rows)


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "model":
        print(model(*args))
    elif command == "devices":
        print(devices(*args))
    elif command == "budgets":
        print(budgets(*args))
    elif command == "check-eval":
        return check_eval(*args)
    elif command == "table":
        print(table(args[0], args[1:]))
    else:
        raise SystemExit(f"unknown command {command!r}; see the docstring")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
