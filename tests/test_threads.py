"""The runtime's thread governor (runtime/threads.py) on step times it is fed, and the pool environment it
sets."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runtime.threads import CpuReading, ThreadGovernor, free_cores_since, step_kind, usable_cores


class FakePool:
    """A pool of `size` workers that records the counts it was set to."""

    def __init__(self, size: int):
        self.size, self.in_use, self.history = size, 0, []

    def use(self, threads: int) -> None:
        self.in_use = threads
        self.history.append(threads)


def drive(governor: ThreadGovernor, seconds_of, steps: int, kind=("decode",)) -> list[int]:
    """Run `steps` steps whose time on n threads is seconds_of(n, step); the counts they ran on."""
    used = []
    for step in range(steps):
        threads = governor.threads_for(kind)
        governor.record(kind, threads, seconds_of(threads, step))
        used.append(threads)
    return used


def test_it_moves_to_the_count_that_is_faster():
    pool = FakePool(4)
    governor = ThreadGovernor(pool)
    # a bandwidth-bound model: more threads are faster, up to 4
    used = drive(governor, lambda n, step: 1e-3 / n ** 0.8, 400)
    assert used[0] == 1  # it starts at one thread
    assert governor.choices()[("decode",)] == 4
    assert used[-50:].count(4) >= 45  # and stays there, with a trial now and then


def test_it_stays_at_one_thread_where_splitting_costs_more():
    governor = ThreadGovernor(FakePool(2))
    used = drive(governor, lambda n, step: 15e-6 if n == 1 else 45e-6, 2000)
    assert governor.choices()[("decode",)] == 1
    assert used.count(2) < 0.05 * len(used)  # trials are few
    # and what they cost beyond the choice's time stays within the share (after each count's first trial)
    assert governor.trial_cost <= governor.trial_share * governor.step_seconds + 5 * 45e-6


def test_jitter_does_not_buy_hopeless_trials():
    """A tiny model beside a busy core: one thread's steps jitter (a slowdown now and then), two threads' cost a
    scheduler slice; what trials cost stays within the share."""
    import random

    rng = random.Random(0)
    governor = ThreadGovernor(FakePool(2))
    used = drive(governor, lambda n, step: 15e-6 * rng.choice((1, 1, 1, 2.5)) if n == 1 else 40e-3, 20000)
    assert used.count(2) <= 5
    assert governor.trial_cost <= governor.trial_share * governor.step_seconds + 40e-3


def test_a_hopeless_trial_ends_after_one_step():
    governor = ThreadGovernor(FakePool(2))
    used = drive(governor, lambda n, step: 20e-6 if n == 1 else 40e-3, 10)  # a worker beside a busy process
    assert used.count(2) == 1


def test_when_the_machine_changes_it_changes_back():
    governor = ThreadGovernor(FakePool(2))
    busy_from = 300
    # two threads win until another program takes a core; then one thread wins
    times = lambda n, step: (1e-3 / n) if step < busy_from else (1e-3 if n == 1 else 8e-3)  # noqa: E731
    used = drive(governor, times, 1200)
    assert used[100:busy_from].count(2) >= 0.85 * (busy_from - 100)
    assert governor.choices()[("decode",)] == 1
    assert used[-200:].count(1) >= 190


def test_a_long_quiet_spell_does_not_delay_the_move_when_load_comes():
    """Many lost trials put the next one far off; a slowdown of the choice's own steps must not wait for it."""
    governor = ThreadGovernor(FakePool(2))
    busy_from = 20000
    times = lambda n, step: (1e-4 / n) if step < busy_from else (1e-4 if n == 1 else 4e-4)  # noqa: E731
    used = drive(governor, times, busy_from + 400)
    assert used[busy_from - 100:busy_from].count(2) >= 95
    assert used[busy_from + 100:].count(1) >= 290  # moved within a few dozen steps of the change


def test_kinds_of_step_are_chosen_apart():
    governor = ThreadGovernor(FakePool(2))
    # decode is too small to split; a prefill of 64 rows is not
    for step in range(300):
        for kind, seconds in ((("decode",), {1: 1e-5, 2: 3e-5}), (step_kind("prefill", 64), {1: 4e-3, 2: 2.2e-3})):
            threads = governor.threads_for(kind)
            governor.record(kind, threads, seconds[threads])
    assert governor.choices() == {("decode",): 1, ("prefill", 64): 2}
    assert step_kind("prefill", 33) == step_kind("prefill", 64) != step_kind("prefill", 65)
    assert step_kind("batch", 3) == ("batch", 4)


def test_a_measured_start_is_used_from_the_first_step():
    """On a quiet machine the free cores run the first steps; a trial of fewer threads, which may cost the parallel
    speed-up over its steps, waits for the trial share where steps are long, and runs at once where they are tiny."""
    asked = []
    governor = ThreadGovernor(FakePool(2), start=lambda: asked.append(1) or 2)
    used = drive(governor, lambda n, step: 20e-3 / n ** 0.8, 40)  # a 1B model's decode
    assert used == [2] * 40 and asked == [1]  # measured once, when the first step came
    used = drive(governor, lambda n, step: 20e-3 / n ** 0.8, 400)
    assert 1 <= used.count(1) <= 8  # later, within the share, one thread is tried (and loses)
    assert governor.trial_cost <= governor.trial_share * governor.step_seconds
    assert governor.choices()[("decode",)] == 2
    tiny = ThreadGovernor(FakePool(2), start=lambda: 2)
    used = drive(tiny, lambda n, step: 15e-6 if n == 1 else 45e-6, 400)  # too small to split: found at once
    assert used.index(1) <= 4 and tiny.choices()[("decode",)] == 1
    # beside a busy core the start is one thread, and a trial of two (a scheduler slice a kernel) waits its share too
    busy = ThreadGovernor(FakePool(2), start=lambda: 1)
    used = drive(busy, lambda n, step: 30e-3 if n == 1 else 80e-3, 32)
    assert used == [1] * 32
    assert ThreadGovernor(FakePool(4), start=9).start() == 4  # never more than the pool has


def test_free_cores_leave_out_a_core_another_program_keeps_busy():
    cores = usable_cores()
    reading = CpuReading.now()
    assert reading is not None  # /proc/stat on Linux
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)  # the child started and spins
        reading = CpuReading.now()
        time.sleep(0.2)
        free = reading.free_cores(cores)
    finally:
        busy.kill()
        busy.wait()
    assert free == max(1, cores - 1) if cores <= 2 else free <= cores - 1
    # this process's own work is not another program's: spinning here leaves every core free (of those idle)
    reading = CpuReading.now()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
    assert reading.free_cores(cores) >= free
    assert free_cores_since(None, cores) == cores  # unreadable: every usable core


def test_a_fixed_count_is_used_for_every_step():
    pool = FakePool(4)
    governor = ThreadGovernor(pool, fixed=3)
    assert drive(governor, lambda n, step: 1e-3 if n == 3 else 1e-6, 50) == [3] * 50
    assert ThreadGovernor(FakePool(2), fixed=8).fixed == 2  # never more than the pool has
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            ThreadGovernor(pool, fixed=bad)


def test_usable_cores_follow_the_affinity_mask():
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
    code = "import os; os.sched_setaffinity(0, {0}); from runtime.threads import usable_cores; print(usable_cores())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_ROOT)
    assert out.stdout.strip() == "1"


def test_the_pool_is_made_unpinned_with_every_usable_core():
    code = ("import os; [os.environ.pop(k, None) for k in ('TVM_NUM_THREADS', 'TVM_BIND_THREADS')]\n"
            "import runtime.engine as e; e._tvm_runtime()\n"
            "from runtime.threads import usable_cores, thread_pool; import tvm_ffi\n"
            "print(os.environ['TVM_BIND_THREADS'], thread_pool(tvm_ffi).size == usable_cores())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_ROOT)
    assert out.stdout.split() == ["0", "True"]


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

