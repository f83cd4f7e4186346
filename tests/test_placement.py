"""picompile's placement program (passes/placement.py): exact against every plan on small problems, never worse
than layer offload, within the budget, and its own price of a plan is step_seconds'."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from passes import placement
from passes.placement import Block, Ffn, Layer, Plan, Problem


def random_problem(seed: int, budget_share: float | None = None, sparse: bool = True) -> Problem:
    """A few layers of a few neurons, with costs drawn so that every kind of plan can win somewhere."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(int(rng.integers(1, 4))):
        width = int(rng.integers(2, 7))
        bytes_per_neuron = int(rng.integers(50, 150))
        gpu_speedup = float(rng.uniform(2, 20))
        cpu_row = float(rng.uniform(0.5, 2.0))
        dense_cpu = width * cpu_row * float(rng.uniform(0.3, 1.2))
        ffn = Ffn(dense=Block(width * bytes_per_neuron, dense_cpu, dense_cpu / gpu_speedup), width=width,
                  gpu_bytes_per_neuron=bytes_per_neuron,
                  frequencies=rng.uniform(0, 1, width) if sparse else None,
                  predictor=Block(int(rng.integers(10, 60)), float(rng.uniform(0.05, 0.5)),
                                  float(rng.uniform(0.01, 0.05))) if sparse else None,
                  rows_per_active=float(rng.uniform(1.0, 2.5)), cpu_s_per_row=cpu_row,
                  gpu_s_per_row=cpu_row / gpu_speedup, part_launch=Block(0, 0.02, 0.05),
                  sync_s=float(rng.uniform(0.01, 0.6)))
        attention_cpu = float(rng.uniform(0.5, 3))
        layers.append(Layer(Block(int(rng.integers(100, 400)), attention_cpu, attention_cpu / gpu_speedup), ffn))
    embed = Block(int(rng.integers(100, 300)), 0.01, 0.012)
    head = Block(int(rng.integers(100, 500)), float(rng.uniform(0.5, 2)), float(rng.uniform(0.1, 0.3)))
    problem = Problem(embed, tuple(layers), head, float(rng.uniform(0.01, 0.3)), 0)
    whole = embed.gpu_bytes + head.gpu_bytes + sum(
        l.attention.gpu_bytes + l.ffn.dense.gpu_bytes + (l.ffn.predictor.gpu_bytes if sparse else 0) for l in layers)
    share = rng.uniform(0.05, 1.1) if budget_share is None else budget_share
    return Problem(embed, tuple(layers), head, problem.copy_s, int(whole * share))


def every_plan(problem: Problem, batch: int):
    per_layer = []
    for layer in problem.layers:
        ffn = layer.ffn
        options = [("gpu", ffn.width), ("cpu", 0)]
        if ffn.sparse:
            options += [("sparse", n) for n in sorted({*range(0, ffn.width, batch), ffn.width})]
        per_layer.append([(device, mode, n) for device in ("cpu", "gpu") for mode, n in options])
    for embed, head in itertools.product(("cpu", "gpu"), repeat=2):
        for choice in itertools.product(*per_layer):
            yield Plan(embed, [c[0] for c in choice], [c[1] for c in choice], [c[2] for c in choice], head)


def best_by_enumeration(problem: Problem, batch: int) -> float:
    return min(placement.step_seconds(problem, plan) for plan in every_plan(problem, batch)
               if placement.gpu_bytes_used(problem, plan) <= problem.budget_bytes)


@pytest.mark.parametrize("seed", range(24))
def test_program_equals_enumeration(seed):
    problem = random_problem(seed, sparse=seed % 4 != 3)
    batch = 1 + seed % 2
    solved = placement.solve(problem, batch=batch, mip_rel_gap=0.0)
    assert placement.gpu_bytes_used(problem, solved.plan) <= problem.budget_bytes
    assert solved.seconds == pytest.approx(placement.step_seconds(problem, solved.plan))
    assert solved.seconds == pytest.approx(best_by_enumeration(problem, batch), rel=1e-6)
    if solved.num_variables:  # the program prices its answer as step_seconds does
        assert solved.program_seconds == pytest.approx(solved.seconds, rel=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_never_slower_than_layer_offload_or_the_cpu_alone(seed):
    for share in (0.0, 0.1, 0.3, 0.6, 0.9, 1.2):
        problem = random_problem(100 + seed, budget_share=share)
        solved = placement.solve(problem, batch=1)
        for baseline in (placement.layer_offload(problem), placement.cpu_only(problem), placement.cpu_dense(problem)):
            assert placement.gpu_bytes_used(problem, baseline) <= max(problem.budget_bytes, 0)
            assert solved.seconds <= placement.step_seconds(problem, baseline) + 1e-12
        # whose plan it took: the solve's, or the baseline it did not beat (the same plan, the same price)
        if solved.chosen != "solve":
            chosen = placement.baselines(problem)[solved.chosen]
            assert solved.plan == chosen and solved.seconds == placement.step_seconds(problem, chosen)
        assert Plan.from_json(solved.plan.to_json()) == solved.plan
    assert placement.solve(random_problem(100 + seed, budget_share=0.0), batch=1).chosen == "CPU only"


def test_more_budget_is_never_slower():
    times = [placement.solve(random_problem(7, budget_share=share), batch=1, mip_rel_gap=0.0).seconds
             for share in np.linspace(0, 1.2, 9)]
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:]))
    assert times[-1] < times[0]


def test_dense_blocks_go_to_the_gpu_before_the_ffn_budget_exists():
    """A budget below the attention blocks' total (PowerInfer's policy would place nothing: its FFN budget is
    what the whole dense part leaves) still holds some attention blocks or hot neurons, and pays off."""
    problem = random_problem(3, budget_share=1.0)
    attention = sum(l.attention.gpu_bytes for l in problem.layers)
    small = Problem(problem.embed, problem.layers, problem.head, problem.copy_s, attention // 2)
    solved = placement.solve(small, batch=1)
    assert 0 < solved.used_bytes <= small.budget_bytes
    assert solved.seconds < placement.step_seconds(small, placement.cpu_only(small))


def test_without_dense_ffns_every_predicted_layer_runs_sparse():
    for seed in range(4):
        problem = random_problem(200 + seed)
        plan = placement.solve(problem, batch=1, dense_ffns=False).plan
        assert plan.ffn == ["sparse"] * len(problem.layers)


def test_layer_offload_takes_the_last_whole_layers():
    problem = random_problem(11, budget_share=1.0)
    sizes = [l.attention.gpu_bytes + l.ffn.dense.gpu_bytes for l in problem.layers]
    budget = sizes[-1] + (sizes[-2] // 2 if len(sizes) > 1 else 0)
    plan = placement.layer_offload(Problem(problem.embed, problem.layers, problem.head, problem.copy_s, budget))
    assert plan.attention[-1] == "gpu" and plan.ffn[-1] == "gpu" and plan.attention[:-1] == ["cpu"] * (len(sizes) - 1)
    assert plan.head == plan.embed == "cpu"


def test_bad_inputs_are_refused():
    problem = random_problem(1)
    with pytest.raises(ValueError, match="batch"):
        placement.solve(problem, batch=0)
    bad = Ffn(dense=Block(10, 1.0, 0.1), width=2, frequencies=np.array([0.5, np.nan]), predictor=Block(1, 0.1, 0.01))
    with pytest.raises(ValueError, match="finite"):
        placement.solve(Problem(problem.embed, (Layer(Block(1, 1.0, 0.1), bad),), problem.head, 0.1, 100))
