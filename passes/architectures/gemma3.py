"""`gemma3`: Gemma 3's language model (transformers' Gemma3ForCausalLM, and the text half of
Gemma3ForConditionalGeneration; llama.cpp's src/models/gemma3.cpp; convert_hf_to_gguf's Gemma3Model, which stores
each RMSNorm weight as 1 + w, so the file's norm weights multiply as LLaMA's do).

Gemma 2's block (embedding times sqrt(d_model), norms before and after attention and the FFN, GeGLU) with an RMSNorm
over each head's query and key before RoPE (Qwen3's) and no attention soft-cap; the logits soft-capped only where
final_logit_softcapping is in the file. Sliding-window layers only where attention.sliding_window is in the file and
not 0: then five of every six slide (attention.sliding_window_pattern 6; every sixth layer global), their RoPE base
rope.freq_base_swa (10000 where absent) and their positions never scaled, while the global layers take rope.freq_base
and rope.scaling.factor. The scores' scale as llama.cpp's rule has it (`QueryScale`: 1/sqrt(head_dim), the 27B's 62
layers 1/sqrt(d_model / heads)). The output layer is output.weight where the file has it, else the embedding table.
"""

from . import (DECODER_PARAMS, Activation, Architecture, EmbeddingScale, Need, Norm, NormPlacement, Param, QKRows,
               QueryScale, Rope, SlidingWindow)

GEMMA3 = Architecture(
    name="gemma3",
    params=(*DECODER_PARAMS, Param("final_softcap", "final_logit_softcapping", float, 0.0),
            Param("rope_base_swa", "rope.freq_base_swa", float, 10000.0)),
    qk_rows=QKRows.ROTATE_HALF,  # llama.cpp's NeoX RoPE: the converter stores q / k rows as transformers has them
    qkv_bias=Need.ABSENT,
    norm=Norm.RMS,
    norm_placement=NormPlacement.SANDWICH,
    activation=Activation.GELU_TANH,
    rope=frozenset({Rope.LINEAR}),
    tied_output=True,
    embedding_scale=EmbeddingScale.SQRT_D_MODEL,
    query_scale=QueryScale(wide_at_layers=62),
    sliding_window=SlidingWindow(period=6, window=0, scaled=False),
    qk_norm=True,
)
