"""benchmarks/host.py: the host-state snapshot parses /proc, flags what it should, and BusyLoad's processes
live exactly inside its block. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host  # noqa: E402


def test_cpu_times_parse_a_proc_stat_file(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 20 1 2 30 7 0\ncpu0 50 2 25 400 10 0 1 15 0 0\nintr 1 2 3\n")
    times = host.read_cpu_times(stat)
    assert times == host.CpuTimes(total=100 + 5 + 50 + 800 + 20 + 1 + 2 + 30, idle=820, steal=30)
    later = host.CpuTimes(total=times.total + 100, idle=times.idle + 50, steal=times.steal + 10)
    busy, steal = later.share_since(times)
    assert busy == pytest.approx(0.4) and steal == pytest.approx(0.1)
    (tmp_path / "bad").write_text("intr 1 2 3\n")
    with pytest.raises(ValueError):
        host.read_cpu_times(tmp_path / "bad")


def test_the_real_proc_files_and_a_snapshot():
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc")
    assert host.read_cpu_times().total > 0
    assert host.read_load_average() >= 0
    state = host.HostState.before(interval_s=0.05, bandwidth=False).after()
    for shot in (state.before_, state.after_):
        assert 0 <= shot.busy_share <= 1 and 0 <= shot.steal_share <= 1 and shot.bandwidth_gbs is None
    assert 0 <= state.run_steal_share <= 1
    line = state.summary()
    assert line.startswith("host: load avg ") and "\n" not in line
    assert line.endswith("quiet") == (not state.flags())
    assert host.read_bandwidth_gbs(mib=8, repeats=1) > 0


def test_flags_name_each_reason():
    def shot(load, busy, steal, gbs):
        return host.Snapshot(cores=2, load_average=load, busy_share=busy, steal_share=steal, bandwidth_gbs=gbs,
                             interval_s=0.5, cpu_times=None)

    quiet = host.HostState(before_=shot(0.2, 0.02, 0.0, 20.0), after_=shot(0.3, 0.05, 0.0, 19.0))
    assert quiet.flags() == [] and not quiet.loaded and quiet.summary().endswith(": quiet")
    loaded = host.HostState(before_=shot(1.5, 0.6, 0.1, 20.0), after_=shot(0.3, 0.05, 0.0, 10.0), load_processes=1)
    flags = " ".join(loaded.flags())
    for word in ("load average", "other work", "steal", "read bandwidth", "--load"):
        assert word in flags
    assert "UNDER LOAD" in loaded.summary()


def test_busy_load_processes_live_inside_the_block_only():
    with host.BusyLoad(2, seconds=60) as load:
        assert len(load.pids) == 2
        processes = list(load.processes)
        assert all(p.poll() is None for p in processes)
        assert all(Path(f"/proc/{pid}").exists() for pid in load.pids) or not Path("/proc").exists()
    assert all(p.poll() is not None for p in processes)  # killed and reaped
    assert load.pids == []
    with host.BusyLoad(0) as none:
        assert none.pids == []
    with pytest.raises(ValueError):
        host.BusyLoad(-1)


def test_a_busy_process_exits_by_itself():
    with host.BusyLoad(1, seconds=0.2) as load:
        process = load.processes[0]
        assert process.wait(timeout=30) == 0  # its own clock ended it, not the block
