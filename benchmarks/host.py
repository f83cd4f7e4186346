"""How busy the host was around a benchmark (issue 31, item 3): every benchmark records it beside its figures
and flags a figure measured under load.

    from host import HostState, BusyLoad

    with BusyLoad(args.load, seconds=600):      # --load N: N busy background processes, bounded in time
        state = HostState.before()              # load average, others' CPU share, steal, read bandwidth
        ...run and time the engines...
        state.after()
    print(state.summary())                      # one line, "UNDER LOAD (...)" when a figure is suspect
    if state.loaded: ...

A snapshot samples /proc/stat over a short idle interval (this process sleeps, so the busy share is other
work's), reads /proc/loadavg, and probes the read bandwidth (numpy sum over a buffer far larger than the
caches, one thread, best of a few). `HostState` also takes the CPU time stolen over the whole run (steal is
the hypervisor's, whoever was running). Linux only (the /proc files); elsewhere the fields it cannot read
are None and are not flagged.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

# What flags a figure as measured under load.
LOAD_FRACTION = 0.5      # 1-minute load average above this share of the cores
BUSY_FRACTION = 0.25     # other work's share of all CPU time while this process slept
STEAL_FRACTION = 0.03    # CPU time stolen by the hypervisor
BANDWIDTH_DROP = 0.20    # read bandwidth after the run this much below the one before


@dataclasses.dataclass(frozen=True)
class CpuTimes:
    """The aggregate "cpu" line of /proc/stat, in clock ticks."""

    total: int
    idle: int    # idle + iowait
    steal: int

    def share_since(self, earlier: "CpuTimes") -> tuple[float, float]:
        """(busy share, steal share) of the CPU time between `earlier` and this reading; steal counts as busy
        only in the steal share (another guest ran, not something of this machine)."""
        total = self.total - earlier.total
        if total <= 0:
            return 0.0, 0.0
        steal = self.steal - earlier.steal
        busy = total - (self.idle - earlier.idle) - steal
        return max(0.0, busy / total), max(0.0, steal / total)


def read_cpu_times(path: str | Path = "/proc/stat") -> CpuTimes:
    """Parse the "cpu " line: user nice system idle iowait irq softirq steal [guest guest_nice]; guest time
    is already inside user/nice, so it is not added again."""
    for line in Path(path).read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]] + [0] * max(0, 9 - len(fields))
            user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
            return CpuTimes(total=user + nice + system + idle + iowait + irq + softirq + steal,
                            idle=idle + iowait, steal=steal)
    raise ValueError(f"{path} has no aggregate 'cpu' line")


def read_load_average(path: str | Path = "/proc/loadavg") -> float:
    """The 1-minute load average."""
    return float(Path(path).read_text().split()[0])


def read_bandwidth_gbs(mib: int = 256, repeats: int = 3) -> float:
    """GB/s of a one-thread numpy sum over `mib` MiB (written once first, so no page fault is timed): the
    best of `repeats`. A probe of what the memory gives now, not the machine's peak (see
    bench_cpu_decode.Bandwidth for the multi-thread copy bandwidth)."""
    import numpy as np

    buffer = np.ones((mib << 20) // 8, np.float64)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.nbytes / (time.perf_counter() - started) / 1e9)
    return best


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The host at one moment: None where a figure could not be read."""

    cores: int
    load_average: float | None          # 1 minute
    busy_share: float | None            # other processes' share of all CPU time over `interval_s`
    steal_share: float | None           # the hypervisor's share over `interval_s`
    bandwidth_gbs: float | None         # read_bandwidth_gbs()
    interval_s: float
    cpu_times: CpuTimes | None          # at the end of the interval: the start of the next span


def snapshot(interval_s: float = 0.5, bandwidth: bool = True, bandwidth_mib: int = 256) -> Snapshot:
    """Sample the host: /proc/stat over `interval_s` of sleep, the load average, and (with `bandwidth`) the
    read-bandwidth probe (about 0.1 s for 256 MiB)."""
    cores = os.cpu_count() or 1
    try:
        load = read_load_average()
    except (OSError, ValueError, IndexError):
        load = None
    busy = steal = times = None
    try:
        first, own = read_cpu_times(), time.process_time()
        time.sleep(interval_s)
        times, own = read_cpu_times(), time.process_time() - own
        busy, steal = times.share_since(first)
        # this process's own threads (a thread pool still spinning after a run) are not other work
        ticks = max(times.total - first.total, 1)
        busy = max(0.0, busy - own * os.sysconf("SC_CLK_TCK") / ticks)
    except (OSError, ValueError):
        pass
    gbs = read_bandwidth_gbs(bandwidth_mib) if bandwidth else None
    return Snapshot(cores=cores, load_average=load, busy_share=busy, steal_share=steal, bandwidth_gbs=gbs,
                    interval_s=interval_s, cpu_times=times)


@dataclasses.dataclass
class HostState:
    """Snapshots before and after a run, the steal over the run, and what they flag."""

    before_: Snapshot
    after_: Snapshot | None = None
    run_steal_share: float | None = None   # between the two snapshots
    load_processes: int = 0                # BusyLoad processes that were running (a --load row), for the summary

    @classmethod
    def before(cls, interval_s: float = 0.5, bandwidth: bool = True, load_processes: int = 0) -> "HostState":
        return cls(before_=snapshot(interval_s, bandwidth), load_processes=load_processes)

    def after(self, interval_s: float | None = None) -> "HostState":
        """Take the second snapshot (same interval and probe as the first); returns self."""
        end = None
        try:
            end = read_cpu_times()
        except (OSError, ValueError):
            pass
        if end is not None and self.before_.cpu_times is not None:
            self.run_steal_share = end.share_since(self.before_.cpu_times)[1]
        self.after_ = snapshot(self.before_.interval_s if interval_s is None else interval_s,
                               self.before_.bandwidth_gbs is not None)
        return self

    def flags(self) -> list[str]:
        """Why a figure measured between the snapshots is suspect; empty when the host looked quiet."""
        found = []
        shots = [s for s in (self.before_, self.after_) if s is not None]
        cores = self.before_.cores
        loads = [s.load_average for s in shots if s.load_average is not None]
        if loads and max(loads) > LOAD_FRACTION * cores:
            found.append(f"load average {max(loads):.2f} > {LOAD_FRACTION * cores:g}")
        busy = [s.busy_share for s in shots if s.busy_share is not None]
        if busy and max(busy) > BUSY_FRACTION:
            found.append(f"other work {max(busy):.0%} of CPU")
        steal = [s.steal_share for s in shots if s.steal_share is not None]
        if self.run_steal_share is not None:
            steal.append(self.run_steal_share)
        if steal and max(steal) > STEAL_FRACTION:
            found.append(f"steal {max(steal):.1%}")
        if self.after_ is not None and self.before_.bandwidth_gbs and self.after_.bandwidth_gbs is not None:
            change = self.after_.bandwidth_gbs / self.before_.bandwidth_gbs - 1
            if change < -BANDWIDTH_DROP:
                found.append(f"read bandwidth {change:+.0%}")
        if self.load_processes:
            found.append(f"{self.load_processes} busy process{'es' if self.load_processes > 1 else ''} (--load)")
        return found

    @property
    def loaded(self) -> bool:
        return bool(self.flags())

    def summary(self) -> str:
        """One line: the figures before -> after, then OK or UNDER LOAD (why)."""
        def pair(get, fmt) -> str:
            values = [get(s) for s in (self.before_, self.after_) if s is not None]
            return " -> ".join("?" if v is None else fmt(v) for v in values)

        steal = pair(lambda s: s.steal_share, lambda v: f"{v:.1%}")
        if self.run_steal_share is not None:
            steal += f" (run {self.run_steal_share:.1%})"
        parts = [f"load avg {pair(lambda s: s.load_average, lambda v: f'{v:.2f}')} on {self.before_.cores} cores",
                 f"others busy {pair(lambda s: s.busy_share, lambda v: f'{v:.0%}')}",
                 f"steal {steal}"]
        if self.before_.bandwidth_gbs is not None:
            parts.append(f"read bw {pair(lambda s: s.bandwidth_gbs, lambda v: f'{v:.1f}')} GB/s")
        flags = self.flags()
        verdict = f"UNDER LOAD ({'; '.join(flags)})" if flags else "quiet"
        return f"host: {', '.join(parts)}: {verdict}"


# A busy process that stops by itself: the loop checks the clock, so a parent that dies leaves nothing behind
# for longer than `seconds`.
_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


class BusyLoad:
    """`with BusyLoad(n, seconds):` keeps n busy processes (one core each) running inside the block; each exits
    by itself after `seconds`, and all are killed when the block ends. n = 0 does nothing (the unloaded row)."""

    def __init__(self, n: int, seconds: float = 600.0):
        if n < 0 or seconds <= 0:
            raise ValueError(f"BusyLoad needs n >= 0 and seconds > 0, got n={n}, seconds={seconds}")
        self.n, self.seconds = n, seconds
        self.processes: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def __enter__(self) -> "BusyLoad":
        code = _SPIN.format(seconds=float(self.seconds))
        try:
            for _ in range(self.n):
                self.processes.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        self.processes = []
