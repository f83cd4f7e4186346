"""nodes: the machines a model is split across (`build --nodes`), and which decoder layers each one runs.

A node is one machine: the memory it offers the model (its weights and KV caches), the device it computes on
(the CPU, or a GPU target whose card it has) and the Ray resources its stage's actor asks for. The split gives
each node one contiguous range of layers, in the nodes' order (stage 0 also holds the embedding, the last one the
output layer), and a token's hidden state crosses from one stage to the next over the network.

Of the splits whose every stage fits its node's memory, `split_layers` takes the one whose slowest stage is
fastest: the tokens of concurrent requests overlap across the stages, so the slowest stage bounds the pipeline's
tokens/s; ties go to the smallest sum of the stages (one request's token passes through all of them). A stage's
seconds are its bytes read per token over its node's bandwidths: the part its card holds at the GPU's, the rest
at the CPU's (the layer-offload price; the placement then refines each GPU node's hot/cold split within it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError
from .targets import RESERVE_FRACTION, TARGETS, Target, format_size, parse_size

# The link between two nodes: 10 GbE, the common fast home / small-lab network (a sustained 1.25 GB/s and a
# round trip's latency per hand-over, Ray's object transfer included). The hand-over of one token is a few KiB:
# its latency, not its bytes, is what it costs.
LINK_BANDWIDTH_GBS = 1.25
LINK_LATENCY_S = 50e-6


@dataclass(frozen=True)
class Node:
    name: str
    memory_bytes: int  # what the node offers the model: its weights and KV caches
    target: str = "cpu"  # "cpu", or the GPU target (passes.targets.TARGETS) of the node's card
    resources: dict = field(default_factory=dict)  # Ray custom resources the stage's actor asks for
    cpu_bandwidth_gbs: float | None = None  # None: the target's
    gpu_memory_bytes: int | None = None  # what its card offers the model (None: the target card's whole memory)

    @property
    def profile(self) -> Target:
        return TARGETS[self.target]

    @property
    def cpu_bandwidth(self) -> float:
        """Bytes per second the node's CPU streams."""
        return (self.cpu_bandwidth_gbs or self.profile.cpu_bandwidth_gbs) * 1e9

    @property
    def gpu_bytes(self) -> int:
        """What its card may hold of the model (its memory less the reserve; 0 without one)."""
        if not self.profile.has_gpu:
            return 0
        return int((self.gpu_memory_bytes or self.profile.gpu_memory_bytes) * (1 - RESERVE_FRACTION))

    def describe(self) -> str:
        card = f", {self.target}" if self.target != "cpu" else ""
        return f"{self.name} ({format_size(self.memory_bytes)}{card})"


def handover_seconds(nbytes: int) -> float:
    """One token's hidden state sent from one node to the next."""
    return LINK_LATENCY_S + nbytes / (LINK_BANDWIDTH_GBS * 1e9)


# ---------------------------------------------------------------------------------------------- --nodes SPEC

_SPEC_HELP = ("--nodes takes COUNTxMEMORY (2x24GiB), a comma-separated list of MEMORY[:TARGET] (24GiB,16GiB:rtx4090) "
              "or a JSON file listing each node's name, memory, target and Ray resources")


def parse_nodes(spec: str) -> tuple[Node, ...]:
    """The nodes of `spec`: `2x24GiB`, `24GiB,16GiB:rtx4090`, or a JSON file ({"nodes": [{"name", "memory",
    "target", "resources", "cpu_bandwidth_gbs", "gpu_memory"}, ...]}, or the list alone). At least two: one node
    is no split."""
    text = spec.strip()
    path = Path(text)
    if text.endswith(".json") or path.is_file():
        nodes = _nodes_from_file(path)
    else:
        nodes = _nodes_from_text(text)
    if len(nodes) < 2:
        raise UserError(f"--nodes {spec!r} names {len(nodes)} node; a split needs two or more (without --nodes "
                        "the model runs on one machine)")
    names = [node.name for node in nodes]
    if len(set(names)) != len(names):
        raise UserError(f"--nodes: node names must differ, got {', '.join(names)}")
    return tuple(nodes)


def _nodes_from_text(text: str) -> list[Node]:
    count = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(.+)", text)
    items = [count.group(2)] * int(count.group(1)) if count else text.split(",")
    if count and not 0 < int(count.group(1)) <= 64:
        raise UserError(f"--nodes: the count must be between 1 and 64, got {count.group(1)}")
    nodes = []
    for index, item in enumerate(items):
        memory, _, target = item.strip().partition(":")
        if not memory:
            raise UserError(f"--nodes {text!r}: node {index} has no memory; {_SPEC_HELP}")
        nodes.append(_node(f"node{index}", _size(memory, index), target.strip() or "cpu", {}, None))
    return nodes


def _nodes_from_file(path: Path) -> list[Node]:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"--nodes {path}: cannot read it ({error.strerror or type(error).__name__})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"--nodes {path}: not JSON ({error})") from None
    entries = data.get("nodes") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise UserError(f"--nodes {path}: expected {{\"nodes\": [{{\"memory\": \"24GiB\", ...}}, ...]}}")
    nodes = []
    for index, entry in enumerate(entries):
        unknown = set(entry) - {"name", "memory", "target", "resources", "cpu_bandwidth_gbs", "gpu_memory"}
        if unknown:
            raise UserError(f"--nodes {path}: node {index} has unknown field(s) {', '.join(sorted(unknown))}")
        if "memory" not in entry:
            raise UserError(f"--nodes {path}: node {index} has no memory (e.g. \"memory\": \"24GiB\")")
        resources = entry.get("resources", {})
        if not isinstance(resources, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in resources.items()):
            raise UserError(f"--nodes {path}: node {index}'s resources must map names to positive numbers")
        bandwidth = entry.get("cpu_bandwidth_gbs")
        if bandwidth is not None and not (isinstance(bandwidth, (int, float)) and not isinstance(bandwidth, bool)
                                          and 0 < bandwidth < math.inf):
            raise UserError(f"--nodes {path}: node {index}'s cpu_bandwidth_gbs must be a positive number")
        memory = entry["memory"]
        memory_bytes = _size(memory, index) if isinstance(memory, str) else memory
        if not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool):
            raise UserError(f"--nodes {path}: node {index}'s memory must be a size like \"24GiB\" or a byte count")
        name = entry.get("name", f"node{index}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise UserError(f"--nodes {path}: node {index}'s name must be letters, digits, '_', '.' or '-'")
        gpu_memory = entry.get("gpu_memory")
        gpu_bytes = _size(gpu_memory, index) if isinstance(gpu_memory, str) else gpu_memory
        if gpu_memory is not None and (not isinstance(gpu_bytes, int) or isinstance(gpu_bytes, bool) or gpu_bytes <= 0
                                       or entry.get("target", "cpu") == "cpu"):
            raise UserError(f"--nodes {path}: node {index}'s gpu_memory must be a size like \"16GiB\" of its card "
                            "(a node with a GPU target)")
        nodes.append(_node(name, memory_bytes, entry.get("target", "cpu"), dict(resources), bandwidth, gpu_bytes))
    return nodes


def _size(text: str, index: int) -> int:
    try:
        return parse_size(text)
    except UserError:
        raise UserError(f"--nodes: node {index}'s memory {text.strip()!r} is not a size like 24GiB; "
                        f"{_SPEC_HELP}") from None


def _node(name: str, memory_bytes: int, target, resources: dict, bandwidth, gpu_bytes: int | None = None) -> Node:
    if not isinstance(target, str) or target not in TARGETS:
        raise UserError(f"--nodes: node {name}'s target {target!r} is unknown; choose one of {', '.join(TARGETS)}")
    if memory_bytes <= 0:
        raise UserError(f"--nodes: node {name}'s memory must be positive")
    return Node(name, memory_bytes, target, resources, bandwidth, gpu_bytes)


# ---------------------------------------------------------------------------------------------- the split


@dataclass(frozen=True)
class Part:
    """A piece of the model as the split sees it: the memory it takes on its node and the bytes one decode
    step reads of it (a layer: its weights, as far as its sparsity reads them, and its KV cache)."""

    stored_bytes: int
    read_bytes: float


@dataclass(frozen=True)
class StagePlan:
    node: Node
    first_layer: int
    stop_layer: int
    stored_bytes: int
    step_s: float  # its part of a decode step


def stage_seconds(node: Node, read_bytes: float) -> float:
    """A stage's decode seconds on `node`: what its card holds at the GPU's bandwidth, the rest at the CPU's."""
    on_gpu = min(read_bytes, node.gpu_bytes) if node.gpu_bytes else 0
    gpu = on_gpu / (node.profile.gpu_bandwidth_gbs * 1e9) if on_gpu else 0.0
    return gpu + (read_bytes - on_gpu) / node.cpu_bandwidth


def split_layers(layers: list[Part], embed: Part, head: Part, nodes: tuple[Node, ...]) -> list[StagePlan]:
    """Each node's contiguous range of `layers` (every node at least one), the embedding on the first and the
    output layer on the last: the split with the fastest slowest stage among those that fit (see the module's
    doc); a UserError naming what is short where none fits."""
    count, stages = len(layers), len(nodes)
    if stages > count:
        raise UserError(f"--nodes names {stages} nodes but the model has {count} layers: at most one node per layer")
    stored = [0] * (count + 1)
    read = [0.0] * (count + 1)
    for i, part in enumerate(layers):
        stored[i + 1], read[i + 1] = stored[i] + part.stored_bytes, read[i] + part.read_bytes

    def cost(k: int, first: int, stop: int) -> tuple[int, float] | None:
        extra = [p for p, at in ((embed, k == 0), (head, k == stages - 1)) if at]
        need = stored[stop] - stored[first] + sum(p.stored_bytes for p in extra)
        if need > nodes[k].memory_bytes:
            return None
        return need, stage_seconds(nodes[k], read[stop] - read[first] + sum(p.read_bytes for p in extra))

    # best[k][i]: (slowest stage, sum of stages, the split) of layers [0, i) over nodes [0, k]
    best: list[dict[int, tuple[float, float, list[tuple[int, int]]]]] = [{} for _ in range(stages)]
    for stop in range(1, count - stages + 2):
        priced = cost(0, 0, stop)
        if priced is not None:
            best[0][stop] = (priced[1], priced[1], [(0, stop)])
    for k in range(1, stages):
        for stop in range(k + 1, count - stages + k + 2):
            options = []
            for first, (slowest, total, ranges) in best[k - 1].items():
                if first >= stop:
                    continue
                priced = cost(k, first, stop)
                if priced is not None:
                    options.append((max(slowest, priced[1]), total + priced[1], ranges + [(first, stop)]))
            if options:
                best[k][stop] = min(options, key=lambda option: option[:2])
    if count not in best[-1]:
        need = stored[count] + embed.stored_bytes + head.stored_bytes
        offered = sum(node.memory_bytes for node in nodes)
        raise UserError(f"the model does not fit the nodes: it needs {format_size(need)} (weights and KV caches; "
                        f"the largest layer {format_size(max(p.stored_bytes for p in layers))}) and the "
                        f"{stages} nodes offer {format_size(offered)} "
                        f"({', '.join(node.describe() for node in nodes)}); add a node or memory, or build with "
                        "a smaller --weight-dtype or --max-context")
    plans = []
    for k, (first, stop) in enumerate(best[-1][count][2]):
        need, seconds = cost(k, first, stop)
        plans.append(StagePlan(nodes[k], first, stop, need, seconds))
    return plans
