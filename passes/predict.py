"""predict: train one activation predictor per FFN layer (PowerInfer's adaptive predictors).

Reads: `ctx.profile` (layer -> FFN inputs [tokens, d_model] float32 after the FFN's norm, active neurons
[tokens, ffn] bool; tokens sequence-major), written by the profile pass; the `picompile.FFN` nodes (int
attribute `layer`; float attributes `sparsity` and `skewness` from the profile pass, computed from the
profile when absent; the up (gate) weight and bias, from which the training targets' pre-activations
come); the model's parameter count (the sum of all initializer sizes); the options
`predictor_param_share`, `target_recall`, `seed` and `dense`.
Adds: per FFN layer i the initializers `layers.{i}.ffn.predictor.w1` [d_model, r] and
`layers.{i}.ffn.predictor.w2` [r, ffn] (float32; neuron j is predicted active for input x iff
(relu(x @ w1) @ w2)[j] > threshold) and, on the FFN node, `predictor_rank` (int), `predictor_threshold`,
`predictor_recall`, `predictor_precision` and `predictor_active` (floats: recall, precision and mean
fraction of neurons predicted active on held-out profiled tokens; the last is what a decode step pays
for). The ranks r come from `choose_ranks`: all predictors together stay within `predictor_param_share`
of the model's parameters. With `dense` set, or without a profile, the IR is left unchanged.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.pipeline import Context

__all__ = ["Predictor", "Predict", "choose_ranks", "train_predictor", "skewness", "predict_active"]

TOP_SHARE = 0.2  # skewness: the share of all activations carried by the top 20% most active neurons
STEPS = 800  # Adam updates a predictor gets by default (about 60 epochs of 4096 profiled tokens) ...
TRAIN_FLOPS = 1e12  # ... unless they would cost more than this (large layers start close to done anyway)
MIN_EPOCHS = 3
REL_LR = 0.03  # Adam step size relative to each weight matrix's initial RMS, at a fan-in of REF_FAN_IN
REF_FAN_IN = 64
INIT_LOGIT_SCALE = 4.0  # the +-1 least-squares start, scaled towards logits
PROBIT_TO_LOGIT = 1.7  # Phi(z) ~ sigmoid(1.7 z)


# ---------------------------------------------------------------- rank choice


def skewness(active: np.ndarray) -> float:
    """How concentrated activity is, in [0, 1]: the share of all activations carried by the 20% most
    frequently active neurons, rescaled so that 0 is uniform (a 20% share) and 1 is all of it.

    This is the profile's definition when it writes none (OPT-30B's "17% of neurons carry 80%" is
    about 0.77 here)."""
    counts = np.sort(np.asarray(active, bool).sum(0))[::-1].astype(np.float64)
    total = counts.sum()
    if total == 0:
        return 1.0
    top = max(1, int(round(TOP_SHARE * counts.size)))
    share = counts[:top].sum() / total
    return float(np.clip((share - TOP_SHARE) / (1 - TOP_SHARE), 0.0, 1.0))


def _difficulty(sparsity: float, skew: float) -> float:
    """How hard a layer is to predict, per unit of rank: grows with density and falls with skewness."""
    density = min(max(1.0 - float(sparsity), 1e-3), 1.0)
    skew = min(max(float(skew), 0.0), 1.0)
    return math.sqrt(density) * (1.0 - 0.5 * skew)


def choose_ranks(d_model: int, ffn_sizes: list[int], sparsity: list[float], skewness: list[float],
                 param_budget: int, min_rank: int = 16, max_rank: int | None = None) -> list[int]:
    """The hidden width r_l of each layer's predictor, within sum_l r_l * (d_model + ffn_l) <= param_budget.

    Rule: every layer gets `min_rank`; then the budget is handed out in steps of 16 (8 when `min_rank` is
    not a multiple of 16), each step to the layer with the lowest r_l / difficulty_l among those it still
    fits (ties to the lower layer), where difficulty_l = sqrt(1 - sparsity_l) * (1 - skewness_l / 2)
    (skewness in [0, 1], 0 = uniform), until no step fits. So ranks end up about proportional to the
    difficulty: denser and less skewed layers get more. Ranks stop at `max_rank` (default: d_model, which
    is where a low-rank first layer stops being low rank). If the budget cannot fund `min_rank` everywhere,
    the floor drops to the largest multiple of 8 that fits, and to 8 (over budget) if none does.
    """
    n = len(ffn_sizes)
    if not (len(sparsity) == len(skewness) == n):
        raise ValueError("ffn_sizes, sparsity and skewness need one entry per layer")
    if n == 0:
        return []
    step = 16 if min_rank % 16 == 0 else 8
    ceiling = max_rank if max_rank is not None else max(min_rank, d_model // step * step)
    cost = [d_model + f for f in ffn_sizes]
    floor = min_rank
    while floor > 8 and floor * sum(cost) > param_budget:
        floor -= 8
    floor = max(floor, 8)
    step = step if floor % step == 0 else 8
    ranks = [min(floor, ceiling)] * n
    left = param_budget - sum(r * c for r, c in zip(ranks, cost))
    weights = [_difficulty(s, k) for s, k in zip(sparsity, skewness)]
    while True:
        candidates = [i for i in range(n) if ranks[i] + step <= ceiling and step * cost[i] <= left]
        if not candidates:
            return ranks
        best = min(candidates, key=lambda i: (ranks[i] / weights[i], i))
        ranks[best] += step
        left -= step * cost[best]


# ---------------------------------------------------------------- training


@dataclass
class Predictor:
    w1: np.ndarray  # [d_model, r] float32  (h = relu(x @ w1))
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


def _init_weights(x: np.ndarray, active: np.ndarray, rank: int, pre: np.ndarray | None = None,
                  ridge: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """A predictor that starts as a linear least-squares probe in a supervised low-rank subspace.

    Targets: the pre-activations `pre` [N, ffn] when given (neuron j fires iff pre_j > 0), else +-1 for
    active / inactive. Directions: reduced-rank regression of the targets (each neuron scaled to unit
    variance) on the centred inputs, i.e. the top generalised eigenvectors u_k of C C^T against the input
    covariance G (C = cov(x, targets)), scaled so that x . u_k has unit variance. When the inputs have an
    offset channel m (every token positive along it), unit 0 is m itself and unit k is u_k + c_k m with
    c_k large enough that x . w1_k > 0 on every profiled token: relu passes them all through, and the
    predictor starts as a rank-(r-1) linear probe with per-neuron offsets. Without one, units come in
    pairs [u, -u] (relu(z) - relu(-z) = z) and the |z| they add up to stands in for the offsets.
    w2 is the ridge least-squares fit of the targets on h = relu(x @ w1). For pre-activations, column j is
    then divided by the residual std s_j of that fit and multiplied by 1.7, so the logit approximates
    log-odds of P(pre_j > 0 | x) = Phi(fit_j / s_j): one threshold then ranks all neurons alike.
    """
    n, d = x.shape
    xd = torch.from_numpy(x).double()
    if pre is not None:
        t = torch.from_numpy(np.ascontiguousarray(pre, np.float32))
    else:
        t = torch.from_numpy(np.where(active, np.float32(1), np.float32(-1)))
    mean = xd.mean(0)
    xc = xd - mean
    cov = xc.T @ xc / n
    cov += (ridge * cov.diagonal().mean().clamp_min(1e-12)) * torch.eye(d, dtype=torch.float64)
    evals, evecs = torch.linalg.eigh(cov)
    inv_sqrt = evecs * evals.clamp_min(1e-12).rsqrt()  # G^{-1/2} (up to rotation)
    tc = t - t.mean(0)
    tc = tc / tc.std(0).clamp_min(1e-12)
    cross = (xc.float().T @ tc).double() / n  # [d, ffn]: float32 for the big product
    white = inv_sqrt.T @ cross
    _, u = torch.linalg.eigh(white @ white.T)
    directions = inv_sqrt @ u.flip(1)  # [d, d], unit variance along each, most predictive first
    offset = _offset_channel(x)
    if offset is not None:
        m = torch.from_numpy(offset)
        s = xd @ m  # > 0 on every token
        k = min(rank - 1, d)
        a = directions[:, :k]
        z = xd @ a
        c = ((-z / s[:, None]).max(0).values.clamp_min(0) * 1.1 + 1e-3)  # x . (a + c m) > 0 everywhere
        w1 = torch.cat([m[:, None] / s.mean(), a + m[:, None] * c[None]], 1)
    else:
        k = max(1, min(rank // 2, d))
        w1 = torch.cat([directions[:, :k], -directions[:, :k]], 1)
    if w1.shape[1] < rank:  # rank > 2d (or odd): extra units along random directions
        generator = torch.Generator().manual_seed(0)
        extra = inv_sqrt @ torch.randn(d, rank - w1.shape[1], generator=generator, dtype=torch.float64)
        w1 = torch.cat([w1, extra / math.sqrt(d)], 1)
    h = torch.relu(xd @ w1)
    hh = h.T @ h / n
    hh += (ridge * hh.diagonal().mean().clamp_min(1e-12)) * torch.eye(rank, dtype=torch.float64)
    w2 = torch.linalg.solve(hh, (h.float().T @ t).double() / n).float()
    if pre is not None:
        residual = (t - h.float() @ w2).std(0).clamp_min(1e-6)
        w2 = w2 * (PROBIT_TO_LOGIT / residual)
    else:
        w2 = w2 * INIT_LOGIT_SCALE
    return w1.float().numpy(), w2.numpy()


def train_predictor(inputs: np.ndarray, active: np.ndarray, rank: int, *, target_recall: float = 0.99,
                    epochs: int | None = None, seed: int = 0, holdout: float = 0.2,
                    pre_activations: np.ndarray | None = None, batch_size: int = 256, lr: float = REL_LR,
                    pos_weight: str | float = "global", init: str = "lstsq", threads: int = 1) -> Predictor:
    """Train relu(x @ w1) @ w2 (no biases) to tell which FFN neurons a token activates.

    inputs [N, d] float32 are the FFN's inputs (after its norm), active [N, ffn] bool says which neurons
    output non-zero; `pre_activations` [N, ffn] (optional; the pass passes x @ w_up + b_up, the gate's
    for gated FFNs) make a much better start on large layers. The last `holdout` share of the tokens is
    kept out of training: profiles are sequence-major, so these are whole sequences (a random split
    leaks each sequence's context, and recall then falls on new text).
    Start: `init="lstsq"` is `_init_weights` (a least-squares probe in a supervised low-rank subspace),
    `"random"` Kaiming-uniform. Then Adam over shuffled mini-batches of `batch_size` tokens for `epochs`
    passes (default: STEPS updates, fewer where they would cost over TRAIN_FLOPS, at least MIN_EPOCHS
    epochs), cosine-decayed, each matrix's step `lr` x its initial RMS x sqrt(REF_FAN_IN / fan-in), on
    BCE-with-logits with positives weighted up so that misses cost more than false alarms:
    `pos_weight="global"` weighs every positive by sqrt((1 - p)/p) for the mean activation rate p,
    `"neuron"` by (1 - p_j)/p_j per neuron (clipped to [1, 100]), a float by that factor.
    The threshold is then set on the held-out tokens to the largest value that reaches `target_recall`
    there, and recall, precision and the predicted-active fraction are measured on those tokens (so
    recall >= target_recall by construction; `predicted_active` is the figure of merit; `predict_active`
    measures a predictor on other tokens). Torch runs with `threads` threads here (one by default: on a
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
    n_hold = min(max(1, int(round(holdout * n))), n - 1)
    x_train, y_train = x[: n - n_hold], y[: n - n_hold]
    x_hold, y_hold = x[n - n_hold:], y[n - n_hold:]
    pre_train = None if pre_activations is None else np.asarray(pre_activations[: n - n_hold], np.float32)

    with _threads(threads):
        generator = torch.Generator().manual_seed(seed)
        if init == "lstsq":
            w1_0, w2_0 = _init_weights(x_train, y_train, rank, pre_train)
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
        for _ in range(epochs):
            order = torch.randperm(len(x_train), generator=generator)
            for begin in range(0, len(x_train), batch_size):
                batch = order[begin:begin + batch_size]
                loss = loss_fn(torch.relu(xt[batch] @ w1) @ w2, yt[batch].float())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
        with torch.no_grad():
            logits = (torch.relu(torch.from_numpy(x_hold) @ w1) @ w2).numpy()

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


def _param_count(model: ir.Model) -> int:
    return int(sum(pir.const_array(v).size for v in model.graph.initializers.values() if v.const_value is not None))


def _pre_activations(node: ir.Node, inputs: np.ndarray, active: np.ndarray) -> np.ndarray | None:
    """x @ w_up + b_up of the neurons whose activity is profiled (the gate half for gated FFNs), or None
    when the node's weights do not fit the profile (or, for ReLU, disagree with its activity)."""
    w_up, b_up = pir.const_array(node.inputs[1]), pir.const_array(node.inputs[2]) if len(node.inputs) > 2 else None
    ffn = active.shape[1]
    if w_up is None or w_up.ndim != 2 or w_up.shape[0] != inputs.shape[1] or w_up.shape[1] < ffn:
        return None
    pre = inputs @ np.asarray(w_up[:, :ffn], np.float32)
    if b_up is not None:
        pre += np.asarray(b_up, np.float32).reshape(-1)[:ffn]
    if pir.attr(node, "activation") == "relu" and ((pre > 0) == active).mean() < 0.99:
        return None
    return pre


@dataclass
class Predict:
    name = "predict"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        options = ctx.options
        if options.dense or not ctx.profile:
            return PassResult(model, modified=False)
        nodes = sorted((n for n in pir.nodes_in_domain(model, "FFN") if int(pir.attr(n, "layer")) in ctx.profile),
                       key=lambda n: int(pir.attr(n, "layer")))
        if not nodes:
            return PassResult(model, modified=False)
        layers = [int(pir.attr(n, "layer")) for n in nodes]
        data = [(np.asarray(ctx.profile[i][0], np.float32), np.asarray(ctx.profile[i][1], bool)) for i in layers]
        d_model = data[0][0].shape[1]
        ffn_sizes = [active.shape[1] for _, active in data]
        sparsity = [float(pir.attr(node, "sparsity", 1.0 - active.mean())) for node, (_, active) in zip(nodes, data)]
        skews = [float(pir.attr(node, "skewness")) if pir.attr(node, "skewness") is not None else skewness(active)
                 for node, (_, active) in zip(nodes, data)]
        params = _param_count(model)
        budget = int(options.predictor_param_share * params)
        ranks = choose_ranks(d_model, ffn_sizes, sparsity, skews, budget)
        used = sum(r * (d_model + f) for r, f in zip(ranks, ffn_sizes))
        ctx.log(f"predict: {len(nodes)} layers, budget {budget} params ({options.predictor_param_share:.1%} of "
                f"{params}), ranks {ranks} use {used}" + (" (OVER BUDGET: floor ranks)" if used > budget else ""))

        def train(index: int) -> tuple[Predictor, bool]:
            inputs, active = data[index]
            pre = _pre_activations(nodes[index], inputs, active)
            return train_predictor(inputs, active, ranks[index], target_recall=options.target_recall,
                                   seed=options.seed + layers[index], pre_activations=pre), pre is not None

        # Layers are independent: train them side by side, one torch thread each (deterministic either way).
        workers = max(1, min(len(nodes), torch.get_num_threads()))
        with _threads(1), ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(train, range(len(nodes))))

        for node, layer, rank, s, (predictor, from_weights) in zip(nodes, layers, ranks, sparsity, results):
            prefix = f"layers.{layer}.ffn.predictor"
            pir.initializer(model.graph, f"{prefix}.w1", predictor.w1)
            pir.initializer(model.graph, f"{prefix}.w2", predictor.w2)
            node.attributes["predictor_rank"] = ir.AttrInt64("predictor_rank", rank)
            for key, value in (("predictor_threshold", predictor.threshold), ("predictor_recall", predictor.recall),
                               ("predictor_precision", predictor.precision),
                               ("predictor_active", predictor.predicted_active)):
                node.attributes[key] = ir.AttrFloat32(key, float(value))
            ctx.log(f"predict: layer {layer} rank {rank}: recall {predictor.recall:.4f} precision "
                    f"{predictor.precision:.4f} predicted active {predictor.predicted_active:.4f} "
                    f"(sparsity {s:.3f}, start from {'weights' if from_weights else 'activity'}) "
                    f"in {predictor.train_seconds:.1f}s")
        return PassResult(model, modified=True)
