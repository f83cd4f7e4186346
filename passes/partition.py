"""partition: decide where every block of the decoder lives, in one integer program (`passes.placement`).

Reads: the block IR (after recognise; in predictor mode after profile and predict): each node's block
(`pir.node_blocks`: the embedding, per layer its attention block with its norms and residual adds, its
`picompile.FFN` node, the final norm and output layer), the constants each block reads, the
`picompile.Attention` nodes' KV cache shape; in predictor mode per layer `layers.{i}.ffn.frequency` (profile),
the predictor `layers.{i}.ffn.predictor.w1` / `w2` and the FFN's `predictor_active` (predict); the target's GPU
memory and bandwidths; the build target (`ctx.build`: the GPU budget, the context length, the CPU's weight format);
the fields `placement_batch`, `time_limit_s` and `dense_ffns`.
Adds per FFN node: `gpu_neurons` (int), `placed` ("sparse", or "gpu" / "cpu": dense on that device) and, where it
has a frequency table, `layers.{i}.ffn.neuron_order` (int64 [F]: neuron ids, hottest first; the first gpu_neurons
on the GPU); and `metadata_props["picompile.placement"]`: the solve's report (`PlacementReport`: status, gap, the
plan: every block's device, its expected step against layer offload's and the CPU alone's, the GPU bytes) that place
applies, the artifact's estimate shows and `inspect` prints. The solve's plan is compared with those baselines by the
same price (`costmodel.step_seconds`) and the faster taken (`placement.solve`), so no build expects less than either.

Every block is priced as its device stores it (`sizes.gpu_bytes`: fp16 matrices on the GPU; `sizes.cpu_bytes`:
on the CPU the quality pass's format where its `WeightPlan` names the matrix, else --weight-dtype; predictors as
`sizes.PREDICTOR_FORMAT`) with the cost model's `price` and `price_ffn`.
The budget is `ctx.build.gpu` (`--vram-budget`, else the target's memory, less its reserve); each attention
block carries its KV cache for `max_context` tokens. A layer without a predictor (a dense build, or no profile)
runs dense on one device. CPU targets: everything on the CPU, no solve.

A build split across machines (`--nodes`, split-nodes' `NodeSplit`) solves one program per stage
(`stage_problems`): its layers within its own node's card (`Stage.gpu_bytes`; a node without one keeps its layers
on its CPU), the hidden state arriving and leaving in host memory; the plans join into one (`joined`), and the
report carries each stage's budget, use and seconds (`StagePlacement`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import costmodel, placement
from . import ir as pir
from .costmodel import CONTEXT, BlockBytes, FfnBytes
from .facts import ModelFact
from .ops import FFN, Attention
from .recognise import BLOCKS
from .pipeline import Context, Fact, Options
from .split_nodes import NodeSplit
from .sizes import (GPU_WEIGHT_FORMAT, PREDICTOR_FORMAT, cpu_bytes, gpu_bytes, kv_cache_bytes,
                             stored_predictor_format)
from .targets import RESERVE_FRACTION, format_size
from runtime.dtypes import WeightFormat, nbytes
from runtime.manifest import Stage

if TYPE_CHECKING:
    from .quality import WeightPlan

PREDICTOR_CALLS = 2  # its two GEMVs
DENSE_FFN_CALLS = 2  # up (and gate), down
METADATA_KEY = "picompile.placement"


@dataclass(frozen=True)
class StagePlacement:
    """One stage of a split build, placed within its own node: its card's budget and use, its part of a decode
    step by the cost model, and whose plan it took."""

    name: str
    budget_bytes: int
    used_bytes: int
    expected_step_s: float
    chosen: str


@dataclass
class PlacementReport(ModelFact):
    """The solve's report, `metadata_props["picompile.placement"]`: the plan place applies, and its price and the
    baselines' by the one cost model (`costmodel.step_seconds`), which the artifact's estimate and `inspect` show.
    No wall time (partition's log line has it): the artifact's manifest carries this report, and two builds of one
    plan must be the same byte for byte."""

    KEY: ClassVar[str] = METADATA_KEY
    status: str  # HiGHS's model status, or why there was nothing to solve
    gap: float | None  # HiGHS's relative MIP gap (None: unknown)
    num_variables: int
    batch: int  # neurons per program column
    vram_bytes: int
    reserve_bytes: int
    budget_bytes: int
    used_bytes: int
    expected_step_s: float  # the plan's
    layer_offload_step_s: float
    layer_offload_layers: int
    activation_share: float  # of the sparse layers' profiled activity, the share on the GPU
    gpu_weight_format: str
    cpu_weight_format: str
    layers: list[int]  # the FFNs' layer numbers, in the plan's order
    plan: placement.Plan
    gpu_neurons: list[int]  # per layer, its sparse part's neurons on the GPU (0 for a dense FFN)
    cpu_only_step_s: float | None = None  # the CPU alone, every FFN dense (None: an artifact older than the field)
    chosen: str = "solve"  # whose plan it is: the solve's, or the baseline (`placement.baselines`) it did not beat
    stages: list[StagePlacement] | None = None  # a split build: each node's own placement (None: one machine)

    def prices(self) -> costmodel.PlanPrices:
        return costmodel.PlanPrices(self.expected_step_s, self.cpu_only_step_s, self.layer_offload_step_s,
                                    self.layer_offload_layers)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["plan"] = self.plan.to_json()
        if self.stages is None:  # one machine: the report as it always was
            del data["stages"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "PlacementReport":
        known = {f.name for f in dataclasses.fields(cls)}
        stages = data.get("stages")
        return cls(**{**{k: v for k, v in data.items() if k in known}, "plan": placement.Plan.from_json(data["plan"]),
                      "stages": None if stages is None else [StagePlacement(**stage) for stage in stages]})

    def choice(self) -> str:
        """Whose plan the build takes, after comparing the solve's with the baselines by the same prices."""
        if self.chosen == "solve":
            return "the solve's plan, none of the baselines faster"
        if not self.num_variables:
            return f"the {self.chosen} plan ({self.status}: nothing to solve)"
        return f"the {self.chosen} plan: the solve found none faster"


def neuron_bytes(d_model: int, up_per_neuron: int, biased: bool, matrix_format: WeightFormat) -> int:
    """One FFN neuron's weights on a device: its up (and gate) and down rows in the device's matrix format,
    its up bias (select-kernels keeps biases in fp32)."""
    rows = math.ceil(d_model * (up_per_neuron + 1) * matrix_format.bytes_per_weight)
    return rows + nbytes([up_per_neuron if biased else 0], "float32")


def stage_problems(problem: placement.Problem, layers: list[int], ranges: list[range],
                   budgets: list[int]) -> list[placement.Problem]:
    """A split build's placement, one program per node: the layers of its range (stage 0 with the embedding, the
    last with the output layer) within its own card's budget (0 without a card). The hidden state arrives and
    leaves in host memory (the hand-over): a stage's ends are blocks pinned to the CPU (no card holds them), so a
    residual stream on the card pays its copies in and out, as the schedule will."""
    problems = []
    for k, (members, budget) in enumerate(zip(ranges, budgets)):
        host = placement.Block(budget + 1, 0.0, 0.0)  # too big for the card: on the CPU, free
        priced = tuple(block for layer, block in zip(layers, problem.layers) if layer in members)
        problems.append(placement.Problem(problem.embed if k == 0 else host, priced,
                                          problem.head if k == len(ranges) - 1 else host, problem.copy_s, budget))
    return problems


def joined(solutions: list[placement.Solution]) -> placement.Solution:
    """The stages' plans as one plan of the model (the embedding's from the first, the output layer's from the
    last), their seconds and GPU bytes added up (each card holds its own stage's)."""
    plans = [solution.plan for solution in solutions]
    plan = placement.Plan(plans[0].embed, [a for p in plans for a in p.attention], [f for p in plans for f in p.ffn],
                          [n for p in plans for n in p.gpu_neurons], plans[-1].head)
    statuses = sorted({solution.status for solution in solutions})
    gaps = [solution.gap for solution in solutions if math.isfinite(solution.gap)]
    chosen = {solution.chosen for solution in solutions}
    return placement.Solution(plan, sum(s.seconds for s in solutions), sum(s.used_bytes for s in solutions),
                              "; ".join(statuses), max(gaps) if gaps else math.inf,
                              sum(s.solve_time_s for s in solutions), sum(s.num_variables for s in solutions),
                              chosen=chosen.pop() if len(chosen) == 1 else "per stage")


# each FFN's place in the plan (`placed`, `gpu_neurons`, its neuron order) and the plan itself (`picompile.placement`)
PARTITIONED = Fact("the placement plan", "partition",
                   lambda model: all(FFN(node).placed is not None for node in FFN.nodes(model)))


@dataclass
class Partition:
    name = "partition"
    requires = (BLOCKS,)
    adds = (PARTITIONED,)
    placement_batch: int | None = Options.placement_batch  # neurons per ILP column; None: placement.default_batch
    time_limit_s: float = Options.placement_time_limit_s
    dense_ffns: bool = Options.dense_fallback  # a layer with a predictor may still run dense (else always sparse)
    # the CPU's int8-activation dot product (None: float activations): a 4-bit row's price (sparse_row_efficiency)
    int8_dot: str | None = None

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        graph, target, gpu = model.graph, ctx.target, ctx.build.gpu
        # imported here: the quality pass brings torch and TVM's script parser, and tools that read this module's
        # PlacementReport from an artifact have loaded TVM's runtime library alone, which cannot import them
        from .quality import WeightPlan

        planned = WeightPlan.of(model)  # the quality plan's formats, where a matrix is not in the build's
        ffns = sorted(FFN.nodes(model), key=lambda n: FFN(n).layer)
        layers = [FFN(node).layer for node in ffns]
        frequencies = [self._frequency(graph, node) for node in ffns]
        problem = self._problem(model, ctx, ffns, frequencies, gpu.usable_bytes, planned)
        batch = self.placement_batch or placement.default_batch(layer.ffn.width for layer in problem.layers)
        split = NodeSplit.of(model)
        staged: list[tuple[Stage, placement.Problem, placement.Solution]] | None = None
        if not target.has_gpu:
            plan = placement.cpu_only(problem, self.dense_ffns)
            solution = placement.Solution(plan, costmodel.step_seconds(problem, plan), 0,
                                          f"no GPU on target {target.name}", 0.0, 0.0, 0, chosen="CPU only")
        elif split is not None:
            staged = []
            parts = stage_problems(problem, layers, [range(s.first_layer, s.stop_layer) for s in split.stages],
                                   [s.gpu_bytes or 0 for s in split.stages])
            for stage, part in zip(split.stages, parts):
                with ctx.progress(f"partition: HiGHS placement ILP, {stage.name} ({stage.layers_text()})"):
                    staged.append((stage, part, placement.solve(part, batch=batch, time_limit_s=self.time_limit_s,
                                                                dense_ffns=self.dense_ffns)))
            solution = joined([s for _, _, s in staged])
        else:
            with ctx.progress(f"partition: HiGHS placement ILP ({len(ffns)} layers)"):
                solution = placement.solve(problem, batch=batch, time_limit_s=self.time_limit_s,
                                           dense_ffns=self.dense_ffns)
        plan = solution.plan

        for node, layer, frequency, mode, n, priced in zip(ffns, layers, frequencies, plan.ffn, plan.gpu_neurons,
                                                           problem.layers):
            FFN(node).gpu_neurons = int(n) if mode == "sparse" else 0
            FFN(node).placed = mode
            if mode != "sparse":
                efficiency = self._row_efficiency(self._ffn_format(planned, node, ctx.build.weight_format))
                node.attributes["placed_reason"] = ir.AttrString(
                    "placed_reason", self._dense_reason(node, priced.ffn, mode, efficiency))
            name = f"layers.{layer}.ffn.neuron_order"
            if name in graph.initializers:
                del graph.initializers[name]
            if frequency is not None:
                pir.initializer(graph, name, np.argsort(-frequency, kind="stable").astype(np.int64))

        offload = placement.layer_offload(problem)
        offload_s = costmodel.step_seconds(problem, offload)
        offload_layers = offload.attention.count("gpu") if target.has_gpu else 0
        cpu_only_s = costmodel.step_seconds(problem, placement.cpu_dense(problem))
        vram, budget = gpu.total_bytes, problem.budget_bytes
        if staged is not None:  # each node's baselines within its own card, added up
            offloads = [placement.layer_offload(part) for _, part, _ in staged]
            offload_s = sum(costmodel.step_seconds(part, o) for (_, part, _), o in zip(staged, offloads))
            offload_layers = sum(o.attention.count("gpu") for o in offloads)
            cpu_only_s = sum(costmodel.step_seconds(part, placement.cpu_dense(part)) for _, part, _ in staged)
            budget = sum(part.budget_bytes for _, part, _ in staged)
            vram = sum(round((stage.gpu_bytes or 0) / (1 - RESERVE_FRACTION)) for stage, _, _ in staged)
        sparse = [i for i, f in enumerate(frequencies) if f is not None and plan.ffn[i] == "sparse"]
        placed = sum(float(np.sort(frequencies[i])[::-1][:plan.gpu_neurons[i]].sum()) for i in sparse)
        total_activity = sum(float(frequencies[i].sum()) for i in sparse)
        report = PlacementReport(
            status=solution.status,
            gap=solution.gap if math.isfinite(solution.gap) else None,
            num_variables=solution.num_variables,
            batch=batch,
            vram_bytes=vram,
            reserve_bytes=vram - budget if staged is not None else gpu.reserve_bytes,
            budget_bytes=budget,
            used_bytes=solution.used_bytes,
            expected_step_s=solution.seconds,
            layer_offload_step_s=offload_s,
            layer_offload_layers=offload_layers,
            activation_share=placed / total_activity if total_activity > 0 else 0.0,
            gpu_weight_format=GPU_WEIGHT_FORMAT.name,
            cpu_weight_format=ctx.build.weight_format.name,
            layers=layers,
            plan=plan,
            gpu_neurons=[int(n) if m == "sparse" else 0 for n, m in zip(plan.gpu_neurons, plan.ffn)],
            cpu_only_step_s=cpu_only_s,
            chosen=solution.chosen,
            stages=None if staged is None else [
                StagePlacement(stage.name, part.budget_bytes, solved.used_bytes, solved.seconds, solved.chosen)
                for stage, part, solved in staged],
        )
        report.attach(model)
        ctx.log(self._summary(report, problem, solution.solve_time_s))
        for stage in report.stages or []:
            ctx.log(f"partition: {stage.name}: GPU {format_size(stage.used_bytes)} of "
                    f"{format_size(stage.budget_bytes)}, expected {stage.expected_step_s * 1e3:.2f} ms a token "
                    f"({stage.chosen})")
        return PassResult(model, modified=True)

    @staticmethod
    def _dense_reason(node: ir.Node, ffn: placement.Ffn, device: str, efficiency: float) -> str:
        """Why the plan runs this FFN dense on `device`, in the cost model's figures."""
        if not ffn.sparse:
            return "no predictor"
        sparse, dense = placement.whole_ffn_seconds(ffn, device)
        share = float(FFN(node).predictor_active)
        return (f"expected {share:.1%} of the neurons predicted active: sparse {sparse * 1e3:.3f} ms/token, dense "
                f"{dense * 1e3:.3f} ms/token on the {device.upper()} (sparse rows at "
                f"{efficiency:.0%} of dense bandwidth)")

    @staticmethod
    def _ffn_format(planned: WeightPlan, node: ir.Node, cpu_format: WeightFormat) -> WeightFormat:
        """The format of an FFN's rows on the CPU: the quality plan gives its up and down matrices one (its knob's)."""
        return planned.format_of(node.inputs[3].name, cpu_format)  # w_down

    def _row_efficiency(self, fmt: WeightFormat) -> float:
        """The share of the CPU's bandwidth its sparse kernels read selected rows at, in format `fmt`."""
        return costmodel.sparse_row_efficiency(fmt.bits, self.int8_dot)

    @staticmethod
    def _frequency(graph: ir.Graph, node: ir.Node) -> np.ndarray | None:
        """The layer's profiled activation frequencies (None without a profile: the layer can only run dense)."""
        name = f"layers.{FFN(node).layer}.ffn.frequency"
        if name not in graph.initializers:
            return None
        frequency = np.asarray(pir.const_array(graph.initializers[name]), np.float64).reshape(-1)
        width = node.inputs[3].const_value.shape[0]
        if frequency.size != width:
            raise ValueError(f"{name} has {frequency.size} entries but layer {FFN(node).layer} has {width} neurons")
        return frequency

    @staticmethod
    def _bytes(values, planned: WeightPlan, cpu_format: WeightFormat) -> BlockBytes:
        """The constants `values` as a block: their GPU memory and what one decode step reads of them on each device
        (the CPU's matrices in the quality plan's format, else the build's `cpu_format`)."""
        values = [v for v in values if v is not None and v.const_value is not None]
        on_gpu = sum(gpu_bytes(v.const_value.shape) for v in values)
        on_cpu, by_format = 0.0, {}  # matrices: format -> [bytes, count, output columns]
        for v in values:
            fmt = planned.format_of(v.name, cpu_format)
            read = cpu_bytes(v.const_value.shape, fmt)
            on_cpu += read
            if len(v.const_value.shape) >= 2:  # a [K, N] linear's weight
                entry = by_format.setdefault(fmt.name, [0.0, 0, 0])
                entry[0] += read
                entry[1] += 1
                entry[2] += int(v.const_value.shape[-1])
        return BlockBytes(on_gpu, on_cpu, on_gpu, 0, tuple((name, *entry) for name, entry in sorted(by_format.items())))

    def _problem(self, model: ir.Model, ctx: Context, ffns: list[ir.Node], frequencies: list, budget: int,
                 planned: WeightPlan):
        graph, target, cpu_format, max_context = model.graph, ctx.target, ctx.build.weight_format, ctx.build.max_context
        blocks = pir.node_blocks(graph)
        members: dict = {}
        for node in graph:
            if FFN.matches(node):
                continue
            members.setdefault(blocks[node], []).append(node)
        constants = lambda nodes: {id(v): v for n in nodes for v in n.inputs if v is not None and v.const_value is not None}

        def block_bytes(nodes: list[ir.Node]) -> BlockBytes:
            b = self._bytes(constants(nodes).values(), planned, cpu_format)
            kv = sum(kv_cache_bytes([(Attention(n).num_kv_heads, Attention(n).head_dim)], 1)
                     for n in nodes if Attention.matches(n))  # per token
            read = kv * min(CONTEXT, max_context)
            return BlockBytes(b.gpu_bytes + kv * max_context, b.cpu_read + read, b.gpu_read + read, len(nodes),
                              b.cpu_formats)

        embed_nodes = members.get(pir.EMBED, [])
        embed = self._bytes(constants(embed_nodes).values(), planned, cpu_format)
        # the embedding gathers one row per token; its table is memory, not traffic
        rows = max((v.const_value.shape[0] for v in constants(embed_nodes).values() if len(v.const_value.shape) >= 2),
                   default=1)
        embed = BlockBytes(embed.gpu_bytes, embed.cpu_read / rows, embed.gpu_read / rows, len(embed_nodes))
        head_nodes = members.get(pir.HEAD, [])
        head = costmodel.price(target, block_bytes(head_nodes))
        # one token's logits go back to the host: a row as wide as the output layer's vocabulary (its wider side)
        vocab = max((max(v.const_value.shape) for v in constants(head_nodes).values() if len(v.const_value.shape) >= 2),
                    default=0)
        head = placement.Block(head.gpu_bytes, head.cpu_s,
                               head.gpu_s + costmodel.copy_seconds(target, nbytes([vocab], "float32")))

        built = []
        for node, frequency in zip(ffns, frequencies):
            layer = FFN(node).layer
            w_up, b_up, w_down, b_down = node.inputs[1:5]
            width, d_model = w_down.const_value.shape
            up = 2 if FFN(node).gated else 1
            dense = self._bytes([w_up, b_up, w_down, b_down], planned, cpu_format)
            ffn_format = self._ffn_format(planned, node, cpu_format)
            ffn = FfnBytes(dense=dataclasses.replace(dense, calls=DENSE_FFN_CALLS),
                           width=int(width), activation_bytes=nbytes([d_model], "float32"))
            predictor = [graph.initializers.get(f"layers.{layer}.ffn.predictor.{w}") for w in ("w1", "w2")]
            if frequency is not None and all(p is not None for p in predictor) and FFN(node).predictor_active is not None:
                shapes = [p.const_value.shape for p in predictor]
                cpu_predictor = sum(math.ceil(math.prod(s) * stored_predictor_format(s, PREDICTOR_FORMAT).bytes_per_weight)
                                    for s in shapes)
                gpu_predictor = sum(gpu_bytes(s) for s in shapes)
                active = float(FFN(node).predictor_active)
                ffn = dataclasses.replace(
                    ffn, gpu_bytes_per_neuron=neuron_bytes(d_model, up, b_up is not None, GPU_WEIGHT_FORMAT),
                    cpu_bytes_per_neuron=neuron_bytes(d_model, up, b_up is not None, ffn_format),
                    frequencies=frequency, predictor=BlockBytes(gpu_predictor, cpu_predictor, gpu_predictor, PREDICTOR_CALLS),
                    rows_per_active=max(1.0, active * width / max(float(frequency.sum()), 1e-12)),
                    cpu_row_efficiency=self._row_efficiency(ffn_format))
            built.append(placement.Layer(costmodel.price(target, block_bytes(members.get(layer, []))),
                                         costmodel.price_ffn(target, ffn)))
        return placement.Problem(costmodel.price(target, embed), tuple(built), head,
                                 costmodel.copy_seconds(target, nbytes([self._d_model(ffns)], "float32")), budget)

    @staticmethod
    def _d_model(ffns: list[ir.Node]) -> int:
        return int(ffns[0].inputs[3].const_value.shape[1]) if ffns else 0

    @staticmethod
    def _summary(report: PlacementReport, problem: placement.Problem, solve_time_s: float) -> str:
        plan = report.plan
        sparse = [i for i, m in enumerate(plan.ffn) if m == "sparse"]
        neurons = sum(problem.layers[i].ffn.width for i in sparse)
        dense_gpu = plan.ffn.count("gpu")
        speedup = report.layer_offload_step_s / report.expected_step_s if report.expected_step_s else 1.0
        gap = "unknown" if report.gap is None else f"{report.gap * 100:.3f}%"
        return (f"partition: {plan.attention.count('gpu')}/{len(plan.attention)} attention blocks, "
                f"{sum(report.gpu_neurons)}/{neurons} sparse FFN neurons "
                f"({report.activation_share * 100:.1f}% of activations), {dense_gpu} dense FFNs, embedding "
                f"{'on the GPU' if plan.embed == 'gpu' else 'on the CPU'}, output layer "
                f"{'on the GPU' if plan.head == 'gpu' else 'on the CPU'}: {format_size(report.used_bytes)} of "
                f"{format_size(report.budget_bytes)} (GPU {format_size(report.vram_bytes)} - reserve "
                f"{format_size(report.reserve_bytes)}); expected {1 / report.expected_step_s:.1f} tok/s, "
                f"{speedup:.2f}x layer offload's ({report.layer_offload_layers} layers), CPU only "
                f"{1 / report.cpu_only_step_s:.1f}: {report.choice()}; {report.status}, "
                f"gap {gap}, {solve_time_s:.2f} s")
