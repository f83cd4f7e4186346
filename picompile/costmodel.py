"""Expected decode speed of a compiled artifact on its target, and of the baselines users compare with.

Decoding is bound by memory traffic, so each decode call costs the bytes it reads over its device's
bandwidth plus a fixed launch cost; a sparse part reads only the rows its predictor is expected to
select. The schedule's DAG, with each device's calls chained in program order (a device runs one call
at a time), gives the step time as its critical path. The baselines come from the same byte counts:
CPU only (every weight streamed by the CPU) and llama.cpp-style offload (as many whole layers as fit in
GPU memory, the rest on the CPU).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import networkx as nx

from runtime.engine import reads_selected_rows  # one answer for the runtime's byte count and this model

from runtime.dtypes import itemsize, nbytes

from .targets import Target

CALL_OVERHEAD_S = {"cpu": 2e-6, "gpu": 5e-6}  # Python dispatch + thread-pool wake-up; kernel launch
COPY_LATENCY_S = 10e-6  # one host<->device copy's fixed cost (launch, wait), whatever its size
CONTEXT = 128  # the KV cache length the estimate reads at (mid-way through a typical generation)
_LAYER = re.compile(r"layers\.(\d+)\.")


def launch_seconds(device: str) -> float:
    """The fixed cost of one call on `device`."""
    return CALL_OVERHEAD_S[device]


def copy_seconds(target: Target, nbytes: int) -> float:
    """One host<->device copy of `nbytes`: its fixed cost plus the bytes over PCIe."""
    return COPY_LATENCY_S + (nbytes / (target.pcie_bandwidth_gbs * 1e9) if target.pcie_bandwidth_gbs > 0 else 0.0)


def sync_seconds(target: Target, activation_bytes: int) -> float:
    """One CPU-GPU synchronisation of a hybrid layer: its input copied to the GPU and its partial output
    copied back (`activation_bytes` each). Placement prices a layer's split with this, the estimate its copies."""
    return 2 * copy_seconds(target, activation_bytes)


@dataclass
class Estimate:
    picompile_tokens_per_s: float
    cpu_only_tokens_per_s: float
    layer_offload_tokens_per_s: float | None  # None on CPU targets
    offloaded_layers: int
    gpu_bytes_per_token: int
    cpu_bytes_per_token: int

    def lines(self, target: Target) -> list[str]:
        lines = [f"expected decode on {target.name}: picompile {self.picompile_tokens_per_s:.1f} tok/s "
                 f"(GPU reads {self.gpu_bytes_per_token / 2**20:.0f} MiB/token, CPU {self.cpu_bytes_per_token / 2**20:.0f} MiB)"]
        if self.layer_offload_tokens_per_s is not None:
            lines.append(f"  llama.cpp-style layer offload ({self.offloaded_layers} whole layers on the GPU): "
                         f"{self.layer_offload_tokens_per_s:.1f} tok/s")
        lines.append(f"  CPU only, dense: {self.cpu_only_tokens_per_s:.1f} tok/s")
        return lines


def _weight_bytes(buffers: dict, name: str) -> int:
    info = buffers.get(name)
    if info is None or info["kind"] not in ("weight", "cache"):
        return 0
    return nbytes(info["shape"], info["dtype"])


def _selected_fraction(node: dict, layers: dict[int, dict]) -> float:
    """The expected share of a sparse part's rows its decode call reads: the predicted-active neurons,
    divided between the parts by their share of the profiled activations."""
    match = _LAYER.match(node["id"])
    layer = layers.get(int(match.group(1))) if match else None
    if layer is not None and "threshold_in" in layer:  # threshold mode: the inputs kept on held-out tokens
        return 1.0 - layer["sparsity_down" if node["id"].endswith(".down") else "sparsity_in"]
    if layer is None or "predictor_active" not in layer:
        return 1.0
    total = layer["gpu_neurons"] + layer["cpu_neurons"]
    hot = node["device"] == "gpu"
    rows = layer["gpu_neurons"] if hot else layer["cpu_neurons"]
    share = layer.get("gpu_activation_share", 0.0) if hot else 1.0 - layer.get("gpu_activation_share", 0.0)
    return min(1.0, layer["predictor_active"] * total * share / max(rows, 1))


def call_seconds(node: dict, buffers: dict, layers: dict[int, dict], target: Target) -> float:
    """One decode call: the bytes it reads over its device's bandwidth, plus its fixed cost."""
    if node["decode"] == "copy":
        return copy_seconds(target, _activation_bytes(buffers, node["args"][0]))
    bandwidth = (target.gpu_bandwidth_gbs if node["device"] == "gpu" else target.cpu_bandwidth_gbs) * 1e9
    read = 0.0
    for arg in node["args"]:
        info = buffers.get(arg)
        if info is None:
            continue
        if info["kind"] == "cache" and node["decode"].startswith("attention"):
            max_context = info["shape"][1]  # attention reads the cached keys/values up to the context
            read += _weight_bytes(buffers, arg) * min(CONTEXT, max_context) / max_context
        elif info["kind"] == "weight" and node["op_class"] == "embed":
            read += _activation_bytes(buffers, arg)  # a gather reads one row per token
        elif info["kind"] == "weight":
            sparse = reads_selected_rows(node["decode"], info)
            read += _weight_bytes(buffers, arg) * (_selected_fraction(node, layers) if sparse else 1.0)
    return read / bandwidth + CALL_OVERHEAD_S[node["device"]]


def _activation_bytes(buffers: dict, name: str) -> int:
    info = buffers.get(name, {"shape": [1, 1], "dtype": "float32"})
    return itemsize(info["dtype"]) * info["shape"][-1]


def step_seconds(schedule: dict, seconds: dict[str, float]) -> float:
    """The decode step's critical path through the DAG (each call costing `seconds[id]`), each
    device's calls chained in program order."""
    nodes = sorted((n for n in schedule["nodes"] if n["decode"]), key=lambda n: n["order"])
    dag = nx.DiGraph()
    last_on_device: dict[str, str] = {}
    for node in nodes:
        dag.add_node(node["id"], seconds=seconds[node["id"]])
        if node["device"] in last_on_device:
            dag.add_edge(last_on_device[node["device"]], node["id"])
        last_on_device[node["device"]] = node["id"]
    for edge in schedule["edges"]:
        if edge["source"] in dag and edge["target"] in dag and "decode" in edge.get("phases", ["decode"]):
            dag.add_edge(edge["source"], edge["target"])
    # node weights on a longest path: give each edge its target's time, and add the first node's
    for u, v in dag.edges:
        dag.edges[u, v]["seconds"] = dag.nodes[v]["seconds"]
    path = nx.dag_longest_path(dag, weight="seconds")
    return sum(dag.nodes[n]["seconds"] for n in path)


def _dense_layer_bytes(schedule: dict, buffers: dict) -> tuple[dict[int, int], int]:
    """Bytes of every weight a dense build would stream per token: per layer, and outside layers.
    Predictors do not exist in a dense build; sparse parts count in full."""
    per_layer: dict[int, int] = {}
    outside = 0
    seen = set()
    for node in schedule["nodes"]:
        if not node["decode"] or node["op_class"] in ("predictor", "copy"):
            continue
        for arg in node["args"]:
            name = arg.split("@")[0]
            if name in seen or buffers.get(arg, {}).get("kind") != "weight" or node["op_class"] == "embed":
                continue
            seen.add(name)
            match = _LAYER.match(name)
            if match:
                per_layer[int(match.group(1))] = per_layer.get(int(match.group(1)), 0) + _weight_bytes(buffers, arg)
            else:
                outside += _weight_bytes(buffers, arg)
    return per_layer, outside


def estimate(manifest: dict, schedule: dict, target: Target, vram_budget_bytes: int | None = None) -> Estimate:
    buffers = manifest["buffers"]
    by_layer = {layer["layer"]: layer for layer in manifest.get("layers", [])}
    decode = [node for node in schedule["nodes"] if node["decode"]]
    seconds = {node["id"]: call_seconds(node, buffers, by_layer, target) for node in decode}
    step = step_seconds(schedule, seconds)
    device_bytes = {"cpu": 0.0, "gpu": 0.0}
    for node in decode:
        if node["decode"] != "copy":
            bandwidth = (target.gpu_bandwidth_gbs if node["device"] == "gpu" else target.cpu_bandwidth_gbs) * 1e9
            device_bytes[node["device"]] += (seconds[node["id"]] - CALL_OVERHEAD_S[node["device"]]) * bandwidth
    per_layer, outside = _dense_layer_bytes(schedule, buffers)
    calls = sum(1 for n in decode if n["op_class"] not in ("predictor", "copy"))
    overhead = calls * CALL_OVERHEAD_S["cpu"]
    total = sum(per_layer.values()) + outside
    cpu_only = total / (target.cpu_bandwidth_gbs * 1e9) + overhead
    offload, offloaded = None, 0
    if target.has_gpu:
        budget = vram_budget_bytes if vram_budget_bytes is not None else target.gpu_memory_bytes
        gpu_bytes = 0
        for layer in sorted(per_layer):  # whole layers, in order, while they fit
            if gpu_bytes + per_layer[layer] > budget:
                break
            gpu_bytes += per_layer[layer]
            offloaded += 1
        if offloaded == len(per_layer) and gpu_bytes + outside <= budget:
            gpu_bytes += outside
        cpu_bytes = total - gpu_bytes
        offload = 1.0 / (gpu_bytes / (target.gpu_bandwidth_gbs * 1e9) + cpu_bytes / (target.cpu_bandwidth_gbs * 1e9)
                         + overhead + (COPY_LATENCY_S if 0 < offloaded else 0))
    return Estimate(1.0 / step, 1.0 / cpu_only, offload, offloaded, int(device_bytes["gpu"]), int(device_bytes["cpu"]))
