"""What the quality pass reads from logits, gathered a vocabulary slice at a time.

A [tokens, vocabulary] array of logits is the largest thing the quality pass would otherwise hold: 2,108 held-out
positions of Qwen2.5's 151,936-token vocabulary are 1.3 GB in float32 and twice that as the float64 log-probabilities
the measures are taken in. The output layer's columns are read a slice at a time instead
(`Interpreter.head_slices`), and each slice folds into a `Logits` summary: per row the log-normalizer (float64,
an online log-sum-exp), the argmax, and the logits at chosen columns (a target token, a reference's top tokens);
optionally the row's own top `k` logits (a reference's). A row's log-probability of column j is then its logit
minus the log-normalizer, exactly as a whole-vocabulary log-softmax in float64 gives it.
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
    (`log_normalizer`), the argmax (`argmax`), the logits at the columns `at` [rows, m] (`at_values`), and with
    `top` the row's `top` largest logits and their columns (`top_values`, `top_columns`, descending)."""

    def __init__(self, rows: int, at: torch.Tensor | None = None, top: int = 0):
        self._max = torch.full((rows,), -torch.inf, dtype=torch.float64)
        self._sum = torch.zeros(rows, dtype=torch.float64)
        self.argmax = torch.zeros(rows, dtype=torch.int64)
        self._argmax_value = torch.full((rows,), -torch.inf)
        self.at = at
        self.at_values = None if at is None else torch.zeros(at.shape, dtype=torch.float64)
        self.top = top
        self.top_values = torch.empty(rows, 0)
        self.top_columns = torch.empty(rows, 0, dtype=torch.int64)

    def add(self, first: int, logits: torch.Tensor) -> None:
        """Fold in the slice `logits` [rows, width] of columns first..first + width."""
        width = logits.shape[1]
        wide = logits.to(torch.float64)
        slice_max = wide.amax(1)
        new_max = torch.maximum(self._max, slice_max)
        self._sum = self._sum * torch.exp(self._max - new_max) + torch.exp(wide - new_max[:, None]).sum(1)
        self._max = new_max
        value, column = logits.max(1)
        better = value > self._argmax_value
        self.argmax = torch.where(better, column + first, self.argmax)
        self._argmax_value = torch.where(better, value, self._argmax_value)
        if self.at is not None:
            inside = (self.at >= first) & (self.at < first + width)
            picked = wide.gather(1, (self.at - first).clamp(0, width - 1))
            self.at_values = torch.where(inside, picked, self.at_values)
        if self.top:
            values = torch.cat([self.top_values, logits], 1)
            columns = torch.cat([self.top_columns, torch.arange(first, first + width).expand(logits.shape[0], -1)], 1)
            self.top_values, order = values.topk(min(self.top, values.shape[1]), dim=1)
            self.top_columns = columns.gather(1, order)

    @property
    def log_normalizer(self) -> torch.Tensor:
        return self._max + torch.log(self._sum)

    @classmethod
    def of(cls, slices: Iterable[tuple[int, torch.Tensor]], rows: int, at: torch.Tensor | None = None,
           top: int = 0) -> "Logits":
        summary = cls(rows, at, top)
        for first, logits in slices:
            summary.add(first, logits)
        return summary
