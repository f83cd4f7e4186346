"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .engine import COUNTERS


def sample(logits: np.ndarray, rng: np.random.Generator | None, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0) -> int:
    if temperature <= 0.0 or rng is None:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    if top_k > 0 and top_k < scaled.size:
        cutoff = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= cutoff, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < top_p  # smallest set whose mass reaches top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


@dataclass
class GenerationStats:
    """What `generate_stream` measured, filled in as it runs: the engine's own time (sampling included), not
    the caller's between tokens."""

    prefill_s: float = 0.0
    decode_s: float = 0.0  # the decode steps (every token after the first comes from one)
    decode_steps: int = 0
    prompt_cached: int = 0  # the prompt's first tokens the engine's cache held already: not prefilled again
    profile: dict | None = None  # with `profile`: the engine's profile of the decode steps (`profile_per_token`)


def generate_stream(engine, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None, stop_ids=(), profile: bool = False,
                    stats: GenerationStats | None = None) -> Iterator[int]:
    """Prefill the prompt, then decode: yields each new token id as soon as it is chosen, up to
    `max_new_tokens`, the first of `stop_ids` included. `stats` (when given) gets the timings, and with
    `profile` the decode steps' profile. The prompt and its room in the context are checked here, at the
    call, not at the first token."""
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.size + max_new_tokens > engine.max_context:
        raise ValueError(f"prompt ({prompt.size}) + new tokens ({max_new_tokens}) exceed the artifact's "
                         f"max context {engine.max_context}")
    return _tokens(engine, prompt, max_new_tokens, np.random.default_rng(seed) if temperature > 0 else None,
                   (temperature, top_k, top_p), frozenset(stop_ids), profile,
                   GenerationStats() if stats is None else stats)


def start_prompt(engine, prompt_ids, slot: int = 0, reuse: bool = True) -> int:
    """Make `slot` ready to prefill `prompt_ids`; returns how many of its first tokens the slot's cache holds
    already: with `reuse` the prefix the cache holds is kept (`Engine.resume`), else the slot starts empty."""
    if reuse:
        return engine.resume(prompt_ids, slot)
    engine.reset(slot)
    return 0


def prefill_part(engine, prompt_ids, slot: int, start: int, stop: int) -> np.ndarray:
    """Prefill `prompt_ids[start:stop]` after the `start` tokens `slot` holds, with the prefill's kernels (the
    logits a cold prefill gives), the output layer on its last row alone; returns that row's logits [vocab]."""
    return engine.forward(prompt_ids[start:stop], slot, last_only=True, as_prompt=True)[-1]


def prefill_prompt(engine, prompt_ids, slot: int = 0, reuse: bool = True) -> tuple[np.ndarray, int]:
    """A prompt's last logits [vocab], and how many of its first tokens `slot`'s cache held already
    (`start_prompt`); the rest runs in one call (`prefill_part`)."""
    kept = start_prompt(engine, prompt_ids, slot, reuse)
    return prefill_part(engine, prompt_ids, slot, kept, len(prompt_ids)), kept


def _tokens(engine, prompt: np.ndarray, max_new_tokens: int, rng, sampling: tuple, stop_ids: frozenset,
            profile: bool, stats: GenerationStats) -> Iterator[int]:
    started = time.perf_counter()
    logits, stats.prompt_cached = prefill_prompt(engine, prompt)  # (from where the last call's tokens part)
    token = sample(logits, rng, *sampling)
    stats.prefill_s = time.perf_counter() - started
    engine.profile = {} if profile else None  # decode steps only
    try:
        for step in range(max_new_tokens):
            yield token
            if token in stop_ids or step == max_new_tokens - 1:
                break
            started = time.perf_counter()
            logits = engine.forward(np.array([token], np.int64))[-1]
            token = sample(logits, rng, *sampling)
            stats.decode_s += time.perf_counter() - started
            stats.decode_steps += 1
    finally:  # also when the caller stops early (a closed generator)
        stats.profile, engine.profile = engine.profile, None


def generate(engine, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop_ids=(), profile: bool = False) -> dict:
    """`generate_stream` to the end. Returns ids and timings; with `profile`, also the decode time per kernel
    class per token (and the runtime's own overhead)."""
    stats = GenerationStats()
    generated = list(generate_stream(engine, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, stop_ids=stop_ids, profile=profile, stats=stats))
    result = {
        "prompt_ids": np.asarray(prompt_ids, dtype=np.int64).tolist(),
        "generated_ids": generated,
        **timings(stats),
    }
    if profile:
        result.update(profile_per_token(stats.profile))
    return result


def timings(stats: GenerationStats) -> dict:
    """The prefill time and the decode speed of a generation, as `generate` reports them."""
    return {"prefill_ms": stats.prefill_s * 1000, "prompt_cached_tokens": stats.prompt_cached,
            "decode_tokens_per_s": stats.decode_steps / stats.decode_s if stats.decode_steps and stats.decode_s > 0
            else 0.0}


def profile_per_token(profile: dict) -> dict:
    """An engine's profile of decode steps, per step: milliseconds per call role (and wall, overhead), and the
    weight bytes read with the bandwidth that makes over the kernels' time and over the wall time, in all and
    per call role (GB/s over that role's kernel time: the sparse FFN's against the dense GEMVs')."""
    steps = max(profile.get("decode_steps", 0), 1)
    ms = {k: v * 1000 / steps for k, v in sorted(profile.items()) if k not in COUNTERS}
    kernel_s = sum(v for k, v in ms.items() if k not in ("wall", "overhead")) / 1000
    weight_bytes = profile.get("weight_bytes", 0) / steps
    by_role = {role: count / steps for role, count in sorted(profile.get("weight_bytes_by_role", {}).items()) if count}
    return {
        "profile_ms_per_token": ms,
        "weight_bytes_per_token_by_role": by_role,
        "weight_gbs_by_role": {role: count / (ms[role] / 1000) / 1e9 for role, count in by_role.items() if ms.get(role)},
        "weight_bytes_per_token": weight_bytes,
        "weight_gbs_kernels": weight_bytes / kernel_s / 1e9 if kernel_s > 0 else 0.0,
        "weight_gbs_wall": weight_bytes / (ms["wall"] / 1000) / 1e9 if ms.get("wall") else 0.0,
    }
