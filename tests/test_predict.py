"""The predict pass: rank choice, predictor training, and the pass on the tiny synthetic models."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from passes.import_onnx import Import, load
from passes.predict import Predict, Predictor, _threshold_for_recall, choose_ranks, predict_active, train_predictor
from passes.recognise import Recognise
from picompile import ir as pir
from picompile.pipeline import Context, Options, run_passes, verify_onnx
from picompile.targets import get_target

torch.set_num_threads(2)


def good_enough(scores) -> bool:
    """What a useful predictor must reach: high recall while predicting well under half the neurons."""
    return scores.recall >= 0.95 and scores.predicted_active < 0.3


# ---------------------------------------------------------------- choose_ranks


def test_choose_ranks_stays_within_budget_and_favours_hard_layers():
    d, ffn = 768, [3072] * 4
    sparsity = [0.9, 0.9, 0.8, 0.9]  # layer 2 is denser
    skew = [0.6, 0.3, 0.6, 0.6]  # layer 1 is less skewed
    budget = 4 * 200 * (d + 3072)
    ranks = choose_ranks(d, ffn, sparsity, skew, budget)
    assert sum(r * (d + f) for r, f in zip(ranks, ffn)) <= budget
    assert budget - sum(r * (d + f) for r, f in zip(ranks, ffn)) < 16 * (d + 3072)  # nothing left unspent
    assert all(r % 16 == 0 and r >= 16 for r in ranks)
    assert ranks[2] > ranks[0] and ranks[1] > ranks[0]
    assert ranks[0] == ranks[3]
    # a cap, and a budget too small for the floor everywhere
    assert max(choose_ranks(d, ffn, sparsity, skew, budget, max_rank=128)) == 128
    tight = choose_ranks(d, ffn, sparsity, skew, 4 * 12 * (d + 3072))
    assert sum(r * (d + f) for r, f in zip(tight, ffn)) <= 4 * 12 * (d + 3072) and min(tight) >= 8


# ---------------------------------------------------------------- train_predictor


def low_rank_layer(d=64, ffn=512, rank=16, noise=0.1, mean_p=0.1, seed=0):
    """A synthetic FFN layer: x ~ N(0, I_d), pre-activation = x @ A (rank 16) + small noise + per-neuron
    bias, the biases giving Zipf-distributed activation probabilities with mean 0.1.
    Returns draw(n, seed) -> (x [n, d] float32, active [n, ffn] bool, pre-activations [n, ffn])."""
    from examples.models import activation_probs

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((d, rank)) @ rng.standard_normal((rank, ffn)) / np.sqrt(d * rank)
    scale = np.sqrt((a * a).sum(0))
    p = activation_probs(ffn, mean_p, "zipf", rng=rng)
    normal = statistics.NormalDist()
    bias = np.array([normal.inv_cdf(pj) for pj in p]) * scale * np.sqrt(1 + noise**2)

    def draw(n, draw_seed):
        r = np.random.default_rng(draw_seed)
        x = r.standard_normal((n, d))
        pre = x @ a + noise * scale * r.standard_normal((n, ffn)) + bias
        return x.astype(np.float32), pre > 0, pre.astype(np.float32)

    return draw


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


def test_train_predictor_is_deterministic():
    x, active, _ = low_rank_layer(ffn=128)(1024, 3)
    first = train_predictor(x, active, 16, epochs=3, seed=5)
    again = train_predictor(x, active, 16, epochs=3, seed=5)
    other = train_predictor(x, active, 16, epochs=3, seed=6)
    np.testing.assert_array_equal(first.w1, again.w1)
    np.testing.assert_array_equal(first.w2, again.w2)
    assert first.threshold == again.threshold
    assert not np.array_equal(first.w2, other.w2)


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
    files = tiny_models(family, "legacy", sparsity=0.9)  # legacy: exports in ~1 s, dynamo in ~20 s
    ctx = Context(get_target("cpu"), Options(), log=print)
    model = run_passes(load(files.onnx), [Import(), Recognise()], ctx)
    (profile, heldout), first_weights = torch_profiles(family, [files.calib, files.heldout])
    ffns = pir.nodes_in_domain(model, "FFN")
    for node in ffns:  # the hooked torch model is the one in the ONNX file
        layer = pir.attr(node, "layer")
        w_up = pir.const_array(node.inputs[1])
        np.testing.assert_allclose(w_up[:, : first_weights[layer].shape[1]], first_weights[layer], atol=1e-6)
    params = sum(pir.const_array(v).size for v in model.graph.initializers.values())

    ctx.profile = profile
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


def test_predict_pass_leaves_dense_and_unprofiled_models_alone(tiny_models):
    files = tiny_models("opt", "legacy", sparsity=0.9)
    model = run_passes(load(files.onnx), [Import(), Recognise()], Context(get_target("cpu")))
    before = set(model.graph.initializers)
    assert not Predict().apply(model, Context(get_target("cpu"))).modified
    ctx = Context(get_target("cpu"), Options(dense=True))
    ctx.profile = {0: (np.zeros((4, 64), np.float32), np.zeros((4, 256), bool))}
    assert not Predict().apply(model, ctx).modified
    assert set(model.graph.initializers) == before
    assert all(pir.attr(n, "predictor_rank") is None for n in pir.nodes_in_domain(model, "FFN"))


def test_predict_pass_sizes_predictors_from_the_profile_attributes(tiny_models):
    """Sparsity and skewness written on the FFN nodes (by the profile pass) decide the ranks."""
    import onnx_ir as ir

    files = tiny_models("opt", "legacy", sparsity=0.9)
    ctx = Context(get_target("cpu"), Options(predictor_param_share=0.25))
    model = run_passes(load(files.onnx), [Import(), Recognise()], ctx)
    (ctx.profile,), _ = torch_profiles("opt", [files.calib])
    easy, hard = pir.nodes_in_domain(model, "FFN")
    for node, sparsity, skew in ((easy, 0.97, 0.9), (hard, 0.6, 0.1)):
        node.attributes["sparsity"] = ir.AttrFloat32("sparsity", sparsity)
        node.attributes["skewness"] = ir.AttrFloat32("skewness", skew)
    model = run_passes(model, [Predict()], ctx)
    ranks = [pir.attr(node, "predictor_rank") for node in (easy, hard)]
    assert ranks[1] > ranks[0] >= 16, ranks
    assert sum(r * (64 + 256) for r in ranks) <= 0.25 * sum(
        v.const_value.size for name, v in model.graph.initializers.items() if ".predictor." not in name)
