"""Sizes of what a compiled model stores: its weights, its KV cache, and the type each device stores its
weights in. The one home of these totals: import's memory check, recognise's context check, predict's
pricing of a decode step and partition's GPU budget all ask here (element sizes come from `runtime.dtypes`).
"""

from __future__ import annotations

from typing import Iterable

import onnx_ir as ir

from runtime.dtypes import WEIGHT_DTYPES, itemsize

KV_CACHE_DTYPE = "float32"  # the KV cache buffers select-kernels makes
GPU_WEIGHT_DTYPE = "float32"  # --weight-dtype changes the CPU's storage only (`weight_storage_dtype`)
PREDICTOR_DTYPE = "float32"  # select-kernels stores the predictors as they are trained, on either device


def weight_bytes(graph: ir.Graph) -> int:
    """Bytes of the graph's constants as they are held now, inline or in external data (sized, not read)."""
    return sum(int(v.const_value.nbytes) for v in graph.initializers.values() if v.const_value is not None)


def parameter_count(graph: ir.Graph) -> int:
    """Elements of the graph's constants: the model's parameters."""
    return sum(int(v.const_value.size) for v in graph.initializers.values() if v.const_value is not None)


def kv_cache_bytes(attentions: Iterable[tuple[int, int]], max_context: int) -> int:
    """The KV cache for `max_context` tokens; `attentions` gives (num_kv_heads, head_dim) per layer."""
    return sum(2 * heads * head_dim for heads, head_dim in attentions) * max_context * itemsize(KV_CACHE_DTYPE)


def weight_storage_dtype(device: str, weight_dtype: str) -> str:
    """The element type a device stores its weight matrices in, for `--weight-dtype` (fp32 or fp16):
    the CPU's follow it, the GPU's stay fp32. select-kernels stores them so; placement prices them so."""
    return WEIGHT_DTYPES[weight_dtype] if device == "cpu" else GPU_WEIGHT_DTYPE
