"""The quality a build may give up for speed (--max-quality-loss): the user's choice, parsed once."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError

KINDS = ("ppl", "kl")


@dataclass(frozen=True)
class QualityBudget:
    """`kind` "ppl": perplexity on held-out calibration tokens at most (1 + value) times the source model's;
    "kl": the mean KL divergence per token from the source model's next-token distribution at most `value`."""

    kind: str = "ppl"
    value: float = 0.01

    @classmethod
    def parse(cls, text: str) -> "QualityBudget":
        """'1%' or '0.01' (perplexity +1%), 'kl=0.01' (mean KL per token); one `error:` line otherwise."""
        spelled = text.strip().lower()
        kind, _, number = spelled.rpartition("=") if "=" in spelled else ("ppl", "", spelled)
        percent = number.endswith("%")
        try:
            value = float(number[:-1] if percent else number) / (100 if percent else 1)
        except ValueError:
            value = float("nan")
        if kind not in KINDS or not value >= 0 or (kind == "kl" and percent) or value == float("inf"):
            raise UserError(f"--max-quality-loss must be a perplexity increase like 1% (or 0.01) or a mean KL per "
                            f"token like kl=0.01, got {text!r}")
        return cls(kind, value)

    def met_by(self, ppl_change: float, kl: float) -> bool:
        return (ppl_change if self.kind == "ppl" else kl) <= self.value

    def describe(self) -> str:
        return f"ppl +{self.value * 100:g}%" if self.kind == "ppl" else f"KL {self.value:g}"


DEFAULT_BUDGET = QualityBudget()  # perplexity within 1% of the source model's
