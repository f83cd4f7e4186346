"""The kernels' threads: how many a step runs on, chosen from what the machine gives, not assumed.

A computer that runs a model is rarely idle. TVM's thread pool, as it comes, fails there three ways
(measured: BENCHMARKS.md, "busy machine"):
- It pins each worker to a core. When another process keeps that core busy, every parallel kernel waits
  a scheduler slice (milliseconds) for its pinned worker: a tiny model's decode falls from 58,000 to 23
  tokens/s beside one busy process. Unpinned, the OS moves the worker to whatever core is free.
- Without TVM_NUM_THREADS it takes half the hardware threads on x86 (to skip hyper-threads), so a 2-core
  VM gets one worker, through the slower handed-off path.
- More threads are not always faster: a kernel too small to split pays for the hand-off and the barrier,
  and a core shared with other work makes every barrier wait for the slowest thread.

So the pool is made once with as many workers as this process may use (`usable_cores`, unpinned), and a
`ThreadGovernor` per engine picks how many of them each kind of step runs on: it starts from the cores free
when the engine loads (`CpuReading`: what other programs took of this process's CPUs meanwhile), so a one-shot
prompt on a quiet machine gets every core from its first step and one beside a busy core starts on what is left;
then, from step times it measures, it tries another count now and then (a few steps, within a small share of the
run's time, ended early when plainly slower) and keeps the faster, and tries again soon when steps slow down
(another program took the cores). `threads=N` (`--threads N`) fixes the count instead.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# TVM's pool reads these once, when it is made (the first parallel kernel): set before then.
POOL_SIZE_ENV = "TVM_NUM_THREADS"
PINNING_ENV = "TVM_BIND_THREADS"
# runtime.config_threadpool's affinity mode that honours the count given (kBig); with pinning off no mode pins
_MODE_BIG = 1
LONG_STEP_S = 2e-3  # a step this long is measured well enough alone
CHECK_EVERY = 8  # between looks at the recent steps, about this many steps' time
FALL_BACK = 2.0  # a step on several threads this many times its best starts a trial of fewer at once
EXPLORE_S = 2e-3  # a first trial of fewer threads that costs at most this runs at once; a dearer one waits its share
READING_S = 0.02  # the shortest window a reading of the free cores is taken over
BUSY_SHARE = 0.3  # a CPU that other programs keep busy more than this share of the window is not free


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (a container's)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cgroup_cpu_quota() -> float | None:
    """The cgroup v2 `cpu.max` (or v1 cfs quota) as CPUs, None where unlimited or unreadable."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class CpuReading:
    """A reading of the busy time of this process's CPUs (/proc/stat) and of this process's own CPU time; two
    readings tell how many cores other programs left free between them (`free_cores`)."""

    at: float  # perf_counter seconds
    busy: float  # seconds the CPUs this process may run on were busy, summed over them (None where unreadable)
    own: float  # seconds this process ran, all its threads

    @classmethod
    def now(cls) -> CpuReading | None:
        busy = _busy_seconds()
        return None if busy is None else cls(time.perf_counter(), busy, time.process_time())

    def free_cores(self, usable: int) -> int:
        """Of `usable` cores, those other programs left free since this reading (waits until the window is
        READING_S long): the CPUs' busy time less this process's over the window, in cores, each other
        program's core counted from BUSY_SHARE of it."""
        wait = self.at + READING_S - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        later = CpuReading.now()
        if later is None:
            return usable
        others = max(0.0, (later.busy - self.busy) - (later.own - self.own)) / (later.at - self.at)
        return max(1, min(usable, usable - math.ceil(others - BUSY_SHARE)))


def _busy_seconds() -> float | None:
    """Busy seconds of this process's CPUs since boot (/proc/stat's per-CPU lines: all but idle and iowait)."""
    try:
        allowed = os.sched_getaffinity(0)
        text = Path("/proc/stat").read_text()
    except (AttributeError, OSError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
            values = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    return busy / ticks


def free_cores_since(reading: CpuReading | None, usable: int) -> int:
    """The cores free since `reading` (None: not readable here, so every usable core)."""
    return usable if reading is None else reading.free_cores(usable)


def prepare_pool_environment() -> None:
    """Before TVM is loaded: a pool of every usable core, unpinned, unless the user chose otherwise."""
    os.environ.setdefault(POOL_SIZE_ENV, str(usable_cores()))
    os.environ.setdefault(PINNING_ENV, "0")


class ThreadPool:
    """The process's one TVM pool, as the engines see it: its size, and the count of workers in use (set only
    where it changes: a reconfiguration costs a few microseconds, a tiny model's whole step is ~20)."""

    def __init__(self, ffi):
        self._configure = ffi.get_global_func("runtime.config_threadpool")
        self._count = ffi.get_global_func("runtime.NumThreads")
        self.in_use = 0
        self.size = self._largest()

    def _largest(self) -> int:
        """The pool's workers: asking for more than it has gets all of them (TVM caps the count)."""
        self._configure(_MODE_BIG, 1 << 16)
        self.in_use = int(self._count())
        return self.in_use

    def use(self, threads: int) -> None:
        if threads != self.in_use:
            self._configure(_MODE_BIG, threads)
            self.in_use = int(self._count())


_POOL: ThreadPool | None = None


def thread_pool(ffi) -> ThreadPool:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPool(ffi)
    return _POOL


@dataclass
class _Trial:
    threads: int
    warmed: bool = False  # its first step wakes the workers the choice left asleep: not judged
    times: list[float] = field(default_factory=list)


@dataclass
class _KindStats:
    """What the governor knows of one kind of step (decode, a batch of n, a prefill of about n rows)."""

    choice: int
    recent: deque = field(default_factory=lambda: deque(maxlen=8))  # the choice's latest step seconds
    best: dict[int, float] = field(default_factory=dict)  # per count: the best median seen
    last: dict[int, float] = field(default_factory=dict)  # per count: its latest trial's median
    next_check: float = 0.0  # the run time (seconds of steps) after which to consider a trial
    next_trial_at: float = 0.0  # ... and after which the next trial may start
    backoff: float = 0.0  # how far the next trial is put off after one that lost (doubles)
    trial: _Trial | None = None
    candidate_turn: int = 0
    fall_back: bool = False  # the choice's last step was FALL_BACK times its best: try fewer threads next


class ThreadGovernor:
    """Picks, per kind of step, how many of the pool's workers run it, from the steps' measured times.

    The first kind of each phase starts at `start` workers (a count, or a function that measures one when the
    first step comes: the cores free, `free_cores_since`); a larger kind of a phase starts where the next smaller
    one is. Too many threads on a busy machine cost a scheduler slice per kernel (40 ms steps where one thread
    takes 20 us), too few on an idle one the parallel speed-up until a trial finds more. A trial runs a few steps at another count (the choice halved, less
    one, more one, doubled), at most `trial_share` of the steps' time in all (a trial's steps cost what they
    take beyond the choice's own time); only an assumed start's first trials run whatever the share. Its first step wakes the workers and is not judged unless it is
    hopeless (`hopeless` times the choice's); a judged step over twice the choice's ends it. A count that
    wins by `margin` becomes the choice; one that loses is tried again later, the interval doubling each time
    it loses, and sooner when the choice's recent steps run `slowdown` times slower than its best: the
    machine changed. Trials toward fewer threads are safe (they cost at most the parallel speed-up), toward
    more are not (a worker beside a busy core waits a scheduler slice per kernel): so one step on several
    threads that takes FALL_BACK times its best starts a trial of half as many at once, whatever the share."""

    def __init__(self, pool: ThreadPool, fixed: int | None = None, *, start: int | Callable[[], int] = 1,
                 trial_share: float = 0.02,
                 trial_steps: int = 4, margin: float = 0.05, slowdown: float = 1.5, hopeless: float = 20.0):
        if fixed is not None and (not isinstance(fixed, int) or isinstance(fixed, bool) or fixed < 1):
            raise ValueError(f"threads must be a positive integer, got {fixed!r}")
        self.pool = pool
        self._start = start
        self.measured_start = callable(start)
        self.fixed = None if fixed is None else min(fixed, pool.size)
        self.trial_share, self.trial_steps, self.margin = trial_share, trial_steps, margin
        self.slowdown, self.hopeless = slowdown, hopeless
        self.kinds: dict[tuple, _KindStats] = {}
        self.step_seconds = 0.0  # all measured steps
        self.trial_cost = 0.0  # what trials took beyond the choice's time

    # ------------------------------------------------------------ what a step runs on
    # (the per-step path is a few attribute reads: a tiny model's whole step takes ~15 us)

    def threads_for(self, kind: tuple) -> int:
        """The count the next step of `kind` runs on (and sets the pool to it)."""
        if self.fixed is not None:
            threads = self.fixed
        else:
            stats = self.kinds.get(kind) or self._new_kind(kind)
            if stats.trial is None and self.step_seconds >= stats.next_check:
                stats.trial = self._maybe_start_trial(stats)
            threads = stats.choice if stats.trial is None else stats.trial.threads
        if threads != self.pool.in_use:
            self.pool.use(threads)
        return threads

    def record(self, kind: tuple, threads: int, seconds: float) -> None:
        """A step of `kind` on `threads` took `seconds`."""
        self.step_seconds += seconds
        if self.fixed is not None:
            return
        stats = self.kinds[kind]
        trial = stats.trial
        if trial is None or trial.threads != threads:
            if threads == stats.choice:
                stats.recent.append(seconds)
                best = stats.best.get(threads)
                if threads > 1 and best is not None and seconds > FALL_BACK * best:
                    # a step on several threads this slow: another program has a core. Fewer threads cost at most
                    # the parallel speed-up, more may cost a scheduler slice per kernel: try fewer at once
                    stats.fall_back = True
                    stats.recent = deque(list(stats.recent)[-2:], maxlen=stats.recent.maxlen)
                    stats.next_check = 0.0
            return
        current = _median(stats.recent)
        self.trial_cost += max(0.0, seconds - current)
        long_steps = current >= LONG_STEP_S  # a prefill's: waking the workers is lost in it, and it is rare
        if not trial.warmed and not long_steps:
            trial.warmed = True
            if seconds > self.hopeless * current:
                trial.times.append(seconds)
                self._end_trial(stats, trial, current)
            return
        trial.times.append(seconds)
        if len(trial.times) >= (1 if long_steps else self.trial_steps) or seconds > 2 * current:
            self._end_trial(stats, trial, current)

    # ------------------------------------------------------------ the choice

    def choices(self) -> dict[tuple, int]:
        """The count each kind of step runs on now."""
        return {kind: (self.fixed or stats.choice) for kind, stats in self.kinds.items()}

    def start(self) -> int:
        """The count a phase's first kind starts at (measured once, when first asked)."""
        if callable(self._start):
            self._start = self._start()
        return max(1, min(int(self._start), self.pool.size))

    def _new_kind(self, kind: tuple) -> _KindStats:
        """A new size of a phase starts where the next smaller one is, else at the start count."""
        smaller = [other for other in self.kinds if other[0] == kind[0] and other[1:] < kind[1:]]
        stats = self.kinds[kind] = _KindStats(choice=self.kinds[max(smaller)].choice if smaller else self.start())
        return stats

    def _candidates(self, choice: int) -> list[int]:
        near = {choice // 2, choice - 1, choice + 1, 2 * choice}
        return sorted({min(count, self.pool.size) for count in near if count >= 1} - {choice})

    def _maybe_start_trial(self, stats: _KindStats) -> _Trial | None:
        """A trial to run now, else None and the step time after which to ask again."""
        if stats.fall_back:
            stats.fall_back = False
            return _Trial(max(1, stats.choice // 2), warmed=True)  # (fewer workers: none to wake)
        candidates = self._candidates(stats.choice)
        # the choice's own time first: three steps, or one long one (a prefill's)
        if not candidates or (len(stats.recent) < 3 and sum(stats.recent) < LONG_STEP_S):
            return None
        current = _median(stats.recent)
        stats.next_check = self.step_seconds + CHECK_EVERY * current
        best = stats.best.get(stats.choice)
        stats.best[stats.choice] = current if best is None else min(best, current)
        latest = _median(list(stats.recent)[-3:])  # a change shows in the last few steps first
        if best is not None and latest > self.slowdown * best:  # the machine changed: what lost may win now
            stats.next_trial_at, stats.backoff = 0.0, 0.0
            stats.best[stats.choice] = latest
        if self.step_seconds < stats.next_trial_at:
            return None
        untried = [count for count in candidates if count not in stats.last]
        if untried:
            # each count's first trial at once where the start was assumed (one thread: more must be found soon);
            # a measured start already holds what a trial would likely find, so its first trials, which may cost
            # the parallel speed-up (fewer) or a scheduler slice a kernel (more), wait for the share unless cheap
            steps = 1 if current >= LONG_STEP_S else self.trial_steps
            affordable = max(EXPLORE_S, self.trial_share * self.step_seconds - self.trial_cost) >= steps * current
            return _Trial(untried[0]) if affordable or not self.measured_start else None
        if self.trial_cost > self.trial_share * self.step_seconds:
            return None
        stats.candidate_turn += 1
        return _Trial(candidates[stats.candidate_turn % len(candidates)])

    def _end_trial(self, stats: _KindStats, trial: _Trial, current: float) -> None:
        stats.trial = None
        median = _median(trial.times)
        stats.last[trial.threads] = median
        stats.best[trial.threads] = min(stats.best.get(trial.threads, median), median)
        if median < (1 - self.margin) * current:
            stats.choice = trial.threads
            stats.recent = deque(trial.times, maxlen=stats.recent.maxlen)
            stats.backoff = 0.0
            stats.next_trial_at = stats.next_check = self.step_seconds  # its own neighbours next
            return
        # lost: try again later, each loss twice as much later (in seconds of steps), at least a few steps on; the
        # choice's own steps are still looked at as often as ever (a slowdown ends the wait)
        stats.backoff = max(2 * stats.backoff, 20 * current)
        stats.next_trial_at = self.step_seconds + stats.backoff
        stats.next_check = self.step_seconds + CHECK_EVERY * current


def step_kind(phase: str, rows: int) -> tuple:
    """The kinds whose best counts may differ: decode, a batch step of n rows, a prefill of about n rows
    (to the power of two above: its time grows with them)."""
    if phase == "decode":
        return ("decode",)
    return (phase, 1 << max(0, int(rows) - 1).bit_length())


def _median(values) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
