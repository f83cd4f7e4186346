"""Quality of a compiled artifact against onnxruntime on the source ONNX: logit error, top-1
agreement, perplexity and KL divergence over the positions of held-out token sequences."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compiled_logits(engine, sequence: np.ndarray, prefill: int = 4) -> np.ndarray:
    """Logits at every position: a short prefill, then one decode step per token (the path decoding uses)."""
    engine.reset()
    prefill = max(1, min(prefill, len(sequence)))
    rows = [engine.forward(sequence[:prefill])]
    rows += [engine.forward(sequence[i: i + 1]) for i in range(prefill, len(sequence))]
    return np.concatenate(rows)


def compare(reference: np.ndarray, compiled: np.ndarray, sequence: np.ndarray) -> dict:
    ref_logp, cmp_logp = log_softmax(reference), log_softmax(compiled)
    targets = sequence[1:]
    positions = np.arange(len(targets))
    return {
        "max_abs_logit_diff": float(np.abs(reference - compiled).max()),
        "top1_agree": int((reference.argmax(-1) == compiled.argmax(-1)).sum()),
        "positions": int(len(sequence)),
        "nll_reference": float(-ref_logp[positions, targets].sum()),
        "nll_compiled": float(-cmp_logp[positions, targets].sum()),
        "predicted": int(len(targets)),
        "kl_sum": float((np.exp(ref_logp) * (ref_logp - cmp_logp)).sum()),
    }


class ArtifactReference:
    """An artifact in onnxruntime's place as eval's reference (`eval --baseline`): its logits along the path
    decoding takes. Eval of a quantized sparse artifact against its quantized dense build measures what
    sparsity costs on its own; the dense build against onnxruntime what quantization costs."""

    def __init__(self, engine):
        self.engine = engine

    def reset(self) -> None:
        self.engine.reset()

    def forward(self, sequence: np.ndarray) -> np.ndarray:
        return compiled_logits(self.engine, sequence)


def evaluate(engine, reference, sequences) -> dict:
    totals = None
    for sequence in sequences:
        sequence = sequence[: engine.max_context]
        reference.reset()
        part = compare(reference.forward(sequence), compiled_logits(engine, sequence), sequence)
        if totals is None:
            totals = part
        else:
            for key, value in part.items():
                totals[key] = max(totals[key], value) if key == "max_abs_logit_diff" else totals[key] + value
    predicted = max(totals["predicted"], 1)
    return {
        "max_abs_logit_diff": totals["max_abs_logit_diff"],
        "top1_agreement": totals["top1_agree"] / totals["positions"],
        "ppl_reference": float(np.exp(totals["nll_reference"] / predicted)),
        "ppl_compiled": float(np.exp(totals["nll_compiled"] / predicted)),
        "kl_mean": totals["kl_sum"] / totals["positions"],
        "sequences": len(sequences),
        "positions": totals["positions"],
    }
