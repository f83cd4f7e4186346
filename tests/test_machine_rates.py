"""The machine's measured kernel rates (passes/machine_rates.py) and how the cost model prices with them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from passes import costmodel, machine_rates
from passes.machine_rates import COLUMN_FORMATS, CpuRates, KernelRate
from passes.targets import CPU_ISAS, get_target, host_cpu_isa
from runtime.dtypes import WEIGHT_FORMATS

SMALL = ((512, 512), (256, 512))  # shapes a test can time in a few seconds
# the threshold calls' shapes: every calibration here times the same kernels, so they are compiled once per run
# (tests/conftest.py); only the timing differs
SMALL_COLUMNS = SMALL[:1] + ((1024, 256),)
SMALL_GATED = ((256, 1024),)  # gate | up halves of 512


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One calibration at small shapes, saved under a cache of its own."""
    cache = tmp_path_factory.mktemp("rates")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PICOMPILE_CACHE", str(cache))
        rates = machine_rates.calibrate(shapes=SMALL, column_shapes=SMALL_COLUMNS, gated_column_shapes=SMALL_GATED,
                                        stream_bytes=4 << 20, rounds=3, save=False)
        machine_rates.keep(dataclasses.replace(rates, busy=False))  # (kept whatever the machine's load)
    return dataclasses.replace(rates, busy=False), cache


def test_every_format_is_measured_on_this_machine(measured):
    rates, _ = measured
    assert set(rates.gemv) == set(WEIGHT_FORMATS)
    assert set(rates.columns) == set(COLUMN_FORMATS)
    for rate in [*rates.gemv.values(), *rates.columns.values()]:
        assert 1e8 < rate.bytes_per_s < 1e13 and 0.0 <= rate.call_s < 1e-2
    assert rates.threads == machine_rates._threads()
    assert rates.key == machine_rates.machine_key(host_cpu_isa(), rates.threads)
    assert any(line.startswith("  q4_k") for line in rates.lines())


def test_a_build_reads_the_cached_figures_and_measures_only_once(measured, monkeypatch):
    rates, cache = measured
    monkeypatch.setenv("PICOMPILE_CACHE", str(cache))
    monkeypatch.setenv(machine_rates.ENABLED_ENV, "1")
    monkeypatch.setattr(machine_rates, "measured_apart", lambda *a, **k: pytest.fail("measured again"))
    assert machine_rates.for_build(host_cpu_isa()) == rates
    # another instruction set's kernels cannot be timed here; and the switch turns them off (the tests' default)
    other = next(isa for isa in CPU_ISAS.values() if isa.name != host_cpu_isa().name)
    assert machine_rates.for_build(other) is None
    monkeypatch.setenv(machine_rates.ENABLED_ENV, "0")
    assert machine_rates.for_build(host_cpu_isa()) is None


def test_a_torn_cache_file_is_measured_again(measured, monkeypatch, tmp_path):
    rates, _ = measured
    monkeypatch.setenv("PICOMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv(machine_rates.ENABLED_ENV, "1")
    path = machine_rates.cache_path(rates.key)
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 2, "key": ')  # torn
    again = []
    monkeypatch.setattr(machine_rates, "measured_apart", lambda isa: again.append(isa) or rates)
    assert machine_rates.for_build(host_cpu_isa()) is rates and len(again) == 1
    # figures measured beside other work are distorted: the build prices with the target's bandwidth instead
    monkeypatch.setattr(machine_rates, "measured_apart", lambda isa: dataclasses.replace(rates, busy=True))
    path.unlink()
    said = []
    assert machine_rates.for_build(host_cpu_isa(), said.append) is None and "busy" in said[-1]
    # a measurement that fails (its child process) leaves the build priced as before, and says why

    def failing(isa):
        raise RuntimeError("measuring the machine's kernels failed: ['boom']")

    monkeypatch.setattr(machine_rates, "measured_apart", failing)
    assert machine_rates.for_build(host_cpu_isa(), said.append) is None and "boom" in said[-1]
    assert CpuRates.from_json(json.loads(json.dumps(rates.to_json()))) == rates
    with pytest.raises(ValueError, match="version"):
        CpuRates.from_json({**rates.to_json(), "version": 0})


def _rates(gemv: float, call_s: float = 0.0, columns: KernelRate | None = None) -> CpuRates:
    return CpuRates("test", 2, {name: KernelRate(gemv, call_s) for name in WEIGHT_FORMATS},
                    {name: columns or KernelRate(gemv, call_s) for name in COLUMN_FORMATS})


def test_the_cost_model_prices_each_format_at_its_measured_rate():
    cpu = get_target("cpu")
    bandwidth = cpu.cpu_bandwidth_gbs * 1e9
    # without measured rates, the target's bandwidth (the formula every price used before)
    assert costmodel.gemv_seconds(cpu, 1e6, "q4_k") == costmodel.read_seconds(1e6, bandwidth, "cpu", 1)
    # rates equal to that bandwidth, no fixed cost: the same prices
    same = dataclasses.replace(cpu, cpu_rates=_rates(bandwidth))
    assert costmodel.gemv_seconds(same, 1e6, "q4_k") == pytest.approx(costmodel.gemv_seconds(cpu, 1e6, "q4_k"))
    # a format measured slower costs more, and a fixed cost per call is paid per GEMV
    rates = _rates(bandwidth)
    rates.gemv["q4_k"] = KernelRate(bandwidth / 2, 10e-6)
    slow = dataclasses.replace(cpu, cpu_rates=rates)
    assert costmodel.gemv_seconds(slow, 1e6, "q4_k", calls=3) == pytest.approx(
        2e6 / bandwidth + 3 * (10e-6 + costmodel.launch_seconds("cpu")))
    assert costmodel.gemv_seconds(slow, 1e6, "int8") == pytest.approx(costmodel.gemv_seconds(cpu, 1e6, "int8"))
    assert costmodel.cpu_bandwidth(slow) == bandwidth  # plain reads stream at the fp32 GEMV's rate
    # a threshold call: its kept rows at the measured rate, its measured fixed cost, and two launches
    columns = dataclasses.replace(cpu, cpu_rates=_rates(bandwidth, columns=KernelRate(1e10, 30e-6)))
    assert costmodel.threshold_seconds(columns, 4e6, 0.25, "int4", 2048) == pytest.approx(
        1e6 / 1e10 + 30e-6 + 2 * costmodel.launch_seconds("cpu"))
    # a block's matrices by format, its vectors streamed
    block = costmodel.BlockBytes(0, 3e6, 0, 4, (("q4_k", 2e6, 2, 0),))
    assert costmodel.price(slow, block).cpu_s == pytest.approx(
        4e6 / bandwidth + 2 * 10e-6 + 1e6 / bandwidth + 4 * costmodel.launch_seconds("cpu"))


def test_a_busy_measurement_is_marked_and_not_cached(monkeypatch, tmp_path):
    """Other work on a core while the kernels are timed: the figures say so, and no file keeps them."""
    monkeypatch.setenv("PICOMPILE_CACHE", str(tmp_path))
    import runtime.threads

    monkeypatch.setattr(runtime.threads, "free_cores_since", lambda reading, usable: usable - 1)
    # (one format, one shape of each kind: what is checked is the marking, whatever was timed)
    monkeypatch.setattr(machine_rates, "WEIGHT_FORMATS", {"int8": machine_rates.WEIGHT_FORMATS["int8"]})
    monkeypatch.setattr(machine_rates, "COLUMN_FORMATS", ("int8",))
    rates = machine_rates.calibrate(shapes=SMALL[:1], column_shapes=SMALL_COLUMNS[:1], gated_column_shapes=(),
                                    stream_bytes=1 << 20, rounds=1)
    assert rates.busy and not machine_rates.cache_path(rates.key).exists()
    assert "not cached" in rates.lines()[0]


def test_a_threshold_level_is_taken_only_beyond_the_cost_models_error():
    """The quality pass's path moves a matrix to a sparse level only where that saves more than PRICE_ERROR of its
    dense time (never slower than dense within the model's own error); the plan says how many stayed dense so."""
    from passes.quality import Knob, _describe_plan, _greedy_path, _within_price_error

    def knob(sparse_cost: float) -> Knob:
        return Knob(node=None, site="down", matrix="w", thresholds=np.array([-1.0, 0.5]),
                    sparse_error=np.array([0.0, 1e-3]), format_error=np.array([0.0]),
                    held_out_dropped=np.array([0.0, 0.5]), cost=np.array([[100e-6], [sparse_cost]]))

    close, clear = knob(95e-6), knob(60e-6)  # saves 5% (within the error), 40%
    moves = _greedy_path([close, clear], 1, [(0, 0), (0, 0)])
    assert moves == [(1, 1, 0)]
    assert _within_price_error([close, clear], [(0, 0), (1, 0)]) == 1
    from passes.quality import WeightPlan

    assert "1 kept dense where sparse would save less than the cost model's error (10%)" in _describe_plan(
        [close, clear], [(0, 0), (1, 0)], WeightPlan({}))
    assert costmodel.worth_sparsity(89e-6, 100e-6) and not costmodel.worth_sparsity(91e-6, 100e-6)
