"""onnxruntime on the user's own ONNX: the reference picompile is measured against (eval, tests, benchmarks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import UserError

# What OrtDecoder feeds a decoder (besides past_key_values.{i}.key/value)
FED_INPUTS = ("input_ids", "attention_mask", "position_ids")


def check_reference(path: Path) -> int:
    """Check that `path` is a model eval can compare an artifact with, as `build` checks a model (the import
    pass's refusals: missing, not ONNX, damaged, not a decoder LLM export with input_ids and logits (a CNN),
    no KV cache (an encoder), weights fed as inputs), that it takes only the inputs OrtDecoder feeds, and that
    its logits are as wide as its vocabulary; return the vocabulary: its token embedding table's rows (the
    table recognise finds: a Gather of a constant by input_ids)."""
    from passes.import_onnx import Import, load
    from passes.recognise import find_embeddings

    from . import ir as pir
    from .pipeline import Context
    from .targets import get_target

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


class OrtDecoder:
    """Runs an exported decoder (optimum-style KV-cache I/O) with onnxruntime, batch 1."""

    def __init__(self, onnx_path: Path, threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.past_names = sorted((n for n in self.inputs if n.startswith("past_key_values.")), key=_layer_key)
        self.reset()

    def reset(self) -> None:
        self.past = {}
        for name in self.past_names:
            shape = self.inputs[name].shape
            self.past[name] = np.zeros((1, shape[1], 0, shape[3]), np.float32)
        self.position = 0

    def forward(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, np.int64).reshape(1, -1)
        total = self.position + ids.shape[1]
        feeds = {"input_ids": ids, **self.past}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, total), np.int64)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(self.position, total, dtype=np.int64)[None]
        results = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        for name in self.past_names:
            self.past[name] = results[name.replace("past_key_values.", "present.")]
        self.position = total
        return results["logits"][0]

    def greedy(self, prompt_ids, max_new_tokens: int) -> list[int]:
        self.reset()
        logits = self.forward(prompt_ids)[-1]
        generated = []
        for step in range(max_new_tokens):
            generated.append(int(np.argmax(logits)))
            if step < max_new_tokens - 1:
                logits = self.forward([generated[-1]])[-1]
        return generated


def _layer_key(name: str):
    _, layer, kind = name.split(".")
    return int(layer), kind
