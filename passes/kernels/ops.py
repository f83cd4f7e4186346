"""The kernel registry: one `KernelOp` per kernel generator, holding its makers for every device.

Code that requests kernels names an op (``ops.linear``), never a function name, and asks it for the device
it builds for: ``op.cpu(name, *args, rows=rows, **kwargs)`` or ``op.cuda(...)``, the same arguments for
both (the CPU makers also take CPU-only options, e.g. ``tile_panels``, which a GPU call never passes).
Weight storage is an argument of both: ``wdtype`` ("float32" or "float16") for the float kernels that read a
weight matrix; the block-quantized ops (``*_q``, ``*_qrows``) take ``bits`` (8 or 4) and ``sdtype`` (the scales',
"float16" or "float32"), each weight as (q, scales). A maker is None where the device has no version of the
kernel: the panel kernels, the fused / column-sparse FFN kernels and the CPU's quantized layouts are CPU-only;
the GPU's quantized kernels read ``quant``'s rows layout (``linear_qrows``, ``embed_q``, ``sparse_up_q``,
``sparse_down_q``). Every op has a CPU maker, since the CPU stands in for the GPU when emulating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import cpu, cuda, kquant_columns, kquant_ops, neuron, quant


@dataclass(frozen=True)
class KernelOp:
    name: str
    cpu: Callable | None  # (name, *args, rows=..., **kwargs) -> PrimFunc for LLVM
    cuda: Callable | None  # the same arguments -> PrimFunc for CUDA

    def __repr__(self) -> str:
        return f"ops.{self.name}"


linear = KernelOp("linear", cpu.linear, cuda.linear)
linear_panels = KernelOp("linear_panels", cpu.linear_panels, None)
glu = KernelOp("glu", cpu.glu, cuda.glu)
layer_norm = KernelOp("layer_norm", cpu.layer_norm, cuda.layer_norm)
rms_norm = KernelOp("rms_norm", cpu.rms_norm, cuda.rms_norm)  # with residual: a post-norm and its residual Add
softcap = KernelOp("softcap", cpu.softcap, cuda.softcap)  # the logits' soft-cap (Gemma 2)
embed = KernelOp("embed", cpu.embed, cuda.embed)
embed_q = KernelOp("embed_q", cpu.embed_q, cuda.embed_q)  # block-quantized tables (quant's rows layout)
rope_kv_write = KernelOp("rope_kv_write", cpu.rope_kv_write, cuda.rope_kv_write)
attention = KernelOp("attention", cpu.attention, cuda.attention)
select = KernelOp("select", neuron.select, cuda.select)
sparse_up = KernelOp("sparse_up", neuron.sparse_up, cuda.sparse_up)
sparse_down = KernelOp("sparse_down", neuron.sparse_down, cuda.sparse_down)
sparse_ffn = KernelOp("sparse_ffn", neuron.sparse_ffn, None)
sparse_ffn_q = KernelOp("sparse_ffn_q", neuron.sparse_ffn_q, None)  # over int8 / int4 rows
sparse_columns = KernelOp("sparse_columns", neuron.sparse_columns, None)
sparse_columns_q = KernelOp("sparse_columns_q", neuron.sparse_columns_q, None)  # over quant rows (int8 / int4 / int4a)
merge = KernelOp("merge", neuron.merge, cuda.merge)
concat_columns = KernelOp("concat_columns", cpu.concat_columns, None)  # a linear's parts in different formats
linear_rows = KernelOp("linear_rows", neuron.linear_rows, cuda.linear_rows)
# block-quantized weights (--weight-dtype int8 / int4); the makers also take bits and sdtype (scales). The panels
# are the CPU's alone; the rows kernels (the FFN parts' prefill GEMMs) have GPU twins
linear_panels_q = KernelOp("linear_panels_q", quant.linear_panels_q, None)
linear_rows_q = KernelOp("linear_rows_q", quant.linear_rows_q, cuda.linear_rows_q)  # quant rows, as on the GPU
linear_kn_q = KernelOp("linear_kn_q", quant.linear_kn_q, cuda.linear_kn_q)
# over block-quantized weights in quant's rows layout (the GPU's; the CPU makers are simple twins)
linear_qrows = KernelOp("linear_qrows", cpu.linear_qrows, cuda.linear_qrows)  # W^T [N, K] as quant rows
sparse_up_q = KernelOp("sparse_up_q", neuron.sparse_up_q, cuda.sparse_up_q)
sparse_down_q = KernelOp("sparse_down_q", neuron.sparse_down_q, cuda.sparse_down_q)
# blocks kept from a model file (ggml's q5_0, q5_1, q4_k, q5_k, q6_k: kquant's layouts); the makers take `fmt`, the
# format's name. CPU only
linear_panels_kq = KernelOp("linear_panels_kq", kquant_ops.linear_panels_kq, None)  # kquant's panels
embed_kq = KernelOp("embed_kq", kquant_ops.embed_kq, None)  # kquant's rows
sparse_columns_kq = KernelOp("sparse_columns_kq", kquant_columns.sparse_columns_kq, None)  # kquant's columns
linear_columns_kq = KernelOp("linear_columns_kq", kquant_columns.linear_columns_kq, None)  # their prefill GEMM


def get(name: str) -> KernelOp:
    """The op a kernel spec names (specs are data: the kernel-call IR carries the op's name)."""
    op = globals().get(name)
    if not isinstance(op, KernelOp):
        raise KeyError(f"no kernel op {name!r}")
    return op
