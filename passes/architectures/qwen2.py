"""`qwen2`: Qwen2 and Qwen2.5: LLaMA's block with q/k/v biases, its q/k rows stored rotate-half."""

from . import DECODER_PARAMS, Activation, Architecture, Need, Norm, NormPlacement, QKRows, Rope

QWEN2 = Architecture(
    name="qwen2",
    params=DECODER_PARAMS,
    qk_rows=QKRows.ROTATE_HALF,
    qkv_bias=Need.REQUIRED,
    norm=Norm.RMS,
    norm_placement=NormPlacement.PRE,
    activation=Activation.SILU,
    rope=frozenset({Rope.LINEAR}),  # llama.cpp's qwen2 has no rope_freqs tensor
    tied_output=True,
)
