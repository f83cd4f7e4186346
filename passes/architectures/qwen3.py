"""`qwen3`: Qwen3 (dense): Qwen2's block without its required biases, with an RMSNorm over each head's query and
key before RoPE."""

from . import DECODER_PARAMS, Activation, Architecture, Need, Norm, NormPlacement, QKRows, Rope

QWEN3 = Architecture(
    name="qwen3",
    params=DECODER_PARAMS,  # attention.key_length: Qwen3's head_dim is not d_model / heads
    qk_rows=QKRows.ROTATE_HALF,
    qkv_bias=Need.OPTIONAL,  # Qwen3 has none (attention_bias false); llama.cpp reads them where a file has them
    norm=Norm.RMS,
    norm_placement=NormPlacement.PRE,
    activation=Activation.SILU,
    rope=frozenset({Rope.LINEAR}),  # llama.cpp's qwen3 has no rope_freqs tensor
    tied_output=True,
    qk_norm=True,
)
