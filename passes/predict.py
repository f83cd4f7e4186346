"""predict: train one activation predictor per FFN layer (PowerInfer's adaptive predictors).

Runs in predictor mode. Reads: the profiled activations (`ProfiledActivations`: per layer the FFN inputs
[tokens, d_model] float32 after the FFN's norm and the active neurons [tokens, ffn] bool; tokens
sequence-major), written by the profile pass as memory-mapped files, each layer read (its activity unpacked)
only while it is priced or trained; the `picompile.FFN` nodes (int attributes `layer` and
`gated`; the up (gate) weight and bias: the pre-activations the predictors are fitted to, and the weight
that gives the fit's cross-covariance exactly, so a profile of fewer tokens than d_model still finds the
right subspace); the model's parameter count (`sizes.parameter_count`); its fields `target_recall`, `param_share`,
`seed`; the build's weight format and instruction set (`ctx.build`).
Adds: per FFN layer i the initializers `layers.{i}.ffn.predictor.w1` [d_model, r] and
`layers.{i}.ffn.predictor.w2` [r, ffn] (float32 holding the values `sizes.PREDICTOR_FORMAT` stores, which
the quantize pass then blocks; neuron j is predicted active for input x iff
(relu(x @ w1) @ w2)[j] > threshold) and, on the FFN node, `predictor_rank` (int), `predictor_threshold`,
`predictor_recall`, `predictor_precision` and `predictor_active` (floats: recall, precision and mean
fraction of neurons predicted active on held-out profiled tokens; the last is what a decode step pays
for). Each layer's rank r is the one whose decode step reads the fewest weight bytes, the predictor's
r * (d_model + ffn) weights (int8 blocks) plus the up (gate) and down rows of the neurons it predicts active at the
CPU's storage type (`step_reads`: fp16 rows under `--weight-dtype fp16` make a predictor relatively
dearer), as estimated before training by the least-squares probe training starts from (`price_ranks`);
all predictors together stay within `param_share` of the model's parameters (`choose_ranks`). Training
refines that probe with BCE and keeps whichever of the start and its checkpoints predicts fewest neurons on
the held-out tokens. Measured and not kept (benchmarks/bench_predictors.py): per-neuron thresholds (they
overfit the held-out tokens: recall 0.93-0.97 on new ones), always computing the hottest 5-20% (more
predicted active than thresholding them), weighting the subspace fit by neuron.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes import PassResult

from . import ir as pir
from .ops import FFN
from .pipeline import Context, Fact, Options
from .sizes import PREDICTOR_FORMAT, float_format, parameter_count, stored_predictor_format
from runtime.dtypes import WEIGHT_FORMATS, WeightFormat

from .kernels import quant
from .profile import PROFILED_ACTIVATIONS, ProfiledActivations

__all__ = ["Predictor", "Predict", "candidate_ranks", "step_reads", "predictor_step_reads", "price_ranks",
           "choose_ranks", "probe_active", "train_predictor", "predict_active"]

STEPS = 800  # Adam updates a predictor gets by default (about 60 epochs of 4096 profiled tokens) ...
TRAIN_FLOPS = 1e12  # ... unless they would cost more than this (large layers start close to done anyway)
MIN_EPOCHS = 3
REL_LR = 0.03  # Adam step size relative to each weight matrix's initial RMS, at a fan-in of REF_FAN_IN
REF_FAN_IN = 64
HOLDOUT = 0.2  # share of the profiled tokens (the last ones) kept out of fitting, to set thresholds on
INIT_LOGIT_SCALE = 4.0  # the +-1 least-squares start, scaled towards logits
PROBIT_TO_LOGIT = 1.7  # Phi(z) ~ sigmoid(1.7 z)
# Ridge of the probe's w2 fit, relative to the mean diagonal of E[h h^T]: that mean is mostly the units'
# constant parts (they keep x . w1_k > 0), so 1e-3 of it over-shrank the varying part; 1e-5 predicted
# 1-4% fewer neurons on every measured layer (benchmarks/bench_predictors.py).
W2_RIDGE = 1e-5
CHECKPOINTS = 8  # points of training (and the start) the kept predictor is chosen from, on held-out tokens


# ---------------------------------------------------------------- rank choice


def candidate_ranks(limit: int) -> list[int]:
    """The predictor ranks worth pricing, up to `limit` (8 at least): steps of 8 to 64, then four per
    octave (80, 96, 112, 128, 160, ...), fine enough that the cheapest is within a few % of the best rank."""
    ranks, rank = [], 8
    while rank <= max(limit, 8):
        ranks.append(rank)
        rank += max(8, (1 << (rank.bit_length() - 1)) // 4)
    return ranks


def step_reads(rank: int, active_share: float, d_model: int, ffn: int, gated: bool,
               row_bytes: float = 4.0, predictor_bytes: float = 4.0, w2_bytes: float | None = None) -> float:
    """Weight bytes one FFN layer reads in a one-token decode step: the whole predictor (w1 [d_model, rank],
    w2 [rank, ffn]; `w2_bytes` where w2 is stored otherwise than w1) and the up (gate) and down rows of the
    neurons it predicts active, each at its bytes per weight as stored (`WeightFormat.bytes_per_weight`;
    `sizes.PREDICTOR_FORMAT`). Decode is memory-bound, so this is its cost."""
    w2 = predictor_bytes if w2_bytes is None else w2_bytes
    return (rank * (d_model * predictor_bytes + ffn * w2)
            + active_share * ffn * d_model * (3 if gated else 2) * row_bytes)


def predictor_step_reads(rank: int, active_share: float, d_model: int, ffn: int, gated: bool, row_bytes: float,
                         predictor: WeightFormat) -> float:
    """`step_reads` of a predictor stored as `predictor` (`sizes.PREDICTOR_FORMAT`), each matrix as the quantize
    pass keeps it (`sizes.stored_predictor_format`: a rank of part of a block keeps w2 in floats)."""
    w1, w2 = (stored_predictor_format(shape, predictor).bytes_per_weight for shape in ((d_model, rank), (rank, ffn)))
    return step_reads(rank, active_share, d_model, ffn, gated, row_bytes, w1, w2)


def price_ranks(inputs: np.ndarray, active: np.ndarray, limit: int, gated: bool, *, target_recall: float,
                pre_activations: np.ndarray | None = None, row_bytes: float = 4.0,
                predictor: WeightFormat = WEIGHT_FORMATS["fp32"], up_weight: np.ndarray | None = None,
                w2_ridge: float = W2_RIDGE) -> dict[int, tuple[float, float]]:
    """rank -> (estimated predicted-active share, `predictor_step_reads`) of one layer's predictor, stored as
    `predictor`, for the `candidate_ranks` up to `limit`, the share from `probe_active`. Pricing stops before
    the first rank that cannot beat the cheapest so far even if it predicted no more neurons than
    `target_recall` of the held-out tokens' active ones (which every predictor must)."""
    d_model, ffn = inputs.shape[1], active.shape[1]
    ranks = candidate_ranks(limit)
    least_share = target_recall * float(np.mean(active[_training_tokens(len(active), HOLDOUT):]))

    def reads(rank: int, share: float) -> float:
        return predictor_step_reads(rank, share, d_model, ffn, gated, row_bytes, predictor)

    priced: dict[int, tuple[float, float]] = {}
    for rank, share in probe_active(inputs, active, ranks, target_recall=target_recall,
                                    pre_activations=pre_activations, up_weight=up_weight, w2_ridge=w2_ridge):
        priced[rank] = (share, reads(rank, share))
        best = min(cost for _, cost in priced.values())
        # a larger rank can cost less (w2 whole blocks again): stop where none can
        if all(reads(r, least_share) >= best for r in ranks if r > rank):
            break
    return priced


def choose_ranks(reads: list[dict[int, float]], widths: list[int], budget: int) -> list[int]:
    """The rank of each layer that keeps the summed decode-step reads least, within
    sum_l r_l * widths_l <= budget (widths_l = d_model + ffn_l, a predictor's parameters per rank).

    reads[l] maps layer l's candidate ranks to its estimated step reads. Every layer starts at its
    cheapest rank (the smaller on ties); while the predictors are over the budget, the layer whose next
    smaller candidate adds the fewest reads per parameter it frees (the lower layer on ties) steps down
    to it. When no layer can step down the ranks stay over the budget (the caller reports it). Greedy:
    exact where each layer's reads fall ever less steeply with rank, which is how they fall."""
    if len(reads) != len(widths):
        raise ValueError("reads and widths need one entry per layer")
    ranks = [min(costs, key=lambda r: (costs[r], r)) for costs in reads]
    while sum(r * w for r, w in zip(ranks, widths)) > budget:
        steps = []
        for i, (costs, width) in enumerate(zip(reads, widths)):
            smaller = [r for r in costs if r < ranks[i]]
            if smaller:
                down = max(smaller)
                steps.append(((costs[down] - costs[ranks[i]]) / ((ranks[i] - down) * width), i, down))
        if not steps:
            break
        _, i, down = min(steps)
        ranks[i] = down
    return ranks


# ---------------------------------------------------------------- training


@dataclass
class Predictor:
    w1: np.ndarray  # [d_model, r] float32 (fp16 once trained for an fp16 build)  (h = relu(x @ w1))
    w2: np.ndarray  # [r, ffn] float32      (logits = h @ w2; neuron j predicted active iff logits[j] > threshold)
    threshold: float
    recall: float  # on held-out profiled tokens: predicted-active among truly active
    precision: float  # truly active among predicted-active
    predicted_active: float  # mean fraction of neurons predicted active (what decode pays for)
    train_seconds: float = 0.0

    @property
    def rank(self) -> int:
        return int(self.w1.shape[1])

    def logits(self, inputs: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(inputs, np.float32) @ self.w1, 0) @ self.w2

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        return self.logits(inputs) > self.threshold


def predict_active(predictor: Predictor, inputs: np.ndarray, active: np.ndarray) -> dict:
    """Recall, precision and predicted-active fraction of `predictor` (at its stored threshold) on other tokens."""
    return _scores(predictor.predict(inputs), np.asarray(active, bool))


def _scores(predicted: np.ndarray, active: np.ndarray) -> dict:
    hits = float(np.logical_and(predicted, active).sum())
    n_active, n_predicted = float(active.sum()), float(predicted.sum())
    return dict(recall=hits / n_active if n_active else 1.0,
                precision=hits / n_predicted if n_predicted else 1.0,
                predicted_active=n_predicted / predicted.size if predicted.size else 0.0)


def _training_tokens(count: int, holdout: float) -> int:
    """How many of `count` profiled tokens are fitted on; the rest (at least one each) are held out."""
    return count - min(max(1, int(round(holdout * count))), count - 1)


def _threshold_for_recall(logits: np.ndarray, active: np.ndarray, target_recall: float) -> float:
    """The largest float32 t with mean(logits[active] > t) >= target_recall."""
    positives = np.sort(logits[active].astype(np.float32))
    if positives.size == 0:
        return float(np.finfo(np.float32).max)
    misses = positives.size - int(math.ceil(target_recall * positives.size - 1e-9))
    misses = min(max(misses, 0), positives.size - 1)
    return float(np.nextafter(positives[misses], np.float32(-np.inf)))


def _offset_channel(x: np.ndarray) -> np.ndarray | None:
    """A unit direction along which every token has a clearly positive coordinate (the mean of a LayerNorm
    bias, LLaMA's constant channel, massive activations), else None: a bias-free predictor gets its
    per-neuron offsets from it."""
    mean = x.mean(0, dtype=np.float64)
    norm = float(np.linalg.norm(mean))
    if norm == 0.0:
        return None
    direction = mean / norm
    s = x.astype(np.float64) @ direction
    return direction if s.min() > 0 and s.mean() > 3 * s.std() else None


def _targets(active: np.ndarray, pre: np.ndarray | None) -> torch.Tensor:
    """What the probe fits: the pre-activations (neuron j fires iff pre_j > 0), else +-1 for active / inactive."""
    if pre is not None:
        return torch.from_numpy(np.ascontiguousarray(pre, np.float32))
    return torch.from_numpy(np.where(active, np.float32(1), np.float32(-1)))


def _usable_up(up: np.ndarray | None, pre: np.ndarray | None) -> np.ndarray | None:
    """The up weight where the probe can use it: it stands for the pre-activations, so only with them."""
    return None if up is None or pre is None else up


def _shrinkage(xc: torch.Tensor, cov: torch.Tensor) -> float:
    """Ledoit-Wolf's weight on mu I (mu = mean variance) in the covariance estimate (1 - a) cov + a mu I of
    the centred inputs xc [n, d]: near 1 where n is small against d, near 0 where it is large."""
    n, d = xc.shape
    mu = float(cov.diagonal().mean())
    spread = float(((cov - mu * torch.eye(d, dtype=cov.dtype)) ** 2).sum()) / d
    # (1/n^2) sum_k ||x_k x_k^T - S||_F^2 / d, from sum_k |x_k|^4 - n ||S||_F^2
    noise = (float((xc * xc).sum(1).pow(2).sum()) - n * float((cov * cov).sum())) / (n * n * d)
    return 0.0 if spread <= 0 else min(max(noise, 0.0), spread) / spread


def _probe_directions(x: np.ndarray, t: torch.Tensor, ridge: float, weights: torch.Tensor | None = None,
                      up: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The least-squares probe's input directions [d, d] (float64), most predictive first, and the inputs'
    offset channel (`_offset_channel`) or None.

    Reduced-rank regression of the targets `t` (each neuron scaled to unit variance) on the centred
    inputs: the top generalised eigenvectors u_k of C C^T against the input covariance G (C = cov(x, t)),
    scaled so that x . u_k has unit variance. With `up` [d, ffn] (t = x @ up + b exactly) G is the
    Ledoit-Wolf shrunk estimate and C = G up: the weights give the cross-covariance exactly, and the
    shrunk G credits the input directions the few profiled tokens leave unexplored."""
    n, d = x.shape
    xc = torch.from_numpy(x).double()
    xc -= xc.mean(0)
    cov = xc.T @ xc / n
    if up is not None:
        a = _shrinkage(xc, cov)
        cov = (1 - a) * cov + a * cov.diagonal().mean() * torch.eye(d, dtype=torch.float64)
    cov += (ridge * cov.diagonal().mean().clamp_min(1e-12)) * torch.eye(d, dtype=torch.float64)
    chol = torch.linalg.cholesky(cov)  # G = L L^T: L^-1 whitens (as G^-1/2 does, up to a rotation; cheaper)
    if up is not None:
        w = torch.from_numpy(np.ascontiguousarray(up, np.float32))
        cross = (cov.float() @ w).double()  # [d, ffn]: float32 for the big product
        cross /= (w.double() * cross).sum(0).clamp_min(1e-24).sqrt()  # each neuron at unit variance under G
    else:
        tc = t - t.mean(0)
        tc = tc / tc.std(0).clamp_min(1e-12)
        cross = (xc.float().T @ tc).double() / n  # [d, ffn]: float32 for the big product
    if weights is not None:  # neuron j's squared error counts weights[j] times in the subspace fit
        cross = cross * weights.sqrt().to(cross.dtype)
    white = torch.linalg.solve_triangular(chol, cross, upper=False)
    _, u = torch.linalg.eigh(white @ white.T)
    directions = torch.linalg.solve_triangular(chol.T, u.flip(1), upper=True)
    offset = _offset_channel(x)
    return directions, None if offset is None else torch.from_numpy(offset)


def _probe_size(offset: torch.Tensor | None, d: int) -> int:
    """How many units `_probe_units` has."""
    return d + 1 if offset is not None else 2 * d


def _probe_units(x: np.ndarray, directions: torch.Tensor, offset: torch.Tensor | None,
                 begin: int, end: int) -> torch.Tensor:
    """Hidden units begin..end-1 (w1's columns, float64 [d, end - begin]) of the least-squares probe. The
    sequence is nested, the rank-r probe using the first r units, so one probe prices every rank.

    With an offset channel m (every token of x positive along it), unit 0 is m itself and unit k is
    u_k + c_k m with c_k large enough that x . w1_k > 0 on every token: relu passes them all through,
    and the probe is linear with per-neuron offsets (d + 1 units at most). Without one, units alternate
    u_k, -u_k (relu(z) - relu(-z) = z) and the |z| they add up to stands in for the offsets (2d at most).
    """
    xd = torch.from_numpy(x).double()
    if offset is not None:
        s = xd @ offset  # > 0 on every token
        a = directions[:, max(begin, 1) - 1:end - 1]
        c = (-(xd @ a) / s[:, None]).max(0).values.clamp_min(0) * 1.1 + 1e-3  # x . (a + c m) > 0 everywhere
        units = a + offset[:, None] * c[None]
        return torch.cat([offset[:, None] / s.mean(), units], 1) if begin == 0 else units
    k = torch.arange(begin, end)
    return directions[:, k // 2] * (1 - 2 * (k % 2)).double()


@dataclass
class _Moments:
    """Training-token moments of the probe's hidden units h = relu(x @ w1) (float64 [N, r]) and of its
    targets t [N, ffn]: all that `_probe_w2` needs, for the probe on any first units."""

    hh: torch.Tensor  # E[h h^T] [r, r]
    ht: torch.Tensor  # E[h t^T] [r, ffn]
    h_mean: torch.Tensor  # [r]
    t_mean: torch.Tensor  # [ffn]
    t_square: torch.Tensor  # E[t^2] [ffn]

    @classmethod
    def of(cls, h: torch.Tensor, t: torch.Tensor) -> _Moments:
        n = h.shape[0]
        return cls(h.T @ h / n, (h.float().T @ t).double() / n, h.mean(0), t.mean(0, dtype=torch.float64),
                   (t * t).mean(0, dtype=torch.float64))

    def extend(self, h: torch.Tensor, new: torch.Tensor, t: torch.Tensor) -> _Moments:
        """The moments of units h (those these are of) followed by units `new` [N, c]."""
        n = h.shape[0]
        cross = h.T @ new / n
        hh = torch.cat([torch.cat([self.hh, cross], 1), torch.cat([cross.T, new.T @ new / n], 1)])
        ht = torch.cat([self.ht, (new.float().T @ t).double() / n])
        return _Moments(hh, ht, torch.cat([self.h_mean, new.mean(0)]), self.t_mean, self.t_square)


def _probe_w2(m: _Moments, rank: int, ridge: float, scaled: bool) -> torch.Tensor:
    """w2 (float32 [rank, ffn]) of the probe on the first `rank` units: the ridge least-squares fit of the
    targets on h. With `scaled` (targets are pre-activations), column j is then divided by the residual
    std s_j of that fit and multiplied by 1.7, so the logit approximates log-odds of
    P(pre_j > 0 | x) = Phi(fit_j / s_j): one threshold then ranks all neurons alike. Otherwise the
    +-1 fit is scaled by INIT_LOGIT_SCALE towards logits."""
    hh, ht = m.hh[:rank, :rank], m.ht[:rank]
    ridged = hh + (ridge * hh.diagonal().mean().clamp_min(1e-12)) * torch.eye(rank, dtype=torch.float64)
    w2 = torch.linalg.solve(ridged, ht)
    if not scaled:
        return (w2 * INIT_LOGIT_SCALE).float()
    # the residual's mean square and mean from the moments: no pass over the tokens per rank
    square = m.t_square - 2 * (w2 * ht).sum(0) + (w2 * (hh @ w2)).sum(0)
    mean = m.t_mean - m.h_mean[:rank] @ w2
    residual = (square - mean * mean).clamp_min(0).sqrt().clamp_min(1e-6)
    return (w2 * (PROBIT_TO_LOGIT / residual)).float()


def _init_weights(x: np.ndarray, active: np.ndarray, rank: int, pre: np.ndarray | None = None,
                  ridge: float = 1e-3, weights: torch.Tensor | None = None,
                  w2_ridge: float = W2_RIDGE, up: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A predictor that starts as a linear least-squares probe in a supervised low-rank subspace: w1 the
    first `rank` `_probe_units` (random directions beyond those), w2 their `_probe_w2`. Targets: the
    pre-activations `pre` [N, ffn] when given (neuron j fires iff pre_j > 0), else +-1 for active /
    inactive."""
    d = x.shape[1]
    t = _targets(active, pre)
    directions, offset = _probe_directions(x, t, ridge, weights, up)
    w1 = _probe_units(x, directions, offset, 0, min(rank, _probe_size(offset, d)))
    if w1.shape[1] < rank:
        generator = torch.Generator().manual_seed(0)
        extra = torch.randn(rank - w1.shape[1], d, generator=generator, dtype=torch.float64).T
        w1 = torch.cat([w1, directions @ extra / math.sqrt(d)], 1)
    h = torch.relu(torch.from_numpy(x).double() @ w1)
    w2 = _probe_w2(_Moments.of(h, t), rank, w2_ridge, scaled=pre is not None)
    return w1.float().numpy(), w2.numpy()


def probe_active(inputs: np.ndarray, active: np.ndarray, ranks: list[int], *, target_recall: float = 0.99,
                 pre_activations: np.ndarray | None = None, holdout: float = HOLDOUT,
                 ridge: float = 1e-3, up_weight: np.ndarray | None = None,
                 w2_ridge: float = W2_RIDGE) -> Iterator[tuple[int, float]]:
    """Yield, for each rank r of `ranks` in ascending order, (r, the mean fraction of neurons predicted
    active on the held-out tokens) by the predictor `train_predictor` (same arguments) starts from at rank
    r, with the threshold that reaches `target_recall` there.

    It prices a rank without training at it: on the synthetic layers training moves that fraction by a
    few points either way. Lazy, so a caller stops once larger ranks cannot pay off; each rank adds only
    its new units' moments and an r x r solve (ranks above the d + 1 or 2d probe units are left out).
    """
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    y = np.asarray(active, dtype=bool)
    n = _training_tokens(x.shape[0], holdout)
    x_train, y_hold = x[:n], y[n:]
    t = _targets(y[:n], None if pre_activations is None else pre_activations[:n])
    directions, offset = _probe_directions(x_train, t, ridge, up=_usable_up(up_weight, pre_activations))
    xt, xh = torch.from_numpy(x_train).double(), torch.from_numpy(x[n:]).double()
    h, h_hold = xt[:, :0], xh[:, :0]
    moments = _Moments.of(h, t)
    for rank in sorted({int(r) for r in ranks if 0 < r <= _probe_size(offset, x.shape[1])}):
        units = _probe_units(x_train, directions, offset, h.shape[1], rank)
        new = torch.relu(xt @ units)
        moments = moments.extend(h, new, t)
        h, h_hold = torch.cat([h, new], 1), torch.cat([h_hold, torch.relu(xh @ units)], 1)
        w2 = _probe_w2(moments, rank, w2_ridge, scaled=pre_activations is not None)
        logits = (h_hold.float() @ w2).numpy()
        threshold = _threshold_for_recall(logits, y_hold, target_recall)
        yield rank, _scores(logits > threshold, y_hold)["predicted_active"]


def train_predictor(inputs: np.ndarray, active: np.ndarray, rank: int, *, target_recall: float = 0.99,
                    epochs: int | None = None, seed: int = 0, holdout: float = HOLDOUT,
                    pre_activations: np.ndarray | None = None, batch_size: int = 256, lr: float = REL_LR,
                    pos_weight: str | float = "global", init: str = "lstsq", threads: int = 1,
                    checkpoints: int = CHECKPOINTS, patience: int | None = None,
                    up_weight: np.ndarray | None = None, w2_ridge: float = W2_RIDGE,
                    stored: Callable[[np.ndarray], np.ndarray] | None = None,
                    seen: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> Predictor:
    """Train relu(x @ w1) @ w2 (no biases) to tell which FFN neurons a token activates.

    inputs [N, d] float32 are the FFN's inputs (after its norm), active [N, ffn] bool says which neurons
    output non-zero; `pre_activations` [N, ffn] (optional; the pass passes x @ w_up + b_up, the gate's
    for gated FFNs) make a much better start on large layers, and with them `up_weight` (w_up [d, ffn],
    the pass passes it too) a much better one from fewer tokens than d (`_probe_directions`). The last
    `holdout` share of the tokens is kept out of training: profiles are sequence-major, so these are whole
    sequences (a random split leaks each sequence's context, and recall then falls on new text).
    Start: `init="lstsq"` is `_init_weights` (a least-squares probe in a supervised low-rank subspace),
    `"random"` Kaiming-uniform. Then Adam over shuffled mini-batches of `batch_size` tokens for `epochs`
    passes (default: STEPS updates, fewer where they would cost over TRAIN_FLOPS, at least MIN_EPOCHS
    epochs), cosine-decayed, each matrix's step `lr` x its initial RMS x sqrt(REF_FAN_IN / fan-in), on
    BCE-with-logits with positives weighted up so that misses cost more than false alarms:
    `pos_weight="global"` weighs every positive by sqrt((1 - p)/p) for the mean activation rate p,
    `"neuron"` by (1 - p_j)/p_j per neuron (clipped to [1, 100]), a float by that factor.
    With `checkpoints` > 0 the predictor kept is the best, by predicted-active share on the held-out tokens
    at `target_recall` there, of the start and `checkpoints` evenly spaced points of training (measured on
    an unseen model, BCE from a pre-activation start overfits on few tokens and gains about a point of
    precision on many: keeping the best gets both); training stops after `patience` checkpoints without
    a better one (None: never). `checkpoints=0` keeps the last.
    The threshold is then set on the held-out tokens to the largest value that reaches `target_recall`
    there, and recall, precision and the predicted-active fraction are measured on those tokens (so
    recall >= target_recall by construction; `predicted_active` is the figure of merit; `predict_active`
    measures a predictor on other tokens). With `stored` (a matrix -> the values it holds as the artifact stores
    it: rounded to fp16 or to int8 blocks) the threshold and the figures are those of the predictor as stored,
    and the weights returned are those values; with `seen` ((an input, the stored matrix it multiplies) -> the
    input as that decode GEMV reads it: int8 blocks where it quantizes its input) so are the inputs. Torch runs with `threads` threads here (one by default: on a
    shared 2-core machine two were 10-15x slower; the pass trains layers in parallel instead).
    Deterministic for a given seed.
    """
    started = time.perf_counter()
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    y = np.asarray(active, dtype=bool)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"inputs {x.shape} and active {y.shape} must be [N, d] and [N, ffn]")
    if pre_activations is not None and np.shape(pre_activations) != y.shape:
        raise ValueError(f"pre_activations {np.shape(pre_activations)} must have the shape of active {y.shape}")
    if rank < 1:
        raise ValueError("rank must be positive")
    if x.shape[0] < 2:
        raise ValueError("need at least two profiled tokens")
    n, d = x.shape
    ffn = y.shape[1]
    n_train = _training_tokens(n, holdout)
    x_train, y_train = x[:n_train], y[:n_train]
    x_hold, y_hold = x[n_train:], y[n_train:]
    pre_train = None if pre_activations is None else np.asarray(pre_activations[:n_train], np.float32)

    with _threads(threads):
        generator = torch.Generator().manual_seed(seed)
        if init == "lstsq":
            w1_0, w2_0 = _init_weights(x_train, y_train, rank, pre_train, w2_ridge=w2_ridge,
                                       up=_usable_up(up_weight, pre_activations))
        elif init == "random":
            w1_0 = ((torch.rand(d, rank, generator=generator) * 2 - 1) * math.sqrt(6.0 / d)).numpy()
            w2_0 = ((torch.rand(rank, ffn, generator=generator) * 2 - 1) * math.sqrt(6.0 / rank)).numpy()
        else:
            raise ValueError(f"unknown init {init!r}: 'lstsq' or 'random'")
        w1 = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w1_0, np.float32)))
        w2 = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w2_0, np.float32)))

        rate = y_train.mean(0, dtype=np.float64)
        if pos_weight == "global":
            p = float(rate.mean())
            weight = torch.tensor(math.sqrt((1 - p) / p) if 0 < p < 1 else 1.0)
        elif pos_weight == "neuron":
            weight = torch.from_numpy(np.clip((1 - rate) / np.maximum(rate, 1e-6), 1.0, 100.0).astype(np.float32))
        else:
            weight = torch.tensor(float(pos_weight))
        loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=weight)

        steps_per_epoch = math.ceil(len(x_train) / batch_size)
        if epochs is None:
            step_flops = 6 * min(batch_size, len(x_train)) * rank * (d + ffn)
            epochs = max(MIN_EPOCHS, math.ceil(min(STEPS, TRAIN_FLOPS / step_flops) / steps_per_epoch))
        # Adam moves every entry by about its step size, and a unit's output by about that times its
        # fan-in: steps relative to each matrix's RMS and to sqrt(fan-in) change outputs alike at any size.
        sizes = [lr * float(w.detach().pow(2).mean().sqrt().clamp_min(1e-6)) * math.sqrt(REF_FAN_IN / w.shape[0])
                 for w in (w1, w2)]
        optimizer = torch.optim.Adam([{"params": [w1], "lr": sizes[0]}, {"params": [w2], "lr": sizes[1]}])
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, epochs * steps_per_epoch))
        xt, yt = torch.from_numpy(x_train), torch.from_numpy(y_train)
        xh = torch.from_numpy(x_hold)

        def held_out() -> tuple[float, np.ndarray]:
            with torch.no_grad():
                logits = (torch.relu(xh @ w1) @ w2).numpy()
            threshold = _threshold_for_recall(logits, y_hold, target_recall)
            return _scores(logits > threshold, y_hold)["predicted_active"], logits

        total = epochs * steps_per_epoch
        every = max(1, math.ceil(total / checkpoints)) if checkpoints else 0
        best = None
        if every:  # the start is a candidate too: on few tokens BCE can only overfit it
            share, logits = held_out()
            best, since = (share, w1.detach().clone(), w2.detach().clone(), logits), 0
        step = 0
        for _ in range(epochs):
            order = torch.randperm(len(x_train), generator=generator)
            for begin in range(0, len(x_train), batch_size):
                batch = order[begin:begin + batch_size]
                loss = loss_fn(torch.relu(xt[batch] @ w1) @ w2, yt[batch].float())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                step += 1
                if every and (step % every == 0 or step == total):
                    share, logits = held_out()
                    if share < best[0]:
                        best, since = (share, w1.detach().clone(), w2.detach().clone(), logits), 0
                    else:
                        since += 1
                    if patience is not None and since >= patience:
                        break
            if every and patience is not None and since >= patience:
                break
        if best is not None:
            _, w1_best, w2_best, logits = best
            w1, w2 = torch.nn.Parameter(w1_best), torch.nn.Parameter(w2_best)
        if stored is not None:
            w1, w2 = (torch.nn.Parameter(torch.from_numpy(stored(w.detach().numpy()))) for w in (w1, w2))
        if best is None or stored is not None or seen is not None:
            with torch.no_grad():
                if seen is None:
                    logits = (torch.relu(xh @ w1) @ w2).numpy()
                else:
                    w1n, w2n = w1.detach().numpy(), w2.detach().numpy()
                    logits = seen(np.maximum(seen(xh.numpy(), w1n) @ w1n, 0), w2n) @ w2n

    threshold = _threshold_for_recall(logits, y_hold, target_recall)
    scores = _scores(logits > threshold, y_hold)
    return Predictor(w1.detach().numpy().copy(), w2.detach().numpy().copy(), threshold, scores["recall"],
                     scores["precision"], scores["predicted_active"], time.perf_counter() - started)


@contextlib.contextmanager
def _threads(count: int):
    """Run torch with at most `count` threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(count, before)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- the pass


def _pre_activations(node: ir.Node, inputs: np.ndarray,
                     active: np.ndarray) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """(x @ w_up + b_up, w_up) of the neurons whose activity is profiled (the gate half for gated FFNs; w_up
    [d_model, ffn]), or (None, None) when the node's weights do not fit the profile (or, for ReLU, disagree
    with its activity)."""
    w_up, b_up = pir.const_array(node.inputs[1]), pir.const_array(node.inputs[2]) if len(node.inputs) > 2 else None
    ffn = active.shape[1]
    if w_up is None or w_up.ndim != 2 or w_up.shape[0] != inputs.shape[1] or w_up.shape[1] < ffn:
        return None, None
    weight = np.asarray(w_up[:, :ffn], np.float32)
    pre = inputs @ weight
    if b_up is not None:
        pre += np.asarray(b_up, np.float32).reshape(-1)[:ffn]
    if FFN(node).activation == "relu" and ((pre > 0) == active).mean() < 0.99:
        return None, None
    return pre, weight


def _has_predictors(model: ir.Model) -> bool:
    return all(FFN(node).predictor_threshold is not None and f"layers.{FFN(node).layer}.ffn.predictor.w1" in
               model.graph.initializers for node in FFN.nodes(model))


def predictor_reads_int8(int8_activations: bool, isa) -> bool:
    """Whether the predictors' decode GEMVs quantize their inputs to int8 blocks (with --int8-activations, where
    select-kernels picks the x8 GEMV for PREDICTOR_FORMAT on the build's instruction set `isa`)."""
    return (int8_activations and PREDICTOR_FORMAT.quantized
            and quant.gemv_int8_dot_fits(PREDICTOR_FORMAT.bits, isa.int8_dot, isa.gemm_panels))


# each FFN's predictor: its weights (`layers.{i}.ffn.predictor.w1` / `w2`) and its threshold, recall and active share
PREDICTORS = Fact("a predictor per FFN", "predict", _has_predictors)


@dataclass
class Predict:
    name = "predict"
    requires = (PROFILED_ACTIVATIONS,)
    adds = (PREDICTORS,)
    target_recall: float = Options.target_recall
    param_share: float = Options.predictor_param_share  # cap on all predictors together, of the model's parameters
    seed: int = Options.seed
    int8_activations: bool = Options.int8_activations

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        profiled = ProfiledActivations.of(model)
        nodes = sorted(FFN.nodes(model), key=lambda n: FFN(n).layer)
        layers = [FFN(n).layer for n in nodes]
        data = [profiled.layer(i) for i in layers]  # memory maps: each worker reads only its layer
        d_model = data[0].inputs.shape[1]
        widths = [d_model + layer.ffn for layer in data]
        gated = [bool(FFN(node).gated) for node in nodes]
        params = parameter_count(model.graph)
        budget = int(self.param_share * params)
        # Predict runs before placement: rows are priced as the CPU stores them, where decode waits for them.
        row_bytes = ctx.build.weight_format.bytes_per_weight
        predictor_fmt = PREDICTOR_FORMAT

        def as_stored(w: np.ndarray) -> np.ndarray:  # w1 [d, r] and w2 [r, ffn]: blocked along their first axis
            return quant.as_stored(w, predictor_fmt, axis=0)

        int8_inputs = predictor_reads_int8(self.int8_activations, ctx.build.cpu_isa)

        def seen(v: np.ndarray, w: np.ndarray) -> np.ndarray:  # select-kernels' rule: a quantized GEMV's x8 form
            return quant.int8_blocks(v) if quant.quantizable(w.shape, 0, predictor_fmt.block) else v

        def layer_data(index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
            # activity unpacked and pre-activations recomputed per phase rather than all held: memory stays
            # at the layers in flight (one per worker), however many tokens were profiled
            inputs, active = np.asarray(data[index].inputs, np.float32), data[index].active
            return inputs, active, *_pre_activations(nodes[index], inputs, active)

        def price(index: int) -> dict[int, tuple[float, float]]:
            with ctx.layer(layers[index]):
                inputs, active, pre, up = layer_data(index)
                # d_model: where a low-rank first layer stops being low rank
                limit = min(d_model, budget // widths[index])
                priced = price_ranks(inputs, active, limit, gated[index], target_recall=self.target_recall,
                                     pre_activations=pre, row_bytes=row_bytes,
                                     predictor=predictor_fmt, up_weight=up)
            advance()
            return priced

        def train(index: int) -> tuple[Predictor, bool]:
            with ctx.layer(layers[index]):
                inputs, active, pre, up = layer_data(index)
                predictor = train_predictor(inputs, active, ranks[index], target_recall=self.target_recall,
                                            seed=self.seed + layers[index], pre_activations=pre, up_weight=up,
                                            stored=as_stored, seen=seen if int8_inputs else None)
            advance()
            # held in their stored precision (exact: fitted as stored), not fp32: all layers' are kept to the end
            return dataclasses.replace(predictor, w1=held(predictor.w1), w2=held(predictor.w2)), pre is not None

        def held(w: np.ndarray) -> np.ndarray:
            return w if predictor_fmt.quantized else w.astype(float_format(predictor_fmt).storage)

        # Layers are independent: each phase runs them side by side, one torch thread each (deterministic
        # either way).
        workers = max(1, min(len(nodes), torch.get_num_threads()))
        with _threads(1), ThreadPoolExecutor(workers) as pool:
            started = time.perf_counter()
            with ctx.progress("predict: pricing ranks (layers)", len(nodes)) as advance:
                priced = list(pool.map(price, range(len(nodes))))
            pricing = time.perf_counter() - started
            ranks = choose_ranks([{r: reads for r, (_, reads) in p.items()} for p in priced], widths, budget)
            for layer, prices, rank in zip(layers, priced, ranks):
                estimates = ", ".join(f"{r} {reads / 2**20:.3g} MiB ({share:.1%} active)"
                                      for r, (share, reads) in prices.items())
                ctx.log(f"predict: layer {layer} estimated step reads by rank: {estimates}; rank {rank}")
            used = sum(r * w for r, w in zip(ranks, widths))
            ctx.log(f"predict: {len(nodes)} layers, ranks {ranks} use {used} params of the budget {budget} "
                    f"({self.param_share:.1%} of {params})"
                    + (" (OVER BUDGET: smallest ranks)" if used > budget else "") + f"; priced in {pricing:.1f}s")
            started = time.perf_counter()
            with ctx.progress("predict: training predictors (layers)", len(nodes)) as advance:
                results = list(pool.map(train, range(len(nodes))))
            ctx.log(f"predict: trained in {time.perf_counter() - started:.1f}s")

        for node, layer, rank, prices, profile, (predictor, from_weights) in zip(
                nodes, layers, ranks, priced, data, results):
            prefix = f"layers.{layer}.ffn.predictor"
            pir.initializer(model.graph, f"{prefix}.w1", predictor.w1)
            pir.initializer(model.graph, f"{prefix}.w2", predictor.w2)
            ffn = FFN(node)
            ffn.predictor_rank = rank
            ffn.predictor_threshold, ffn.predictor_recall = float(predictor.threshold), float(predictor.recall)
            ffn.predictor_precision, ffn.predictor_active = float(predictor.precision), float(predictor.predicted_active)
            true_active = profile.active_share  # over every profiled token; predicted: on the held-out ones
            ratio = f"{predictor.predicted_active / true_active:.2f}x" if true_active else "-"
            ctx.log(f"predict: layer {layer} rank {rank}: recall {predictor.recall:.4f} precision "
                    f"{predictor.precision:.4f}; active share predicted {predictor.predicted_active:.4f}, true "
                    f"{true_active:.4f} ({ratio}; estimated "
                    f"{prices[rank][0]:.4f}; start from {'weights' if from_weights else 'activity'}) "
                    f"in {predictor.train_seconds:.1f}s")
        return PassResult(model, modified=True)
