"""The quality budget: parsed once, met by the plan the build chooses, printed, confirmed by eval, and a budget that
cannot be met falls back and says so."""

from __future__ import annotations

import json

import numpy as np
import pytest

from passes.budget import parse_budget, ppl_change_interval
from runtime import load_manifest
from runtime.manifest import OUTPUT_LAYER, QualityBudget
from passes.errors import UserError


@pytest.mark.parametrize("text, kind, value", [("1%", "ppl", 0.01), ("0.03", "ppl", 0.03), ("kl=0.005", "kl", 0.005),
                                               ("KL=0", "kl", 0.0), (" 10% ", "ppl", 0.1)])
def test_budget_spellings(text, kind, value):
    assert parse_budget(text) == QualityBudget(kind, pytest.approx(value))


@pytest.mark.parametrize("text", ["", "abc", "-1%", "kl=1%", "ppl:1", "inf", "nan", "top1=0.9"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(UserError, match="--max-quality-loss must be"):
        parse_budget(text)


def test_bad_budget_on_the_command_line_is_one_error_line(tiny_models, tmp_path, capsys):
    from picompile.cli import main

    files = tiny_models("llama", hidden_act="silu")
    assert main(["build", str(files.onnx), "-o", str(tmp_path / "x.pic"), "--max-quality-loss", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--max-quality-loss" in err[0], err
    assert not (tmp_path / "x.pic").exists()


def test_the_interpreter_computes_what_onnxruntime_computes(tiny_models):
    """The plans are measured through passes.ir_reference: on the dense model it must be the source model."""
    from passes.import_onnx import Import
    from passes.front_end import load
    from passes.ir_reference import Interpreter
    from passes.recognise import Recognise
    from passes.pipeline import Context, Options
    from passes.reference import OrtDecoder
    from passes.targets import get_target

    for family, kwargs in (("llama", {"hidden_act": "silu"}), ("gpt2", {})):
        files = tiny_models(family, **kwargs)
        ctx = Context(get_target("cpu"), options=Options(max_context=64))
        lifted = Recognise().apply(Import().apply(load(files.onnx), ctx).model, ctx).model
        sequences = np.load(files.calib).reshape(-1)[:60].reshape(3, 20)
        got = Interpreter(lifted).logits(sequences).numpy()
        decoder = OrtDecoder(files.onnx)
        want = []
        for sequence in sequences:
            decoder.reset()
            want.append(decoder.run(sequence[None], ["logits"])["logits"][0])
        np.testing.assert_allclose(got, np.stack(want), atol=2e-5, rtol=1e-4)


def test_the_sampled_fisher_weighs_a_blocks_change_by_the_kl_it_causes(tiny_models):
    """The quality pass prices a change to one block's output by the Fisher information at that output
    (Interpreter.output_gradients): half the mean squared projection of the change on the sampled gradients is,
    to second order, the KL the change causes at the logits. Checked on one thresholded input per block of a
    tiny SwiGLU model, against the KL the whole model measures."""
    import torch

    from passes.front_end import load
    from passes.import_onnx import Import
    from passes.ir_reference import Interpreter, Variant
    from passes.ops import view as op_view
    from passes.pipeline import Context, Options
    from passes.recognise import Recognise
    from passes.targets import get_target

    files = tiny_models("llama", hidden_act="silu")
    ctx = Context(get_target("cpu"), options=Options(max_context=64))
    lifted = Recognise().apply(Import().apply(load(files.onnx), ctx).model, ctx).model
    sequences = np.load(files.calib).reshape(-1)[:128].reshape(4, 32)
    interpreter = Interpreter(lifted)
    gradients = interpreter.output_gradients(sequences, ("Attention", "FFN"), draws=64)
    dense = torch.log_softmax(interpreter.logits(sequences).double(), -1)
    blocks = {}  # node name -> (input, dense output), from one dense pass
    interpreter.logits(sequences, probe=lambda block: blocks.setdefault(block.node.name, (block.x, block.out)))
    estimates, measured = [], []
    for node in (n for n in lifted.graph if n.op_type in ("Attention", "FFN")):
        site = "qkv" if node.op_type == "Attention" else "in"
        x, out = blocks[node.name]
        taps = {}
        interpreter.block(node, x, taps=taps)
        threshold = float(taps[site].abs().flatten().quantile(0.2))
        variant = Variant({(op_view(node).layer, site): threshold}, prefill=0)
        estimates.append(Interpreter.fisher_kl(gradients[node.name], interpreter.block(node, x, variant) - out))
        got = torch.log_softmax(interpreter.logits(sequences, variant).double(), -1)
        measured.append(float((dense.exp() * (dense - got)).sum(-1).mean()))
    ratios = np.array(estimates) / np.array(measured)
    assert len(ratios) >= 4 and min(measured) > 0, measured
    assert np.all((ratios > 0.5) & (ratios < 2.0)), ratios


def test_the_budget_is_measured_on_the_tokens_the_profile_kept_out():
    """The held-out sequences are the user's last ones the profile kept out of every fit (`measured`), whatever
    their lengths, run in batches of one length; the fitting ones come from the rest."""
    from passes.profile import CalibrationSequences
    from passes.quality import _batches, _split

    sampled = [np.full(8, i) for i in range(6)]
    given = [np.full(4, 10 + i) for i in range(5)] + [np.full(3, 20)]
    fit, held = _split(CalibrationSequences(sampled + given, measured=3))
    assert [int(s[0]) for s in held] == [13, 14, 20]
    assert fit.shape[1] == 8 and set(fit[:, 0]) <= set(range(6))
    assert [c.shape for c in _batches(held)] == [(2, 4), (1, 3)]


def test_a_larger_model_measures_on_fewer_tokens_spread_across_the_held_out_ones():
    """Past TOKEN_PARAMETERS the held-out and fitting tokens shrink with the model's parameters (never below the
    MIN_ ones), the held-out sequences taken evenly across those the profile kept out; a small model keeps all."""
    from passes import quality
    from passes.profile import CalibrationSequences

    sampled = [np.full(128, i) for i in range(8)]
    given = [np.full(128, 100 + i) for i in range(16)]
    calibration = CalibrationSequences(sampled + given, measured=16)
    fit, held = quality._split(calibration, int(quality.TOKEN_PARAMETERS))
    assert [int(s[0]) for s in held] == list(range(100, 116)) and fit.shape == (4, 128)
    fit, held = quality._split(calibration, int(2.5 * quality.TOKEN_PARAMETERS))  # 2,048 / 2.5: about 6 of 16
    assert [int(s[0]) for s in held] == [101, 104, 106, 109, 112, 114]
    assert fit.shape == (1, 128)  # 512 / 2.5 = 204 tokens: one sequence
    fit, held = quality._split(calibration, int(100 * quality.TOKEN_PARAMETERS))
    assert len(held) * 128 == quality.MIN_HELD_OUT_TOKENS and fit.shape == (1, 128)


@pytest.fixture(scope="module")
def trained_text(tmp_path_factory):
    """The ReLU text model's tiny preset (trained here in seconds): real, learned sparsity."""
    from examples import text_model

    return text_model.cached_text_model("tiny", seed=0, threads=1)


def _build(files, out, *args):
    from picompile.cli import main

    assert main(["build", str(files.onnx), "-o", str(out), "--calib", str(files.calib), "--max-context", "64",
                 *args]) == 0
    return load_manifest(out)


def _eval(files, out, capsys) -> dict:
    from picompile.cli import main

    capsys.readouterr()
    assert main(["eval", str(out), "--reference", str(files.onnx), "--tokens", str(files.heldout),
                 "--max-sequences", "4", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


LINEAR_PATH = np.linspace(0.0, 1.0, 121)
# SmolLM2's fp32 path: 701 moves, the summed local error (an estimate of the KL) 0.01 after 89, 0.09 after 241, 5.0
# at the end, where the ppl change is +150,000%
SMOLLM2_PATH = 5.0 * (np.arange(701) / 700) ** 3.5


@pytest.mark.parametrize("curve, local_error", [
    (lambda x: 0.5 * x, LINEAR_PATH), (lambda x: 0.5 * x ** 2, LINEAR_PATH), (lambda x: 0.5 * x ** 3, LINEAR_PATH),
    (lambda x: 0.5 * x ** 4, LINEAR_PATH), (lambda x: 0.02 * np.expm1(5 * x), LINEAR_PATH),
    (lambda x: 0.8 * x * np.exp(x), SMOLLM2_PATH), (lambda x: 1.3 * x * np.exp(2 * x), SMOLLM2_PATH),
    # ... whose first steps measure as noise (a ppl change of -0.3% where the KL is 1e-4)
    (lambda x: 0.8 * x * np.exp(x) - 0.003 * np.cos(40 * x), SMOLLM2_PATH),
    # ... and concave where the budget is (SmolLM2's int4 path: moves to int8 cost more than their local errors)
    (lambda x: 3 * np.sqrt(x), SMOLLM2_PATH)])
def test_the_path_search_spends_the_budget_in_a_few_measured_plans(curve, local_error):
    """Quality grows faster than linearly along the path: the search still lands within a few steps of the furthest
    plan within the budget, measuring at most MAX_EVALUATIONS plans (a straight-line search stopped at +6.6% of a
    10% budget on x**3, at +4.1% on x**4; one aimed from step 0 at a far end at +3% of a 10% budget)."""
    from passes.ir_reference import Quality
    from passes.quality import MAX_EVALUATIONS, _furthest_within

    steps, measured = len(local_error), set()

    def evaluate(step):
        measured.add(step)
        value = float(curve(local_error[step]))
        return Quality(value, float(np.log1p(value)), 1.0, 100, value, value)  # the KL's figure: the same

    step, found = _furthest_within(QualityBudget("ppl", 0.10), local_error, evaluate)
    furthest = max(k for k in range(steps) if curve(local_error[k]) <= 0.10)
    assert found.ppl_change <= 0.10 and step <= furthest, (step, furthest)
    # within two steps of the furthest; on SmolLM2's fine-grained path, or at the 0.9 of the budget it aims at
    fine = local_error is SMOLLM2_PATH and found.ppl_change >= 0.085
    assert step >= furthest - 2 or fine, (step, furthest, found.ppl_change)
    assert len(measured) <= MAX_EVALUATIONS


def test_a_path_that_ends_far_beyond_the_budget_is_searched_without_measuring_its_end():
    """SmolLM2's int4 default path: 30 moves, its summed local error 340 times a 1% budget's aim at the end, a plan
    whose measuring took a quarter of the build. The search leaves it unmeasured (the summed local errors say it
    is far beyond) and still lands within two steps of the furthest within."""
    from passes.ir_reference import Quality
    from passes.quality import FAR_END, MAX_EVALUATIONS, _furthest_within

    local_error = np.concatenate([[0.0], np.linspace(0.027, 3.0, 30)])
    budget = QualityBudget("ppl", 0.01)
    assert local_error[-1] > FAR_END * 0.9 * budget.value
    measured = set()

    def evaluate(step):
        measured.add(step)
        kl = 0.002 + 0.01 * local_error[step]  # the KL grows with the local error, from the format's 0.002
        return Quality(float(np.expm1(kl)), kl, 1.0, 100, 0.0, 0.0)

    step, found = _furthest_within(budget, local_error, evaluate)
    assert len(local_error) - 1 not in measured and len(measured) <= MAX_EVALUATIONS, measured
    furthest = max(k for k in range(len(local_error)) if np.expm1(0.002 + 0.01 * local_error[k]) <= 0.01)
    assert furthest - 2 <= step <= furthest and budget.met_by(found.ppl_change, found.kl), (step, furthest)


def test_a_path_whose_start_is_expected_beyond_the_budget_measures_its_start_first():
    """Where the summed local error of the path's start (dense, the widest formats) is beyond the aim already, the
    start is measured first: beyond the budget, it is the answer and nothing else is measured (a random model's
    int8 activations: five plans, every one beyond); within it, the search goes on as before."""
    from passes.ir_reference import Quality
    from passes.quality import MAX_EVALUATIONS, _furthest_within

    local_error = np.linspace(0.02, 1.0, 21)
    budget = QualityBudget("ppl", 0.01)
    for scale, within in ((1.0, False), (0.05, True)):
        measured = []

        def evaluate(step):
            measured.append(step)
            change = scale * local_error[step]
            return Quality(change, float(np.log1p(change)), 1.0, 100, change, change)

        step, found = _furthest_within(budget, local_error, evaluate)
        assert measured[0] == 0 and budget.met_by(found.ppl_change, found.kl) == within
        assert (step, measured) == (0, [0]) if not within else step > 0 and len(measured) <= MAX_EVALUATIONS + 1


def test_a_plan_searched_on_part_of_the_held_out_text_is_judged_on_all_of_it():
    """The search aims on a part of the held-out tokens; the plan it lands on is measured on all of them, and where
    that puts it beyond the budget the step at half its summed local error is taken (measured on all too); a
    search on the whole text is not measured again."""
    from passes.ir_reference import Quality
    from passes.quality import _confirmed

    local_error = np.linspace(0.0, 1.0, 11)
    budget = QualityBudget("ppl", 0.01)
    measured = []

    def on_all(scale):
        def evaluate(step):
            measured.append(step)
            change = scale * local_error[step]
            return Quality(change, float(np.log1p(change)), 1.0, 100, change, change)
        return evaluate

    # the part said step 8 (+0.8%); the whole says +1.2% there: back to step 4 (+0.6%)
    step, found = _confirmed(budget, local_error, on_all(0.015), True, (8, Quality(0.008, 0.008, 1.0, 50, 0, 0)))
    assert (step, measured) == (4, [8, 4]) and found.ppl_change == pytest.approx(0.006)
    # the whole agrees: step 8 stays, measured once more
    measured.clear()
    step, found = _confirmed(budget, local_error, on_all(0.01), True, (8, Quality(0.008, 0.008, 1.0, 50, 0, 0)))
    assert (step, measured) == (8, [8]) and found.tokens == 100
    # searched on the whole already: nothing measured again
    measured.clear()
    searched = (8, Quality(0.008, 0.008, 1.0, 100, 0, 0))
    assert _confirmed(budget, local_error, on_all(0.015), False, searched) == searched and not measured


def test_the_ppl_change_interval_covers_the_true_change_about_19_times_in_20():
    """Sequences whose per-token log-likelihood change has a known mean, drawn many times: the 95% interval
    (standard error over whole sequences) holds the true change about 95% of the time; tokens of a sequence
    share a common part, which an interval over tokens would miss. One sequence: the point, no spread."""
    rng = np.random.default_rng(0)
    true, covered, token_wise = 0.03, 0, 0
    for _ in range(400):
        counts = rng.integers(100, 140, size=8)
        # per sequence: a shared shift (the passage) plus independent per-token noise
        per_token = [true + rng.normal(0, 0.05) + rng.normal(0, 0.3, size=n) for n in counts]
        got = np.array([d.sum() for d in per_token])
        change, low, high = ppl_change_interval(got, np.zeros(8), counts)
        assert low <= change <= high
        covered += low <= np.expm1(true) <= high
        flat = np.concatenate(per_token)
        half = 1.96 * flat.std(ddof=1) / np.sqrt(len(flat))  # the naive interval, every token independent
        token_wise += np.expm1(flat.mean() - half) <= np.expm1(true) <= np.expm1(flat.mean() + half)
    assert 0.92 <= covered / 400 <= 0.98, covered
    assert token_wise / 400 < 0.85, token_wise  # why the interval is taken over sequences
    change, low, high = ppl_change_interval(np.array([5.0]), np.array([4.0]), np.array([100]))
    assert low == change == high == pytest.approx(np.expm1(0.01))


def test_quality_is_judged_on_the_logits_generation_reads():
    """eval (and the quality pass, by the same budget.scored_positions) scores a sequence from its prompt's last
    position on: a compiled model wrong only at the prompt's earlier positions, whose logits generation never
    reads, scores as the reference; wrong at the prompt's last, it does not."""
    from passes.budget import PROMPT_TOKENS
    from picompile.evaluate import compare

    rng = np.random.default_rng(0)
    sequence = rng.integers(0, 50, size=12)
    reference = rng.normal(size=(12, 50)).astype(np.float32)
    wrong_early = reference.copy()
    wrong_early[: PROMPT_TOKENS - 1] = rng.normal(size=(PROMPT_TOKENS - 1, 50))
    early = compare(reference, wrong_early, sequence)
    assert early["positions"] == 12 - PROMPT_TOKENS  # the prompt's last predicts the first decoded token
    assert early["kl_sum"] == pytest.approx(0.0, abs=1e-9) and early["top1_agree"] == early["positions"]
    assert early["nll_compiled"] == pytest.approx(early["nll_reference"])
    wrong_last = reference.copy()
    wrong_last[PROMPT_TOKENS - 1] = rng.normal(size=50)
    assert compare(reference, wrong_last, sequence)["kl_sum"] > 0.01
    assert compare(reference, reference, sequence[:2])["positions"] == 1  # too short: its last position


def test_a_ppl_budget_holds_a_plan_to_its_kl_too():
    """A perplexity budget judges a plan on the larger of its held-out ppl change and exp(KL) - 1: a plan whose
    held-out tokens happened to favour it (ppl +0.5%) but whose KL says +2% misses a 1% budget; a KL budget
    reads the KL alone."""
    budget = QualityBudget("ppl", 0.01)
    assert budget.met_by(0.005, 0.004) and not budget.met_by(0.005, 0.02) and not budget.met_by(0.02, 0.001)
    assert budget.judged(0.005, np.log1p(0.02)) == pytest.approx(0.02)
    assert budget.judged(0.0, 5000.0) > 1e300  # a path's far end: no overflow
    assert QualityBudget("kl", 0.01).met_by(0.5, 0.009) and not QualityBudget("kl", 0.01).met_by(0.0, 0.011)


def test_trained_relu_model_meets_its_budget_and_eval_confirms_it(trained_text, tmp_path, capsys):
    """Predictor mode: the recall per layer is chosen within the budget (--target-recall its floor); the build
    prints what it expects and eval, on held-out text the build never saw, measures about that."""
    manifest = _build(trained_text, tmp_path / "loose.pic", "--max-quality-loss", "kl=0.05", "--target-recall", "0.9")
    quality = manifest.quality
    assert quality.met and quality.kl <= 0.05 and quality.budget == QualityBudget("kl", 0.05)
    printed = capsys.readouterr().out
    assert "expected quality:" in printed
    # the expected ppl change with its 95% interval over the held-out sequences, printed and carried to eval
    assert quality.ppl_low <= quality.ppl_change <= quality.ppl_high and quality.ppl_high > quality.ppl_low
    assert f"95%: {quality.ppl_low * 100:+.1f}..{quality.ppl_high * 100:+.1f}%" in printed
    report = _eval(trained_text, tmp_path / "loose.pic", capsys)
    assert report["expected_kl"] == pytest.approx(quality.kl)
    assert (report["expected_ppl_low"], report["expected_ppl_high"]) == pytest.approx(
        (quality.ppl_low, quality.ppl_high))
    assert report["ppl_change_low"] <= report["ppl_change"] <= report["ppl_change_high"], report
    assert report["kl_mean"] < 2 * 0.05, report
    recalls = [layer.predictor_recall for layer in manifest.layers if layer.predictor_recall is not None]
    assert recalls and min(recalls) >= 0.85, recalls
    # a tighter budget: never a lower recall in any layer, and the expectation within it
    tight = _build(trained_text, tmp_path / "tight.pic", "--max-quality-loss", "kl=0.0005", "--target-recall", "0.9")
    assert tight.quality.kl <= 0.0005 or not tight.quality.met
    tight_recalls = [layer.predictor_recall for layer in tight.layers if layer.predictor_recall is not None]
    assert sum(tight_recalls) >= sum(recalls) - 1e-6, (tight_recalls, recalls)


def test_threshold_plan_spends_the_budget_on_more_sparsity(tiny_models, tmp_path, capsys, monkeypatch):
    """Threshold mode: a larger budget buys more dropped inputs (attention's inputs among the choices), each level
    measured; the build's expectation stays within each budget. A tiny model's matrices are read in a microsecond,
    where the column kernel's fixed cost makes every level dearer than dense (the next test); without that cost
    bytes decide, as they do at real sizes."""
    from passes import costmodel

    monkeypatch.setattr(costmodel, "COLUMN_CALL_S", 0.0)
    monkeypatch.setattr(costmodel, "PRICE_ERROR", 0.0)  # (the next tests: a plan within the model's error)
    files = tiny_models("llama", hidden_act="silu")
    plans = {}
    for budget in ("kl=0.00005", "kl=0.01"):
        manifest = _build(files, tmp_path / f"{budget}.pic", "--max-quality-loss", budget)
        quality = manifest.quality
        assert quality.met and quality.kl <= float(budget.split("=")[1]), quality
        plans[budget] = quality
    dropped = {b: float(q.plan.split("dropping ")[1].split(" ")[0]) * int(q.plan.split(" of ")[0])
               for b, q in plans.items()}
    assert dropped["kl=0.01"] > dropped["kl=0.00005"], plans


def test_each_knobs_choice_is_shown_with_its_measured_cost(tiny_models, tmp_path, capsys, monkeypatch):
    """The manifest carries each linear input's choice as typed data (`MatrixChoice`): its stored format, the share
    it drops, the KL it alone adds and its decode microseconds against dense. A sparse choice adds KL and saves
    time, a dense one neither; an int8 build's formats are those the quantize pass stored; `-v` and `inspect` print
    them per layer; --sparsity's fixed level is not measured, and says so."""
    from passes import costmodel
    from picompile.cli import main

    monkeypatch.setattr(costmodel, "COLUMN_CALL_S", 0.0)  # (bytes decide, as at real sizes: some levels pay)
    monkeypatch.setattr(costmodel, "PRICE_ERROR", 0.0)  # (and pay, however little)
    files = tiny_models("llama", hidden_act="silu")
    capsys.readouterr()
    manifest = _build(files, tmp_path / "loose.pic", "--max-quality-loss", "kl=0.01", "-v")
    built = capsys.readouterr().err
    choices = manifest.quality.choices
    # every block's four linear inputs and the output layer's, last
    assert len(choices) == 9 and {c.site for c in choices} == {"qkv", "o", "in", "down", "head"}, choices
    assert choices[-1].site == "head" and choices[-1].layer == OUTPUT_LAYER, choices
    assert manifest.quality.layer_lines()[-1].startswith("in the output layer: head "), manifest.quality.layer_lines()
    sparse = [c for c in choices if c.dropped > 0]
    assert sparse and all(c.kl > 0 and c.us < c.dense_us for c in sparse), choices
    assert all(c.kl == 0 and c.us == c.dense_us and c.format == "fp32" for c in choices if c.dropped == 0), choices
    assert all(line in built for line in manifest.quality.layer_lines()), built
    assert main(["inspect", str(tmp_path / "loose.pic")]) == 0
    shown = capsys.readouterr().out
    assert all(line in shown for line in manifest.quality.layer_lines()), shown

    int8 = _build(files, tmp_path / "int8.pic", "--weight-dtype", "int8", "--max-quality-loss", "kl=0.01")
    stored = {(c.layer, c.site): c.format for c in int8.quality.choices}
    names = {"qkv": "attn.w_qkv", "o": "attn.w_o", "in": "ffn.w_up", "down": "ffn.w_down"}
    for (layer, site), fmt in stored.items():
        prefix = "lm_head.weight" if site == "head" else f"layers.{layer}.{names[site]}"
        buffer = next(info for name, info in int8.buffers.items() if name.startswith(prefix))
        assert (buffer.format or {"float16": "fp16", "float32": "fp32"}[buffer.dtype]) == fmt, (layer, site, buffer)

    fixed = _build(files, tmp_path / "fixed.pic", "--sparsity", "0.5")
    assert all(c.kl is None for c in fixed.quality.choices) and "KL -" in fixed.quality.layer_lines()[0]


def test_a_plan_whose_whole_gain_is_within_the_cost_models_error_stays_dense(tiny_models, tmp_path, monkeypatch):
    """Without the column kernel's fixed cost some levels of a tiny model pay alone (the tests above), but all the
    plan takes saves less than the cost model's error of the linear layers' time: every input stays dense, the
    quality is the dense build's, and the plan says why."""
    from passes import costmodel

    monkeypatch.setattr(costmodel, "COLUMN_CALL_S", 0.0)
    files = tiny_models("llama", hidden_act="silu")
    manifest = _build(files, tmp_path / "loose.pic", "--max-quality-loss", "kl=0.01")
    quality = manifest.quality
    assert "linear inputs sparse (none)" in quality.plan and "no plan on its path thins inputs that save more than " \
        "the cost model's error (10%) of the linear layers' time: kept dense" in quality.plan, quality.plan
    assert all(c.dropped == 0 for c in quality.choices) and quality.kl == 0, quality
    assert all(not layer.sparsity_in and not layer.sparsity_o for layer in manifest.layers), manifest.layers


def test_the_search_starts_where_the_path_pays():
    """On a path of thresholds alone, the plans before the first whose thinned inputs save more than the cost
    model's error of the linear layers' time would be kept dense: the search starts at that step (on the real 0.5B
    file it measured four such plans, a minute of the build), or measures none where no step pays."""
    from types import SimpleNamespace

    from passes.quality import _first_paying

    # two knobs, dense 100 us each; level 1 of the first saves 6 us, of the second 10 us; level 2 of the first 20 us
    knobs = [SimpleNamespace(cost=np.array([[100.0], [94.0], [80.0]]), predictor=None),
             SimpleNamespace(cost=np.array([[100.0], [90.0], [90.0]]), predictor=None)]
    start = [(0, 0), (0, 0)]
    assert _first_paying(knobs, start, [(0, 1, 0), (1, 1, 0), (0, 2, 0)]) == 3  # saves 3%, 8%, 15%
    assert _first_paying(knobs, start, [(0, 2, 0), (1, 1, 0)]) == 2  # 10% is within the error; 15% is not
    assert _first_paying(knobs, start, [(0, 1, 0), (1, 1, 0)]) is None


def test_threshold_levels_that_do_not_pay_stay_dense(tiny_models, tmp_path):
    """At the column kernel's real fixed cost a tiny model's thresholded matrices would be slower than dense ones:
    however large the budget, the plan keeps every linear input dense, and the estimate says it is as fast as dense."""
    files = tiny_models("llama", hidden_act="silu")
    manifest = _build(files, tmp_path / "loose.pic", "--max-quality-loss", "kl=0.01")
    assert "linear inputs sparse (none)" in manifest.quality.plan, manifest.quality
    assert all(not layer.sparsity_in and not layer.sparsity_o for layer in manifest.layers), manifest.layers
    # and the estimate prices that plan as the dense build it is (the KV cache read on both sides)
    estimate = manifest.estimate
    assert estimate["picompile_tokens_per_s"] >= 0.99 * estimate["cpu_only_tokens_per_s"], estimate


def test_levels_that_do_not_pay_are_not_measured(tiny_models, tmp_path, monkeypatch):
    """A level the cost model prices at no saving in any format is never on the path, so the quality pass does not
    measure its local effect (on int4 SmolLM2, 240 of 270 FFN levels and every attention level; there it was a
    third of the pass): a tiny float model, where no level pays, weighs nothing (no gradients drawn) and is built
    dense; and a level left unmeasured counts as infinitely bad, while measured ones never fall with sparsity."""
    from passes.ir_reference import Interpreter
    from passes.quality import _monotone

    drawn = []
    gradients = Interpreter.output_gradients
    monkeypatch.setattr(Interpreter, "output_gradients", lambda self, *a, **k: drawn.append(a) or gradients(self, *a, **k))
    files = tiny_models("llama", hidden_act="silu")
    manifest = _build(files, tmp_path / "dense.pic", "--max-quality-loss", "kl=0.01")
    assert drawn == [] and "linear inputs sparse (none)" in manifest.quality.plan, (drawn, manifest.quality.plan)
    # an int8 build chooses formats too: every block is weighed
    _build(files, tmp_path / "int8.pic", "--weight-dtype", "int8", "--max-quality-loss", "kl=0.01")
    assert len(drawn) == 1 and set(drawn[0][1]) == {"Attention", "FFN"}, drawn
    np.testing.assert_array_equal(_monotone([0.0, np.nan, 0.2, 0.1, np.nan, -1.0]),
                                  [0.0, np.inf, 0.2, 0.2, np.inf, 0.2])


def test_a_budget_no_plan_meets_falls_back_and_says_so(tiny_models, tmp_path, capsys):
    """kl=0 for an int8 build: even fp16 matrices differ a little from fp32, so no plan meets it: the build
    makes the densest, widest one, warns, and the manifest says the budget was missed."""
    files = tiny_models("llama", hidden_act="silu")
    manifest = _build(files, tmp_path / "zero.pic", "--weight-dtype", "int8", "--max-quality-loss", "kl=0")
    err = capsys.readouterr().err
    assert "misses the budget (KL 0)" in err, err
    assert not manifest.quality.met
    assert "0 of 9 linear inputs sparse" in manifest.quality.plan  # (the output layer's among them)


def test_a_fixed_sparsity_over_the_budget_is_built_as_asked_and_said(tiny_models, tmp_path, capsys):
    """--sparsity is the user's level: a budget it misses gets a warning, not a denser build."""
    files = tiny_models("llama", hidden_act="silu")
    manifest = _build(files, tmp_path / "fixed.pic", "--sparsity", "0.5", "--max-quality-loss", "kl=0")
    assert "the --sparsity level misses the budget (KL 0)" in capsys.readouterr().err
    assert not manifest.quality.met and manifest.quality.kl > 0
    assert all(layer.threshold_in >= 0 and layer.sparsity_in > 0.3 for layer in manifest.layers)


def test_a_thresholded_matrix_is_priced_as_its_column_kernel_runs():
    """The prices the quality pass orders its moves by (BENCHMARKS.md, the column constants): a level that keeps
    90% of a 3.5 MB matrix's short rows costs more than the dense GEMV (the kernel's fixed cost alone), one
    that keeps a third less; long float rows stream faster per byte than short ones; 4-bit rows on a VNNI
    CPU at the measured share of the dense GEMV over int8 activations."""
    from passes import costmodel

    bandwidth, stored = 30e9, 1536 * 576 * 4.0  # SmolLM2's down projection in fp32
    dense = costmodel.linear_seconds(stored, bandwidth)
    efficiency = costmodel.column_row_efficiency(576 * 4, 0, "vnni")
    assert costmodel.column_seconds(stored, bandwidth, 0.9, efficiency) > dense
    assert costmodel.column_seconds(stored, bandwidth, 0.33, efficiency) < dense
    assert costmodel.column_row_efficiency(12288, 0, None) > costmodel.column_row_efficiency(2304, 0, None)
    assert costmodel.column_row_efficiency(1728, 4, "vnni") == costmodel.QUANT_COLUMN_ROW_EFFICIENCY
    assert costmodel.column_row_efficiency(1728, 4, "madd") != costmodel.QUANT_COLUMN_ROW_EFFICIENCY


def test_the_output_layers_levels_are_its_exact_kl_measured_up_to_the_first_over_the_limit():
    """The output layer's knob: each level's local error is the KL its thresholded input causes at the logits (its
    own output), exactly; levels past the first whose KL is over the limit (HEAD_LIMIT times the budget) are not
    measured, so the path never takes them; a level that does not pay is not measured either."""
    from types import SimpleNamespace

    import torch

    from passes.ir_reference import Block
    from passes.quality import LEVELS, _head_knob

    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 32, 16, generator=generator), torch.randn(16, 50, generator=generator)
    node = SimpleNamespace(inputs=[None, SimpleNamespace(name="lm_head.weight")], op_type="MatMul")
    interpreter = SimpleNamespace(weight=lambda value: weight)
    block = Block(node, x, x @ weight, None)
    paying = np.ones(len(LEVELS), bool)

    every = _head_knob(interpreter, block, ("fp32",), None, paying, limit=np.inf)
    assert np.isfinite(every.sparse_error).all() and (np.diff(every.sparse_error) >= 0).all()
    level = 3
    kept = x * (x.abs() > float(every.thresholds[level]))
    reference, got = (torch.log_softmax(v.double(), -1) for v in (x @ weight, kept @ weight))
    exact = float((reference.exp() * (reference - got)).sum(-1).mean())
    assert every.sparse_error[level] == pytest.approx(exact, rel=1e-9) and exact > 0

    limit = float(every.sparse_error[level]) * 0.99  # level 3 is the first over it
    limited = _head_knob(interpreter, block, ("fp32",), None, paying, limit=limit)
    np.testing.assert_allclose(limited.sparse_error[: level + 1], every.sparse_error[: level + 1])
    assert np.isinf(limited.sparse_error[level + 1:]).all(), limited.sparse_error
    paying[1] = False
    assert np.isinf(_head_knob(interpreter, block, ("fp32",), None, paying, limit=np.inf).sparse_error[1])
