"""Model makers: random-weight ReLU decoder LLMs with *synthetic* PowerInfer-style sparsity.

Nothing here downloads anything. A model is built from a transformers config with random
weights (``torch.manual_seed(seed)``), optionally given *synthetic* activation sparsity that
imitates what trained ReLU models show, exported to ONNX in optimum's KV-cache convention,
and written next to random calibration / held-out token files.

Families (ReLU unless noted; presets ``tiny``, ``small``, ``1b``; LLaMA also ``7b`` and ``13b``, made layer by
layer by :mod:`examples.streamed_models`)
    ``opt``    OPTForCausalLM, ReLU FFN (fc1 -> relu -> fc2), pre-LayerNorm, biases, tied LM head.
    ``llama``  LlamaForCausalLM with ``hidden_act="relu"`` (gated ReGLU: down(relu(gate(x)) * up(x))),
               grouped-query attention, untied LM head, no biases anywhere. ``hidden_act="silu"`` makes
               the SwiGLU LLaMA, ``"gelu"`` / ``"gelu_pytorch_tanh"`` the GeGLU one (exact or tanh GELU,
               Gemma's FFN) (dense-random only: synthetic sparsity needs ReLU's exact zeros).
    ``llama_tied``  the same with ``tie_word_embeddings=True`` (LM head = token embedding transposed).
    ``gpt2``   GPT2LMHeadModel with ``activation_function="relu"``: Conv1D layers (weights [in, out],
               transposed against nn.Linear), one fused QKV projection, learned positions, tied LM head.
    ``neox``   GPTNeoXForCausalLM with ``hidden_act="relu"``: parallel residual (x + attn(ln1(x)) +
               mlp(ln2(x))), fused QKV interleaved per head, partial rotary (a quarter of each head).
    ``falcon`` FalconForCausalLM with ``activation="relu"`` (FalconConfig has the field): parallel attention
               and FFN from one LayerNorm, multi-query attention (one key/value head), fused QKV, RoPE,
               no biases, tied LM head.

Synthetic sparsity (``sparsity=0.9, skew="zipf"``; ``sparsity=None`` leaves the model dense-random)
    The numbers are *synthetic*: they are what this maker designed, not what any trained model
    does. Per FFN layer, in order (each layer is calibrated on inputs produced by the already
    calibrated earlier layers, in one forward pass, through forward pre-hooks):

    1. Low rank plus noise. The up weight (and gate weight for llama) is ``a_i * L_i + b_i * E_i``
       with ``L = U V^T`` of rank ``lowrank_rank`` (default ``min(64, hidden // 4)``, V an
       orthonormal input basis shared by gate and up) and ``E`` full-rank Gaussian noise. Per
       neuron, ``a_i, b_i`` are chosen from the measured input covariance so that the low-rank
       part carries ``predictability`` (default 0.95; old name ``lowrank_var``) of the pre-activation
       variance and the total
       variance equals what the default init (std 0.02) gives. (0.95 rather than 0.9: trained
       models' predictors reach > 0.95 recall; on the tiny preset a rank-32 least-squares probe
       gets recall ~0.94 at 0.95, ~0.91 at 0.9, ~0.72 on full-rank weights.) So which neurons fire is
       predictable from a low-dimensional projection of the input, as in trained models
       (on full-rank random weights small predictors fail: see shared/POWERINFER.md).
    2. Power-law activation probabilities. Neuron of rank k gets ``p_k = min(c * k^-alpha, pmax)``
       (``alpha = 1`` for ``"zipf"``; ``"uniform"`` gives every neuron the same p; a float or
       ``"zipf:1.2"`` sets alpha), ``c`` solved so that ``mean(p) = 1 - sparsity``, and the ranks
       are randomly permuted across neurons.
    3. Thresholds. On random tokens, each neuron's threshold is the ``1 - p_i`` quantile of its
       pre-activation, so that P(pre-activation > 0) = p_i:
       - OPT: ``fc1.bias_i = -quantile(w_i . x, 1 - p_i)`` where x is the final_layer_norm output;
         GPT-2 and GPT-NeoX the same through their FFN up bias. Falcon has no biases and no bias
         channel: it is made dense-random only (``sparsity=None``).
       - LLaMA has no biases, so the offset goes through a *constant channel* ("bias channel",
         like the massive activations of trained LLMs): one residual channel ``c`` is set to a
         constant ``M > 0`` in every token embedding, and row ``c`` of every ``o_proj`` and
         ``down_proj`` is zeroed, so ``h_c == M`` exactly in every layer. After RMSNorm
         ``x_c = g_c * M / rms(h) > 0`` (g_c > 0) varies with the token, but
         ``gate_i(x) = (W_i . (g*h) + beta_i * g_c * M) / rms(h)`` has the sign of an affine
         function of h, so column c of gate_proj is an exact bias in sign. Low-rank and noise
         parts leave column c empty; ``beta_i = -quantile(a_i / x_c, 1 - p_i)`` with
         ``a_i = W_i . x`` makes P(gate_i > 0) = p_i exactly on the calibration tokens. The
         channel index is recorded in the metadata (``synthetic_sparsity.bias_channel``).
    4. Measurement. On the held-out tokens, forward pre-hooks on fc2 / down_proj (whose input is
       relu(fc1) or relu(gate) * up; zero means inactive) count active neurons per layer; the
       per-layer sparsity and the top-20%-neuron share of activations are stored and returned.

The benchmark family (issue 13: a benchmark on a model that is easy in ways we chose measures little)
    ``predictability`` (in [0, 1]) is the knob: the share of each neuron's pre-activation variance that
    the low-rank part carries; the rest is full-rank noise a small predictor cannot see, so at recall 0.99
    it must switch on more neurons the lower it is. It goes into the config hash (as every override),
    ``config.json`` (``predictability``, also inside ``synthetic_sparsity``), the ONNX metadata
    (``picompile.predictability``) and :class:`ModelFiles`. The second knob is the calibration size,
    ``calib_seqs`` sequences of ``seq_len`` (64) tokens in calib.npy (``calib_tokens`` in config.json): the
    compiler's profile and predictors see only those. ``PREDICTABILITY_LEVELS`` names the levels and
    ``FAMILY`` the sweep; benchmarks/bench_cpu_decode.py ``--predictability family --calib-tokens 1024,4096``
    runs it. Measured (2026-12-01) at the ``small`` width (hidden 768, FFN 3072, low-rank rank 64, 2 layers),
    sparsity 0.9 zipf, last layer, 20% of the calibration tokens held out to set the threshold for recall
    0.99: precision (truly active among predicted active) of passes/predict.py's least-squares probe
    (``probe_active``, ranks 64 / 128 / 256, some 384) and of ``train_predictor`` at rank 128, both given
    the pre-activations as the pass gives them (layer 0 measured alike where measured):

    ============== ============ =========================== ============
    predictability calib tokens probe r64 / r128 / r256 (r384) trained r128
    ============== ============ =========================== ============
    0.99 (easy)    1,024        0.52 / 0.62 / 0.63          0.49
    0.99 (easy)    4,096        0.67 / 0.78 / 0.83          0.81
    0.95 (default) 1,024        0.49 / 0.58 / 0.59          0.45
    0.95 (default) 4,096        0.58 / 0.71 / 0.77          0.71
    0.8 (medium)   1,024        0.32 / 0.43 / 0.49          0.35
    0.8 (medium)   4,096        0.37 / 0.51 / 0.62          0.50
    0.6            1,024        0.22 / 0.31 / -             -
    0.6            4,096        0.24 / 0.37 / -             -
    0.5            1,024        0.19 / 0.26 / 0.34          0.24
    0.5            4,096        0.21 / 0.31 / 0.44          0.30
    0.4 (hard)     1,024        0.18 / 0.24 / 0.32          0.21
    0.4 (hard)     4,096        0.19 / 0.28 / 0.41          0.27
    0.3            1,024        - / 0.21 / 0.29 (0.36)      -
    0.3            4,096        - / 0.25 / 0.37 (0.49)      -
    0.0            1,024        0.15 / 0.18 / 0.23 (0.30)   -
    0.0            4,096        0.16 / 0.22 / 0.32 (0.43)   -
    ============== ============ =========================== ============

    So the calibration size is a difficulty of its own (1,024 tokens cost the easy level a third of its
    precision: a rank-128 predictor overfits 819 training tokens), and the hard level is at or below 0.3
    for a trained rank-128 predictor with either size. Precision grows with the predictor's rank at every
    level, even at 0 (the pre-activation is linear in the input, so a predictor of rank near hidden learns
    it whatever the weights): with 4,096 tokens, rank 256 reaches 0.41 at the hard level. The predict pass
    picks each layer's rank by the bytes a decode step reads, so the family's hard end is (hard, 1,024
    tokens), and the precision a build reached is the one to read (its manifest; the benchmark prints it).
    Through the whole build (bench_cpu_decode.py at ``--preset small``, 12 layers, the pass's own ranks; one
    short run on a loaded 2-core machine, so read the precision, not the speed): (easy, 4,096 tokens) ranks
    64-80, precision 0.70, 14.5% predicted active, top-1 0.984, byte limit 1.73x; (hard, 1,024 tokens)
    ranks 160-224, precision 0.19, 56.5% predicted active, top-1 0.941, byte limit 1.35x. At the tiny
    preset the levels order the same way (precision 0.58-0.70, 0.36-0.43, 0.24-0.28; tests/test_models.py
    checks the order with a probe).

Files a maker writes into a model directory
    ``model.onnx`` (weights inline below 1.8 GB, else in ``model.onnx.data`` beside it),
    ``calib.npy`` / ``heldout.npy`` (int64 [n, len] random token ids), ``config.json``
    (picompile metadata, HF config, measured sparsity), ``sparsity.npz`` (``target_p`` and
    ``measured_freq``, float [layers, ffn]; absent for dense models).

Exporters: ``dynamo`` / ``legacy`` (torch.onnx), ``ort_basic`` / ``ort_extended`` (the dynamo export
saved again by onnxruntime after its basic / extended graph optimisations), ``optimum`` (optimum-onnx's
own export of the model saved with save_pretrained, in an environment of its own made once by
``scripts/optimum_env.py``: :func:`make_optimum_venv`; its names are optimum's, some inputs may be absent,
e.g. Falcon's mask).

ONNX convention (optimum's): inputs ``input_ids`` [batch, seq] int64, ``attention_mask``
[batch, total] int64 (total = past + seq), ``position_ids`` [batch, seq] int64 (rotary families only),
``past_key_values.{i}.key|value`` [batch, kv_heads, past, head_dim]; outputs ``logits``
[batch, seq, vocab], ``present.{i}.key|value`` [batch, kv_heads, total, head_dim].
Empty past (past = 0) works in onnxruntime for both exporters; prefill uses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

MAKER_VERSION = "2"  # 2: the synthetic FFN weights drawn in float32 (streamed 7B/13B makers share them)
FAMILIES = ("opt", "llama", "llama_tied", "gpt2", "neox", "falcon")
# torch.onnx's two exporters; "ort_basic" / "ort_extended": the dynamo export saved again by onnxruntime
# after its basic / extended graph optimisations (fused contrib ops); "optimum": optimum-onnx's exporter,
# run in its own environment (it needs transformers < 4.58): see export_optimum.
EXPORTERS = ("dynamo", "legacy", "ort_basic", "ort_extended", "optimum")
ORT_LEVELS = {"ort_basic": "ORT_ENABLE_BASIC", "ort_extended": "ORT_ENABLE_EXTENDED"}
INLINE_LIMIT_BYTES = 1_800_000_000
SPARSITY_TOLERANCE = 0.03  # per-layer |measured - asked| the maker verifies (warns if missed)

# Presets: plain data, transformers config field names per family.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "opt": {
        "tiny": dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, vocab_size=128,
                     num_attention_heads=4, max_position_embeddings=256),
        "small": dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, vocab_size=32000,
                      num_attention_heads=12, max_position_embeddings=2048),
        "1b": dict(hidden_size=2048, num_hidden_layers=16, ffn_dim=8192, vocab_size=32000,
                   num_attention_heads=32, max_position_embeddings=2048),
    },
    "llama": {
        "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256, vocab_size=128,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        "small": dict(hidden_size=768, num_hidden_layers=8, intermediate_size=3072, vocab_size=32000,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
        "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, vocab_size=32000,
                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
        # LLaMA-2-7B / 13B's shapes (multi-head attention, as ReluLLaMA and ProSparse keep; num_key_value_heads=8
        # makes them grouped-query), made layer by layer by examples/streamed_models.py, fp16 by default
        "7b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        "13b": dict(hidden_size=5120, num_hidden_layers=40, intermediate_size=13824, vocab_size=32000,
                    num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
    },
    "gpt2": {
        "tiny": dict(n_embd=64, n_layer=2, n_inner=256, vocab_size=128, n_head=4, n_positions=256,
                     bos_token_id=127, eos_token_id=127),
        "small": dict(n_embd=768, n_layer=12, n_inner=3072, vocab_size=32000, n_head=12, n_positions=2048,
                      bos_token_id=31999, eos_token_id=31999),
        "1b": dict(n_embd=2048, n_layer=16, n_inner=8192, vocab_size=32000, n_head=16, n_positions=2048,
                   bos_token_id=31999, eos_token_id=31999),
    },
    "neox": {
        "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256, vocab_size=128,
                     num_attention_heads=4, max_position_embeddings=256),
        "small": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, vocab_size=32000,
                      num_attention_heads=12, max_position_embeddings=2048),
        "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, vocab_size=32000,
                   num_attention_heads=16, max_position_embeddings=2048),
    },
    "falcon": {
        "tiny": dict(hidden_size=64, num_hidden_layers=2, ffn_hidden_size=256, vocab_size=128,
                     num_attention_heads=4, max_position_embeddings=256),
        "small": dict(hidden_size=768, num_hidden_layers=12, ffn_hidden_size=3072, vocab_size=32000,
                      num_attention_heads=12, max_position_embeddings=2048),
        "1b": dict(hidden_size=2048, num_hidden_layers=16, ffn_hidden_size=8192, vocab_size=32000,
                   num_attention_heads=16, max_position_embeddings=2048),
    },
}
PRESETS["llama_tied"] = PRESETS["llama"]  # the same sizes; the output layer is the embedding's transpose

# Fixed architecture choices (not overridable: they define the family).
FAMILY_FIXED: dict[str, dict[str, Any]] = {
    "opt": dict(activation_function="relu", do_layer_norm_before=True, enable_bias=True,
                dropout=0.0, attention_dropout=0.0, layerdrop=0.0),
    "llama": dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "llama_tied": dict(hidden_act="relu", tie_word_embeddings=True, attention_bias=False, mlp_bias=False),
    "gpt2": dict(activation_function="relu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 tie_word_embeddings=True),
    "neox": dict(hidden_act="relu", use_parallel_residual=True, attention_bias=True, tie_word_embeddings=False,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    "falcon": dict(activation="relu", parallel_attn=True, multi_query=True, new_decoder_architecture=False,
                   alibi=False, bias=False, tie_word_embeddings=True),
}
# Architecture choices a family allows (the first is the default).
FAMILY_CHOICES: dict[str, dict[str, tuple]] = {
    "llama": dict(hidden_act=("relu", "silu", "gelu", "gelu_pytorch_tanh")),  # ReGLU, SwiGLU, GeGLU (exact, tanh)
}
# transformers config and model class per family; model_type (config.model_type) per family.
MODEL_CLASSES = {"opt": ("OPTConfig", "OPTForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "llama_tied": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
                 "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"), "falcon": ("FalconConfig", "FalconForCausalLM")}
# these take position_ids (optimum's inputs too); qwen3: tests/test_qwen3.py exports transformers' Qwen3 with them
ROTARY_TYPES = ("llama", "gpt_neox", "falcon", "qwen3")
BIASED_FFN_TYPES = ("opt", "gpt2", "gpt_neox")  # synthetic thresholds go into the FFN up bias

# Knobs of the synthetic structure (may be passed as keyword overrides). Only overrides given are hashed,
# so changing a default here must bump MAKER_VERSION (else cached models of the old default are reused).
# `predictability` (called lowrank_var before; that name is still accepted) is the difficulty knob of the
# benchmark family: see PREDICTABILITY_LEVELS.
SYNTH_DEFAULTS: dict[str, Any] = dict(lowrank_rank=None, predictability=0.95, pmax=0.95)
SYNTH_ALIASES = {"lowrank_var": "predictability"}
# The benchmark family (issue 13): one synthetic model per difficulty level, easy to hard, at the same size and
# sparsity. `predictability` is the share of each neuron's pre-activation variance that the low-rank part
# carries (the rest is full-rank noise no small predictor sees), so the lower, the more neurons a predictor
# must switch on to keep recall 0.99. Measured values: see the module docstring ("The benchmark family").
PREDICTABILITY_LEVELS: dict[str, float] = dict(easy=0.99, medium=0.8, hard=0.4)
FAMILY: dict[str, Any] = dict(
    family="opt", sparsity=0.9, skew="zipf", knob="predictability", levels=PREDICTABILITY_LEVELS,
    calib_seqs=(16, 64),  # 1,024 (the hard case of issue 13) and 4,096 calibration tokens of 64
    note="iterate over levels x calib_seqs; everything else as cached_model's defaults")
# Token files (may be passed as keyword overrides): sequences x tokens of calib / held-out data;
# the synthesis itself is calibrated on a third, independent draw of the same size.
# `calib_seqs` (None: n_seqs) sizes calib.npy alone, so a benchmark can starve the compiler's profile and
# predictors of calibration data (the hard case of issue 13: 1,024 tokens for an FFN of 8192) while the
# synthesis and the held-out measurement keep n_seqs sequences.
TOKEN_DEFAULTS: dict[str, Any] = dict(n_seqs=64, seq_len=64, calib_seqs=None)

__all__ = [
    "MAKER_VERSION", "PRESETS", "ModelFiles", "make_config", "build_model", "synthesize_sparsity",
    "activation_probs", "measure_sparsity", "ffn_modules", "export_onnx", "make_model",
    "cached_model", "cache_dir", "config_hash", "write_tokens", "read_tokens", "random_tokens",
    "ort_logits_steps", "ort_greedy", "num_params", "io_names", "make_models", "cached_models", "ort_optimise",
    "matmul_weights_as_initializers", "ort_quantize_nbits",
    "export_optimum", "optimum_python", "optimum_venv", "make_optimum_venv", "build_cached",
    "PREDICTABILITY_LEVELS", "FAMILY",
]


# ----------------------------------------------------------------------------- configs / models


def _canonical(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides with old knob names replaced by their current ones (so both spellings hash alike)."""
    out = {}
    for key, value in overrides.items():
        key = SYNTH_ALIASES.get(key, key)
        if key in out:
            raise ValueError(f"{key} given twice (once by an old name: {sorted(SYNTH_ALIASES)})")
        out[key] = value
    return out


def _split_overrides(overrides: dict[str, Any]) -> tuple[dict, dict, dict]:
    overrides = _canonical(overrides)
    synth = {k: overrides[k] for k in SYNTH_DEFAULTS if k in overrides}
    tokens = {k: overrides[k] for k in TOKEN_DEFAULTS if k in overrides}
    arch = {k: v for k, v in overrides.items() if k not in SYNTH_DEFAULTS and k not in TOKEN_DEFAULTS}
    return arch, synth, tokens


def make_config(family: str, preset: str = "tiny", **overrides):
    """A transformers config for ``family`` at ``preset``; keyword overrides are config fields."""
    import transformers

    if family not in PRESETS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if preset not in PRESETS[family]:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS[family])}")
    fields = dict(PRESETS[family][preset])
    fields.update(overrides)
    for key, value in FAMILY_FIXED[family].items():
        if key in overrides and overrides[key] != value:
            raise ValueError(f"{family}: {key} is fixed to {value!r}")
        fields[key] = value
    for key, allowed in FAMILY_CHOICES.get(family, {}).items():
        fields.setdefault(key, allowed[0])
        if fields[key] not in allowed:
            raise ValueError(f"{family}: {key} must be one of {allowed}, got {fields[key]!r}")
    if family == "opt":
        fields["word_embed_proj_dim"] = fields["hidden_size"]
    if family.startswith("llama") and fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError("llama: num_key_value_heads must divide num_attention_heads")
    return getattr(transformers, MODEL_CLASSES[family][0])(**fields)


def ffn_modules(model) -> list[dict[str, torch.nn.Module]]:
    """Per decoder layer: {'norm', 'up', 'down'} (+ 'gate' for llama) modules of the FFN.
    GPT-2's up/down are Conv1D modules, whose weights are [in, out] (transposed against nn.Linear)."""
    family = model.config.model_type
    if family == "opt":
        return [dict(norm=l.final_layer_norm, up=l.fc1, down=l.fc2, layer=l) for l in model.model.decoder.layers]
    if family == "llama":
        return [dict(norm=l.post_attention_layernorm, gate=l.mlp.gate_proj, up=l.mlp.up_proj,
                     down=l.mlp.down_proj, mlp=l.mlp, layer=l) for l in model.model.layers]
    if family == "gpt2":
        return [dict(norm=l.ln_2, up=l.mlp.c_fc, down=l.mlp.c_proj, layer=l) for l in model.transformer.h]
    if family == "gpt_neox":
        return [dict(norm=l.post_attention_layernorm, up=l.mlp.dense_h_to_4h, down=l.mlp.dense_4h_to_h, layer=l)
                for l in model.gpt_neox.layers]
    if family == "falcon":  # one LayerNorm feeds attention and FFN (parallel blocks)
        return [dict(norm=l.input_layernorm, up=l.mlp.dense_h_to_4h, down=l.mlp.dense_4h_to_h, layer=l)
                for l in model.transformer.h]
    raise ValueError(f"unsupported model type {family!r}")


def _linear_weight(module) -> torch.Tensor:
    """The weight as [out, in] (nn.Linear's layout; GPT-2's Conv1D stores [in, out])."""
    return module.weight.T if type(module).__name__ == "Conv1D" else module.weight


def num_params(model) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _randomize_small(model, generator: torch.Generator) -> None:
    """Norm weights 1 + 0.1*randn, norm biases 0.1*randn, linear biases 0.02*randn, so that no
    two initializers are equal (ONNX optimizers de-duplicate identical constants)."""
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if isinstance(module, torch.nn.LayerNorm) or name.endswith("RMSNorm"):
                if getattr(module, "weight", None) is not None:
                    module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
            elif (isinstance(module, torch.nn.Linear) or name == "Conv1D") and module.bias is not None:
                module.bias.copy_(0.02 * torch.randn(module.bias.shape, generator=generator))


def random_tokens(vocab_size: int, n_seqs: int, seq_len: int, seed: int, avoid: Sequence[int] = ()) -> np.ndarray:
    """Uniform random token ids, int64 [n_seqs, seq_len], never one of ``avoid`` (e.g. pad)."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(avoid), dtype=np.int64))
    rng = np.random.default_rng(seed)
    return allowed[rng.integers(0, len(allowed), size=(n_seqs, seq_len))].astype(np.int64)


def _avoid_ids(config) -> list[int]:
    pad = getattr(config, "pad_token_id", None)
    return [pad] if isinstance(pad, int) and 0 <= pad < config.vocab_size else []


def build_model(family: str, preset: str = "tiny", sparsity: float | None = None, skew: str | float = "zipf",
                seed: int = 0, **overrides):
    """Build the (deterministic) torch model. Returns ``(model, report)``.

    ``report`` is None for dense models, else the dict from :func:`synthesize_sparsity`
    (design parameters; the measured sparsity comes from :func:`measure_sparsity`).
    """
    import transformers

    arch, synth, tokens = _split_overrides(overrides)
    config = make_config(family, preset, **arch)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[family][1])(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    _randomize_small(model, generator)
    report = None
    if sparsity is not None and getattr(config, "hidden_act", "relu") != "relu":
        raise ValueError(f"synthetic sparsity needs a ReLU FFN; {family} has hidden_act={config.hidden_act!r}")
    if sparsity is not None:
        t = {**TOKEN_DEFAULTS, **tokens}
        synth_ids = random_tokens(config.vocab_size, t["n_seqs"], t["seq_len"], seed + 1001, _avoid_ids(config))
        report = synthesize_sparsity(model, synth_ids, sparsity=sparsity, skew=skew, seed=seed,
                                     **{**SYNTH_DEFAULTS, **synth})
    return model, report


# ----------------------------------------------------------------------------- synthetic sparsity


def _parse_skew(skew: str | float) -> float:
    if isinstance(skew, (int, float)):
        return float(skew)
    s = str(skew).lower()
    if s in ("uniform", "none", "flat"):
        return 0.0
    if s == "zipf":
        return 1.0
    if s.startswith("zipf:"):
        return float(s.split(":", 1)[1])
    raise ValueError(f"unknown skew {skew!r}: use 'zipf', 'zipf:<alpha>', 'uniform' or a float alpha")


def activation_probs(n: int, mean: float, skew: str | float = "zipf", pmax: float = 0.95,
                     rng: np.random.Generator | None = None) -> np.ndarray:
    """*Synthetic* per-neuron activation probabilities: ``min(c * rank^-alpha, pmax)`` with the
    mean equal to ``mean``, randomly permuted across the ``n`` neurons (if ``rng`` is given)."""
    alpha = _parse_skew(skew)
    if not 0 < mean < pmax:
        raise ValueError(f"mean activation probability {mean} must lie in (0, pmax={pmax})")
    base = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    lo, hi = 0.0, pmax / base.min()
    for _ in range(200):
        c = 0.5 * (lo + hi)
        if np.minimum(c * base, pmax).mean() > mean:
            hi = c
        else:
            lo = c
    p = np.minimum(0.5 * (lo + hi) * base, pmax)
    return p[rng.permutation(n)] if rng is not None else p


def _column_quantile(values: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-column quantile (linear interpolation): values [N, F], q [F] in [0, 1] -> [F]."""
    n = values.shape[0]
    ordered = values.sort(dim=0).values
    pos = q.to(torch.float64).clamp(0, 1) * (n - 1)
    lo = pos.floor().long().clamp(0, n - 1)
    hi = (lo + 1).clamp(max=n - 1)
    frac = (pos - lo.to(torch.float64)).to(values.dtype)
    v_lo = ordered.gather(0, lo[None])[0]
    v_hi = ordered.gather(0, hi[None])[0]
    return v_lo + frac * (v_hi - v_lo)


def _lowrank_plus_noise(x: torch.Tensor, basis: torch.Tensor, out_features: int, var_frac: float,
                        std: float, generator: torch.Generator, zero_col: int | None) -> torch.Tensor:
    """Weight [F, d] = a_i * (U V^T)_i + b_i * E_i with the low-rank part carrying ``var_frac`` of
    each neuron's pre-activation variance under the covariance of ``x`` [N, d], and a total
    variance of std^2 * trace(cov) (what an isotropic std-``std`` init gives). The variances are those of
    the projections of the centred ``x`` (w^T cov w, without forming the d x d covariance: a 7B layer's FFN
    costs N x d x F, not F x d x d, multiply-adds)."""
    d = x.shape[1]
    xc = x.float() - x.float().mean(0, keepdim=True)
    u = torch.randn(out_features, basis.shape[1], generator=generator)
    low = u @ basis.T.float()
    noise = torch.randn(out_features, d, generator=generator)
    variances = (xc * xc).sum(0) / max(1, x.shape[0] - 1)
    if zero_col is not None:
        noise[:, zero_col] = 0
        low[:, zero_col] = 0
        variances[zero_col] = 0
    total = std**2 * float(variances.double().sum())
    projected_variance = lambda w: ((xc @ w.T).double().pow(2).sum(0) / max(1, x.shape[0] - 1)).clamp_min(1e-30)
    a = (var_frac * total / projected_variance(low)).sqrt().float()
    b = ((1 - var_frac) * total / projected_variance(noise)).sqrt().float()
    return (a[:, None] * low + b[:, None] * noise).to(x.dtype)


def _orthonormal_basis(d: int, rank: int, dims: list[int], generator: torch.Generator) -> torch.Tensor:
    """[d, rank] float64: an orthonormal basis of a random rank-`rank` subspace of the channels `dims`
    (the others, the bias channel, stay zero)."""
    q, _ = torch.linalg.qr(torch.randn(len(dims), rank, generator=generator, dtype=torch.float64))
    basis = torch.zeros(d, rank, dtype=torch.float64)
    basis[dims] = q
    return basis


def _bias_channel_column(x: torch.Tensor, gate: torch.Tensor, bias_channel: int, p: torch.Tensor) -> torch.Tensor:
    """LLaMA's threshold through the constant channel: beta with P(gate_i(x) > 0) = p_i on the rows of `x`
    (gate's column `bias_channel` is empty; x's is positive after RMSNorm: see the module docstring)."""
    xc = x[:, bias_channel]
    if not bool((xc > 0).all()):
        raise RuntimeError("llama bias channel is not positive after RMSNorm")
    return -_column_quantile((x @ gate.T) / xc[:, None], 1 - p)


def synthesize_sparsity(model, token_ids: np.ndarray, sparsity: float = 0.9, skew: str | float = "zipf",
                        seed: int = 0, lowrank_rank: int | None = None, predictability: float = 0.95,
                        pmax: float = 0.95) -> dict:
    """Give ``model`` *synthetic* PowerInfer-like FFN sparsity, in place (see the module docstring).

    One forward pass over ``token_ids`` [n, len]; a forward pre-hook on each layer's FFN rewrites
    that layer's up/gate weights (and OPT's fc1 bias) from the inputs it is about to see, so
    each layer is calibrated on inputs produced by the already calibrated earlier layers.
    Returns the design: target probabilities ``target_p`` [layers, ffn], rank, bias channel...
    """
    if not 0 < sparsity < 1:
        raise ValueError("sparsity must be in (0, 1)")
    if not 0 <= predictability <= 1:
        raise ValueError(f"predictability {predictability} must be in [0, 1] (a share of variance)")
    config = model.config
    family = config.model_type
    if family not in BIASED_FFN_TYPES and family != "llama":
        raise ValueError(f"synthetic sparsity needs FFN up biases or llama's bias channel; {family} has neither "
                         "(build it dense-random: sparsity=None)")
    d = config.hidden_size
    rank = int(lowrank_rank) if lowrank_rank else min(64, max(1, d // 4))
    std = float(getattr(config, "init_std", None) or getattr(config, "initializer_range", 0.02))
    rng = np.random.default_rng(seed + 7)
    generator = torch.Generator().manual_seed(seed + 2)
    layers = ffn_modules(model)
    ffn = _linear_weight(layers[0]["up"]).shape[0]
    target_p = np.stack([activation_probs(ffn, 1 - sparsity, skew, pmax, rng) for _ in layers])

    bias_channel = None
    if family == "llama":
        bias_channel = int(rng.integers(d))
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            others = torch.cat([emb[:, :bias_channel], emb[:, bias_channel + 1:]], 1)
            emb[:, bias_channel] = 5.0 * float(others.std())
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[bias_channel, :] = 0
                layer.mlp.down_proj.weight[bias_channel, :] = 0
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight[bias_channel] = norm.weight[bias_channel].abs().clamp_min(0.5)
            model.model.norm.weight[bias_channel] = model.model.norm.weight[bias_channel].abs().clamp_min(0.5)
    basis_dims = [i for i in range(d) if i != bias_channel]
    if rank > len(basis_dims):
        raise ValueError(f"lowrank_rank {rank} > input dimension {len(basis_dims)}")

    achieved: list[float] = []

    def calibrate(index: int, x: torch.Tensor) -> None:
        mods = layers[index]
        x = x.detach().reshape(-1, d).float()
        p = torch.from_numpy(target_p[index])
        basis = _orthonormal_basis(d, rank, basis_dims, generator)
        up = _lowrank_plus_noise(x, basis, ffn, predictability, std, generator, bias_channel)
        if family in BIASED_FFN_TYPES:
            pre = x @ up.T
            threshold = _column_quantile(pre, 1 - p)
            _linear_weight(mods["up"]).copy_(up)
            mods["up"].bias.copy_(-threshold)
            achieved.append(float((pre - threshold > 0).float().mean()))
        else:
            gate = _lowrank_plus_noise(x, basis, ffn, predictability, std, generator, bias_channel)
            gate[:, bias_channel] = _bias_channel_column(x, gate, bias_channel, p)
            up[:, bias_channel] = std * torch.randn(ffn, generator=generator, dtype=torch.float64).float()
            mods["gate"].weight.copy_(gate)
            mods["up"].weight.copy_(up)
            achieved.append(float((x @ gate.T > 0).float().mean()))

    handles = []
    for index, mods in enumerate(layers):
        target = mods["up"] if family in BIASED_FFN_TYPES else mods["mlp"]
        handles.append(target.register_forward_pre_hook(lambda m, args, i=index: calibrate(i, args[0])))
    try:
        with torch.no_grad():
            _forward_tokens(model, token_ids, batch=len(token_ids))
    finally:
        for handle in handles:
            handle.remove()
    return dict(
        synthetic=True, sparsity=float(sparsity), skew=str(skew), alpha=_parse_skew(skew), pmax=pmax,
        lowrank_rank=rank, predictability=predictability, bias_channel=bias_channel,
        calibration_tokens=int(np.asarray(token_ids).size),
        calibration_active_fraction=achieved, target_p=target_p,
        method=("per-neuron threshold = (1 - p_i) quantile of the pre-activation on random tokens; "
                + ("FFN up bias (OPT fc1, GPT-2 c_fc, GPT-NeoX dense_h_to_4h)" if family in BIASED_FFN_TYPES else
                   "LLaMA: column `bias_channel` of gate_proj against a constant residual channel")),
    )


def _forward_tokens(model, token_ids: np.ndarray, batch: int = 16) -> None:
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
    for start in range(0, ids.shape[0], batch):
        chunk = ids[start:start + batch]
        model(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False)


def measure_sparsity(model, token_ids: np.ndarray, batch: int = 16) -> dict:
    """Measure FFN activation sparsity with forward pre-hooks on fc2 / down_proj, whose input is
    relu(fc1 x) (OPT) or relu(gate x) * up x (LLaMA); an exact zero means inactive.

    Returns ``per_layer`` sparsity, ``mean``, ``top20_share`` per layer (fraction of all
    activations carried by the 20% most frequently active neurons) and ``freq`` [layers, ffn].
    """
    layers = ffn_modules(model)
    counts = [None] * len(layers)
    tokens = [0]

    def hook(index: int, act: torch.Tensor) -> None:
        flat = act.detach().reshape(-1, act.shape[-1])
        c = (flat != 0).sum(0).double()
        counts[index] = c if counts[index] is None else counts[index] + c
        if index == 0:
            tokens[0] += flat.shape[0]

    handles = [mods["down"].register_forward_pre_hook(lambda m, args, i=i: hook(i, args[0]))
               for i, mods in enumerate(layers)]
    try:
        with torch.no_grad():
            _forward_tokens(model, token_ids, batch)
    finally:
        for handle in handles:
            handle.remove()
    freq = np.stack([(c / tokens[0]).numpy() for c in counts])
    return dict(summarise_activity(freq, tokens[0]), freq=freq)


def summarise_activity(freq: np.ndarray, tokens: int) -> dict:
    """Per-layer sparsity, its mean and the top-20%-neuron share of activations, from each neuron's active
    frequency ``freq`` [layers, ffn] over ``tokens`` tokens."""
    per_layer = [float(1 - f.mean()) for f in freq]
    top = []
    for f in freq:
        ordered = np.sort(f)[::-1]
        top.append(float(ordered[: max(1, len(f) // 5)].sum() / max(ordered.sum(), 1e-30)))
    return dict(per_layer=per_layer, mean=float(np.mean(per_layer)), top20_share=top, tokens=int(tokens))


# ----------------------------------------------------------------------------- ONNX export


def _kv_shape(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if config.model_type == "falcon" and config.multi_query and not config.new_decoder_architecture:
        kv_heads = 1  # multi-query attention: one key/value head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def io_names(config) -> tuple[list[str], list[str]]:
    n, _, _ = _kv_shape(config)
    pos = config.model_type in ROTARY_TYPES
    inputs = ["input_ids", "attention_mask"] + (["position_ids"] if pos else [])
    inputs += [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    outputs = ["logits"] + [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    return inputs, outputs


class _KVWrapper(torch.nn.Module):
    """Flat-tensor KV-cache interface around a transformers causal LM (DynamicCache inside)."""

    def __init__(self, model, n_layers: int, with_positions: bool):
        super().__init__()
        self.m, self.n, self.pos = model, n_layers, with_positions
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids, attention_mask, *rest):
        from transformers.cache_utils import DynamicCache

        if self.pos:
            position_ids, rest = rest[0], rest[1:]
        cache = DynamicCache()
        for i in range(self.n):
            cache.update(rest[2 * i], rest[2 * i + 1], i)
        kw = dict(position_ids=position_ids) if self.pos else {}
        kw[self.cache_kw] = cache
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kw)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        present = []
        for layer in new_cache.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def export_onnx(model, out_dir: str | os.PathLike, exporter: str = "dynamo", opset: int = 18,
                name: str = "model.onnx", metadata: dict[str, str] | None = None) -> Path:
    """Export ``model`` with a KV cache (optimum's names, see the module docstring) to
    ``out_dir/name``. Weights go inline when under 1.8 GB, else into ``name + '.data'`` beside it.

    dynamo: torch.onnx.export(dynamo=True), dynamic batch/seq/past/total (past exported with
    min 1, but past = 0 runs fine in onnxruntime). legacy: dynamo=False, dynamic_axes.
    """
    import onnx

    if exporter == "optimum":
        return export_optimum([(model, out_dir, metadata)])[0]
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}")
    config = model.config
    n, kv_heads, head_dim = _kv_shape(config)
    pos = config.model_type in ROTARY_TYPES
    inputs, outputs = io_names(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir, prefix=".export-"))
    raw = work / "raw.onnx"
    wrapper = _KVWrapper(model.eval(), n, pos).eval()
    batch, past, seq = 2, 3, 2
    gen = torch.Generator().manual_seed(0)
    args = [torch.randint(0, config.vocab_size, (batch, seq), generator=gen),
            torch.ones(batch, past + seq, dtype=torch.long)]
    if pos:
        args.append(torch.arange(past, past + seq).repeat(batch, 1))
    dtype = next(model.parameters()).dtype
    args += [torch.randn(batch, kv_heads, past, head_dim, generator=gen, dtype=dtype) for _ in range(2 * n)]
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet_loggers("torch.onnx"):
            warnings.simplefilter("ignore")
            if exporter == "legacy":
                axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                        "logits": {0: "batch", 1: "seq"}}
                if pos:
                    axes["position_ids"] = {0: "batch", 1: "seq"}
                for nm in inputs[2 + pos:]:
                    axes[nm] = {0: "batch", 2: "past"}
                for nm in outputs[1:]:
                    axes[nm] = {0: "batch", 2: "total"}
                torch.onnx.export(wrapper, tuple(args), str(raw), input_names=inputs, output_names=outputs,
                                  dynamic_axes=axes, dynamo=False, opset_version=opset)
            else:
                from torch.export import Dim

                b = Dim("batch", min=1, max=256)
                s = Dim("seq", min=1, max=config.max_position_embeddings)
                p = Dim("past", min=1, max=config.max_position_embeddings)
                t = Dim("total", min=2, max=2 * config.max_position_embeddings)
                shapes = [{0: b, 1: s}, {0: b, 1: t},
                          tuple(([{0: b, 1: s}] if pos else []) + [{0: b, 2: p}] * (2 * n))]
                torch.onnx.export(wrapper, tuple(args), str(raw), input_names=inputs, output_names=outputs,
                                  dynamic_shapes=tuple(shapes), dynamo=True, opset_version=opset,
                                  external_data=True, verbose=False)
        if exporter in ORT_LEVELS:
            raw = ort_optimise(raw, work / "optimised.onnx", exporter)
        proto = onnx.load(str(raw))
        # Name the present length like the attention mask's ("total"), as the legacy export does.
        for value in proto.graph.output[1:]:
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[2].dim_param:
                dims[2].dim_param = "total"
        for value in proto.graph.output[:1]:
            dims = value.type.tensor_type.shape.dim
            if dims and dims[0].dim_param:
                dims[0].dim_param = "batch"
        target = _save_onnx(proto, out_dir, name, n_bytes, exporter, metadata)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def ort_optimise(source: str | os.PathLike, target: str | os.PathLike, level: str = "ort_extended") -> Path:
    """Save ``source`` as onnxruntime optimises it for the CPU at ``level`` ("ort_basic": constant folding
    and redundant nodes; "ort_extended": also fusions into its own ops such as FusedGemm, FusedMatMul,
    SkipLayerNormalization, SimplifiedLayerNormalization), via SessionOptions.optimized_model_filepath."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_LEVELS[level])
    options.optimized_model_filepath = str(target)
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return Path(target)


def matmul_weights_as_initializers(proto) -> int:
    """Rewrite `proto` in place so that each linear layer is a MatMul reading its weight from a [K, N]
    initializer, which is what onnxruntime's MatMulNBits quantizer quantizes (MatMul weights that are
    initializers, nothing else): a Gemm whose weight is a 2-D initializer becomes MatMul (+ Add of beta x C;
    alpha folded into the weight; the dynamo export writes OPT's FFN projections so), and a MatMul of a
    Transpose of a 2-D initializer (a tied output layer, which the exporter's folding leaves when large) reads
    the transposed initializer. A Gemm with transA, or whose weight or bias is computed, stays. Returns how
    many nodes were rewritten."""
    import onnx
    from onnx import numpy_helper

    graph = proto.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    taken = set(initializers) | set(producers)
    transposed: dict[str, str] = {}  # initializer -> its [K, N] transpose, made once however many read it

    def fresh(name: str) -> str:
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    def release(name: str) -> None:
        uses[name] -= 1
        if not uses[name] and name in initializers:  # no longer read: drop it rather than keep both
            graph.initializer.remove(initializers.pop(name))

    nodes, rewritten, dead = [], 0, set()
    for node in graph.node:
        standard = node.domain in ("", "ai.onnx")
        if standard and node.op_type == "MatMul" and node.input[1] in producers:
            transpose = producers[node.input[1]]
            perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
            source = initializers.get(transpose.input[0]) if transpose.op_type == "Transpose" else None
            if source is not None and len(source.dims) == 2 and perm in ([], [[1, 0]]):
                if source.name not in transposed:
                    transposed[source.name] = fresh(source.name + ".T")
                    w = np.ascontiguousarray(numpy_helper.to_array(source).T)
                    graph.initializer.append(numpy_helper.from_array(w, transposed[source.name]))
                uses[node.input[1]] -= 1
                if not uses[node.input[1]]:
                    dead.add(id(transpose))
                node.input[1] = transposed[source.name]
                rewritten += 1
            nodes.append(node)
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        weight = initializers.get(node.input[1]) if standard and node.op_type == "Gemm" else None
        bias_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if (weight is None or len(weight.dims) != 2 or attrs.get("transA", 0)
                or (bias_name is not None and bias_name not in initializers)):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight).astype(np.float32)
        w = (w.T if attrs.get("transB", 0) else w) * np.float32(attrs.get("alpha", 1.0))
        name = fresh(weight.name + ".kn")
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), name))
        release(weight.name)
        out = node.output[0]
        if bias_name is None:
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], name], [out], name=node.name))
        else:
            beta = np.float32(attrs.get("beta", 1.0))
            if beta != 1.0:
                bias = numpy_helper.to_array(initializers[bias_name]).astype(np.float32) * beta
                release(bias_name)
                bias_name = fresh(bias_name + ".scaled")
                graph.initializer.append(numpy_helper.from_array(bias, bias_name))
            product = fresh(out + ".matmul")
            nodes += [onnx.helper.make_node("MatMul", [node.input[0], name], [product], name=node.name),
                      onnx.helper.make_node("Add", [product, bias_name], [out], name=node.name + ".bias")]
        rewritten += 1
    for transpose in (n for n in nodes if id(n) in dead):
        release(transpose.input[0])  # the untransposed initializer, where nothing else reads it
    del graph.node[:]
    graph.node.extend(n for n in nodes if id(n) not in dead)
    return rewritten


def ort_quantize_nbits(source: str | os.PathLike, target: str | os.PathLike, bits: int = 4, block_size: int = 32,
                       symmetric: bool = True, accuracy_level: int | None = 4, every_matrix: bool = True) -> Path:
    """Save `source` with its MatMul weights quantized by onnxruntime's MatMulNBitsQuantizer into com.microsoft
    MatMulNBits nodes (its linear layers first made MatMuls of initializers, `matmul_weights_as_initializers`:
    Gemms as MatMul + Add, a tied output layer's transpose folded), in `target` (with
    external data beside it when large). Round to nearest: the quantizer's "DEFAULT" algorithm (its C++
    blockwise quantizer; symmetric: scale = the block's largest-magnitude weight / -2^(bits-1), no zero
    points), not its RTNWeightOnlyQuantConfig, which runs Intel neural-compressor, not installed here.
    accuracy_level 4 lets onnxruntime quantize the activations to int8 inside the kernel (its fast CPU path).
    every_matrix=False leaves the graph as it is: the quantizer's own choice, MatMuls whose weight is an
    initializer (a tied output layer, a MatMul of the embedding's Transpose, then stays in floats)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 MatMulNBitsQuantizer)

    proto = onnx.load(str(source))
    if every_matrix:
        matmul_weights_as_initializers(proto)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                          accuracy_level=accuracy_level, bits=bits)
    quantizer = MatMulNBitsQuantizer(proto, algo_config=config)
    with _quiet_loggers("onnxruntime.quantization"):
        quantizer.process()
    quantized = quantizer.model.model
    target = Path(target)
    for stale in (target, target.with_name(target.name + ".data")):
        if stale.exists():
            stale.unlink()
    if quantized.ByteSize() < INLINE_LIMIT_BYTES:
        onnx.save(quantized, str(target))
    else:
        onnx.save(quantized, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=target.name + ".data", size_threshold=1024)
    return target


def _save_onnx(proto, out_dir: Path, name: str, n_bytes: int, exporter: str, metadata: dict[str, str] | None) -> Path:
    """Write an exported model with picompile's metadata, inline below the 1.8 GB limit, else with external data."""
    import onnx

    del proto.metadata_props[:]
    for key, value in {"picompile.exporter": exporter, **(metadata or {})}.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = str(key), str(value)
    target = out_dir / name
    for stale in (target, out_dir / (name + ".data")):
        if stale.exists():
            stale.unlink()
    if n_bytes < INLINE_LIMIT_BYTES:
        onnx.save(proto, str(target), save_as_external_data=False)
    else:
        onnx.save(proto, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=name + ".data", size_threshold=1024)
        os.chmod(out_dir / (name + ".data"), target.stat().st_mode & 0o777)
    return target


# optimum-onnx 0.1.0, the newest, needs transformers < 4.58 (this environment has 5.x): it runs in a virtual
# environment of its own, made once by scripts/optimum_env.py (the README's test command runs it), never by a
# test. That environment sees this one's site-packages through a .pth file (`venv --system-site-packages`
# would expose the base interpreter's packages instead, when this one is itself a venv) and installs only
# what must differ: optimum-onnx, optimum, transformers 4.57 and the older huggingface-hub and tokenizers it
# needs (with requests where this environment lacks it).
OPTIMUM_REQUIREMENTS = ("optimum-onnx==0.1.0", "transformers==4.57.*")
# Reused from this environment, pinned to the versions it has so that pip never installs its own (a torch
# from PyPI is a CUDA build of gigabytes; onnx and onnxruntime fix the exported model's dynamic shapes).
OPTIMUM_SHARED = ("torch", "numpy", "onnx", "onnxruntime")
OPTIMUM_SETUP = "python scripts/optimum_env.py"
_OPTIMUM_EXPORT = """
import json, sys, warnings
warnings.simplefilter("ignore")
from optimum.exporters.onnx import main_export
for model_dir, output in json.loads(sys.argv[1]):
    main_export(model_dir, output=output, task="text-generation-with-past", device="cpu", do_validation=False)
"""


def _site_dirs() -> list[str]:
    """This interpreter's site-packages directories, in its sys.path order (a venv's own, the base's
    where the venv includes them, the user's where enabled): what the optimum environment must see."""
    import site

    dirs = set(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return [entry for entry in sys.path if entry in dirs]


def _optimum_marker() -> str:
    """What a complete optimum environment for this interpreter records: its requirements and the
    site-packages it sees (a change of either means it must be made again)."""
    return json.dumps(dict(requirements=OPTIMUM_REQUIREMENTS, site_dirs=_site_dirs()), indent=1) + "\n"


def optimum_venv() -> Path:
    """Where the optimum environment lives: ``$PICOMPILE_OPTIMUM_VENV``, else
    ``cache_dir()/optimum-venv-<hash of this interpreter's site-packages>`` (one per project environment)."""
    if os.environ.get("PICOMPILE_OPTIMUM_VENV"):
        return Path(os.environ["PICOMPILE_OPTIMUM_VENV"])
    digest = hashlib.sha256("\n".join(_site_dirs()).encode()).hexdigest()[:12]
    return cache_dir() / f"optimum-venv-{digest}"


def _optimum_venv_problem(venv: Path) -> str | None:
    """None where ``venv`` is a complete optimum environment for this interpreter, else what is wrong."""
    marker = venv / ".complete"
    if not marker.exists():
        return "is missing"
    if marker.read_text() != _optimum_marker():
        return "was made for other requirements or another environment's packages"
    return None


def optimum_python() -> Path:
    """The Python of the optimum environment; fails, naming the setup step, where it was not made (or
    was made for other requirements or another interpreter's packages)."""
    venv = optimum_venv()
    problem = _optimum_venv_problem(venv)
    if problem:
        raise RuntimeError(f"the optimum environment {venv} {problem}: run `{OPTIMUM_SETUP}` first "
                           f"(the README's test command does)")
    return venv / "bin" / "python"


def make_optimum_venv(log=lambda message: None) -> Path:
    """Make the optimum environment at :func:`optimum_venv` unless it is already there, complete and
    current; returns its Python. Needs PyPI (or a mirror) once. Made in a temporary directory renamed
    into place when complete, so a killed setup never leaves a half-made environment in use."""
    import subprocess
    from importlib import metadata

    venv = optimum_venv()
    if _optimum_venv_problem(venv) is None:
        return venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=venv.parent, prefix=f".tmp-{venv.name}-"))
    started = time.perf_counter()
    try:
        # without pip of its own: this environment's pip, seen through the .pth, installs into it
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work)], check=True,
                       capture_output=True, text=True)
        python = work / "bin" / "python"
        own_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                  check=True, capture_output=True, text=True).stdout.strip()
        Path(own_site, "_picompile_project.pth").write_text("\n".join(_site_dirs()) + "\n")
        constraints = work / "shared.txt"
        constraints.write_text("".join(f"{name}=={metadata.version(name)}\n" for name in OPTIMUM_SHARED))
        result = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                 "--constraint", str(constraints), *OPTIMUM_REQUIREMENTS],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"could not install {' '.join(OPTIMUM_REQUIREMENTS)} into {work} "
                               f"(pip exit {result.returncode}):\n{result.stderr[-3000:]}")
        check = subprocess.run([str(python), "-c", "import optimum.exporters.onnx, onnxruntime"],
                               capture_output=True, text=True)
        if check.returncode:
            raise RuntimeError(f"the optimum environment {work} cannot import its exporter:\n{check.stderr[-3000:]}")
        installed = sorted(p.name.removesuffix(".dist-info") for p in Path(own_site).glob("*.dist-info"))
        (work / ".complete").write_text(_optimum_marker())
        _replace_optimum_venv(work, venv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"made the optimum environment {venv} in {time.perf_counter() - started:.1f}s: {', '.join(installed)} "
        f"(its {', '.join(OPTIMUM_SHARED)} are this environment's)")
    return venv / "bin" / "python"


def _replace_optimum_venv(work: Path, venv: Path) -> None:
    """Put the finished environment ``work`` at ``venv``, replacing a stale optimum environment there
    (one with a marker: never a directory this code did not make) or a concurrent setup's finished one."""
    if venv.exists() and not (venv / ".complete").exists():
        raise RuntimeError(f"{venv} exists and is not an optimum environment: remove it or set "
                           f"PICOMPILE_OPTIMUM_VENV elsewhere")
    if venv.exists():
        shutil.rmtree(venv)
    try:
        os.rename(work, venv)
    except OSError:
        optimum_python()  # a concurrent setup put its own in place first: use that one, else fail


def export_optimum(jobs: list[tuple[Any, str | os.PathLike, dict[str, str] | None]],
                   log=lambda message: None) -> list[Path]:
    """Export each ``(model, out_dir, metadata)`` with optimum's ONNX exporter (task text-generation-with-past,
    its own graph and names) from a locally saved model directory, all in one process of the optimum
    environment; writes ``out_dir/model.onnx`` like :func:`export_onnx`."""
    import subprocess

    import onnx

    python = optimum_python()
    works, pairs = [], []
    try:
        for model, out_dir, _ in jobs:
            out_dir = Path(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(dir=out_dir, prefix=".export-"))
            works.append(work)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                model.save_pretrained(work / "hf")
            pairs.append((str(work / "hf"), str(work / "onnx")))
        result = subprocess.run([str(python), "-c", _OPTIMUM_EXPORT, json.dumps(pairs)], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"optimum export failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        targets = []
        for (model, out_dir, metadata), work in zip(jobs, works):
            proto = onnx.load(str(work / "onnx" / "model.onnx"))
            n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            targets.append(_save_onnx(proto, Path(out_dir), "model.onnx", n_bytes, "optimum", metadata))
        return targets
    finally:
        for work in works:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    import logging

    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ----------------------------------------------------------------------------- token files


def write_tokens(path: str | os.PathLike, sequences) -> Path:
    """Write token sequences. ``.npy``: int64 [n, len] when all lengths agree, else a 1-D object
    array of int64 arrays. Any other suffix: text, one sequence per line, space-separated ids."""
    path = Path(path)
    seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        if seqs and len({len(s) for s in seqs}) == 1:
            array = np.stack(seqs)
        else:
            array = np.empty(len(seqs), dtype=object)
            for i, s in enumerate(seqs):
                array[i] = s
        with open(path, "wb") as f:  # np.save(path) would append .npy to other names
            np.save(f, array, allow_pickle=array.dtype == object)
    else:
        path.write_text("".join(" ".join(str(int(t)) for t in s) + "\n" for s in seqs))
    return path


def read_tokens(path: str | os.PathLike) -> list[np.ndarray]:
    """Read token sequences as a list of int64 1-D arrays. ``.npy``: 2-D [n, len] integer array
    (one sequence per row), 1-D integer array (one sequence) or 1-D object array of sequences.
    Text: one sequence per line, ids separated by whitespace and/or commas; blank lines skipped."""
    path = Path(path)
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError:  # object arrays (ragged sequences) need pickle
            array = np.load(path, allow_pickle=True)
        if array.dtype == object:
            return [_as_ids(s) for s in array.reshape(-1)]
        if array.ndim == 1:
            return [_as_ids(array)]
        if array.ndim == 2:
            return [_as_ids(row) for row in array]
        raise ValueError(f"{path}: expected a 1-D or 2-D token array, got shape {array.shape}")
    seqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        fields = [f for f in re.split(r"[\s,]+", line.strip()) if f]
        if not fields:
            continue
        try:
            seqs.append(np.array([int(f) for f in fields], dtype=np.int64))
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not an integer token id ({exc})") from None
    return seqs


def _as_ids(values) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        if array.dtype.kind == "f" and np.all(array == np.round(array)):
            array = array.astype(np.int64)
        else:
            raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
    return array.astype(np.int64).reshape(-1)


# ----------------------------------------------------------------------------- making / caching


@dataclasses.dataclass
class ModelFiles:
    """What a maker wrote: paths plus the measured (synthetic or dense-random) FFN sparsity."""

    dir: Path
    onnx: Path
    calib: Path
    heldout: Path
    config: Path
    sparsity: float | None  # measured mean FFN sparsity on heldout (None if not measured)
    layer_sparsity: list[float] = dataclasses.field(default_factory=list)
    top20_share: list[float] = dataclasses.field(default_factory=list)
    stats: Path | None = None  # sparsity.npz (target_p, measured_freq); None for dense models
    predictability: float | None = None  # the synthetic design's (None: dense-random or trained)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "ModelFiles":
        directory = Path(directory)
        meta = json.loads((directory / "config.json").read_text())
        measured = meta.get("measured_sparsity") or {}
        files = meta["files"]
        stats = directory / files["stats"] if files.get("stats") else None
        return cls(dir=directory, onnx=directory / files["onnx"], calib=directory / files["calib"],
                   heldout=directory / files["heldout"], config=directory / "config.json",
                   sparsity=measured.get("mean"), layer_sparsity=measured.get("per_layer", []),
                   top20_share=measured.get("top20_share", []), stats=stats,
                   predictability=meta.get("predictability"))

    def paths(self) -> list[Path]:
        extra = [self.onnx.with_name(self.onnx.name + ".data")]
        return [p for p in [self.onnx, *extra, self.calib, self.heldout, self.config, self.stats]
                if p is not None and p.exists()]


def make_model(family: str, out_dir: str | os.PathLike, preset: str = "tiny", sparsity: float | None = None,
               skew: str | float = "zipf", exporter: str = "dynamo", seed: int = 0,
               log=lambda message: None, **overrides) -> ModelFiles:
    """Build, (synthetically) sparsify, measure, export and write a model into ``out_dir``."""
    return make_models([(dict(family=family, preset=preset, sparsity=sparsity, skew=skew, exporter=exporter, seed=seed,
                              **overrides), out_dir)], log)[0]


def make_models(jobs: list[tuple[dict, str | os.PathLike]], log=lambda message: None) -> list[ModelFiles]:
    """:func:`make_model` for several ``(make_model keyword arguments, out_dir)`` jobs; the optimum exports
    among them run in one process of the isolated environment (its start-up dominates a tiny export). The big
    presets (``7b``, ``13b``), and any LLaMA spec with ``streamed=True`` (an fp16 ``1b`` to compare with them), are
    made layer by layer by :mod:`examples.streamed_models`."""
    from examples.streamed_models import STREAMED_PRESETS, make_streamed_model

    streamed = {index: make_streamed_model(out_dir, log=log, **_streamed_spec(spec))
                for index, (spec, out_dir) in enumerate(jobs)
                if spec.get("preset") in STREAMED_PRESETS or spec.get("streamed")}
    jobs = [job for index, job in enumerate(jobs) if index not in streamed]
    made = iter(_make_in_memory(jobs, log))
    return [streamed[index] if index in streamed else next(made) for index in range(len(jobs) + len(streamed))]


def _streamed_spec(spec: dict) -> dict:
    """make_model's keywords as make_streamed_model takes them: a streamed preset is a LLaMA ReGLU made by the
    dynamo exporter, so those two keywords must say so."""
    spec = dict(spec)
    spec.pop("streamed", None)
    family, exporter = spec.pop("family"), spec.pop("exporter", "dynamo")
    if family != "llama" or exporter != "dynamo":
        raise ValueError(f"preset {spec.get('preset')!r} is made layer by layer as a LLaMA by the dynamo exporter, "
                         f"not {family!r} by {exporter!r}")
    return spec


def _make_in_memory(jobs: list[tuple[dict, str | os.PathLike]], log) -> list[ModelFiles]:
    states = [_prepare_model(out_dir=out_dir, log=log, **spec) for spec, out_dir in jobs]
    optimum = [state for state in states if state["exporter"] == "optimum"]
    if optimum:
        started = time.perf_counter()
        paths = export_optimum([(state["model"], state["out_dir"], state["onnx_meta"]) for state in optimum], log)
        for state, path in zip(optimum, paths):
            state["onnx_path"], state["export_s"] = path, (time.perf_counter() - started) / len(optimum)
    for state in states:
        if state["exporter"] != "optimum":
            started = time.perf_counter()
            state["onnx_path"] = export_onnx(state["model"], state["out_dir"], state["exporter"], metadata=state["onnx_meta"])
            state["export_s"] = time.perf_counter() - started
        log(f"exported ({state['exporter']}) in {state['export_s']:.1f}s")
    return [_finish_model(**state) for state in states]


def _prepare_model(family: str, out_dir: str | os.PathLike, preset: str = "tiny", sparsity: float | None = None,
                   skew: str | float = "zipf", exporter: str = "dynamo", seed: int = 0,
                   log=lambda message: None, **overrides) -> dict:
    """Everything of make_model before the export: model, token files, measured sparsity."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, _, token_over = _split_overrides(overrides)
    tok = {**TOKEN_DEFAULTS, **token_over}
    started = time.perf_counter()
    model, report = build_model(family, preset, sparsity, skew, seed, **overrides)
    built = time.perf_counter()
    log(f"built {family}-{preset} ({num_params(model) / 1e6:.1f}M params) in {built - started:.1f}s")
    config = model.config
    avoid = _avoid_ids(config)
    calib_seqs = tok["calib_seqs"] or tok["n_seqs"]
    calib = random_tokens(config.vocab_size, calib_seqs, tok["seq_len"], seed + 2001, avoid)
    heldout = random_tokens(config.vocab_size, tok["n_seqs"], tok["seq_len"], seed + 3001, avoid)
    calib_path = write_tokens(out_dir / "calib.npy", calib)
    heldout_path = write_tokens(out_dir / "heldout.npy", heldout)
    measured = measure_sparsity(model, heldout)
    measured_at = time.perf_counter()
    log(f"measured sparsity {measured['mean']:.4f} per layer "
        f"{[round(s, 4) for s in measured['per_layer']]} in {measured_at - built:.1f}s")
    checks = None
    if report is not None:  # verify the synthetic design was reached (held-out tokens, not the fitted ones)
        worst = max(abs(sp - sparsity) for sp in measured["per_layer"])
        skewed = min(measured["top20_share"]) > 0.5
        checks = dict(sparsity_tolerance=SPARSITY_TOLERANCE, worst_layer_deviation=worst,
                      sparsity_ok=worst <= SPARSITY_TOLERANCE, min_top20_share=min(measured["top20_share"]),
                      skew_ok=skewed if report["alpha"] > 0 else None)
        if worst > SPARSITY_TOLERANCE:
            warnings.warn(f"synthetic sparsity missed: a layer deviates {worst:.3f} from {sparsity}")
        if report["alpha"] > 0 and not skewed:
            warnings.warn("synthetic skew missed: top 20% of neurons carry <= 50% of activations in some layer")
    stats_path = None
    if report is not None:
        stats_path = out_dir / "sparsity.npz"
        np.savez(stats_path, target_p=report["target_p"].astype(np.float32),
                 measured_freq=measured["freq"].astype(np.float32))
    inputs, outputs = io_names(config)
    _, kv_heads, head_dim = _kv_shape(config)
    onnx_meta = {"picompile.family": family, "picompile.preset": preset, "picompile.seed": str(seed),
                 "picompile.synthetic_sparsity": "none" if sparsity is None else f"{sparsity} ({skew})",
                 "picompile.maker_version": MAKER_VERSION}
    if report is not None:
        onnx_meta["picompile.predictability"] = str(report["predictability"])
    return dict(locals(), log=log)


def _finish_model(*, family, preset, sparsity, skew, exporter, seed, overrides, model, report, config, measured,
                  checks, calib_path, heldout_path, stats_path, inputs, outputs, kv_heads, head_dim, onnx_path,
                  started, built, measured_at, export_s, out_dir, **_) -> ModelFiles:
    """Everything of make_model after the export: the metadata file."""
    exported = measured_at + export_s
    synth_meta = None
    if report is not None:
        synth_meta = {k: v for k, v in report.items() if k != "target_p"}
    meta = dict(
        maker_version=MAKER_VERSION, family=family, preset=preset, seed=seed, exporter=exporter, opset=18,
        overrides=_canonical(overrides), num_params=num_params(model),
        # the difficulty knob of the benchmark family (None: dense-random, nothing designed to predict)
        predictability=None if report is None else report["predictability"],
        calib_tokens=sum(len(seq) for seq in read_tokens(calib_path)),
        synthetic_sparsity=synth_meta,
        measured_sparsity=dict(on="heldout.npy", tokens=measured["tokens"], mean=measured["mean"],
                               per_layer=measured["per_layer"], top20_share=measured["top20_share"],
                               checks=checks,
                               note=("synthetic sparsity designed by examples/models.py" if report is not None
                                     else "dense-random model (no synthetic sparsity)")),
        onnx=dict(inputs=inputs, outputs=outputs, kv_heads=kv_heads, head_dim=head_dim,
                  num_layers=config.num_hidden_layers, position_ids=config.model_type in ROTARY_TYPES,
                  empty_past_ok=True),
        files=dict(onnx=onnx_path.name, calib=calib_path.name, heldout=heldout_path.name,
                   stats=stats_path.name if stats_path else None),
        timing_s=dict(build=built - started, measure=measured_at - built, export=exported - measured_at),
        hf_config=config.to_dict(),
    )
    (out_dir / "config.json").write_text(json.dumps(meta, indent=1, default=_json_default) + "\n")
    return ModelFiles.from_dir(out_dir)


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (np.ndarray, tuple, set)):
        return list(value)
    if isinstance(value, (torch.dtype, Path)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def cache_dir() -> Path:
    """``$PICOMPILE_CACHE`` or ``~/.cache/picompile`` (passes.cache's)."""
    from passes.cache import cache_dir as picompile_cache

    return picompile_cache()


ARTIFACT_CACHE_BYTES = 30 * 2**30  # the benchmarks' built artifacts kept (PICOMPILE_ARTIFACT_CACHE_GB overrides)
ARTIFACT_IN_USE_S = 3600  # an artifact built or reused this recently may be in a running benchmark: never evicted


def cached_artifact(name: str) -> Path:
    """Where the benchmarks keep the artifact `name` (a `.pic` directory under the cache's `artifacts`), marked as
    used now when it is there (`evict_artifacts` goes by that)."""
    artifact = cache_dir() / "artifacts" / name
    if artifact.is_dir():
        os.utime(artifact)
    return artifact


def evict_artifacts(keep: Path) -> None:
    """Before a benchmark builds `keep` (a few GB each at 1B parameters): the least recently used artifacts go
    (with their `.build.json` records) until the rest fit ARTIFACT_CACHE_BYTES, sparing any used within
    ARTIFACT_IN_USE_S, which a running benchmark may hold."""
    root = keep.parent
    if not root.is_dir():
        return
    limit = float(os.environ.get("PICOMPILE_ARTIFACT_CACHE_GB", ARTIFACT_CACHE_BYTES / 2**30)) * 2**30
    sizes = {path: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
             for path in root.iterdir() if path.is_dir() and path.suffix == ".pic"}
    total, now = sum(sizes.values()), time.time()
    for path in sorted(sizes, key=lambda path: path.stat().st_mtime):
        if total <= limit:
            break
        if path == keep or now - path.stat().st_mtime < ARTIFACT_IN_USE_S:
            continue
        shutil.rmtree(path, ignore_errors=True)
        path.with_name(path.name + ".build.json").unlink(missing_ok=True)
        total -= sizes[path]


def config_hash(family: str, preset: str = "tiny", sparsity: float | None = None, skew: str | float = "zipf",
                exporter: str = "dynamo", seed: int = 0, **overrides) -> str:
    key = dict(maker_version=MAKER_VERSION, family=family, preset=preset, sparsity=sparsity, skew=skew,
               exporter=exporter, seed=seed, overrides=_canonical(overrides))
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def cached_model(family: str, preset: str = "tiny", sparsity: float | None = None, skew: str | float = "zipf",
                 exporter: str = "dynamo", seed: int = 0, log=lambda message: None, **overrides) -> ModelFiles:
    """Build once per configuration into ``cache_dir()/models/<family>-<preset>-<hash12>/`` and
    reuse it afterwards. Builds go to a temporary sibling directory renamed into place when
    complete, so an interrupted build never leaves a half-written model directory."""
    return cached_models([dict(family=family, preset=preset, sparsity=sparsity, skew=skew, exporter=exporter,
                               seed=seed, **overrides)], log)[0]


def cached_models(specs: list[dict], log=lambda message: None) -> list[ModelFiles]:
    """:func:`cached_model` for several configurations (``cached_model`` keyword arguments); those not
    cached yet are made together by :func:`make_models`."""
    root = cache_dir() / "models"
    finals = []
    for spec in specs:
        spec = {"preset": "tiny", **spec}
        digest = config_hash(**spec)[:12]
        finals.append(root / f"{spec['family']}-{spec['preset']}-{digest}")
    missing = [(spec, final) for spec, final in zip(specs, finals) if not (final / "config.json").exists()]
    if missing:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root)
        works = [Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-")) for _, final in missing]
        try:
            make_models([(spec, work) for (spec, _), work in zip(missing, works)], log)
            for work, (_, final) in zip(works, missing):
                try:
                    os.rename(work, final)
                except OSError:
                    if not (final / "config.json").exists():  # not a concurrent builder's finished copy
                        raise
                    shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            for work in works:
                shutil.rmtree(work, ignore_errors=True)
            raise
    return [ModelFiles.from_dir(final) for final in finals]


def build_cached(final: Path, make, log=lambda message: None) -> Path:
    """``final`` if it holds a finished model (its config.json), else ``make(work)`` into a temporary sibling
    renamed to ``final`` when complete (what cached_models does, for makers of other kinds of models)."""
    final = Path(final)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(final.parent)
    work = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        make(work)
        try:
            os.rename(work, final)
        except OSError:
            if not (final / "config.json").exists():  # not a concurrent builder's finished copy
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _remove_stale_temps(root: Path, max_age_s: float = 24 * 3600) -> None:
    """Remove temporary build directories left by killed runs (older than a day)."""
    now = time.time()
    for entry in root.glob(".tmp-*"):
        try:
            if now - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


# ----------------------------------------------------------------------------- onnxruntime reference


def _session(onnx_path):
    import onnxruntime as ort

    if isinstance(onnx_path, ort.InferenceSession):
        return onnx_path
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


def ort_logits_steps(onnx_path, prompt_ids, n_decode: int) -> list[np.ndarray]:
    """Run greedy decoding in onnxruntime with the KV cache (present fed back as past).

    Prefill runs with an empty past (past length 0). Returns ``[prefill logits [S, vocab],
    decode step 1 logits [vocab], ..., step n_decode]``; each decode step feeds the argmax of
    the previous logits. ``onnx_path`` may also be an ``onnxruntime.InferenceSession``.
    """
    sess = _session(onnx_path)
    names = [i.name for i in sess.get_inputs()]
    meta = {i.name: i for i in sess.get_inputs()}
    past_names = [n for n in names if n.startswith("past_key_values.")]
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(1, -1)
    first = meta[past_names[0]]
    kv_heads, head_dim = int(first.shape[1]), int(first.shape[3])
    dtype = np.float16 if "float16" in first.type else np.float32
    past = {n: np.zeros((1, kv_heads, 0, head_dim), dtype) for n in past_names}
    out_names = [o.name for o in sess.get_outputs()]
    steps: list[np.ndarray] = []
    length = 0
    for step in range(n_decode + 1):
        feed = {"input_ids": ids, "attention_mask": np.ones((1, length + ids.shape[1]), np.int64), **past}
        if "position_ids" in meta:
            feed["position_ids"] = np.arange(length, length + ids.shape[1], dtype=np.int64)[None]
        results = dict(zip(out_names, sess.run(out_names, feed)))
        logits = results["logits"][0]
        steps.append(logits if step == 0 else logits[-1])
        length += ids.shape[1]
        past = {n: results["present." + n[len("past_key_values."):]] for n in past_names}
        ids = np.array([[int(np.argmax(logits[-1]))]], dtype=np.int64)
    return steps


def ort_greedy(onnx_path, prompt_ids, n_new: int) -> list[int]:
    """Greedy generation in onnxruntime with the KV cache; returns the ``n_new`` new token ids
    (the prompt not included)."""
    if n_new <= 0:
        return []
    steps = ort_logits_steps(onnx_path, prompt_ids, n_new - 1)
    return [int(np.argmax(steps[0][-1]))] + [int(np.argmax(s)) for s in steps[1:]]
