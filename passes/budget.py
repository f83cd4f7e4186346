"""The quality a build may give up for speed (--max-quality-loss): the user's choice, parsed once."""

from __future__ import annotations

from runtime.manifest import QualityBudget

from .errors import UserError

KINDS = ("ppl", "kl")


def parse_budget(text: str) -> QualityBudget:
    """'1%' or '0.01' (perplexity +1%), 'kl=0.01' (mean KL per token); one `error:` line otherwise. (The budget's
    type is the manifest's, which carries it: runtime.manifest.QualityBudget.)"""
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
    return QualityBudget(kind, value)


DEFAULT_BUDGET = QualityBudget()  # perplexity within 1% of the source model's
