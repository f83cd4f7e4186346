"""PowerInfer's neuron placement policy (SOSP '24, section "Neuron placement policy") as a 0-1 integer program,
solved by HiGHS: the FFN neurons alone, for a GPU budget left after the whole dense part. picompile's own
placement (`passes.placement`) places every block in one program; this one is kept as the baseline the
placement benchmarks compare with (`benchmarks/bench_placement.py` times it at real shapes).

Fixed against the public code: variables are declared binary (its unbounded integers are rightly reported
unbounded by HiGHS) and layers are taken in numeric order (its string sort put activation_10 before activation_2).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

@dataclass
class Placement:
    gpu_neurons: list[int]  # per layer: how many of its hottest neurons go to the GPU (a multiple of batch, or all)
    status: str  # HiGHS model status as text, e.g. "Optimal", "Time limit reached", or "no GPU budget"
    objective: float  # total activation frequency placed on the GPU
    gap: float  # relative MIP gap: HiGHS's (<= mip_rel_gap when "Optimal", 0.0 when proven exactly); when
    #             HiGHS stops early, at most the gap to the LP bound
    solve_time_s: float  # wall time of the whole call: model building, greedy start and HiGHS
    num_variables: int  # binaries of the formulation (x per group of tied batches, y per layer)
    used_bytes: int
    min_neurons: list[int] = field(default_factory=list)  # the per-layer minimum as applied (clamped to the layer)


@dataclass
class _Model:
    """The integer program's columns: per layer, its frequency-sorted batches merged into groups of
    batches that the constraints force on or off together; group k belongs to layer[k]."""

    sorted_frequencies: list[np.ndarray]
    offsets: np.ndarray  # first group of each layer, plus the total at the end
    layer: np.ndarray  # layer of each group
    size: np.ndarray  # neurons in each group
    value: np.ndarray  # sum of the group's frequencies (expected active neurons per token)
    bytes: np.ndarray  # bytes of the group
    minimum: np.ndarray  # per layer: min-or-nothing count, clamped to [0, layer size]
    balance: dict  # layer -> (columns, values, upper) of its balance row (4), when balance applies


def _layout(frequencies: list[np.ndarray], bytes_per_neuron: list[int], batch: int,
            min_neurons: list[int] | None, g: float, c: float) -> _Model:
    """Sort, batch, and merge tied batches: (3) ties a layer's first batches up to its minimum, and (4)
    ties the batches past the longest prefix it allows (only the whole layer may take them)."""
    share = g / (g + c) if g > 0 and c > 0 else None
    minimum = np.zeros(len(frequencies), np.int64)
    sorted_f, columns, balance, counts = [], [], {}, []
    for index, f in enumerate(frequencies):
        f = np.asarray(f, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(f)) or (f.size and f.min() < 0):
            raise ValueError(f"layer {index}: frequencies must be finite and non-negative")
        f = -np.sort(-f)  # hottest first
        sorted_f.append(f)
        if min_neurons is not None:
            minimum[index] = min(max(int(min_neurons[index]), 0), f.size)
        if f.size == 0:
            counts.append(0)
            continue
        starts = np.arange(0, f.size, batch)
        ends = np.append(starts[1:], f.size)  # neurons in the prefix ending with each batch
        value = np.add.reduceat(f, starts)
        tied = np.zeros(starts.size, bool)  # batch b is on the GPU exactly when batch b-1 is
        first = int(np.searchsorted(ends, max(int(minimum[index]), 1))) + 1  # batches in the minimum part
        tied[1:first] = True
        cap = None
        if share is not None:
            # (4) with A_b the expected active neurons of batch b (the bytes per neuron cancel):
            #   g * sum_b A_b x_b  <=  c * sum_b A_b (1 - x_b)  +  g * A(minimum part)  +  M * x_last,
            # divided by (g + c); M = g * A(layer) exempts a layer placed entirely on the GPU. The
            # coefficients are frequencies, not nanoseconds (HiGHS drops matrix entries below 1e-9).
            total = float(value.sum())
            cap = (1 - share) * total + share * float(value[:first].sum())
            # The hot part grows with the prefix: (4) allows prefixes up to some batch, then only all.
            allowed = int(np.searchsorted(np.cumsum(value), cap * (1 + 1e-9) + 1e-12, side="right"))
            tied[max(allowed, first) + 1:] = True
        heads = np.flatnonzero(~tied)
        group_ends = np.append(heads[1:], starts.size)
        size = ends[group_ends - 1] - starts[heads]
        group_value = np.add.reduceat(value, heads)
        nbytes = size.astype(np.float64) * bytes_per_neuron[index]
        columns.append((np.full(heads.size, index), size, group_value, nbytes))
        if cap is not None:
            row = group_value.copy()
            row[-1] -= share * total
            balance[index] = (sum(counts) + np.arange(heads.size), row, cap)
        counts.append(heads.size)
    cat = lambda k, dtype: np.concatenate([c[k] for c in columns]).astype(dtype) if columns else np.zeros(0, dtype)
    return _Model(sorted_f, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), cat(0, np.int64),
                  cat(1, np.int64), cat(2, np.float64), cat(3, np.float64), minimum, balance)


def _greedy(M: _Model, budget: float) -> np.ndarray:
    """A feasible start: take groups by value per byte across layers. Within a layer the value per byte
    never grows, so a stable sort visits each layer's groups in order; a group that does not fit closes
    its layer (later ones would break the prefix), smaller groups of other layers may still fit."""
    density = np.divide(M.value, M.bytes, out=np.zeros_like(M.value), where=M.bytes > 0)
    for l in range(len(M.sorted_frequencies)):  # exact ties may round either way
        lo, hi = M.offsets[l], M.offsets[l + 1]
        density[lo:hi] = np.minimum.accumulate(density[lo:hi])
    next_group = M.offsets[:-1].copy()
    closed = np.zeros(len(M.sorted_frequencies), bool)
    x = np.zeros(M.size.size)
    used = 0.0
    for k in np.lexsort((np.arange(M.size.size), -density)):
        l = M.layer[k]
        if closed[l] or k != next_group[l]:
            continue
        if used + M.bytes[k] <= budget:
            x[k] = 1
            used += M.bytes[k]
            next_group[l] = k + 1
        else:
            closed[l] = True
    return x


def _bound_and_fixings(M: _Model, budget: float, incumbent: np.ndarray, value: float):
    """The LP bound and the variables it proves fixed (reduced-cost fixing, done by hand).

    Within a layer the groups' value per byte never grows, so the LP relaxation is the fractional
    greedy: take groups by value per byte until one does not fit, then a fraction of that one, whose
    value per byte is the price lam of a byte. The bound is UB = lam * budget + sum_l best_l, with best_l
    = max_k (V_l(k) - lam W_l(k)) over the layer's prefixes of k groups (value V, bytes W). Forcing
    x[l,g] on (a prefix longer than g) or off (a prefix shorter than g+1) lowers that bound by the loss
    in best_l; where the lowered bound is below the incumbent's value, no better placement has that
    setting, so the variable is fixed the other way. Fixed sets are a prefix (on) and a suffix (off) of
    each layer, and never contradict the incumbent."""
    density = np.divide(M.value, M.bytes, out=np.zeros_like(M.value), where=M.bytes > 0)
    for l in range(len(M.sorted_frequencies)):
        lo, hi = M.offsets[l], M.offsets[l + 1]
        density[lo:hi] = np.minimum.accumulate(density[lo:hi])
    order = np.lexsort((np.arange(M.size.size), -density))
    filled = np.cumsum(M.bytes[order])
    cut = int(np.searchsorted(filled, budget, side="right"))  # groups that fit whole
    lam = 0.0 if cut == order.size else float(density[order[cut]])
    best = np.zeros(len(M.sorted_frequencies))
    fix_on = np.zeros(M.size.size, bool)
    fix_off = np.zeros(M.size.size, bool)
    losses = []
    for l in range(len(M.sorted_frequencies)):
        lo, hi = M.offsets[l], M.offsets[l + 1]
        score = np.concatenate([[0.0], np.cumsum(M.value[lo:hi] - lam * M.bytes[lo:hi])])  # prefixes of k groups
        best[l] = score.max()
        longer = np.maximum.accumulate(score[::-1])[::-1][1:]  # best prefix including group j
        shorter = np.maximum.accumulate(score)[:-1]  # best prefix excluding group j
        losses.append((lo, hi, best[l] - longer, best[l] - shorter))
    upper = lam * budget + float(best.sum())
    slack = upper - value + 1e-9 * max(1.0, abs(upper))  # a fixing must cost more than this
    for lo, hi, loss_on, loss_off in losses:
        fix_off[lo:hi] = (loss_on > slack) & (incumbent[lo:hi] < 0.5)
        fix_on[lo:hi] = (loss_off > slack) & (incumbent[lo:hi] > 0.5)
    return upper, fix_on, fix_off


def solve_placement(frequencies: list[np.ndarray], bytes_per_neuron: list[int], budget_bytes: int, *,
                    batch: int = 64, min_neurons: list[int] | None = None, time_limit_s: float = 30.0,
                    gpu_time_per_byte: float = 0.0, cpu_time_per_byte: float = 0.0,
                    mip_rel_gap: float = 1e-3, threads: int | None = None,
                    highs_options: dict | None = None) -> Placement:
    """PowerInfer's neuron placement as a 0-1 integer program, solved by HiGHS.

    Each layer's neurons are sorted by frequency, hottest first (`frequencies[l]` is layer l, in numeric
    layer order), and grouped in batches of `batch` (the last may be smaller); one binary x[l,b] per batch
    says "on the GPU". Maximise the frequency placed on the GPU, sum f(l,b) x[l,b], subject to
      (1) memory:   sum bytes(l,b) x[l,b] <= budget_bytes;
      (2) prefix:   x[l,b+1] <= x[l,b]: a layer's GPU part is its hottest neurons;
      (3) minimum-or-nothing (when min_neurons is given): a binary y[l] with
          sum_b size(l,b) x[l,b] >= min_neurons[l] y[l] and x[l,0] <= y[l] (with (2) that bounds every
          x[l,b]): a layer's GPU part, if any, has at least min_neurons[l] neurons, fewer would not pay
          for the CPU-GPU synchronisation. A minimum above the layer's size means "all or nothing";
      (4) balance (only when gpu_time_per_byte and cpu_time_per_byte are both > 0: seconds per byte of an
          active neuron's weights, i.e. 1 / bandwidth): per layer, the GPU's expected time for its hot part
          must not exceed the CPU's expected time for its cold part plus the GPU's time for one minimum GPU
          part (the layer's smallest allowed prefix), so that neither side idles long waiting for the
          other. A layer placed entirely on the GPU is exempt: it has no CPU part to wait for.

    Two exact reductions keep HiGHS fast (in HiGHS 1.16 a 36k-binary model of this shape spent 12 s in
    presolve probing, and its root rounding heuristics, quadratic in the columns here, ran past the time
    limit for minutes):
      - batches that (3) and (4) force on or off together share one variable: a layer's minimum part, and
        the batches past the longest prefix (4) allows (a batch's expected time is proportional to its
        frequencies, so (4) allows exactly the prefixes up to some batch, plus the whole layer);
      - variables that the LP bound proves fixed, given a greedy placement, are fixed before the solve
        (`_bound_and_fixings`); HiGHS solves the rest, all rows (1)-(4) included, from the greedy start.
    `num_variables` counts the formulation's binaries after merging (groups x, plus y); the log of a
    solve (PICOMPILE_HIGHS_LOG=1) shows how many were left free. Non-optimal results keep HiGHS's status
    text and gap; the placement is always feasible (at worst the greedy one).
    Budget <= 0 or no layers: everything on the CPU, status "no GPU budget".
    """
    started = time.perf_counter()
    if len(bytes_per_neuron) != len(frequencies):
        raise ValueError(f"{len(frequencies)} layers of frequencies but {len(bytes_per_neuron)} byte sizes")
    if min_neurons is not None and len(min_neurons) != len(frequencies):
        raise ValueError(f"{len(frequencies)} layers of frequencies but {len(min_neurons)} minimums")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, not {batch}")
    M = _layout(frequencies, bytes_per_neuron, batch, min_neurons, gpu_time_per_byte, cpu_time_per_byte)
    if budget_bytes <= 0 or not frequencies or M.size.size == 0:
        return Placement([0] * len(frequencies), "no GPU budget", 0.0, 0.0, time.perf_counter() - started, 0, 0,
                         M.minimum.tolist())

    nx = int(M.size.size)
    layers = len(frequencies)
    use_min = min_neurons is not None
    ncol = nx + (layers if use_min else 0)  # x[l,g] for every group of batches, then y[l]
    first = M.offsets[:-1]
    has_groups = M.offsets[1:] > first
    greedy = _greedy(M, float(budget_bytes))
    start = greedy  # y[l] = x[l,0]
    if use_min:
        start = np.concatenate([greedy, np.where(has_groups, greedy[np.minimum(first, nx - 1)], 0.0)])
    upper_bound, fix_on, fix_off = _bound_and_fixings(M, float(budget_bytes), greedy, float(M.value @ greedy))

    # The full model's rows as (row, column, value) entries with bounds: memory, prefix, (3a), (3b), (4).
    entries, lower, upper = [], [], []

    def rows(count: int, row_of_entry, cols, vals, lo, hi) -> None:
        base = sum(len(b) for b in lower)
        entries.append((base + np.asarray(row_of_entry, np.int64), np.asarray(cols, np.int64),
                        np.asarray(vals, np.float64)))
        lower.append(np.broadcast_to(np.asarray(lo, np.float64), (count,)))
        upper.append(np.broadcast_to(np.asarray(hi, np.float64), (count,)))

    unit = float(max(bytes_per_neuron))  # (1) in units of the largest neuron: HiGHS warns about 1e10 bounds
    rows(1, np.zeros(nx), np.arange(nx), M.bytes / unit, -math.inf, float(budget_bytes) / unit)
    follower = np.flatnonzero(M.layer[1:] == M.layer[:-1]) + 1  # groups with a hotter group before them
    pairs = lambda a, b: np.stack([a, b], 1).ravel()
    rows(follower.size, np.repeat(np.arange(follower.size), 2), pairs(follower, follower - 1),  # (2) x[k] <= x[k-1]
         np.tile([1.0, -1.0], follower.size), -math.inf, 0.0)
    if use_min:
        nonempty = np.flatnonzero(has_groups)  # groups are stored layer by layer
        rows(nonempty.size, np.concatenate([np.repeat(np.arange(nonempty.size), np.diff(M.offsets)[nonempty]),
                                            np.arange(nonempty.size)]),
             np.concatenate([np.arange(nx), nx + nonempty]), np.concatenate([M.size, -M.minimum[nonempty]]),
             0.0, math.inf)  # (3a) sum size x - min y >= 0
        rows(nonempty.size, np.repeat(np.arange(nonempty.size), 2), pairs(first[nonempty], nx + nonempty),
             np.tile([1.0, -1.0], nonempty.size), -math.inf, 0.0)  # (3b) x[l,0] - y[l] <= 0
    for cols, vals, cap in M.balance.values():  # (4), see _layout
        rows(1, np.zeros(cols.size), cols, vals, -math.inf, cap)
    row = np.concatenate([e[0] for e in entries])
    col = np.concatenate([e[1] for e in entries])
    val = np.concatenate([e[2] for e in entries])
    row_lower, row_upper = np.concatenate(lower), np.concatenate(upper)

    # Fix what the bound proves (y[l] follows x[l,0] when that is fixed), move fixed columns to the bounds.
    fixed = np.full(ncol, np.nan)
    fixed[:nx][fix_on] = 1.0
    fixed[:nx][fix_off] = 0.0
    if use_min:
        fixed[nx:][~has_groups] = 0.0
        known = has_groups & ~np.isnan(fixed[np.minimum(first, nx - 1)])
        fixed[nx:][known] = fixed[first[known]]
    free = np.isnan(fixed)
    constant = np.bincount(row, weights=np.where(free[col], 0.0, val * np.nan_to_num(fixed[col])),
                           minlength=row_lower.size)
    keep = free[col]
    live = np.bincount(row[keep], minlength=row_lower.size) > 0
    new_row = np.cumsum(live) - 1
    new_col = np.cumsum(free) - 1
    offset = float(M.value[:nx] @ np.nan_to_num(fixed[:nx]))
    free_x = np.flatnonzero(free[:nx])
    status, gap = "Optimal", 0.0
    solution = start.copy()
    if free.any():
        import highspy

        nfree = int(free.sum())
        # HiGHS's plain core class: the `Highs` wrapper prints a banner on stdout when first created.
        h = getattr(highspy, "_Highs", highspy.Highs)()
        h.setOptionValue("output_flag", bool(os.environ.get("PICOMPILE_HIGHS_LOG")))
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("threads", int(threads or os.cpu_count() or 1))
        for key, option in (highs_options or {}).items():
            h.setOptionValue(key, option)
        h.addVars(nfree, np.zeros(nfree), np.ones(nfree))  # binaries: bounds [0, 1] ...
        h.changeColsIntegrality(nfree, np.arange(nfree, dtype=np.int32),
                                np.full(nfree, highspy.HighsVarType.kInteger.value, np.uint8))  # ... and integral
        h.changeColsCost(free_x.size, new_col[free_x].astype(np.int32), M.value[free_x])
        h.changeObjectiveOffset(offset)
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        order = np.lexsort((new_col[col[keep]], new_row[row[keep]]))  # CSR: by row, then column
        r, c, v = new_row[row[keep]][order], new_col[col[keep]][order], val[keep][order]
        nrow = int(live.sum())
        h.addRows(nrow, (row_lower - constant)[live], (row_upper - constant)[live], int(r.size),
                  np.searchsorted(r, np.arange(nrow)).astype(np.int32), c.astype(np.int32), v)
        warm = highspy.HighsSolution()
        warm.col_value = start[free].tolist()
        h.setSolution(warm)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        info = h.getInfo()
        gap = float(info.mip_gap)
        if info.primal_solution_status != 0:  # 0 = kSolutionStatusNone; else HiGHS holds the start or better
            solution = np.where(free, 0.0, np.nan_to_num(fixed))
            solution[free] = np.asarray(h.getSolution().col_value)
    # else nothing is left to decide: the bound proves the start optimal
    counts = _prefix_counts(M, solution[:nx] > 0.5)
    used = int(sum(n * b for n, b in zip(counts, bytes_per_neuron)))
    if used > budget_bytes:  # cannot happen beyond HiGHS's tolerance (1e-6 of a neuron); stay safe anyway
        counts = _prefix_counts(M, greedy > 0.5)
        used = int(sum(n * b for n, b in zip(counts, bytes_per_neuron)))
    objective = float(sum(f[:n].sum() for f, n in zip(M.sorted_frequencies, counts)))
    if status != "Optimal" and upper_bound > objective:  # HiGHS may stop before it has a bound of its own
        gap = min(gap, (upper_bound - objective) / objective if objective > 0 else math.inf)
    if status == "Optimal" and gap < 1e-12:
        gap = 0.0
    return Placement(counts, status, objective, gap, time.perf_counter() - started, ncol, used, M.minimum.tolist())


def _prefix_counts(M: _Model, chosen: np.ndarray) -> list[int]:
    counts = []
    for l in range(len(M.sorted_frequencies)):
        on = chosen[M.offsets[l]: M.offsets[l + 1]]
        prefix = on.size if on.all() else int(np.argmin(on))  # (2) holds; be safe about rounding
        counts.append(int(M.size[M.offsets[l]: M.offsets[l] + prefix].sum()))
    return counts



def min_neurons_for(frequency_sorted: np.ndarray, cpu_bytes_per_neuron: int, batch: int, cpu_bandwidth_gbs: float,
                    sync_s: float) -> int:
    """The smallest GPU part (a multiple of `batch`, at least one batch, or the whole layer) whose expected
    saving of CPU time per token, sum of its frequencies * a neuron's bytes as the CPU stores them / CPU
    bandwidth, covers one synchronisation of `sync_s` seconds (`costmodel.sync_seconds`). If no part short
    of the whole layer pays, the minimum is the whole layer (all on the GPU needs no synchronisation at all)."""
    total = frequency_sorted.size
    if total == 0:
        return 0
    if cpu_bandwidth_gbs <= 0:
        return total
    saved = np.cumsum(np.asarray(frequency_sorted, np.float64)) * cpu_bytes_per_neuron / (cpu_bandwidth_gbs * 1e9)
    candidates = np.append(np.arange(batch, total, batch), total)
    paying = candidates[saved[candidates - 1] >= sync_s]
    return int(paying[0]) if paying.size else int(total)
