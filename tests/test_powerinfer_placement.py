"""PowerInfer's placement policy (powerinfer_placement), the baseline of the placement benchmarks:
its ILP is exact on small instances and its answers keep every constraint."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from passes.costmodel import sync_seconds
from benchmarks.powerinfer_placement import min_neurons_for, solve_placement
from passes.targets import GiB, get_target

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
