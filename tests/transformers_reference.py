"""A tiny transformers model as the reference of an architecture's build: its logits on token ids, and the
artifact's on the same prompt and greedy steps (the architecture tests: test_qwen3, test_gemma)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime import Engine


def transformers_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits of `ids`, one row per token."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def artifact_logits(artifact: Path, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """The artifact's logits of `prompt` and of `steps` greedy steps after it, one row per token, and the tokens."""
    engine = Engine(artifact)
    rows = [np.asarray(engine.forward(np.array(prompt, np.int64))).reshape(len(prompt), -1)]
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(rows[-1][-1])))
        rows.append(np.asarray(engine.forward([ids[-1]])).reshape(1, -1))
    return np.concatenate(rows), ids
