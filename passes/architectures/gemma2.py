"""`gemma2`: Gemma 2 (llama.cpp's src/models/gemma2.cpp; convert_hf_to_gguf's Gemma2Model, which stores each RMSNorm
weight as 1 + w, so the file's norm weights multiply as LLaMA's do).

The embedding scaled by sqrt(d_model); norms before and after attention and the FFN; GeGLU; the scores scaled by
llama.cpp's rule (`QueryScale`: 1/sqrt(head_dim), the 27B's 46 layers 1/sqrt(d_model / heads)) and soft-capped
(attn_logit_softcapping, 50 where absent); every other layer sliding-window (the even ones; 4096 where
attention.sliding_window is absent); the logits soft-capped (final_logit_softcapping, 30); the output layer always
the embedding table (llama.cpp reads no output.weight).
"""

from . import (DECODER_PARAMS, SOFTCAP_PARAMS, Activation, Architecture, EmbeddingScale, Need, Norm, NormPlacement,
               Param, QKRows, QueryScale, Rope, SlidingWindow)

GEMMA2 = Architecture(
    name="gemma2",
    params=(*DECODER_PARAMS, *SOFTCAP_PARAMS,
            Param("rope_base_swa", "rope.freq_base_swa", float, lambda got: got["rope_base"])),
    qk_rows=QKRows.ROTATE_HALF,  # llama.cpp's NeoX RoPE: the converter stores q / k rows as transformers has them
    qkv_bias=Need.ABSENT,
    norm=Norm.RMS,
    norm_placement=NormPlacement.SANDWICH,
    activation=Activation.GELU_TANH,
    rope=frozenset({Rope.LINEAR}),  # llama.cpp's gemma2 has no rope_freqs tensor
    tied_output=True,
    own_output=False,
    embedding_scale=EmbeddingScale.SQRT_D_MODEL,
    query_scale=QueryScale(wide_at_layers=46),
    sliding_window=SlidingWindow(period=2, window=4096),
)
