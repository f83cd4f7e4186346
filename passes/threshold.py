"""threshold: calibrate TEAL-style magnitude thresholds on the inputs of each FFN's projections.

Runs in threshold mode. Reads: the sparsity s the sparsity pass recorded on the IR (`sparsity_of`), the
profiled FFN inputs (`ProfiledActivations`: per layer [tokens, d_model], the normed x the gate and up
projections read) and the `picompile.FFN` nodes' weights (w_up [D, F] or [D, 2F] gate then up, b_up),
`activation` and `gated`. It has no fields: s is recorded once, on the IR, by the sparsity pass.
Adds, per FFN node, float attributes `threshold_in` (t_in: decode keeps input channel j of gate/up iff
|x_j| > t_in) and `threshold_down` (t_down: keeps hidden neuron i, the input of down, iff |h_i| > t_down),
and `sparsity_in` / `sparsity_down`, the shares of inputs each drops on held-out profiled tokens.

As in TEAL (Liu et al. 2024, "Training-Free Activation Sparsity in Large Language Models"), a threshold is
the s-quantile of the magnitudes of the tensor it gates, so that a share s of its entries is dropped; one
scalar per projection input, the same s for every layer. t_in comes from the profiled x; t_down from the h
that decode will see, h = act(gate) * up computed from x already thresholded by t_in (so the down projection
drops s of what actually reaches it, not of a dense h it never gets). Thresholds are fitted on the first
(1 - HOLDOUT) of the profiled tokens; the rest measure the sparsity reached. At s = 0 both thresholds
admit everything (the thresholded FFN is then exactly the dense one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes import PassResult

from . import ir as pir
from .activations import ACTIVATIONS
from .pipeline import Context

from .predict import HOLDOUT, _training_tokens  # the predictors' split of the profiled tokens
from .profile import ProfiledActivations
from .sparsity_mode import sparsity_of

from .ops import FFN, KEEP_ALL  # KEEP_ALL: a threshold every magnitude passes (|v| > -1)
from .profile import PROFILED_ACTIVATIONS
from .sparsity_mode import SPARSITY_MODE


def magnitude_threshold(values: np.ndarray, sparsity: float) -> float:
    """The s-quantile of |values|: dropping the entries with |v| <= t drops a share `sparsity` of them."""
    if sparsity <= 0.0:
        return KEEP_ALL
    return float(np.quantile(np.abs(values), sparsity).astype(np.float32))


def dropped_share(values: np.ndarray, threshold: float) -> float:
    return float(np.mean(np.abs(values) <= threshold))


def hidden_of(x: np.ndarray, w_up: np.ndarray, b_up: np.ndarray | None, activation: str, gated: bool) -> np.ndarray:
    """The FFN's hidden values, the input of down: act(x @ W_gate) * (x @ W_up) when gated, else act(x @ W_up)."""
    tensor = lambda a: torch.from_numpy(np.array(a, np.float32))  # noqa: E731  (a writable copy for torch)
    with torch.no_grad():
        pre = tensor(x) @ tensor(w_up)
        if b_up is not None:
            pre += tensor(b_up)
        act = ACTIVATIONS[activation].torch()
        if gated:
            half = pre.shape[1] // 2
            return (act(pre[:, :half]) * pre[:, half:]).numpy()
        return act(pre).numpy()


@dataclass
class Calibration:
    threshold_in: float
    threshold_down: float
    sparsity_in: float  # measured on held-out tokens
    sparsity_down: float


def calibrate(x: np.ndarray, w_up: np.ndarray, b_up: np.ndarray | None, activation: str, gated: bool,
              sparsity: float, holdout: float = HOLDOUT) -> Calibration:
    """One layer's two thresholds, fitted on the first tokens of `x` and measured on the last `holdout` of them."""
    fit = _training_tokens(len(x), holdout)
    t_in = magnitude_threshold(x[:fit], sparsity)
    kept = np.where(np.abs(x) > t_in, x, np.float32(0))
    h = hidden_of(kept, w_up, b_up, activation, gated)
    t_down = magnitude_threshold(h[:fit], sparsity)
    return Calibration(t_in, t_down, dropped_share(x[fit:], t_in), dropped_share(h[fit:], t_down))


@dataclass
class Threshold:
    name = "threshold"
    requires = (SPARSITY_MODE, PROFILED_ACTIVATIONS)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        sparsity = float(sparsity_of(model).sparsity)
        profiled = ProfiledActivations.of(model)
        found = []
        for node in sorted(FFN.nodes(model), key=lambda n: FFN(n).layer):
            ffn = FFN(node)
            layer = ffn.layer
            x = np.asarray(profiled.layer(layer).inputs, np.float32)  # a memory map: one layer in memory at a time
            w_up = np.asarray(pir.const_array(node.inputs[1]), np.float32)  # (a half model's, widened per layer)
            c = calibrate(x, w_up, pir.const_array(node.inputs[2]),
                          ffn.activation, bool(ffn.gated), sparsity)
            for key in ("threshold_in", "threshold_down", "sparsity_in", "sparsity_down"):
                ffn.set(key, getattr(c, key))
            found.append(c)
        ctx.log(f"threshold: {len(found)} layers at sparsity {sparsity:.2f}; held-out sparsity of the gate/up "
                f"inputs {np.mean([c.sparsity_in for c in found]):.3f}, of the down inputs "
                f"{np.mean([c.sparsity_down for c in found]):.3f}")
        return PassResult(model, modified=True)
