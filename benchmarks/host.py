"""What the host was doing while a benchmark ran, and background load to run one under.

Machines here are shared: a figure measured while something else took cores or memory bandwidth is not the
figure of a quiet machine. Every benchmark takes a `HostState` before and after its timed part and prints
its line beside the figures; `flags` names what makes them figures of a busy host. `BusyLoad(n, seconds)`
keeps n cores busy for a bounded time, so that running under load is a benchmark row of its own.

    with HostWatch() as watch, BusyLoad(1, seconds=600):
        ...  # timed runs
    print(watch.line())  # "host: load 1.05 -> 2.01 (2 cores), busy 98%, steal 0.0%, read 31.2 -> 30.8 GB/s; ..."
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Above these a figure is one of a busy host.
LOAD_PER_CORE = 0.5  # 1-minute load average per core, before the run
STEAL_SHARE = 0.02  # CPU time the hypervisor gave to other guests
BANDWIDTH_DROP = 0.2  # read bandwidth after the run below before by this share
PROBE_MIB = 256


@dataclass(frozen=True)
class CpuTimes:
    """/proc/stat's first line: jiffies spent busy, idle and stolen, all CPUs together."""

    busy: int
    idle: int
    steal: int

    @staticmethod
    def now() -> "CpuTimes":
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return CpuTimes(busy=user + nice + system + irq + softirq, idle=idle + iowait, steal=steal)

    def since(self, earlier: "CpuTimes") -> tuple[float, float]:
        """(share of CPU time busy, share stolen) between `earlier` and this."""
        busy, idle, steal = self.busy - earlier.busy, self.idle - earlier.idle, self.steal - earlier.steal
        total = max(1, busy + idle + steal)
        return busy / total, steal / total


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def read_bandwidth_gbs(mib: int = PROBE_MIB, repeats: int = 3) -> float:
    """One thread's read bandwidth: the best of `repeats` sums over a `mib` MiB array, GB/s."""
    import numpy as np

    data = np.ones(mib * (1 << 20) // 8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9


@dataclass
class HostWatch:
    """The host around a timed part: load, busy and stolen CPU, read bandwidth before and after."""

    probe_mib: int = PROBE_MIB
    load_before: float = 0.0
    load_after: float = 0.0
    bandwidth_before: float = 0.0
    bandwidth_after: float = 0.0
    busy: float = 0.0
    steal: float = 0.0
    _times: CpuTimes | None = None

    def __enter__(self) -> "HostWatch":
        self.load_before = load_average()
        self.bandwidth_before = read_bandwidth_gbs(self.probe_mib)
        self._times = CpuTimes.now()
        return self

    def __exit__(self, *exc) -> None:
        self.busy, self.steal = CpuTimes.now().since(self._times)
        self.load_after = load_average()
        self.bandwidth_after = read_bandwidth_gbs(self.probe_mib)

    def flags(self, cores: int | None = None) -> list[str]:
        """Why the figures are a busy host's: empty for a quiet one."""
        cores = cores or os.cpu_count() or 1
        flags = []
        if self.load_before > LOAD_PER_CORE * cores:
            flags.append(f"load {self.load_before:.2f} before the run on {cores} cores")
        if self.steal > STEAL_SHARE:
            flags.append(f"{self.steal:.0%} of CPU time stolen")
        if self.bandwidth_after < (1 - BANDWIDTH_DROP) * self.bandwidth_before:
            flags.append(f"read bandwidth fell {1 - self.bandwidth_after / self.bandwidth_before:.0%}")
        return flags

    def line(self) -> str:
        flags = self.flags()
        return (f"host: load {self.load_before:.2f} -> {self.load_after:.2f} ({os.cpu_count()} cores), "
                f"CPU busy {self.busy:.0%}, stolen {self.steal:.1%}, one thread's read {self.bandwidth_before:.1f} -> "
                f"{self.bandwidth_after:.1f} GB/s" + (f"; BUSY HOST: {', '.join(flags)}" if flags else "; quiet"))

    def as_dict(self) -> dict:
        return {"load_before": self.load_before, "load_after": self.load_after, "cpu_busy": self.busy,
                "cpu_stolen": self.steal, "read_gbs_before": self.bandwidth_before,
                "read_gbs_after": self.bandwidth_after, "flags": self.flags()}


def _spin(deadline: float) -> None:
    while time.monotonic() < deadline:
        pass


class BusyLoad:
    """`count` processes that each keep a core busy until `seconds` have passed or the block ends, whichever is
    first: every one stops by itself."""

    def __init__(self, count: int, seconds: float):
        if count < 0 or seconds <= 0:
            raise ValueError(f"BusyLoad needs count >= 0 and seconds > 0, got {count}, {seconds}")
        self.count, self.seconds = count, seconds
        self.processes: list[multiprocessing.Process] = []

    def __enter__(self) -> "BusyLoad":
        context = multiprocessing.get_context("spawn")
        deadline = time.monotonic() + self.seconds  # CLOCK_MONOTONIC is system-wide: the children read the same
        self.processes = [context.Process(target=_spin, args=(deadline,), daemon=True) for _ in range(self.count)]
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join(timeout=10)
        self.processes = []

    def alive(self) -> int:
        return sum(process.is_alive() for process in self.processes)
