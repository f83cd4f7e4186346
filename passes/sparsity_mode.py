"""sparsity: decide how decode skips FFN work, predictor (PowerInfer) or threshold (TEAL).

Reads: the `picompile.FFN` nodes' `activation` attribute, the options `sparsity_mode` ("auto", "predictor",
"threshold") and `sparsity`, and whether the target has a GPU. Adds: `ctx.sparsity` ({"mode", "sparsity",
"reason"}), which the profile, predict, threshold and partition passes follow, and the same as JSON in the
graph's `metadata_props["picompile.sparsity"]` (the artifact's manifest carries it; `build` prints the
reason).

The rule of "auto": a ReLU FFN outputs exact zeros for most neurons, so a predictor can skip whole neurons
(predictor mode). A SiLU or GELU FFN almost never does, so there is nothing to predict; instead the inputs of
each projection whose magnitude is below a calibrated threshold are dropped (threshold mode, at
DEFAULT_SPARSITY unless `--sparsity` says otherwise). Asking for predictor mode on such a model is refused:
its predictors would let every neuron through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.errors import UserError
from picompile.pipeline import Context

MODES = ("auto", "predictor", "threshold")
# TEAL reports 40-50% model-wide sparsity at small quality cost; 0.4 is the cautious end of that range.
DEFAULT_SPARSITY = 0.4
PREDICTABLE = ("relu",)  # activations with exact zeros a predictor can learn
SPELLING = {"relu": "ReLU", "silu": "SiLU", "gelu": "GELU"}


@dataclass
class SparsityMode:
    name = "sparsity"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        options = ctx.options
        if options.dense:
            return PassResult(model, modified=False)
        if options.sparsity_mode not in MODES:
            raise UserError(f"--sparsity-mode must be one of {', '.join(MODES)}, got {options.sparsity_mode!r}")
        if options.sparsity is not None and not 0.0 <= options.sparsity < 1.0:
            raise UserError(f"--sparsity must be in [0, 1), got {options.sparsity}")
        activations = sorted({str(pir.attr(n, "activation")) for n in pir.nodes_in_domain(model, "FFN")})
        names = "/".join(SPELLING.get(a, a) for a in activations)
        predictable = all(a in PREDICTABLE for a in activations)
        mode = options.sparsity_mode
        if mode == "auto":
            mode = "predictor" if predictable else "threshold"
            why = (f"layer FFNs use {names}: most neurons output exactly zero, so a predictor can skip them"
                   if predictable else
                   f"layer FFNs use {names}: neurons are rarely exactly zero, so a predictor has nothing to predict")
        elif mode == "predictor" and not predictable:
            ffn = next(n for n in pir.nodes_in_domain(model, "FFN") if pir.attr(n, "activation") not in PREDICTABLE)
            raise UserError(f"--sparsity-mode predictor needs ReLU FFNs, but layer {pir.attr(ffn, 'layer')}'s FFN uses "
                            f"{SPELLING.get(pir.attr(ffn, 'activation'), pir.attr(ffn, 'activation'))} (its output "
                            f"{ffn.metadata_props.get('source.activation', ffn.name)}), which is rarely exactly zero, "
                            "so every neuron would be predicted active: use --sparsity-mode threshold, or --dense")
        else:
            why = "asked for with --sparsity-mode"
        if mode == "predictor" and options.sparsity is not None:
            raise UserError("--sparsity sets the share of inputs threshold mode drops; predictor mode's sparsity "
                            f"comes from the model ({why}): drop --sparsity, or add --sparsity-mode threshold")
        if mode == "threshold" and ctx.target.has_gpu:
            raise UserError(f"threshold sparsity runs on the CPU only (no GPU kernels for it yet), and target "
                            f"{ctx.target.name} has a GPU: build with --target cpu, or --dense")
        sparsity = None
        if mode == "threshold":
            sparsity = DEFAULT_SPARSITY if options.sparsity is None else float(options.sparsity)
        ctx.sparsity = {"mode": mode, "sparsity": sparsity, "reason": why}
        model.metadata_props["picompile.sparsity"] = json.dumps(ctx.sparsity)
        ctx.log(f"sparsity: {describe(ctx.sparsity)}")
        return PassResult(model, modified=True)


def describe(sparsity: dict) -> str:
    """One line: the mode, its sparsity (threshold mode) and why (what `build` prints)."""
    level = f" at {sparsity['sparsity']:.2f}" if sparsity.get("sparsity") is not None else ""
    return f"{sparsity['mode']} mode{level} ({sparsity['reason']})"
