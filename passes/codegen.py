"""codegen: lower each block op to TVM kernel calls and compile the kernels.

Reads: the block-level IR (`picompile.Embed`, `picompile.Attention`, `picompile.FFN` or, after lower,
`picompile.Predict` / `SparseFFN` / `MergePartial` (predictor mode) or `ThresholdFFN` / `MergePartial`
(threshold mode); norms, residual Adds, the output MatMul) and the
placement report. Adds: a new graph made only of `picompile.Call` nodes, one per kernel call. Each Call
names its kernels (`decode` for one token, `prefill` for a symbolic number of rows; "" where it runs in
one phase only), its arguments in order (`args`: buffer names, with `start` for the cached-token count)
and its device. Values are named `buffer#version`: activation buffers are shared by role across layers
(layers run one after another), so the IR shows where each buffer is written; each device has its own
instance of a buffer (`name@gpu`), with explicit `copy` calls where a value crosses devices. Residual
Adds are fused into the epilogue of the call before them. Every kernel is compiled for the CPU
(`kernels/cpu.so`); a GPU target also gets its GPU calls' kernels from nvcc (`kernels/cuda_<arch>.so`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.errors import UserError
from picompile.pipeline import Context

from .kernels import cpu, neuron, ops


@dataclass
class KernelCall:
    decode: str  # kernel for one-token steps ("" if the call is prefill-only)
    prefill: str  # kernel for multi-token steps ("" if the call is decode-only)
    args: list[str]  # buffer names in argument order; "start" is the scalar position
    writes: list[str]
    label: str  # what it computes, for the IR and the profile (e.g. "layers.3.ffn.up")
    op_class: str  # attention, predictor, ffn_up, ffn_down, merge, norm, embed, head
    device: str = "cpu"


@dataclass
class Lowering:
    """Collects kernels (deduplicated by name) and calls while walking the block IR."""

    max_context: int
    dense_device: str = "cpu"  # where everything but the cold FFN parts runs
    cpu_weight_dtype: str = "float32"  # storage of the CPU's large weights (matrices, embeddings); GPU ones stay fp32
    gemm_panels: int = 1  # weight panels per prefill GEMM register tile (from the CPU instruction set)
    kernels: dict[str, object] = field(default_factory=dict)
    # How each kernel was made (its ops.KernelOp, rows, arguments), so a GPU target can make it again for CUDA.
    kernel_specs: dict[str, tuple] = field(default_factory=dict)
    calls: list[KernelCall] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, dict] = field(default_factory=dict)

    def kernel(self, op: ops.KernelOp, base: str, *args, phases=("decode", "prefill"), **kwargs) -> tuple[str, str]:
        """The kernel's variants: (decode name, prefill name), "" for a phase it does not run in."""
        names = []
        for rows, phase in ((1, "decode"), (None, "prefill")):
            name = f"{base}_{phase}" if phase in phases else ""
            if name and name not in self.kernels:
                self.kernels[name] = op.cpu(name, *args, rows=rows, **kwargs)
                self.kernel_specs[name] = (op, rows, args, kwargs)
            names.append(name)
        return names[0], names[1]

    def activation(self, name: str, width: int, dtype: str = "float32", rows: int | None = None) -> str:
        """A buffer of one row per token (`rows` fixes the row count, e.g. 1 for decode-only scratch)."""
        shape = [rows or self.max_context, width]
        self.buffers.setdefault(name, {"kind": "activation", "shape": shape, "dtype": dtype})
        return name

    def scratch(self, name: str, shape: list[int], dtype: str = "float32") -> str:
        """A kernel's private work area: fixed shape (not one row per token), never copied between devices."""
        self.buffers.setdefault(name, {"kind": "scratch", "shape": list(shape), "dtype": dtype})
        return name

    def weight(self, name: str, array: np.ndarray, dtype: str = "float32", layout: str = "") -> str:
        """Store a weight (`layout` "panels" when panel-packed; the manifest shows it)."""
        self.weights[name] = np.ascontiguousarray(array, dtype=dtype)
        self.buffers[name] = {"kind": "weight", "shape": list(array.shape), "dtype": dtype}
        if layout:
            self.buffers[name]["layout"] = layout
        return name

    def weight_dtype(self, device: str) -> str:
        return self.cpu_weight_dtype if device == "cpu" else "float32"

    def cpu_matrix(self, name: str, device: str) -> str:
        """A large weight in its device's storage type (done once; later calls see it converted)."""
        dtype = self.weight_dtype(device)
        if self.buffers[name]["dtype"] != dtype:
            self.weight(name, self.weights[name], dtype, self.buffers[name].get("layout", ""))
        return name

    def matrix_shape(self, name: str) -> tuple[int, int]:
        """[K, N] of a linear layer's weight, whether stored as [K, N] or panel-packed."""
        info = self.buffers[name]
        return (info["shape"][1], info["logical_columns"]) if info.get("layout") == "panels" else tuple(info["shape"])

    def pack(self, name: str) -> str:
        """Panel-pack a [K, N] weight for the CPU's linear kernels (once)."""
        info = self.buffers[name]
        if info.get("layout") != "panels":
            columns = info["shape"][1]
            self.weight(name, cpu.pack_panels(self.weights[name]), info["dtype"], "panels")
            self.buffers[name]["logical_columns"] = columns
        return name

    def call(self, kernels: tuple[str, str], args: list[str], writes: list[str], label: str, op_class: str,
             device: str | None = None) -> None:
        self.calls.append(KernelCall(kernels[0], kernels[1], args, writes, label, op_class, device or self.dense_device))

    def linear(self, x: str, weight: str, bias: str | None, out: str, label: str, op_class: str,
               act: str = "none", residual: str | None = None, phases=("decode", "prefill"), device: str | None = None,
               packed: bool | None = None) -> None:
        """y = act(x @ W + b) + residual for W given in [K, N] layout. On the CPU W is panel-packed (unless
        `packed` is False: rows a sparse kernel also gathers keep their layout) and stored in the weight dtype;
        the GPU reads [K, N] fp32."""
        device = device or self.dense_device
        packed = device == "cpu" if packed is None else packed
        self.cpu_matrix(weight, device)
        if packed:
            self.pack(weight)
        k, n = self.matrix_shape(weight)
        dtype = self.buffers[weight]["dtype"]
        tags = (f"{'_panels' if packed else ''}{'_f16' if dtype == 'float16' else ''}{'_b' if bias else ''}"
                f"{'' if act == 'none' else '_' + act}{'_res' if residual else ''}")
        flags = dict(bias=bias is not None, act=act, residual=residual is not None)
        if dtype != "float32":
            flags["wdtype"] = dtype
        kernels = self.kernel(ops.linear_panels if packed else ops.linear, f"linear_k{k}_n{n}{tags}", k, n,
                              phases=phases, **flags, **self.gemm_tile(device))
        args = [x, weight] + ([bias] if bias else []) + ([residual] if residual else []) + [out]
        self.call(kernels, args, [out], label, op_class, device)

    def gemm_tile(self, device: str) -> dict:
        """The prefill GEMMs' register tile for `device`: wider on CPUs whose instruction set allows it."""
        return {"tile_panels": self.gemm_panels} if device == "cpu" and self.gemm_panels != 1 else {}

    def glu(self, pre: str, hidden: str, neurons: int, activation: str, label: str, device: str | None = None,
            phases=("decode", "prefill")) -> None:
        """A gated FFN's hidden = act(gate) * up, from `pre` holding the gate and up halves side by side."""
        kernels = self.kernel(ops.glu, f"glu_f{neurons}_{activation}", neurons, act=activation, phases=phases)
        self.call(kernels, [pre, hidden], [hidden], label, "ffn_up", device)

    def zeros(self, name: str, size: int) -> str:
        """A zero bias, so that biased and bias-free models share one kernel shape."""
        return self.weight(name, np.zeros(size, np.float32))


class _Walker:
    """Lowers the block IR node by node, tracking which buffer holds each block-IR value."""

    def __init__(self, graph: ir.Graph, lowering: Lowering):
        self.graph, self.low = graph, lowering
        self.location: dict[str, str] = {}  # block-IR value name -> buffer name
        self.residual_turn = 0
        self.fused_adds: set[str] = set()

    def weight_of(self, value: ir.Value | None) -> str | None:
        if value is None:
            return None
        array = pir.const_array(value)
        if array is None:
            raise UserError(f"{value.name} must be a constant weight")
        if value.name not in self.low.weights:
            self.low.weight(value.name, array)
        return value.name

    def next_residual(self, width: int) -> str:
        """The residual stream alternates between two buffers (a linear reads one and writes the other)."""
        self.residual_turn ^= 1
        return self.low.activation(f"act.residual{self.residual_turn}", width)

    def residual_add_after(self, node: ir.Node) -> ir.Node | None:
        users = node.outputs[0].consumers()
        if len(users) == 1 and users[0].op_type == "Add" and users[0].domain == "":
            return users[0]
        return None

    def output_for(self, node: ir.Node, width: int) -> tuple[str, str | None]:
        """Where a block writes, and the residual it adds (fusing the Add that follows it)."""
        add = self.residual_add_after(node)
        if add is None:
            return self.low.activation(f"act.{node.name}", width), None
        skip = add.inputs[0] if add.inputs[1] is node.outputs[0] else add.inputs[1]
        out = self.next_residual(width)
        self.location[add.outputs[0].name] = out
        self.fused_adds.add(add.name)
        return out, self.location[skip.name]

    def lower(self, node: ir.Node) -> None:
        if node.op_type == "Add" and node.name in self.fused_adds:
            return
        handler = getattr(self, f"lower_{node.op_type}", None)
        if handler is None:
            raise UserError(f"codegen: no kernel for {node.domain or 'onnx'}.{node.op_type} ({node.name})")
        handler(node)

    def lower_Embed(self, node: ir.Node) -> None:
        table = self.low.cpu_matrix(self.weight_of(node.inputs[2]), self.low.dense_device)
        positions = self.weight_of(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        vocab, width = self.low.weights[table].shape
        dtype = self.low.buffers[table]["dtype"]
        out = self.next_residual(width)
        kernels = self.low.kernel(ops.embed, f"embed_v{vocab}_d{width}{'_pos' if positions else ''}"
                                  f"{'_f16' if dtype == 'float16' else ''}", vocab, width,
                                  positions=self.low.max_context if positions else None,
                                  **({"wdtype": dtype} if dtype != "float32" else {}))
        if positions:  # the kernel indexes positions up to max_context: store exactly that many rows
            self.low.weights[positions] = self.low.weights[positions][: self.low.max_context]
            self.low.buffers[positions]["shape"] = list(self.low.weights[positions].shape)
        args = ["input_ids", table] + ([positions, "start"] if positions else []) + [out]
        self.low.call(kernels, args, [out], node.name, "embed")
        self.location[node.outputs[0].name] = out

    def _norm(self, node: ir.Node, kind: str) -> None:
        scale = self.weight_of(node.inputs[1])
        bias = self.weight_of(node.inputs[2]) if kind == "layer" else None
        width = self.low.weights[scale].shape[0]
        eps = float(pir.attr(node, "epsilon", 1e-5))
        out = self.low.activation("act.norm", width)
        make = ops.layer_norm if kind == "layer" else ops.rms_norm
        kernels = self.low.kernel(make, f"{kind}_norm_d{width}_eps{eps:.0e}".replace("-", "m"), width, eps)
        args = [self.location[node.inputs[0].name], scale] + ([bias] if bias else []) + [out]
        self.low.call(kernels, args, [out], node.name, "norm")
        self.location[node.outputs[0].name] = out

    def lower_LayerNormalization(self, node: ir.Node) -> None:
        self._norm(node, "layer")

    def lower_RMSNormalization(self, node: ir.Node) -> None:
        self._norm(node, "rms")

    def lower_Attention(self, node: ir.Node) -> None:
        layer = pir.attr(node, "layer")
        heads, kv_heads, head_dim = (pir.attr(node, a) for a in ("num_heads", "num_kv_heads", "head_dim"))
        scale = pir.attr(node, "scale")
        x = self.location[node.inputs[0].name]
        w_qkv, b_qkv = self.weight_of(node.inputs[4]), self.weight_of(node.inputs[5])
        w_o, b_o = self.weight_of(node.inputs[6]), self.weight_of(node.inputs[7])
        inv_freq = pir.const_array(node.inputs[8]) if node.inputs[8] is not None else None
        ctx = self.low.max_context
        qkv = self.low.activation("act.qkv", (heads + 2 * kv_heads) * head_dim)
        q = self.low.activation("act.q", heads * head_dim)
        attn = self.low.activation("act.attn", heads * head_dim)
        key_cache, value_cache = f"cache.{layer}.key", f"cache.{layer}.value"
        for name in (key_cache, value_cache):
            self.low.buffers[name] = {"kind": "cache", "shape": [kv_heads, ctx, head_dim], "dtype": "float32"}
        p = node.name
        self.low.linear(x, w_qkv, b_qkv, qkv, f"{p}.qkv", "attention")
        rope_args = []
        if inv_freq is not None:
            angles = np.arange(ctx, dtype=np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
            rope_args = [self.shared_table("rope.cos", np.cos(angles)), self.shared_table("rope.sin", np.sin(angles))]
        kernels = self.low.kernel(ops.rope_kv_write, f"rope_kv_h{heads}_kv{kv_heads}_d{head_dim}{'_rope' if rope_args else ''}",
                                  heads, kv_heads, head_dim, ctx, rope=bool(rope_args))
        self.low.call(kernels, [qkv, *rope_args, key_cache, value_cache, q, "start"], [key_cache, value_cache, q],
                      f"{p}.rope_kv", "attention")
        kernels = self.low.kernel(ops.attention, f"attention_h{heads}_kv{kv_heads}_d{head_dim}", heads, kv_heads,
                                  head_dim, ctx, scale)
        self.low.call(kernels, [q, key_cache, value_cache, attn, "start"], [attn], f"{p}.attention", "attention")
        out, residual = self.output_for(node, self.low.weights[w_o].shape[1])
        self.low.linear(attn, w_o, b_o, out, f"{p}.o", "attention", residual=residual)
        self.location[node.outputs[0].name] = out
        self.location[node.outputs[1].name], self.location[node.outputs[2].name] = key_cache, value_cache

    def shared_table(self, name: str, table: np.ndarray) -> str:
        """RoPE tables are the same for every layer of HF models: store one copy, or one per layer if not."""
        existing = self.low.weights.get(name)
        if existing is not None and np.array_equal(existing, table.astype(np.float32)):
            return name
        if existing is not None:
            name = f"{name}.{len(self.low.weights)}"
        return self.low.weight(name, table)

    def lower_FFN(self, node: ir.Node) -> None:
        activation, gated = pir.attr(node, "activation"), bool(pir.attr(node, "gated"))
        x = self.location[node.inputs[0].name]
        w_up, b_up = self.weight_of(node.inputs[1]), self.weight_of(node.inputs[2])
        w_down, b_down = self.weight_of(node.inputs[3]), self.weight_of(node.inputs[4])
        width_up = self.low.weights[w_up].shape[1]
        ffn_width = width_up // 2 if gated else width_up
        p = node.name
        if gated:
            pre = self.low.activation("act.ffn_pre", width_up)
            self.low.linear(x, w_up, b_up, pre, f"{p}.up", "ffn_up")
            hidden = self.low.activation("act.ffn_hidden", ffn_width)
            self.low.glu(pre, hidden, ffn_width, activation, f"{p}.glu")
        else:
            hidden = self.low.activation("act.ffn_hidden", ffn_width)
            self.low.linear(x, w_up, b_up, hidden, f"{p}.up", "ffn_up", act=activation)
        out, residual = self.output_for(node, self.low.weights[w_down].shape[1])
        self.low.linear(hidden, w_down, b_down, out, f"{p}.down", "ffn_down", residual=residual)
        self.location[node.outputs[0].name] = out

    def lower_Predict(self, node: ir.Node) -> None:
        """The predictor runs for one-token steps only: prompts compute every neuron."""
        device = pir.attr(node, "device")
        x, w1 = self.location[node.inputs[0].name], self.weight_of(node.inputs[1])
        hidden = self.low.activation(f"act.predictor_hidden.r{self.low.weights[w1].shape[1]}", self.low.weights[w1].shape[1], rows=1)
        self.low.linear(x, w1, None, hidden, f"{node.name}.fc1", "predictor", act="relu", phases=("decode",), device=device)
        for w2_value, scores in zip(node.inputs[2:], node.outputs):
            w2 = self.weight_of(w2_value)
            out = self.low.activation(f"act.scores.n{self.low.weights[w2].shape[1]}", self.low.weights[w2].shape[1], rows=1)
            self.low.linear(hidden, w2, None, out, f"{scores.name}.fc2", "predictor", phases=("decode",), device=device)
            self.location[scores.name] = out

    def lower_SparseFFN(self, node: ir.Node) -> None:
        part, device, neurons = pir.attr(node, "part"), pir.attr(node, "device"), pir.attr(node, "neurons")
        activation, gated = pir.attr(node, "activation"), bool(pir.attr(node, "gated"))
        x, scores = self.location[node.inputs[0].name], self.location[node.inputs[1].name]
        up_rows, up_bias = self.weight_of(node.inputs[2]), self.weight_of(node.inputs[3])
        down_rows = self.weight_of(node.inputs[4])
        width = self.low.weights[down_rows].shape[1]
        d_in = self.low.weights[up_rows].shape[1]
        p, tag = node.name, f"{part}.n{neurons}"
        partial = self.low.activation(f"act.partial.{part}", width)
        # one-token steps: predicted neurons only
        threshold = self.low.weight(f"{p}.threshold", np.array([pir.attr(node, "threshold")], np.float32))
        index = self.low.activation(f"act.ffn_index.{tag}", neurons, dtype="int32", rows=1)
        count = self.low.activation(f"act.ffn_count.{part}", 1, dtype="int32", rows=1)
        hidden = self.low.activation(f"act.ffn_sparse_hidden.{tag}", neurons, rows=1)
        up_width = self.low.weights[up_rows].shape[0]
        up_bias = up_bias or self.low.zeros(f"{p}.up_bias", up_width)
        gate_tag = "_gated" if gated else ""
        for rows in (up_rows, down_rows):
            self.low.cpu_matrix(rows, device)
        dtype = self.low.buffers[up_rows]["dtype"]
        dtype_tag, dtype_arg = ("_f16", {"wdtype": dtype}) if dtype != "float32" else ("", {})
        kernels = self.low.kernel(ops.select, f"select_n{neurons}", neurons, phases=("decode",))
        self.low.call(kernels, [scores, threshold, index, count], [index, count], f"{p}.select", "predictor", device)
        if device == "cpu":  # up and down in one pass over the rows
            scratch = self.low.scratch(f"scratch.ffn.d{width}", [neuron.FFN_TASKS, width])
            fired = self.low.scratch(f"scratch.ffn_fired.n{neurons}", [1, neurons], "int32")
            kernels = self.low.kernel(ops.sparse_ffn, f"sparse_ffn_d{d_in}_n{neurons}{gate_tag}_{activation}{dtype_tag}",
                                      d_in, neurons, gated=gated, act=activation, phases=("decode",), **dtype_arg)
            self.low.call(kernels, [x, index, count, up_rows, up_bias, down_rows, hidden, fired, scratch, partial],
                          [hidden, fired, scratch, partial], f"{p}.up_down", "ffn", device)
        else:
            kernels = self.low.kernel(ops.sparse_up, f"sparse_up_d{d_in}_n{neurons}{gate_tag}_{activation}",
                                      d_in, neurons, gated=gated, act=activation, phases=("decode",))
            self.low.call(kernels, [x, index, count, up_rows, up_bias, hidden], [hidden], f"{p}.up", "ffn_up", device)
            kernels = self.low.kernel(ops.sparse_down, f"sparse_down_n{neurons}_d{width}", neurons, width,
                                      phases=("decode",))
            self.low.call(kernels, [hidden, index, count, down_rows, partial], [partial], f"{p}.down", "ffn_down", device)
        # multi-token steps: every neuron of the part, as dense GEMMs over the same row-major weights
        pre = self.low.activation(f"act.ffn_pre.{tag}", up_width)
        up_act = "none" if gated else activation
        kernels = self.low.kernel(ops.linear_rows, f"linear_rows_k{d_in}_n{up_width}_{up_act}{dtype_tag}", d_in,
                                  up_width, act=up_act, phases=("prefill",), **dtype_arg, **self.low.gemm_tile(device))
        self.low.call(kernels, [x, up_rows, up_bias, pre], [pre], f"{p}.up_dense", "ffn_up", device)
        if gated:
            dense_hidden = self.low.activation(f"act.ffn_dense_hidden.{tag}", neurons)
            self.low.glu(pre, dense_hidden, neurons, activation, f"{p}.glu", device, phases=("prefill",))
            pre = dense_hidden
        self.low.linear(pre, down_rows, None, partial, f"{p}.down_dense", "ffn_down", phases=("prefill",), device=device,
                        packed=False)
        self.location[node.outputs[0].name] = partial

    def lower_ThresholdFFN(self, node: ir.Node) -> None:
        """Decode: keep the inputs above their thresholds (select on |x|), gate and up over the kept input
        channels' rows (one column-sparse GEMV over w_up [D, 2F], the GLU on its sums), the same for down over
        h. Prompts: dense GEMMs over the same [K, N] weights (the sparse kernels need that layout, not panels)."""
        activation, gated = pir.attr(node, "activation"), bool(pir.attr(node, "gated"))
        x = self.location[node.inputs[0].name]
        w_up, b_up, w_down = self.weight_of(node.inputs[1]), self.weight_of(node.inputs[2]), self.weight_of(node.inputs[3])
        for weight in (w_up, w_down):
            self.low.cpu_matrix(weight, "cpu")
        d_in, up_width = self.low.weights[w_up].shape
        neurons, width = self.low.weights[w_down].shape
        dtype = self.low.buffers[w_up]["dtype"]
        dtype_tag, dtype_arg = ("_f16", {"wdtype": dtype}) if dtype != "float32" else ("", {})
        p = node.name
        partial = self.low.activation("act.partial.cpu", width)
        hidden = self.low.activation(f"act.ffn_hidden.f{neurons}", neurons)
        projections = (("up", x, w_up, b_up, d_in, up_width, hidden, gated, activation, "threshold_in", "ffn_up"),
                       ("down", hidden, w_down, None, neurons, width, partial, False, "none", "threshold_down", "ffn_down"))
        for part, v, weight, bias, rows, columns, out, glu, act, key, op_class in projections:
            threshold = self.low.weight(f"{p}.{key}", np.array([pir.attr(node, key)], np.float32))
            index = self.low.activation(f"act.kept_index.n{rows}", rows, dtype="int32", rows=1)
            count = self.low.activation("act.kept_count", 1, dtype="int32", rows=1)
            kernels = self.low.kernel(ops.select, f"select_abs_n{rows}", rows, magnitude=True, phases=("decode",))
            self.low.call(kernels, [v, threshold, index, count], [index, count], f"{p}.{part}_select", op_class)
            scratch = self.low.scratch(f"scratch.columns.n{columns}", [neuron.COLUMN_TASKS, columns])
            tags = f"{'_gated' if glu else ''}_{act}{'_b' if bias else ''}{dtype_tag}"
            kernels = self.low.kernel(ops.sparse_columns, f"sparse_columns_k{rows}_n{columns}{tags}", rows, columns,
                                      gated=glu, act=act, bias=bias is not None, phases=("decode",), **dtype_arg)
            self.low.call(kernels, [v, index, count, weight, *([bias] if bias else []), scratch, out],
                          [scratch, out], f"{p}.{part}", op_class)
        # multi-token steps: dense, as the sparse FFN parts do
        pre = self.low.activation(f"act.ffn_pre.n{up_width}", up_width)
        self.low.linear(x, w_up, b_up, pre if gated else hidden, f"{p}.up_dense", "ffn_up",
                        act="none" if gated else activation, phases=("prefill",), packed=False)
        if gated:
            self.low.glu(pre, hidden, neurons, activation, f"{p}.glu", phases=("prefill",))
        self.low.linear(hidden, w_down, None, partial, f"{p}.down_dense", "ffn_down", phases=("prefill",), packed=False)
        self.location[node.outputs[0].name] = partial

    def lower_MergePartial(self, node: ir.Node) -> None:
        parts = [self.location[v.name] for v in node.inputs[:-1] if v is not None]
        bias = self.weight_of(node.inputs[-1])
        width = self.low.buffers[parts[0]]["shape"][1]
        out, residual = self.output_for(node, width)
        base = f"merge_d{width}_p{len(parts)}{'_b' if bias else ''}{'_res' if residual else ''}"
        kernels = self.low.kernel(ops.merge, base, width, len(parts), bias=bias is not None, residual=residual is not None)
        args = ([residual] if residual else []) + parts + ([bias] if bias else []) + [out]
        self.low.call(kernels, args, [out], node.name, "merge")
        self.location[node.outputs[0].name] = out

    def lower_MatMul(self, node: ir.Node) -> None:
        weight = self.weight_of(node.inputs[1])
        add = self.residual_add_after(node)
        bias = None
        if add is not None and pir.const_array(add.inputs[1]) is not None:  # the output layer's bias
            bias = self.weight_of(add.inputs[1])
            self.fused_adds.add(add.name)
        out = self.low.activation("logits", self.low.weights[weight].shape[1])
        self.low.linear(self.location[node.inputs[0].name], weight, bias, out, node.name, "head")
        self.location[(add or node).outputs[0].name] = out

    def lower_Add(self, node: ir.Node) -> None:
        raise UserError(f"codegen: residual add {node.name} does not follow a linear block")


COPY = "copy"  # the runtime's own transfer op (host<->device memcpy), not a TVM kernel
RESIDENT_KINDS = ("activation", "input", "cache")


def on_device(buffer: str, device: str) -> str:
    """Each device holds its own instance of a buffer it uses: `name` on the CPU, `name@gpu` on the GPU."""
    return buffer if device == "cpu" else f"{buffer}@{device}"


def place_buffers(lowering: Lowering) -> None:
    """Give each call its device's instances of the activations it uses, inserting a copy wherever a
    call reads a value last written on the other device. Done per phase (decode and prefill run
    different calls), so each copy carries the phases that need it. The logits end on the CPU."""
    if {call.device for call in lowering.calls} == {"cpu"}:
        return
    needed: dict[tuple[int, str, str, str], set[str]] = {}
    for phase in ("decode", "prefill"):
        resident = {"input_ids": {"cpu"}}
        for index, call in enumerate(lowering.calls + [None]):
            if call is None:  # after the last call: the runtime reads the logits on the CPU
                reads, device, writes = ["logits"], "cpu", []
            elif not getattr(call, phase):
                continue
            else:
                reads, device, writes = call.args, call.device, call.writes
            for buffer in reads:
                info = lowering.buffers.get(buffer)
                if info is None or info["kind"] not in RESIDENT_KINDS:
                    continue
                holders = resident.setdefault(buffer, {device})  # caches live where first used
                if device not in holders:
                    needed.setdefault((index, buffer, sorted(holders)[0], device), set()).add(phase)
                    holders.add(device)
            for buffer in writes:
                resident[buffer] = {device}
    calls = []
    for index, call in enumerate(lowering.calls + [None]):
        for (at, buffer, source, target), phases in sorted(needed.items()):
            if at == index:
                src, dst = on_device(buffer, source), on_device(buffer, target)
                reader = "output" if call is None else call.label
                calls.append(KernelCall(COPY if "decode" in phases else "", COPY if "prefill" in phases else "",
                                        [src, dst], [dst], f"{reader}.copy_{buffer}_to_{target}", "copy", "gpu"))
        if call is not None:
            call.args = [on_device(a, call.device) if a in lowering.buffers and lowering.buffers[a]["kind"] in RESIDENT_KINDS
                         else a for a in call.args]
            call.writes = [on_device(w, call.device) for w in call.writes]
            calls.append(call)
    for call in calls:
        for name in call.args:
            base = name.split("@")[0]
            if name not in lowering.buffers and base in lowering.buffers:
                lowering.buffers[name] = dict(lowering.buffers[base])
    used = {name for call in calls for name in call.args} | {"input_ids", "logits"}
    lowering.buffers = {name: info for name, info in lowering.buffers.items() if name in used}
    lowering.calls = calls


_DTYPES = {"float32": ir.DataType.FLOAT, "int32": ir.DataType.INT32, "int64": ir.DataType.INT64}


def _call_graph(lowering: Lowering) -> ir.Model:
    """The lowered IR: one picompile.Call node per kernel call, values named buffer#version."""
    version: dict[str, int] = {}
    current: dict[str, ir.Value] = {}

    def shape(buffer: str) -> ir.Shape:
        info = lowering.buffers.get(buffer)
        if info is None:  # the scalar `start`
            return ir.Shape([])
        dims = list(info["shape"])
        if info["kind"] in ("activation", "input"):
            dims[0] = "rows"  # activations hold one row per token of the current step
        return ir.Shape(dims)

    def read(buffer: str) -> ir.Value:
        if buffer not in current:
            info = lowering.buffers.get(buffer)
            if info is not None and info["kind"] == "weight":
                current[buffer] = pir.initializer(graph, buffer, lowering.weights[buffer])
            else:
                dtype = ir.DataType.INT64 if buffer == "start" else _DTYPES[lowering.buffers[buffer]["dtype"]]
                current[buffer] = ir.val(f"{buffer}#0", dtype, shape(buffer))
                version[buffer] = 0
                graph.inputs.append(current[buffer])
        return current[buffer]

    graph = ir.Graph([], [], nodes=[], name="kernels", opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: pir.DOMAIN_VERSION})
    for call in lowering.calls:
        reads = [read(arg) for arg in call.args if arg not in call.writes or lowering.buffers.get(arg, {}).get("kind") == "cache"]
        node = ir.node("Call", reads, {"decode": call.decode, "prefill": call.prefill, "args": call.args,
                                       "device": call.device, "op_class": call.op_class},
                       domain=pir.DOMAIN, num_outputs=len(call.writes), name=call.label)
        graph.append(node)
        for value, buffer in zip(node.outputs, call.writes):
            version[buffer] = version.get(buffer, 0) + 1
            value.name = f"{buffer}#{version[buffer]}"
            value.dtype = _DTYPES[lowering.buffers[buffer]["dtype"]]
            value.shape = shape(buffer)
            current[buffer] = value
    graph.outputs.append(current["logits"])
    graph.outputs.extend(current[b] for b in lowering.buffers if lowering.buffers[b]["kind"] == "cache" and b in current)
    return ir.Model(graph, ir_version=10, producer_name="picompile")


@dataclass
class Codegen:
    name = "codegen"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        placement = json.loads(model.metadata_props.get("picompile.placement", "{}"))
        dense_on_gpu = ctx.target.has_gpu and placement.get("budget_bytes", 1) > 0
        lowering = Lowering(max_context=ctx.options.max_context, dense_device="gpu" if dense_on_gpu else "cpu",
                            cpu_weight_dtype=cpu.WEIGHT_DTYPES[ctx.options.weight_dtype],
                            gemm_panels=ctx.cpu_isa.gemm_panels)
        lowering.buffers["input_ids"] = {"kind": "input", "shape": [lowering.max_context], "dtype": "int64"}
        walker = _Walker(model.graph, lowering)
        nodes = list(model.graph)
        with ctx.progress("codegen: making kernels (blocks)", len(nodes)) as advance:
            for node in nodes:
                with ctx.layer(pir.attr(node, "layer")) if "layer" in node.attributes else contextlib.nullcontext():
                    walker.lower(node)
                advance()
        place_buffers(lowering)
        lowered = _call_graph(lowering)
        lowered.metadata_props.update(model.metadata_props)  # what earlier passes decided (placement, layers)
        lowered.metadata_props["picompile.buffers"] = _json(lowering.buffers)
        library = Path(ctx.workdir) / "kernels" / "cpu.so"
        library.parent.mkdir(parents=True, exist_ok=True)
        # Every kernel exists for the CPU: the CPU runs its own calls, and stands in for the GPU when emulating.
        with ctx.progress(f"codegen: compiling {len(lowering.kernels)} CPU kernels (LLVM)"):
            cpu.build(list(lowering.kernels.values()), ctx.cpu_isa.llvm_target(), str(library))
        ctx.artifact_files["kernels/cpu.so"] = library
        if ctx.target.has_gpu:
            self.build_cuda(lowering, ctx)
        ctx.log(f"codegen: {len(lowering.kernels)} kernels, {len(lowering.calls)} calls per token")
        return PassResult(lowered, modified=True)

    def build_cuda(self, lowering: Lowering, ctx: Context) -> None:
        """The GPU calls' kernels again, scheduled for CUDA and compiled by nvcc for the target's arch now,
        so the GPU machine needs no compiler."""
        from .kernels import cuda

        names = sorted({name for call in lowering.calls if call.device == "gpu"
                        for name in (call.decode, call.prefill) if name and name != COPY})
        if not names:
            return
        if cuda.nvcc_path() is None:
            raise UserError(f"building for {ctx.target.name} compiles its GPU kernels with nvcc, which is not installed "
                            "(install the CUDA toolkit or set CUDA_PATH), or build with --target cpu")
        funcs = []
        with ctx.progress("codegen: making CUDA kernels", len(names)) as advance:
            for name in names:
                op, rows, args, kwargs = lowering.kernel_specs[name]
                funcs.append(op.cuda(name, *args, rows=rows, **kwargs))
                advance()
        library = Path(ctx.workdir) / "kernels" / f"cuda_{ctx.target.cuda_arch}.so"
        with ctx.progress(f"codegen: compiling {len(funcs)} CUDA kernels (nvcc)"):
            facts = cuda.build(funcs, ctx.target.cuda_arch, str(library))
        ctx.artifact_files[f"kernels/cuda_{ctx.target.cuda_arch}.so"] = library
        ctx.log(f"codegen: {len(funcs)} CUDA kernels for {ctx.target.cuda_arch} ({facts.get('binary_format')}, "
                f"nvcc {facts.get('nvcc_seconds', 0):.1f} s)")


def _json(obj) -> str:
    return json.dumps(obj, sort_keys=True)
