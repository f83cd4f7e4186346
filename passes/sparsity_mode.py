"""sparsity: decide how decode skips FFN work, predictor (PowerInfer) or threshold (TEAL).

Reads: the `picompile.FFN` nodes' `activation` attribute, its fields `requested` (--sparsity-mode: "auto",
"predictor", "threshold") and `sparsity` (--sparsity), and whether the target has a GPU. Adds: a `Sparsity`
(mode, sparsity, reason) as JSON in the graph's `metadata_props["picompile.sparsity"]`, a fact about the
model: `picompile.compiler` reads the mode there (`sparsity_of`) to choose the passes that follow, the
threshold pass its sparsity, and the artifact's manifest carries it (`build` prints the reason).

The rule of "auto": a ReLU FFN outputs exact zeros for most neurons, so a predictor can skip whole neurons
(predictor mode). A SiLU or GELU FFN almost never does, so there is nothing to predict; instead the inputs of
each projection whose magnitude is below a calibrated threshold are dropped (threshold mode: a level per linear
input within the quality budget, passes.quality, unless `--sparsity` fixes one for every FFN input). Asking for predictor mode on such a model is refused:
its predictors would let every neuron through.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import PassResult

from .activations import ACTIVATIONS, spelling
from .facts import read_entry, write_entry
from .ops import FFN
from .pipeline import Fact
from .recognise import BLOCKS
from .errors import UserError
from .pipeline import Context, Options
from runtime.manifest import Sparsity

MODES = ("auto", "predictor", "threshold")
KEY = "picompile.sparsity"  # the metadata_props entry
SPARSITY_MODE = Fact("the sparsity mode", "sparsity", lambda model: KEY in model.metadata_props)


def attach(model: ir.Model, sparsity: Sparsity) -> None:
    write_entry(model, KEY, sparsity)


def sparsity_of(model: ir.Model) -> Sparsity:
    """The mode the sparsity pass decided (the type is the manifest's: runtime.manifest.Sparsity)."""
    found = read_entry(model, KEY, Sparsity)
    if found is None:
        raise ValueError("the IR has no sparsity mode (run the sparsity pass first)")
    return found


@dataclass
class SparsityMode:
    name = "sparsity"
    requires = (BLOCKS,)
    adds = (SPARSITY_MODE,)
    requested: str = Options.sparsity_mode  # "auto", "predictor" or "threshold"
    sparsity: float | None = Options.sparsity  # threshold mode's share dropped (None: per input, passes.quality)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        if self.requested not in MODES:
            raise UserError(f"--sparsity-mode must be one of {', '.join(MODES)}, got {self.requested!r}")
        if self.sparsity is not None and not 0.0 <= self.sparsity < 1.0:
            raise UserError(f"--sparsity must be in [0, 1), got {self.sparsity}")
        activations = sorted({FFN(n).activation for n in FFN.nodes(model)})
        names = "/".join(spelling(a) for a in activations)
        predictable = all(ACTIVATIONS[a].exact_zeros for a in activations)
        mode = self.requested
        if mode == "auto":
            mode = "predictor" if predictable else "threshold"
            why = (f"layer FFNs use {names}: most neurons output exactly zero, so a predictor can skip them"
                   if predictable else
                   f"layer FFNs use {names}: neurons are rarely exactly zero, so a predictor has nothing to predict")
        elif mode == "predictor" and not predictable:
            ffn = next(FFN(n) for n in FFN.nodes(model) if not ACTIVATIONS[FFN(n).activation].exact_zeros)
            raise UserError(f"--sparsity-mode predictor needs ReLU FFNs, but layer {ffn.layer}'s FFN uses "
                            f"{spelling(ffn.activation)} (its output "
                            f"{ffn.node.metadata_props.get('source.activation', ffn.node.name)}), which is rarely exactly zero, "
                            "so every neuron would be predicted active: use --sparsity-mode threshold, or --dense")
        else:
            why = "asked for with --sparsity-mode"
        if mode == "predictor" and self.sparsity is not None:
            raise UserError("--sparsity sets the share of inputs threshold mode drops; predictor mode's sparsity "
                            f"comes from the model ({why}): drop --sparsity, or add --sparsity-mode threshold")
        if mode == "threshold" and ctx.target.has_gpu:
            raise UserError(f"threshold sparsity runs on the CPU only (no GPU kernels for it yet), and target "
                            f"{ctx.target.name} has a GPU: build with --target cpu, or --dense")
        sparsity = None if self.sparsity is None else float(self.sparsity)
        decided = Sparsity(mode, sparsity, why)
        attach(model, decided)
        ctx.log(f"sparsity: {decided.describe()}")
        return PassResult(model, modified=True)
