"""`phi3`: Phi-3, Phi-3.5 and Phi-4 (transformers' Phi3ForCausalLM): LLaMA's block, its q, k and v in one fused
tensor and its gate and up in another, as transformers' checkpoints store them (llama.cpp's converter keeps both, and
does not permute q / k: src/models/phi3.cpp computes NeoX RoPE and ggml_swiglu, gate first, on them)."""

from . import DECODER_PARAMS, Activation, Architecture, Fused, Need, Norm, NormPlacement, QKRows, Refused, Rope

_LONGROPE = ("LongRoPE's (Phi-3-128k, Phi-3.5, Phi-4-mini), which picompile does not compile yet: llama.cpp scales "
             "RoPE's cos and sin by rope.scaling.attn_factor as well, and picompile's attention scores take "
             "1/sqrt(head_dim) only")

PHI3 = Architecture(
    name="phi3",
    # (attention.sliding_window, which the converter writes from transformers' config, is not read: llama.cpp
    # attends to every position of a phi3 file, its SWA disabled, and a build computes what llama.cpp computes)
    params=DECODER_PARAMS,
    qk_rows=QKRows.ROTATE_HALF,
    qkv_bias=Need.ABSENT,
    norm=Norm.RMS,
    norm_placement=NormPlacement.PRE,
    activation=Activation.SILU,
    rope=frozenset({Rope.LINEAR}),  # llama.cpp's generic scaling (the converter writes none); no rope_freqs tensor
    tied_output=True,  # llama.cpp's phi3 reads the embedding table where output.weight is absent
    fused=(Fused("attn_qkv.weight", ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
           Fused("ffn_up.weight", ("ffn_gate.weight", "ffn_up.weight"))),
    refused=(Refused("rope_factors_long.weight", _LONGROPE), Refused("rope_factors_short.weight", _LONGROPE)),
)
