"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p."""

from __future__ import annotations

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


def generate(engine, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop_ids=(), profile: bool = False) -> dict:
    """Prefill the prompt, then decode token by token. Returns ids and timings; with `profile`, also the
    decode time per kernel class per token (and the runtime's own overhead)."""
    import time

    rng = np.random.default_rng(seed) if temperature > 0 else None
    engine.reset()
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.size + max_new_tokens > engine.max_context:
        raise ValueError(f"prompt ({prompt.size}) + new tokens ({max_new_tokens}) exceed the artifact's "
                         f"max context {engine.max_context}")
    started = time.perf_counter()
    logits = engine.forward(prompt)[-1]
    prefill_s = time.perf_counter() - started
    generated = []
    engine.profile = {} if profile else None  # decode steps only
    started = time.perf_counter()
    for step in range(max_new_tokens):
        token = sample(logits, rng, temperature, top_k, top_p)
        generated.append(token)
        if token in stop_ids or step == max_new_tokens - 1:
            break
        logits = engine.forward(np.array([token], np.int64))[-1]
    decode_s = time.perf_counter() - started
    decoded_steps = max(len(generated) - 1, 0)  # the first token comes from the prefill logits
    result = {
        "prompt_ids": prompt.tolist(),
        "generated_ids": generated,
        "prefill_ms": prefill_s * 1000,
        "decode_tokens_per_s": decoded_steps / decode_s if decoded_steps and decode_s > 0 else 0.0,
    }
    if profile:
        result.update(profile_per_token(engine.profile))
        engine.profile = None
    return result


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
