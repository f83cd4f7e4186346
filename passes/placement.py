"""The placement program: where every block of a decoder lives, as one integer program (no IR here).

A decode step runs the blocks in order: the embedding, per layer its attention block (with its norms, residual
adds and the FFN's merge, which run where the residual stream is) and its FFN, then the output layer. Each
block is priced on both devices (`Block`: its GPU memory and its decode seconds on each); an FFN layer runs one
of three ways:
  - sparse: its predictor runs with the attention block, its hottest `gpu_neurons` on the GPU and the rest on
    the CPU, both parts at once (the step waits for the slower), each reading the rows its predictor selects;
  - dense on the GPU or dense on the CPU: every row, no predictor (what llama.cpp-style layer offload runs).
Moving the residual stream between devices costs one copy; an FFN whose neurons are not all on the residual's
device costs one synchronisation (its input there, the selection, its partial output back).

`solve` minimises the step's expected seconds subject to the GPU memory budget, with HiGHS; the baselines
(`baselines`) are the CPU alone and `layer_offload` (the last k whole layers on the GPU, dense, as many as fit, then
the output layer); the cost model's `step_seconds` prices any plan (the program is its linear form), so they are
compared like for like. The best baseline is one of the program's feasible plans and its start, and the solve's
answer is checked against it after, so the plan is never slower than either (`Solution.chosen` says whose it is).
The problem's types (`Block`, `Ffn`, `Layer`, `Problem`, `Plan`) are the cost model's, importable from here.

Formulation (per layer l; x[l,g] = "neuron group g on the GPU", groups are the frequency-sorted batches):
  binaries a[l] (attention on the GPU), dg[l] / dc[l] (dense FFN on the GPU / CPU), w[l] (predictor on the
  GPU), x[l,g], e and h (embedding, output layer on the GPU); continuous M[l] (the FFN's time), k[l] (a sync),
  t (residual moves). Minimise
      sum of each dense block's seconds on its device + predictor seconds + sum M[l] + sync * k[l] + copy * t
  subject to
      memory:     GPU bytes of everything placed there <= budget;
      prefix:     x[l,g+1] <= x[l,g] (the GPU part is the hottest neurons);
      modes:      dg <= x[l,last], x[l,0] <= 1 - dc, dg + dc <= 1 (= 1 without a predictor);
      predictor:  w = a and sparse, written w <= a, w <= 1 - dg - dc, w >= a - dg - dc;
      FFN time:   M >= GPU part (launch + selected rows) and M >= CPU part; the dense modes replace them
                  by the dense time (big-M terms that are exact: the coefficients are the parts' totals);
      sync:       k >= a - x[l,last], k >= x[l,0] - a;   moves: t >= |a[l] - a[l+1]| (and embedding, head).
  Exact reduction: in a split layer the step waits for the slower part, so past the first prefix whose GPU part
  is the slower one, longer (non-whole) prefixes cost more time and memory: those batches are one group, taken
  only with the whole layer.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

# a plan and its price are the cost model's (one function prices every plan: `costmodel.step_seconds`); the
# names stay importable from here, where the program that chooses the plan lives
from .costmodel import (Block, Ffn, Layer, Plan, Problem, gpu_bytes_used, hottest_first, part_seconds,  # noqa: F401 (re-exported)
                        step_seconds, whole_ffn_seconds)

DEVICES = ("cpu", "gpu")
TIME_UNIT_S = 1e-3  # the program's unit of time


@dataclass
class Solution:
    plan: Plan
    seconds: float  # the plan's expected decode step (`step_seconds`)
    used_bytes: int
    status: str  # HiGHS's model status, or why there was nothing to solve
    gap: float  # HiGHS's relative MIP gap (inf where it stopped without a bound)
    solve_time_s: float
    num_variables: int
    program_seconds: float | None = None  # the program's own price of the plan (None: nothing was solved)
    chosen: str = "solve"  # whose plan it is: the solve's, or the baseline it did not beat (`BASELINES`)



def cpu_only(problem: Problem, dense_ffns: bool = True) -> Plan:
    """Everything on the CPU; sparse FFNs where they have a predictor and, if `dense_ffns`, cost less than dense."""
    modes = []
    for layer in problem.layers:
        sparse, dense = whole_ffn_seconds(layer.ffn, "cpu")
        modes.append("sparse" if layer.ffn.sparse and (sparse < dense or not dense_ffns) else "cpu")
    n = len(problem.layers)
    return Plan("cpu", ["cpu"] * n, modes, [0] * n, "cpu")


def cpu_dense(problem: Problem) -> Plan:
    """The CPU alone, every FFN dense: what the estimate calls "CPU only"."""
    n = len(problem.layers)
    return Plan("cpu", ["cpu"] * n, ["cpu"] * n, [0] * n, "cpu")


def baselines(problem: Problem, dense_ffns: bool = True) -> dict[str, Plan]:
    """The plans a solve must beat, by name: the CPU alone (sparse FFNs where cheaper) and, where FFNs may run
    dense, llama.cpp-style layer offload."""
    return {"CPU only": cpu_only(problem, dense_ffns), **({"layer offload": layer_offload(problem)} if dense_ffns else {})}


def layer_offload(problem: Problem) -> Plan:
    """llama.cpp-style offload: the last k whole layers (attention and dense FFN) on the GPU, as many as fit, and
    the output layer too once every layer is there; the embedding stays on the CPU, every FFN is dense."""
    n = len(problem.layers)
    sizes = [layer.attention.gpu_bytes + layer.ffn.dense.gpu_bytes for layer in problem.layers]
    k, used = 0, 0
    while k < n and used + sizes[n - 1 - k] <= problem.budget_bytes:
        used += sizes[n - 1 - k]
        k += 1
    head = "gpu" if k == n and used + problem.head.gpu_bytes <= problem.budget_bytes else "cpu"
    on_gpu = [i >= n - k for i in range(n)]
    return Plan("cpu", ["gpu" if g else "cpu" for g in on_gpu], ["gpu" if g else "cpu" for g in on_gpu],
                [layer.ffn.width if g else 0 for layer, g in zip(problem.layers, on_gpu)], head)


# ---------------------------------------------------------------- the integer program


@dataclass
class _Groups:
    """One sparse layer's neuron groups (frequency-sorted batches, the batches past the balance point merged)."""

    size: np.ndarray  # neurons per group
    gpu_s: np.ndarray  # the group's selected rows' seconds on the GPU
    cpu_s: np.ndarray  # ... on the CPU


def _groups(ffn: Ffn, batch: int) -> _Groups:
    if not ffn.sparse:
        return _Groups(np.array([ffn.width]), np.zeros(1), np.zeros(1))
    f = hottest_first(ffn.frequencies)
    starts = np.arange(0, f.size, batch)
    ends = np.append(starts[1:], f.size)
    value = np.add.reduceat(f, starts) * ffn.rows_per_active
    gpu, cpu = value * ffn.gpu_s_per_row, value * ffn.cpu_s_per_row
    # the first split prefix whose GPU part is the slower: later split prefixes only cost more (see the module doc)
    prefix_gpu = ffn.part_launch.gpu_s + np.cumsum(gpu)
    rest_cpu = ffn.part_launch.cpu_s + cpu.sum() - np.cumsum(cpu)
    crossing = int(np.argmax(prefix_gpu >= rest_cpu)) if np.any(prefix_gpu >= rest_cpu) else starts.size - 1
    keep = crossing + 1  # batches 0..crossing stand alone; the rest form one group (the whole layer)
    if keep < starts.size - 1:
        size = np.append(ends[:keep] - starts[:keep], f.size - ends[keep - 1])
        gpu = np.append(gpu[:keep], gpu[keep:].sum())
        cpu = np.append(cpu[:keep], cpu[keep:].sum())
    else:
        size = ends - starts
    return _Groups(size, gpu, cpu)


class _Program:
    """A HiGHS model built column by column and row by row (sparse rows)."""

    def __init__(self):
        self.cost, self.lower, self.upper, self.integer = [], [], [], []
        self.rows = []  # (columns, values, lower, upper)

    def column(self, cost: float = 0.0, upper: float = 1.0, integer: bool = True) -> int:
        self.cost.append(float(cost))
        self.lower.append(0.0)
        self.upper.append(float(upper))
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, terms: dict[int, float], lower: float = -math.inf, upper: float = math.inf) -> None:
        columns = [c for c, v in terms.items() if v != 0.0]
        self.rows.append((columns, [float(terms[c]) for c in columns], float(lower), float(upper)))

    def complete(self, start: np.ndarray) -> np.ndarray:
        """`start` with each continuous column that is the only one of its rows at the least value they allow (the
        others as `start` has them): a MIP start HiGHS takes as it is."""
        values = start.copy()
        continuous = ~np.asarray(self.integer)
        rows = [(row, [(c, v) for c, v in zip(row[0], row[1]) if continuous[c]]) for row in self.rows]
        for _, free in rows:
            if len(free) == 1:
                values[free[0][0]] = 0.0
        for (columns, coefficients, lower, upper), free in rows:
            if len(free) != 1:
                continue
            (column, coefficient), = free
            rest = sum(v * values[c] for c, v in zip(columns, coefficients) if c != column)
            bound = (upper - rest) / coefficient if coefficient < 0 else (lower - rest) / coefficient
            values[column] = max(values[column], bound)
        return values

    def solve(self, start: np.ndarray, time_limit_s: float, mip_rel_gap: float, threads: int | None,
              offset: float = 0.0):
        import highspy

        h = getattr(highspy, "_Highs", highspy.Highs)()  # the plain class: the wrapper prints a banner
        h.setOptionValue("output_flag", bool(os.environ.get("PICOMPILE_HIGHS_LOG")))
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("threads", int(threads or os.cpu_count() or 1))
        n = len(self.cost)
        h.addVars(n, np.asarray(self.lower), np.asarray(self.upper))
        integers = np.flatnonzero(self.integer).astype(np.int32)
        h.changeColsIntegrality(integers.size, integers,
                                np.full(integers.size, highspy.HighsVarType.kInteger.value, np.uint8))
        h.changeColsCost(n, np.arange(n, dtype=np.int32), np.asarray(self.cost))
        h.changeObjectiveOffset(float(offset))  # so that the relative gap is of the whole objective
        starts, index, value = [], [], []
        for columns, values, _, _ in self.rows:
            starts.append(len(index))
            index += columns
            value += values
        h.addRows(len(self.rows), np.array([r[2] for r in self.rows]), np.array([r[3] for r in self.rows]),
                  len(index), np.asarray(starts, np.int32), np.asarray(index, np.int32), np.asarray(value))
        warm = highspy.HighsSolution()
        warm.col_value = start.tolist()
        h.setSolution(warm)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        info = h.getInfo()
        solution = np.asarray(h.getSolution().col_value) if info.primal_solution_status != 0 else start
        return status, float(info.mip_gap), solution


@dataclass
class _Side:
    """A layer's columns for one attention device (the formulation is split by it, see `solve`)."""

    x: list[int]  # neuron groups on the GPU, hottest first
    dg: int  # dense FFN on the GPU
    dc: int  # dense FFN on the CPU
    M: int  # the FFN's time


@dataclass
class _Columns:
    a: int  # attention on the GPU
    sides: dict[str, _Side]  # "gpu": the layer's columns when a = 1, "cpu": when a = 0
    groups: _Groups


def default_batch(widths) -> int:
    """Neurons per program column unless the build says otherwise: 64 per 8,192 neurons of the widest layer, so
    that a layer has at most 128 groups (at 70B shapes, batches of 64 left HiGHS at a 0.3% gap after 30 s, and
    found worse plans than batches of 256 solved to optimality in 10 s)."""
    return 64 * max(1, math.ceil(max(widths, default=0) / 8192))


def solve(problem: Problem, *, batch: int | None = None, time_limit_s: float = 30.0, mip_rel_gap: float = 1e-3,
          threads: int | None = None, dense_ffns: bool = True) -> Solution:
    """The plan of least expected step time whose GPU blocks fit `problem.budget_bytes` (see the module doc).
    `dense_ffns` False: a layer with a predictor always runs sparse (what --all-neurons and --no-dense-fallback ask).

    The program is written split by each layer's attention device (its FFN columns twice, one copy zero unless
    that device is chosen) and with the residual's moves as a path (one column per pair of consecutive devices):
    each layer's sync and moves are then linear in the columns, not bounds on them, and the LP relaxation is as
    tight as the memory row allows (with |a - b| bounds it let half of every layer on each device, costing no
    copies, and HiGHS ran into the time limit at 70B shapes)."""
    started = time.perf_counter()
    batch = default_batch(layer.ffn.width for layer in problem.layers) if batch is None else batch
    if batch < 1:
        raise ValueError(f"batch must be >= 1, not {batch}")
    starts = baselines(problem, dense_ffns)
    best = min(starts, key=lambda name: step_seconds(problem, starts[name]))
    baseline = starts[best]
    if problem.budget_bytes <= 0:
        return _solution(problem, starts["CPU only"], "no GPU budget", 0.0, started, 0, chosen="CPU only")

    p = _Program()
    ms = lambda seconds: seconds / TIME_UNIT_S  # the program's times: well scaled for HiGHS's tolerances
    memory: dict[int, float] = {}
    e = p.column(ms(problem.embed.gpu_s - problem.embed.cpu_s))
    h = p.column(ms(problem.head.gpu_s - problem.head.cpu_s))
    memory[e], memory[h] = problem.embed.gpu_bytes, problem.head.gpu_bytes
    constant = ms(problem.embed.cpu_s + problem.head.cpu_s)
    layers: list[_Columns] = []
    for layer in problem.layers:
        ffn = layer.ffn
        groups = _groups(ffn, batch)
        a = p.column(ms(layer.attention.gpu_s - layer.attention.cpu_s))
        memory[a] = layer.attention.gpu_bytes
        constant += ms(layer.attention.cpu_s)
        G, C = ms(float(groups.gpu_s.sum())), ms(float(groups.cpu_s.sum()))
        Lg, Lc = (ms(ffn.part_launch.gpu_s), ms(ffn.part_launch.cpu_s)) if ffn.sparse else (0.0, 0.0)
        sides = {}
        for device in DEVICES:
            # on(): this side's indicator as terms of a row, a for "gpu" and 1 - a for "cpu" (constant, a's coefficient)
            on = (0.0, 1.0) if device == "gpu" else (1.0, -1.0)
            predictor = ms(ffn.predictor.seconds(device)) if ffn.sparse else 0.0
            # the predictor runs unless the FFN is dense: its cost is on(side) - dg - dc, times its seconds
            x = [p.column() for _ in groups.size]
            fixed = 0.0 if ffn.sparse and not dense_ffns else 1.0
            dg, dc = p.column(-predictor, upper=fixed), p.column(-predictor, upper=fixed)
            constant += on[0] * predictor
            p.cost[a] += on[1] * predictor
            M = p.column(1.0, upper=math.inf, integer=False)
            for c, size in zip(x, groups.size):
                memory[c] = ffn.gpu_bytes_per_neuron * int(size) if ffn.sparse else ffn.dense.gpu_bytes
            if ffn.sparse and device == "gpu":  # the predictor's GPU memory: a - dg - dc
                memory[a] = memory[a] + ffn.predictor.gpu_bytes
                memory[dg] = memory[dc] = -ffn.predictor.gpu_bytes
            for hotter, colder in zip(x, x[1:]):
                p.row({colder: 1, hotter: -1}, upper=0)  # prefix
            p.row({dg: 1, x[-1]: -1}, upper=0)  # dense on the GPU: every group there
            p.row({x[0]: 1, dc: 1, a: -on[1]}, upper=on[0])  # dense on the CPU: none; neither on the other side
            if ffn.sparse:
                p.row({dg: 1, dc: 1, a: -on[1]}, upper=on[0])
            else:
                p.row({dg: 1, dc: 1, a: -on[1]}, lower=on[0], upper=on[0])
            gpu_row = {c: ms(float(v)) for c, v in zip(x, groups.gpu_s)}
            gpu_row[x[0]] = gpu_row.get(x[0], 0.0) + Lg
            gpu_row[dg] = -(G + Lg - ms(ffn.dense.gpu_s))
            gpu_row[M] = -1.0
            p.row(gpu_row, upper=0)  # M >= the GPU part, or the dense GPU time
            cpu_row = {c: -ms(float(v)) for c, v in zip(x, groups.cpu_s)}
            cpu_row[x[-1]] = cpu_row.get(x[-1], 0.0) - Lc
            cpu_row[dc] = -(C + Lc - ms(ffn.dense.cpu_s))
            cpu_row[M] = -1.0
            cpu_row[a] = cpu_row.get(a, 0.0) + (C + Lc) * on[1]
            p.row(cpu_row, upper=-(C + Lc) * on[0])  # M >= the CPU part (on this side), or the dense CPU time
            # a sync: attention on the GPU and a CPU part (a - x[-1]), or on the CPU and a GPU part (x[0])
            if device == "gpu":
                p.cost[a] += ms(ffn.sync_s)
                p.cost[x[-1]] -= ms(ffn.sync_s)
            else:
                p.cost[x[0]] += ms(ffn.sync_s)
            sides[device] = _Side(x, dg, dc, M)
        layers.append(_Columns(a, sides, groups))
    # the residual's path: u[i][j] = "this block on device i, the next on j"; a move costs one copy
    chain = [e, *(c.a for c in layers), h]
    moves = []
    for u, v in zip(chain, chain[1:]):
        pair = {(i, j): p.column(ms(problem.copy_s) if i != j else 0.0, upper=math.inf, integer=False)
                for i in (0, 1) for j in (0, 1)}
        p.row({pair[1, 0]: 1, pair[1, 1]: 1, u: -1}, lower=0, upper=0)
        p.row({pair[0, 0]: 1, pair[0, 1]: 1, u: 1}, lower=1, upper=1)
        p.row({pair[0, 1]: 1, pair[1, 1]: 1, v: -1}, lower=0, upper=0)
        moves.append(pair)
    unit = max(memory.values()) or 1.0  # HiGHS warns of rows with 1e10 coefficients
    p.row({c: b / unit for c, b in memory.items()}, upper=problem.budget_bytes / unit)

    start = p.complete(_columns_of(baseline, problem, layers, chain, moves, len(p.cost)))
    status, gap, values = p.solve(start, time_limit_s, mip_rel_gap, threads, offset=constant)
    plan, chosen = _plan_of(values, problem, layers, e, h), "solve"
    # never behind a baseline by the cost model's own price (the start is the best of them, so only HiGHS's
    # tolerances could put the answer behind it)
    if step_seconds(problem, plan) > step_seconds(problem, baseline) or gpu_bytes_used(problem, plan) > problem.budget_bytes:
        plan, chosen = baseline, best
    solution = _solution(problem, plan, status, gap, started, len(p.cost), chosen)
    # the program's own price of its answer: step_seconds of the plan, up to HiGHS's tolerances
    solution.program_seconds = (constant + float(np.dot(p.cost, values))) * TIME_UNIT_S
    return solution


def _columns_of(plan: Plan, problem: Problem, layers: list[_Columns], chain: list[int], moves: list[dict],
                n: int) -> np.ndarray:
    """The program's columns for `plan` (the MIP start): its integers and moves; the FFN times: `_Program.complete`."""
    v = np.zeros(n)
    v[chain[0]], v[chain[-1]] = plan.embed == "gpu", plan.head == "gpu"
    for i, (columns, layer) in enumerate(zip(layers, problem.layers)):
        device = plan.attention[i]
        v[columns.a] = device == "gpu"
        side = columns.sides[device]
        mode = plan.ffn[i]
        v[side.dg], v[side.dc] = mode == "gpu", mode == "cpu"
        if mode == "gpu" or (mode == "sparse" and plan.gpu_neurons[i] >= layer.ffn.width):
            v[side.x] = 1
        elif mode == "sparse":
            v[side.x] = np.cumsum(columns.groups.size) <= plan.gpu_neurons[i]
    for u, w, pair in zip(chain, chain[1:], moves):
        v[pair[int(v[u]), int(v[w])]] = 1
    return v


def _plan_of(values: np.ndarray, problem: Problem, layers: list[_Columns], e: int, h: int) -> Plan:
    on = lambda c: bool(values[c] > 0.5)
    attention, modes, counts = [], [], []
    for columns, layer in zip(layers, problem.layers):
        device = "gpu" if on(columns.a) else "cpu"
        attention.append(device)
        side = columns.sides[device]
        if on(side.dg):
            modes.append("gpu")
            counts.append(layer.ffn.width)
        elif on(side.dc):
            modes.append("cpu")
            counts.append(0)
        else:
            modes.append("sparse")
            chosen = np.array([on(c) for c in side.x])
            prefix = chosen.size if chosen.all() else int(np.argmin(chosen))
            counts.append(int(columns.groups.size[:prefix].sum()))
    return Plan("gpu" if on(e) else "cpu", attention, modes, counts, "gpu" if on(h) else "cpu")


def _solution(problem: Problem, plan: Plan, status: str, gap: float, started: float, variables: int,
              chosen: str = "solve") -> Solution:
    return Solution(plan, step_seconds(problem, plan), gpu_bytes_used(problem, plan), status, gap,
                    time.perf_counter() - started, variables, chosen=chosen)
