"""The partition pass: the placement ILP is exact on small instances, its answers keep every constraint,
and the pass writes a placement the later passes can trust."""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx_ir as ir
import pytest

from passes.partition import Partition, min_neurons_for, solve_placement
from picompile import ir as pir
from picompile.costmodel import sync_seconds
from picompile.errors import UserError
from picompile.pipeline import Context, run_passes
from picompile.targets import GiB, get_target

# ---------------------------------------------------------------- the solver against brute force


def power_law(rng, size: int, alpha: float = 1.0) -> np.ndarray:
    """Activation frequencies in (0, 1], zipf-like, in random neuron order."""
    ranked = np.minimum(1.0, 0.9 * np.arange(1, size + 1, dtype=np.float64) ** -alpha * rng.uniform(0.5, 1.5, size))
    return rng.permutation(ranked)


def prefix_value(frequency: np.ndarray, n: int) -> float:
    return float(np.sort(frequency)[::-1][:n].sum())


def smallest_part(frequency: np.ndarray, batch: int, minimum: int) -> int:
    """Neurons in a layer's smallest allowed GPU part: whole batches covering max(minimum, 1) neurons."""
    if frequency.size == 0:
        return 0
    return min(frequency.size, -(-max(minimum, 1) // batch) * batch)


def feasible(frequencies, bytes_per_neuron, budget, counts, batch, minimums=None, g=0.0, c=0.0) -> bool:
    """Every constraint of the formulation, checked on per-layer prefix counts."""
    if sum(n * b for n, b in zip(counts, bytes_per_neuron)) > budget:
        return False
    for l, (f, n) in enumerate(zip(frequencies, counts)):
        if n < 0 or n > f.size or (n % batch and n != f.size):  # whole batches, or the whole layer
            return False
        minimum = 0 if minimums is None else min(minimums[l], f.size)
        if 0 < n < minimum:
            return False
        if g > 0 and c > 0 and 0 < n < f.size:
            hot, total = prefix_value(f, n), prefix_value(f, f.size)
            least = prefix_value(f, smallest_part(f, batch, minimum))
            if g * hot > c * (total - hot) + g * least + 1e-9:
                return False
    return True


def brute_force(frequencies, bytes_per_neuron, budget, batch, minimums=None, g=0.0, c=0.0) -> float:
    choices = [sorted({0, f.size, *range(batch, f.size, batch)}) for f in frequencies]
    best = 0.0
    for counts in itertools.product(*choices):
        if feasible(frequencies, bytes_per_neuron, budget, counts, batch, minimums, g, c):
            best = max(best, sum(prefix_value(f, n) for f, n in zip(frequencies, counts)))
    return best


def random_instance(seed: int):
    rng = np.random.default_rng(seed)
    batch = int(rng.choice([2, 3, 4]))
    layers = int(rng.integers(2, 4))
    frequencies = [power_law(rng, int(rng.integers(batch + 1, 4 * batch + 1)), rng.uniform(0.3, 1.5))
                   for _ in range(layers)]
    bytes_per_neuron = [int(rng.integers(50, 200)) for _ in range(layers)]
    total = sum(f.size * b for f, b in zip(frequencies, bytes_per_neuron))
    budget = int(total * rng.uniform(0.05, 0.95))
    minimums = [int(rng.integers(0, f.size + 2)) for f in frequencies] if rng.random() < 0.7 else None
    g, c = (1.0, float(rng.uniform(1.0, 20.0))) if rng.random() < 0.5 else (0.0, 0.0)
    return frequencies, bytes_per_neuron, budget, batch, minimums, g, c


@pytest.mark.parametrize("seed", range(40))
def test_ilp_equals_brute_force(seed):
    frequencies, bytes_per_neuron, budget, batch, minimums, g, c = random_instance(seed)
    placement = solve_placement(frequencies, bytes_per_neuron, budget, batch=batch, min_neurons=minimums,
                                gpu_time_per_byte=g, cpu_time_per_byte=c, mip_rel_gap=0.0)
    assert placement.status == "Optimal"
    assert feasible(frequencies, bytes_per_neuron, budget, placement.gpu_neurons, batch, minimums, g, c)
    best = brute_force(frequencies, bytes_per_neuron, budget, batch, minimums, g, c)
    assert placement.objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    placed = sum(prefix_value(f, n) for f, n in zip(frequencies, placement.gpu_neurons))
    assert placement.objective == pytest.approx(placed)
    assert placement.used_bytes == sum(n * b for n, b in zip(placement.gpu_neurons, bytes_per_neuron))


# ---------------------------------------------------------------- the solver at size


def sized_instance(seed: int, layers: int = 8, width: int = 2000):
    rng = np.random.default_rng(100 + seed)
    frequencies = [power_law(rng, width, rng.uniform(0.6, 1.2)) for _ in range(layers)]
    bytes_per_neuron = [3 * 512 * 2] * layers
    budget = int(layers * width * bytes_per_neuron[0] * rng.uniform(0.02, 0.9))
    minimums = [int(m) for m in rng.integers(1, 600, layers)]
    return rng, frequencies, bytes_per_neuron, budget, minimums


@pytest.mark.parametrize("seed", range(12))
def test_answers_keep_every_constraint(seed):
    rng, frequencies, bytes_per_neuron, budget, minimums = sized_instance(seed)
    g, c = (1 / 900e9, 1 / 60e9) if seed % 2 else (0.0, 0.0)
    batch = 64
    placement = solve_placement(frequencies, bytes_per_neuron, budget, batch=batch, min_neurons=minimums,
                                gpu_time_per_byte=g, cpu_time_per_byte=c)
    assert placement.status == "Optimal"
    assert 0.0 <= placement.gap <= 1e-3
    counts = placement.gpu_neurons
    assert placement.used_bytes == sum(n * b for n, b in zip(counts, bytes_per_neuron)) <= budget  # memory
    for f, n, minimum in zip(frequencies, counts, minimums):
        assert n % batch == 0 or n == f.size  # prefix of whole batches, or all
        assert n == 0 or n >= minimum  # minimum or nothing
    assert feasible(frequencies, bytes_per_neuron, budget, counts, batch, minimums, g, c)  # and balance
    assert placement.num_variables > len(frequencies)


def test_time_limit_still_gives_a_feasible_placement():
    _, frequencies, bytes_per_neuron, budget, minimums = sized_instance(0)
    placement = solve_placement(frequencies, bytes_per_neuron, budget, batch=64, min_neurons=minimums,
                                time_limit_s=0.0, mip_rel_gap=0.0)
    assert placement.status == "Time limit reached"  # reported as such, with the gap of the LP bound
    assert 0.0 < placement.gap < 0.5
    assert feasible(frequencies, bytes_per_neuron, budget, placement.gpu_neurons, 64, minimums)
    optimal = solve_placement(frequencies, bytes_per_neuron, budget, batch=64, min_neurons=minimums, mip_rel_gap=0.0)
    assert optimal.objective >= placement.objective


def test_more_budget_never_places_less():
    rng, frequencies, bytes_per_neuron, _, minimums = sized_instance(0, layers=6, width=1200)
    total = sum(f.size * b for f, b in zip(frequencies, bytes_per_neuron))
    objectives = []
    for share in np.linspace(0.0, 1.05, 15):
        placement = solve_placement(frequencies, bytes_per_neuron, int(total * share), batch=64, min_neurons=minimums,
                                    gpu_time_per_byte=1 / 900e9, cpu_time_per_byte=1 / 60e9, mip_rel_gap=0.0)
        objectives.append(placement.objective)
    assert all(b >= a - 1e-9 for a, b in zip(objectives, objectives[1:]))
    assert objectives[0] == 0.0 and objectives[-1] == pytest.approx(sum(f.sum() for f in frequencies))


def test_zero_and_huge_budgets():
    _, frequencies, bytes_per_neuron, _, minimums = sized_instance(1)
    for budget in (0, -5):
        nothing = solve_placement(frequencies, bytes_per_neuron, budget, min_neurons=minimums)
        assert nothing.gpu_neurons == [0] * len(frequencies) and nothing.status == "no GPU budget"
        assert nothing.objective == 0.0 and nothing.used_bytes == 0
    assert solve_placement([], [], 10 * GiB).status == "no GPU budget"
    everything = solve_placement(frequencies, bytes_per_neuron, 10**15, min_neurons=minimums,
                                 gpu_time_per_byte=1 / 900e9, cpu_time_per_byte=1 / 60e9)
    assert everything.gpu_neurons == [f.size for f in frequencies]
    assert everything.status == "Optimal" and everything.gap == 0.0
    small = solve_placement(frequencies, bytes_per_neuron, bytes_per_neuron[0] * 10, batch=64)  # not one batch fits
    assert small.gpu_neurons == [0] * len(frequencies) and small.status == "Optimal"


def test_frequencies_order_within_a_layer_does_not_matter():
    rng, frequencies, bytes_per_neuron, budget, minimums = sized_instance(2)
    a = solve_placement(frequencies, bytes_per_neuron, budget, min_neurons=minimums, mip_rel_gap=0.0)
    b = solve_placement([rng.permutation(f) for f in frequencies], bytes_per_neuron, budget, min_neurons=minimums,
                        mip_rel_gap=0.0)
    assert a.objective == pytest.approx(b.objective)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="byte sizes"):
        solve_placement([np.ones(4)], [1, 2], 100)
    with pytest.raises(ValueError, match="finite"):
        solve_placement([np.array([0.5, np.nan])], [1], 100)
    with pytest.raises(ValueError, match="batch"):
        solve_placement([np.ones(4)], [1], 100, batch=0)


def test_minimum_part_pays_for_the_synchronisation():
    ranked = np.sort(power_law(np.random.default_rng(3), 4096))[::-1]
    sync = sync_seconds(get_target("rtx4090"), 4096 * 4)  # a d_model 4096 layer's fp32 input and output over PCIe
    assert sync == pytest.approx(20e-6 + 2 * 4096 * 4 / 25e9)  # the fixed 20 us and the copies, as placement had
    fast_cpu = min_neurons_for(ranked, 6 * 4096, 64, cpu_bandwidth_gbs=200.0, sync_s=sync)
    slow_cpu = min_neurons_for(ranked, 6 * 4096, 64, cpu_bandwidth_gbs=20.0, sync_s=sync)
    assert fast_cpu % 64 == 0 and slow_cpu % 64 == 0 and 64 <= slow_cpu <= fast_cpu  # a faster CPU needs more
    assert min_neurons_for(ranked, 8, 64, 60.0, sync) == ranked.size  # never pays: all or nothing
    assert min_neurons_for(ranked, 6 * 4096, 64, 60.0, sync_s=0.0) == 64  # at least a batch
    fp16 = min_neurons_for(ranked, 3 * 4096, 64, 60.0, sync)  # fp16 rows: a neuron left on the CPU costs half
    assert fp16 >= min_neurons_for(ranked, 6 * 4096, 64, 60.0, sync)


# ---------------------------------------------------------------- the pass on a real tiny model


@pytest.fixture(scope="module")
def lifted(tiny_models):
    from passes.import_onnx import Import, load
    from passes.recognise import Recognise

    files = tiny_models("llama", sparsity=0.9)
    return lambda: run_passes(load(files.onnx), [Import(), Recognise()], Context(get_target("cpu")))


def with_frequencies(model: ir.Model, seed: int = 0) -> ir.Model:
    """What the profile pass adds: per layer a power-law frequency table."""
    rng = np.random.default_rng(seed)
    for node in pir.nodes_in_domain(model, "FFN"):
        width = pir.const_array(node.inputs[3]).shape[0]
        pir.initializer(model.graph, f"layers.{pir.attr(node, 'layer')}.ffn.frequency",
                        power_law(rng, width, 0.8).astype(np.float32))
    return model


def partition(model: ir.Model, target: str = "rtx4090", **fields) -> tuple[ir.Model, dict, list[str]]:
    lines = []
    ctx = Context(get_target(target), log=lines.append)
    result = Partition(min_or_nothing=False, **fields).apply(model, ctx)
    assert result.modified
    return result.model, json.loads(result.model.metadata_props["picompile.placement"]), lines


def gpu_neurons(model: ir.Model) -> list[int]:
    ffns = sorted(pir.nodes_in_domain(model, "FFN"), key=lambda n: pir.attr(n, "layer"))
    return [pir.attr(n, "gpu_neurons") for n in ffns]


def test_pass_places_more_with_more_budget(lifted):
    model = with_frequencies(lifted())
    _, report, _ = partition(model, vram_budget_bytes=1)
    floor = report["dense_gpu_bytes"] + report["kv_cache_bytes"]
    totals, previous = [], None
    for extra in (0, 25_000, 50_000, 100_000, 150_000, 200_000, 10**9):  # (a neuron: 384 bytes in fp16)
        model, report, lines = partition(model, vram_budget_bytes=int((floor + extra) / 0.95) + 1, placement_batch=16)
        counts = gpu_neurons(model)
        assert counts == report["gpu_neurons"] and len(lines) == 1 and lines[0].startswith("partition:")
        assert report["used_bytes"] <= report["budget_bytes"]
        assert all(n % 16 == 0 for n in counts)
        if previous is not None:
            assert report["objective"] >= previous - 1e-9
        previous = report["objective"]
        totals.append(sum(counts))
    assert totals[0] == 0 and 0 < totals[3] < totals[-1] == 512
    assert report["status"] == "Optimal" and report["num_variables"] > 0
    for key in ("gap", "solve_time_s", "budget_bytes", "dense_gpu_bytes", "kv_cache_bytes", "min_neurons"):
        assert key in report


def test_budget_below_the_dense_part_places_nothing(lifted):
    _, whole, _ = partition(with_frequencies(lifted()), vram_budget_bytes=10**9)
    budget = whole["dense_gpu_bytes"] // 2
    model, report, lines = partition(with_frequencies(lifted()), vram_budget_bytes=budget)
    assert gpu_neurons(model) == [0, 0]
    assert report["dense_gpu_bytes"] > budget and "no GPU budget" in report["status"]
    assert "no GPU budget" in lines[0]


def test_cpu_target_places_nothing(lifted):
    model, report, _ = partition(with_frequencies(lifted()), target="cpu")
    assert gpu_neurons(model) == [0, 0]
    assert "no GPU" in report["status"] and "cpu" in report["status"]
    assert all(f"layers.{i}.ffn.neuron_order" in model.graph.initializers for i in (0, 1))


def test_neuron_order_is_hottest_first(lifted):
    model, report, _ = partition(with_frequencies(lifted(), seed=5))
    assert gpu_neurons(model) == [256, 256]  # the whole tiny model fits a 24 GiB card
    for layer in (0, 1):
        order = pir.const_array(model.graph.initializers[f"layers.{layer}.ffn.neuron_order"])
        frequency = pir.const_array(model.graph.initializers[f"layers.{layer}.ffn.frequency"])
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(frequency.size))
        assert np.all(np.diff(frequency[order]) <= 0)
    again, _, _ = partition(model)  # running twice replaces the tables
    assert len([n for n in again.graph.initializers if n.endswith("neuron_order")]) == 2


def test_budget_over_the_target_memory_is_a_user_error(lifted):
    model = with_frequencies(lifted())
    with pytest.raises(UserError) as error:
        partition(model, vram_budget_bytes=25 * GiB)
    assert str(25 * GiB) in str(error.value) and str(24 * GiB) in str(error.value)
    with pytest.raises(UserError, match="no GPU"):
        partition(model, target="cpu", vram_budget_bytes=GiB)


def test_pass_needs_the_profile(lifted):
    with pytest.raises(ValueError, match="profile"):
        partition(lifted())


def test_weights_are_priced_as_stored(lifted):
    """--weight-dtype fp16 halves what a cold neuron costs the CPU; the GPU's copy (and the budget) is fp16
    whatever the CPU's is."""
    model = with_frequencies(lifted())
    _, fp32, _ = partition(model, vram_budget_bytes=GiB)
    _, fp16, _ = partition(model, vram_budget_bytes=GiB, weight_dtype="fp16")
    assert (fp32["cpu_weight_format"], fp16["cpu_weight_format"]) == ("fp32", "fp16")
    assert fp32["gpu_weight_format"] == fp16["gpu_weight_format"] == "fp16"
    for key in ("dense_gpu_bytes", "kv_cache_bytes", "ffn_bytes", "budget_bytes"):
        assert fp32[key] == fp16[key], key
    d_model, ffn = 64, 256  # the tiny llama: gated, no biases
    assert fp32["ffn_bytes"] == 2 * ffn * 3 * d_model * 2


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
                       {"layer": layer, "activation": "relu", "gated": 0}, domain=pir.DOMAIN, name=p)
        graph.append(node)
        frequency = np.full(width, 0.9 if layer == hot_layer else 0.01, np.float32)
        pir.initializer(graph, f"{p}.frequency", frequency)
    return ir.Model(graph, ir_version=10)


def test_layers_are_matched_by_number_not_by_name_order():
    model = synthetic_ir(layers=12, width=64, d_model=16, hot_layer=10)
    per_layer = 64 * 2 * 16 * 2  # fp16 on the GPU
    dense = 12 * 64 * 4  # the frequency tables (vectors: fp32)
    budget = int((dense + per_layer + 1000) / 0.95) + 1  # room for one layer
    partition = Partition(vram_budget_bytes=budget, placement_batch=16, min_or_nothing=False, balance=False)
    model = partition.apply(model, Context(get_target("rtx4090"))).model
    placed = {pir.attr(n, "layer"): pir.attr(n, "gpu_neurons") for n in pir.nodes_in_domain(model, "FFN")}
    assert placed[10] == 64 and sum(placed.values()) == 64
    report = json.loads(model.metadata_props["picompile.placement"])
    assert report["layers"] == list(range(12)) and report["gpu_neurons"][10] == 64
