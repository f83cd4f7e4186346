"""The hybrid executor on a CPU-only machine (`--emulate-gpu`): the CPU and GPU programs run on two
threads that genuinely overlap, never deadlock, and give the same logits whatever the timing."""

from __future__ import annotations

import random
import threading
import time

import networkx as nx
import numpy as np
import pytest

from passes.partition import Partition
from runtime import Engine
from test_sparse import sparse_build

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def hybrid(tiny_models, tmp_path_factory):
    """Hot rows on the emulated GPU, cold rows on the CPU, in the same layers (as in test_sparse)."""
    files = tiny_models("opt", sparsity=0.9)
    greedy_split = {"partition": Partition(sync_latency_s=0.0, balance=False)}
    return sparse_build(files, tmp_path_factory.mktemp("hybrid") / "h.pic", target="rtx4090", all_neurons=True,
                        vram_budget_bytes=600_000, placement_batch=32, passes_override=greedy_split)


def decode_run(engine: Engine, steps: int = 6) -> list[np.ndarray]:
    engine.reset()
    outputs = [engine.forward(PROMPT)]
    for _ in range(steps):
        outputs.append(engine.forward([int(np.argmax(outputs[-1][-1]))]))
    return outputs


def wrap_steps(engine: Engine, wrapper) -> None:
    """Route every call of every program (decode's, and each prefill's as it is made) through wrapper(step, run)."""
    def wrap(steps):
        for step in steps:
            step.run = wrapper(step, step.run)
        return steps

    wrap(engine._decode)
    make_program = engine._program
    engine._program = lambda phase, rows: wrap(make_program(phase, rows))


def independent_pair(steps) -> tuple[int, int]:
    """A CPU call and a GPU call of a program with no dependency path between them (each device runs its
    calls in order; `waits` are the edges that cross devices)."""
    dag = nx.DiGraph()
    last: dict[str, int] = {}
    for index, step in enumerate(steps):
        dag.add_node(index)
        if step.device in last:
            dag.add_edge(last[step.device], index)
        last[step.device] = index
        dag.add_edges_from((wait, index) for wait in step.waits)
    closure = nx.transitive_closure_dag(dag)
    for i, cpu_step in enumerate(steps):
        for j, gpu_step in enumerate(steps):
            if (cpu_step.device, gpu_step.device) == ("cpu", "gpu") and not closure.has_edge(i, j) \
                    and not closure.has_edge(j, i):
                return i, j
    raise AssertionError("the hybrid schedule has no CPU call that could run beside a GPU call")


def test_cpu_and_gpu_programs_overlap(hybrid):
    """Two calls that the DAG lets run at once must meet at a barrier: if the executors took turns, the
    barrier would time out and the step would fail."""
    engine = Engine(hybrid, emulate_gpu=True)
    engine.forward(PROMPT)
    cpu_index, gpu_index = independent_pair(engine._decode)
    barrier = threading.Barrier(2, timeout=20)
    met: list[str] = []

    def meet(step, run):
        def at_barrier(position):
            barrier.wait()
            met.append(threading.current_thread().name)
            run(position)
        return at_barrier

    for index in (cpu_index, gpu_index):
        engine._decode[index].run = meet(engine._decode[index], engine._decode[index].run)
    engine.forward([3])
    assert len(met) == 2 and len(set(met)) == 2, met  # both calls were in flight at once, on two threads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_results_do_not_depend_on_timing(hybrid, seed):
    """Random delays before and after every call reorder the two executors' progress; a missing wait
    (a race on a copied or merged buffer) would change the logits. They stay bitwise equal."""
    expected = decode_run(Engine(hybrid, emulate_gpu=True))
    engine = Engine(hybrid, emulate_gpu=True)
    rng = random.Random(seed)
    lock = threading.Lock()

    def jitter(step, run):
        def delayed(position):
            with lock:
                before, after = rng.random() * 3e-4, rng.random() * 3e-4
            time.sleep(before)
            run(position)
            time.sleep(after)
        return delayed

    wrap_steps(engine, jitter)
    for got, want in zip(decode_run(engine), expected):
        np.testing.assert_array_equal(got, want)
