"""awq: scale each FFN's input channels so that quantize rounds the up weights where the activations are large
more finely (activation-aware weight quantization, AWQ, Lin et al. 2024), folded into the FFN's norm.

Runs in int8 / int4 builds with --quant-method awq, after profile and before predict. Reads: the profiled FFN
inputs (`ProfiledActivations`: x after the FFN's norm) and each `picompile.FFN` node's w_up [D, F]. Per layer,
channel scales s = mean|x|^alpha (normalised to a geometric mean of 1) with alpha searched over ALPHAS (0: no
scales) to minimise, on SAMPLE_TOKENS profiled tokens and SAMPLE_COLUMNS of the up columns,
the error of the up projection's output (after the ReLU, where ungated: the neurons that stay off do not
matter) once diag(s) W_up is quantized as the quantize pass will round it (with fitted block scales, AWQ's
other half). The scales are folded exactly:
the norm's scale and bias are divided by s, the rows of W_up multiplied by s, and the profiled inputs divided
by s, so that predict fits the predictors to what the model now computes. The float model is the same
function up to float rounding; only the quantization grid moves.

Where s cannot be folded the layer goes unscaled: a norm that feeds more than this FFN (Falcon's
shared LayerNorm), an FFN input that is no norm's output. A model that came quantized keeps its own values
(rescaling would move them off their grid). Attention and the output layer are not profiled: they go
unscaled too. The down projection gains nothing: its blocks run along a neuron's row, inside one
input channel, where a channel scale only multiplies a block's scale.
The per-layer alpha and error reduction go to `metadata_props["picompile.awq"]` (`AwqReport`) for inspect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .facts import ModelFact
from .ops import FFN
from .pipeline import Context, Options

from .import_gguf import GGUFSource
from .import_onnx import SourceQuantization
from .kernels import quant
from .profile import PROFILED_ACTIVATIONS, ProfiledActivations

ALPHAS = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 11))  # AWQ's grid: s = mean|x|^alpha
AWQ_TOKENS = 2048  # calibration tokens a dense build profiles for the channel magnitudes (at most)
AWQ_MIN_TOKENS = 512  # fewer, and the build warns that the scales rest on little data
SAMPLE_TOKENS = 512  # profiled tokens the search measures the error on
SAMPLE_COLUMNS = 2048  # up columns it measures (each column's error is independent of the others' given s)
NORMS = ("LayerNormalization", "RMSNormalization")
AWQ_KEY = "picompile.awq"


@dataclass(frozen=True)
class ChannelScales:
    """One layer's search result: the scales (None where alpha 0 won) and the errors it compared."""

    alpha: float
    scales: np.ndarray | None
    unscaled_error: float  # relative output error without channel scales (alpha 0)
    error: float  # the same at the chosen alpha

    def report(self, layer: int) -> "AwqLayer":
        return AwqLayer(layer, self.alpha, round(self.unscaled_error, 6), round(self.error, 6))


@dataclass(frozen=True)
class AwqLayer:
    """What the search chose for one layer's FFN input, and the up projection's error with and without it."""

    layer: int
    alpha: float  # 0: unscaled
    unscaled_error: float
    error: float


@dataclass(frozen=True)
class AwqReport(ModelFact):
    """What the awq pass did (the quantize pass repeats it in its summary, for inspect)."""

    KEY: ClassVar[str] = AWQ_KEY
    layers: tuple[AwqLayer, ...]  # the searched layers
    unscaled: tuple[int, ...]  # layers whose norm does not fold a scale: left unscaled
    error_ratio: float  # mean over the searched layers of the up projection's error against the unscaled one

    @classmethod
    def from_json(cls, data: dict) -> "AwqReport":
        return cls(tuple(AwqLayer(**layer) for layer in data["layers"]), tuple(data["unscaled"]), data["error_ratio"])


def mean_magnitude(inputs: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """mean |x| per channel of `inputs` [tokens, d], read a chunk of rows at a time (a memory map stays small)."""
    total = np.zeros(inputs.shape[1], np.float64)
    for begin in range(0, inputs.shape[0], chunk):
        total += np.abs(np.asarray(inputs[begin: begin + chunk], np.float32)).sum(0, dtype=np.float64)
    return (total / max(inputs.shape[0], 1)).astype(np.float32)


def search_scales(x: np.ndarray, w_up: np.ndarray, b_up: np.ndarray | None, magnitude: np.ndarray, fmt,
                  relu: bool, alphas=ALPHAS) -> ChannelScales:
    """The alpha of `alphas` whose scales s = magnitude^alpha make quantize(diag(s) w_up) (blocks along the
    input axis, as stored) reproduce x @ w_up (+ b_up, through the ReLU where `relu`) best on the rows `x`."""
    x = np.asarray(x, np.float32)
    reference = x @ w_up + (0 if b_up is None else b_up)
    if relu:
        reference = np.maximum(reference, 0)
    norm = float(np.linalg.norm(reference)) or 1.0
    floor = max(float(magnitude.max()) * 1e-4, 1e-12)  # a dead channel must not get a scale of 0
    best = None
    for alpha in alphas:
        s = np.maximum(magnitude, floor).astype(np.float64) ** alpha
        s = (s / np.exp(np.log(s).mean())).astype(np.float32)  # geometric mean 1: the weights keep their size
        q, scales, *mins = quant.quantize(w_up * s[:, None], fmt, axis=0, fit_scales=True)
        out = (x / s) @ quant.dequantize(q, scales, 0, *mins) + (0 if b_up is None else b_up)
        if relu:
            out = np.maximum(out, 0)
        error = float(np.linalg.norm(out - reference)) / norm
        if alpha == 0:
            unscaled = error
        if best is None or error < best[1]:
            best = (alpha, error, s)
    alpha, error, s = best
    return ChannelScales(alpha, None if alpha == 0 else s, unscaled, error)


def _foldable_norm(node: ir.Node) -> ir.Node | None:
    """The norm whose output is the FFN's input, where this FFN is all that reads it."""
    norm = node.inputs[0].producer()
    if norm is None or norm.op_type not in NORMS or norm.domain not in ("", "ai.onnx"):
        return None
    if any(user is not node for user, _ in norm.outputs[0].uses()):
        return None
    if any(pir.const_array(value) is None for value in norm.inputs[1:] if value is not None):
        return None
    return norm


@dataclass
class AWQ:
    name = "awq"
    requires = (PROFILED_ACTIVATIONS,)
    seed: int = Options.seed

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        fmt = ctx.build.weight_format
        if not fmt.quantized:
            return PassResult(model, modified=False)
        gguf = GGUFSource.of(model)
        if SourceQuantization.of(model) is not None or (gguf is not None and gguf.quantized()):
            ctx.log("awq: the model came quantized; its weights keep their own values")
            return PassResult(model, modified=False)
        profiled = ProfiledActivations.of(model)
        rng = np.random.default_rng([self.seed, 2])
        report, kept = [], []
        ffns = sorted(FFN.nodes(model), key=lambda n: FFN(n).layer)
        with ctx.progress("awq: searching channel scales", len(ffns)) as advance:
            for node in ffns:
                layer = FFN(node).layer
                with ctx.layer(layer):
                    norm = _foldable_norm(node)
                    w_up, b_up = pir.const_array(node.inputs[1]), pir.const_array(node.inputs[2])
                    if norm is None or not quant.quantizable(w_up.shape, 0, fmt.block):
                        kept.append(layer)
                        advance()
                        continue
                    activations = profiled.layer(layer)
                    rows = np.unique(np.linspace(0, activations.tokens - 1, SAMPLE_TOKENS).astype(np.int64))
                    columns = np.sort(rng.choice(w_up.shape[1], min(SAMPLE_COLUMNS, w_up.shape[1]), replace=False))
                    relu = FFN(node).activation == "relu" and not FFN(node).gated
                    found = search_scales(activations.inputs[rows], np.asarray(w_up[:, columns], np.float32),
                                          None if b_up is None else b_up[columns],
                                          mean_magnitude(activations.inputs), fmt, relu)
                    if found.scales is not None:
                        self._fold(norm, node, found.scales)
                        profiled.scale_inputs(layer, found.scales)
                    report.append(found.report(layer))
                advance()
        # mean over the searched layers of the up projection's error against the unscaled one (1: no gain)
        ratio = float(np.mean([r.error / r.unscaled_error for r in report if r.unscaled_error > 0] or [1.0]))
        AwqReport(tuple(report), tuple(kept), ratio).attach(model)
        scaled = [r for r in report if r.alpha > 0]
        if report:
            ctx.log(f"awq: {len(scaled)} of {len(ffns)} FFN inputs scaled (alpha "
                    f"{', '.join(str(r.alpha) for r in report)}); up-projection error {ratio:.3f}x "
                    f"the unscaled one's" + (f"; layers {kept} not foldable, unscaled" if kept else ""))
        return PassResult(model, modified=bool(scaled))

    @staticmethod
    def _fold(norm: ir.Node, node: ir.Node, s: np.ndarray) -> None:
        """x' = x / s out of the norm (its scale and bias divided), W_up' = diag(s) W_up: x' W_up' = x W_up."""
        for value in norm.inputs[1:]:
            if value is not None:
                value.const_value = ir.tensor(pir.const_array(value) / s, name=value.name)
        up = node.inputs[1]
        stored = pir.const_array(up)  # scaled in fp32, kept in its precision (the quantize pass rounds it next)
        scaled = (np.asarray(stored, np.float32) * s[:, None].astype(np.float32)).astype(pir.weight_array(stored).dtype)
        up.const_value = ir.tensor(np.ascontiguousarray(scaled), name=up.name)
