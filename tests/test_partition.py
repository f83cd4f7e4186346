"""The partition pass: it prices every block of a real tiny model, solves the one placement for it, and writes a
plan the later passes can trust."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.partition import PlacementReport, Partition
from passes import ir as pir
from passes.errors import UserError
from passes.pipeline import Context, Options, run_passes
from passes.targets import GiB, get_target
from test_powerinfer_placement import power_law
from tiny_targets import SLOW_CPU_RTX4090


# ---------------------------------------------------------------- the pass on a real tiny model


@pytest.fixture(scope="module")
def lifted(tiny_models):
    from passes.import_onnx import Import
    from passes.front_end import load
    from passes.recognise import Recognise

    files = tiny_models("llama", sparsity=0.9)
    return lambda: run_passes(load(files.onnx), [Import(), Recognise()], Context(get_target("cpu")))


def with_profile(model: ir.Model, seed: int = 0, rank: int = 8) -> ir.Model:
    """What the profile and predict passes add: per layer a power-law frequency table, a rank-r predictor and its
    expected share of predicted-active neurons."""
    rng = np.random.default_rng(seed)
    for node in pir.nodes_in_domain(model, "FFN"):
        prefix = f"layers.{pir.attr(node, 'layer')}.ffn"
        width, d_model = pir.const_array(node.inputs[3]).shape
        frequency = power_law(rng, width, 0.8)
        pir.initializer(model.graph, f"{prefix}.frequency", frequency.astype(np.float32))
        pir.initializer(model.graph, f"{prefix}.predictor.w1", rng.standard_normal((d_model, rank)).astype(np.float32))
        pir.initializer(model.graph, f"{prefix}.predictor.w2", rng.standard_normal((rank, width)).astype(np.float32))
        node.attributes["predictor_active"] = ir.AttrFloat32("predictor_active", float(1.5 * frequency.mean()))
    return model


def partition(model: ir.Model, target=SLOW_CPU_RTX4090, **fields) -> tuple[ir.Model, PlacementReport, list[str]]:
    """Partition alone; `fields` are the pass's fields and the options of the build target it reads."""
    lines = []
    built = {name: fields.pop(name) for name in ("vram_budget_bytes", "weight_dtype", "max_context") if name in fields}
    ctx = Context(get_target(target) if isinstance(target, str) else target, log=lines.append,
                  options=Options(**built))
    result = Partition(**fields).apply(model, ctx)
    assert result.modified
    report = PlacementReport.of(result.model)
    # at every budget: the plan the estimate will show is never behind whole-layer offload or the CPU alone, by the
    # one price all three have (costmodel.step_seconds)
    assert report.expected_step_s <= min(report.layer_offload_step_s, report.cpu_only_step_s) * (1 + 1e-9)
    return result.model, report, lines


def ffn_nodes(model: ir.Model) -> list[ir.Node]:
    return sorted(pir.nodes_in_domain(model, "FFN"), key=lambda n: pir.attr(n, "layer"))


def test_more_budget_is_never_slower_and_never_behind_layer_offload(lifted):
    model = with_profile(lifted())
    _, whole, _ = partition(model, vram_budget_bytes=GiB)
    everything = whole.used_bytes
    steps = []
    for share in (0.0, 0.05, 0.2, 0.4, 0.7, 1.0, 1.5):
        model, report, lines = partition(model, vram_budget_bytes=int(everything * share / 0.95) + 1, placement_batch=16)
        assert len(lines) == 1 and lines[0].startswith("partition:")
        assert report.used_bytes <= report.budget_bytes
        assert report.expected_step_s <= report.layer_offload_step_s * (1 + 1e-9)
        nodes = ffn_nodes(model)
        assert [pir.attr(n, "gpu_neurons") for n in nodes] == report.gpu_neurons
        assert [pir.attr(n, "placed") for n in nodes] == report.plan.ffn
        assert all(n % 16 == 0 or n == 256 for n in report.gpu_neurons)
        steps.append(report.expected_step_s)
    assert all(b <= a * (1 + 1e-3) for a, b in zip(steps, steps[1:])) and steps[-1] < steps[0]
    assert report.plan.attention == ["gpu", "gpu"] and report.status == "Optimal"
    assert report.num_variables > 0 and report.vram_bytes > report.reserve_bytes > 0 and report.layer_offload_layers
    # a wall time is no fact of the plan: two builds of one plan write the same report
    assert "solve_time_s" not in report.to_json() and PlacementReport.from_json(report.to_json()) == report


def test_dense_blocks_go_to_the_gpu_when_the_ffn_budget_alone_would_be_empty(lifted):
    """A budget smaller than the dense part (attention, norms, embedding, output layer), which left PowerInfer's
    policy, and this pass before, no FFN budget and so nothing on the GPU: the plan still uses it."""
    model = with_profile(lifted())
    dense = sum(v.const_value.nbytes // 2 for name, v in model.graph.initializers.items()  # fp16 on the GPU
                if ".ffn." not in name and v.const_value is not None and len(v.const_value.shape) >= 2)
    model, report, _ = partition(model, vram_budget_bytes=dense // 2)
    assert 0 < report.used_bytes <= report.budget_bytes < dense
    plan = report.plan
    assert "gpu" in plan.attention or "gpu" in (plan.head, plan.embed)  # a dense block on the GPU
    _, cpu, _ = partition(with_profile(lifted()), vram_budget_bytes=1)
    assert report.expected_step_s < cpu.expected_step_s


def test_cpu_target_places_nothing(lifted):
    model, report, _ = partition(with_profile(lifted()), target="cpu")
    assert report.gpu_neurons == [0, 0] and set(report.plan.attention) == {"cpu"}
    assert "no GPU" in report.status and "cpu" in report.status
    assert all(f"layers.{i}.ffn.neuron_order" in model.graph.initializers for i in (0, 1))


def test_layers_without_a_profile_run_dense(lifted):
    """A dense build (no frequencies, no predictors): every FFN runs dense on one device, with its reason."""
    model, report, _ = partition(lifted(), vram_budget_bytes=GiB)
    assert set(report.plan.ffn) <= {"gpu", "cpu"}
    assert all(pir.attr(n, "placed_reason") == "no predictor" for n in ffn_nodes(model))
    assert not [n for n in model.graph.initializers if n.endswith("neuron_order")]


def test_neuron_order_is_hottest_first(lifted):
    model, report, _ = partition(with_profile(lifted(), seed=5))
    assert report.used_bytes > 0  # the whole tiny model fits a 24 GiB card
    for layer in (0, 1):
        order = pir.const_array(model.graph.initializers[f"layers.{layer}.ffn.neuron_order"])
        frequency = pir.const_array(model.graph.initializers[f"layers.{layer}.ffn.frequency"])
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(frequency.size))
        assert np.all(np.diff(frequency[order]) <= 0)
    again, _, _ = partition(model)  # running twice replaces the tables
    assert len([n for n in again.graph.initializers if n.endswith("neuron_order")]) == 2


def test_budget_over_the_target_memory_is_a_user_error(lifted):
    model = with_profile(lifted())
    with pytest.raises(UserError) as error:
        partition(model, vram_budget_bytes=25 * GiB)
    assert str(25 * GiB) in str(error.value) and str(24 * GiB) in str(error.value)
    with pytest.raises(UserError, match="no GPU"):
        partition(model, target="cpu", vram_budget_bytes=GiB)


def test_weights_are_priced_as_stored(lifted):
    """The CPU stores its blocks in --weight-dtype, the GPU in fp16 whatever the CPU's is: an fp16 CPU halves what
    leaving a block there costs, so at the same budget the plan is never slower, and its GPU bytes are the same
    for the same plan."""
    model = with_profile(lifted())
    _, fp32, _ = partition(model, vram_budget_bytes=GiB)
    _, fp16, _ = partition(model, vram_budget_bytes=GiB, weight_dtype="fp16")
    assert (fp32.cpu_weight_format, fp16.cpu_weight_format) == ("fp32", "fp16")
    assert fp32.gpu_weight_format == fp16.gpu_weight_format == "fp16"
    assert fp32.plan == fp16.plan and fp32.used_bytes == fp16.used_bytes  # all on the GPU
    _, fp32_cpu, _ = partition(model, target="cpu")
    _, fp16_cpu, _ = partition(model, target="cpu", weight_dtype="fp16")
    assert fp16_cpu.expected_step_s < fp32_cpu.expected_step_s


def test_the_quality_plans_formats_are_priced(lifted):
    """A matrix the quality plan widens is read in its planned format: an int4 build whose plan keeps every matrix
    in fp16 costs what an fp16 build does, more than the int4 build without a plan."""
    from passes.quality import WeightPlan

    _, int4, _ = partition(with_profile(lifted()), target="cpu", weight_dtype="int4")
    model = with_profile(lifted())
    WeightPlan({name: "fp16" for name, value in model.graph.initializers.items()
                if len(value.const_value.shape) >= 2}).attach(model)
    _, widened, _ = partition(model, target="cpu", weight_dtype="int4")
    _, fp16, _ = partition(with_profile(lifted()), target="cpu", weight_dtype="fp16")
    assert widened.expected_step_s == pytest.approx(fp16.expected_step_s, rel=1e-9)
    assert widened.cpu_only_step_s == pytest.approx(fp16.cpu_only_step_s, rel=1e-9)
    assert int4.expected_step_s < widened.expected_step_s


# ---------------------------------------------------------------- the pass on a hand-built IR: numeric layer order


def synthetic_ir(layers: int, width: int, d_model: int, hot_layer: int) -> ir.Model:
    """FFN nodes only, added in string order of their layer numbers (1, 10, 11, 2, ...); every layer is
    cold except `hot_layer`."""
    graph = ir.Graph([], [], nodes=[], name="g", opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: pir.DOMAIN_VERSION})
    x = ir.val("x", ir.DataType.FLOAT, ["seq", d_model])
    graph.inputs.append(x)
    for layer in sorted(range(layers), key=str):
        p = f"layers.{layer}.ffn"
        node = ir.node("FFN", [x, pir.initializer(graph, f"{p}.w_up", np.zeros((d_model, width), np.float32)), None,
                               pir.initializer(graph, f"{p}.w_down", np.zeros((width, d_model), np.float32)), None],
                       {"layer": layer, "activation": "relu", "gated": 0, "predictor_active": 0.5}, domain=pir.DOMAIN,
                       name=p)
        graph.append(node)
        frequency = np.full(width, 0.9 if layer == hot_layer else 0.01, np.float32)
        pir.initializer(graph, f"{p}.frequency", frequency)
        pir.initializer(graph, f"{p}.predictor.w1", np.zeros((d_model, 2), np.float32))
        pir.initializer(graph, f"{p}.predictor.w2", np.zeros((2, width), np.float32))
    return ir.Model(graph, ir_version=10)


def test_layers_are_matched_by_number_not_by_name_order():
    model = synthetic_ir(layers=12, width=64, d_model=16, hot_layer=10)
    per_layer = 64 * 2 * 16 * 2  # fp16 on the GPU
    budget = int((per_layer + 200) / 0.95) + 1  # room for one layer's neurons
    partition = Partition(placement_batch=16, dense_ffns=False)
    model = partition.apply(model, Context(SLOW_CPU_RTX4090, options=Options(vram_budget_bytes=budget))).model
    placed = {pir.attr(n, "layer"): pir.attr(n, "gpu_neurons") for n in pir.nodes_in_domain(model, "FFN")}
    assert placed[10] == 64 and sum(placed.values()) == 64
    report = PlacementReport.of(model)
    assert report.layers == list(range(12)) and report.gpu_neurons[10] == 64
