"""The quality a build may give up for speed (--max-quality-loss): the user's choice, parsed once; and the
perplexity change it is judged by, with its interval (the quality pass's and eval's one statistic)."""

from __future__ import annotations

import numpy as np

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

PROMPT_TOKENS = 4  # eval's prompt (one prefill, then one-token decode steps); the quality pass measures so too


def scored_positions(length: int) -> slice:
    """The positions of a `length`-token sequence whose logits quality is judged on (eval's and the quality
    pass's): from the prompt's last, the first whose logits generation reads, to the last with a next token
    (position i predicts token i + 1). The prompt's earlier logits are never read when generating, and a window
    that starts mid-text has next to no context there: on SmolLM2 one held-out window's second position gave KL
    0.015 or 10 by which matrices' inputs were rounded to int8 (its float64 and float32 logits agree), a coin
    toss that carried most of a 1,100-token measure. A sequence too short for that scores its last position."""
    start = min(PROMPT_TOKENS - 1, max(length - 2, 0))
    return slice(start, max(length - 1, start))


def predicted_tokens(scored: slice) -> slice:
    """The tokens the `scored` positions predict: position i predicts token i + 1."""
    return slice(scored.start + 1, scored.stop + 1)

# Student's t at 97.5% by degrees of freedom (a few sequences: a normal 1.96 would cover ~92% with 8), and
# 1.96 from 60 on
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 20: 2.09, 30: 2.04, 60: 1.96}


def _t_975(freedom: int) -> float:
    return T_975[max(k for k in T_975 if k <= freedom)]


def ppl_change_interval(nll_got: np.ndarray, nll_reference: np.ndarray,
                        tokens: np.ndarray) -> tuple[float, float, float]:
    """The perplexity change (ppl ratio - 1) over sequences whose summed negative log-likelihoods (a plan's,
    the reference's) and predicted tokens are given, and its 95% interval. A ppl change of a few percent on a
    thousand tokens is mostly which tokens they were; the interval says how much: the mean log-likelihood change
    per token, its standard error taken over whole sequences (tokens of one sequence are not independent; a ratio
    estimator's clustered error) times Student's t, mapped through exp. One sequence has no spread: its interval
    is the point."""
    got, ref, counts = (np.asarray(a, np.float64) for a in (nll_got, nll_reference, tokens))
    total = max(float(counts.sum()), 1.0)
    mean = float((got - ref).sum()) / total
    n = len(counts)
    spread = 0.0
    if n > 1:
        residual = (got - ref) - mean * counts
        spread = _t_975(n - 1) * float(np.sqrt(n / (n - 1) * (residual ** 2).sum())) / total
    return float(np.expm1(mean)), float(np.expm1(mean - spread)), float(np.expm1(mean + spread))
