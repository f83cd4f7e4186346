"""Bring your own model: the exporter x family matrix, half-precision inputs, external data.

Each row exports a tiny random ReLU model of one family with one exporter and builds it dense and (for the
SPARSE_EXPORTERS) sparse with every neuron admitted (`all_neurons`); each artifact must give onnxruntime's logits
on that same ONNX file (prompt, then decode steps) within 1e-4. Models are dense-random (about half the neurons
fire), made once per session; the optimum rows run optimum in its own environment, made before the run by
`python scripts/optimum_env.py` (the README's test command runs it); without it those rows fail, naming it.
No test installs anything.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import onnx
import pytest
import torch

from examples import models
from picompile.cli import main
from picompile.compiler import build
from passes.pipeline import Options
from passes.targets import get_target
from runtime.artifact import load_manifest
from runtime.calls import Role, schedule_calls
from test_sparse import assert_matches_onnxruntime  # the same check, prompt and tolerance

FAMILIES = ("opt", "llama", "llama_tied", "gpt2", "neox", "falcon")
EXPORTERS = ("dynamo", "legacy", "optimum", "ort_extended")
ROWS = [(exporter, family) for exporter in EXPORTERS for family in FAMILIES]
# The rows whose sparse build runs too. After recognise the block IR is the same whatever exported the graph (the
# dense build checks recognise, and the whole back end, on every row), so the sparse passes are checked on the two
# exporters people use most; the suite's time budget pays for the rest.
SPARSE_EXPORTERS = ("dynamo", "optimum")


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    """(exporter, family) -> ModelFiles. The same tiny models as the other test files (shared in a session);
    the optimum ones are exported together on first use (one start of the optimum environment); the
    onnxruntime-optimised ones are the dynamo exports saved again by onnxruntime."""
    made: dict = {}

    def get(exporter: str, family: str):
        if (exporter, family) in made:
            return made[exporter, family]
        if exporter == "optimum":
            families = [f for e, f in ROWS if e == "optimum"]
            made.update(zip([("optimum", f) for f in families],
                            models.cached_models([dict(family=f, exporter="optimum") for f in families])))
        elif exporter in models.ORT_LEVELS:
            base = tiny_models(family, "dynamo")
            target = tmp_path_factory.mktemp(f"{exporter}-{family}") / "model.onnx"
            made[exporter, family] = dataclasses.replace(base, onnx=models.ort_optimise(base.onnx, target, exporter))
        else:
            made[exporter, family] = tiny_models(family, exporter)
        return made[exporter, family]

    return get


def dense_and_all_neurons(onnx_path, calib, out_dir, **options):
    dense = build(onnx_path, out_dir / "dense.pic", get_target("cpu"), Options(dense=True, max_context=32, **options))
    sparse = build(onnx_path, out_dir / "sparse.pic", get_target("cpu"),
                   Options(max_context=32, calib=calib, calib_tokens=256, all_neurons=True, **options))  # 256 tokens: plenty to pass every neuron
    return dense, sparse


@pytest.mark.parametrize("exporter,family", ROWS)
def test_exported_model_compiles_and_matches_onnxruntime(exported, tmp_path, exporter, family):
    files = exported(exporter, family)
    if exporter.startswith("ort_"):  # what onnxruntime saved, not a plain export
        assert any(n.domain == "com.microsoft" or n.op_type == "SimplifiedLayerNormalization"
                   for n in onnx.load(str(files.onnx)).graph.node) or exporter == "ort_basic"
    if exporter not in SPARSE_EXPORTERS:
        dense = build(files.onnx, tmp_path / "dense.pic", get_target("cpu"), Options(dense=True, max_context=32))
        assert_matches_onnxruntime(dense, files.onnx, decode_steps=3)
        return
    dense, sparse = dense_and_all_neurons(files.onnx, files.calib, tmp_path)
    calls = schedule_calls(json.loads((sparse / "schedule.json").read_text()))
    assert any(call.role is Role.FFN and call.selection for call in calls)  # the sparse build runs neuron kernels
    for artifact in (dense, sparse):
        assert_matches_onnxruntime(artifact, files.onnx, decode_steps=3)


def test_optimum_rows_fail_naming_the_setup_step_when_its_environment_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOMPILE_OPTIMUM_VENV", str(tmp_path / "absent"))
    with pytest.raises(RuntimeError, match="is missing: run `python scripts/optimum_env.py` first"):
        models.export_optimum([(None, tmp_path / "out", None)])
    assert not (tmp_path / "absent").exists()  # refused, not installed on the spot


@pytest.fixture(scope="module")
def half_exports(tmp_path_factory):
    """A tiny LLaMA exported in fp16 and in bf16, and as fp32 with the same rounded weights (the reference:
    the compiler computes in fp32)."""
    directory = tmp_path_factory.mktemp("half")
    model, _ = models.build_model("llama")
    made = {}
    # the legacy exporter is the quicker one, but it cannot export bf16
    for name, dtype, exporter in (("fp16", torch.float16, "legacy"), ("bf16", torch.bfloat16, "dynamo")):
        model = model.to(dtype)
        half = models.export_onnx(model, directory / name, exporter)
        rounded = models.export_onnx(model.float(), directory / f"{name}-as-fp32", exporter)
        made[name] = (half, rounded)
    return made


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_models_compile_in_fp32(half_exports, tmp_path, precision):
    half, rounded = half_exports[precision]
    proto = onnx.load(str(half))
    half_type = getattr(onnx.TensorProto, {"fp16": "FLOAT16", "bf16": "BFLOAT16"}[precision])
    matrices = [t.data_type for t in proto.graph.initializer if len(t.dims) == 2]
    assert matrices.count(half_type) > len(matrices) // 2  # (the legacy export keeps a few in fp32)
    assert {i.type.tensor_type.elem_type for i in proto.graph.input if i.name.startswith("past")} == {half_type}
    artifact = build(half, tmp_path / "a.pic", get_target("cpu"), Options(dense=True, max_context=32))
    assert_matches_onnxruntime(artifact, rounded, decode_steps=3)
    if precision == "fp16":  # --weight-dtype fp16 stores the CPU's matrices in fp16: exactly the file's values
        stored = build(half, tmp_path / "f16.pic", get_target("cpu"),
                       Options(dense=True, max_context=32, weight_dtype="fp16"))
        assert load_manifest(stored).buffers["layers.0.ffn.w_up"].dtype == "float16"
        assert_matches_onnxruntime(stored, rounded, decode_steps=3)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_weights_stay_half_until_lowering(half_exports, precision):
    """Import keeps a half model's matrices as stored (behind a Cast to fp32) and recognise lifts them so:
    the block IR holds them at half the memory; only their small constants are widened."""
    import ml_dtypes
    import numpy as np

    from passes.import_onnx import Import
    from passes.front_end import load
    from passes.recognise import Recognise
    from passes import ir as pir
    from passes.pipeline import Context, run_passes

    half, _ = half_exports[precision]
    expected = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}[precision]
    imported = run_passes(load(half), [Import()], Context(get_target("cpu")))
    casts = [n for n in imported.graph if n.op_type == "Cast" and n.inputs[0].is_initializer()]
    assert casts and {n.inputs[0].const_value.dtype.numpy() for n in casts} == {expected}
    assert all(pir.const_array(n.outputs[0]).dtype == expected for n in casts)  # read through the Cast
    lifted = run_passes(imported, [Recognise()], Context(get_target("cpu"), options=Options(max_context=32)))
    ffn = pir.nodes_in_domain(lifted, "FFN")[0]
    assert pir.const_array(ffn.inputs[1]).dtype == pir.const_array(ffn.inputs[3]).dtype == expected
    assert pir.const_array(lifted.graph.initializers["embed.tokens"]).dtype == expected


def test_the_default_weight_dtype_is_the_files_own(half_exports, tmp_path):
    """--weight-dtype auto (the default) stores a half model's matrices in fp16, not in an fp32 copy twice the
    file's size; an fp32 model stays fp32 and an explicit choice stands."""
    from passes.import_onnx import stored_weight_dtype
    from passes.front_end import load
    from picompile.compiler import resolve_weight_dtype

    half, rounded = half_exports["fp16"]
    assert stored_weight_dtype(load(half_exports["bf16"][0])) == stored_weight_dtype(load(half)) == "fp16"
    assert stored_weight_dtype(load(rounded)) == "fp32"
    assert resolve_weight_dtype(Options(weight_dtype="fp32"), load(half)).weight_dtype == "fp32"
    assert main(["build", str(half), "-o", str(tmp_path / "a.pic"), "--dense", "--max-context", "32", "-q"]) == 0
    manifest = load_manifest(tmp_path / "a.pic")
    assert manifest.options.weight_dtype == "fp16"
    stored = {info.dtype for info in manifest.buffers.values() if info.kind == "weight" and len(info.shape) == 2}
    assert "float16" in stored


def test_a_half_models_sparse_rows_stay_half_through_lowering(half_exports, tmp_path):
    """lower gathers each FFN part's rows in the weights' stored precision: an fp16 model's stay fp16 (widened
    to fp32 there, a 7B build's lower pass held twice its weights)."""
    import numpy as np

    from passes.front_end import load
    from picompile import compiler
    from passes import ir as pir
    from passes.pipeline import Context, run_passes

    half, rounded = half_exports["fp16"]
    calib = models.write_tokens(tmp_path / "calib.npy", models.random_tokens(128, 8, 16, seed=0))
    options = Options(max_context=32, calib=calib, calib_samples=0, all_neurons=True)  # every layer split
    passes = compiler.pipeline(options, "predictor")
    through_lower = passes[: [p.name for p in passes].index("lower") + 1]
    lowered = run_passes(load(half), through_lower, Context(get_target("cpu"), workdir=tmp_path, options=options))
    sparse = pir.nodes_in_domain(lowered, "SparseFFN")
    assert sparse
    for node in sparse:
        up_rows, down_rows = pir.const_array(node.inputs[2]), pir.const_array(node.inputs[4])
        assert up_rows.dtype == down_rows.dtype == np.dtype(np.float16), node.name
    artifact = build(half, tmp_path / "a.pic", get_target("cpu"), options)  # fp32 storage: widened when held
    assert_matches_onnxruntime(artifact, rounded, decode_steps=3)


def test_external_data_model_compiles_and_the_artifact_stands_alone(exported, tmp_path):
    files = exported("legacy", "gpt2")
    source = tmp_path / "external"
    source.mkdir()
    onnx.save(onnx.load(str(files.onnx)), str(source / "model.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    assert (source / "weights.bin").stat().st_size > (source / "model.onnx").stat().st_size
    dense, sparse = dense_and_all_neurons(source / "model.onnx", files.calib, tmp_path)
    shutil.rmtree(source)  # the artifacts must not point back into the user's files
    for artifact in (dense, sparse):
        assert_matches_onnxruntime(artifact, files.onnx, decode_steps=3)


def test_unsupported_onnxruntime_op_is_refused_by_name(tmp_path, capsys):
    """GPT-2 with its own GELU (tanh form): onnxruntime's extended level fuses it into FastGelu."""
    import onnxruntime as ort
    import transformers

    config = models.make_config("gpt2", n_layer=1)
    config.activation_function = "gelu_new"
    torch.manual_seed(0)
    raw = models.export_onnx(transformers.GPT2LMHeadModel(config).eval(), tmp_path / "raw", "legacy")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "fused.onnx")
    ort.InferenceSession(str(raw), options, providers=["CPUExecutionProvider"])
    assert "FastGelu" in {n.op_type for n in onnx.load(str(tmp_path / "fused.onnx")).graph.node}
    assert main(["build", str(tmp_path / "fused.onnx"), "-o", str(tmp_path / "m.pic"), "--dense"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error:") and "FastGelu" in error and "Traceback" not in error
    assert not (tmp_path / "m.pic").exists()
