"""quality: the plan with the most expected speed that keeps the build within the user's quality budget.

Runs in threshold mode after profile; in predictor mode after predict, where its knobs are a recall per FFN
and, in a quantized build, a format per FFN (up and down rows together), per attention matrix and for the output
layer, their inputs dense. Reads: the block IR (Attention, FFN and the output layer's MatMul, their
weights), the calibration sequences the profile pass ran (`CalibrationSequences`), the budget
(--max-quality-loss, `passes.budget`), the build's weight format and quantization method, and, where
--sparsity fixed one level for every FFN, the thresholds the threshold pass set.
Adds: on each FFN `threshold_in` / `threshold_down` and on each Attention `threshold_qkv` / `threshold_o`
(`KEEP_ALL` where the input stays dense), with `sparsity_*`, the share each drops on held-out tokens, and the
output layer's (`HeadThreshold`, where its input is thinned); the per-matrix formats (`WeightPlan`, which the
quantize pass stores) and what the build expects eval to measure (`ExpectedQuality`, the manifest's type, carried
into it and printed by `build`).

How (TEAL's greedy allocation, priced by the cost model, checked end to end):
1. Knobs. Every linear input of every block (qkv, o, the FFN's gate/up and down) and the output layer's (on
   SmolLM2 its 108 MiB a token is a fifth of what decode reads; not where the formats are a quantized file's own,
   whose blocks along K a thinned matrix would lose) may drop its inputs below a
   magnitude threshold, at LEVELS of the input's share; every matrix may be stored in any format from the
   build's own up to fp16 (`allowed_formats`: --weight-dtype int4 means "at most 4 bits"). A knob's cost is the
   cost model's decode seconds for its matrix at that level and format (`costmodel.column_seconds`): a sparse
   read pays the gathered rows' lower bandwidth, a select call and the column kernel's fixed cost, so a low
   level costs more than dense (and any level of a tiny model's matrices).
2. Local effects, measured. One dense pass over the fitting tokens (the first calibration sequences) runs every
   block again at each level and format of each of its knobs alone (`passes.ir_reference`), and records the
   KL the change of the block's output causes at the logits, to second order: the change weighted by the
   gradients of the model's log-likelihood of tokens it draws itself (the sampled Fisher information,
   `Interpreter.output_gradients`, one backward pass per draw). Its size against the residual stream, the
   measure before, misjudged SmolLM2's layers past its massive activation (layer 11) by 100x, and the path
   built on it was no faster than one FFN level for every layer at the same perplexity.
3. Greedy path. From dense at the widest formats, repeatedly take the move (one knob to a sparser level and/or
   a narrower format) with the least added local error per second saved. Every move saves time, so every plan
   on the path is expected faster than the dense build of its formats.
4. Budget, measured. On the held-out sequences (the user's, across the file, which the profile kept out of every
   fit: `CalibrationSequences.measured`), the model's logits under a plan, computed with the kernels' arithmetic
   (thresholded decode rows after a 4-token prompt, weights as stored, predictors over int8 inputs where their
   GEMVs read int8), against the dense source model's: a binary search along the path for the furthest plan
   within the budget.
   That plan's perplexity change (with its 95% interval over the held-out sequences: `budget.ppl_change_interval`),
   KL and top-1 are what the build prints and eval should confirm.
The output layer's local effects are its KL at the logits, measured exactly; where it is no knob (a quantized
file's own blocks, a float predictor-mode build, --sparsity) it stays as the build stores it; in predictor mode
its input stays dense. The embedding table (one row
gathered per token: its format costs memory, not time) takes int8 where the build allows it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes import PassResult

from . import costmodel
from . import ir as pir
from .file_blocks import file_matrix
from .memory import BoundedCache
from .blocking import Blocking
from .budget import PROMPT_TOKENS, QualityBudget, ppl_change_interval, predicted_tokens, scored_positions
from .facts import ModelFact, ValueFact, read_entry, write_entry
from .ops import ALL_NEURONS, DOMAIN, FFN, Attention, Embed, view as op_view
from .pipeline import Context, Options
from .sizes import PREDICTOR_FORMAT, float_format, parameter_count
from .targets import CpuIsa, Target
from runtime.dtypes import WEIGHT_FORMATS, WeightFormat, dequantize_blocks
from runtime.manifest import ExpectedQuality, MatrixChoice

from .ir_reference import SITES, Block, Interpreter, Quality, Variant, head_node, layer_of
from .kernels import quant
from .predict import HOLDOUT, _threshold_for_recall, predictor_reads_int8
from .profile import CALIBRATION_SEQUENCES, MEASURED_TOKENS, CalibrationSequences
from .streamed_logits import Logits
from .threshold import KEEP_ALL

LEVELS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # shares of a linear input a plan may drop
FIT_TOKENS = 512  # tokens the local effects are measured on (at most)
HEAD_LIMIT = 2.0  # of the budget: the output layer's levels are measured up to the first whose KL alone is over it
FISHER_DRAWS = 4  # tokens drawn per position to weigh a local effect by its KL (on SmolLM2: 0.4-2.6x the KL measured)
HELD_OUT_TOKENS = 1024  # tokens the budget is measured on (at most) where the profile kept none of the user's out
# The pass's work is its tokens times the parameters each one reads. Past a 0.5B model's (Qwen2.5-Coder-0.5B's
# file holds 0.63B, its output layer beside the embedding: a 207 s default build measuring 2,048 held-out tokens
# on 2 cores) a model measures on proportionally fewer tokens, so that a 1.5B's default build stays within 3x its
# dense build; no fewer than the MIN_ ones (a plan's ppl interval widens as the root of their share)
TOKEN_PARAMETERS = 0.65e9
MIN_HELD_OUT_TOKENS, MIN_FIT_TOKENS = 512, 128
BATCH_TOKENS = 4096  # held-out tokens run together (every weight is read once per batch; bounds the activations)
BLOCKS_BYTES = 256 << 20  # the blocks of matrices stored in another format than the source's kept between reads
SEARCH_EVERY = 2  # the path's search measures plans on every 2nd held-out sequence, the plan found on all
QUALITY_KEY = "picompile.quality"
WEIGHT_PLAN_KEY = "picompile.weight_plan"
# The knobs of each mode, by block: threshold mode's linear inputs; predictor mode's FFN neurons (a predictor's
# threshold: RECALLS, from dense (level 0) down)
MODE_SITES = {"threshold": {"Attention": ("qkv", "o"), "FFN": ("in", "down")}, "predictor": {"FFN": ("neurons",)}}
# predictor mode's attention inputs where the plan chooses formats: a format each, their inputs dense
FORMAT_SITES = {"Attention": ("qkv", "o")}
RECALLS = (0.999, 0.995, 0.99, 0.98, 0.95, 0.9)  # predictor mode's levels after dense, down to --target-recall


def allowed_formats(weight_dtype: str) -> tuple[str, ...]:
    """The formats a matrix may take, widest first: a float build keeps its own; a quantized one may widen a
    matrix to int8 or fp16 where rounding it hurts (--weight-dtype int4: "at most 4 bits")."""
    fmt = WEIGHT_FORMATS[weight_dtype]
    if not fmt.quantized:
        return (weight_dtype,)
    return ("fp16", "int8") + (() if weight_dtype == "int8" else (weight_dtype,))


@dataclass(frozen=True)
class WeightPlan(ValueFact):
    """Per matrix (its initializer's name), the format the quantize pass stores it in where it is not the build's."""

    KEY: ClassVar[str] = WEIGHT_PLAN_KEY
    SORT_KEYS: ClassVar[bool] = True
    formats: dict[str, str]

    @classmethod
    def missing(cls) -> "WeightPlan":
        return cls({})

    def format_of(self, name: str, build_format: WeightFormat) -> WeightFormat:
        """The format matrix `name` is stored in on the CPU: the plan's, else the build's."""
        return WEIGHT_FORMATS[self.formats[name]] if name in self.formats else build_format


@dataclass(frozen=True)
class HeadThreshold(ModelFact):
    """The output layer's input as the plan thins it: decode rows read the rows of the channels with |x| >
    `threshold`, `dropped` the share it drops on held-out tokens (lower makes the output layer a Linear by it)."""

    KEY: ClassVar[str] = "picompile.head_threshold"
    threshold: float
    dropped: float


def quality_of(model: ir.Model) -> ExpectedQuality | None:
    """What the quality pass expects eval to measure (None where it did not run)."""
    return read_entry(model, QUALITY_KEY, ExpectedQuality)


@dataclass
class Knob:
    """One linear input of one block and the matrix it multiplies: its levels' thresholds and local errors, its
    formats' local errors, and the cost of each (level, format)."""

    node: ir.Node
    site: str
    matrix: str
    thresholds: np.ndarray  # per level (KEEP_ALL at level 0; predictor mode: the predictor's, per RECALLS)
    sparse_error: np.ndarray  # per level
    format_error: np.ndarray  # per allowed format
    held_out_dropped: np.ndarray  # per level: the share of held-out decode inputs (neurons) it does not read
    predictor: tuple[torch.Tensor, torch.Tensor] | None = None  # predictor mode: the FFN's w1, w2
    held_out_recall: np.ndarray | None = None  # predictor mode, per level: truly active neurons computed
    held_out_precision: np.ndarray | None = None  # ... and truly active among those computed
    cost: np.ndarray = field(default=None)  # [level, format] seconds

    @property
    def layer(self) -> int:
        return layer_of(self.node)

    def error(self, level: int, fmt: int) -> float:
        return float(self.sparse_error[level] + self.format_error[fmt])

    def stored_as(self, level: int) -> tuple[tuple[str, int], ...]:
        """The matrices its format is chosen for, each with the axis it is blocked along at `level`: a predictor's
        FFN's up rows along K and its down rows per neuron (one fused kernel reads both, in one format); a
        thresholded matrix along its rows (the layout its column kernel gathers); else along K."""
        if self.predictor is not None:
            return (self.matrix, 0), (self.node.inputs[3].name, 1)
        return ((self.matrix, 1 if level else 0),)


FILE_VALUES = object()  # StoredWeights' blocks of a matrix kept in the model file's own blocks: its values are the file's


class StoredWeights:
    """Matrices as a plan stores them, for the reference: blocks made once per (matrix, format, axis) by the
    quantize pass's own rule (`passes.blocking`: a model that came quantized keeps its blocks), kept as
    integers and scales, dequantized when a pass asks (`Variant.weights` reads it as a mapping)."""

    def __init__(self, model: ir.Model, blocking: Blocking, thinned_rows: bool = False):
        self._values = {v.name: v for v in model.graph.initializers.values()}
        self._blocking = blocking
        self._thinned_rows = thinned_rows  # a matrix blocked along its rows is one a threshold thins (threshold mode)
        # (matrix, format, axis) -> the format it is stored in; and its blocks, the recent ones while they fit
        # BLOCKS_BYTES (a plan at a path's end thins every matrix: their blocks together are the model's size)
        self._formats: dict[tuple[str, str, int], WeightFormat] = {}
        self._blocks = BoundedCache(BLOCKS_BYTES)

    def _held(self, name: str):
        return file_matrix(self._values[name], any_formats=True)

    def _kept(self, name: str, fmt: WeightFormat, axis: int) -> WeightFormat | None:
        """The format of the file's own blocks where the quantize pass keeps them (run by run: priced as its
        largest run's format), else None."""
        held = self._held(name)
        kept = self._blocking.kept(held, fmt, axis, thinned=self._thinned_rows)
        if kept is None and self._blocking.kept_in_runs(held, fmt, axis):
            kept = max(held.runs(), key=lambda run: run.size).stored_format()
        return kept

    def _stored(self, name: str, fmt_name: str, axis: int) -> tuple[tuple | None, WeightFormat]:
        """(blocks, or None where the matrix is kept in floats; the format it is stored in)."""
        fmt = self._blocking.format_for(fmt_name)
        if not fmt.quantized:
            return None, fmt
        kept = self._kept(name, fmt, axis)
        if kept is not None:  # the file's own blocks, as the quantize pass keeps them: the file's values
            return FILE_VALUES, kept
        fmt = self._blocking.rounding_format(fmt)
        if not quant.quantizable(tuple(self._values[name].const_value.shape), axis, fmt.block):
            return None, float_format(fmt)  # the quantize pass keeps it in floats
        key = (name, fmt_name, axis)
        if key in self._formats and not self._formats[key].quantized:
            return None, self._formats[key]  # (kept in floats: no blocks)
        blocks = self._blocks.get(key)
        if blocks is None:
            blocks, used, _ = self._blocking.blocks(self._source(name), fmt, axis, self._held(name))
            self._formats[key] = used if blocks is not None else float_format(fmt)
            self._blocks.put(key, blocks, sum(a.nbytes for a in blocks if isinstance(a, np.ndarray))
                             if blocks is not None else 0)
        return blocks, self._formats[key]

    def _source(self, name: str) -> np.ndarray:
        return np.asarray(pir.const_array(self._values[name]), np.float32)

    def priced_format(self, name: str, fmt_name: str, axis: int) -> WeightFormat:
        """The format a plan's cost reads the matrix in when it gives it `fmt_name` blocked along `axis`: the
        file's own blocks where they are kept (a quantized file's matrix, dense), else the format it is rounded
        to (a thresholded one whose blocks are a file's legacy ones, its rows gathered: int8); found without rounding
        it."""
        fmt = self._blocking.format_for(fmt_name)
        if not fmt.quantized:
            return fmt
        return self._kept(name, fmt, axis) or self._blocking.rounding_format(fmt)

    def format(self, name: str, fmt_name: str, axis: int) -> WeightFormat:
        """The format the quantize pass stores the matrix in when the plan gives it `fmt_name` (a model's own
        blocks may keep another: a Q4_1 file's Q8_0 output layer in int8)."""
        return self._stored(name, fmt_name, axis)[1]

    def are_source(self, name: str, fmt_name: str, axis: int) -> bool:
        """Whether the matrix so stored holds the source's values (a file's own blocks, kept)."""
        return self._stored(name, fmt_name, axis)[0] is FILE_VALUES

    def values(self, name: str, fmt_name: str, axis: int) -> np.ndarray:
        blocks, fmt = self._stored(name, fmt_name, axis)
        if blocks is FILE_VALUES:
            return self._source(name)
        if blocks is None:
            return self._source(name).astype(fmt.storage).astype(np.float32)
        return dequantize_blocks(*blocks[:2], axis, *blocks[2:])


class _Planned(dict):
    """name -> stored values of the matrices a plan changes, computed when read (a Variant's `weights`)."""

    def __init__(self, stored: StoredWeights, choices: dict[str, tuple[str, int]]):
        super().__init__()
        self._stored, self._choices = stored, choices

    def __contains__(self, name) -> bool:
        # (a file's own blocks are the source's values, which the interpreter holds: not computed again per plan)
        return name in self._choices and not self._stored.are_source(name, *self._choices[name])

    def __getitem__(self, name: str) -> np.ndarray:
        # (not kept: a plan's run reads each matrix once a batch, and a path's end changes every matrix)
        return self._stored.values(name, *self._choices[name])


@dataclass
class QualityPlan:
    name = "quality"
    requires = (CALIBRATION_SEQUENCES,)
    method: str = Options.quant_method
    mode: str = "threshold"  # threshold: a level per linear input; predictor: a recall per FFN (formats fixed)
    lowest_recall: float = Options.target_recall  # predictor mode: the recall predict fitted to, the lowest level
    int8_activations: bool = Options.int8_activations

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        started = time.perf_counter()
        # the build's format, budget and instruction set (with int8_activations: which quantized GEMVs round their
        # input to int8)
        weight_dtype, budget, cpu_isa = ctx.build.weight_dtype, ctx.build.quality_budget, ctx.build.cpu_isa
        fit, held_out = _split(CalibrationSequences.of(model), parameter_count(model.graph))
        interpreter = Interpreter(model, int8_predictor_inputs=predictor_reads_int8(self.int8_activations, cpu_isa))
        fixed_level = _fixed_levels(model)  # --sparsity: the threshold pass's levels, kept as they are (measured)
        planned = self.mode == "threshold" and not fixed_level
        # (auto's build of a quantized model keeps its blocks: formats are not the plan's)
        fixed_formats = ctx.build.keep_source_blocks
        unpaid = ""  # why a plan's sparsity was given up as not worth it, where it was
        # (predictor mode too: a format per FFN, its up and down rows read by one fused kernel, and per attention
        # matrix)
        formats = allowed_formats(weight_dtype) if not fixed_level and not fixed_formats else (weight_dtype,)
        sites = MODE_SITES[self.mode] if not fixed_level else {"FFN": ("in", "down")}
        if self.mode == "predictor" and len(formats) > 1:
            sites = {**sites, **FORMAT_SITES}
        stored = StoredWeights(model, Blocking.of(model, ctx.build.weight_format, self.method, fixed_formats),
                               thinned_rows=self.mode == "threshold")
        blocks = [n for n in model.graph if n.op_type in sites and n.domain == DOMAIN]
        # the output layer's input is a knob too where the plan chooses formats (a quantized file's own blocks, along
        # K, would be blocked again along the rows its column kernel gathers)
        # (predictor mode's: a format, its input dense: the code model's int4 output layer alone cost +1.3%)
        head_knob = head_node(model) is not None and (planned and not fixed_formats or
                                                      self.mode == "predictor" and len(formats) > 1)
        # (its levels measured up to the first whose KL alone is far beyond the budget: no plan within takes it)
        head_limit = HEAD_LIMIT * budget.value if head_knob else None
        isa = cpu_isa if self.int8_activations else None
        int8_dot = isa.int8_dot if isa is not None else None
        price = lambda knob: _costs(knob, model, formats, stored, ctx.target, int8_dot)  # noqa: E731
        with ctx.progress("quality: local effects", len(blocks)) as advance:
            knobs = _measure_locally(interpreter, fit, blocks, sites, formats, stored, fixed_level,
                                     self.lowest_recall, price, advance, head_limit, thresholded=planned)
        measure = _HeldOut(interpreter, held_out, knobs)  # (each knob's held-out share dropped per level, too)
        for knob in knobs:
            knob.cost = price(knob)
        embed = _embed_format(model, formats)
        start = _start(knobs, fixed_level)
        moves = [] if fixed_level else _greedy_path(knobs, len(formats), start)
        local_error = _summed_errors(knobs, moves, start)
        state_at = lambda steps: _replay(start, moves[:steps])  # noqa: E731
        # every matrix in the build's format where no knob chooses one (predictor mode's output layer in a float build)
        unplanned = _build_matrices(model, weight_dtype)
        variant = lambda state: _variant(knobs, state, formats, stored, embed, isa, unplanned)  # noqa: E731
        # (a plan is known by its step and embedding format: measured on all sequences, it runs only those the
        # search did not measure it on)
        evaluate = lambda steps: measure.quality(variant(state_at(steps)), plan=(steps, embed))  # noqa: E731
        # (the search measures plans on a part of the held-out tokens; the plan it finds is measured on all)
        evaluate_part = lambda steps: measure.quality(variant(state_at(steps)), part=True,  # noqa: E731
                                                      plan=(steps, embed))
        # a path of thresholds alone (one format) pays from its first step whose thinned inputs save more than the
        # cost model's error: the plans before it would be kept dense (below), so the search starts there
        floor = _first_paying(knobs, start, moves) if planned and len(formats) == 1 else 0
        base, errors_on = floor or 0, local_error[floor or 0:]
        search = lambda: _from_step(base, _confirmed(  # noqa: E731
            budget, errors_on, lambda k: evaluate(base + k), measure.partial,
            _furthest_within(budget, errors_on, lambda k: evaluate_part(base + k))))
        with ctx.progress("quality: the budget on held-out tokens", None):
            if floor is None:  # no plan on the path pays: dense, measured once
                steps, found = 0, evaluate(0)
                unpaid = (f"; no plan on its path thins inputs that save more than the cost model's error "
                          f"({costmodel.PRICE_ERROR:.0%}) of the linear layers' time: kept dense")
            else:
                steps, found = search()
                if floor and steps == floor and not budget.met_by(found.ppl_change, found.kl):
                    steps, found = 0, evaluate(0)  # the first plan that pays is beyond: dense
            if not budget.met_by(found.ppl_change, found.kl) and embed and floor is not None:
                embed = (embed[0], formats[0])  # the widest embedding too, and dense
                steps, found = search()
            state = state_at(steps)
            thinned, saved = sum(1 for level, _ in state if level), _saved_share(knobs, state)
            # (levels --sparsity fixed are the user's: measured and said, not given up)
            if not budget.met_by(found.ppl_change, found.kl) and not fixed_level and thinned:
                state = [(0, f) for _, f in state]  # every input dense (predictor mode: every FFN)
                found = measure.quality(variant(state))
            elif planned and thinned and saved <= costmodel.PRICE_ERROR:
                dense = [(0, f) for _, f in state]  # its formats, every input dense
                dense_found = measure.quality(variant(dense))
                if budget.met_by(dense_found.ppl_change, dense_found.kl):
                    unpaid = (f"; the {thinned} inputs it would thin save {saved:.1%} of the linear layers' time, "
                              f"within the cost model's error ({costmodel.PRICE_ERROR:.0%}): kept dense")
                    state, found = dense, dense_found
        _write_thresholds(model, knobs, state)
        plan = WeightPlan({**{m: formats[f] for k, (level, f) in zip(knobs, state) if formats[f] != weight_dtype
                              for m, _ in k.stored_as(level)},
                           **({embed[0]: embed[1]} if embed and embed[1] != weight_dtype else {})})
        plan.attach(model)
        met = budget.met_by(found.ppl_change, found.kl)
        gave_up = _gave_up(knobs, state, start, moves, steps, met, budget)
        expected = ExpectedQuality(budget, found.ppl_change, found.kl, found.top1, found.tokens, met,
                                   _describe_plan(knobs, state, plan) + unpaid, gave_up, found.ppl_low,
                                   found.ppl_high,
                                   _choices(knobs, state, formats, stored, measured=not fixed_level))
        write_entry(model, QUALITY_KEY, expected)
        ctx.log(f"quality: {expected.plan}")
        for line in expected.layer_lines():
            ctx.log(f"quality: {line}")
        ctx.log(f"quality: {expected.line()}; measured in {round(time.perf_counter() - started, 2):.1f}s")
        if expected.gave_up:
            (ctx.log if met else ctx.warn)(f"quality: {expected.gave_up}")
        return PassResult(model, modified=True)


def _equal_length(sequences: list[np.ndarray]) -> np.ndarray:
    """The sequences of the most common length (a calibration file's last piece may be shorter), stacked."""
    lengths = [len(s) for s in sequences]
    length = max(set(lengths), key=lambda n: (lengths.count(n) * n, n))
    return np.stack([s for s in sequences if len(s) == length])


def _token_budget(parameters: int) -> tuple[int, int | None]:
    """(fitting, held-out) tokens at most for a model of `parameters` (see TOKEN_PARAMETERS; None: every one)."""
    if parameters <= TOKEN_PARAMETERS:
        return FIT_TOKENS, None
    share = TOKEN_PARAMETERS / parameters
    return max(MIN_FIT_TOKENS, int(FIT_TOKENS * share)), max(MIN_HELD_OUT_TOKENS, int(MEASURED_TOKENS * share))


def _spread(sequences: list[np.ndarray], tokens: int | None) -> list[np.ndarray]:
    """About `tokens` of `sequences`' tokens: whole sequences taken evenly across them (they are across the file)."""
    total = sum(len(s) for s in sequences)
    if tokens is None or total <= tokens:
        return sequences
    count = max(1, round(len(sequences) * tokens / total))
    return [sequences[int((k + 0.5) * len(sequences) / count)] for k in range(count)]


def _split(calibration: CalibrationSequences, parameters: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """(fitting, held-out) sequences, within the token budget of a model of `parameters` (`_token_budget`). Held
    out: the user's sequences the profile kept out of every fit (`measured`, any lengths), evenly spread where the
    budget takes fewer; failing those (a single sequence), the last HOLDOUT of the sequences of the most common
    length (at most HELD_OUT_TOKENS). Fitting: the first (at most FIT_TOKENS) of the others of the most common
    length; a single sequence serves both."""
    fit_tokens, held_tokens = _token_budget(parameters)
    measured = calibration.measured
    if measured:
        rest, held = calibration.sequences[:-measured], list(calibration.sequences[-measured:])
        fit = _equal_length(rest) if rest else _equal_length(held)
        return fit[: max(1, fit_tokens // fit.shape[1])], _spread(held, held_tokens)
    sequences = _equal_length(calibration.sequences)
    count, length = sequences.shape
    held = max(1, min(int(round(HOLDOUT * count)), min(HELD_OUT_TOKENS, held_tokens or HELD_OUT_TOKENS) // length or 1))
    fit = max(1, min(count - held, fit_tokens // length or 1))
    return sequences[:fit] if count > 1 else sequences, list(sequences[count - held:])


def _fixed_levels(model: ir.Model) -> dict[str, bool]:
    """With --sparsity the threshold pass set the FFN inputs' thresholds: {site: True} for the FFN's two."""
    ffn = next(iter(FFN.nodes(model)), None)
    return {"in": True, "down": True} if ffn is not None and "threshold_in" in ffn.attributes else {}


def _matrix(node: ir.Node, site: str) -> ir.Value:
    return node.inputs[SITES[(node.op_type, site)]]


QUANTILE_SAMPLE = 1 << 18  # magnitudes a threshold's quantile is taken over (an even sample of them)


def _quantiles(magnitudes: torch.Tensor, shares) -> np.ndarray:
    """The `shares`-quantiles of `magnitudes` (over an evenly strided sample where there are many)."""
    flat = magnitudes.flatten()
    flat = flat[:: max(1, flat.numel() // QUANTILE_SAMPLE)].numpy()
    ranks = [min(len(flat) - 1, int(share * len(flat))) for share in shares]
    return np.partition(flat, ranks)[ranks].astype(np.float64)  # (those order statistics only: no whole sort)


def _measure_locally(interpreter: Interpreter, fit: np.ndarray, blocks: list[ir.Node], sites: dict,
                     formats: tuple[str, ...], stored: StoredWeights, fixed_level: dict, lowest_recall: float, price,
                     advance, head_limit: float | None = None, thresholded: bool = True) -> list[Knob]:
    """The knobs of `blocks` (at their `sites`) and, with `head_limit`, the output layer's, last: thresholds per
    level and local errors per level and format, from one dense pass over `fit`. A level `price` (the cost model's
    [level, format] seconds of a knob) finds no saving at, in any format, is not measured: the path never takes it
    (its error is infinite). Without `thresholded` (predictor mode, --sparsity) a linear input has no levels but
    dense (and --sparsity's own), a format only."""
    knobs: list[Knob] = []
    head = head_node(interpreter.model)
    knob_sites = [(node, site) for node in blocks for site in sites[node.op_type] if site != "neurons"]
    knob_sites += [(head, "head")] if head_limit is not None else []
    paying = {} if fixed_level else {(node.name, site): _paying_levels(node, site, price) for node, site in knob_sites}
    if head_limit is not None and not thresholded:  # a format only
        paying[(head.name, "head")] = np.zeros(len(LEVELS), bool)

    def weighed(node: ir.Node) -> bool:  # (--sparsity's levels are the user's: no path to order, none)
        return not fixed_level and (len(formats) > 1 or "neurons" in sites[node.op_type]
                                    or any(paying[(node.name, site)].any() for site in sites[node.op_type]))

    op_types = tuple({node.op_type for node in blocks if weighed(node)})
    gradients = interpreter.output_gradients(fit, op_types, FISHER_DRAWS) if op_types else None

    def probe(block: Block) -> None:
        node = block.node
        if node is head and head_limit is not None:
            knobs.append(_head_knob(interpreter, block, formats, stored, paying[(node.name, "head")], head_limit))
            return
        if node.op_type not in sites:  # the output layer as the build stores it (and predictor mode's attention)
            return
        taps = block.taps
        layer = op_view(node).layer
        fisher = gradients.pop(node.name, None) if gradients is not None else None

        def error(delta: torch.Tensor) -> float:  # the KL per fitting token it causes (sampled Fisher)
            return Interpreter.fisher_kl(fisher, delta) if fisher is not None else 0.0

        def rerun(variant: Variant) -> torch.Tensor:
            return interpreter.block(node, block.x, variant) - block.out

        for site in sites[node.op_type]:
            if site == "neurons":
                knobs.append(_predictor_knob(interpreter, node, block.x, taps["down"], lowest_recall, error, rerun,
                                             formats, stored))
                continue
            matrix = _matrix(node, site)
            v, weight = taps[site], interpreter.weight(matrix)
            last = site in ("o", "down")  # its product is the block's output: the change is what it drops, times W
            if site in fixed_level:
                thresholds = np.array([KEEP_ALL, float(op_view(node).value(f"threshold_{site}"))], np.float32)
            elif not thresholded:
                thresholds = np.array([KEEP_ALL], np.float32)
            else:
                thresholds = np.concatenate([[KEEP_ALL], _quantiles(v.abs(), LEVELS[1:])]).astype(np.float32)
            sparse = [0.0] * len(thresholds)  # --sparsity's one level: the user's, unweighed
            for level, t in enumerate(thresholds[1:] if not fixed_level else (), 1):
                if not paying[(node.name, site)][level]:
                    sparse[level] = np.nan
                    continue
                dropped = v * (v.abs() <= float(t))
                sparse[level] = (error(-(dropped @ weight)) if last else
                                 error(rerun(Variant({(layer, site): float(t)}, prefill=0))))
            fmt_error = [0.0]
            for fmt in formats[1:]:
                values = stored.values(matrix.name, fmt, 0)
                fmt_error.append(error(v @ (torch.from_numpy(values) - weight)) if last else
                                 error(rerun(Variant(weights={matrix.name: values}, prefill=0))))
            knobs.append(Knob(node, site, matrix.name, thresholds, _monotone(sparse), _monotone(fmt_error),
                              np.zeros(len(thresholds))))
        advance()

    if head_limit is not None:  # (the output layer's knob measures its levels on its whole logits)
        interpreter.logits(fit, probe=probe)
    else:
        interpreter.head_input(fit, probe=probe)
    return knobs


def _head_knob(interpreter: Interpreter, block: Block, formats: tuple[str, ...], stored: StoredWeights,
               paying: np.ndarray, limit: float) -> Knob:
    """The output layer's input as a knob: its levels' and formats' KL at the logits, measured exactly (the logits
    are its output), per fitting token; a level that does not pay, and those past the first whose KL is over
    `limit`, unmeasured (each level is a product with the whole output layer: 0.45 s on SmolLM2's 512 tokens)."""
    node, x = block.node, block.x
    matrix = node.inputs[1]
    weight = interpreter.weight(matrix)
    reference = torch.log_softmax(block.out.to(torch.float64), -1)
    probabilities = reference.exp()

    def kl(logits: torch.Tensor) -> float:
        got = torch.log_softmax(logits.to(torch.float64), -1)
        return float((probabilities * (reference - got)).sum(-1).mean())

    thresholds = np.concatenate([[KEEP_ALL], _quantiles(x.abs(), LEVELS[1:])]).astype(np.float32)
    sparse = [0.0]
    for level, t in enumerate(thresholds[1:], 1):
        beyond = np.nanmax(sparse) > limit
        sparse.append(kl((x * (x.abs() > float(t))) @ weight) if paying[level] and not beyond else np.nan)
    fmt_error = [0.0] + [kl(x @ torch.from_numpy(stored.values(matrix.name, fmt, 0))) for fmt in formats[1:]]
    return Knob(node, "head", matrix.name, thresholds, _monotone(sparse), _monotone(fmt_error),
                np.zeros(len(thresholds)))


def _paying_levels(node: ir.Node, site: str, price) -> np.ndarray:
    """Per level of LEVELS, whether `price` finds it cheaper than the input dense in some format, at the share
    it drops on the fitting tokens (the share its threshold is the quantile of): the levels worth measuring. On
    int4 SmolLM2, 30 of its 1,080 (each FFN input's 0.9); on a tiny model, none."""
    nominal = Knob(node, site, _matrix(node, site).name, np.full(len(LEVELS), KEEP_ALL, np.float32),
                   np.zeros(len(LEVELS)), np.zeros(1), np.array(LEVELS))
    cost = price(nominal)
    return (cost < cost[0]).any(axis=1)


def _monotone(errors: list[float]) -> np.ndarray:
    """Local errors by level (or format) as the path reads them: a sparser level or a narrower format never
    counts as better (noise at the first levels); one not measured (nan) is never taken (infinite)."""
    errors = np.asarray(errors, np.float64)
    measured = ~np.isnan(errors)
    rising = np.maximum.accumulate(np.where(measured, np.maximum(errors, 0.0), 0.0))
    return np.where(measured, rising, np.inf)


def _predictor_knob(interpreter: Interpreter, node: ir.Node, x: torch.Tensor, hidden: torch.Tensor,
                    lowest_recall: float, error, rerun, formats: tuple[str, ...], stored: StoredWeights) -> Knob:
    """Predictor mode's knob of one FFN: dense, or its predictor at the threshold reaching each of RECALLS above
    `lowest_recall` of the truly active neurons (those with a non-zero hidden value) on the fitting tokens, then at
    predict's own threshold (fitted to `lowest_recall` on held-out profiled tokens); and a format for its up and
    down rows together (the fused sparse kernel reads both in one), each blocked along its neuron's row."""
    layer = FFN(node).layer
    graph = interpreter.model.graph
    w1, w2 = (interpreter.weight(graph.initializers[f"layers.{layer}.ffn.predictor.{w}"]) for w in ("w1", "w2"))
    logits = interpreter.predictor_scores(x, w1, w2).flatten().numpy()
    active = (hidden != 0).flatten().numpy()
    thresholds = np.array([KEEP_ALL] + [_threshold_for_recall(logits, active, r) for r in RECALLS if r > lowest_recall]
                          + [float(FFN(node).predictor_threshold)], np.float32)
    errors = [0.0] + [error(rerun(Variant(prefill=0, predictors={layer: (w1, w2, float(t))}))) for t in thresholds[1:]]
    knob = Knob(node, "neurons", node.inputs[1].name, thresholds, np.maximum.accumulate(errors), np.zeros(1),
                np.zeros(len(thresholds)), predictor=(w1, w2))
    knob.format_error = _monotone([0.0] + [
        error(rerun(Variant(prefill=0, weights={m: stored.values(m, fmt, axis) for m, axis in knob.stored_as(0)})))
        for fmt in formats[1:]])
    return knob


def _embed_format(model: ir.Model, formats: tuple[str, ...]) -> tuple[str, str] | None:
    """(matrix, format) of the embedding table: int8 where allowed (its rows are gathered, one per token: its format
    costs memory, not time); None where the build has one format."""
    embed_node = next(iter(Embed.nodes(model)), None)
    if len(formats) == 1 or embed_node is None:
        return None
    return embed_node.inputs[2].name, "int8" if "int8" in formats else formats[-1]


def _costs(knob: Knob, model: ir.Model, formats: tuple[str, ...], stored: StoredWeights, target: Target,
           int8_dot: str | None) -> np.ndarray:
    """[level, format] decode seconds of the knob's matrix (the cost model's `gemv_seconds`), a threshold level
    reading the rows of the inputs it keeps on held-out tokens (`threshold_seconds`); a predictor knob's FFN (up and
    down), its sparse levels reading the predictor whole and the rows of the neurons it selects. Each in the format
    the quantize pass stores the matrix in at that level (`StoredWeights.priced_format`): a quantized file's
    matrix in its own blocks (thresholded too, where a column kernel reads its format), else in the blocks its rows
    are rounded to."""
    shape = lambda value: tuple(value.const_value.shape)  # noqa: E731  (the values stay unread)
    inputs, outputs = shape(model.graph.initializers[knob.matrix])  # [K, N]: a row per input
    weights = inputs * outputs
    if knob.predictor is not None:
        weights += int(np.prod(shape(knob.node.inputs[3])))  # w_down
        predictor = sum(w.numel() for w in knob.predictor) * PREDICTOR_FORMAT.bytes_per_weight
    cost = np.empty((len(knob.thresholds), len(formats)))
    for f, name in enumerate(formats):
        for level in range(len(knob.thresholds)):
            fmt = stored.priced_format(knob.matrix, name, knob.stored_as(level)[0][1])
            stored_bytes = weights * fmt.bytes_per_weight
            kept = 1.0 - float(knob.held_out_dropped[level]) if level else None
            if not level:
                cost[level, f] = costmodel.gemv_seconds(target, stored_bytes, fmt.name, columns=outputs)
            elif knob.predictor is None:
                cost[level, f] = costmodel.threshold_seconds(target, stored_bytes, kept, fmt.name, inputs, int8_dot)
            else:  # the predictor's GEMVs and the fused kernel's selected rows
                efficiency = costmodel.sparse_row_efficiency(fmt.bits, int8_dot)
                bandwidth = costmodel.cpu_bandwidth(target)
                cost[level, f] = (costmodel.linear_seconds(stored_bytes, bandwidth, kept, efficiency)
                                  + costmodel.linear_seconds(predictor, bandwidth))
    return cost


def _start(knobs: list[Knob], fixed_level: dict) -> list[tuple[int, int]]:
    """Where the path starts: every knob dense at the widest format, but a --sparsity FFN input at the pass's level
    and a predictor at its highest recall (whether an FFN runs dense is placement's choice, with its own prices)."""
    return [(1 if knob.site in fixed_level or knob.predictor is not None else 0, 0) for knob in knobs]


def _greedy_path(knobs: list[Knob], formats: int, start: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The moves (knob, level, format) from dense at the widest formats, each the least added local error per
    second saved among every knob's moves to a sparser level and/or narrower format; until no move saves time.
    A threshold level is a move only where it is cheaper than its format's dense matrix by more than the cost
    model's error (`costmodel.worth_sparsity`): else the matrix stays dense (never slower than dense). (A predictor
    FFN starts sparse: whether it runs dense is placement's choice, with its own prices and dense fallback.)"""
    state = list(start)
    moves = []

    def best_move(index: int):
        knob, (level, fmt) = knobs[index], state[index]
        here_cost, here_error = knob.cost[level, fmt], knob.error(level, fmt)
        best = None
        for new_level in range(level, len(knob.thresholds)):
            for new_fmt in range(fmt, formats):
                saved = here_cost - knob.cost[new_level, new_fmt]
                if saved <= 0 or not np.isfinite(knob.error(new_level, new_fmt)):
                    continue
                if (new_level and knob.predictor is None  # (a predictor FFN's dense fallback is placement's)
                        and not costmodel.worth_sparsity(knob.cost[new_level, new_fmt], knob.cost[0, new_fmt])):
                    continue
                ratio = (knob.error(new_level, new_fmt) - here_error) / saved
                if best is None or ratio < best[0]:
                    best = (ratio, new_level, new_fmt)
        return best

    candidates = [best_move(i) for i in range(len(knobs))]
    while True:
        options = [(c[0], i) for i, c in enumerate(candidates) if c is not None]
        if not options:
            return moves
        _, index = min(options)
        _, level, fmt = candidates[index]
        state[index] = (level, fmt)
        moves.append((index, level, fmt))
        candidates[index] = best_move(index)


def _saved_share(knobs: list[Knob], state: list[tuple[int, int]]) -> float:
    """The share of the linear layers' dense time (in the plan's formats) the plan's thresholded inputs are expected
    to save, all together. Each alone saves more than the cost model's error of its own dense time
    (`_greedy_path`); a plan whose whole gain is within the error of the whole is not worth its quality nor its
    prompts' slower GEMMs over thinned rows."""
    saved = sum(float(knob.cost[0, fmt] - knob.cost[level, fmt]) for knob, (level, fmt) in zip(knobs, state)
                if level and knob.predictor is None)
    dense = sum(float(knob.cost[0, fmt]) for knob, (_, fmt) in zip(knobs, state))
    return saved / dense if dense > 0 else 0.0


def _first_paying(knobs: list[Knob], start: list[tuple[int, int]], moves: list[tuple[int, int, int]]) -> int | None:
    """The first step of a path of threshold moves whose thinned inputs together save more than the cost model's
    error of the linear layers' time (`_saved_share`; it only grows along such a path); None where none does."""
    state = list(start)
    for step, (index, level, fmt) in enumerate(moves, 1):
        state[index] = (level, fmt)
        if _saved_share(knobs, state) > costmodel.PRICE_ERROR:
            return step
    return None


def _from_step(floor: int, searched: tuple[int, Quality]) -> tuple[int, Quality]:
    """A search's result over the path from step `floor` on, as a step of the whole path."""
    steps, found = searched
    return floor + steps, found


def _within_price_error(knobs: list[Knob], state: list[tuple[int, int]]) -> int:
    """The knobs the plan keeps dense although a sparse level of theirs was expected faster, by less than the cost
    model's error."""
    close = 0
    for knob, (level, fmt) in zip(knobs, state):
        if level == 0 and knob.predictor is None and knob.cost.shape[0] > 1:
            sparse = knob.cost[1:, fmt]
            close += bool(np.any(sparse < knob.cost[0, fmt]) and
                          not any(costmodel.worth_sparsity(s, knob.cost[0, fmt]) for s in sparse))
    return close


def _summed_errors(knobs: list[Knob], moves: list[tuple[int, int, int]], start: list[tuple[int, int]]) -> np.ndarray:
    """The summed local error of every knob after 0, 1, ... len(moves) moves from `start`."""
    now = [knob.error(*state) for knob, state in zip(knobs, start)]
    sums = [sum(now)]
    for index, level, fmt in moves:
        error = knobs[index].error(level, fmt)
        sums.append(sums[-1] + error - now[index])
        now[index] = error
    return np.array(sums)


def _replay(start: list[tuple[int, int]], moves: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Each knob's (level, format) after `moves` from `start`."""
    state = list(start)
    for index, level, fmt in moves:
        state[index] = (level, fmt)
    return state


def _build_matrices(model: ir.Model, weight_dtype: str) -> dict[str, tuple[str, int]]:
    """Every matrix a quantized build stores in its own format, with the axis the quantize pass blocks it along
    (a dense linear's K; the embedding's rows; predictor mode's down rows, gathered per neuron); {} for a float
    build. Where a knob then chooses a level or format, its choice replaces this."""
    if not WEIGHT_FORMATS[weight_dtype].quantized:
        return {}
    matrices = {}
    for node in model.graph:
        if Attention.matches(node) or FFN.matches(node):
            for (op, site), index in SITES.items():
                if op == node.op_type and node.inputs[index] is not None:
                    matrices[node.inputs[index].name] = (weight_dtype, 1 if site == "down" else 0)
        elif node.op_type == "Embed":
            matrices[node.inputs[2].name] = (weight_dtype, 1)
    head = head_node(model)
    if head is not None:
        matrices[head.inputs[1].name] = (weight_dtype, 0)
    return matrices


def _variant(knobs: list[Knob], state: list[tuple[int, int]], formats: tuple[str, ...], stored: StoredWeights,
             embed: tuple[str, str] | None, isa: CpuIsa | None,
             build_matrices: dict[str, tuple[str, int]]) -> Variant:
    """A plan as the kernels compute it: thresholds on decode rows, matrices as stored (a sparse one blocked
    along its rows, the layout its kernel gathers; a dense one along K); `build_matrices`: the matrices no knob
    chooses a format for, in the build's (a quantized predictor-mode or --sparsity build's)."""
    thresholds = {(knob.layer, knob.site): float(knob.thresholds[level])
                  for knob, (level, _) in zip(knobs, state) if level and knob.predictor is None}
    predictors = {knob.layer: (*knob.predictor, float(knob.thresholds[level]))
                  for knob, (level, _) in zip(knobs, state) if level and knob.predictor is not None}
    # (a float build's own format is the source's values: fp32, or the fp16 a half model stores)
    changed = lambda fmt: fmt != "fp32" and not (len(formats) == 1 and not WEIGHT_FORMATS[fmt].quantized)  # noqa: E731
    choices = dict(build_matrices)
    choices.update({matrix: (formats[f], axis) for knob, (level, f) in zip(knobs, state) if changed(formats[f])
                    for matrix, axis in knob.stored_as(level)})
    if embed is not None and changed(embed[1]):
        choices[embed[0]] = (embed[1], 1)
    # a dense quantized matrix's decode GEMV over int8 activations, where select-kernels picks that kernel
    stored_in = {name: stored.format(name, *choice) for name, choice in choices.items() if choice[1] == 0}
    dot, tile = (isa.int8_dot, isa.gemm_panels) if isa is not None else (None, 1)
    int8_inputs = frozenset(name for name, fmt in stored_in.items()
                            if quant.int8_activations(fmt, dot, tile, prompt=False))
    # and its prefill GEMM's, each row so, where the GEMM reads int8
    int8_prefill = frozenset(name for name, fmt in stored_in.items()
                             if quant.int8_activations(fmt, dot, tile, prompt=True))
    return Variant(thresholds, _Planned(stored, choices), prefill=PROMPT_TOKENS, predictors=predictors,
                   int8_inputs=int8_inputs, int8_prefill_inputs=int8_prefill)


def _held_out_predictions(knob: Knob, logits: torch.Tensor, active: torch.Tensor, counts: np.ndarray) -> None:
    """Add a predictor knob's held-out decode rows (its scores `logits`) to `counts` [level, (kept, hits, rows,
    active)]: the neurons it computes, the truly active among them, the rows' neurons and truly active ones
    (level 0: every neuron)."""
    for level, t in enumerate(knob.thresholds):
        selected = logits > float(t) if level else torch.ones_like(active)
        counts[level] += (float(selected.sum()), float((selected & active).sum()), float(active.numel()),
                          float(active.sum()))


def _batches(sequences: list[np.ndarray]) -> list[np.ndarray]:
    """The sequences in batches of one length (the held-out ones may differ), each of at most BATCH_TOKENS tokens
    (or one sequence), in the order their lengths first come."""
    by_length: dict[int, list[list[np.ndarray]]] = {}
    for sequence in sequences:
        batches = by_length.setdefault(len(sequence), [[]])
        if batches[-1] and (len(batches[-1]) + 1) * len(sequence) > BATCH_TOKENS:
            batches.append([])
        batches[-1].append(sequence)
    return [np.stack(batch) for batches in by_length.values() for batch in batches]


class _HeldOut:
    """The dense model's reference on the held-out sequences (`_Reference`, computed once), and a plan's quality
    against it; also each knob's held-out dropped share per level (from the same dense pass, over every
    held-out decode row)."""

    def __init__(self, interpreter: Interpreter, sequences: list[np.ndarray], knobs: list[Knob]):
        self.interpreter, self.batches = interpreter, _batches(sequences)
        # plan -> (batch, sequence) -> its measures (`_SequenceMeasure`): a plan is run on each sequence once
        self._measured: dict[object, dict[tuple[int, int], _SequenceMeasure]] = {}
        # the part the path's search measures plans on: every SEARCH_EVERY-th sequence of each batch
        self.part = [np.arange(0, len(batch), SEARCH_EVERY) for batch in self.batches]
        self.partial = sum(map(len, self.part)) < sum(map(len, self.batches))
        by_block = {}
        for knob in knobs:
            if knob.predictor is None and not np.isfinite(knob.sparse_error[1:]).any():
                # no sparse level the path may take (none pays, or none but dense): nothing to count, and its
                # block not run again for its inputs
                knob.held_out_dropped = np.zeros(len(knob.thresholds))
                continue
            by_block.setdefault(knob.node.name, []).append(knob)
        counted = [knob for block_knobs in by_block.values() for knob in block_knobs]
        # per knob and level: predictor knobs (kept, hits, rows, active), linear inputs (dropped, inputs)
        counts = {id(knob): np.zeros((len(knob.thresholds), 4 if knob.predictor is not None else 2))
                  for knob in counted}

        def probe(block: Block) -> None:
            if block.node.name not in by_block:
                return
            taps = block.taps
            for knob in by_block[block.node.name]:
                if knob.predictor is not None:
                    decode_x = block.x[:, PROMPT_TOKENS:]
                    _held_out_predictions(knob, interpreter.predictor_scores(decode_x, *knob.predictor),
                                          taps["down"][:, PROMPT_TOKENS:] != 0, counts[id(knob)])
                    continue
                counts[id(knob)] += _dropped_counts(taps[knob.site][:, PROMPT_TOKENS:], knob.thresholds)

        self.reference = [_Reference.of(interpreter, batch, probe) for batch in self.batches]
        for knob in counted:
            c = counts[id(knob)]
            if knob.predictor is None:
                knob.held_out_dropped = c[:, 0] / np.maximum(c[:, 1], 1.0)
                continue
            kept, hits, rows, active = c.T
            knob.held_out_dropped = 1.0 - kept / np.maximum(rows, 1.0)
            knob.held_out_recall = hits / np.maximum(active, 1.0)
            knob.held_out_precision = hits / np.maximum(kept, 1.0)

    def quality(self, variant: Variant, part: bool = False, plan: object = None) -> Quality:
        """The plan's quality against the dense model's on the held-out sequences (`part`: on `self.part`'s).
        `plan` (any key) names the plan: its sequences measured before are not run again."""
        measured = self._measured.setdefault(plan, {}) if plan is not None else {}
        for index, (batch, ref) in enumerate(zip(self.batches, self.reference)):
            chosen = self.part[index] if part else np.arange(len(batch))
            missing = np.array([s for s in chosen if (index, s) not in measured], np.int64)
            if len(missing):
                measured.update({(index, int(s)): m for s, m in zip(missing, self._measure(batch, ref, missing,
                                                                                              variant))})
        picked = [(ref, measured[(index, int(s))], int(s)) for index, ref in enumerate(self.reference)
                  for s in (self.part[index] if part else range(len(ref.nll)))]
        nll_ref = np.array([float(ref.nll[s]) for ref, _, s in picked])
        nll_got = np.array([m.nll for _, m, _ in picked])
        predicted = np.array([ref.positions for ref, _, _ in picked])
        count = int(predicted.sum())
        change, low, high = ppl_change_interval(nll_got, nll_ref, predicted)
        return Quality(change, sum(m.kl for _, m, _ in picked) / count, sum(m.agree for _, m, _ in picked) / count,
                       count, low, high)

    def _measure(self, batch: np.ndarray, ref: "_Reference", chosen: np.ndarray,
                 variant: Variant) -> list["_SequenceMeasure"]:
        """The plan's measures on the sequences `chosen` of one batch."""
        interpreter, rows = self.interpreter, ref.rows(chosen)
        x, x_ref = interpreter.head_input(batch[chosen], variant, positions=ref.scored), ref.x[rows]
        planned = interpreter.head_columns(len(x), variant)
        # (the reference's logits from the source's output layer, where the plan stores it otherwise)
        source = interpreter.head_columns(len(x)) if interpreter.head.inputs[1].name in variant.weights else None
        logits = interpreter.head_logits
        slices = ((first, logits(x, w), logits(x_ref, w if source is None else next(source)[1])) for first, w in planned)
        got = Logits.of(slices, len(x), at=ref.targets[rows, None], reference=ref.log_normalizer[rows])
        per_sequence = lambda v: v.reshape(len(chosen), -1).sum(1).tolist()  # noqa: E731
        return [_SequenceMeasure(*m) for m in zip(per_sequence(got.log_normalizer - got.at_values[:, 0]),
                                                  per_sequence(got.kl_from_reference),
                                                  per_sequence((ref.top[rows] == got.argmax).double()))]


@dataclass(frozen=True)
class _SequenceMeasure:
    """A plan on one held-out sequence: its summed negative log-likelihood, summed KL from the reference and
    agreeing argmaxes over the scored positions."""

    nll: float
    kl: float
    agree: float


def _dropped_counts(decode: torch.Tensor, thresholds: np.ndarray) -> np.ndarray:
    """[level, (inputs at or below the level's threshold, inputs)] of a site's decode inputs: one pass that puts
    each |v| among the sorted thresholds (a negative threshold, KEEP_ALL, drops none)."""
    order = np.argsort(thresholds, kind="stable")
    edges = torch.from_numpy(np.asarray(thresholds, np.float32)[order])
    bins = torch.bucketize(decode.abs().flatten(), edges)  # v <= edges[i] exactly where bin <= i
    at_or_below = np.cumsum(torch.bincount(bins, minlength=len(edges) + 1).numpy()[:len(edges)])
    dropped = np.zeros(len(thresholds))
    dropped[order] = at_or_below
    dropped[np.asarray(thresholds) < 0] = 0.0
    return np.stack([dropped, np.full(len(thresholds), float(decode.numel()))], 1)


@dataclass(frozen=True)
class _Reference:
    """What a plan's quality on one batch is measured against: the dense model at the scored positions (rows:
    each sequence's `positions` in turn), as the output layer's input `x` (its logits are computed again beside
    each plan's, a slice at a time: no [rows, vocabulary] array is kept) and each row's log-normalizer, argmax
    (`top`) and target, and each sequence's summed negative log-likelihood of its targets. Float64, as a
    whole-vocabulary log-softmax in float64 gives them (what resolves a KL of fp16 rounding)."""

    scored: slice
    positions: int
    x: torch.Tensor
    log_normalizer: torch.Tensor
    top: torch.Tensor
    targets: torch.Tensor
    nll: torch.Tensor

    @classmethod
    def of(cls, interpreter: Interpreter, batch: np.ndarray, probe) -> "_Reference":
        scored = scored_positions(batch.shape[1])
        targets = torch.from_numpy(np.asarray(batch[:, predicted_tokens(scored)], np.int64)).reshape(-1)
        x = interpreter.head_input(batch, probe=probe, positions=scored)
        dense = Logits.of(((first, interpreter.head_logits(x, w)) for first, w in interpreter.head_columns(len(x))), len(x),
                          at=targets[:, None])
        log_normalizer = dense.log_normalizer
        nll = (log_normalizer - dense.at_values[:, 0]).reshape(len(batch), -1).sum(1)
        return cls(scored, len(x) // len(batch), x, log_normalizer, dense.argmax, targets, nll)

    def rows(self, sequences: np.ndarray) -> torch.Tensor:
        """The rows of `sequences` (indexes into the batch)."""
        return (torch.from_numpy(sequences)[:, None] * self.positions + torch.arange(self.positions)).reshape(-1)


MAX_EVALUATIONS = 5  # plans measured on the held-out tokens while searching the path
FAR_END = 100  # a path's end past this many times the aim is no point to interpolate from


def _furthest_within(budget: QualityBudget, local_error: np.ndarray, evaluate) -> tuple[int, Quality]:
    """The furthest step of the path (`local_error[k]`: the summed local error after k moves) whose plan `evaluate`
    finds within `budget`, and its quality. The path's end first; then steps aimed at 0.9 of the budget (`_aim`: a
    few plans measured, not a bisection's many). The end is not measured where its summed local error (an
    estimate of the KL, 0.4-2.6x of it on SmolLM2) is more than FAR_END times the aim: SmolLM2's int4 default
    path ends at 340 times a 1% budget's, and measuring that plan took a quarter of the build. Then:
    - first, where the end is more than FAR_END times the aim, where the summed local error reaches it (it
      estimates the KL; a ppl change of a few percent is of the same size); else on the line from step 0 to the end;
    - while no step beyond the budget but the end is measured, and the end is more than FAR_END times the aim,
      on the line from step 0 through the furthest within: such an end (SmolLM2's fp32 path ends at +150,000%)
      is so far off the curve that a curve through it aims at the path's first steps;
    - while no step within the budget but step 0 is known, back from the nearest beyond as if quality grew like
      the square root of the local error: a line from step 0 keeps landing beyond on a concave stretch (SmolLM2's
      int4 path, where moves to int8 cost more than their local errors say, stopped at step 0 so);
    - then between the furthest step within the budget and the nearest beyond it. Quality grows faster than
      linearly along the path, so a straight line keeps landing short of the aim from below: `_aim` follows the
      power law through the two where it can, and the Illinois rule halves the far one's excess each time the
      near one moves twice in a row.
    Step 0 (dense at the widest formats) where none is within; measured first where its summed local error is
    beyond the aim already, and returned at once where it is beyond the budget."""
    metric = lambda q: budget.judged(q.ppl_change, q.kl)  # noqa: E731
    aim_at = 0.9 * budget.value
    end = len(local_error) - 1
    found = {}
    if local_error[0] > aim_at:  # even the path's start is expected beyond: where it is, no step is within
        found[0] = evaluate(0)  # (a random model's int8 activations: its logits are huge)
        if not budget.met_by(found[0].ppl_change, found[0].kl):
            return 0, found[0]
    if end > 0 and local_error[end] > FAR_END * aim_at:
        high_value = float(local_error[end])  # far beyond: its estimate stands in for a measure
    else:
        found[end] = evaluate(end)
        if budget.met_by(found[end].ppl_change, found[end].kl):
            return end, found[end]
        high_value = metric(found[end])
    low, high, low_value = 0, end, 0.0  # step 0 is taken as within until measured
    moved_low = False
    for _ in range(MAX_EVALUATIONS - 1):
        if high - low <= 1:
            break
        far = high == end and high_value > FAR_END * aim_at  # too far off any curve to aim from
        if low == 0 and far:  # nothing measured but the end: the summed local errors estimate the KL
            aim = aim_at
        elif low == 0 and high < end:  # only plans beyond: back off as if quality grew like the local error's root
            aim = local_error[high] * (aim_at / high_value) ** 2  # (concave stretches: SmolLM2's int8 moves)
        elif far:  # from step 0 through the furthest within
            aim = _aim(0.0, 0.0, local_error[low], low_value, aim_at)
        else:
            aim = _aim(local_error[low], low_value, local_error[high], high_value, aim_at)
        step = int(np.clip(np.searchsorted(local_error, aim), low + 1, high - 1))
        found[step] = evaluate(step)
        if budget.met_by(found[step].ppl_change, found[step].kl):
            if moved_low:  # Illinois: the far end has held twice; halve its excess over the aim
                high_value = aim_at + (high_value - aim_at) / 2
            low, low_value, moved_low = step, metric(found[step]), True
        else:
            high, high_value, moved_low = step, metric(found[step]), False
    if low not in found:
        found[low] = evaluate(low)
    return low, found[low]


def _confirmed(budget: QualityBudget, local_error: np.ndarray, evaluate, partial: bool,
               searched: tuple[int, Quality]) -> tuple[int, Quality]:
    """The step the search found (`searched`: on a part of the held-out tokens, where `partial`) and its quality
    measured on all of them (`evaluate`). Where that is beyond the budget, the step at half its summed local error,
    measured on all (the caller's fallbacks take it from there where it is beyond too). A plan on the edge of the
    budget may fall either side on another part of the text: the part only aims the search, the whole judges it."""
    steps, found = searched
    if not partial:
        return steps, found
    found = evaluate(steps)
    if steps == 0 or budget.met_by(found.ppl_change, found.kl):
        return steps, found
    back = int(np.clip(np.searchsorted(local_error, local_error[steps] / 2, side="right") - 1, 0, steps - 1))
    return back, evaluate(back)


def _aim(x_low: float, y_low: float, x_high: float, y_high: float, target: float) -> float:
    """Where between two measured points of the path (local error x, quality y) the quality reaches `target`:
    on the power law through them (a straight line in log-log: quality grows like a power of the local error)
    where both are positive, else on the straight line (from step 0, whose quality is 0)."""
    if min(x_low, y_low) > 0 and y_high > y_low and x_high > x_low:
        power = np.log(y_high / y_low) / np.log(x_high / x_low)
        return float(x_low * (target / y_low) ** (1 / power))
    slope = (y_high - y_low) / max(x_high - x_low, 1e-30)
    return x_low + (target - y_low) / slope if slope > 0 else x_high


def _write_thresholds(model: ir.Model, knobs: list[Knob], state: list[tuple[int, int]]) -> None:
    """Each knob's level on its node: a linear input's threshold and held-out share dropped; a predictor's
    threshold, recall, precision and predicted-active share (dense: every neuron passes, placement runs it dense);
    the output layer's, thinned, as the model's `HeadThreshold` (its MatMul takes no attributes of ours)."""
    for knob, (level, _) in zip(knobs, state):
        if knob.site == "head":
            if level:
                HeadThreshold(float(knob.thresholds[level]), float(knob.held_out_dropped[level])).attach(model)
            continue
        if knob.predictor is not None:
            threshold = float(knob.thresholds[level]) if level else ALL_NEURONS
            ffn = FFN(knob.node)
            ffn.predictor_threshold, ffn.predictor_recall = threshold, float(knob.held_out_recall[level])
            ffn.predictor_precision, ffn.predictor_active = (float(knob.held_out_precision[level]),
                                                             float(1.0 - knob.held_out_dropped[level]))
            continue
        block = op_view(knob.node)
        block.set(f"threshold_{knob.site}", float(knob.thresholds[level]))
        block.set(f"sparsity_{knob.site}", float(knob.held_out_dropped[level]))


def _choices(knobs: list[Knob], state: list[tuple[int, int]], formats: tuple[str, ...], stored: StoredWeights,
             measured: bool) -> tuple[MatrixChoice, ...]:
    """Each knob as the plan chose it: its stored format (by the quantize pass's rule: a model's own blocks may
    keep another), held-out share dropped, local KL (`measured`: not where --sparsity fixed the level) and the
    cost model's microseconds, at the choice and dense in the widest format."""
    return tuple(MatrixChoice(knob.layer, knob.site,
                              stored.format(knob.matrix, formats[f], dict(knob.stored_as(level))[knob.matrix]).name,
                              float(knob.held_out_dropped[level]), knob.error(level, f) if measured else None,
                              float(knob.cost[level, f]) * 1e6, float(knob.cost[0, 0]) * 1e6)
                 for knob, (level, f) in zip(knobs, state))


def _describe_plan(knobs: list[Knob], state: list[tuple[int, int]], plan: WeightPlan) -> str:
    """The chosen plan in one line: which knobs are sparse and how much they drop, the formats it changed."""
    sparse = [(knob, level) for knob, (level, _) in zip(knobs, state) if level]
    if knobs and knobs[0].predictor is not None:
        if not sparse:
            return f"every one of the {len(knobs)} FFNs dense"
        recalls = [knob.held_out_recall[level] for knob, level in sparse]
        active = np.mean([1.0 - knob.held_out_dropped[level] for knob, level in sparse])
        return (f"{len(sparse)} of {len(knobs)} FFNs predicted, computing {active:.2f} of their neurons on held-out "
                f"tokens at recall {min(recalls):.3f}-{max(recalls):.3f}")
    mean = float(np.mean([knob.held_out_dropped[level] for knob, level in sparse])) if sparse else 0.0
    by_site = Counter(knob.site for knob, _ in sparse)
    counts = Counter(plan.formats.values())
    where = ", ".join(f"{site} {n}" for site, n in sorted(by_site.items()))
    widened = "; " + ", ".join(f"{n} matrices in {fmt}" for fmt, n in sorted(counts.items())) if counts else ""
    close = _within_price_error(knobs, state)
    kept = (f"; {close} kept dense where sparse would save less than the cost model's error "
            f"({costmodel.PRICE_ERROR:.0%})") if close else ""
    return (f"{len(sparse)} of {len(knobs)} linear inputs sparse ({where or 'none'}), dropping {mean:.2f} of "
            f"their inputs on held-out tokens{widened}{kept}")


def _gave_up(knobs: list[Knob], state, state_at_start, moves, steps: int, met: bool, budget: QualityBudget) -> str:
    """What the budget cost against the end of the greedy path (every move taken), one line; "" where nothing."""
    if not met and not moves and any(level for level, _ in state):
        return (f"the --sparsity level misses the budget ({budget.describe()}); built as asked (without --sparsity "
                "the build picks a level per linear input within it)")
    if not met:
        return (f"even dense at the widest formats the plan misses the budget ({budget.describe()}): built dense, "
                "at the widest formats allowed")
    if steps == len(moves):
        return ""
    full = _replay(state_at_start, moves)
    dense = sum(1 for (level, _), (end, _) in zip(state, full) if end and not level)
    wider = sum(1 for (_, f), (_, g) in zip(state, full) if f < g)
    share = sum(k.cost[s] for k, s in zip(knobs, full)) / sum(k.cost[s] for k, s in zip(knobs, state))
    return (f"to stay within {budget.describe()} the plan stops at step {steps} of {len(moves)} of its path: "
            f"{dense} more linear inputs stay dense and {wider} matrices wider than at the path's end, where the "
            f"linear layers would take {share:.2f} of the time")
