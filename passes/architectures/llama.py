"""`llama`: LLaMA 1-3, and what llama.cpp's converter writes as llama (Mistral, SmolLM, ...)."""

from . import DECODER_PARAMS, Activation, Architecture, Need, Norm, NormPlacement, QKRows, Rope

LLAMA = Architecture(
    name="llama",
    params=DECODER_PARAMS,
    qk_rows=QKRows.PERMUTED,  # convert_hf_to_gguf's LlamaModel.permute
    qkv_bias=Need.OPTIONAL,  # llama.cpp reads them where a file has them
    norm=Norm.RMS,
    norm_placement=NormPlacement.PRE,
    activation=Activation.SILU,
    rope=frozenset({Rope.LINEAR, Rope.FREQS}),
    tied_output=True,
)
