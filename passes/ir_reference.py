"""A torch interpreter of the block IR (after recognise, before lower): what the quality pass measures plans with.

It runs whole calibration sequences from an empty KV cache, batched, causal, as the artifact computes them: a
prompt of `prefill` tokens through dense GEMMs, then one token per step. A `Variant` says how a plan changes that
arithmetic, as the kernels will: a linear input's channels with |v| <= threshold read no weight row in decode
steps (rows from `prefill` on), and a weight matrix is read as stored (its fp16 or quantized values).
`probe` sees every Attention / FFN block (and MatMul: the output layer) as it runs (its input, output and the
residual it is added to), so that a caller can measure a change to one block on the spot instead of keeping every
activation. `output_gradients` weighs such a change by the KL it causes at the logits.

Memory: nothing model-sized is held. Weights are float32 tensors read on use, the most recent kept up to a byte
budget (`memory.BoundedCache`: at least a block's, so a block run again for each level of a knob reads them once); a
file's blocks are dequantized again when read past that. The embedding table gives only the rows of the tokens
run; the output layer is read a slice of its columns at a time (`head_columns`), by callers that fold each slice's
logits into what they need (`streamed_logits`) rather than hold [tokens, vocabulary] logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_ir as ir
import torch
from torch.utils.checkpoint import checkpoint

from . import ir as pir
from .activations import ACTIVATIONS
from .budget import PROMPT_TOKENS
from .file_blocks import FileMatrix
from .memory import BoundedCache
from .ops import FFN, Attention, Embed, Softcap, view as op_view
from .streamed_logits import Logits, slice_width
from runtime.manifest import OUTPUT_LAYER

# Linear inputs a plan can threshold, by block: (op type, site) -> the weight input it multiplies (MatMul: the
# output layer, the one MatMul of the block IR)
SITES = {("Attention", "qkv"): 4, ("Attention", "o"): 6, ("FFN", "in"): 1, ("FFN", "down"): 3, ("MatMul", "head"): 1}


@dataclass
class Variant:
    """A plan's changes to the dense arithmetic. `thresholds[(layer, site)]`: decode rows keep the input channels
    with |v| > t; `weights[name]`: a matrix's values as stored (absent: the source's); `prefill`: the rows
    computed densely (eval's and the engine's prompt before one-token steps)."""

    thresholds: dict[tuple[int, str], float] = field(default_factory=dict)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    prefill: int = PROMPT_TOKENS
    # matrices whose decode GEMV quantizes its input to int8 per block of 32 (an int4 / int8 build's int8_dot kernels)
    int8_inputs: frozenset[str] = frozenset()
    # matrices whose prefill GEMM quantizes each row so (quant.gemm_panels_qx8, kquant_gemm.gemm_panels_kqx8)
    int8_prefill_inputs: frozenset[str] = frozenset()
    # layer -> (w1 [d, r], w2 [r, ffn], threshold): decode rows compute only the FFN neurons the predictor selects
    predictors: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)


DENSE = Variant()


@dataclass
class Block:
    """One block as `probe` sees it: the node, its input and output [batch, tokens, width], and the residual
    stream it is added to (its output plus that is the next residual)."""

    node: ir.Node
    x: torch.Tensor
    out: torch.Tensor
    residual: torch.Tensor | None
    taps: dict[str, torch.Tensor] = field(default_factory=dict)  # each site's input, as `block`'s taps


RESIDENT_BYTES = 64 << 20  # float32 weights kept between reads, at least (and at least the largest block's)


def _float_tensor(value: ir.Value) -> tuple[torch.Tensor, int]:
    """(the constant as a float32 tensor, the bytes it newly holds): a model's own writable float32 array is
    shared, not copied; a file's blocks are dequantized (a new array)."""
    array = pir.const_array(value)
    fresh = isinstance(pir.const_matrix(value), FileMatrix)  # (dequantized for this read: no one else holds it)
    usable = isinstance(array, np.ndarray) and array.dtype == np.float32 and array.flags.writeable
    tensor = torch.from_numpy(array if usable else np.array(array, np.float32))
    return tensor, tensor.numel() * 4 if fresh or not usable else 0


def _largest_block_bytes(model: ir.Model) -> int:
    """Float32 bytes of the largest Attention / FFN block's constants (a knob's levels rerun one block)."""
    sizes = [sum(4 * int(np.prod(v.const_value.shape)) for v in node.inputs if v is not None and v.const_value is not None)
             for node in model.graph if node.op_type in ("Attention", "FFN")]
    return max(sizes, default=0)


def head_node(model: ir.Model) -> ir.Node | None:
    """The output layer: the MatMul of a constant producing the logits (or the logits a `Softcap` caps)."""
    producer = model.graph.outputs[0].producer()
    if producer is not None and Softcap.matches(producer):
        producer = producer.inputs[0].producer()
    # (const_matrix: a file's blocks stay unread)
    return producer if producer is not None and producer.op_type == "MatMul" and \
        pir.const_matrix(producer.inputs[1]) is not None else None


class Interpreter:
    """The block IR of `model` in torch, weights fp32 (read from the IR's constants on use; `resident_bytes` of
    them kept between reads, by default RESIDENT_BYTES or 1.25 of the largest block's, whichever is more).
    `int8_predictor_inputs`: the predictors' decode GEMVs read their inputs as int8 blocks (the build's x8
    kernels, `predict.predictor_reads_int8`)."""

    def __init__(self, model: ir.Model, int8_predictor_inputs: bool = False, resident_bytes: int | None = None):
        self.model = model
        self.int8_predictor_inputs = int8_predictor_inputs
        self.head = head_node(model)
        capped = model.graph.outputs[0].producer()  # the logits' soft-cap after the output layer (Gemma 2), or 0
        self.head_cap = float(Softcap(capped).cap) if capped is not None and Softcap.matches(capped) else 0.0
        budget = resident_bytes if resident_bytes is not None else max(RESIDENT_BYTES,
                                                                       int(1.25 * _largest_block_bytes(model)))
        self._resident = BoundedCache(budget)
        self._residual_of = _residual_partners(model.graph)
        self._last_reader = _last_readers(model.graph)
        self._rotations: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def weight(self, value: ir.Value | None, variant: Variant = DENSE) -> torch.Tensor | None:
        if value is None:
            return None
        if value.name in variant.weights:
            return torch.from_numpy(np.asarray(variant.weights[value.name], np.float32))
        held = self._resident.get(value.name)
        return held if held is not None else self._resident.put(value.name, *_float_tensor(value))

    def _file_lines(self, value: ir.Value, variant: Variant, transposed: bool) -> FileMatrix | None:
        """The file matrix to read a few of `value`'s lines from (rows of a table, columns of a transposed matrix:
        the file's rows either way), where the variant does not replace it, it is not kept, and it is a file's
        blocks in that orientation; else None (read it whole: `weight`)."""
        matrix = pir.const_matrix(value)
        if (value.name in variant.weights or self._resident.get(value.name) is not None
                or not isinstance(matrix, FileMatrix) or matrix.transposed != transposed):
            return None
        return matrix

    def _embedding_rows(self, table: ir.Value, ids: torch.Tensor, variant: Variant) -> torch.Tensor:
        """The table's rows of `ids` (a file's table: only those rows dequantized)."""
        matrix = self._file_lines(table, variant, transposed=False)
        if matrix is None:
            return self.weight(table, variant)[ids]
        rows, inverse = np.unique(ids.numpy(), return_inverse=True)
        return torch.from_numpy(matrix.take(rows).dequantize())[torch.from_numpy(inverse.reshape(ids.shape))]

    def logits(self, sequences: np.ndarray, variant: Variant = DENSE,
               probe: Callable[[Block], None] | None = None) -> torch.Tensor:
        """[batch, tokens, vocab] logits of `sequences` [batch, tokens] (each from an empty cache)."""
        with torch.no_grad():
            return self._forward(sequences, variant, probe, to_head=False)

    def head_input(self, sequences: np.ndarray, variant: Variant = DENSE, probe: Callable[[Block], None] | None = None,
                   positions: slice = slice(None)) -> torch.Tensor:
        """[rows, width]: the output layer's input at `positions` of each of `sequences`, as its kernel reads it
        (thresholded, int8 where the variant says), the rows of sequence 0 first. `probe` sees the output layer
        with its input only (`out` None). The layer is read a slice at a time: `head_columns`."""
        with torch.no_grad():
            x = self._forward(sequences, variant, probe, to_head=True)
            return self._head_rows(x, variant)[:, positions].reshape(-1, x.shape[-1])

    def _head_rows(self, x: torch.Tensor, variant: Variant) -> torch.Tensor:
        return self.product_input(self.linear_input(self.head, "head", x, variant, None), self.head.inputs[1], variant)

    def head_columns(self, rows: int, variant: Variant = DENSE) -> Iterator[tuple[int, torch.Tensor]]:
        """(first column, the output layer's [width, columns] slice from it) over the vocabulary, slices as wide as
        `streamed_logits.slice_width` allows for `rows` rows; a file's blocks dequantized a slice at a time."""
        value = self.head.inputs[1]
        vocabulary = value.shape[1]
        width = slice_width(rows, vocabulary)
        matrix = self._file_lines(value, variant, transposed=True)
        whole = self.weight(value, variant) if matrix is None else None
        for first in range(0, vocabulary, width):
            stop = min(first + width, vocabulary)
            if whole is not None:
                yield first, whole[:, first:stop]
            else:  # (a transposed file matrix's columns are the file's rows: whole blocks, read by themselves)
                yield first, torch.from_numpy(matrix.take(np.arange(first, stop)).dequantize())

    def head_logits(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """The logits of `rows` (the output layer's input) over a `head_columns` slice: their product, soft-capped
        where the model caps its logits."""
        return softcap(rows @ columns, self.head_cap)

    def _forward(self, sequences: np.ndarray, variant: Variant, probe: Callable[[Block], None] | None,
                 to_head: bool, kept: tuple[str, ...] = (), outputs: dict | None = None) -> torch.Tensor:
        """The graph's output (`to_head`: the output layer's input instead). With `kept` op types (under
        autograd), each such block's output is kept in `outputs` (a gradient is asked of it), and every block is
        checkpointed: its activations and weights recomputed in the backward rather than held."""
        ids = torch.from_numpy(np.asarray(sequences, np.int64))
        values: dict[str, torch.Tensor] = {}
        for node in self.model.graph:
            if to_head and node is self.head:
                x = values[node.inputs[0].name]
                if probe is not None:
                    probe(Block(node, x, None, None, {"head": x}))
                return x
            # (a probed block's site inputs are kept as it runs: a probe need not run it again for them)
            taps = {} if probe is not None and node.op_type in ("Attention", "FFN", "MatMul") else None
            if outputs is not None and node.op_type in ("Attention", "FFN"):
                out = checkpoint(self.block, node, values[node.inputs[0].name], variant, use_reentrant=False)
            else:
                out = self._run(node, values, ids, variant, taps)
            if node.op_type in kept:
                if not out.requires_grad:  # the first block (no weight asks for a gradient)
                    out.requires_grad_()
                outputs[node.name] = out
            values[node.outputs[0].name] = out
            if taps is not None:
                partner = self._residual_of.get(node.outputs[0].name)
                probe(Block(node, values[node.inputs[0].name], out, values.get(partner), taps))
            for value in node.inputs:  # (a value no later node reads is dropped: one batch's residual stream at a
                if value is not None and self._last_reader.get(value.name) is node:  # time, not every layer's)
                    values.pop(value.name, None)
        return values[self.model.graph.outputs[0].name]

    def output_gradients(self, sequences: np.ndarray, op_types: tuple[str, ...], draws: int,
                         seed: int = 0) -> dict[str, torch.Tensor]:
        """Per block of `op_types` (by node name), [draws, batch, tokens, width] bfloat16: the gradient, with
        respect to the block's dense output, of the log-likelihood of tokens drawn from the dense model's own
        distribution at every position of `sequences`. Half the mean of (g . delta)^2 over the draws is, to
        second order, the KL summed over the positions that a change `delta` to the block's output causes at
        the logits (the Fisher information, sampled): what a change costs where the model reads it, which the
        change's size against the residual stream is not (on SmolLM2 that misjudged layers past a massive
        activation by 100x).
        The output layer is read a slice at a time: the draws are the Gumbel-max of each row's logits (as
        sampling its softmax), and the gradient at its input of log p(drawn) is the drawn token's column less
        the probability-weighted mean column, summed slice by slice (each column times the soft-cap's slope, 1 -
        (logit / cap)^2, where the logits are soft-capped)."""
        outputs: dict[str, torch.Tensor] = {}
        with torch.enable_grad():
            x = self._forward(sequences, DENSE, None, to_head=True, kept=op_types, outputs=outputs)
            rows = x.detach().reshape(-1, x.shape[-1])
            generator = torch.Generator().manual_seed(seed)
            summary = Logits(rows.shape[0])
            best = torch.full((draws, rows.shape[0]), -torch.inf)
            drawn = torch.zeros((draws, rows.shape[0]), dtype=torch.int64)
            for first, columns in self.head_columns(rows.shape[0]):
                logits = self.head_logits(rows, columns)
                summary.add(first, logits)
                for draw in range(draws):
                    noise = torch.rand(logits.shape, generator=generator).clamp_(min=1e-20).log_().neg_().log_()
                    value, column = (logits - noise).max(1)
                    better = value > best[draw]
                    best[draw] = torch.where(better, value, best[draw])
                    drawn[draw] = torch.where(better, column + first, drawn[draw])
            log_normalizer = summary.log_normalizer
            mean_column = torch.zeros_like(rows)
            drawn_column = torch.zeros((draws, *rows.shape))
            for first, columns in self.head_columns(rows.shape[0]):
                logits = self.head_logits(rows, columns)
                probabilities = torch.exp(logits.to(torch.float64) - log_normalizer[:, None]).float()
                slope = 1.0 - (logits / self.head_cap) ** 2 if self.head_cap else None  # d softcap(z) / dz
                mean_column += (probabilities if slope is None else probabilities * slope) @ columns.T
                for draw in range(draws):
                    inside = (drawn[draw] >= first) & (drawn[draw] < first + columns.shape[1])
                    picked = columns[:, drawn[draw, inside] - first].T
                    if slope is not None:
                        picked = picked * slope[inside, drawn[draw, inside] - first][:, None]
                    drawn_column[draw, inside] = picked
            # every draw in one backward (batched: each block recomputed once, its products a draw's rows deeper)
            gradients = torch.autograd.grad(x, list(outputs.values()), is_grads_batched=True,
                                            grad_outputs=(drawn_column - mean_column).reshape(draws, *x.shape))
        return {name: gradient.to(torch.bfloat16) for name, gradient in zip(outputs, gradients)}

    @staticmethod
    def fisher_kl(gradients: torch.Tensor, delta: torch.Tensor) -> float:
        """The KL per token that a change `delta` [batch, tokens, width] to a block's output causes, to second
        order, from that block's `output_gradients` [draws, batch, tokens, width]."""
        projections = (gradients.float() * delta).sum((-1, -2))  # [draws, batch]
        return 0.5 * float((projections ** 2).mean(0).sum()) / (delta.shape[0] * delta.shape[1])

    def _run(self, node: ir.Node, values: dict, ids: torch.Tensor, variant: Variant,
             taps: dict | None = None) -> torch.Tensor:
        op = node.op_type
        x = values.get(node.inputs[0].name) if node.inputs and node.inputs[0] is not None else None
        if op == "Embed":
            out = self._embedding_rows(node.inputs[2], ids, variant)
            scale = float(Embed(node).scale)
            if scale != 1.0:
                out = out * scale
            if len(node.inputs) > 3 and node.inputs[3] is not None:
                out = out + self.weight(node.inputs[3], variant)[: ids.shape[1]]
            return out
        if op in ("LayerNormalization", "RMSNormalization"):
            return norm(node, x, self.weight(node.inputs[1]),
                        self.weight(node.inputs[2]) if len(node.inputs) > 2 else None)
        if op == "Add":
            return values[node.inputs[0].name] + (values.get(node.inputs[1].name) if node.inputs[1].name in values
                                                   else self.weight(node.inputs[1]))
        if op == "MatMul":
            return self.product(self.linear_input(node, "head", x, variant, taps), node.inputs[1], variant)
        if op == "FFN":
            return self.ffn(node, x, variant, taps)
        if op == "Attention":
            return self.attention(node, x, variant, taps)
        if op == "Softcap":
            return softcap(x, float(Softcap(node).cap))
        raise NotImplementedError(f"the IR reference has no {op} ({node.name})")

    def product(self, v: torch.Tensor, matrix: ir.Value, variant: Variant) -> torch.Tensor:
        """v @ W for the weight `matrix` as the variant stores it, v as its kernel reads it (`product_input`)."""
        return self.product_input(v, matrix, variant) @ self.weight(matrix, variant)

    @staticmethod
    def product_input(v: torch.Tensor, matrix: ir.Value, variant: Variant) -> torch.Tensor:
        """v [batch, tokens, width] as the kernel of `matrix` reads it: its decode (and prefill) rows rounded to int8
        blocks where the kernel takes int8 activations."""
        prompt, decode = matrix.name in variant.int8_prefill_inputs, matrix.name in variant.int8_inputs
        if prompt and decode:
            return int8_blocks(v)
        if prompt or decode:
            first, rest = v[:, : variant.prefill], v[:, variant.prefill:]
            return torch.cat([int8_blocks(first) if prompt else first, int8_blocks(rest) if decode else rest], dim=1)
        return v

    def predictor_scores(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """A predictor's scores relu(x @ w1) @ w2 of rows `x`, each GEMV's input as its kernel reads it (int8
        blocks where the build's predictors read int8 and the input is whole blocks of 32)."""
        def seen(v: torch.Tensor) -> torch.Tensor:
            return int8_blocks(v) if self.int8_predictor_inputs and v.shape[-1] % 32 == 0 else v

        return seen(torch.relu(seen(x) @ w1)) @ w2

    @staticmethod
    def linear_input(node: ir.Node, site: str, v: torch.Tensor, variant: Variant, taps: dict | None) -> torch.Tensor:
        """`v` as a decode step's sparse kernel reads it: the channels at or below the site's threshold zeroed
        from the `prefill`-th row on (prompt rows run dense). `taps` (where given) keeps the dense `v`."""
        if taps is not None:
            taps[site] = v
        t = variant.thresholds.get((layer_of(node), site))
        if t is None or t < 0:
            return v
        kept = v.clone()
        decode = kept[:, variant.prefill:]
        decode.mul_(decode.abs() > t)
        return kept

    def ffn(self, node: ir.Node, x: torch.Tensor, variant: Variant = DENSE, taps: dict | None = None) -> torch.Tensor:
        b_up, b_down = self.weight(node.inputs[2]), self.weight(node.inputs[4])
        pre = self.product(self.linear_input(node, "in", x, variant, taps), node.inputs[1], variant)
        if b_up is not None:
            pre = pre + b_up
        ffn = FFN(node)
        act = ACTIVATIONS[ffn.activation].torch()
        if ffn.gated:
            half = pre.shape[-1] // 2
            hidden = act(pre[..., :half]) * pre[..., half:]
        else:
            hidden = act(pre)
        predictor = variant.predictors.get(ffn.layer)
        if predictor is not None:
            w1, w2, threshold = predictor
            selected = self.predictor_scores(x, w1, w2) > threshold
            selected[:, : variant.prefill] = True
            hidden = hidden * selected
        out = self.product(self.linear_input(node, "down", hidden, variant, taps), node.inputs[3], variant)
        return out if b_down is None else out + b_down

    def attention(self, node: ir.Node, x: torch.Tensor, variant: Variant = DENSE,
                  taps: dict | None = None) -> torch.Tensor:
        block = Attention(node)
        heads, kv_heads, hd = block.num_heads, block.num_kv_heads, block.head_dim
        batch, tokens, _ = x.shape
        qkv = self.product(self.linear_input(node, "qkv", x, variant, taps), node.inputs[4], variant)
        if node.inputs[5] is not None:
            qkv = qkv + self.weight(node.inputs[5])
        q = qkv[..., : heads * hd].reshape(batch, tokens, heads, hd).transpose(1, 2)
        k = qkv[..., heads * hd: (heads + kv_heads) * hd].reshape(batch, tokens, kv_heads, hd).transpose(1, 2)
        v = qkv[..., (heads + kv_heads) * hd:].reshape(batch, tokens, kv_heads, hd).transpose(1, 2)
        if block.input("q_norm") is not None:  # each head's query and key RMS-normed, before RoPE
            eps = float(block.qk_norm_eps)
            q = rms_norm(q, self.weight(block.input("q_norm")), eps)
            k = rms_norm(k, self.weight(block.input("k_norm")), eps)
        if block.input("inv_freq") is not None:
            cos, sin = self._rotation(block.input("inv_freq"), tokens)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        cap, window = float(block.softcap), int(block.window)
        if cap or window:  # what SDPA does not: scores soft-capped, a query attending to its last `window` keys
            scores = softcap(q @ k.transpose(-1, -2) * float(block.scale), cap)
            position = torch.arange(tokens)
            closed = position[None, :] > position[:, None]
            if window:
                closed |= position[None, :] <= position[:, None] - window
            weights = torch.softmax(scores.masked_fill(closed, -torch.inf), dim=-1)
            attended = weights @ v
        else:
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                        scale=float(block.scale))
        attended = attended.transpose(1, 2).reshape(batch, tokens, heads * hd)
        out = self.product(self.linear_input(node, "o", attended, variant, taps), node.inputs[6], variant)
        return out if node.inputs[7] is None else out + self.weight(node.inputs[7])

    def _rotation(self, inv_freq: ir.Value, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [tokens, hd / 2] at positions 0.. (computed in float64 once per table and length)."""
        key = (inv_freq.name, tokens)
        if key not in self._rotations:
            angles = torch.arange(tokens, dtype=torch.float64)[:, None] * self.weight(inv_freq).to(torch.float64)[None]
            self._rotations[key] = (torch.cos(angles).float(), torch.sin(angles).float())
        return self._rotations[key]

    def block(self, node: ir.Node, x: torch.Tensor, variant: Variant = DENSE,
              taps: dict | None = None) -> torch.Tensor:
        """A block's output for input `x` under `variant` (`taps`: gets each site's dense input)."""
        return (self.attention if node.op_type == "Attention" else self.ffn)(node, x, variant, taps)


def layer_of(node: ir.Node) -> int:
    """The layer a block's knobs are keyed by: its own, OUTPUT_LAYER for the output layer's MatMul."""
    return OUTPUT_LAYER if node.op_type == "MatMul" else op_view(node).layer


def int8_blocks(v: torch.Tensor, block: int = 32) -> torch.Tensor:
    """v as the int8-activation kernels see it (quant.x_quantizer): per block of 32 along the last axis, the
    scale max|v| / 127 and q = round(v * 127 / max|v|)."""
    blocks = v.reshape(*v.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros((), dtype=v.dtype))
    return (torch.round(blocks * inverse) * (amax / 127.0)).reshape(v.shape)


def norm(node: ir.Node, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    eps = float(pir.attr(node, "epsilon", 1e-5))
    if node.op_type == "LayerNormalization":
        out = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps) * scale
        return out if bias is None else out + bias
    return rms_norm(x, scale, eps)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis (a block's norms; an Attention's q / k norm, over each head)."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * scale


def softcap(t: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(t / cap) (Gemma 2's soft-caps); `t` itself for a cap of 0."""
    return cap * torch.tanh(t / cap) if cap else t


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over [batch, heads, tokens, hd] (the CPU kernel's rope_kv_write)."""
    half = t.shape[-1] // 2
    a, b = t[..., :half], t[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _last_readers(graph: ir.Graph) -> dict[str, ir.Node]:
    """Value name -> the last node (in graph order) that reads it; the graph's outputs have none."""
    readers = {value.name: node for node in graph for value in node.inputs if value is not None}
    for output in graph.outputs:
        readers.pop(output.name, None)
    return readers


def _residual_partners(graph: ir.Graph) -> dict[str, str]:
    """Block output name -> the other operand of the Add that puts it on the residual stream."""
    partners = {}
    for node in graph:
        if node.op_type == "Add" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
            a, b = node.inputs
            partners[a.name], partners[b.name] = b.name, a.name
    return partners


@dataclass(frozen=True)
class Quality:
    """A plan's quality against the dense model on the same tokens: perplexity change (ppl ratio - 1) with its
    95% interval (`budget.ppl_change_interval`), mean KL per predicted position, and top-1 agreement."""

    ppl_change: float
    kl: float
    top1: float
    tokens: int
    ppl_low: float
    ppl_high: float

    def describe(self) -> str:
        return (f"ppl {self.ppl_change * 100:+.1f}% ({self.ppl_low * 100:+.1f}..{self.ppl_high * 100:+.1f}%), "
                f"KL {self.kl:.4f}, top-1 {self.top1:.2f}")
