"""--nodes: the spec's spellings and refusals, and the split of layers across nodes (passes/nodes.py)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from passes.errors import UserError
from passes.nodes import Node, Part, parse_nodes, split_layers, stage_seconds
from passes.targets import RESERVE_FRACTION, TARGETS

GiB = 1 << 30


def test_count_and_list_spellings():
    nodes = parse_nodes("2x24GiB")
    assert [(n.name, n.memory_bytes, n.target) for n in nodes] == [("node0", 24 * GiB, "cpu"), ("node1", 24 * GiB, "cpu")]
    nodes = parse_nodes("24GiB, 16GiB:rtx4090")
    assert [(n.memory_bytes, n.target) for n in nodes] == [(24 * GiB, "cpu"), (16 * GiB, "rtx4090")]


def test_json_file(tmp_path):
    spec = tmp_path / "nodes.json"
    spec.write_text(json.dumps({"nodes": [
        {"name": "desk", "memory": "8GiB", "resources": {"desk": 1}},
        {"name": "attic", "memory": 4 * GiB, "cpu_bandwidth_gbs": 19.0},
        {"name": "den", "memory": "16GiB", "target": "rtx4090", "gpu_memory": "8GiB"},
        {"name": "loft", "memory": "16GiB", "target": "rtx4090"}]}))
    desk, attic, den, loft = parse_nodes(str(spec))
    assert (desk.name, desk.memory_bytes, desk.resources, desk.gpu_bytes) == ("desk", 8 * GiB, {"desk": 1}, 0)
    assert (attic.name, attic.memory_bytes, attic.cpu_bandwidth) == ("attic", 4 * GiB, 19e9)
    # a card's budget: what the node gives of it (or the whole card), less the reserve
    assert den.gpu_bytes == int(8 * GiB * (1 - RESERVE_FRACTION))
    assert loft.gpu_bytes == int(TARGETS["rtx4090"].gpu_memory_bytes * (1 - RESERVE_FRACTION))


@pytest.mark.parametrize("spec, words", [
    ("24GiB", "two or more"),
    ("2xlots", "not a size"),
    ("0x1GiB", "between 1 and 64"),
    ("1GiB,1GiB:tpu", "target 'tpu' is unknown"),
    ("1GiB,,1GiB", "has no memory"),
])
def test_bad_specs(spec, words):
    with pytest.raises(UserError, match=words):
        parse_nodes(spec)


@pytest.mark.parametrize("content, words", [
    ("{", "not JSON"),
    ('{"nodes": [{"memory": "1GiB"}, {"name": "b"}]}', "node 1 has no memory"),
    ('{"nodes": [{"memory": "1GiB", "colour": 1}, {"memory": "1GiB"}]}', "unknown field"),
    ('{"nodes": [{"memory": "1GiB", "resources": {"a": -1}}, {"memory": "1GiB"}]}', "positive numbers"),
    ('{"nodes": [{"memory": "1GiB", "name": "a b"}, {"memory": "1GiB"}]}', "letters, digits"),
    ('{"nodes": [{"memory": "1GiB", "name": "a"}, {"memory": "1GiB", "name": "a"}]}', "must differ"),
    ('{"nodes": [{"memory": "1GiB", "gpu_memory": "1GiB"}, {"memory": "1GiB"}]}', "a node with a GPU target"),
])
def test_bad_files(tmp_path, content, words):
    spec = tmp_path / "nodes.json"
    spec.write_text(content)
    with pytest.raises(UserError, match=words):
        parse_nodes(str(spec))


def _brute_force(layers, embed, head, nodes):
    """Every split into contiguous non-empty ranges, the best by (slowest stage, sum), or None."""
    best = None
    for cuts in itertools.combinations(range(1, len(layers)), len(nodes) - 1):
        bounds = (0, *cuts, len(layers))
        seconds = []
        for k, node in enumerate(nodes):
            parts = layers[bounds[k]:bounds[k + 1]] + [embed] * (k == 0) + [head] * (k == len(nodes) - 1)
            if sum(p.stored_bytes for p in parts) > node.memory_bytes:
                break
            seconds.append(stage_seconds(node, sum(p.read_bytes for p in parts)))
        else:
            key = (max(seconds), sum(seconds))
            if best is None or key < best[0]:
                best = (key, bounds)
    return best


def test_split_is_the_best_contiguous_split():
    rng = np.random.default_rng(0)
    for trial in range(40):
        layers = [Part(int(b), float(b)) for b in rng.integers(1, 100, size=int(rng.integers(3, 9)))]
        count = int(rng.integers(2, min(4, len(layers)) + 1))
        nodes = tuple(Node(f"n{k}", int(rng.integers(50, 400)), cpu_bandwidth_gbs=float(rng.choice([1.0, 2.0, 4.0])))
                      for k in range(count))
        embed, head = Part(int(rng.integers(0, 30)), 0.0), Part(int(rng.integers(0, 30)), 20.0)
        expected = _brute_force(layers, embed, head, nodes)
        if expected is None:
            with pytest.raises(UserError, match="does not fit the nodes"):
                split_layers(layers, embed, head, nodes)
            continue
        plans = split_layers(layers, embed, head, nodes)
        assert [p.first_layer for p in plans] + [plans[-1].stop_layer] == list(expected[1])
        assert max(p.step_s for p in plans) == pytest.approx(expected[0][0])
        assert all(p.stored_bytes <= p.node.memory_bytes for p in plans)


def test_a_faster_node_takes_more_layers():
    layers = [Part(10, 10.0)] * 12
    slow, fast = Node("slow", 10_000, cpu_bandwidth_gbs=1.0), Node("fast", 10_000, cpu_bandwidth_gbs=3.0)
    plans = split_layers(layers, Part(0, 0.0), Part(0, 0.0), (slow, fast))
    assert [(p.first_layer, p.stop_layer) for p in plans] == [(0, 3), (3, 12)]


def test_memory_moves_layers_off_a_small_node():
    layers = [Part(10, 10.0)] * 10
    plans = split_layers(layers, Part(0, 0.0), Part(0, 0.0), (Node("small", 20), Node("big", 1000)))
    assert [(p.first_layer, p.stop_layer) for p in plans] == [(0, 2), (2, 10)]


def test_more_nodes_than_layers():
    with pytest.raises(UserError, match="at most one node per layer"):
        split_layers([Part(1, 1.0)] * 2, Part(0, 0.0), Part(0, 0.0), tuple(Node(f"n{k}", 100) for k in range(3)))


@pytest.mark.parametrize("args, words", [
    (["--nodes", "1GiB"], "two or more"),
    (["--nodes", "1GiB:rtx4090,1GiB"], "build with --target rtx4090"),
    (["--nodes", "1GiB:rtx4090,1GiB:h200", "--target", "rtx4090"], "must be one kind"),
])
def test_cli_refusals(tmp_path, tiny_models, args, words):
    model = tiny_models("opt", sparsity=0.9).onnx
    result = subprocess.run([sys.executable, "-m", "picompile", "build", str(model), "-o", str(tmp_path / "a.pic"),
                             *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], result.stderr
    assert not (tmp_path / "a.pic").exists()
