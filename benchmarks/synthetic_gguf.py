"""A GGUF file of a real family's shape with random weights in llama.cpp's Q4_K_M mix of blocks: build time,
memory and speed at sizes no real file here has (its perplexity means nothing; use real files for quality).

    python benchmarks/synthetic_gguf.py llama3-8b [-o FILE]     # prints the file's path (made once, in the cache)

Shapes (`SHAPES`): qwen2-1.5b (Qwen2.5-1.5B: 28 layers, 1536 wide, FFN 8960, 151,936 tokens, tied output) and
llama3-8b (Llama 3 8B: 32 layers, 4096 wide, FFN 14336, 8 kv heads, 128,256 tokens). Blocks as llama-quantize's
Q4_K_M gives them: Q4_K everywhere, Q6_K for the output layer and for attn_v and ffn_down in the layers it gives
more bits (the first and last eighth, every third between); Q5_0 where a row is not whole super-blocks. The
random blocks have fp16 scales of a trained model's size, so activations stay finite. The vocabulary is a
SentencePiece one (byte tokens and placeholders) that llama.cpp and picompile both load.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    arch: str
    layers: int
    d_model: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_base: float


SHAPES = {
    "qwen2-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, 151936, True, 1000000.0),
    "llama3-8b": Shape("llama", 32, 4096, 14336, 32, 8, 128256, False, 500000.0),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_blocks(kind: T, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks of `kind` for a [rows, columns] tensor: random codes and sub-scales, fp16 scales of a
    trained model's size (d ~ 1e-3, so a row's dot products stay near 1)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n = rows * columns // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q5_0: (0,)}[kind]
    for at in halves:
        d = rng.uniform(2e-4, 1e-3, n).astype(np.float16)
        raw[:, at: at + 2] = d.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, columns // block * size)


def _vocabulary(size: int) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (size - 259)
    return {"tokens": tokens, "types": types}


def write(shape: Shape, path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    head_dim = shape.d_model // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    vocab = _vocabulary(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores([0.0] * shape.vocab)
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(name: str, rows: int, columns: int, kind: T) -> None:
        if columns % 256:  # llama-quantize's fallback where a row is not whole super-blocks
            kind = T.Q5_0
        writer.add_tensor(name, _random_blocks(kind, rows, columns, rng), raw_dtype=kind)

    def vector(name: str, size: int, base: float) -> None:
        writer.add_tensor(name, (base + 0.02 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", shape.vocab, shape.d_model, T.Q4_K)
    for i in range(shape.layers):
        p, more = f"blk.{i}.", _more_bits(i, shape.layers)
        vector(p + "attn_norm.weight", shape.d_model, 1.0)
        matrix(p + "attn_q.weight", q, shape.d_model, T.Q4_K)
        matrix(p + "attn_k.weight", kv, shape.d_model, T.Q4_K)
        matrix(p + "attn_v.weight", kv, shape.d_model, T.Q6_K if more else T.Q4_K)
        if shape.arch == "qwen2":
            for name, width in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                vector(p + name + ".bias", width, 0.0)
        matrix(p + "attn_output.weight", shape.d_model, q, T.Q4_K)
        vector(p + "ffn_norm.weight", shape.d_model, 1.0)
        matrix(p + "ffn_gate.weight", shape.ffn, shape.d_model, T.Q4_K)
        matrix(p + "ffn_up.weight", shape.ffn, shape.d_model, T.Q4_K)
        matrix(p + "ffn_down.weight", shape.d_model, shape.ffn, T.Q6_K if more else T.Q4_K)
    vector("output_norm.weight", shape.d_model, 1.0)
    if not shape.tied:
        matrix("output.weight", shape.vocab, shape.d_model, T.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ensure(name: str, path: Path | None = None) -> Path:
    """The synthetic file of shape `name` (written once)."""
    if path is None:
        from passes.cache import cache_dir

        path = cache_dir("gguf") / f"synthetic-{name}-Q4_K_M.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        write(SHAPES[name], partial)
        partial.rename(path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args(argv)
    print(ensure(args.shape, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
