"""Quality of a compiled artifact against onnxruntime on the source ONNX: logit error, top-1
agreement, perplexity and KL divergence over the positions of held-out token sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from passes import ir as pir
from passes.budget import PROMPT_TOKENS, ppl_change_interval, predicted_tokens, scored_positions
from passes.errors import UserError
from passes.import_gguf import reference_onnx
from passes.import_onnx import Import, source_file
from passes.front_end import load
from passes.layer_reference import LayeredReference, needs_layers
from passes.pipeline import Context
from passes.recognise import analyse, find_embeddings, source_layer_input
from passes.reference import FED_INPUTS, OrtDecoder
from passes.targets import get_target


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compiled_logits(engine, sequence: np.ndarray, prefill: int = PROMPT_TOKENS, first: int = 0) -> np.ndarray:
    """Logits at every position from `first` on: a short prefill, then one decode step per token (the path decoding
    uses). A prefill whose rows all come before `first` makes its last row's alone (`last_only`)."""
    engine.reset()
    prefill = max(1, min(prefill, len(sequence)))
    last_only = first >= prefill
    rows = [engine.forward(sequence[:prefill], last_only=last_only)]
    rows += [engine.forward(sequence[i: i + 1]) for i in range(prefill, len(sequence))]
    return np.concatenate(rows)[first - (prefill - 1 if last_only else 0):]


def compare(reference: np.ndarray, compiled: np.ndarray, sequence: np.ndarray) -> dict:
    """One sequence's sums over its scored positions (budget.scored_positions); the logit difference over all."""
    scored = scored_positions(len(sequence))
    ref_logp, cmp_logp = log_softmax(reference[scored]), log_softmax(compiled[scored])
    targets = sequence[predicted_tokens(scored)]
    positions = np.arange(len(targets))
    return {
        "max_abs_logit_diff": float(np.abs(reference - compiled).max()),
        "top1_agree": int((ref_logp.argmax(-1) == cmp_logp.argmax(-1)).sum()),
        "positions": int(len(targets)),
        "nll_reference": float(-ref_logp[positions, targets].sum()),
        "nll_compiled": float(-cmp_logp[positions, targets].sum()),
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
    parts = []
    for sequence in sequences:
        sequence = sequence[: engine.max_context]
        reference.reset()
        parts.append(compare(reference.forward(sequence), compiled_logits(engine, sequence), sequence))
    totals = {key: max(p[key] for p in parts) if key == "max_abs_logit_diff" else sum(p[key] for p in parts)
              for key in parts[0]}
    scored = max(totals["positions"], 1)
    _, low, high = ppl_change_interval(*(np.array([p[key] for p in parts])
                                         for key in ("nll_compiled", "nll_reference", "positions")))
    return {
        "max_abs_logit_diff": totals["max_abs_logit_diff"],
        "top1_agreement": totals["top1_agree"] / scored,
        "ppl_reference": float(np.exp(totals["nll_reference"] / scored)),
        "ppl_compiled": float(np.exp(totals["nll_compiled"] / scored)),
        "ppl_change_low": low,  # the 95% interval of ppl_compiled / ppl_reference - 1 over these sequences
        "ppl_change_high": high,
        "kl_mean": totals["kl_sum"] / scored,
        "sequences": len(sequences),
        "positions": totals["positions"],  # scored: budget.scored_positions of each sequence
    }


def reference_for(path: Path, sequences: list[np.ndarray], workdir: Path):
    """eval's reference executor on the model at `path` for these sequences: onnxruntime on the whole model,
    or, where onnxruntime could not hold its weights, on one layer at a time (`passes.layer_reference`)."""
    imported = Import().apply(load(Path(path), for_build=False), Context(get_target("cpu"))).model
    if not needs_layers(imported):
        return OrtDecoder(source_file(imported) or reference_onnx(Path(path)))  # a GGUF file's: its float ONNX
    layered = LayeredReference(imported, {a.layer: source_layer_input(a) for a in analyse(imported).attentions}, workdir)
    layered.prepare(sequences)
    return layered


def check_reference(path: Path) -> int:
    """Check that `path` is a model eval can compare an artifact with, as `build` checks a model (the import
    pass's refusals: missing, not ONNX, damaged, not a decoder LLM export with input_ids and logits (a CNN),
    no KV cache (an encoder), weights fed as inputs), that it takes only the inputs OrtDecoder feeds, and that
    its logits are as wide as its vocabulary; return the vocabulary: its token embedding table's rows (the
    table recognise finds: a Gather of a constant by input_ids)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"reference model not found: {path}")
    try:
        model = Import().apply(load(path, for_build=False), Context(get_target("cpu"))).model
    except UserError as error:
        raise UserError(f"reference {path}: {error}") from None
    unfed = [v.name for v in model.graph.inputs if v.name not in FED_INPUTS and not v.name.startswith("past_key_values.")]
    if unfed:
        raise UserError(f"reference {path} takes {', '.join(unfed)}, which eval does not feed (it feeds "
                        f"{', '.join(FED_INPUTS)} and past_key_values.*)")
    try:
        token, _ = find_embeddings(model.graph)
    except UserError as error:
        raise UserError(f"reference {path}: {error}") from None
    vocab = int(pir.const_array(token.inputs[0]).shape[0])
    logits = next(v for v in model.graph.outputs if v.name == "logits")  # check_decoder saw it
    width = logits.shape[-1] if logits.shape is not None and len(logits.shape) else None
    if isinstance(width, int) and width != vocab:
        raise UserError(f"reference {path} has logits over {width} tokens but its token embedding table has {vocab} "
                        "rows: not a language model eval can compare")
    return vocab
