"""The quality pass's reference without model-sized arrays: logits summarised a vocabulary slice at a time
(passes/streamed_logits.py), weights read on use within a byte budget, the embedding's rows and the output layer's
columns read from a file's blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf_files as gf
from passes.budget import predicted_tokens, scored_positions
from passes.front_end import load
from passes.ir_reference import Interpreter, Variant
from passes.pipeline import Context, Options
from passes.recognise import Recognise
from passes.streamed_logits import Logits
from passes.targets import get_target

T = gf.T
# a file's blocks everywhere, the embedding table tied to the output layer (read by rows, then by columns)
TIED = gf.Tiny(d_model=256, heads=4, kv_heads=2, ffn=512, vocab=300, tied=True, formats={
    "attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.Q5_K,
    "ffn_up": T.Q5_K, "ffn_down": T.Q6_K, "token_embd": T.Q8_0})


def test_a_summary_of_slices_is_the_whole_vocabularys():
    """Folded in uneven slices, the log-normalizer, argmax, chosen columns' logits and KL from a reference are
    those of the whole array."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 1000, generator=generator) * 4
    reference = logits + torch.randn(37, 1000, generator=generator) * 0.1
    at = torch.randint(0, 1000, (37, 3), generator=generator)
    bounds = [0, 1, 257, 300, 999, 1000]
    summary = Logits.of(((a, logits[:, a:b], reference[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])), 37, at=at,
                        reference=torch.logsumexp(reference.double(), 1))
    torch.testing.assert_close(summary.log_normalizer, torch.logsumexp(logits.double(), 1), rtol=0, atol=1e-12)
    assert torch.equal(summary.argmax, logits.argmax(1))
    assert torch.equal(summary.at_values, logits.gather(1, at).double())
    p, q = torch.log_softmax(reference.double(), 1), torch.log_softmax(logits.double(), 1)
    torch.testing.assert_close(summary.kl_from_reference, (p.exp() * (p - q)).sum(1), rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def lifted(tmp_path_factory):
    from passes.import_gguf import ImportGGUF

    path = tmp_path_factory.mktemp("streamed") / "tied.gguf"
    gf.write(path, TIED)
    ctx = Context(get_target("cpu"), options=Options(max_context=64))
    return Recognise().apply(ImportGGUF().apply(load(path), ctx).model, ctx).model


def _sequences(count: int = 3, length: int = 24) -> np.ndarray:
    return np.random.default_rng(1).integers(0, TIED.vocab, (count, length))


def test_weights_read_on_use_within_a_budget_give_the_same_logits(lifted):
    """With no weight kept between reads (every matrix dequantized from the file's blocks when read, the
    embedding's rows only, the output layer a slice of columns at a time), the logits are those of an
    interpreter that keeps every weight; and what it keeps stays within its budget."""
    sequences = _sequences()
    keeps_all = Interpreter(lifted, resident_bytes=1 << 40)
    want = keeps_all.logits(sequences)
    none_kept = Interpreter(lifted, resident_bytes=0)
    assert torch.equal(none_kept.logits(sequences), want)
    assert none_kept._resident.bytes == 0 and keeps_all._resident.bytes > 0
    x = none_kept.head_input(sequences)
    streamed = torch.cat([x @ columns for _, columns in none_kept.head_columns(len(x))], 1)
    torch.testing.assert_close(streamed, want.reshape(-1, want.shape[-1]), rtol=1e-5, atol=1e-5)
    small = Interpreter(lifted, resident_bytes=300_000)
    small.logits(sequences)
    assert 0 < small._resident.bytes <= 300_000


def _exact(interpreter: Interpreter, sequences: np.ndarray, variant: Variant) -> tuple[np.ndarray, torch.Tensor]:
    """(summed nll per sequence, log-probabilities at the scored positions) from whole-vocabulary logits."""
    scored = scored_positions(sequences.shape[1])
    log_probs = torch.log_softmax(interpreter.logits(sequences, variant)[:, scored].double(), -1)
    targets = torch.from_numpy(sequences[:, predicted_tokens(scored)])[..., None]
    return (-log_probs.gather(-1, targets)).sum((1, 2)).numpy(), log_probs


def test_a_plans_quality_is_the_whole_vocabularys(lifted):
    """The held-out measure's ppl change, KL and top-1, its logits a slice of the output layer at a time, are those
    of whole-vocabulary log-softmaxes."""
    from passes import quality

    sequences = _sequences(4)
    interpreter = Interpreter(lifted)
    measure = quality._HeldOut(interpreter, list(sequences), [])
    variant = Variant({(layer, "in"): 0.05 for layer in range(TIED.layers)})
    got = measure.quality(variant)
    nll_ref, dense = _exact(interpreter, sequences, Variant())
    nll_got, plan = _exact(interpreter, sequences, variant)
    count = dense.shape[0] * dense.shape[1]
    assert got.tokens == count
    assert got.ppl_change == pytest.approx(np.exp((nll_got.sum() - nll_ref.sum()) / count) - 1, rel=1e-9)
    assert got.top1 == pytest.approx(float((dense.argmax(-1) == plan.argmax(-1)).double().mean()))
    kl = float((dense.exp() * (dense - plan)).sum(-1).mean())
    assert kl > 1e-4 and got.kl == pytest.approx(kl, rel=1e-6)


def test_a_plan_measured_on_part_of_the_text_runs_only_the_rest_when_measured_on_all(lifted):
    """The search measures a plan on every second held-out sequence; confirming it on all of them runs only the
    others, and gives what measuring it afresh on all gives."""
    from passes import quality

    interpreter = Interpreter(lifted)
    measure = quality._HeldOut(interpreter, list(_sequences(6)), [])
    run = []
    head_input = interpreter.head_input
    interpreter.head_input = lambda sequences, *a, **k: run.append(len(sequences)) or head_input(sequences, *a, **k)
    variant = Variant({(layer, "down"): 0.02 for layer in range(TIED.layers)})
    part = measure.quality(variant, part=True, plan="p")
    whole = measure.quality(variant, plan="p")
    assert run == [3, 3] and measure.partial and part.tokens * 2 == whole.tokens
    afresh = measure.quality(variant)
    assert run == [3, 3, 6]
    assert (whole.ppl_change, whole.kl, whole.top1) == pytest.approx((afresh.ppl_change, afresh.kl, afresh.top1))
