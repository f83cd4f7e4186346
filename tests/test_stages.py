"""A model split across machines (`build --nodes`): the hand-over in the schedule, each stage's engine, the stages as
Ray actors on a two-node Ray cluster of this machine (127.0.0.1), and the CLI around them.

The tiny OPT of the server tests, built whole (`tiny_sparse_artifact`) and split in two stages (stage 1 asking for
the Ray resource `picompile_stage1`, which only the cluster's second node offers). Prefill and decode logits of the
split artifact equal the whole one's exactly (the same kernels on the same rows; the hand-over copies the rows
unchanged), in one process, stage by stage, and through Ray. A batch step of the pipeline runs a micro-batch per
stage: its logits equal one engine's batch steps of the same micro-batches exactly (a sparse batch step computes
the union of its sequences' predicted neurons, so another grouping gives other logits, as one engine's batch steps
differ from its decode steps), and concurrent requests' greedy answers equal one engine's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from runtime import ArtifactError
from runtime.engine import Engine
from runtime.sampling import generate
from test_runtime_thin import ROOT
from test_serve import START_WAIT_S, WAIT_S, GatedEngine, client, live_server, stream_completion, wait_until

STAGE1 = {"picompile_stage1": 1}
PROMPT, DECODED = [3, 14, 15, 92, 65], [5, 7, 9, 11, 13, 2]


@pytest.fixture(scope="module")
def split_artifact(tiny_models, tmp_path_factory):
    """The tiny OPT built as `tiny_sparse_artifact` is, by the CLI, split in two stages by a nodes file naming the
    second node's Ray resource."""
    from picompile.cli import main

    work = tmp_path_factory.mktemp("stages")
    spec = work / "nodes.json"
    spec.write_text(json.dumps({"nodes": [{"name": "head", "memory": "1GiB"},
                                          {"name": "second", "memory": "1GiB", "resources": STAGE1}]}))
    out = work / "opt-tiny-split.pic"
    assert main(["build", str(tiny_models("opt", sparsity=0.9).onnx), "--target", "cpu", "--max-context", "64",
                 "--weight-dtype", "fp32", "--nodes", str(spec), "-o", str(out), "-q"]) == 0
    return out


def _steps(forward, forward_batch=None) -> list[np.ndarray]:
    """The logits of a prefill, decode steps, and (with `forward_batch`) batch steps of slots 0-2."""
    found = [forward(PROMPT, 0)] + [forward([token], 0) for token in DECODED]
    if forward_batch is not None:
        for slot in (1, 2):
            found.append(forward([slot, 40 + slot], slot))
        found += [forward_batch([4 + step, 6, 8], [0, 1, 2]) for step in range(3)]
    return found


def _schedule(artifact) -> list[dict]:
    return sorted(json.loads((artifact / "schedule.json").read_text())["nodes"], key=lambda node: node["order"])


def test_the_hand_over_is_a_call_of_the_schedule_and_an_unsplit_schedule_has_no_stages(split_artifact,
                                                                                        tiny_sparse_artifact):
    assert not any("stage" in node["call"] for node in _schedule(tiny_sparse_artifact))
    schedule = json.loads((split_artifact / "schedule.json").read_text())
    calls = [node["call"] for node in sorted(schedule["nodes"], key=lambda node: node["order"])]
    (handover,) = [call for call in calls if call["role"] == "handover"]
    stages = [call.get("stage", 0) for call in calls]
    at = calls.index(handover)
    assert stages == [0] * (at + 1) + [1] * (len(calls) - at - 1) and handover["layer"] is None
    source, target = (arg["buffer"] for arg in handover["args"])
    assert source != target
    # the DAG orders it after the stage-0 call that wrote its source and before the stage-1 calls that read its target
    edges = {(edge["source"], edge["target"]) for edge in schedule["edges"]}
    assert any((call["id"], handover["id"]) in edges for call in calls[:at]
               if any(arg["buffer"] == source and arg["access"] == "write" for arg in call["args"]))
    assert any((handover["id"], call["id"]) in edges for call in calls[at + 1:]
               if any(arg["buffer"] == target for arg in call["args"]))
    assert sorted(p.name for p in (split_artifact / "weights").iterdir()) == ["stage0.cpu.safetensors",
                                                                              "stage1.cpu.safetensors"]


def test_inspect_shows_the_stages_and_their_hand_over(split_artifact, capsys):
    from picompile.cli import main

    assert main(["inspect", str(split_artifact), "--json"]) == 0
    first, last = json.loads(capsys.readouterr().out)["stages"]
    assert (first["first_layer"], first["stop_layer"], last["first_layer"], last["stop_layer"]) == (0, 1, 1, 2)
    assert first["handovers"] == [{"call": "handover.stage0_to_1", "bytes_per_token": 64 * 4}] and not last["handovers"]
    assert last["resources"] == STAGE1 and first["calls"] + last["calls"] == len(_schedule(split_artifact))
    assert main(["inspect", str(split_artifact)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stage ")]
    assert len(lines) == 2 and "hands over 256 B/token" in lines[0] and "picompile_stage1" in lines[1]


def test_one_process_and_stage_by_stage_equal_the_unsplit_artifact(split_artifact, tiny_sparse_artifact):
    """Exactly: prefill, decode and batch steps of the split artifact in one process (the hand-over a copy), and
    prefill and decode stage by stage, each stage engine feeding the next."""
    whole, split = Engine(tiny_sparse_artifact, slots=3), Engine(split_artifact, slots=3)
    expected = _steps(whole.forward, whole.forward_batch)
    for found, wanted in zip(_steps(split.forward, split.forward_batch), expected, strict=True):
        np.testing.assert_array_equal(found, wanted)
    first, last = Engine(split_artifact, stage=0), Engine(split_artifact, stage=1)
    assert (first.stage_input, first.stage_output, last.stage_input, last.stage_output) == (
        None, "act.residual1", "act.stage1.in", "logits")  # the hand-over: from a buffer of stage 0 to one of stage 1
    with pytest.raises(ValueError, match="forward_stage"):
        first.forward(PROMPT)
    found = _steps(lambda ids, slot: last.forward_stage(first.forward_stage(ids, slot), slot))
    for found_step, wanted in zip(found, expected):
        np.testing.assert_array_equal(found_step, wanted)
    with pytest.raises(ValueError, match=r"hidden rows \[rows, 64\]"):
        last.forward_stage(np.zeros((1, 3), np.float32))


def test_a_stage_never_reads_another_stages_weights(split_artifact, tmp_path):
    """Stage 0's weight file with its data overwritten (its header kept): stage 1 loads and computes as before,
    so it neither hashed nor read that data; stage 0 refuses the file."""
    import shutil

    from runtime.artifact import read_safetensors_header

    copy = tmp_path / "split.pic"
    shutil.copytree(split_artifact, copy)
    path = copy / "weights" / "stage0.cpu.safetensors"
    data = bytearray(path.read_bytes())
    start = len(data) - max(tensor["data_offsets"][1] for tensor in read_safetensors_header(path).values())
    data[start:] = bytes(len(data) - start)
    path.write_bytes(bytes(data))
    hidden = Engine(split_artifact, stage=0).forward_stage(PROMPT)
    np.testing.assert_array_equal(Engine(copy, stage=1).forward_stage(hidden),
                                  Engine(split_artifact, stage=1).forward_stage(hidden))
    with pytest.raises(ArtifactError, match="stage0.cpu.safetensors is damaged"):
        Engine(copy, stage=0)


def test_stage_of_an_unsplit_artifact_is_refused(tiny_sparse_artifact):
    with pytest.raises(ArtifactError, match="not split across machines"):
        Engine(tiny_sparse_artifact, stage=0)


def test_run_local_equals_the_unsplit_run_and_without_ray_is_one_error_line(split_artifact, tiny_sparse_artifact,
                                                                             capsys):
    from picompile.cli import main

    def run(artifact, *options):
        assert main(["run", str(artifact), "--prompt-ids", "3,14,15", "-n", "6", "--json", *options]) == 0
        return json.loads(capsys.readouterr().out)["generated_ids"]

    assert run(split_artifact, "--stages", "local") == run(tiny_sparse_artifact)
    assert main(["run", str(tiny_sparse_artifact), "--prompt-ids", "1", "--stages", "local"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --stages: {tiny_sparse_artifact} is not split across "
                                                    "machines (built without --nodes)"]
    assert main(["run", str(tiny_sparse_artifact), "--prompt-ids", "1", "--address", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --address starts the stages of a model split across "
                                                    f"machines (build --nodes) on a Ray cluster; {tiny_sparse_artifact} "
                                                    "is not split"]
    assert main(["run", str(split_artifact), "--prompt-ids", "1", "--profile"]) == 2  # refused before Ray starts
    assert "add --stages local" in capsys.readouterr().err
    code = ("import sys\nsys.modules['ray'] = None  # as on a machine without it\n"
            "from picompile.cli import main\n"
            f"sys.exit(main(['run', {str(split_artifact)!r}, '--prompt-ids', '1,2']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: {split_artifact} is split across machines (build --nodes): running "
                                          "its stages needs the ray extra (ray is not installed): pip install -e "
                                          "'.[ray]' (or --stages local: all in this process)"]


def test_run_starts_the_stages_on_a_ray_of_its_own_and_stops_it(split_artifact, tiny_sparse_artifact, capsys):
    """`run` of a split artifact, as a user types it: a Ray instance of its own on 127.0.0.1, one actor per stage,
    the unsplit run's tokens; the process ends (Ray stopped) within the bound."""
    pytest.importorskip("ray")
    from picompile.cli import main

    assert main(["run", str(tiny_sparse_artifact), "--prompt-ids", "3,14,15", "-n", "6", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["generated_ids"]
    result = subprocess.run([sys.executable, "-m", "picompile", "run", str(split_artifact), "--prompt-ids", "3,14,15",
                             "-n", "6", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=START_WAIT_S)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["generated_ids"] == expected
    assert "2 stages on Ray (this machine): head layer 0, second layer 1" in result.stderr, result.stderr


# ---------------------------------------------------------------- nodes with a card each (the GPU emulated)

CARD_BYTES = 150_000  # each node's card: room for some of its stage's blocks and hot neurons, not all


@pytest.fixture(scope="module")
def gpu_split(tiny_models, tmp_path_factory):
    """The tiny OPT's hybrid build (test_sparse's: blocks and hot neurons on a card, cold neurons on the CPU, for a
    target whose CPU is slow enough that bytes decide) split across two nodes with a card of CARD_BYTES each."""
    import dataclasses

    from passes.nodes import Node
    from passes.pipeline import Options
    from picompile.compiler import build, pipeline
    from tiny_targets import SLOW_CPU_RTX4090

    files = tiny_models("opt", sparsity=0.9)
    nodes = tuple(Node(name, 1 << 30, "rtx4090", STAGE1 if name == "second" else {}, None, CARD_BYTES)
                  for name in ("head", "second"))
    options = Options(max_context=64, calib=files.calib, all_neurons=True, nodes=nodes)
    passes = [dataclasses.replace(p, placement_batch=32) if p.name == "partition" else p
              for p in pipeline(options, "predictor", SLOW_CPU_RTX4090)]
    out = tmp_path_factory.mktemp("gpu-stages") / "opt-tiny-gpu-split.pic"
    return files, build(files.onnx, out, SLOW_CPU_RTX4090, options, passes=passes)


def test_each_node_places_its_own_layers_on_its_own_card(gpu_split):
    """One placement program per node: each stage's GPU bytes within its own card, blocks on both cards; the copies
    to and from a card are its stage's, and the hand-over leaves and arrives in host memory."""
    from passes.partition import PlacementReport
    from passes.targets import RESERVE_FRACTION

    _, artifact = gpu_split
    manifest = json.loads((artifact / "manifest.json").read_text())
    report = PlacementReport.from_json(manifest["placement"])
    budget = int(CARD_BYTES * (1 - RESERVE_FRACTION))
    assert [stage.budget_bytes for stage in report.stages] == [budget, budget]
    assert all(0 < stage.used_bytes <= budget for stage in report.stages), report.stages
    assert report.used_bytes == sum(stage.used_bytes for stage in report.stages)
    assert [stage["gpu_bytes"] for stage in manifest["stages"]] == [budget, budget]
    calls = [node["call"] for node in _schedule(artifact)]
    devices = {(call["device"], call.get("stage", 0)) for call in calls}
    assert devices == {("cpu", 0), ("gpu", 0), ("cpu", 1), ("gpu", 1)}
    (handover,) = [call for call in calls if call["role"] == "handover"]
    assert not any("@gpu" in arg["buffer"] for arg in handover["args"])
    at = calls.index(handover)
    for index, call in enumerate(calls):
        if call["role"] == "copy":  # a copy runs on the machine of the call it feeds (the logits': the last)
            assert call.get("stage", 0) == (0 if index < at else 1), call["id"]
    assert sorted(p.name for p in (artifact / "weights").iterdir()) == [
        "stage0.cpu.safetensors", "stage0.gpu.safetensors", "stage1.cpu.safetensors", "stage1.gpu.safetensors"]


def test_gpu_stages_in_one_process_and_stage_by_stage_compute_the_model(gpu_split):
    """The split artifact with its cards emulated: within fp16 rounding of onnxruntime, and its two stage
    engines, each with its own (emulated) card, give exactly the one-process logits."""
    from test_sparse import assert_matches_onnxruntime

    files, artifact = gpu_split
    assert_matches_onnxruntime(artifact, files.onnx, emulate_gpu=True)
    whole = Engine(artifact, emulate_gpu=True)
    expected = _steps(lambda ids, slot: whole.forward(ids))
    first, last = Engine(artifact, stage=0, emulate_gpu=True), Engine(artifact, stage=1, emulate_gpu=True)
    found = _steps(lambda ids, slot: last.forward_stage(first.forward_stage(ids)))
    for found_step, wanted in zip(found, expected, strict=True):
        np.testing.assert_array_equal(found_step, wanted)


# ---------------------------------------------------------------- on Ray: a head node and a second node


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of two node processes on 127.0.0.1, the second offering `picompile_stage1`; this process its
    driver. Shut down at the module's end."""
    pytest.importorskip("ray")
    import ray
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    # Ray turns a loopback address into the machine's own (for other machines to reach): keep everything on 127.0.0.1
    constants.ENABLE_RAY_CLUSTER, was = False, constants.ENABLE_RAY_CLUSTER
    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
    made = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        second = made.add_node(**node, resources=STAGE1)
        ray.init(address=made.address, log_to_driver=False, configure_logging=False)
        yield second.node_id
    finally:
        ray.shutdown()
        made.shutdown()
        constants.ENABLE_RAY_CLUSTER = was


def test_gpu_stages_on_two_ray_nodes_give_the_one_process_logits(cluster, gpu_split):
    """Each stage an actor on its own node with its card emulated (a real card: the actor asks Ray for a GPU);
    the logits equal the one-process run's exactly. (Runs before the CPU split's pipeline takes the nodes' CPUs.)"""
    from runtime.ray_stages import Pipeline

    _, artifact = gpu_split
    whole = Engine(artifact, emulate_gpu=True)
    expected = _steps(lambda ids, slot: whole.forward(ids))
    stages = Pipeline(artifact, code_path=str(ROOT), step_timeout_s=WAIT_S, start_timeout_s=START_WAIT_S,
                      emulate_gpu=True)
    try:
        assert stages.where[1]["node"] == cluster and stages.where[0]["node"] != cluster
        found = _steps(stages.forward)
    finally:
        stages.close()
    for found_step, wanted in zip(found, expected, strict=True):
        np.testing.assert_array_equal(found_step, wanted)


@pytest.fixture(scope="module")
def pipeline(cluster, split_artifact):
    from runtime.ray_stages import Pipeline

    _wait_for_free_cpus(2)  # (the GPU test's stages, killed, hold the nodes' CPUs until their processes exit)
    stages = Pipeline(split_artifact, slots=4, code_path=str(ROOT), step_timeout_s=WAIT_S, start_timeout_s=START_WAIT_S)
    yield stages
    stages.close()


def _wait_for_free_cpus(cpus: int) -> None:
    """Until the cluster offers `cpus` CPUs again (bounded): ray.kill returns before a killed actor's CPU is free."""
    import ray

    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(tiny_sparse_artifact):
    engine = Engine(tiny_sparse_artifact)  # a single-slot engine of the unsplit artifact
    return lambda prompt, tokens: generate(engine, prompt, tokens)["generated_ids"]


def test_two_stages_on_two_ray_nodes_give_the_unsplit_logits(pipeline, cluster, tiny_sparse_artifact):
    assert pipeline.where[1]["node"] == cluster and pipeline.where[0]["node"] != cluster
    whole = Engine(tiny_sparse_artifact, slots=3)

    def micro_batches(ids, slots):  # the pipeline's batch step of 3 slots over 2 stages: slots 0-1, then slot 2
        return np.concatenate([whole.forward_batch(ids[:2], slots[:2]), whole.forward_batch(ids[2:], slots[2:])])

    expected = _steps(whole.forward, micro_batches)
    for slot in range(3):
        pipeline.reset(slot)
    found = _steps(pipeline.forward, pipeline.forward_batch)
    for found_step, wanted in zip(found, expected, strict=True):
        np.testing.assert_array_equal(found_step, wanted)
    assert pipeline.positions[:3] == [len(PROMPT) + len(DECODED) + 3, 5, 5]


@pytest.fixture(scope="module")
def server(pipeline):
    gated = GatedEngine(pipeline)
    with live_server(gated, tokenizer=None, parallel=4, queue=8) as url:
        yield url, gated


def test_concurrent_requests_through_the_stages_equal_one_engine(server, reference):
    from concurrent.futures import ThreadPoolExecutor

    url, _ = server
    prompts = [[1, 2, 3], [50, 60, 70, 80], [100, 5], [9] * 7, [33, 44]]

    def ask(prompt):
        return client(url).completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0).choices[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert [answer.model_extra["token_ids"] for answer in answers] == [reference(p, 8) for p in prompts]


def test_a_killed_stage_fails_its_request_and_the_next_request_works(server, pipeline, reference):
    """A streamed request held between steps; its stage 1 actor killed: the request ends with an error chunk (never
    a hang), Ray restarts the stage, and the next request gets the unsplit artifact's answer."""
    import ray

    url, gated = server
    into: dict = {}
    gated.hold()
    thread = threading.Thread(target=stream_completion, args=(url, [1, 2, 3], 20, into), daemon=True)
    thread.start()
    gated.step(3)  # the prefill and two decode steps
    wait_until(lambda: len(into.get("ids", [])) == 3, "three tokens")
    ray.kill(pipeline.actors[1], no_restart=False)
    gated.open()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the request hung"
    assert into["error"] is not None and "stage" in into["error"] and into["ids"] == reference([1, 2, 3], 3), into
    assert into["error_code"] == "engine_unavailable"
    answer = client(url).completions.create(model="any", prompt=[5, 6], max_tokens=6, temperature=0)
    assert answer.choices[0].model_extra["token_ids"] == reference([5, 6], 6)
