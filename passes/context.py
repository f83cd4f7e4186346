"""The context an artifact is built for (`build --max-context`).

Without --max-context a build takes the context the model was trained for: a GGUF file's
`<general.architecture>.context_length`, an ONNX model's `max_position_embeddings` (or GPT-2's `n_positions`) in the
config.json beside it; a model that states neither gets DEFAULT_CONTEXT. That context is capped so that one
sequence's KV cache (layers x 2 x kv_heads x head_dim x context x 4 bytes: the runtime's caches are float32, one
set per sequence an engine holds) fits the KV budget: KV_BUDGET_SHARE of the memory available at build time beside
the weights, and for a GPU target KV_BUDGET_SHARE of the GPU budget too (the caches of the layers placed on the card
live there, beside their weights). An explicit --max-context wins, with a warning where it passes the trained
context.

What grows with the context is the KV cache (and RoPE's cos and sin tables, a row of head_dim floats per position:
a fraction of a percent of the cache): every buffer of one row per token (activations, the logits) holds
`sizes.PREFILL_ROWS` rows at most, and the runtime prefills a longer prompt in steps of that many.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from runtime.artifact import available_memory_bytes

from . import import_gguf, recognise
from .errors import UserError
from .sizes import kv_cache_bytes, weight_bytes
from .targets import format_size

DEFAULT_CONTEXT = 256  # a model that states no trained context (and the floor of the memory cap)
KV_BUDGET_SHARE = 0.25  # of the memory available beside the weights, for one sequence's KV cache
CONTEXT_STEP = 256  # a capped context is a multiple of this
CONFIG_KEYS = ("max_position_embeddings", "n_positions")  # an ONNX model's config.json: its trained context


def trained_context(path: Path) -> tuple[int | None, str]:
    """The context the model at `path` was trained for, and where it says so (None, "" where it does not)."""
    path = Path(path)
    if path.is_file() and import_gguf.is_gguf(path):
        tokens = import_gguf.context_length(path)
        return (tokens, "the file's") if tokens else (None, "")
    config = (path if path.is_dir() else path.parent) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None, ""
    for key in CONFIG_KEYS:
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"config.json's {key}"
    return None, ""


def kv_shapes(model: ir.Model) -> list[tuple[int, int]] | None:
    """(kv_heads, head_dim) of each layer's KV cache, as recognise reads them from the imported model; None where the
    model does not say (recognise then refuses it, naming what is missing)."""
    try:
        return recognise.kv_shapes(model.graph) or None
    except UserError:
        return None


@dataclass(frozen=True)
class ContextChoice:
    """The context a build takes, and why."""

    tokens: int
    kv_bytes: int | None  # one sequence's KV cache at `tokens` (None: the model's caches are not known)
    requested: bool = False  # --max-context
    trained: int | None = None  # the model's trained context, where it states one
    source: str = ""  # ... where: "the file's", "config.json's max_position_embeddings"
    budget: int | None = None  # the KV budget that capped the trained context (None: not capped)
    budget_of: str = ""  # ... what it is a share of

    def line(self) -> str:
        """What the build prints: 'context 8192 tokens (the file's trained context; KV cache 384.00 MiB per
        sequence)'."""
        if self.requested:
            why = "--max-context"
        elif self.trained is None:
            why = "the default: the model states no trained context"
        elif self.budget is None:
            why = ("the file's trained context" if self.source == "the file's" else
                   f"the trained context, {self.source}")
        else:
            why = (f"{self.source} {self.trained} capped by the KV memory budget {format_size(self.budget)}, "
                   f"{KV_BUDGET_SHARE:.0%} of {self.budget_of}; --max-context raises it")
        kv = f"; KV cache {format_size(self.kv_bytes)} per sequence" if self.kv_bytes is not None else ""
        return f"context {self.tokens} tokens ({why}{kv})"

    def warning(self) -> str | None:
        """Where --max-context passes the trained context: what that means."""
        if self.requested and self.trained is not None and self.tokens > self.trained:
            return (f"--max-context {self.tokens} is past the model's trained context of {self.trained} tokens "
                    f"({self.source}); the model has not learned positions past it, and its output there degrades")
        return None


def choose_context(path: Path, model: ir.Model, requested: int | None,
                   trained: tuple[int | None, str] | None = None, gpu_bytes: int = 0) -> ContextChoice:
    """The context of a build of the model at `path` (`model`: its import): `requested` (--max-context) where
    given, else the trained context (`trained`: `trained_context(path)`, read here if None) capped by the KV
    budget (`gpu_bytes`: the GPU budget of a GPU target), else DEFAULT_CONTEXT."""
    trained, source = trained if trained is not None else trained_context(path)
    shapes = kv_shapes(model)
    per_token = kv_cache_bytes(shapes, 1) if shapes else None
    kv = (lambda tokens: None if per_token is None else per_token * tokens)  # noqa: E731
    if requested is not None:
        return ContextChoice(requested, kv(requested), True, trained, source)
    if trained is None:
        return ContextChoice(DEFAULT_CONTEXT, kv(DEFAULT_CONTEXT))
    budget, budget_of = kv_budget(path, model, gpu_bytes)
    if per_token is None or budget is None or per_token * trained <= budget:
        return ContextChoice(trained, kv(trained), trained=trained, source=source)
    capped = max(budget // per_token // CONTEXT_STEP * CONTEXT_STEP, min(trained, DEFAULT_CONTEXT))
    return ContextChoice(capped, kv(capped), trained=trained, source=source, budget=budget, budget_of=budget_of)


def kv_budget(path: Path, model: ir.Model, gpu_bytes: int = 0) -> tuple[int | None, str]:
    """What one sequence's KV cache may take, and what of: KV_BUDGET_SHARE of the memory available beside the
    weights, or of the GPU budget (`gpu_bytes`) where that is less (None where neither is known)."""
    budgets = []
    available = available_memory_bytes()
    if available is not None:
        path = Path(path)
        weights = path.stat().st_size if path.is_file() and import_gguf.is_gguf(path) else weight_bytes(model.graph)
        budgets.append((int(max(available - weights, 0) * KV_BUDGET_SHARE), "the memory available beside the weights"))
    if gpu_bytes > 0:
        budgets.append((int(gpu_bytes * KV_BUDGET_SHARE), "the GPU budget"))
    return min(budgets) if budgets else (None, "")

