"""A numpy interpreter of the block-level IR (after `recognise`), for tests only.

It checks the recognise pass on its own: the lifted graph must compute what the exported graph
computes, before any kernel is involved.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from passes import ir as pir


def _norm(node, x, values):
    eps = pir.attr(node, "epsilon", 1e-5)
    scale = values[node.inputs[1].name]
    if node.op_type == "LayerNormalization":
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * scale + values[node.inputs[2].name]
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


_ACT = {"relu": lambda x: np.maximum(x, 0), "silu": lambda x: x / (1 + np.exp(-x)),
        "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
        "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))}


def _rope(x, positions, inv_freq):
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def run_blocks(model: ir.Model, token_ids: np.ndarray, caches: dict, start: int, weights: dict | None = None,
               thresholded: bool = False, seen: dict | None = None) -> np.ndarray:
    """Forward `token_ids` after `start` cached tokens; `caches` maps layer -> (K, V) lists, updated.
    `weights` replaces initializers by name (e.g. by the values a quantized build stores). `thresholded`: a one-
    token step zeroes each projection input |v| <= the block's threshold attribute (FFN threshold_in /
    threshold_down, Attention threshold_qkv / threshold_o; absent or < 0: none) and the output layer's
    (the model's `HeadThreshold`), as threshold decode does.
    `seen` collects, per (layer, attribute), the inputs each of those projections got (rows of every step)."""
    from passes.quality import HeadThreshold

    head = HeadThreshold.of(model)
    values = {name: v.const_value.numpy() for name, v in model.graph.initializers.items()}
    values.update(weights or {})
    m = len(token_ids)
    positions = np.arange(start, start + m)

    def kept(v, node, key):
        if seen is not None:
            seen.setdefault((pir.attr(node, "layer"), key), []).append(np.array(v))
        t = pir.attr(node, key)
        return np.where(np.abs(v) > t, v, 0) if thresholded and m == 1 and t is not None else v
    for node in model.graph:
        x = values.get(node.inputs[0].name) if node.inputs and node.inputs[0] is not None else None
        if node.op_type == "Embed":
            out = values[node.inputs[2].name][token_ids]
            if len(node.inputs) > 3 and node.inputs[3] is not None:
                out = out + values[node.inputs[3].name][positions]
        elif node.op_type in ("LayerNormalization", "RMSNormalization"):
            out = _norm(node, x, values)
        elif node.op_type == "Add":
            out = values[node.inputs[0].name] + values[node.inputs[1].name]
        elif node.op_type == "MatMul":
            if seen is not None:
                seen.setdefault((None, "head"), []).append(np.array(x))
            if thresholded and m == 1 and head is not None:
                x = np.where(np.abs(x) > head.threshold, x, 0)
            out = x @ values[node.inputs[1].name]
        elif node.op_type == "FFN":
            x = kept(x, node, "threshold_in")
            w_up = values[node.inputs[1].name]
            pre = x @ w_up + (values[node.inputs[2].name] if node.inputs[2] is not None else 0)
            act = _ACT[pir.attr(node, "activation")]
            if pir.attr(node, "gated"):
                half = w_up.shape[1] // 2
                hidden = act(pre[:, :half]) * pre[:, half:]
            else:
                hidden = act(pre)
            out = kept(hidden, node, "threshold_down") @ values[node.inputs[3].name] + (
                values[node.inputs[4].name] if node.inputs[4] is not None else 0)
        elif node.op_type == "Attention":
            layer = pir.attr(node, "layer")
            heads, kv_heads, hd = (pir.attr(node, a) for a in ("num_heads", "num_kv_heads", "head_dim"))
            qkv = kept(x, node, "threshold_qkv") @ values[node.inputs[4].name] + (values[node.inputs[5].name] if node.inputs[5] is not None else 0)
            q = qkv[:, : heads * hd].reshape(m, heads, hd)
            k = qkv[:, heads * hd: (heads + kv_heads) * hd].reshape(m, kv_heads, hd)
            v = qkv[:, (heads + kv_heads) * hd:].reshape(m, kv_heads, hd)
            if node.inputs[8] is not None:
                inv_freq = values[node.inputs[8].name].astype(np.float64)
                q, k = _rope(q, positions, inv_freq), _rope(k, positions, inv_freq)
            keys, vals = caches.setdefault(layer, ([], []))
            keys.extend(k)
            vals.extend(v)
            K, V = np.stack(keys), np.stack(vals)  # [t, kv, hd]
            group = heads // kv_heads
            out = np.zeros((m, heads, hd))
            for h in range(heads):
                scores = q[:, h] @ K[:, h // group].T * pir.attr(node, "scale")
                scores = np.where(np.arange(len(K))[None, :] <= positions[:, None], scores, -np.inf)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                out[:, h] = (p / p.sum(-1, keepdims=True)) @ V[:, h // group]
            out = kept(out.reshape(m, heads * hd), node, "threshold_o") @ values[node.inputs[6].name]
            if node.inputs[7] is not None:
                out = out + values[node.inputs[7].name]
            values[node.outputs[1].name] = values[node.outputs[2].name] = None
        else:
            raise NotImplementedError(node.op_type)
        values[node.outputs[0].name] = out
    return values["logits"]
