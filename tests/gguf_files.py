"""Tiny GGUF files made on the fly with the `gguf` package's writer, as llama.cpp's converter writes them
(LLaMA's attn_q / attn_k rows permuted for llama.cpp's adjacent-pair RoPE; Phi-3's q, k, v and gate, up fused, as
transformers stores them), and a numpy forward pass that computes what llama.cpp computes from the file's dequantized
tensors (the reference for the GGUF front end); and llama.cpp's own converter run on a saved transformers model
(`convert_with_llama_cpp`)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from tests.ggml_encode import encode

T = gguf.GGMLQuantizationType

# the block tensors an architecture's converter fuses: the file's tensor -> the matrices it stacks along its rows, in
# order (convert_hf_to_gguf maps Phi-3's qkv_proj to attn_qkv and gate_up_proj, gate first, to ffn_up)
FUSED = {"phi3": {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}}


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
    sliding_window: int = 0  # phi3's attention.sliding_window (its converter writes 0 for none)
    key_length: int | None = None  # attention.key_length (and value_length): a head size other than d_model / heads
    # gemma2 / gemma3: their metadata where not None (llama.cpp's defaults where None: gemma2's caps 50 and 30 and
    # window 4096; gemma3's no cap, no window, sliding layers' RoPE base 10000)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    window: int | None = None
    rope_base_swa: float | None = None
    rope_factor: float | None = None  # rope.scaling.factor (linear)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.d_model // self.heads


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
    (tokenizer.ggml.*, or any other). `edit(writer, tensors)` may change the tensors (name -> (array, type)) before
    writing."""
    rng = np.random.default_rng(seed)
    t, q, kv = tiny, tiny.heads * tiny.head_dim, tiny.kv_heads * tiny.head_dim
    shapes = {"token_embd.weight": (t.vocab, t.d_model), "output_norm.weight": (t.d_model,)}
    if t.rope_freqs:
        shapes["rope_freqs.weight"] = (t.head_dim // 2,)
    gemma = t.arch in ("gemma2", "gemma3")  # norms after attention and the FFN
    if not t.tied and t.arch != "gemma2":  # (llama.cpp's gemma2 reads no output.weight: always tied)
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
        if t.arch in ("qwen3", "gemma3"):  # an RMSNorm over each head's query and key
            shapes.update({p + "attn_q_norm.weight": (t.head_dim,), p + "attn_k_norm.weight": (t.head_dim,)})
        if gemma:
            shapes.update({p + "post_attention_norm.weight": (t.d_model,), p + "post_ffw_norm.weight": (t.d_model,)})
    floats = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            if name == "rope_freqs.weight":
                w = rng.uniform(1.0, 8.0, shape)
            elif name.endswith("norm.weight"):
                w = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                w = 0.1 * rng.standard_normal(shape)
            floats[name] = w.astype(np.float32)
            continue
        w = (0.5 if name == "token_embd.weight" else 0.15) * rng.standard_normal(shape)
        if t.arch == "llama" and name.endswith("attn_q.weight"):
            w = _permute(w, t.heads)
        elif t.arch == "llama" and name.endswith("attn_k.weight"):
            w = _permute(w, t.kv_heads)
        floats[name] = w
    # a fused tensor stacks its parts' rows before it is stored (its blocks are its rows'), where its first part was
    fused_at = {f"blk.{i}.{parts[0]}.weight": (f"blk.{i}.{fused}.weight", [f"blk.{i}.{p}.weight" for p in parts])
                for i in range(t.layers) for fused, parts in FUSED.get(t.arch, {}).items()}
    stacked = {part for _, parts in fused_at.values() for part in parts}
    tensors = {}
    for name, w in floats.items():
        if name in fused_at:
            name, parts = fused_at[name]
            w = np.concatenate([floats[part] for part in parts])
        elif name in stacked:
            continue
        if w.ndim == 1:
            tensors[name] = (w, T.F32)
        else:
            tensors[name] = _stored(name, w, t.formats.get(name.split(".")[-2], t.default), rng)
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
    if t.arch == "phi3":
        writer.add_sliding_window(t.sliding_window)
    if t.key_length is not None:
        writer.add_key_length(t.key_length)
        writer.add_value_length(t.key_length)
    if gemma:  # what convert_hf_to_gguf's Gemma2Model / Gemma3Model write besides
        if t.key_length is None:
            writer.add_key_length(t.head_dim)
            writer.add_value_length(t.head_dim)
        for value, add in ((t.attn_softcap, writer.add_attn_logit_softcapping),
                           (t.final_softcap, writer.add_final_logit_softcapping), (t.window, writer.add_sliding_window),
                           (t.rope_base_swa, writer.add_rope_freq_base_swa)):
            if value is not None:
                add(value)
    if t.rope_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(t.rope_factor)
    for key, value in (tokenizer or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
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


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _gemma_layers(t: Tiny) -> list[tuple[bool, float, float]]:
    """Per layer of a gemma2 / gemma3 tiny model: (whether it slides, its RoPE base, its RoPE position divisor), as
    llama.cpp's src/models/gemma2.cpp and gemma3.cpp read them (set_swa_pattern(2) / (6): layer i slides where
    i % n < n - 1; gemma3 slides only with a window in the file, its sliding layers' RoPE unscaled)."""
    factor = t.rope_factor or 1.0
    if t.arch == "gemma2":
        base_swa = t.rope_base if t.rope_base_swa is None else t.rope_base_swa
        return [(i % 2 < 1, base_swa if i % 2 < 1 else t.rope_base, factor) for i in range(t.layers)]
    base_swa = 10000.0 if t.rope_base_swa is None else t.rope_base_swa
    slides = [bool(t.window) and i % 6 < 5 for i in range(t.layers)]
    return [(s, base_swa, 1.0) if s else (False, t.rope_base, factor) for s in slides]


def forward(weights: dict[str, np.ndarray], tiny: Tiny, tokens, thinned: tuple[int, dict] | None = None) -> np.ndarray:
    """Logits [S, vocab] of a prompt, in float64, as llama.cpp computes them from the file's tensors (gemma2 and
    gemma3: src/models/gemma2.cpp and gemma3.cpp: the embedding times sqrtf(n_embd), q times 1/sqrt(head_dim) (the
    27B's layer counts: 1/sqrt(d_model / heads)), gemma2's scores and logits soft-capped, gemma3's logits where the
    file says, the sliding layers' keys within the window, norms after attention and the FFN, GeGLU).

    `thinned` (start, {layer: (t_in, t_down)}): from position `start` on (decode steps after a dense prompt), each
    layer's FFN input entries of magnitude at most t_in, and its down projection's at most t_down, zeroed."""
    w = {name: np.asarray(a, np.float64) for name, a in weights.items()}
    t = tiny
    gemma = t.arch in ("gemma2", "gemma3")
    layers = _gemma_layers(t) if gemma else [(False, t.rope_base, 1.0)] * t.layers
    wide = {"gemma2": 46, "gemma3": 62}.get(t.arch) == t.layers
    scale = 1 / np.sqrt(t.d_model // t.heads if wide else t.head_dim)
    for i in range(t.layers):  # a fused tensor's rows back into the matrices it stacks
        for fused, parts in FUSED.get(t.arch, {}).items():
            stacked = w.pop(f"blk.{i}.{fused}.weight")
            sizes = {"attn_q": t.heads * t.head_dim, "attn_k": t.kv_heads * t.head_dim,
                     "attn_v": t.kv_heads * t.head_dim, "ffn_gate": t.ffn, "ffn_up": t.ffn}
            ends = np.cumsum([sizes[part] for part in parts])
            w.update({f"blk.{i}.{part}.weight": rows for part, rows in zip(parts, np.split(stacked, ends[:-1]))})
    tokens = np.asarray(tokens)
    S, hd, group = len(tokens), t.head_dim, t.heads // t.kv_heads
    x = w["token_embd.weight"][tokens]
    if gemma:
        x = x * float(np.float32(np.sqrt(t.d_model)))
    positions = np.arange(S, dtype=np.float64)
    causal = np.tril(np.ones((S, S), bool))
    window = t.window if t.window is not None else (4096 if t.arch == "gemma2" else 0)
    windowed = causal & (positions[None, :] > positions[:, None] - window)
    attn_cap = t.attn_softcap if t.attn_softcap is not None else (50.0 if t.arch == "gemma2" else 0.0)
    final_cap = t.final_softcap if t.final_softcap is not None else (30.0 if t.arch == "gemma2" else 0.0)
    for i in range(t.layers):
        p = f"blk.{i}."
        a = _rms(x, w[p + "attn_norm.weight"], t.eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = a @ w[p + f"attn_{name}.weight"].T
            if p + f"attn_{name}.bias" in w:
                y = y + w[p + f"attn_{name}.bias"]
            proj[name] = y.reshape(S, -1, hd)
            if p + f"attn_{name}_norm.weight" in w:  # qwen3: each head's query and key RMS-normed before RoPE
                proj[name] = _rms(proj[name], w[p + f"attn_{name}_norm.weight"], t.eps)
        factors = w.get("rope_freqs.weight")
        slides, base, divisor = layers[i]
        q = _rope(proj["q"], positions / divisor, base, t.arch == "llama", factors)
        k = _rope(proj["k"], positions / divisor, base, t.arch == "llama", factors)
        heads = []
        for h in range(t.heads):
            scores = q[:, h] @ k[:, h // group].T * scale
            if attn_cap:
                scores = attn_cap * np.tanh(scores / attn_cap)
            scores = np.where(windowed if slides else causal, scores, -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((scores / scores.sum(-1, keepdims=True)) @ proj["v"][:, h // group])
        attended = np.concatenate(heads, -1) @ w[p + "attn_output.weight"].T
        if gemma:
            attended = _rms(attended, w[p + "post_attention_norm.weight"], t.eps)
        x = x + attended
        f = _rms(x, w[p + "ffn_norm.weight"], t.eps)
        t_in, t_down = thinned[1][i] if thinned else (-1.0, -1.0)
        later = positions[:, None] >= (thinned[0] if thinned else S)
        f = np.where(later & (np.abs(f) <= t_in), 0.0, f)
        gate = f @ w[p + "ffn_gate.weight"].T
        act = _gelu_tanh(gate) if gemma else gate / (1 + np.exp(-gate))
        hidden = act * (f @ w[p + "ffn_up.weight"].T)
        down = np.where(later & (np.abs(hidden) <= t_down), 0.0, hidden) @ w[p + "ffn_down.weight"].T
        if gemma:
            down = _rms(down, w[p + "post_ffw_norm.weight"], t.eps)
        x = x + down
    out = w.get("output.weight", w["token_embd.weight"])
    logits = _rms(x, w["output_norm.weight"], t.eps) @ out.T
    return final_cap * np.tanh(logits / final_cap) if final_cap else logits


# convert_hf_to_gguf.py as llama.cpp runs it, with its own gguf-py, in a process of its own (its gguf package is not
# the project's). Stand-ins, for a test's byte-level tokenizer: the converter recognises a BPE tokenizer's
# pre-tokenizer by a hash of how a published model's splits a text (this one is none of them: `pre` names the one to
# write), and tries SentencePiece first, whose package the project lacks (without tokenizer.model it would give up
# on it: FileNotFoundError, as here); an architecture whose converter only knows SentencePiece (Gemma 2's) is given
# the BPE vocabulary instead where `bpe_for_sentencepiece`. Tensors and the rest of the metadata are the converter's
# own.
_CONVERT = """
import runpy, sys
from pathlib import Path
script, model, out, pre, bpe = sys.argv[1:6]
sys.path[:0] = [str(Path(script).parent / "gguf-py"), str(Path(script).parent)]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
def no_sentencepiece(self):
    raise FileNotFoundError(self.dir_model / "tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
if bpe == "1":
    base.TextModel._set_vocab_sentencepiece = lambda self: self._set_vocab_gpt2()
sys.argv = [script, model, "--outfile", out, "--outtype", "f32"]
runpy.run_path(script, run_name="__main__")
"""


def convert_with_llama_cpp(converter: Path, model_dir: Path, out: Path, pre: str = "qwen2",
                           bpe_for_sentencepiece: bool = False) -> Path:
    """The GGUF file llama.cpp's `converter` (convert_hf_to_gguf.py) writes, F32, from a transformers model saved
    in `model_dir` with a byte-level tokenizer (examples/byte_tokenizer.py)."""
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(converter), str(model_dir), str(out), pre,
                           "1" if bpe_for_sentencepiece else "0"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{converter} failed:\n{done.stderr[-3000:]}")
    return out
