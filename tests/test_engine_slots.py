"""Engine(slots=N): each slot a sequence of its own, sharing weights, activations and scratch; and
Engine(threads=N) / --threads N, and a run beside a busy process; and forward(last_only=True): a prompt's last
row's logits alone."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import Engine, generate


def test_slots_give_the_logits_of_separate_engines_in_any_interleaving(tiny_sparse_artifact):
    engine = Engine(tiny_sparse_artifact, slots=3)
    alone = [Engine(tiny_sparse_artifact) for _ in range(3)]
    prompts = [[1, 2, 3], [50, 60, 70, 80, 90], [100]]
    rng = np.random.default_rng(0)
    next_tokens = {}
    for slot in rng.permutation(3):  # prefills in a shuffled order
        got, expected = engine.forward(prompts[slot], slot=slot), alone[slot].forward(prompts[slot])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
        next_tokens[slot] = int(np.argmax(got[-1]))
    order = [0, 0, 2, 1, 2, 2, 0, 1, 1, 1, 0, 2] + list(rng.integers(0, 3, size=20))
    for slot in order:  # one slot several steps ahead of another, and back
        slot = int(slot)
        got, expected = engine.forward([next_tokens[slot]], slot=slot), alone[slot].forward([next_tokens[slot]])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
        next_tokens[slot] = int(np.argmax(got[-1]))
    assert engine.positions == [alone[s].position for s in range(3)]


def test_reset_of_one_slot_leaves_the_others(tiny_sparse_artifact):
    engine, reference = Engine(tiny_sparse_artifact, slots=2), Engine(tiny_sparse_artifact)
    engine.forward([5, 6, 7], slot=1)
    reference.forward([5, 6, 7])
    engine.forward([9, 9], slot=0)
    engine.reset(0)
    engine.forward([1], slot=0)
    assert engine.positions == [1, 3]
    np.testing.assert_allclose(engine.forward([8], slot=1), reference.forward([8]), rtol=0, atol=1e-6)


def test_holding_the_caches_keeps_what_they_hold(tiny_sparse_artifact):
    """hold_caches (a server's, at its start) writes each page of every slot's cache once, with its own values:
    a conversation in progress goes on as if nothing happened; it counts every slot's caches."""
    from runtime import load_manifest
    from runtime.dtypes import get_dtype

    engine, reference = Engine(tiny_sparse_artifact, slots=2), Engine(tiny_sparse_artifact)
    engine.forward([5, 6, 7], slot=1)
    reference.forward([5, 6, 7])
    caches = sum(int(np.prod(b.shape)) * get_dtype(b.dtype).itemsize
                 for b in load_manifest(tiny_sparse_artifact).buffers.values() if b.kind == "cache")
    assert engine.hold_caches() == 2 * caches
    np.testing.assert_array_equal(engine.forward([8], slot=1), reference.forward([8]))


def test_last_only_gives_the_last_rows_logits(tiny_sparse_artifact):
    full, last = Engine(tiny_sparse_artifact), Engine(tiny_sparse_artifact)
    for ids in ([3, 1, 4, 1, 5, 9, 2, 6], [7], [8, 8]):  # a prompt, a decode step, a short prefill after them
        expected, got = full.forward(ids)[-1:], last.forward(ids, last_only=True)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert last.position == full.position == 11


def test_slot_zero_keeps_the_single_sequence_interface(tiny_sparse_artifact):
    engine = Engine(tiny_sparse_artifact, slots=2)
    engine.forward([40, 41], slot=1)  # another sequence in flight changes nothing for slot 0's callers
    expected = generate(Engine(tiny_sparse_artifact), [4, 8, 15], 10)["generated_ids"]
    assert generate(engine, [4, 8, 15], 10)["generated_ids"] == expected
    assert engine.position == engine.positions[0] == 3 + 9


def test_bad_slots_are_refused(tiny_sparse_artifact):
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        Engine(tiny_sparse_artifact, slots=0)
    engine = Engine(tiny_sparse_artifact, slots=2)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
        engine.forward([1], slot=2)
    with pytest.raises(ValueError, match="slot must be"):
        engine.reset(-1)


def test_a_gpu_artifact_refuses_more_than_one_slot_and_runs_as_before(tiny_models, tmp_path_factory):
    from runtime import ArtifactError
    from test_sparse import hybrid_build

    from passes.reference import OrtDecoder

    files = tiny_models("opt", sparsity=0.9)
    hybrid = hybrid_build(files, tmp_path_factory)  # every neuron let through: the dense model's tokens
    with pytest.raises(ArtifactError, match="slots=2 is supported for CPU artifacts only"):
        Engine(hybrid, emulate_gpu=True, slots=2)
    engine = Engine(hybrid, emulate_gpu=True, slots=1)
    assert "gpu" in engine.devices
    first = generate(engine, [4, 8, 15], 8)["generated_ids"]
    assert first == OrtDecoder(files.onnx).greedy([4, 8, 15], 8)
    assert generate(engine, [4, 8, 15], 8)["generated_ids"] == first  # positions restart with reset
    result = generate(engine, [4, 8, 15], 8, profile=True)
    assert result["generated_ids"] == first and result["profile_ms_per_token"]


def test_any_thread_count_gives_the_same_logits(tiny_sparse_artifact):
    engines = [Engine(tiny_sparse_artifact), Engine(tiny_sparse_artifact, threads=1),
               Engine(tiny_sparse_artifact, threads=2)]
    expected = None
    for engine in engines:  # they share the process's one pool: each sets the count it runs on
        got = [engine.forward([3, 1, 4, 1, 5])] + [engine.forward([token]) for token in (9, 2, 6, 5, 3, 5, 8, 9)]
        if expected is None:
            expected = got
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert engines[1].governor.fixed == 1 and engines[0].governor.fixed is None
    assert set(engines[0].governor.choices()) == {("decode",), ("prefill", 8)}
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            Engine(tiny_sparse_artifact, threads=bad)


def test_a_run_beside_a_busy_process_completes_with_the_same_tokens(tiny_sparse_artifact):
    """No timing here (benchmarks/bench_busy.py measures it): the governor's trials under load change which
    count runs a step, never what it computes."""
    from benchmarks.host import BusyLoad

    expected = generate(Engine(tiny_sparse_artifact), [7, 7, 7], 40)["generated_ids"]
    with BusyLoad(1, seconds=120):
        assert generate(Engine(tiny_sparse_artifact), [7, 7, 7], 40)["generated_ids"] == expected


def test_threads_on_the_command_line(tiny_sparse_artifact, capsys):
    import json

    from picompile.cli import main

    assert main(["run", str(tiny_sparse_artifact), "--prompt-ids", "1,2,3", "-n", "5", "--threads", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["run", str(tiny_sparse_artifact), "--prompt-ids", "1,2,3", "-n", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["generated_ids"] == one["generated_ids"]
    for command in ("run", "chat", "serve", "eval"):
        assert main([command, str(tiny_sparse_artifact), "--threads", "0"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "--threads" in lines[0], lines
        assert "positive integer" in lines[0]
