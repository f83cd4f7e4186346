"""Tiny GGUF files made on the fly with the `gguf` package's writer, as llama.cpp's converter writes them
(LLaMA's attn_q / attn_k rows permuted for llama.cpp's adjacent-pair RoPE), and a numpy forward pass that
computes what llama.cpp computes from the file's dequantized tensors (the reference for the GGUF front end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from tests.ggml_encode import encode

T = gguf.GGMLQuantizationType


@dataclass
class Tiny:
    """A tiny model's shape and what it stores each matrix as."""

    arch: str = "llama"
    layers: int = 2
    d_model: int = 64
    ffn: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 300
    tied: bool = False
    formats: dict = field(default_factory=dict)  # GGUF tensor name suffix (attn_q, ffn_down, token_embd, output) -> type
    default: T = T.F32
    rope_base: float = 10000.0
    eps: float = 1e-5
    rope_freqs: bool = False  # LLaMA 3.1's rope_freqs.weight: per-frequency divisors of RoPE's angles
    context: int = 256  # <arch>.context_length: the context the model was trained for

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows to llama.cpp's adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(name: str, w: np.ndarray, kind: T, rng) -> tuple[np.ndarray, T]:
    if kind == T.F32:
        return w.astype(np.float32), kind
    if kind == T.F16:
        return w.astype(np.float16), kind
    return encode(kind.name, w.astype(np.float32)), kind  # (the K-quants by tests.ggml_encode: gguf cannot)


def write(path: Path, tiny: Tiny = Tiny(), seed: int = 0, tokenizer: dict | None = None,
          edit=None) -> dict[str, np.ndarray]:
    """Write a random model of `tiny`'s shape to `path`; return the file's tensors dequantized (as llama.cpp
    reads them: GGUF names, numpy order, q/k rows permuted as stored). `tokenizer`: metadata keys to add
    (tokenizer.ggml.*). `edit(writer, tensors)` may change the tensors (name -> (array, type)) before writing."""
    rng = np.random.default_rng(seed)
    t, q, kv = tiny, tiny.heads * tiny.head_dim, tiny.kv_heads * tiny.head_dim
    shapes = {"token_embd.weight": (t.vocab, t.d_model), "output_norm.weight": (t.d_model,)}
    if t.rope_freqs:
        shapes["rope_freqs.weight"] = (t.head_dim // 2,)
    if not t.tied:
        shapes["output.weight"] = (t.vocab, t.d_model)
    for i in range(t.layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (t.d_model,), p + "attn_q.weight": (q, t.d_model),
                       p + "attn_k.weight": (kv, t.d_model), p + "attn_v.weight": (kv, t.d_model),
                       p + "attn_output.weight": (t.d_model, q), p + "ffn_norm.weight": (t.d_model,),
                       p + "ffn_gate.weight": (t.ffn, t.d_model), p + "ffn_up.weight": (t.ffn, t.d_model),
                       p + "ffn_down.weight": (t.d_model, t.ffn)})
        if t.arch == "qwen2":
            shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            if name == "rope_freqs.weight":
                w = rng.uniform(1.0, 8.0, shape)
            elif name.endswith("norm.weight"):
                w = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                w = 0.1 * rng.standard_normal(shape)
            tensors[name] = (w.astype(np.float32), T.F32)
            continue
        w = (0.5 if name == "token_embd.weight" else 0.15) * rng.standard_normal(shape)
        if t.arch == "llama" and name.endswith("attn_q.weight"):
            w = _permute(w, t.heads)
        elif t.arch == "llama" and name.endswith("attn_k.weight"):
            w = _permute(w, t.kv_heads)
        suffix = name.split(".")[-2]
        tensors[name] = _stored(name, w, t.formats.get(suffix, t.default), rng)
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(str(path), t.arch)
    writer.add_block_count(t.layers)
    writer.add_context_length(t.context)
    writer.add_embedding_length(t.d_model)
    writer.add_feed_forward_length(t.ffn)
    writer.add_head_count(t.heads)
    writer.add_head_count_kv(t.kv_heads)
    writer.add_rope_freq_base(t.rope_base)
    writer.add_layer_norm_rms_eps(t.eps)
    writer.add_rope_dimension_count(t.head_dim)
    for key, value in (tokenizer or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            writer.add_array(key, value)
        else:
            writer.add_array(key, list(value))
    for name, (array, kind) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: gguf.quants.dequantize(array, kind) for name, (array, kind) in tensors.items()}


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, base: float, adjacent: bool, factors=None) -> np.ndarray:
    """llama.cpp's RoPE on [S, heads, d]: adjacent pairs (2i, 2i+1) for llama ("normal"), (i, i + d/2) for
    qwen2 (NeoX); `factors` (rope_freqs) divide the angles."""
    d = x.shape[-1]
    theta = positions[:, None] * base ** (-np.arange(0, d, 2) / d) / (1.0 if factors is None else factors)
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
    a, b = (x[..., 0::2], x[..., 1::2]) if adjacent else (x[..., : d // 2], x[..., d // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if adjacent:
        return np.stack([ra, rb], -1).reshape(x.shape)
    return np.concatenate([ra, rb], -1)


def forward(weights: dict[str, np.ndarray], tiny: Tiny, tokens) -> np.ndarray:
    """Logits [S, vocab] of a prompt, in float64, as llama.cpp computes them from the file's tensors."""
    w = {name: np.asarray(a, np.float64) for name, a in weights.items()}
    t = tiny
    tokens = np.asarray(tokens)
    S, hd, group = len(tokens), t.head_dim, t.heads // t.kv_heads
    x = w["token_embd.weight"][tokens]
    positions = np.arange(S, dtype=np.float64)
    causal = np.tril(np.ones((S, S), bool))
    for i in range(t.layers):
        p = f"blk.{i}."
        a = _rms(x, w[p + "attn_norm.weight"], t.eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = a @ w[p + f"attn_{name}.weight"].T
            if p + f"attn_{name}.bias" in w:
                y = y + w[p + f"attn_{name}.bias"]
            proj[name] = y.reshape(S, -1, hd)
        factors = w.get("rope_freqs.weight")
        q = _rope(proj["q"], positions, t.rope_base, t.arch == "llama", factors)
        k = _rope(proj["k"], positions, t.rope_base, t.arch == "llama", factors)
        heads = []
        for h in range(t.heads):
            scores = q[:, h] @ k[:, h // group].T / np.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((scores / scores.sum(-1, keepdims=True)) @ proj["v"][:, h // group])
        x = x + np.concatenate(heads, -1) @ w[p + "attn_output.weight"].T
        f = _rms(x, w[p + "ffn_norm.weight"], t.eps)
        gate = f @ w[p + "ffn_gate.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (f @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms(x, w["output_norm.weight"], t.eps) @ out.T
