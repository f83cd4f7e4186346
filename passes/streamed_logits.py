"""What the quality pass reads from logits, gathered a vocabulary slice at a time.

A [tokens, vocabulary] array of logits is the largest thing the quality pass would otherwise hold: 2,108 held-out
positions of Qwen2.5's 151,936-token vocabulary are 1.3 GB in float32 and twice that as the float64 log-probabilities
the measures are taken in. The output layer's columns are read a slice at a time instead
(`Interpreter.head_columns`), and each slice folds into a `Logits` summary: per row the log-normalizer (float64,
an online log-sum-exp), the argmax, the logits at chosen columns (a target token), and, given a reference's
logits of the same slice and its log-normalizer, the KL from the reference's distribution. A row's
log-probability of column j is its logit minus the log-normalizer, exactly as a whole-vocabulary log-softmax in
float64 gives it; the KL is sum p (l - m) - log Z_p + log Z_q over the slices (l, m: the reference's and the
row's logits), the whole vocabulary's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

SLICE_ELEMENTS = 8 << 20  # logits of one slice (rows x columns): 32 MiB of float32, twice that while in float64


def slice_width(rows: int, vocabulary: int) -> int:
    """Columns per slice for `rows` rows: SLICE_ELEMENTS at most (at least 256 columns)."""
    return max(256, min(vocabulary, SLICE_ELEMENTS // max(rows, 1)))


class Logits:
    """Per row of a [rows, vocabulary] logits array seen a slice at a time (`add`): the log-normalizer
    (`log_normalizer`), the argmax (`argmax`), the logits at the columns `at` [rows, m] (`at_values`), and with a
    reference's log-normalizer (`reference`, [rows]; its logits given with each slice) the KL from the
    reference's distribution to this one (`kl_from_reference`)."""

    def __init__(self, rows: int, at: torch.Tensor | None = None, reference: torch.Tensor | None = None):
        self._max = torch.full((rows,), -torch.inf, dtype=torch.float64)
        self._sum = torch.zeros(rows, dtype=torch.float64)
        self.argmax = torch.zeros(rows, dtype=torch.int64)
        self._argmax_value = torch.full((rows,), -torch.inf)
        self.at = at
        self.at_values = None if at is None else torch.zeros(at.shape, dtype=torch.float64)
        self.reference = reference
        self._cross = torch.zeros(rows, dtype=torch.float64)  # sum p (l - m) so far

    def add(self, first: int, logits: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        """Fold in the slice `logits` [rows, width] of columns first..first + width (and the reference's, where
        there is one)."""
        width = logits.shape[1]
        wide = logits.to(torch.float64)
        value, column = logits.max(1)
        new_max = torch.maximum(self._max, value.to(torch.float64))
        self._sum = self._sum * torch.exp(self._max - new_max) + (wide - new_max[:, None]).exp_().sum(1)
        self._max = new_max
        better = value > self._argmax_value
        self.argmax = torch.where(better, column + first, self.argmax)
        self._argmax_value = torch.where(better, value, self._argmax_value)
        if self.at is not None:
            inside = (self.at >= first) & (self.at < first + width)
            picked = wide.gather(1, (self.at - first).clamp(0, width - 1))
            self.at_values = torch.where(inside, picked, self.at_values)
        if self.reference is not None:
            l = reference.to(torch.float64, copy=True)  # noqa: E741  (changed in place below)
            p = (l - self.reference[:, None]).exp_()
            self._cross += (p.mul_(l.sub_(wide))).sum(1)

    @property
    def log_normalizer(self) -> torch.Tensor:
        return self._max + torch.log(self._sum)

    @property
    def kl_from_reference(self) -> torch.Tensor:
        """Per row, KL(reference || these logits' distribution) over the whole vocabulary."""
        return self._cross - self.reference + self.log_normalizer

    @classmethod
    def of(cls, slices: Iterable[tuple], rows: int, at: torch.Tensor | None = None,
           reference: torch.Tensor | None = None) -> "Logits":
        """The summary of `slices`: (first column, logits) or, with `reference`, (first, logits, its logits)."""
        summary = cls(rows, at, reference)
        for piece in slices:
            summary.add(*piece)
        return summary
