"""The FFN activations picompile computes, declared once.

Each is named on the block IR (`picompile.FFN`'s `activation`, checked against this table after every pass),
spelled for people in messages, known to output exact zeros or not (what decides predictor against threshold
sparsity), and has a torch reference: the interpreter's and the threshold calibration's arithmetic, and what
recognise compares a decomposed activation with. The kernels' TIR form of each is
`passes.kernels.compute.activation`'s (its device math differs per target); where an exported graph spells
an activation is recognise's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable


@dataclass(frozen=True)
class Activation:
    name: str  # on the block IR and in kernel names
    spelling: str  # in messages and reports
    exact_zeros: bool  # most neurons output exactly 0 (ReLU): a predictor can learn which
    function: str  # torch.nn.functional's
    options: tuple[tuple[str, str], ...] = ()  # its keyword arguments

    def torch(self) -> Callable:
        """The activation as a function of a torch tensor (any float dtype)."""
        import torch.nn.functional  # here, not above: the IR's declarations (passes.ops) read this table without torch

        function = getattr(torch.nn.functional, self.function)
        return partial(function, **dict(self.options)) if self.options else function


ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation("relu", "ReLU", True, "relu"),
    Activation("gelu", "GELU", False, "gelu"),  # exact: 0.5 x (1 + erf(x / sqrt 2)), torch's default
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GPT-2's gelu_new, Gemma's gelu_pytorch_tanh; it differs
    # from the exact GELU by up to 5e-4 (at |x| = 2.7), so the two are never interchanged
    Activation("gelu_tanh", "GELU (tanh)", False, "gelu", (("approximate", "tanh"),)),
    Activation("silu", "SiLU", False, "silu"),
)}


def spelling(name: str) -> str:
    """How people read an activation's name (an unknown one as it is)."""
    found = ACTIVATIONS.get(name)
    return name if found is None else found.spelling
