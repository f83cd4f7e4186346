"""Expected decode speed: of the blocks placement places, of a compiled artifact on its target, and of the
baselines users compare with.

Decoding is bound by memory traffic, so each decode call costs the bytes it reads over its device's
bandwidth plus a fixed launch cost; a sparse part reads only the rows its predictor is expected to
select. Placement prices each block so (`price`, `price_ffn`: `passes.placement` solves with those costs and
prices llama.cpp-style layer offload with the same ones). An artifact's step is its schedule's DAG, with each
device's calls chained in program order (a device runs one call at a time), and its critical path; the
CPU-only baseline comes from the same byte counts (every weight streamed by the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from runtime.calls import Access, Call, Role, decode_weight_reads, schedule_calls
from runtime.dtypes import itemsize, nbytes
from runtime.manifest import Buffer, LayerReport, Manifest

from .placement import Block, Ffn
from .targets import Target

CALL_OVERHEAD_S = {"cpu": 2e-6, "gpu": 5e-6}  # Python dispatch + thread-pool wake-up; kernel launch
COPY_LATENCY_S = 10e-6  # one host<->device copy's fixed cost (launch, wait), whatever its size
CONTEXT = 128  # the KV cache length the estimate reads at (mid-way through a typical generation)
SPARSE_ROW_EFFICIENCY = 0.9
"""The CPU's fused sparse FFN kernel (passes/kernels/neuron.py sparse_ffn) streams the rows it gathers at this
share of the bandwidth the dense panel GEMVs stream a whole FFN at (GB/s of rows read over GB/s of weights
read). Measured 2026-12-01 on the 2-core Zen 4 (AVX-512), shared with other work, with
`benchmarks/bench_sparse_in_model.py --dense-ffn` (6 layers of distinct 2048x8192 fp32 weights on huge pages,
each layer's sparse call after its attention GEMVs, against the dense up + down GEMVs of the same layers,
alternated in one process): at 10-20% of the rows selected 1.09-1.21 on one thread (medians over rounds and
90th percentiles of calls alike; 1.09-1.17 on 4 KiB pages), 1.11-1.14 on two (90th percentiles: the medians of
the 10 ms dense calls measured the other work's load); before the kernel's prefetches went to L2, 0.6-0.7. On the
2-core Intel Xeon of 2026-12-02 the one-row kernel read at 0.54-0.86 of the dense FFN in whole-model runs, the
kernel that reads 8 rows in lockstep (neuron.ROW_GROUP) at 0.94-0.99 (fp32, float rows only). Taken a little
below 1 so that a layer near the break-even point stays dense (never slower than dense). Placement prices a CPU
part's selected rows with it (`price_ffn`), and so chooses which layers run dense."""


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


QUANT_SPARSE_ROW_EFFICIENCY = 0.45
"""4-bit rows gathered by the column-sparse kernel (neuron.sparse_columns_q) against the dense GEMV of the same
matrix where that one takes int8 activations with VNNI: on the 2-core Zen 4 (AVX-512 VNNI) of 2026-12-03, a gated
576x3072 int4 up read 10.5 GB/s sparse at 60% of its inputs kept against 23 GB/s dense (57 vs 43 us; 47 us at 40%:
no faster than dense), int8 rows 16 GB/s against a dense int8 GEMV at half that rate; on AVX2 the int4 rows beat the
dense GEMV (77 vs 144 us). The dense VNNI GEMV's integer dot products are what the row kernel lacks."""


def sparse_row_efficiency(bits: int, int8_dot: str | None) -> float:
    """The share of the dense GEMV's rate at which a column-sparse kernel reads rows of `bits`-bit weights (0: a
    float format) on a CPU whose int8-activation kernels use `int8_dot` (None: none)."""
    return QUANT_SPARSE_ROW_EFFICIENCY if bits == 4 and int8_dot == "vnni" else SPARSE_ROW_EFFICIENCY


def linear_seconds(stored_bytes: float, bandwidth: float, kept: float | None = None,
                   efficiency: float = SPARSE_ROW_EFFICIENCY) -> float:
    """One CPU linear layer's decode seconds for a matrix of `stored_bytes`: dense (`kept` None) the matrix over
    the bandwidth and one call; thresholded, the `kept` share of its rows (one per input channel) at `efficiency`
    of the bandwidth (`sparse_row_efficiency`), plus the select call before it. The quality pass prices its plans so."""
    if kept is None:
        return stored_bytes / bandwidth + launch_seconds("cpu")
    return kept * stored_bytes / (bandwidth * efficiency) + 2 * launch_seconds("cpu")


@dataclass(frozen=True)
class BlockBytes:
    """What a block keeps on the GPU and reads in one decode step on each device (each stores its weights in its own
    format), and its calls: the facts placement prices (`price`)."""

    gpu_bytes: int
    cpu_read: float
    gpu_read: float
    calls: int


def price(target: Target, block: BlockBytes) -> Block:
    """A block's decode seconds on each device: its bytes over the device's bandwidth, plus its calls' fixed cost."""
    cpu = block.cpu_read / (target.cpu_bandwidth_gbs * 1e9) + block.calls * launch_seconds("cpu")
    gpu = (block.gpu_read / (target.gpu_bandwidth_gbs * 1e9) if target.gpu_bandwidth_gbs > 0 else float("inf")) \
        + block.calls * launch_seconds("gpu")
    return Block(int(block.gpu_bytes), cpu, gpu)


@dataclass(frozen=True)
class FfnBytes:
    """One FFN layer as placement sees it: the dense FFN, and for a sparse one its neurons' activity, a neuron's
    bytes on each device, its predictor and the predicted rows per truly active neuron."""

    dense: BlockBytes
    width: int
    activation_bytes: int  # the layer's input (and output) row: what a split copies each way
    gpu_bytes_per_neuron: int = 0
    cpu_bytes_per_neuron: int = 0
    frequencies: np.ndarray | None = None
    predictor: BlockBytes | None = None
    rows_per_active: float = 1.0


def price_ffn(target: Target, ffn: FfnBytes) -> Ffn:
    """An FFN's costs: the dense GEMVs as `price`s them; a selected row at the neuron's bytes over the GPU's
    bandwidth, or over SPARSE_ROW_EFFICIENCY of the CPU's; one call per part; a split's copies (`sync_seconds`,
    plus the other part's selection scores)."""
    sparse = ffn.frequencies is not None and ffn.predictor is not None
    gpu_bw = target.gpu_bandwidth_gbs * 1e9
    return Ffn(
        dense=price(target, ffn.dense), width=ffn.width, gpu_bytes_per_neuron=ffn.gpu_bytes_per_neuron,
        frequencies=ffn.frequencies if sparse else None,
        predictor=price(target, ffn.predictor) if sparse else None, rows_per_active=ffn.rows_per_active,
        cpu_s_per_row=ffn.cpu_bytes_per_neuron / (target.cpu_bandwidth_gbs * 1e9 * SPARSE_ROW_EFFICIENCY),
        gpu_s_per_row=ffn.gpu_bytes_per_neuron / gpu_bw if gpu_bw > 0 else float("inf"),
        part_launch=Block(0, launch_seconds("cpu"), launch_seconds("gpu")),
        sync_s=sync_seconds(target, ffn.activation_bytes) + copy_seconds(target, nbytes([ffn.width], "float32")))


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


# a threshold call's part -> the layer report's held-out share of its inputs dropped (lower's report)
THRESHOLD_SPARSITY = {"up": lambda layer: layer.sparsity_in, "down": lambda layer: layer.sparsity_down,
                      "qkv": lambda layer: layer.sparsity_qkv, "o": lambda layer: layer.sparsity_o}


def expected_share(call: Call, layers: dict[int, LayerReport]) -> float:
    """The expected share of a sparse call's selectable entries its decode step reads: the inputs a
    threshold keeps on held-out tokens, or the predicted-active neurons divided between the parts by their
    share of the profiled activations."""
    selection, layer = call.selection, layers.get(call.layer)
    if selection is None or layer is None:
        return 1.0
    if selection.by == "threshold":
        dropped = THRESHOLD_SPARSITY[selection.part](layer)
        return 1.0 - (0.0 if dropped is None else dropped)
    if layer.predictor_active is None:
        return 1.0
    total = layer.gpu_neurons + layer.cpu_neurons
    hot = selection.part == "gpu"
    rows = layer.gpu_neurons if hot else layer.cpu_neurons
    hot_share = 0.0 if layer.gpu_activation_share is None else layer.gpu_activation_share
    share = hot_share if hot else 1.0 - hot_share
    return min(1.0, layer.predictor_active * total * share / max(rows, 1))


def weight_bytes(call: Call, buffers: dict[str, Buffer], selected: float = 0.0, nonzero: float = 0.0) -> float:
    """The weight bytes a decode call reads when its selection lets `selected` entries through, `nonzero` of
    them with a non-zero hidden value: the same facts the runtime counts with."""
    reads = decode_weight_reads(call, buffers)
    return reads.fixed + selected * reads.per_selected + nonzero * reads.per_nonzero


def _context_bytes(call: Call, buffers: dict[str, Buffer]) -> float:
    """The KV cache an attention call reads: its cached positions, up to CONTEXT."""
    total = 0.0
    for arg in call.args:
        if arg.access is Access.CONTEXT:
            info = buffers[arg.buffer]
            max_context = info.shape[1]
            total += nbytes(info.shape, info.dtype) * min(CONTEXT, max_context) / max_context
    return total


def call_seconds(call: Call, buffers: dict[str, Buffer], layers: dict[int, LayerReport], target: Target) -> float:
    """One decode call: the bytes it reads over its device's bandwidth, plus its fixed cost."""
    if call.role is Role.COPY:
        return copy_seconds(target, _row_bytes(buffers, call.reads()[0]))
    bandwidth = (target.gpu_bandwidth_gbs if call.device == "gpu" else target.cpu_bandwidth_gbs) * 1e9
    selected = 0.0 if call.selection is None else expected_share(call, layers) * call.selection.capacity
    read = weight_bytes(call, buffers, selected, selected) + _context_bytes(call, buffers)
    return read / bandwidth + launch_seconds(call.device)


def _row_bytes(buffers: dict[str, Buffer], name: str) -> int:
    info = buffers[name]
    return itemsize(info.dtype) * info.shape[-1]


def step_seconds(calls: list[Call], edges: list[dict], seconds: dict[str, float]) -> float:
    """The decode step's critical path through the DAG (each call costing `seconds[id]`), each
    device's calls chained in program order."""
    dag = nx.DiGraph()
    last_on_device: dict[str, str] = {}
    for call in calls:
        if not call.decode:
            continue
        dag.add_node(call.id, seconds=seconds[call.id])
        if call.device in last_on_device:
            dag.add_edge(last_on_device[call.device], call.id)
        last_on_device[call.device] = call.id
    for edge in edges:
        if edge["source"] in dag and edge["target"] in dag and "decode" in edge.get("phases", ["decode"]):
            dag.add_edge(edge["source"], edge["target"])
    # node weights on a longest path: give each edge its target's time, and add the first node's
    for u, v in dag.edges:
        dag.edges[u, v]["seconds"] = dag.nodes[v]["seconds"]
    path = nx.dag_longest_path(dag, weight="seconds")
    return sum(dag.nodes[n]["seconds"] for n in path)


def _dense_layer_bytes(calls: list[Call], buffers: dict[str, Buffer]) -> tuple[dict[int, int], int]:
    """Bytes of every weight a dense build would stream per token: per layer, and outside layers.
    Predictors do not exist in a dense build; sparse parts count in full; the embedding's gather is free."""
    per_layer: dict[int, int] = {}
    outside = 0
    seen = set()
    for call in calls:
        if not call.decode or call.role in (Role.PREDICTOR, Role.COPY, Role.EMBED):
            continue
        for name in call.buffers():
            info = buffers.get(name)
            if name in seen or info is None or info.kind != "weight":
                continue
            seen.add(name)
            size = nbytes(info.shape, info.dtype)
            if call.layer is None:
                outside += size
            else:
                per_layer[call.layer] = per_layer.get(call.layer, 0) + size
    return per_layer, outside


def estimate(manifest: Manifest, schedule: dict, target: Target) -> Estimate:
    """The artifact's expected decode: its schedule's critical path, and the CPU-only dense baseline from the same
    byte counts. Layer offload's is the placement report's (partition priced it with the program's own costs: the
    one like-for-like comparison); None where the build placed nothing (CPU targets, threshold mode)."""
    buffers = manifest.buffers
    by_layer = {layer.layer: layer for layer in manifest.layers}
    calls = schedule_calls(schedule)
    decode = [call for call in calls if call.decode]
    seconds = {call.id: call_seconds(call, buffers, by_layer, target) for call in decode}
    step = step_seconds(calls, schedule["edges"], seconds)
    device_bytes = {"cpu": 0.0, "gpu": 0.0}
    for call in decode:
        if call.role is not Role.COPY:
            bandwidth = (target.gpu_bandwidth_gbs if call.device == "gpu" else target.cpu_bandwidth_gbs) * 1e9
            device_bytes[call.device] += (seconds[call.id] - launch_seconds(call.device)) * bandwidth
    per_layer, outside = _dense_layer_bytes(calls, buffers)
    overhead = sum(1 for call in decode if call.role not in (Role.PREDICTOR, Role.COPY)) * launch_seconds("cpu")
    cpu_only = (sum(per_layer.values()) + outside) / (target.cpu_bandwidth_gbs * 1e9) + overhead
    placement = manifest.placement
    offload, offloaded = None, 0
    if target.has_gpu and placement.get("layer_offload_step_s"):
        offload, offloaded = 1.0 / placement["layer_offload_step_s"], placement["layer_offload_layers"]
    return Estimate(1.0 / step, 1.0 / cpu_only, offload, offloaded, int(device_bytes["gpu"]), int(device_bytes["cpu"]))


def byte_disagreements(engine) -> list[str]:
    """The decode calls whose weight bytes, as the runtime counted them in `engine`'s last decode step (its
    bound steps read the count and hidden buffers the kernels wrote), differ from this model's for the same
    selections: the check that both read the calls' facts alike. Call it right after a one-token forward."""
    calls = {call.id: call for call in engine.calls}
    buffers = engine.manifest.buffers
    wrong = []
    for step in engine.decode_steps:
        call = calls[step.name]
        selected = nonzero = 0.0
        if call.selection is not None:
            selected = int(engine.read_buffer(call.selection.count, call.device)[0, 0])
            nonzero = selected
            if call.selection.hidden is not None:
                nonzero = int(np.count_nonzero(engine.read_buffer(call.selection.hidden, call.device)[0, :selected]))
        if step.bytes_read() != weight_bytes(call, buffers, selected, nonzero):
            wrong.append(call.id)
    return wrong
