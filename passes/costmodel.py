"""Expected decode speed: of the blocks placement places, of a compiled artifact on its target, and of the
baselines users compare with.

Decoding is bound by memory traffic, so each decode call costs the bytes it reads over its device's
bandwidth plus a fixed launch cost (`read_seconds`, the one formula); a sparse part reads only the rows its
predictor is expected to select, at `sparse_row_efficiency` of the bandwidth. Each block is priced so (`price`,
`price_ffn`) into a `Problem`, and `step_seconds(problem, plan)` is the one price of a plan: the placement's
objective (`passes.placement` solves its linear form and checks the answer with it), the dense-fallback choice
(`whole_ffn_seconds`), the baselines (CPU alone, llama.cpp-style layer offload), and through partition's report the
artifact's estimate and `inspect`. The quality pass prices a matrix's levels with the same formula
(`linear_seconds`; a threshold level `column_seconds`, which adds the column kernel's fixed cost). A build
without a placement (threshold mode) is estimated from its schedule's DAG, each device's calls chained in program
order, and its critical path; its CPU-only baseline from the same byte counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx
import numpy as np

from runtime.calls import Access, Call, Role, decode_weight_reads, schedule_calls
from runtime.dtypes import WEIGHT_FORMATS, itemsize, nbytes
from runtime.manifest import Buffer, LayerReport, Manifest

from .nodes import handover_seconds
from .targets import Target

CALL_OVERHEAD_S = {"cpu": 2e-6, "gpu": 5e-6}  # Python dispatch + thread-pool wake-up; kernel launch
COPY_LATENCY_S = 10e-6  # one host<->device copy's fixed cost (launch, wait), whatever its size
CONTEXT = 128  # the KV cache length the estimate reads at (mid-way through a typical generation)
SPARSE_ROW_EFFICIENCY = 0.9
"""The CPU's fused sparse FFN kernel (passes/kernels/neuron.py sparse_ffn) streams the rows it gathers at this
share of the bandwidth the dense panel GEMVs stream a whole FFN at (GB/s of rows read over GB/s of weights
read). Measured on a 2-core Zen 4 (AVX-512), shared with other work, with
`benchmarks/bench_sparse_in_model.py --dense-ffn` (6 layers of distinct 2048x8192 fp32 weights on huge pages,
each layer's sparse call after its attention GEMVs, against the dense up + down GEMVs of the same layers,
alternated in one process): at 10-20% of the rows selected 1.09-1.21 on one thread (medians over rounds and
90th percentiles of calls alike; 1.09-1.17 on 4 KiB pages), 1.11-1.14 on two (90th percentiles: the medians of
the 10 ms dense calls measured the other work's load); with the kernel's prefetches to L1, 0.6-0.7. On a
2-core Intel Xeon the one-row kernel read at 0.54-0.86 of the dense FFN in whole-model runs, the
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
matrix where that one takes int8 activations with VNNI: on a 2-core Zen 4 (AVX-512 VNNI), a gated
576x3072 int4 up read 10.5 GB/s sparse at 60% of its inputs kept against 23 GB/s dense (57 vs 43 us; 47 us at 40%:
no faster than dense), int8 rows 16 GB/s against a dense int8 GEMV at half that rate; on AVX2 the int4 rows beat the
dense GEMV (77 vs 144 us). The dense VNNI GEMV's integer dot products are what the row kernel lacks.
Placement prices predictor builds' quantized rows with it; threshold levels are priced by `column_seconds`, whose
fixed cost explains the same two figures (COLUMN_CALL_S, QUANT_COLUMN_ROW_EFFICIENCY)."""


def sparse_row_efficiency(bits: int, int8_dot: str | None) -> float:
    """The share of the dense GEMV's rate at which a column-sparse kernel reads rows of `bits`-bit weights (0: a
    float format) on a CPU whose int8-activation kernels use `int8_dot` (None: none)."""
    return QUANT_SPARSE_ROW_EFFICIENCY if bits == 4 and int8_dot == "vnni" else SPARSE_ROW_EFFICIENCY


def read_seconds(read_bytes: float, bandwidth: float, device: str, calls: int, efficiency: float = 1.0) -> float:
    """The one price of decode work on a device: the bytes it reads over `bandwidth` (bytes/s; 0: the device is
    absent, infinitely slow) at `efficiency` of it (rows gathered: `sparse_row_efficiency`), plus its calls' fixed
    cost. Blocks (`price`), selected rows (`price_ffn`) and the quality pass's matrices (`linear_seconds`) are
    priced by it."""
    if bandwidth <= 0:
        return math.inf
    return read_bytes / (bandwidth * efficiency) + calls * launch_seconds(device)


COLUMN_CALL_S = 20e-6
"""What a threshold call (select, then the column-sparse GEMV neuron.sparse_columns / sparse_columns_q) costs on
the CPU beyond the rows it reads: the second parallel loop that sums its tasks' partial rows, zeroing them, and
starting its tasks' row streams cold. Priced as a 2 us launch, low levels of small matrices would look cheaper
than dense where they are no faster (BENCHMARKS.md, "Measurements behind the code's constants")."""


COLUMN_ROW_RATE = 1.25
COLUMN_ROW_START_BYTES = 600
"""A column kernel reads a float row of r bytes as if it were r + COLUMN_ROW_START_BYTES at COLUMN_ROW_RATE of the
dense panel GEMV's rate (a new stream per row; whole rows stream faster than the panel GEMVs of these shapes):
SmolLM2's gated gate|up rows (12 KiB) at ~1.2x the dense rate, its down rows (2.3 KiB) at ~1.0x. Fitted to
bench_column_kernels.py and `run --profile` (BENCHMARKS.md, "Measurements behind the code's constants")."""
QUANT_COLUMN_ROW_EFFICIENCY = 0.67
"""4-bit rows against the dense GEMV over int8 activations with VNNI, beside COLUMN_CALL_S (BENCHMARKS.md)."""


def column_row_efficiency(row_bytes: float, bits: int, int8_dot: str | None) -> float:
    """The share of the bandwidth a column kernel reads rows of `row_bytes` at (`bits`: 0 for a float format;
    `int8_dot`: the CPU's int8-activation dot product, None: not known, priced as the slower VNNI case)."""
    if bits == 4 and int8_dot in ("vnni", None):
        return QUANT_COLUMN_ROW_EFFICIENCY
    return COLUMN_ROW_RATE * row_bytes / (row_bytes + COLUMN_ROW_START_BYTES)


def column_seconds(stored_bytes: float, bandwidth: float, kept: float, efficiency: float) -> float:
    """One column kernel call of a CPU linear layer thresholded to the `kept` share of its inputs: those rows of
    its matrix of `stored_bytes` (one per input channel) at `efficiency` of the bandwidth
    (`column_row_efficiency`), its launch and its fixed cost (COLUMN_CALL_S); the select call before it is a call
    of its own. The quality pass prices its threshold levels so (with the select), and the estimate each
    threshold call."""
    return read_seconds(kept * stored_bytes, bandwidth, "cpu", 1, efficiency) + COLUMN_CALL_S


PRICE_ERROR = 0.10
"""How far the cost model's expected decode may be from the measured one (benchmarks/bench_cost_model.py checks
it): a sparse choice is taken only where it is expected to save more than this share of the dense time, so that
no plan is slower than dense by the model's own error (`worth_sparsity`)."""


def worth_sparsity(sparse_s: float, dense_s: float) -> bool:
    """Whether a sparse price beats the dense one by more than the cost model's error."""
    return sparse_s < (1.0 - PRICE_ERROR) * dense_s


def cpu_bandwidth(target: Target) -> float:
    """Bytes per second a plain CPU read streams at (a KV cache, a block whose formats are not told apart): the
    machine's measured fp32 GEMV where the build measured its kernels (`Target.cpu_rates`), else the target's."""
    rates = target.cpu_rates
    return rates.stream_bytes_per_s if rates is not None else target.cpu_bandwidth_gbs * 1e9


def gemv_seconds(target: Target, read_bytes: float, fmt: str, calls: int = 1, columns: int = 0) -> float:
    """`calls` dense CPU decode GEMVs reading `read_bytes` of weights in format `fmt` in all, of `columns` outputs
    in all, their launches included: at the rate and fixed costs measured for that format on this machine, else at
    the target's bandwidth."""
    rates = target.cpu_rates
    if rates is not None and fmt in rates.gemv:
        rate = rates.gemv[fmt]
        return rate.seconds(read_bytes, columns) + (calls - 1) * rate.call_s + calls * launch_seconds("cpu")
    return read_seconds(read_bytes, target.cpu_bandwidth_gbs * 1e9, "cpu", calls)


def column_units(fmt: str, stored_bytes: float, rows: int, kept: float) -> float:
    """The units of a threshold call's per-unit cost (`KernelRate.unit_s`) over a matrix of `rows` inputs: the kept
    rows (each a new stream), or for a file's own blocks (kquant_columns) the outputs of every block of the matrix
    (each block's sums are taken through its scales across the N outputs; at the shares plans take every block holds
    a kept input, so this part does not shrink with them)."""
    weight_format = WEIGHT_FORMATS[fmt]
    if weight_format.kept_from_file:
        return stored_bytes / weight_format.bytes_per_weight / weight_format.block
    return kept * rows


def threshold_seconds(target: Target, stored_bytes: float, kept: float, fmt: str, rows: int,
                      int8_dot: str | None = None) -> float:
    """A thresholded CPU linear layer's decode seconds: the select call, then the column kernel over the `kept`
    share of the `rows` rows of a matrix of `stored_bytes` in format `fmt`: at the rates measured on this machine
    (a fixed cost per call and per `column_units`, a rate per byte of kept rows), else the target's bandwidth at
    `column_row_efficiency` plus COLUMN_CALL_S."""
    rates = target.cpu_rates
    if rates is not None and fmt in rates.columns:
        units = column_units(fmt, stored_bytes, rows, kept)
        return rates.columns[fmt].seconds(kept * stored_bytes, units) + 2 * launch_seconds("cpu")
    bits = WEIGHT_FORMATS[fmt].bits
    efficiency = column_row_efficiency(stored_bytes / max(rows, 1), bits, int8_dot)
    return column_seconds(stored_bytes, target.cpu_bandwidth_gbs * 1e9, kept, efficiency) + launch_seconds("cpu")


def linear_seconds(stored_bytes: float, bandwidth: float, kept: float | None = None,
                   efficiency: float = SPARSE_ROW_EFFICIENCY) -> float:
    """One CPU linear layer's decode seconds for a matrix of `stored_bytes`: dense (`kept` None) the matrix over
    the bandwidth and one call; thresholded, the `kept` share of its rows (one per input channel) at `efficiency`
    of the bandwidth (`sparse_row_efficiency`), plus the select call before it. The quality pass prices its plans so."""
    if kept is None:
        return read_seconds(stored_bytes, bandwidth, "cpu", 1)
    return read_seconds(kept * stored_bytes, bandwidth, "cpu", 2, efficiency)


@dataclass(frozen=True)
class Block:
    """A block that runs whole on one device: the GPU memory it takes there, its decode seconds on each."""

    gpu_bytes: int
    cpu_s: float
    gpu_s: float

    def seconds(self, device: str) -> float:
        return self.gpu_s if device == "gpu" else self.cpu_s


@dataclass(frozen=True)
class Ffn:
    """One layer's FFN. `dense`: the whole FFN as dense GEMVs (gpu_bytes: every neuron). Sparse, when it has a
    predictor: `frequencies` (expected activity per neuron), a neuron's GPU bytes, each device's seconds per
    selected neuron, and its parts' fixed cost (`part_launch`: cpu_s and gpu_s, no memory)."""

    dense: Block
    width: int  # neurons
    gpu_bytes_per_neuron: int = 0
    frequencies: np.ndarray | None = None  # None: no predictor, dense only
    predictor: Block | None = None
    rows_per_active: float = 1.0  # selected rows per truly active neuron (the predictor's false positives)
    cpu_s_per_row: float = 0.0
    gpu_s_per_row: float = 0.0
    part_launch: Block = Block(0, 0.0, 0.0)
    sync_s: float = 0.0  # one split's copies: input to the other device, the selection, partial output back

    @property
    def sparse(self) -> bool:
        return self.frequencies is not None and self.predictor is not None


@dataclass(frozen=True)
class Layer:
    attention: Block
    ffn: Ffn


@dataclass(frozen=True)
class Problem:
    embed: Block
    layers: tuple[Layer, ...]
    head: Block  # its gpu_s includes copying the logits back to the host
    copy_s: float  # one move of the residual stream between devices
    budget_bytes: int


@dataclass
class Plan:
    """Where each block runs. ffn[l]: "sparse", "gpu" or "cpu" (dense there); gpu_neurons[l]: the sparse layer's
    hottest neurons on the GPU (all of them for "gpu", none for "cpu")."""

    embed: str
    attention: list[str]
    ffn: list[str]
    gpu_neurons: list[int]
    head: str

    def predictor_device(self, layer: int) -> str | None:
        return self.attention[layer] if self.ffn[layer] == "sparse" else None

    def to_json(self) -> dict:
        return {"embed": self.embed, "attention": self.attention, "ffn": self.ffn,
                "gpu_neurons": [int(n) for n in self.gpu_neurons], "head": self.head}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(data["embed"], list(data["attention"]), list(data["ffn"]), [int(n) for n in data["gpu_neurons"]],
                   data["head"])


def hottest_first(frequencies) -> np.ndarray:
    """The frequencies, hottest first (a sparse part takes a prefix of them)."""
    f = np.asarray(frequencies, np.float64).reshape(-1)
    if not np.all(np.isfinite(f)) or (f.size and f.min() < 0):
        raise ValueError("frequencies must be finite and non-negative")
    return -np.sort(-f)


def part_seconds(ffn: Ffn, gpu_neurons: int) -> tuple[float, float]:
    """A sparse FFN's GPU and CPU part times when its hottest `gpu_neurons` are on the GPU (0 for an empty part)."""
    f = hottest_first(ffn.frequencies)
    hot, cold = float(f[:gpu_neurons].sum()), float(f[gpu_neurons:].sum())
    gpu = ffn.part_launch.gpu_s + ffn.rows_per_active * hot * ffn.gpu_s_per_row if gpu_neurons > 0 else 0.0
    cpu = ffn.part_launch.cpu_s + ffn.rows_per_active * cold * ffn.cpu_s_per_row if gpu_neurons < f.size else 0.0
    return gpu, cpu


def gpu_bytes_used(problem: Problem, plan: Plan) -> int:
    total = problem.embed.gpu_bytes * (plan.embed == "gpu") + problem.head.gpu_bytes * (plan.head == "gpu")
    for layer, attention, mode, n in zip(problem.layers, plan.attention, plan.ffn, plan.gpu_neurons):
        total += layer.attention.gpu_bytes * (attention == "gpu")
        if mode == "gpu":
            total += layer.ffn.dense.gpu_bytes
        elif mode == "sparse":
            total += n * layer.ffn.gpu_bytes_per_neuron + layer.ffn.predictor.gpu_bytes * (attention == "gpu")
    return int(total)


def step_seconds(problem: Problem, plan: Plan) -> float:
    """The plan's expected decode step: every block on its device, each split's sync, each residual move. The one
    price of a plan: the placement minimises it, the baselines are compared by it, the build's estimate is it."""
    total = problem.embed.seconds(plan.embed) + problem.head.seconds(plan.head)
    residual = [plan.embed, *plan.attention, plan.head]
    total += problem.copy_s * sum(a != b for a, b in zip(residual, residual[1:]))
    for layer, attention, mode, n in zip(problem.layers, plan.attention, plan.ffn, plan.gpu_neurons):
        ffn = layer.ffn
        total += layer.attention.seconds(attention)
        if mode == "sparse":
            gpu, cpu = part_seconds(ffn, n)
            total += ffn.predictor.seconds(attention) + max(gpu, cpu)
            on_gpu = n > 0
            on_cpu = n < ffn.width
        else:
            total += ffn.dense.seconds(mode)
            on_gpu, on_cpu = mode == "gpu", mode == "cpu"
        if (attention == "gpu" and on_cpu) or (attention == "cpu" and on_gpu):
            total += ffn.sync_s
    return total


def whole_ffn_seconds(ffn: Ffn, device: str) -> tuple[float, float]:
    """The FFN all on `device`: sparse (its predictor, every neuron's selected rows) and dense seconds."""
    sparse = math.inf
    if ffn.sparse:
        sparse = ffn.predictor.seconds(device) + max(part_seconds(ffn, ffn.width if device == "gpu" else 0))
    return sparse, ffn.dense.seconds(device)


@dataclass(frozen=True)
class BlockBytes:
    """What a block keeps on the GPU and reads in one decode step on each device (each stores its weights in its own
    format), and its calls: the facts placement prices (`price`)."""

    gpu_bytes: int
    cpu_read: float
    gpu_read: float
    calls: int
    # of cpu_read, the matrices its GEMVs read whole, by format ((format, bytes, matrices, output columns), ...):
    # priced at each format's measured rate and fixed costs where the machine's kernels were timed; the rest
    # (vectors, the KV cache, gathered rows) is streamed
    cpu_formats: tuple[tuple[str, float, int, int], ...] = ()


def price(target: Target, block: BlockBytes) -> Block:
    """A block's decode seconds on each device: its bytes over the device's bandwidth (on the CPU, its GEMVs'
    weights at their formats' measured rates where known: `gemv_seconds`), plus its calls' fixed cost."""
    cpu = read_seconds(block.cpu_read, cpu_bandwidth(target), "cpu", block.calls)
    if target.cpu_rates is not None and block.cpu_formats:
        streamed = block.cpu_read - sum(read for _, read, _, _ in block.cpu_formats)
        cpu = (sum(gemv_seconds(target, read, fmt, matrices, columns) - matrices * launch_seconds("cpu")
                   for fmt, read, matrices, columns in block.cpu_formats)
               + read_seconds(streamed, cpu_bandwidth(target), "cpu", block.calls))
    return Block(int(block.gpu_bytes), cpu, read_seconds(block.gpu_read, target.gpu_bandwidth_gbs * 1e9, "gpu", block.calls))


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
    cpu_row_efficiency: float = SPARSE_ROW_EFFICIENCY  # the CPU's selected rows' share of its bandwidth


def price_ffn(target: Target, ffn: FfnBytes) -> Ffn:
    """An FFN's costs: the dense GEMVs as `price`s them; a selected row at the neuron's bytes over the GPU's
    bandwidth, or over `cpu_row_efficiency` of the CPU's; one call per part; a split's copies (`sync_seconds`,
    plus the other part's selection scores)."""
    sparse = ffn.frequencies is not None and ffn.predictor is not None
    return Ffn(
        dense=price(target, ffn.dense), width=ffn.width, gpu_bytes_per_neuron=ffn.gpu_bytes_per_neuron,
        frequencies=ffn.frequencies if sparse else None,
        predictor=price(target, ffn.predictor) if sparse else None, rows_per_active=ffn.rows_per_active,
        cpu_s_per_row=read_seconds(ffn.cpu_bytes_per_neuron, cpu_bandwidth(target), "cpu", 0,
                                   ffn.cpu_row_efficiency),
        gpu_s_per_row=read_seconds(ffn.gpu_bytes_per_neuron, target.gpu_bandwidth_gbs * 1e9, "gpu", 0),
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


@dataclass(frozen=True)
class PlanPrices:
    """A placed build's expected decode step and its baselines', each `step_seconds` of the placement's problem
    (partition's report carries them): what the estimate shows for a build with a placement."""

    step_s: float
    cpu_only_step_s: float | None  # the CPU alone, every FFN dense (None: not priced)
    layer_offload_step_s: float
    layer_offload_layers: int


# a threshold call's part -> the layer report's held-out share of its inputs dropped (lower's report)
THRESHOLD_SPARSITY = {"up": lambda layer: layer.sparsity_in, "down": lambda layer: layer.sparsity_down,
                      "qkv": lambda layer: layer.sparsity_qkv, "o": lambda layer: layer.sparsity_o}


def expected_share(call: Call, layers: dict[int, LayerReport]) -> float:
    """The expected share of a sparse call's selectable entries its decode step reads: the inputs a
    threshold keeps on held-out tokens, or the predicted-active neurons divided between the parts by their
    share of the profiled activations."""
    selection, layer = call.selection, layers.get(call.layer)
    if selection is not None and selection.kept is not None:
        return selection.kept
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
    if call.role is Role.HANDOVER:  # one token's row over the link between two machines (passes/nodes.py's price)
        return handover_seconds(_row_bytes(buffers, call.reads()[0]))
    bandwidth = target.gpu_bandwidth_gbs * 1e9 if call.device == "gpu" else cpu_bandwidth(target)
    selected = 0.0 if call.selection is None else expected_share(call, layers) * call.selection.capacity
    if call.device == "cpu" and call.selection is not None and call.selection.by == "threshold":
        reads = decode_weight_reads(call, buffers)
        fmt = next(_format_of(buffers[a.buffer]) for a in call.args if a.access is Access.SELECTED_ROWS)
        kept = selected / max(call.selection.capacity, 1)
        # (threshold_seconds prices the select call too; it is a call of its own here, priced as one)
        return reads.fixed / bandwidth + threshold_seconds(
            target, call.selection.capacity * reads.per_selected, kept, fmt, call.selection.capacity) - launch_seconds("cpu")
    if call.device == "cpu" and call.selection is None and target.cpu_rates is not None:
        # each weight read whole at its format's measured GEMV rate; gathered rows and the KV cache streamed
        whole = [buffers[a.buffer] for a in call.args if a.reads and a.access is Access.WHOLE
                 and a.buffer in buffers and buffers[a.buffer].kind == "weight"]
        matrices, _ = _matrices_by_format(whole)
        streamed = weight_bytes(call, buffers) - sum(read for read, _ in matrices.values()) + _context_bytes(call, buffers)
        return (sum(gemv_seconds(target, read, fmt, columns=columns) - launch_seconds("cpu")
                    for fmt, (read, columns) in matrices.items())
                + streamed / bandwidth + launch_seconds("cpu"))
    read = weight_bytes(call, buffers, selected, selected) + _context_bytes(call, buffers)
    return read / bandwidth + launch_seconds(call.device)


def _matrices_by_format(weights: list[Buffer]) -> tuple[dict[str, tuple[int, int]], int]:
    """Of one call's weight buffers: its matrices' bytes and outputs by format ({format: (bytes, columns)}: values and
    scales are one matrix, one GEMV), and the bytes of its vectors (norms, biases)."""
    matrices: dict[str, tuple[int, int]] = {}
    vectors = 0
    for info in weights:
        size = nbytes(info.shape, info.dtype)
        if len(info.shape) < 2:
            vectors += size
            continue
        read, columns = matrices.get(_format_of(info), (0, 0))
        matrices[_format_of(info)] = (read + size, max(columns, _output_columns(info)))
    return matrices, vectors


def _output_columns(info: Buffer) -> int:
    """The outputs of the linear layer whose weight `info` is: its logical [K, N]'s N."""
    if info.matrix:
        return int(info.matrix[1])
    return int(info.logical_columns or info.shape[-1])


def _format_of(info: Buffer) -> str:
    """The weight format of a weight buffer: its quantized format, else the float format of its dtype."""
    if info.format:
        return info.format
    return next(name for name, fmt in WEIGHT_FORMATS.items() if not fmt.quantized and fmt.storage == info.dtype)


def _row_bytes(buffers: dict[str, Buffer], name: str) -> int:
    info = buffers[name]
    return itemsize(info.dtype) * info.shape[-1]


def critical_path_seconds(calls: list[Call], edges: list[dict], seconds: dict[str, float]) -> float:
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


def _dense_bytes(calls: list[Call], buffers: dict[str, Buffer]) -> tuple[list[tuple[str, int, int]], int]:
    """What a dense build would read of the weights per token: per call and format, its matrices' bytes and outputs
    ([(format, bytes, columns)]: a call's values and scales are one GEMV), and the bytes of vectors (norms,
    biases). Predictors do not
    exist in a dense build; sparse parts count in full; the embedding's gather is free."""
    matrices: list[tuple[str, int, int]] = []
    streamed = 0
    seen = set()
    for call in calls:
        if not call.decode or call.role in (Role.PREDICTOR, Role.COPY, Role.EMBED):
            continue
        new = [name for name in call.buffers()
               if name not in seen and name in buffers and buffers[name].kind == "weight"]
        seen.update(new)
        mine, vectors = _matrices_by_format([buffers[name] for name in new])
        streamed += vectors
        matrices.extend((fmt, read, columns) for fmt, (read, columns) in mine.items())
    return matrices, streamed


def estimate(manifest: Manifest, schedule: dict, target: Target, placed: PlanPrices | None = None) -> Estimate:
    """The artifact's expected decode. A build with a placement (`placed`): its plan's price and the baselines',
    by `step_seconds` as placement compared them, so the estimate is the placement's own expectation. Without one
    (threshold builds): the schedule's critical path, and the CPU-only dense baseline from the same byte counts.
    The bytes per token are the schedule's either way. Layer offload: None on CPU targets and without a placement."""
    buffers = manifest.buffers
    by_layer = {layer.layer: layer for layer in manifest.layers}
    calls = schedule_calls(schedule)
    decode = [call for call in calls if call.decode]
    seconds = {call.id: call_seconds(call, buffers, by_layer, target) for call in decode}
    step = critical_path_seconds(calls, schedule["edges"], seconds)
    device_bytes = {"cpu": 0.0, "gpu": 0.0}
    for call in decode:
        if not call.runtime_own:
            selected = 0.0 if call.selection is None else expected_share(call, by_layer) * call.selection.capacity
            device_bytes[call.device] += (weight_bytes(call, buffers, selected, selected)
                                          + _context_bytes(call, buffers))
    matrices, streamed = _dense_bytes(calls, buffers)
    overhead = sum(1 for call in decode if call.role is not Role.PREDICTOR and not call.runtime_own) * launch_seconds("cpu")
    context = sum(_context_bytes(call, buffers) for call in decode)  # a dense build reads the same KV cache
    cpu_only = (sum(gemv_seconds(target, read, fmt, columns=columns) - launch_seconds("cpu")
                    for fmt, read, columns in matrices)
                + (streamed + context) / cpu_bandwidth(target) + overhead)
    offload, offloaded = None, 0
    if placed is not None:  # the placement's price of the plan, plus the hand-overs between machines it leaves out
        step = placed.step_s + sum(seconds[call.id] for call in decode if call.role is Role.HANDOVER)
        cpu_only = placed.cpu_only_step_s or cpu_only
        if target.has_gpu and placed.layer_offload_step_s:
            offload, offloaded = 1.0 / placed.layer_offload_step_s, placed.layer_offload_layers
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
