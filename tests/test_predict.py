"""The predict pass: rank choice, predictor training, and the pass on the tiny synthetic models."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from passes.import_onnx import Import
from passes.front_end import load
from passes.predict import (Predict, Predictor, _threshold_for_recall, candidate_ranks, choose_ranks, predict_active,
                            predictor_step_reads, price_ranks, step_reads, train_predictor)
from passes.profile import LayerActivations, ProfiledActivations
from passes.recognise import Recognise
from passes import ir as pir
from runtime.dtypes import WEIGHT_FORMATS
from passes.pipeline import Context, run_passes, verify_onnx
from passes.targets import get_target

torch.set_num_threads(2)


def good_enough(scores) -> bool:
    """What a useful predictor must reach: high recall while predicting well under half the neurons."""
    return scores.recall >= 0.95 and scores.predicted_active < 0.3


# ---------------------------------------------------------------- rank choice


def test_candidate_ranks_and_step_reads():
    assert candidate_ranks(100) == [8, 16, 24, 32, 40, 48, 56, 64, 80, 96]
    assert candidate_ranks(1024)[-5:] == [512, 640, 768, 896, 1024]
    assert candidate_ranks(3) == [8]  # the floor, even where the budget cannot pay for it
    # bytes: the fp32 predictor, and the rows of the predicted neurons as the CPU stores them
    assert step_reads(64, 0.1, 2048, 8192, gated=False) == (64 * 10240 + 0.1 * 8192 * 2048 * 2) * 4
    assert step_reads(64, 0.1, 2048, 8192, gated=True) == (64 * 10240 + 0.1 * 8192 * 2048 * 3) * 4
    assert step_reads(64, 0.1, 2048, 8192, gated=True, row_bytes=2.0, predictor_bytes=2.0) == (
        64 * 10240 * 2 + 0.1 * 8192 * 2048 * 3 * 2)
    int4 = WEIGHT_FORMATS["int4"].bytes_per_weight  # 4 bits and a 2-byte scale per 32 weights
    assert step_reads(64, 0.1, 2048, 8192, gated=False, row_bytes=int4, predictor_bytes=2.0) == (
        64 * 10240 * 2 + 0.1 * 8192 * 2048 * 2 * (0.5 + 2 / 32))  # int4 rows: the predictor weighs relatively more
    # int8-blocked predictors: w2 [r, ffn] of a rank of part of a block stays in fp16 (the quantize pass's rule)
    int8, fp16 = WEIGHT_FORMATS["int8"], WEIGHT_FORMATS["fp16"]
    assert predictor_step_reads(64, 0.1, 2048, 8192, False, int4, int8) == step_reads(
        64, 0.1, 2048, 8192, False, int4, int8.bytes_per_weight)
    assert predictor_step_reads(80, 0.1, 2048, 8192, False, int4, int8) == (
        80 * (2048 * int8.bytes_per_weight + 8192 * fp16.bytes_per_weight) + 0.1 * 8192 * 2048 * 2 * int4)
    assert predictor_step_reads(80, 0.1, 2048, 8192, False, int4, int8) > predictor_step_reads(
        96, 0.1, 2048, 8192, False, int4, int8)  # a larger rank of whole blocks reads less


def test_choose_ranks_takes_each_layers_cheapest_rank_within_the_budget():
    widths = [100, 100, 200]
    reads = [{8: 50_000, 16: 30_000, 32: 31_000},
             {8: 40_000, 16: 20_000, 32: 10_000, 64: 12_000},
             {8: 9_000, 16: 8_000}]
    assert choose_ranks(reads, widths, 10**9) == [16, 32, 16]  # the budget does not bind: cheapest each
    assert choose_ranks([{8: 5, 16: 5}], [100], 10**9) == [8]  # ties go to the smaller rank
    # 8000 params wanted. Freeing a parameter costs, in extra reads: layer 2 16 -> 8: 1000 / 1600,
    # layer 1 32 -> 16: 10000 / 1600, layer 0 16 -> 8: 20000 / 800 (all per param freed)
    assert choose_ranks(reads, widths, 6500) == [16, 32, 8]
    assert choose_ranks(reads, widths, 5000) == [16, 16, 8]
    assert choose_ranks(reads, widths, 4000) == [8, 16, 8]  # 20000 / 800 either way: the lower layer first
    assert choose_ranks(reads, widths, 0) == [8, 8, 8]  # over budget: nothing smaller to take


# ---------------------------------------------------------------- train_predictor


def low_rank_layer(d=64, ffn=512, rank=16, noise=0.1, mean_p=0.1, seed=0, offset=False):
    """A synthetic FFN layer: x ~ N(0, I_d), pre-activation = x @ A (rank 16) + small noise + per-neuron
    bias, the biases giving Zipf-distributed activation probabilities with mean 0.1. With `offset` the
    last input channel is instead about 4 on every token (as a LayerNorm bias or LLaMA's constant channel
    make it) and A ignores it.
    Returns draw(n, seed) -> (x [n, d] float32, active [n, ffn] bool, pre-activations [n, ffn])."""
    from examples.models import activation_probs

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((d, rank)) @ rng.standard_normal((rank, ffn)) / np.sqrt(d * rank)
    if offset:
        a[-1] = 0
    scale = np.sqrt((a * a).sum(0))
    p = activation_probs(ffn, mean_p, "zipf", rng=rng)
    normal = statistics.NormalDist()
    bias = np.array([normal.inv_cdf(pj) for pj in p]) * scale * np.sqrt(1 + noise**2)

    def draw(n, draw_seed):
        r = np.random.default_rng(draw_seed)
        x = r.standard_normal((n, d))
        if offset:
            x[:, -1] = 4 + 0.1 * x[:, -1]
        pre = x @ a + noise * scale * r.standard_normal((n, ffn)) + bias
        return x.astype(np.float32), pre > 0, pre.astype(np.float32)

    return draw


def test_thresholds_are_fitted_to_the_inputs_as_the_decode_gemvs_read_them():
    """With `seen` (int8-activation predictor GEMVs: both inputs rounded to int8 blocks) the threshold is set on
    the scores computed that way, so the held-out tokens reach the target recall as the kernels score them."""
    from passes.kernels.quant import int8_blocks, QUANT_BLOCK
    from passes.predict import HOLDOUT, _training_tokens

    draw = low_rank_layer()
    x, active, _ = draw(2048, 1)
    seen = lambda v, w: int8_blocks(v) if w.shape[0] % QUANT_BLOCK == 0 else v  # noqa: E731
    plain = train_predictor(x, active, 32, target_recall=0.99, seed=0)
    rounded = train_predictor(x, active, 32, target_recall=0.99, seed=0, seen=seen)
    np.testing.assert_array_equal(rounded.w2, plain.w2)  # the same training: only the inputs scored differ
    assert rounded.threshold != plain.threshold
    hold = slice(_training_tokens(len(x), HOLDOUT), None)
    scores = seen(np.maximum(seen(x[hold], rounded.w1) @ rounded.w1, 0), rounded.w2) @ rounded.w2
    predicted, truth = scores > rounded.threshold, active[hold]
    assert (predicted & truth).sum() / truth.sum() >= 0.99
    assert rounded.recall == pytest.approx((predicted & truth).sum() / truth.sum())


def test_train_predictor_on_low_rank_data():
    draw = low_rank_layer()
    x, active, pre = draw(4096, 1)
    x_new, active_new, _ = draw(2048, 2)
    assert abs(active.mean() - 0.1) < 0.02
    predictor = train_predictor(x, active, 32, target_recall=0.99, seed=0)
    assert predictor.w1.shape == (64, 32) and predictor.w2.shape == (32, 512)
    assert predictor.w1.dtype == predictor.w2.dtype == np.float32
    assert predictor.recall >= 0.99 and 0 < predictor.precision <= 1
    assert good_enough(predictor), predictor
    # the stored threshold carries over to tokens it never saw
    fresh = predict_active(predictor, x_new, active_new)
    assert fresh["recall"] >= 0.97 and fresh["predicted_active"] < 0.3, fresh
    # starting from the pre-activations (what the pass does) is at least as good
    from_pre = train_predictor(x, active, 32, target_recall=0.99, seed=0, pre_activations=pre)
    assert good_enough(from_pre) and from_pre.predicted_active <= predictor.predicted_active + 0.01, from_pre
    # a trivial predictor (everything active) has perfect recall but must not pass
    trivial = Predictor(np.zeros((64, 32), np.float32), np.zeros((32, 512), np.float32), -1.0, 0, 0, 0)
    scores = predict_active(trivial, x, active)
    trivial.recall, trivial.precision, trivial.predicted_active = scores["recall"], scores["precision"], scores["predicted_active"]
    assert trivial.recall == 1.0 and not good_enough(trivial)


def weight_layer(d=256, ffn=512, rank=16, low_var=0.9, mean_p=0.1, seed=0):
    """A synthetic ReLU FFN layer given by its weights, as the pass sees one: pre-activation = x @ w + bias
    exactly, w a rank-16 part carrying `low_var` of each neuron's variance plus a full-rank part, biases for
    Zipf activation probabilities of mean 0.1; inputs Gaussian with channel scales from 0.5 to 2 (not
    isotropic, so that shrinking their covariance towards a multiple of I is not exact).
    Returns (w [d, ffn] float32, draw(n, seed) -> (x [n, d] float32, active [n, ffn] bool, pre-activations))."""
    from examples.models import activation_probs

    rng = np.random.default_rng(seed)
    scales = np.exp(rng.uniform(np.log(0.5), np.log(2), d))
    low = rng.standard_normal((d, rank)) @ rng.standard_normal((rank, ffn))
    full = rng.standard_normal((d, ffn))

    def variance(part):
        return ((part * scales[:, None]) ** 2).sum(0)

    w = (low * np.sqrt(low_var / variance(low)) + full * np.sqrt((1 - low_var) / variance(full))).astype(np.float32)
    normal = statistics.NormalDist()
    bias = np.array([normal.inv_cdf(pj) for pj in activation_probs(ffn, mean_p, "zipf", rng=rng)], np.float32)

    def draw(n, draw_seed):
        x = (np.random.default_rng(draw_seed).standard_normal((n, d)) * scales).astype(np.float32)
        pre = x @ w + bias
        return x, pre > 0, pre

    return w, draw


def test_up_weight_start_needs_fewer_tokens():
    """Given the up weight, the probe's cross-covariance is exact and its input covariance shrunk
    (Ledoit-Wolf): fitted on fewer tokens than inputs it must predict far fewer neurons on new tokens at the
    same recall than the probe from the profiled pre-activations alone; on many tokens both agree."""
    w, draw = weight_layer()
    x, active, pre = draw(160, 1)  # 128 fitted tokens for 256 inputs
    x_new, active_new, _ = draw(4096, 2)
    alone = predict_active(train_predictor(x, active, 32, pre_activations=pre, epochs=0), x_new, active_new)
    with_up = train_predictor(x, active, 32, pre_activations=pre, up_weight=w, epochs=0)
    fresh = predict_active(with_up, x_new, active_new)
    assert fresh["recall"] >= 0.97, fresh
    assert fresh["predicted_active"] < 0.7 * alone["predicted_active"], (fresh, alone)
    # the method before it (BCE to the end from the probe without the weight) against the default now
    old = predict_active(train_predictor(x, active, 32, pre_activations=pre, checkpoints=0), x_new, active_new)
    new = predict_active(train_predictor(x, active, 32, pre_activations=pre, up_weight=w), x_new, active_new)
    assert new["recall"] >= 0.97 and new["predicted_active"] < 0.7 * old["predicted_active"], (new, old)
    x, active, pre = draw(8192, 3)
    many = [train_predictor(x, active, 32, pre_activations=pre, up_weight=up, epochs=0).predicted_active
            for up in (None, w)]
    assert abs(many[0] - many[1]) < 0.01, many
    # the weight only stands in for the pre-activations: without them it is not used
    no_pre = [train_predictor(x[:512], active[:512], 16, up_weight=up, epochs=0) for up in (None, w)]
    np.testing.assert_array_equal(no_pre[0].w2, no_pre[1].w2)


def test_train_predictor_is_deterministic():
    x, active, _ = low_rank_layer(ffn=128)(1024, 3)
    first = train_predictor(x, active, 16, epochs=3, seed=5)
    again = train_predictor(x, active, 16, epochs=3, seed=5)
    other = train_predictor(x, active, 16, epochs=3, seed=6)
    np.testing.assert_array_equal(first.w1, again.w1)
    np.testing.assert_array_equal(first.w2, again.w2)
    assert first.threshold == again.threshold
    assert not np.array_equal(first.w2, other.w2)


def test_training_keeps_the_best_checkpoint_on_held_out_tokens():
    """The predictor kept is the start or a point of training, whichever predicts fewest neurons on the
    held-out tokens at the target recall: never worse there than the start or the end of training."""
    x, active, pre = low_rank_layer()(2048, 1)
    for kwargs in (dict(), dict(pre_activations=pre)):
        start = train_predictor(x, active, 32, epochs=0, **kwargs)
        last = train_predictor(x, active, 32, checkpoints=0, **kwargs)
        kept = train_predictor(x, active, 32, **kwargs)
        assert kept.recall >= 0.99
        assert kept.predicted_active <= min(start.predicted_active, last.predicted_active), (kept, start, last)
        if not kwargs:  # from the +-1 start training helps: a later point is kept
            assert kept.predicted_active < start.predicted_active and not np.array_equal(kept.w2, start.w2)


def test_threshold_is_the_largest_reaching_the_target():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((200, 50)).astype(np.float32)
    active = rng.random((200, 50)) < 0.2
    for target in (0.9, 0.99, 1.0):
        t = _threshold_for_recall(logits, active, target)
        positives = logits[active]
        assert (positives > t).mean() >= target
        above = positives[positives > t].min()  # the next larger threshold loses at least one positive
        assert (positives > above).mean() < target


@pytest.mark.parametrize("offset, units", [(True, 16), (False, 32)])
def test_price_ranks_finds_the_rank_of_low_rank_pre_activations(offset, units):
    """Pre-activations of rank k plus noise of a tenth of their scale. With an offset channel (k = 15) the
    probe needs k + 1 = 16 units (one carries the offsets), without one (k = 16) 2k = 32 (a +- pair per
    direction). Pricing must find that many, not the cap."""
    draw = low_rank_layer(d=128, ffn=1024, rank=15 if offset else 16, offset=offset)
    x, active, pre = draw(4096, 1)
    priced = price_ranks(x, active, 128, gated=False, target_recall=0.99, pre_activations=pre)
    cheapest = min(priced, key=lambda r: priced[r][1])
    assert cheapest == units, priced
    assert max(priced) <= 64  # larger ranks could not pay off: never priced
    below = max(r for r in priced if r < units)
    assert priced[below][0] > 1.5 * priced[units][0]  # too few units miss directions: many more predicted
    # the estimate is the predictor training starts from at that rank ...
    start = train_predictor(x, active, units, pre_activations=pre, epochs=0)
    assert abs(start.predicted_active - priced[units][0]) < 2e-3, (start, priced[units])
    # ... and what training makes of it is within a few points
    trained = train_predictor(x, active, units, pre_activations=pre)
    assert trained.recall >= 0.99 and abs(trained.predicted_active - priced[units][0]) < 0.05, (trained, priced[units])
    # a limit below that caps the ranks priced
    assert list(price_ranks(x, active, 20, gated=False, target_recall=0.99, pre_activations=pre)) == [8, 16]


# ---------------------------------------------------------------- the pass


def torch_profiles(family: str, token_files) -> tuple[list[dict], dict]:
    """Per token file: layer -> (FFN inputs [tokens, d] after the norm, active [tokens, ffn]) of the tiny
    model, from forward hooks on the torch model its ONNX file was exported from (rebuilt: the maker is
    deterministic); and layer -> the first FFN weight [d, ffn] (gate or up), to check it is that model."""
    from examples.models import build_model, ffn_modules, read_tokens

    model, _ = build_model(family, "tiny", sparsity=0.9)
    modules = ffn_modules(model)
    profiles = []
    for token_file in token_files:
        inputs, active = [[] for _ in modules], [[] for _ in modules]
        handles = []
        for i, mods in enumerate(modules):
            first = mods["up"] if "gate" not in mods else mods["mlp"]
            handles.append(first.register_forward_pre_hook(
                lambda m, args, i=i: inputs[i].append(args[0].reshape(-1, args[0].shape[-1]))))
            handles.append(mods["down"].register_forward_pre_hook(
                lambda m, args, i=i: active[i].append(args[0].reshape(-1, args[0].shape[-1]) != 0)))
        ids = torch.from_numpy(np.asarray(read_tokens(token_file), np.int64))
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        profiles.append({i: (torch.cat(inputs[i]).numpy(), torch.cat(active[i]).numpy()) for i in range(len(modules))})
    weights = {i: mods["gate" if "gate" in mods else "up"].weight.detach().numpy().T for i, mods in enumerate(modules)}
    return profiles, weights


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_predict_pass_on_tiny_model(tiny_models, family):
    files = tiny_models(family, sparsity=0.9)  # the sparse models other files build too (made once a session)
    ctx = Context(get_target("cpu"), log=print)
    model = run_passes(load(files.onnx), [Import(), Recognise()], ctx)
    (profile, heldout), first_weights = torch_profiles(family, [files.calib, files.heldout])
    ffns = pir.nodes_in_domain(model, "FFN")
    for node in ffns:  # the hooked torch model is the one in the ONNX file
        layer = pir.attr(node, "layer")
        w_up = pir.const_array(node.inputs[1])
        np.testing.assert_allclose(w_up[:, : first_weights[layer].shape[1]], first_weights[layer], atol=1e-6)
    params = sum(pir.const_array(v).size for v in model.graph.initializers.values())

    profiled(profile).attach(model)
    model = run_passes(model, [Predict()], ctx, [verify_onnx])

    predictor_params = 0
    for node in ffns:
        layer = pir.attr(node, "layer")
        x, active = profile[layer]
        d, ffn = x.shape[1], active.shape[1]
        rank = pir.attr(node, "predictor_rank")
        w1 = pir.const_array(model.graph.initializers[f"layers.{layer}.ffn.predictor.w1"])
        w2 = pir.const_array(model.graph.initializers[f"layers.{layer}.ffn.predictor.w2"])
        assert w1.shape == (d, rank) and w2.shape == (rank, ffn) and w1.dtype == w2.dtype == np.float32
        predictor_params += w1.size + w2.size
        attrs = {k: pir.attr(node, f"predictor_{k}") for k in ("threshold", "recall", "precision", "active")}
        assert all(isinstance(v, float) for v in attrs.values())
        assert attrs["recall"] >= 0.95 and 0 < attrs["precision"] <= 1
        assert attrs["active"] < 0.3  # a tenth of the neurons fire: far below all-active
        # the stored threshold on the model's own held-out token file (never seen by training)
        fresh = predict_active(Predictor(w1, w2, attrs["threshold"], 0, 0, 0), *heldout[layer])
        assert fresh["recall"] >= 0.95 and fresh["predicted_active"] < 0.3, (layer, fresh)
    assert predictor_params <= 0.10 * params


def profiled(profile: dict) -> ProfiledActivations:
    """What the profile pass leaves on the IR, from torch's (inputs, active) per layer."""
    return ProfiledActivations({layer: LayerActivations.of(x, active) for layer, (x, active) in profile.items()})


def test_predict_pass_needs_every_layer_profiled(tiny_models):
    files = tiny_models("opt", sparsity=0.9)
    model = run_passes(load(files.onnx), [Import(), Recognise()], Context(get_target("cpu")))
    before = set(model.graph.initializers)
    with pytest.raises(ValueError, match="profile pass"):
        Predict().apply(model, Context(get_target("cpu")))
    profiled({0: (np.zeros((4, 64), np.float32), np.zeros((4, 256), bool))}).attach(model)  # layer 1 missing
    with pytest.raises(ValueError, match="layer 1 was not profiled"):
        Predict().apply(model, Context(get_target("cpu")))
    assert set(model.graph.initializers) == before
    assert all(pir.attr(n, "predictor_rank") is None for n in pir.nodes_in_domain(model, "FFN"))


def test_predict_pass_caps_the_ranks_at_the_budget(tiny_models):
    """The ranks that read least, unless their parameters exceed predictor_param_share."""
    files = tiny_models("opt", sparsity=0.9)
    (profile,), _ = torch_profiles("opt", [files.calib])

    x, active = profile[0]
    width = x.shape[1] + active.shape[1]  # predictor params per rank

    def ranks(share: float) -> tuple[list[int], int]:
        ctx = Context(get_target("cpu"))
        model = run_passes(load(files.onnx), [Import(), Recognise()], ctx)
        params = sum(v.const_value.size for v in model.graph.initializers.values())
        profiled(profile).attach(model)
        model = run_passes(model, [Predict(param_share=share)], ctx)
        return [pir.attr(node, "predictor_rank") for node in pir.nodes_in_domain(model, "FFN")], params

    free, params = ranks(0.5)
    used = sum(free) * width
    assert used < 0.5 * params and max(free) < x.shape[1], free  # the budget did not bind
    tight, _ = ranks(0.6 * used / params)
    assert sum(tight) * width <= 0.6 * used, (tight, free)
    assert all(t <= f for t, f in zip(tight, free)) and tight != free
