"""Sizes of what a compiled model stores: its weights, its KV cache, and the type each device stores its
weights in. The one home of these totals: import's memory check, recognise's context check, predict's
pricing of a decode step and partition's GPU budget all ask here (element sizes come from `runtime.dtypes`).
"""

from __future__ import annotations

import math
from typing import Iterable

import onnx_ir as ir

from runtime.dtypes import WEIGHT_FORMATS, WeightFormat, itemsize, nbytes

KV_CACHE_DTYPE = "float32"  # the KV cache buffers select-kernels makes
GPU_WEIGHT_FORMAT = WEIGHT_FORMATS["fp16"]
"""What the GPU stores its weight matrices and embedding tables in, whatever --weight-dtype says of the CPU's
(`weight_format`): fp16, so the hot neurons a card holds are twice fp32's (its kernels convert as they load;
the GPU's quantized kernels exist, placement does not put quantized rows on it yet)."""


def weight_bytes(graph: ir.Graph) -> int:
    """Bytes of the graph's constants as they are held now, inline or in external data (sized, not read)."""
    return sum(int(v.const_value.nbytes) for v in graph.initializers.values() if v.const_value is not None)


def parameter_count(graph: ir.Graph) -> int:
    """Elements of the graph's constants: the model's parameters."""
    return sum(int(v.const_value.size) for v in graph.initializers.values() if v.const_value is not None)


PREFILL_ROWS = 512
"""Rows of every row buffer (activations, input_ids, the logits) of an artifact whose context is longer: the most
tokens one step computes. The runtime prefills a longer prompt in steps of at most this many (runtime/engine.py),
so that a step's memory does not grow with the context or the prompt (llama.cpp's default micro-batch is 512)."""


def prefill_rows(max_context: int) -> int:
    """Rows of an artifact's row buffers at `max_context`."""
    return min(max_context, PREFILL_ROWS)


def kv_cache_bytes(attentions: Iterable[tuple[int, int]], max_context: int) -> int:
    """The KV cache for `max_context` tokens; `attentions` gives (num_kv_heads, head_dim) per layer."""
    return sum(2 * heads * head_dim for heads, head_dim in attentions) * max_context * itemsize(KV_CACHE_DTYPE)


def weight_format(device: str, cpu_format: WeightFormat) -> WeightFormat:
    """The format a device stores its weight matrices in, where the CPU's is `cpu_format` (the build's --weight-dtype,
    `BuildTarget.weight_format`): the GPU's are GPU_WEIGHT_FORMAT. The quantize pass and select-kernels store them
    so; predict, partition and lower price them so (`WeightFormat.bytes_per_weight`)."""
    return cpu_format if device == "cpu" else GPU_WEIGHT_FORMAT


def gpu_bytes(shape) -> int:
    """Bytes of a constant of `shape` on the GPU: a matrix (2-D or more: linear weights, embedding tables) in
    GPU_WEIGHT_FORMAT, as select-kernels stores them there; a vector (biases, norms) in fp32."""
    if len(shape) >= 2:
        return math.ceil(math.prod(int(d) for d in shape) * GPU_WEIGHT_FORMAT.bytes_per_weight)
    return nbytes(shape, "float32")


def cpu_bytes(shape, cpu_format: WeightFormat) -> int:
    """Bytes of a constant of `shape` on the CPU: a matrix (2-D or more) in the build's `cpu_format`, a vector in
    fp32."""
    if len(shape) >= 2:
        return math.ceil(math.prod(int(d) for d in shape) * cpu_format.bytes_per_weight)
    return nbytes(shape, "float32")


def float_format(fmt: WeightFormat) -> WeightFormat:
    """The float format a build in `fmt` stores a matrix in that it does not quantize (not a whole number of
    blocks): fmt itself for float builds, fp16 for quantized ones."""
    return WEIGHT_FORMATS["fp16"] if fmt.quantized else fmt


PREDICTOR_FORMAT = WEIGHT_FORMATS["int8"]
"""What the CPU stores predictors in, whatever --weight-dtype: int8 blocks, which the quantize pass makes.
int4 ones lose too much of a score's margin (their precision at recall 0.99 fell to a third); a predictor is
read whole every decode step, so its bytes are what it costs: int8 ones cost a quarter of fp32's, predicted as
precisely (measurements: BENCHMARKS.md#measurements-behind-the-codes-constants). Predict fits the thresholds
to the predictors as stored; predict and lower price them so."""


def stored_predictor_format(shape: tuple[int, ...], fmt: WeightFormat) -> WeightFormat:
    """What a predictor matrix of `shape` (w1 [d_model, r], w2 [r, ffn], blocked along their first axis) is stored
    in, given PREDICTOR_FORMAT `fmt`: `fmt` where that axis is whole blocks, else `float_format(fmt)` (the
    quantize pass keeps such a matrix in floats: w2 of a rank that is part of a block, twice int8's bytes)."""
    return float_format(fmt) if fmt.quantized and shape[0] % fmt.block else fmt
