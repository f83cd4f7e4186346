"""The compiler-runtime contract: each call's facts (runtime/calls.py) are what the runtime counts, the cost
model prices and placement decides, and a dense GPU build stays inside its GPU budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from passes import costmodel
from picompile.compiler import build
from passes.pipeline import Options
from runtime import Engine, load_manifest
from runtime.calls import Access, Arg, Call, Role, Selection, schedule_calls
from runtime.dtypes import itemsize
from test_sparse import assert_matches_onnxruntime, sparse_build
from tiny_targets import SLOW_CPU_RTX4090


def test_call_facts_round_trip_through_json():
    call = Call("layers.1.ffn.sparse.cpu.up_down", "cpu", Role.FFN, "sparse_ffn_decode", "",
                (Arg("x"), Arg("w", Access.SELECTED_ROWS, row_bytes=64, nonzero_row_bytes=32), Arg("out", Access.WRITE)),
                layer=1, selection=Selection("predictor", "cpu", "count", 40, "hidden"))
    again = Call.from_json(json.loads(json.dumps(call.to_json())))
    assert again == call
    assert again.reads() == ["x", "w"] and again.writes() == ["out"]
    with pytest.raises(ValueError):
        Call.from_json({**call.to_json(), "role": "teleport"})


@pytest.fixture(scope="module")
def sparse_artifact(tiny_models, tmp_path_factory):
    files = tiny_models("opt", sparsity=0.9)
    return files, sparse_build(files, tmp_path_factory.mktemp("contract") / "s.pic")


def test_cost_model_and_runtime_count_the_same_bytes_for_every_call(sparse_artifact):
    """After each decode step, every call's weight bytes as the runtime counts them (its bound step, reading
    the count and hidden buffers the kernels wrote) equal the cost model's for the same selections."""
    _, artifact = sparse_artifact
    engine = Engine(artifact)
    assert any(call.selection is not None for call in engine.calls)  # there are selections to compare
    engine.forward([11, 22, 33])
    for token in (4, 5, 6):
        engine.forward([token])
        assert costmodel.byte_disagreements(engine) == []
    # the check can fail: a count the cost model would read differently is caught
    broken = next(step for step in engine.decode_steps if step.count is not None and int(step.count[0, 0]) > 0)
    broken.bytes_per_count += 1
    assert costmodel.byte_disagreements(engine) == [broken.name]


def test_dense_gpu_build_honours_the_vram_budget(tiny_models, tmp_path):
    """--dense for a GPU target: placement's plan holds every layer when the model fits, some blocks when only some
    fit (their GPU weights within the budget), nothing at a zero budget; the split runs (emulated) and matches
    onnxruntime."""
    files = tiny_models("opt")

    def dense(budget, name):
        artifact = build(files.onnx, tmp_path / name, SLOW_CPU_RTX4090,
                         Options(dense=True, max_context=64, vram_budget_bytes=budget))
        manifest = load_manifest(artifact)
        calls = [call for call in schedule_calls(json.loads((artifact / "schedule.json").read_text()))
                 if call.role is not Role.COPY]
        return artifact, manifest, calls

    def gpu_weight_bytes(manifest, calls):
        names = {name for call in calls if call.device == "gpu" for name in call.buffers()
                 if manifest.buffers[name].kind == "weight"}
        return sum(np.prod(manifest.buffers[n].shape) * itemsize(manifest.buffers[n].dtype) for n in names)

    _, manifest, calls = dense(None, "all.pic")
    layers = manifest.model.num_layers
    assert {call.layer for call in calls if call.device == "gpu"} >= set(range(layers))
    model_bytes = manifest.placement["used_bytes"]  # (the placement report: typed by its own pass)

    _, manifest, calls = dense(0, "none.pic")
    assert {call.device for call in calls} == {"cpu"}

    budget = int(0.4 * model_bytes)
    artifact, manifest, calls = dense(budget, "some.pic")
    on_gpu = {call.layer for call in calls if call.device == "gpu"} - {None}
    assert on_gpu == set(manifest.devices.gpu_layers) and 0 < len(on_gpu)
    assert {call.device for call in calls} == {"cpu", "gpu"}
    assert gpu_weight_bytes(manifest, calls) <= manifest.placement["used_bytes"] <= budget
    assert_matches_onnxruntime(artifact, files.onnx, emulate_gpu=True, decode_steps=3)
