"""The sparse pipeline end to end: profile, predict, partition, lower, hybrid schedule."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest

from passes import costmodel, placement
from passes.partition import PlacementReport
from picompile.cli import main
from picompile.compiler import build, pipeline
from passes.errors import UserError
from passes.pipeline import Options
from passes.reference import OrtDecoder
from passes.targets import get_target
from runtime import Engine, generate, load_manifest
from runtime.artifact import seal_manifest
from runtime.calls import Role, schedule_calls
from tiny_targets import SLOW_CPU_RTX4090


def sparse_build(files, out, target="cpu", pass_fields=None, **options):
    """A predictor-mode build for `target` (a name or a Target); `pass_fields` changes some passes' fields, by
    pass name."""
    opts = Options(max_context=64, calib=files.calib, **options)
    target = get_target(target) if isinstance(target, str) else target
    passes = [dataclasses.replace(p, **(pass_fields or {}).get(p.name, {}))
              for p in pipeline(opts, "predictor", target)]
    artifact = build(files.onnx, out, target, opts, passes=passes)
    assert_estimate_is_the_placements(artifact, baselines_allowed=not opts.all_neurons)
    return artifact


def assert_estimate_is_the_placements(artifact, baselines_allowed: bool = True) -> None:
    """The estimate the artifact carries (and the build prints) is the placement's own price of its plan and of
    the baselines, one cost model for both; the plan is never behind whole-layer offload or the CPU alone unless the
    build ruled those plans out (--all-neurons, --no-dense-fallback: every FFN with a predictor runs sparse)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    report, estimate = PlacementReport.from_json(manifest["placement"]), manifest["estimate"]
    assert "solve_time_s" not in manifest["placement"]  # no wall time: the same plan, the same bytes
    assert estimate["picompile_tokens_per_s"] == 1 / report.expected_step_s
    assert estimate["cpu_only_tokens_per_s"] == 1 / report.cpu_only_step_s
    if estimate["layer_offload_tokens_per_s"] is not None:
        assert estimate["layer_offload_tokens_per_s"] == 1 / report.layer_offload_step_s
    if baselines_allowed:
        assert report.expected_step_s <= min(report.cpu_only_step_s, report.layer_offload_step_s)


def assert_matches_onnxruntime(artifact, onnx_path, emulate_gpu=False, decode_steps=8):
    """The artifact's logits are onnxruntime's on a prompt and greedy decode steps: within fp32 rounding, or,
    with the GPU's calls (emulated), within fp16 rounding of the weights the GPU holds."""
    engine, reference = Engine(artifact, emulate_gpu=emulate_gpu), OrtDecoder(onnx_path)

    def check(got, expected):
        if emulate_gpu:
            assert np.abs(got - expected).max() / expected.std() < 1e-2
        else:
            np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)

    prompt = np.array([11, 22, 33, 44, 55], np.int64)
    check(engine.forward(prompt), reference.forward(prompt))
    token = 3
    for _ in range(decode_steps):
        expected = reference.forward([token])
        check(engine.forward([token]), expected)
        token = int(np.argmax(expected[-1]))


@pytest.fixture(scope="module")
def sparse_models(tiny_models):
    return {family: tiny_models(family, sparsity=0.9) for family in ("opt", "llama")}


@pytest.fixture(scope="module")
def all_neurons_artifacts(sparse_models, tmp_path_factory):
    """family -> its sparse build letting every neuron through (fp32, default ISA), built on first use and shared
    by the tests that only read it."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = sparse_build(sparse_models[family], tmp_path_factory.mktemp("all-neurons") / "a.pic",
                                         all_neurons=True)
        return built[family]

    return get


@pytest.fixture(scope="module")
def dense_opt_artifact(sparse_models, tmp_path_factory):
    """The tiny sparse OPT's dense build (default ISA, max context 64), shared by the tests that only read it."""
    artifact = build(sparse_models["opt"].onnx, tmp_path_factory.mktemp("dense-opt") / "d.pic", get_target("cpu"),
                     Options(dense=True, max_context=64))
    assert_estimate_is_the_placements(artifact)
    return artifact


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_all_neurons_sparse_lowering_matches_onnxruntime(sparse_models, all_neurons_artifacts, family):
    files = sparse_models[family]
    artifact = all_neurons_artifacts(family)
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    assert any(call.role is Role.FFN and call.selection for call in calls)  # the CPU's fused up+down pass
    assert_matches_onnxruntime(artifact, files.onnx)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_fp16_weights_stay_close_to_onnxruntime(sparse_models, all_neurons_artifacts, tmp_path, family):
    """--weight-dtype fp16: the CPU's matrices are stored in fp16 (half the bytes) and the logits move only
    by fp16 rounding of the weights."""
    files = sparse_models[family]
    fp32 = all_neurons_artifacts(family)
    fp16 = sparse_build(files, tmp_path / "f16.pic", all_neurons=True, weight_dtype="fp16")
    manifest = load_manifest(fp16)
    kept = {name for name, info in manifest.buffers.items()  # position tables are read a row per token
            if info.kind == "weight" and len(info.shape) > 1 and info.dtype == "float32"}
    assert all("pos" in name or "rope" in name for name in kept), kept
    size = lambda a: sum(f.stat().st_size for f in (a / "weights").iterdir())  # noqa: E731
    assert size(fp16) < 0.6 * size(fp32)
    engine, reference = Engine(fp16), OrtDecoder(files.onnx)
    errors, tokens = [], [11, 22, 33, 44, 55]  # the prompt, then 6 greedy decode steps
    for _ in range(7):
        expected, got = reference.forward(tokens), engine.forward(tokens)
        errors.append(np.abs(got - expected).max() / expected.std())
        tokens = [int(np.argmax(expected[-1]))]
    # fp16 rounding (2^-11 relative per weight) moves the logits a little, never by much
    assert 0 < max(errors) < 1e-2, errors


class _ForcedPlan:
    """Stands in for partition's choice after it ran: every way a layer can sit across the devices, in one model
    (tiny models would otherwise stay on the CPU at real bandwidths): the embedding on the GPU, layer 0's attention
    on the CPU with its hottest neurons on the GPU (the predictor on the CPU, scores copied over), layer 1's
    attention on the GPU with its FFN all on the CPU (the predictor on the GPU), the output layer on the CPU."""

    name = "forced-plan"

    def apply(self, model, ctx):
        import onnx_ir as ir
        from onnx_ir.passes import PassResult

        from passes import ir as pir

        ffns = sorted(pir.nodes_in_domain(model, "FFN"), key=lambda n: pir.attr(n, "layer"))
        counts = [64, 0]
        plan = placement.Plan("gpu", ["cpu", "gpu"], ["sparse", "sparse"], counts, "cpu")
        report = dataclasses.replace(PlacementReport.of(model), plan=plan, gpu_neurons=counts)
        for node, n in zip(ffns, counts):
            node.attributes["gpu_neurons"] = ir.AttrInt64("gpu_neurons", n)
            node.attributes["placed"] = ir.AttrString("placed", "sparse")
        report.attach(model)
        return PassResult(model, modified=True)


def test_every_way_across_the_devices_matches_onnxruntime(sparse_models, tmp_path):
    files = sparse_models["llama"]
    opts = Options(max_context=64, calib=files.calib, all_neurons=True)
    passes = pipeline(opts, "predictor")
    at = next(i for i, p in enumerate(passes) if p.name == "partition") + 1
    artifact = build(files.onnx, tmp_path / "f.pic", get_target("rtx4090"), opts,
                     passes=passes[:at] + [_ForcedPlan()] + passes[at:])
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    device = {call.id: call.device for call in calls}
    assert device["embed"] == "gpu" and device["lm_head"] == "cpu"
    assert device["layers.0.attn.attention"] == "cpu" and device["layers.0.ffn.predict.fc1"] == "cpu"
    assert device["layers.1.attn.attention"] == "gpu" and device["layers.1.ffn.predict.fc1"] == "gpu"
    assert device["layers.0.ffn.sparse.gpu.up"] == "gpu" and device["layers.0.ffn.merge"] == "cpu"
    assert "layers.1.ffn.sparse.gpu.up" not in device and device["layers.1.ffn.merge"] == "gpu"
    assert_matches_onnxruntime(artifact, files.onnx, emulate_gpu=True, decode_steps=3)


_HYBRID: dict = {}


def hybrid_build(files, tmp_path_factory):
    """Hot rows on the (emulated) GPU, cold rows on the CPU, in the same layers: the build this file and
    test_concurrency check, made once per session and model."""
    if files.onnx not in _HYBRID:
        _HYBRID[files.onnx] = sparse_build(files, tmp_path_factory.mktemp("hybrid") / "h.pic", target=SLOW_CPU_RTX4090,
                                           all_neurons=True, vram_budget_bytes=300_000, placement_batch=32)
    return _HYBRID[files.onnx]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_hybrid_split_with_copies_matches_onnxruntime(sparse_models, tmp_path_factory, family):
    """Hot rows on the (emulated) GPU, cold rows on the CPU, in the same layers; separate buffers per
    device, so a missing copy or a wrong merge changes the logits."""
    files = sparse_models[family]
    artifact = hybrid_build(files, tmp_path_factory)
    manifest = load_manifest(artifact)
    split = [(layer.gpu_neurons, layer.cpu_neurons) for layer in manifest.layers]
    assert any(gpu and cpu for gpu, cpu in split), split
    schedule = json.loads((artifact / "schedule.json").read_text())
    calls = schedule_calls(schedule)
    assert {call.device for call in calls} == {"cpu", "gpu"}
    assert any(call.role is Role.COPY for call in calls)
    # the GPU calls' kernels were also compiled for the target's GPU (sm_89) by nvcc at build time
    assert (artifact / "kernels" / "cuda_sm_89.so").stat().st_size > 0
    assert_matches_onnxruntime(artifact, files.onnx, emulate_gpu=True)
    # the build's speed estimate splits the bytes between the devices and prices the baselines
    estimate = manifest.estimate  # (passes.costmodel.Estimate, as the writer stored it)
    assert estimate["gpu_bytes_per_token"] > 0 and estimate["cpu_bytes_per_token"] > 0
    assert estimate["layer_offload_tokens_per_s"] > 0 and estimate["picompile_tokens_per_s"] > 0
    # the schedule priced on another target (no placement's prices: those are for the build's target)
    faster_cpu = dataclasses.replace(get_target("rtx4090"), cpu_bandwidth_gbs=600.0)
    here, again = (costmodel.estimate(manifest, schedule, t) for t in (SLOW_CPU_RTX4090, faster_cpu))
    assert again.cpu_only_tokens_per_s > here.cpu_only_tokens_per_s
    assert again.picompile_tokens_per_s > here.picompile_tokens_per_s  # the CPU part got cheaper
    # without the flag a GPU artifact is refused, with a message that says what to do
    assert main(["run", str(artifact), "--prompt-ids", "1,2"]) == 2


def test_predictors_reach_recall_and_quality_is_reported(sparse_models, tmp_path, capsys):
    files = sparse_models["opt"]
    out, dumps = tmp_path / "p.pic", tmp_path / "ir"
    assert main(["build", str(files.onnx), "-o", str(out), "--calib", str(files.calib), "--max-context", "64",
                 "--dump-ir", str(dumps)]) == 0
    # a ReLU model gets predictor mode without being told, and the build says why
    printed = capsys.readouterr().out
    assert "sparsity: predictor mode (layer FFNs use ReLU: most neurons output exactly zero" in printed
    # the estimate it prints is the placement's expectation, beside the CPU alone's by the same cost model
    assert_estimate_is_the_placements(out)
    report = PlacementReport.from_json(json.loads((out / "manifest.json").read_text())["placement"])
    assert (f"picompile {1 / report.expected_step_s:.1f} tok/s" in printed
            and f"CPU only, dense: {1 / report.cpu_only_step_s:.1f} tok/s" in printed), printed
    names = sorted(p.name for p in dumps.glob("*.onnx"))
    assert [n.split("-", 1)[1] for n in names] == ["import.onnx", "recognise.onnx", "sparsity.onnx", "profile.onnx",
                                                  "predict.onnx", "quality.onnx", "partition.onnx", "lower.onnx", "fuse.onnx",
                                                  "place.onnx", "quantize.onnx", "select-kernels.onnx",
                                                  "plan-buffers.onnx", "compile.onnx", "schedule.onnx"]
    # predictor mode's passes: no threshold; quantize blocks the predictors of this fp32 build
    for name in names:
        onnx.checker.check_model(onnx.load(str(dumps / name)))
    manifest = load_manifest(out)
    for layer in manifest.layers:
        assert layer.predictor_recall >= 0.95, layer
        assert layer.predictor_active < 0.5, layer  # a predictor that keeps everything saves nothing
        assert 0.85 < layer.sparsity < 0.95
    assert (out / "plots" / "activation_cdf.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["eval", str(out), "--reference", str(files.onnx), "--tokens", str(files.heldout),
                 "--max-sequences", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top1_agreement"] >= 0.9, report
    assert report["kl_mean"] < 0.05, report
    assert [r["recall"] for r in report["layers"]] == [layer.predictor_recall for layer in manifest.layers]
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recall" in text and "layer" in text
    stored = [line for line in text.splitlines() if line.startswith("predictors ")]  # the fp32 build's int8 predictors
    assert len(stored) == 1 and " matrices in int8 (rtn, blocks of 32)" in stored[0], stored


def test_models_with_external_data_build(sparse_models, tmp_path, monkeypatch):
    """Weights in a `.onnx.data` file beside the model (how exports over 2 GB come): the profile pass
    hands the source graph to onnxruntime from the build's own directory, so it must copy them along."""
    import onnx_ir as ir

    from passes import ir as pir

    files = sparse_models["llama"]
    external = tmp_path / "ext" / "model.onnx"
    external.parent.mkdir()
    ir.save(ir.load(str(files.onnx)), external, external_data="model.onnx.data", size_threshold_bytes=0)
    assert (tmp_path / "ext" / "model.onnx.data").stat().st_size > 0
    monkeypatch.setattr(pir, "EXTERNAL_DATA_BYTES", 0)  # treat this tiny model as a large one
    external_files = dataclasses.replace(files, onnx=external)
    artifact = sparse_build(external_files, tmp_path / "x.pic", all_neurons=True)
    assert_matches_onnxruntime(artifact, files.onnx, decode_steps=2)


def test_profile_counts_the_weight_bytes_each_decode_step_reads(sparse_models, all_neurons_artifacts,
                                                               dense_opt_artifact, tmp_path):
    """Dense: every weight a decode call takes, once (an embedding table: the one row gathered). Sparse with
    every neuron let through: the predictors', every up row, and the down rows of the neurons that fired.
    Sparse: fewer FFN bytes than dense."""
    files = sparse_models["opt"]
    dense = dense_opt_artifact
    every = all_neurons_artifacts("opt")
    sparse = sparse_build(files, tmp_path / "s.pic")

    def measured(artifact):
        engine = Engine(artifact)
        result = generate(engine, [5, 6, 7], 9, profile=True)
        assert engine.profile is None and result["weight_gbs_kernels"] > 0
        return engine, result["weight_bytes_per_token"]

    def weight_nbytes(engine, roles):
        """nbytes of the weight arrays the decode calls of these roles take (embedding tables: one row)."""
        total = 0
        for call in schedule_calls(json.loads((engine.directory / "schedule.json").read_text())):
            if call.decode and call.role.value in roles:
                for name in call.buffers():
                    if name in engine.manifest.buffers and engine.manifest.buffers[name].kind == "weight":
                        array = engine.buffers[name]
                        total += array[0].nbytes if call.role is Role.EMBED else array.nbytes
        return total

    everything = {"embed", "norm", "attention", "ffn_up", "ffn_down", "merge", "head", "predictor"}
    rest = {"embed", "norm", "attention", "head"}  # not the FFN, not the predictors
    engine, dense_bytes = measured(dense)
    assert dense_bytes == weight_nbytes(engine, everything) > 0
    dense_ffn = dense_bytes - weight_nbytes(engine, rest)
    dense_down = weight_nbytes(engine, {"ffn_down"})
    engine, every_bytes = measured(every)
    predictors = weight_nbytes(engine, {"predictor"})
    # every up row is read; a down row only where the neuron's ReLU output was not 0 (some, not all, fired)
    assert predictors > 0 and dense_bytes - dense_down < every_bytes - predictors < dense_bytes
    engine, sparse_bytes = measured(sparse)
    sparse_ffn = sparse_bytes - weight_nbytes(engine, rest | {"predictor"})
    assert 0 < sparse_ffn < 0.5 * dense_ffn, (sparse_ffn, dense_ffn)  # ~10% fire; the predictors keep some more


def test_avx512_kernels_run_where_the_cpu_has_them(sparse_models, tmp_path):
    """--cpu-isa avx512 (wider GEMM tiles, skylake-avx512 code): logits as onnxruntime's on a CPU with
    AVX-512; elsewhere the runtime refuses the artifact, naming the missing flags, instead of crashing."""
    from runtime.artifact import ArtifactError, missing_cpu_features

    files = sparse_models["opt"]
    artifact = sparse_build(files, tmp_path / "w.pic", all_neurons=True, cpu_isa="avx512")
    target = load_manifest(artifact).target
    assert target.cpu_isa == "avx512" and "avx512f" in target.cpu_features
    missing = missing_cpu_features(target.cpu_features)
    if missing:
        with pytest.raises(ArtifactError, match=missing[0]):
            Engine(artifact)
    else:
        assert_matches_onnxruntime(artifact, files.onnx, decode_steps=3)


def test_default_kernels_are_the_build_machines_widest_and_avx2_is_portable(sparse_models, dense_opt_artifact,
                                                                            tmp_path):
    """Without --cpu-isa the kernels are compiled for the widest instruction set this CPU has (AVX-512 where
    present); --cpu-isa avx2 builds the portable artifact, which matches onnxruntime on any x86 CPU here."""
    from passes.targets import host_cpu_isa

    files = sparse_models["opt"]
    default = dense_opt_artifact  # built without --cpu-isa
    assert load_manifest(default).target.cpu_isa == host_cpu_isa().name
    portable = sparse_build(files, tmp_path / "p.pic", all_neurons=True, cpu_isa="avx2")
    target = load_manifest(portable).target
    assert target.cpu_isa == "avx2" and not any(flag.startswith("avx512") for flag in target.cpu_features)
    assert_matches_onnxruntime(portable, files.onnx, decode_steps=3)


def test_host_isa_is_read_from_the_cpu_flags(monkeypatch):
    from passes import targets

    avx2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    for flags, expected in ((avx2, "avx2"), (avx512, "avx512"), (avx512 | {"avx512_vnni"}, "avx512vnni"),
                            (avx2 | {"avx512f"}, "avx2"), (avx2 | {"avx512_vnni"}, "avx2"), (None, "avx2")):
        monkeypatch.setattr(targets, "cpu_flags", lambda flags=flags: None if flags is None else frozenset(flags))
        assert targets.host_cpu_isa().name == expected, flags
    monkeypatch.setattr(targets, "cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.raises(UserError, match="--cpu-isa"):
        targets.host_cpu_isa()


def test_runtime_refuses_kernels_for_a_cpu_it_is_not(dense_opt_artifact, tmp_path, capsys):
    artifact = tmp_path / "d.pic"
    shutil.copytree(dense_opt_artifact, artifact)  # edited below: a copy of the shared build
    manifest_path = artifact / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["target"]["cpu_features"].append("amx_tile_from_the_future")
    manifest_path.write_text(json.dumps(seal_manifest(manifest)))  # an edit that keeps the digest right
    assert main(["run", str(artifact), "--prompt-ids", "1,2", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "amx_tile_from_the_future" in err[0]


@dataclasses.dataclass
class _ExpectedShares:
    """Stands in for predict's expected shares before partition: layer 0's predictor is made to expect most neurons
    active (so the cost model prices its sparse path above the dense one); every other layer's threshold lets
    every neuron through, so the whole artifact still computes exactly the dense model."""

    name = "expected-shares"

    def apply(self, model, ctx):
        import onnx_ir as ir
        from onnx_ir.passes import PassResult

        from passes.lower import ALL_NEURONS
        from passes import ir as pir

        for node in pir.nodes_in_domain(model, "FFN"):
            if pir.attr(node, "layer") == 0:
                node.attributes["predictor_active"] = ir.AttrFloat32("predictor_active", 0.95)
            else:
                node.attributes["predictor_threshold"] = ir.AttrFloat32("predictor_threshold", ALL_NEURONS)
        return PassResult(model, modified=True)


def test_a_layer_whose_sparse_path_costs_more_is_lowered_dense(sparse_models, tmp_path, capsys):
    files = sparse_models["opt"]
    opts = Options(max_context=64, calib=files.calib)
    passes = pipeline(opts, "predictor")
    at = next(i for i, p in enumerate(passes) if p.name == "partition")
    artifact = build(files.onnx, tmp_path / "d.pic", get_target("cpu"), opts,
                     passes=passes[:at] + [_ExpectedShares()] + passes[at:])
    assert_estimate_is_the_placements(artifact)
    layers = {layer.layer: layer for layer in load_manifest(artifact).layers}
    assert layers[0].dense and "95.0%" in layers[0].dense_reason, layers[0]
    assert all(not layer.dense for number, layer in layers.items() if number != 0)
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    dense = [call for call in calls if call.layer == 0 and call.role in (Role.FFN, Role.FFN_UP, Role.FFN_DOWN)]
    assert dense and all(call.selection is None and call.decode for call in dense)  # dense GEMVs in decode too
    assert not any(call.layer == 0 and call.role is Role.PREDICTOR for call in calls)  # no predictor to run
    assert any(call.layer == 1 and call.role is Role.FFN and call.selection for call in calls)
    assert_matches_onnxruntime(artifact, files.onnx)
    assert main(["inspect", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert "layer 0 FFN lowered dense: placed dense on the CPU: expected 95.0% of the neurons predicted active" in out
    # the cost model's choice, alone: a high share goes dense, a low one stays sparse
    target = get_target("cpu")
    for share, dense in ((0.9, True), (0.1, False)):
        ffn = costmodel.price_ffn(target, costmodel.FfnBytes(
            dense=costmodel.BlockBytes(1 << 26, 1 << 26, 1 << 26, 2), width=1024, activation_bytes=4096,
            gpu_bytes_per_neuron=1 << 16, cpu_bytes_per_neuron=1 << 16, frequencies=np.full(1024, share),
            predictor=costmodel.BlockBytes(1 << 22, 1 << 22, 1 << 22, 2)))
        sparse_s, dense_s = placement.whole_ffn_seconds(ffn, "cpu")
        assert (dense_s < sparse_s) == dense
