"""onnxruntime on the user's own ONNX: the reference picompile is measured against (eval, tests, benchmarks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


# What OrtDecoder feeds a decoder (besides past_key_values.{i}.key/value)
FED_INPUTS = ("input_ids", "attention_mask", "position_ids")


def quiet_between_runs(options) -> None:
    """onnxruntime's threads may spin while a run of its own waits for them, never after it returns: picompile
    runs beside it in the same process (eval, sampling, benchmarks), and a spinning pool takes the cores its
    next step needs (runtime/threads.py)."""
    options.add_session_config_entry("session.force_spinning_stop", "1")


class OrtDecoder:
    """Runs an exported decoder (optimum-style KV-cache I/O) with onnxruntime: batch 1 by `forward`, any batch
    by `run` (after `reset(batch)`) and `sample`."""

    def __init__(self, onnx_path: Path, threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        quiet_between_runs(options)
        self.session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.past_names = sorted((n for n in self.inputs if n.startswith("past_key_values.")), key=_layer_key)
        ids = self.inputs.get("input_ids")
        batch = ids.shape[0] if ids is not None and ids.shape else None
        self.max_batch = batch if isinstance(batch, int) and batch > 0 else None  # None: any batch
        self.reset()

    def reset(self, batch: int = 1) -> None:
        """Empty the KV cache, for `batch` sequences side by side."""
        self.past = {}
        for name in self.past_names:
            shape = self.inputs[name].shape
            self.past[name] = np.zeros((batch, shape[1], 0, shape[3]), _ORT_FLOATS[self.inputs[name].type])
        self.position = 0

    def run(self, ids: np.ndarray, names: list[str] | None = None,
            extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run token ids [batch, seq] after the cache; the outputs `names` (default all) by name. The cache
        moves on only when all outputs are run (it needs the present.* ones). `extra` feeds inputs of a part of
        a model cut out of it (say, a layer's input)."""
        ids = np.asarray(ids, np.int64)
        batch, total = ids.shape[0], self.position + ids.shape[1]
        feeds = {"input_ids": ids, **self.past, **(extra or {})}
        if "input_ids" not in self.inputs:
            del feeds["input_ids"]
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((batch, total), np.int64)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.broadcast_to(np.arange(self.position, total, dtype=np.int64), ids.shape).copy()
        results = dict(zip(names or self.outputs, self.session.run(names or self.outputs, feeds)))
        if names is None:
            for name in self.past_names:
                self.past[name] = results[name.replace("past_key_values.", "present.")]
            self.position = total
        return results

    def forward(self, token_ids) -> np.ndarray:
        return self.run(np.asarray(token_ids, np.int64).reshape(1, -1))["logits"][0]

    def sample(self, first: np.ndarray, length: int, rng: np.random.Generator, vocab: int | None = None) -> np.ndarray:
        """[batch, length] token ids, each row from its `first` token on, each next token drawn by `rng` from
        softmax(logits) (temperature 1) over the first `vocab` logits (default all). The rows decode as one
        batch with the KV cache (in chunks of `max_batch` where the model fixes its batch)."""
        first = np.asarray(first, np.int64).reshape(-1)
        chunk = self.max_batch or max(1, len(first))
        rows = []
        for begin in range(0, len(first), chunk):
            tokens = first[begin:begin + chunk, None]
            self.reset(len(tokens))
            step = tokens
            for _ in range(length - 1):
                logits = self.run(step)["logits"][:, -1, :vocab].astype(np.float64)
                weights = np.exp(logits - logits.max(1, keepdims=True))
                cdf = np.cumsum(weights, 1)
                drawn = (cdf < rng.random((len(cdf), 1)) * cdf[:, -1:]).sum(1)  # inverse CDF, one draw per row
                step = np.minimum(drawn, cdf.shape[1] - 1)[:, None]
                tokens = np.concatenate([tokens, step], 1)
            rows.append(tokens)
        self.reset()
        return np.concatenate(rows)

    def greedy(self, prompt_ids, max_new_tokens: int) -> list[int]:
        self.reset()
        logits = self.forward(prompt_ids)[-1]
        generated = []
        for step in range(max_new_tokens):
            generated.append(int(np.argmax(logits)))
            if step < max_new_tokens - 1:
                logits = self.forward([generated[-1]])[-1]
        return generated


# the cache's element type, as onnxruntime names it (an fp16 export's cache is fp16)
_ORT_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _layer_key(name: str):
    _, layer, kind = name.split(".")
    return int(layer), kind
