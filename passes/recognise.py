"""recognise: lift an exported decoder graph to picompile's block-level ops.

Reads: the imported IR (constants folded, batch 1) from any exporter. Finds, by dataflow from the KV
cache outputs and by patterns around the weights, per layer the attention block (q/k/v/o projections,
heads, RoPE) and the FFN block (ReLU: up(+bias) -> act -> down(+bias); gated: act(gate) * up -> down;
the activation an op (Relu, Gelu with its approximation), SiLU as x * Sigmoid(x), or GELU written out in
elementwise ops, known by its values), their norms, the token (and learned position) embedding and the
output layer. Which columns of the projections are the query, key and value of each head (separate or
fused QKV, any head interleaving) is read off the graph itself: onnxruntime runs the data movement between
the projections and the cache / the score MatMul on column indices, for one token at position 0, where RoPE
is the identity.
Adds: a new graph with one `picompile.Embed`, per layer a norm, a `picompile.Attention`, a residual Add,
a norm, a `picompile.FFN` and an Add (parallel blocks, GPT-NeoX / Falcon: both blocks read the layer's
input and both outputs are added to it), then the final norm and the output MatMul. Weights become named
initializers (`layers.3.ffn.w_up`, ...). Partial rotary embeddings become full-width RoPE with zero
frequencies on the pass-through dimensions (query and key columns permuted alike, so the scores are
unchanged). The source model rides on the new IR's `meta` (`source_model`), for the profile pass to run as
its reference executor. Refuses what it cannot recognise with a message naming it, and a `max_context`
(the build's, `ctx.build`) that the model's learned positions or the machine's memory cannot hold.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from passes.import_gguf import GGUFSource
from passes.import_onnx import SourceQuantization, available_memory_bytes
from . import ir as pir
from .activations import ACTIVATIONS
from .file_blocks import FileMatrix
from .errors import UserError
from .ops import Embed
from .pipeline import Context, Fact
from .sizes import kv_cache_bytes, prefill_rows
from .targets import format_size
from runtime.artifact import first_line
from runtime.dtypes import nbytes

# Ops that move or retype an activation without changing its values.
PASS_THROUGH = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast"}
# Ops whose output is a tensor's shape, not its data: dataflow walks stop there.
SHAPE_OF = {"Shape", "Size"}
# Activation ops by ONNX name (Gelu: exact unless its `approximate` says "tanh"; onnxruntime's own Gelu is exact).
ONNX_ACTIVATIONS = {"Relu": "relu", "Gelu": "gelu"}
GELU_APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}  # ONNX Gelu's `approximate` (opset 20)
# onnxruntime's own ops (com.microsoft) that its basic/extended graph optimisations write and that are
# recognised: Gemm + activation, MatMul with transposes/scale, LayerNorm/RMSNorm fused with the residual Add.
CONTRIB_DOMAIN = "com.microsoft"
RECOGNISED_CONTRIB = {"FusedGemm", "FusedMatMul", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
                      "SimplifiedLayerNormalization", "Gelu"}


@dataclass
class Linear:
    """y = x @ weight (+ bias), weight in [K, N] (ONNX MatMul) layout."""

    input: ir.Value
    weight: np.ndarray
    bias: np.ndarray | None
    output: ir.Value
    matmul: ir.Node
    activation: str | None = None  # onnxruntime's FusedGemm applies one to its output


@dataclass
class Norm:
    kind: str  # "layer" or "rms"
    input: ir.Value
    scale: np.ndarray
    bias: np.ndarray | None
    epsilon: float


@dataclass
class HeadNorm:
    """A norm on an attention's query or key side of the graph (before the lift: its weight in the graph's
    order), and the value it writes."""

    norm: Norm
    output: ir.Value


@dataclass
class QKNorm:
    """An RMSNorm over each head's query and key before RoPE (Qwen3): one weight [head_dim] each, in the order of
    the lifted heads' columns."""

    q: np.ndarray
    k: np.ndarray
    epsilon: float


@dataclass
class Attention:
    layer: int
    norm: Norm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: np.ndarray | None  # RoPE frequencies (rotate-half form), None without RoPE
    scale: float | None = None  # the scores' scale where the graph applies one after q.k (else 1/sqrt(head_dim))
    softcap: float = 0.0  # the scores' soft-cap, cap * tanh(s / cap) (0: none)
    window: int = 0  # a query attends to this many positions, itself and the ones before (0: every earlier one)
    post_norm: Norm | None = None  # a norm of the block's output inside the residual branch (Gemma)
    qk_norm: QKNorm | None = None


@dataclass
class FFN:
    norm: Norm
    up: Linear
    down: Linear
    activation: str
    activation_output: ir.Value  # in the source graph: zero exactly where a neuron is inactive
    gate: Linear | None = None
    layer: int = -1
    parallel: bool = False  # reads the layer's input (beside the attention), not the attention's output
    post_norm: Norm | None = None  # a norm of the block's output inside the residual branch (Gemma)


@dataclass
class Decoder:
    """What the recognised graph means, before it is rebuilt as picompile ops."""

    embed: np.ndarray
    positions: np.ndarray | None
    attentions: list[Attention]
    ffns: list[FFN]
    final_norm: Norm
    lm_head: Linear
    extras: dict = field(default_factory=dict)
    embed_scale: float = 1.0  # the token rows' scale (Gemma: sqrt(d_model))
    final_softcap: float = 0.0  # the logits' soft-cap (0: none)


# ---------------------------------------------------------------- graph helpers


def _up(value: ir.Value) -> ir.Value:
    """Follow pass-through ops upwards to the value that carries the data."""
    while (node := value.producer()) is not None and node.op_type in PASS_THROUGH and node.inputs:
        value = node.inputs[0]
    return value


def _consumers(value: ir.Value) -> list[ir.Node]:
    """Consumers of a value's data, looking through pass-through ops (shape reads are not data uses)."""
    found = []
    for node in value.consumers():
        if node.op_type in SHAPE_OF:
            continue
        if node.op_type in PASS_THROUGH:
            found.extend(_consumers(node.outputs[0]))
        else:
            found.append(node)
    return found


def _const_weight(value: ir.Value) -> np.ndarray | None:
    """A constant matrix, or the transpose of one (tied output layers: folding skips large transposes)."""
    array = pir.const_matrix(value)
    if array is not None:
        return array
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and list(pir.attr(node, "perm", [1, 0])) == [1, 0]:
        source = pir.const_matrix(node.inputs[0])
        return None if source is None or source.ndim != 2 else source.T
    return None


def _match_linear(node: ir.Node) -> Linear | None:
    activation = None
    if node.op_type == "MatMul":
        weight = _const_weight(node.inputs[1])
        if weight is None or weight.ndim != 2 or pir.const_array(node.inputs[0]) is not None:
            return None
        bias = None
    elif node.op_type in ("Gemm", "FusedGemm", "FusedMatMul"):
        weight = _const_weight(node.inputs[1])
        if (weight is None or weight.ndim != 2 or pir.attr(node, "transA", 0) or pir.attr(node, "alpha", 1.0) != 1.0
                or pir.attr(node, "transBatchA", 0) or pir.attr(node, "transBatchB", 0)):
            return None
        if pir.attr(node, "transB", 0):
            weight = weight.T
        bias = pir.const_array(node.inputs[2]) if node.op_type != "FusedMatMul" and len(node.inputs) > 2 else None
        if bias is not None:
            bias = np.broadcast_to(bias * pir.attr(node, "beta", 1.0), (weight.shape[1],))
        if node.op_type == "FusedGemm" and pir.attr(node, "activation", "") not in ("", *ONNX_ACTIVATIONS):
            raise UserError(f"onnxruntime FusedGemm {node.name} applies activation {pir.attr(node, 'activation')}, "
                            f"which is not supported (supported: {', '.join(ONNX_ACTIVATIONS)})")
        activation = ONNX_ACTIVATIONS.get(pir.attr(node, "activation", "")) if node.op_type == "FusedGemm" else None
    else:
        return None
    output = node.outputs[0]
    users = list(output.uses())
    if bias is None and activation is None and len(users) == 1 and users[0][0].op_type == "Add":
        add = users[0][0]
        other = add.inputs[1 - users[0][1]]
        candidate = pir.const_array(other)
        if candidate is not None and candidate.size == weight.shape[1]:
            bias, output = candidate.reshape(-1), add.outputs[0]
    return Linear(node.inputs[0], pir.weight_array(weight),
                  None if bias is None else np.asarray(bias, np.float32), output, node, activation)


def _scalar(value: ir.Value | None) -> float | None:
    array = pir.const_array(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def _sqrt_of_mean_square(value: ir.Value, x: ir.Value) -> float | None:
    """If value = sqrt(mean(x^2) + eps), return eps."""
    node = _up(value).producer()
    if node is None or node.op_type != "Sqrt" or (add := node.inputs[0].producer()) is None or add.op_type != "Add":
        return None
    for mean_index in (0, 1):
        mean = add.inputs[mean_index].producer()
        eps = _scalar(add.inputs[1 - mean_index])
        if mean is None or mean.op_type != "ReduceMean" or eps is None:
            continue
        square = mean.inputs[0].producer()
        if square is not None and square.op_type in ("Pow", "Mul") and _up(square.inputs[0]) is _up(x):
            return eps
    return None


def _reciprocal_of(value: ir.Value) -> ir.Value | None:
    """If value = 1 / s (Reciprocal, or Div with a constant 1 numerator), return s."""
    node = _up(value).producer()
    if node is not None and node.op_type == "Reciprocal":
        return node.inputs[0]
    if node is not None and node.op_type == "Div" and _scalar(node.inputs[0]) == 1.0:
        return node.inputs[1]
    return None


def _match_rms_core(value: ir.Value) -> tuple[ir.Value, float] | None:
    """x * 1/sqrt(mean(x^2) + eps)  or  x / sqrt(mean(x^2) + eps)  ->  (x, eps)."""
    node = _up(value).producer()
    if node is not None and node.op_type == "Div":
        eps = _sqrt_of_mean_square(node.inputs[1], node.inputs[0])
        return None if eps is None else (node.inputs[0], eps)
    if node is not None and node.op_type == "Mul":
        for x_index in (0, 1):
            x, other = node.inputs[x_index], node.inputs[1 - x_index]
            root = _reciprocal_of(other)
            eps = None if root is None else _sqrt_of_mean_square(root, x)
            if eps is not None:
                return x, eps
    return None


def _match_norm(value: ir.Value) -> Norm | None:
    node = _up(value).producer()
    if node is None:
        return None
    if node.op_type == "LayerNormalization":
        scale = pir.const_array(node.inputs[1])
        bias = pir.const_array(node.inputs[2]) if len(node.inputs) > 2 else None
        if scale is None:
            return None
        return Norm("layer", node.inputs[0], scale.astype(np.float32),
                    np.zeros_like(scale, np.float32) if bias is None else bias.astype(np.float32),
                    float(pir.attr(node, "epsilon", 1e-5)))
    if node.op_type in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization") and node.domain == CONTRIB_DOMAIN:
        # norm(input + skip): the residual Add fused in; its sum, when kept, is the fourth output
        if len(node.inputs) > 4 and node.inputs[4] is not None:
            raise UserError(f"onnxruntime {node.op_type} {node.name} adds a bias before the norm, which is not supported")
        scale = pir.const_array(node.inputs[2])
        if scale is None:
            return None
        layer = node.op_type == "SkipLayerNormalization"
        bias = pir.const_array(node.inputs[3]) if layer and len(node.inputs) > 3 and node.inputs[3] is not None else None
        total = node.outputs[3] if len(node.outputs) > 3 else node.inputs[0]
        return Norm("layer" if layer else "rms", total, scale.astype(np.float32),
                    (np.zeros_like(scale, np.float32) if bias is None else bias.astype(np.float32)) if layer else None,
                    float(pir.attr(node, "epsilon", 1e-5)))
    if node.op_type in ("RMSNormalization", "SimplifiedLayerNormalization"):
        scale = pir.const_array(node.inputs[1])
        if scale is not None:
            return Norm("rms", node.inputs[0], scale.astype(np.float32), None, float(pir.attr(node, "epsilon", 1e-5)))
        return None
    if node.op_type == "Mul":
        for scale_index in (0, 1):
            scale = pir.const_array(node.inputs[scale_index])
            if scale is None or scale.ndim != 1:
                continue
            core = _match_rms_core(node.inputs[1 - scale_index])
            if core is not None:
                return Norm("rms", core[0], scale.astype(np.float32), None, core[1])
    return None


def _upstream(start: ir.Value, stop) -> tuple[list, set[ir.Node]]:
    """Breadth-first walk up from `start`; values for which stop(value) is truthy end the walk there.
    Returns (the stop results found, every node visited)."""
    found, seen_nodes, seen_values = [], set(), set()
    queue = deque([start])
    while queue:
        value = queue.popleft()
        if id(value) in seen_values:
            continue
        seen_values.add(id(value))
        hit = stop(value)
        if hit is not None:
            found.append(hit)
            continue
        node = value.producer()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        queue.extend(v for v in node.inputs if v is not None)
    return found, seen_nodes


def _downstream_linear(start: ir.Value, linear_by_node: dict[ir.Node, Linear]) -> Linear | None:
    """The nearest linear below a value."""
    queue, seen = deque([start]), set()
    while queue:
        value = queue.popleft()
        for node in value.consumers():
            if node in linear_by_node:
                return linear_by_node[node]
            if node not in seen:
                seen.add(node)
                queue.extend(node.outputs)
    return None


# ---------------------------------------------------------------- activations


def _named_activation(node: ir.Node) -> str:
    """The activation a Relu or Gelu node computes."""
    if node.op_type != "Gelu":
        return ONNX_ACTIVATIONS[node.op_type]
    approximate = pir.attr(node, "approximate", "none")
    if approximate not in GELU_APPROXIMATIONS:
        raise UserError(f"Gelu {node.name} has approximate={approximate!r}; ONNX defines "
                        f"{' and '.join(map(repr, GELU_APPROXIMATIONS))}")
    return GELU_APPROXIMATIONS[approximate]


# The elementwise ops an activation is written out with, as functions of float64 arrays (pass-through ops
# carry their data input). Exporters write GELU so below opset 20, each in its own order of operations.
_ELEMENTWISE = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
                "Sqrt": np.sqrt, "Neg": np.negative, "Exp": np.exp, "Tanh": np.tanh,
                "Erf": np.vectorize(math.erf, otypes=[np.float64])}
# Where the written-out function is compared with each activation: wide enough that exact and tanh GELU
# differ (by 5e-4 at |x| = 2.7) far beyond the rounding of an exporter's fp32 constants (1e-7 relative).
_PROBE = np.linspace(-8.0, 8.0, 321)
_PROBE_TOLERANCE = 1e-5


def _elementwise_inputs(node: ir.Node) -> list[ir.Value | None] | None:
    """The inputs an elementwise node computes with (a pass-through op's data input alone), None for any other op."""
    if node.op_type in PASS_THROUGH:
        return list(node.inputs[:1])
    return list(node.inputs) if node.op_type in _ELEMENTWISE and node.domain in ("", "ai.onnx") else None


def _written_out_activation(anchor: ir.Node, linear_of) -> tuple[str, ir.Value, Linear] | None:
    """An activation exported as elementwise arithmetic around `anchor` (a Tanh or Erf): (its name, its output,
    the linear it reads) when the ops that read that linear's output compute, of it alone and with scalar
    constants, one value that leaves them and equals a known activation on a probe of inputs; else None.
    Matching the values rather than an op pattern takes every exporter's spelling, and never mistakes one
    GELU for the other."""
    first, stack, seen = None, [anchor.inputs[0]], set()
    while stack:  # up: the one linear the anchor's input is computed from
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        linear = linear_of(value)
        if linear is not None:
            if first is not None and first is not linear:
                return None
            first = linear
            continue
        inputs = None if value.producer() is None else _elementwise_inputs(value.producer())
        if inputs is None:
            return None
        stack.extend(v for v in inputs if v is not None and pir.const_array(v) is None)
    if first is None:
        return None
    # down: evaluate every op whose inputs are x, values computed from x, or scalar constants
    x = first.output
    computed, done, queue = {id(x): (x, _PROBE)}, set(), deque([x])
    with np.errstate(all="ignore"):
        while queue:
            for node in queue.popleft().consumers():
                inputs = _elementwise_inputs(node)
                if node in done or inputs is None or len(node.outputs) != 1:
                    continue
                args = []
                for v in inputs:
                    if v is not None and id(v) in computed:
                        args.append(computed[id(v)][1])
                        continue
                    constant = None if v is None else pir.const_array(v)
                    if constant is None or constant.size != 1:
                        break  # another tensor, or one not computed yet (this node is seen again when it is)
                    args.append(float(constant.reshape(-1)[0]))
                else:
                    done.add(node)
                    function = _ELEMENTWISE.get(node.op_type, lambda a: a)
                    computed[id(node.outputs[0])] = (node.outputs[0], function(*args))
                    queue.append(node.outputs[0])
    if anchor not in done:
        return None
    leaving = [(value, probe) for value, probe in computed.values()
               if value.is_graph_output() or any(c not in done and c.op_type not in SHAPE_OF for c in value.consumers())]
    if len(leaving) != 1 or leaving[0][0] is x:
        return None
    out, got = leaving[0]
    import torch  # here: recognise needs torch only for written-out activations

    for activation in ACTIVATIONS.values():
        want = activation.torch()(torch.from_numpy(_PROBE)).numpy()
        if np.shape(got) == want.shape and np.allclose(got, want, rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE):
            return activation.name, out, first
    return None


# ---------------------------------------------------------------- scales and soft-caps, post-norms, windows


def _scalar_chain(start: ir.Value) -> list[ir.Node]:
    """The elementwise ops that follow `start` one after another, each the only reader of the value before it and
    computing with it alone and scalar constants (a scale, a soft-cap's divide, tanh and multiply; casts)."""
    nodes, value = [], start
    while not value.is_graph_output():
        users = [node for node in value.consumers() if node.op_type not in SHAPE_OF]
        inputs = _elementwise_inputs(users[0]) if len(users) == 1 else None
        if inputs is None or len(users[0].outputs) != 1 or sum(v is value for v in inputs) != 1:
            break
        constants = [None if v is None else pir.const_array(v) for v in inputs if v is not value]
        if any(c is None or c.size != 1 for c in constants):
            break
        nodes.append(users[0])
        value = users[0].outputs[0]
    return nodes


def _chain_values(nodes: list[ir.Node], start: ir.Value, probe: np.ndarray) -> np.ndarray:
    """What `_scalar_chain`'s ops compute from `start` = `probe`, in float64."""
    computed = {id(start): probe}
    with np.errstate(all="ignore"):
        for node in nodes:
            args = [computed[id(v)] if id(v) in computed else float(pir.const_array(v).reshape(-1)[0])
                    for v in _elementwise_inputs(node)]
            computed[id(node.outputs[0])] = _ELEMENTWISE.get(node.op_type, lambda a: a)(*args)
    return computed[id(nodes[-1].outputs[0])] if nodes else probe


# raw scores / logits the chains are evaluated on: small ones (where a soft-cap is the identity) to large ones
_CHAIN_PROBE = np.concatenate([-np.geomspace(1e-3, 1e5, 81)[::-1], [0.0], np.geomspace(1e-3, 1e5, 81)])


def _capped_scale(nodes: list[ir.Node], start: ir.Value) -> tuple[float, float] | None:
    """(s, cap) where the chain computes cap * tanh(s x / cap) of its input x (cap 0: s x), the cap fitted on
    the probe's largest value; None for any other function."""
    x = _CHAIN_PROBE
    y = _chain_values(nodes, start, x)
    if not np.all(np.isfinite(y)):
        return None
    small = np.abs(x) == 1e-3
    s = float(np.mean(y[small] / x[small]))
    if s <= 0:
        return None
    if np.allclose(y, s * x, rtol=1e-6, atol=0):
        return s, 0.0
    top = float(y[-1])  # cap * tanh(s x / cap) grows with the cap, from 0 to s x: bisect it
    low, high = top, top * 1e6
    if not 0 < top < s * x[-1]:
        return None
    for _ in range(200):
        cap = 0.5 * (low + high)
        low, high = (cap, high) if cap * np.tanh(s * x[-1] / cap) < top else (low, cap)
    cap = 0.5 * (low + high)
    if not np.allclose(y, cap * np.tanh(s * x / cap), rtol=1e-6, atol=1e-9 * cap):
        return None
    return s, float(np.float32(cap))


def _plain_scale(s: float) -> float:
    """A fitted scale s as the constant it came from: 1/sqrt(n) for the whole n it is within 1e-6 of, else s."""
    n = round(s ** -2)
    return n ** -0.5 if n > 0 and abs(n ** -0.5 - s) <= 1e-6 * s else s


def _post_norm(output: ir.Value) -> Norm | None:
    """A norm whose input is a block's output (`output`), within the few ops below it: Gemma's norm after
    attention or the FFN, inside the residual branch. None for a pre-norm block (the next norm reads the sum)."""
    queue, seen = deque([(output, 0)]), set()
    while queue:
        value, depth = queue.popleft()
        for node in value.consumers():
            if node in seen or depth > 8 or node.op_type in SHAPE_OF:
                continue
            seen.add(node)
            for out in node.outputs:  # (onnxruntime's Skip*Normalization is the residual Add and the next pre-norm)
                norm = None if node.op_type.startswith("Skip") else _match_norm(out)
                if norm is not None and _up(norm.input) is _up(output):
                    return norm
                queue.append((out, depth + 1))
    return None


def _score_matmul(present_key: ir.Value) -> ir.Node | None:
    """The score product: the first MatMul below the key cache (`_query_side`'s)."""
    queue, seen = deque([present_key]), set()
    while queue:
        value = queue.popleft()
        for node in value.consumers():
            if node.op_type in ("MatMul", "FusedMatMul") and len(node.inputs) == 2:
                return node
            if node not in seen:
                seen.add(node)
                queue.extend(node.outputs)
    return None


def _scores(model: ir.Model, where: str, present_key: ir.Value) -> tuple[float | None, float, ir.Value | None]:
    """(the scale the graph applies to q.k after the product, None where it applies none there; the soft-cap, 0
    for none; the mask added to the scores, None for none) from the elementwise ops between the score product and
    the mask's Add (the Gemma 2 export's `* scaling`, `/ cap`, `tanh`, `* cap`)."""
    product = _score_matmul(present_key)
    if product is None or product.op_type != "MatMul":  # (FusedMatMul's alpha is its own scale: as before)
        return None, 0.0, None
    start = product.outputs[0]
    nodes = _scalar_chain(start)
    fitted = _capped_scale(nodes, start)
    if fitted is None:
        raise UserError(f"{where}: the attention scores go through {', '.join(n.op_type for n in nodes)} after the "
                        "q.k product, which is neither a scale nor a scale and a soft-cap (cap * tanh(s / cap))")
    scale, cap = fitted
    end = nodes[-1].outputs[0] if nodes else start
    users = [node for node in end.consumers() if node.op_type not in SHAPE_OF]
    mask = None
    if len(users) == 1 and users[0].op_type == "Add" and len(users[0].inputs) == 2:
        other = users[0].inputs[1 - list(users[0].inputs).index(end)]
        mask = other if pir.const_array(other) is None else None
    return (_plain_scale(scale) if abs(scale - 1.0) > 1e-9 else None), cap, mask


def _window(model: ir.Model, where: str, mask: ir.Value, max_context: int) -> int:
    """How many positions a query attends to through `mask` (the scores' additive mask), measured in onnxruntime
    for the last position of the context (one token after max_context - 1 cached ones): 0 where it attends to
    every one (a sliding window no shorter than the context is none)."""
    past = max_context - 1
    try:
        values = np.asarray(_run_subgraph(model, [mask], [], tokens=1, past=past)[0], np.float64)
    except UserError:  # a mask onnxruntime cannot compute on its own: taken as the plain causal one, as before
        return 0
    if values.size % (past + 1):
        return 0
    row = values.reshape(-1, past + 1)[0]
    opened = row > -1e4
    count = int(opened.sum())
    if count == past + 1:
        return 0
    if count == 0 or not opened[past + 1 - count:].all():
        raise UserError(f"{where}: the attention mask closes positions that are neither later ones nor outside a "
                        f"sliding window (a query at position {past} attends to {np.flatnonzero(opened)[:8].tolist()}"
                        f"...)")
    return count


def _final_softcap(logits: ir.Value, linear_by_output: dict[int, Linear]) -> tuple[ir.Value, float]:
    """(the value the output layer computes, the logits' soft-cap) where the logits are the output layer's,
    soft-capped (Gemma 2: cap * tanh(logits / cap)); (logits, 0) where no such ops follow the output layer."""
    value = logits
    while id(_up(value)) not in linear_by_output and (node := value.producer()) is not None:
        inputs = _elementwise_inputs(node)
        data = [v for v in inputs or () if v is not None and pir.const_array(v) is None]
        if len(data) != 1:
            return logits, 0.0
        value = data[0]
    if value is logits or id(_up(value)) not in linear_by_output:
        return logits, 0.0
    start = linear_by_output[id(_up(value))].output
    nodes = _scalar_chain(start)
    fitted = _capped_scale(nodes, start) if nodes and nodes[-1].outputs[0] is logits else None
    if fitted is None or abs(fitted[0] - 1.0) > 1e-6 or not fitted[1]:
        raise UserError(f"the logits go through {', '.join(n.op_type for n in nodes) or 'ops'} after the output "
                        "layer, which is not a soft-cap (cap * tanh(logits / cap)) picompile computes")
    return start, fitted[1]


def _embedding_scale(token: ir.Node) -> float:
    """The scalar constant the token embedding's rows are multiplied by before anything else reads them (Gemma's
    sqrt(d_model)), else 1."""
    users = _consumers(token.outputs[0])
    if len(users) != 1 or users[0].op_type not in ("Mul", "Div") or len(users[0].inputs) != 2:
        return 1.0
    node = users[0]
    data = [i for i, v in enumerate(node.inputs) if _up(v) is _up(token.outputs[0])]
    if len(data) != 1:
        return 1.0
    constant = pir.const_array(node.inputs[1 - data[0]])
    if constant is None or constant.size != 1:
        return 1.0
    value = float(constant.reshape(-1)[0])
    if node.op_type == "Div":  # x / c (c / x is no scale: the rows then are not the table's, and the graph says so)
        return 1.0 / value if data[0] == 0 else 1.0
    return value


# ---------------------------------------------------------------- recognition


def _find_ffns(graph: ir.Graph, linear_by_output: dict[int, Linear]) -> list[FFN]:
    def linear_of(value: ir.Value) -> Linear | None:
        return linear_by_output.get(id(_up(value)))

    ffns = []
    for node in graph:
        fused = linear_by_output.get(id(node.outputs[0])) if node.op_type == "FusedGemm" and node.outputs else None
        if fused is not None and fused.activation is not None:  # onnxruntime's Gemm + activation in one op
            activation, act_out, first = fused.activation, node.outputs[0], fused
        elif node.op_type == "Sigmoid":  # SiLU exported as x * sigmoid(x)
            muls = [c for c in node.outputs[0].consumers() if c.op_type == "Mul" and node.inputs[0] in c.inputs]
            if not muls:
                continue
            activation, act_out, first = "silu", muls[0].outputs[0], linear_of(node.inputs[0])
        elif node.op_type in ONNX_ACTIVATIONS:
            activation, act_out, first = _named_activation(node), node.outputs[0], linear_of(node.inputs[0])
        elif node.op_type in ("Tanh", "Erf"):  # GELU written out, as exporters do below opset 20
            found = _written_out_activation(node, linear_of)
            if found is None:
                continue
            activation, act_out, first = found
        else:
            continue
        if first is None or first.activation is not None and first is not fused:
            continue
        users = _consumers(act_out)
        if len(users) != 1:
            continue
        user = users[0]
        linears = {id(lin.matmul): lin for lin in linear_by_output.values()}
        if id(user) in linears and _up(user.inputs[0]) is _up(act_out):
            down = linears[id(user)]
            ffns.append(FFN(norm=None, up=first, down=down, activation=activation, activation_output=act_out))
        elif user.op_type == "Mul":
            other = user.inputs[1] if _up(user.inputs[0]) is _up(act_out) else user.inputs[0]
            up = linear_of(other)
            downs = [linears[id(c)] for c in _consumers(user.outputs[0]) if id(c) in linears]
            if up is None or len(downs) != 1:
                continue
            ffns.append(FFN(norm=None, up=up, down=downs[0], activation=activation, activation_output=act_out, gate=first))
    return ffns


def _present_outputs(graph: ir.Graph) -> dict[int, tuple[ir.Value, ir.Value]]:
    by_layer: dict[int, dict[str, ir.Value]] = {}
    for value in graph.outputs:
        parts = value.name.split(".")
        if len(parts) == 3 and parts[0] == "present" and parts[1].isdigit() and parts[2] in ("key", "value"):
            by_layer.setdefault(int(parts[1]), {})[parts[2]] = value
    if sorted(by_layer) != list(range(len(by_layer))) or any(len(kv) != 2 for kv in by_layer.values()):
        raise UserError("model outputs present.{i}.key/value are incomplete: every layer needs both")
    return {i: (kv["key"], kv["value"]) for i, kv in by_layer.items()}


def kv_shapes(graph: ir.Graph) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's KV cache, from its past_key_values.{i}.key input; UserError where a
    layer's cache input or output is missing or has no static shape."""
    return [_kv_shape(graph, layer) for layer in sorted(_present_outputs(graph))]


def _kv_shape(graph: ir.Graph, layer: int) -> tuple[int, int]:
    for value in graph.inputs:
        if value.name == f"past_key_values.{layer}.key":
            shape = value.shape
            if shape is not None and len(shape) == 4 and isinstance(shape[1], int) and isinstance(shape[3], int):
                return shape[1], shape[3]
    raise UserError(f"input past_key_values.{layer}.key is missing or has no static [batch, kv_heads, past, head_dim] shape")


def _rope_frequencies(nodes: set[ir.Node], head_dim: int) -> np.ndarray | None:
    """RoPE: find the Cos op among the nodes feeding the key cache; its frequencies are the float constant of
    at most head_dim/2 values upstream of it (the `inv_freq` buffer of HF models, any scaling already applied;
    fewer than head_dim/2 for partial rotary embeddings)."""
    cos = [n for n in nodes if n.op_type == "Cos"]
    if not cos:
        return None

    def frequencies(value: ir.Value):
        array = pir.const_array(value)
        return array if array is not None and array.dtype.kind == "f" and 1 < array.size <= head_dim // 2 else None

    found, _ = _upstream(cos[0].inputs[0], frequencies)
    if len(found) != 1:
        raise UserError("attention uses RoPE but its frequency table (inv_freq) could not be found")
    return found[0].reshape(-1).astype(np.float64)


def _query_side(present_key: ir.Value) -> ir.Value | None:
    """The query operand of the score product: the other input of the first MatMul below the key cache."""
    queue, seen = deque([present_key]), set()
    while queue:
        value = queue.popleft()
        for node in value.consumers():
            if node.op_type in ("MatMul", "FusedMatMul") and len(node.inputs) == 2:
                return node.inputs[1 - list(node.inputs).index(value)]
            if node not in seen:
                seen.add(node)
                queue.extend(node.outputs)
    return None


def _subgraph_proto(model: ir.Model, outputs: list[ir.Value], cuts: list[ir.Value] = (),
                    identities: list[tuple[ir.Value, ir.Value]] = ()):
    """An ONNX proto computing only `outputs` from the graph inputs they need, with `cuts` made inputs
    too (what is above them is left out), plus the constants on the way. `identities`: (value, source) pairs,
    each value computed as a copy of its source in place of the op that makes it (the column probe's per-head
    q / k norms: they scale each head's values and move none)."""
    import onnx

    cut_ids = {id(v) for v in cuts}
    copied = {id(value): source for value, source in identities}
    replaced: dict[ir.Node, tuple[ir.Value, ir.Value]] = {}  # the op making a copied value -> (value, source)
    needed, stack, seen = set(), list(outputs), set()
    while stack:
        value = stack.pop()
        if id(value) in seen or id(value) in cut_ids:
            continue
        seen.add(id(value))
        if id(value) in copied:
            replaced[value.producer()] = (value, copied[id(value)])
            stack.append(copied[id(value)])
            continue
        node = value.producer()
        if node is not None and node not in needed:
            needed.add(node)
            stack.extend(v for v in node.inputs if v is not None)
    nodes = [onnx.helper.make_node("Identity", [replaced[node][1].name], [replaced[node][0].name])
             if node in replaced else ir.serde.serialize_node(node) for node in model.graph
             if node in needed or node in replaced]
    used = {id(v): v for node in model.graph if node in needed for v in node.inputs if v is not None}
    used.update((id(source), source) for _, source in replaced.values())
    names = []
    for value in outputs:
        names.append(value.name)
        if value.producer() is None:  # a graph input asked for as it is: ONNX wants an op in between
            used[id(value)] = value
            names[-1] = value.name + ".probe"
            nodes.append(onnx.helper.make_node("Identity", [value.name], [names[-1]]))
    initializers = [onnx.numpy_helper.from_array(v.const_value.numpy(), v.name)
                    for v in used.values() if v.is_initializer() and id(v) not in cut_ids]
    inputs = [onnx.helper.make_tensor_value_info(v.name, int(v.dtype or ir.DataType.FLOAT), None)
              for v in [*model.graph.inputs, *cuts] if id(v) in used]
    graph = onnx.helper.make_graph(nodes, "probe", inputs, [onnx.helper.make_empty_tensor_value_info(n) for n in names],
                                   initializers)
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)


def _run_subgraph(model: ir.Model, outputs: list[ir.Value], cut_feeds: list[tuple[ir.Value, np.ndarray]],
                  tokens: int, past: int, identities: list[tuple[ir.Value, ir.Value]] = ()) -> list[np.ndarray]:
    """Run `outputs` in onnxruntime for `tokens` new tokens after `past` cached ones (zero ids, zero cache),
    the `cut_feeds` values given (`identities`: see `_subgraph_proto`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    proto = _subgraph_proto(model, outputs, [v for v, _ in cut_feeds], identities)
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own types for invalid graphs
        raise _probe_failed(outputs, error) from None
    given = {v.name: array for v, array in cut_feeds}
    graph_inputs = {v.name: v for v in model.graph.inputs}
    feeds = {}
    for info in session.get_inputs():
        name = info.name
        if name in given:
            feeds[name] = given[name]
        elif name == "input_ids":
            feeds[name] = np.zeros((1, tokens), np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, past + tokens), np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(past, past + tokens, dtype=np.int64)[None]
        else:
            value = graph_inputs[name]
            shape = [d if isinstance(d, int) else (past if i == 2 else 1) for i, d in enumerate(value.shape)]
            feeds[name] = np.zeros(shape, value.dtype.numpy())
    try:
        return session.run([o.name for o in session.get_outputs()], feeds)
    except Exception as error:  # ... and for mistyped or misshapen values met while running
        raise _probe_failed(outputs, error) from None


def _probe_failed(outputs: list[ir.Value], error: Exception) -> UserError:
    return UserError(f"onnxruntime cannot run the part of the graph that computes {', '.join(o.name for o in outputs)} "
                     f"({type(error).__name__}: {first_line(error)})")


def _columns(model: ir.Model, layer: int, q: Linear, k: Linear, v: Linear, query: ir.Value,
             present_key: ir.Value, present_value: ir.Value, norms: dict[str, HeadNorm]):
    """Which output columns of the q / k / v projections hold each head's query, key and value, in head-major
    order; and for each of `norms` (the query's and the key's per-head norms, by name) which columns it normalises
    together, a row per group in the order its weight reads them. The projections' outputs are replaced by their
    column numbers (and then by ones, to divide out a scale applied to the query) and the graph moves them into
    the cache and the score MatMul, each norm passing its input on unchanged."""
    projections = list({id(lin): lin for lin in (q, k, v)}.values())
    identities = [(norm.output, norm.norm.input) for norm in norms.values()]

    def feeds(fill):
        found = []
        for lin in projections:
            width = lin.weight.shape[1]
            rank = len(lin.output.shape) if lin.output.shape is not None else 3
            found.append((lin.output, fill(width).astype(np.float32).reshape([1] * (rank - 1) + [width])))
        return found

    outputs = [query, present_key, present_value, *(norm.norm.input for norm in norms.values())]
    numbered = _run_subgraph(model, outputs, feeds(lambda n: np.arange(n)), tokens=1, past=0, identities=identities)
    ones = _run_subgraph(model, outputs[:1], feeds(np.ones), tokens=1, past=0, identities=identities)[0]
    groups = {}
    for (name, norm), array in zip(norms.items(), numbered[3:]):
        array = np.asarray(array, np.float64).reshape(-1, norm.norm.scale.size)
        groups[name] = np.rint(array).astype(np.int64)
        if np.abs(array - groups[name]).max(initial=0) > 1e-2:
            raise UserError(f"layer {layer}: the {name}'s per-head norm reads values that are not the projection's "
                            "columns (unrecognised attention layout)")
    found = []
    for name, lin, array in (("query", q, numbered[0] / ones), ("key", k, numbered[1]), ("value", v, numbered[2])):
        array = np.asarray(array, np.float64).reshape(-1)
        columns = np.rint(array).astype(np.int64)
        if (np.abs(array - columns).max(initial=0) > 1e-2 or columns.min(initial=0) < 0
                or columns.max(initial=0) >= lin.weight.shape[1] or len(set(columns.tolist())) != columns.size):
            raise UserError(f"layer {layer}: the {name} heads are not a rearrangement of the projection's columns "
                            "(unrecognised attention layout)")
        found.append(columns)
    return found[0], found[1], found[2], groups


def _head_norm(nodes: set[ir.Node], head_dim: int, what: str, where: str) -> HeadNorm | None:
    """The norm among the `nodes` between an attention's query or key projection and its use, if any: it must be
    an RMSNorm over each head's values (Qwen3's q / k norm) before RoPE; any other is refused, never dropped."""
    found = [HeadNorm(norm, node.outputs[0]) for node in nodes if node.op_type not in PASS_THROUGH and node.outputs
             and (norm := _match_norm(node.outputs[0])) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise UserError(f"{where}: the attention's {what} passes {len(found)} norms (picompile lifts one, over "
                        "each head)")
    norm = found[0].norm
    if norm.kind != "rms":
        raise UserError(f"{where}: the attention's {what} heads pass a LayerNorm, which is not supported (an RMSNorm "
                        "over each head is)")
    if norm.scale.size != head_dim:
        raise UserError(f"{where}: the attention's {what} passes a norm over {norm.scale.size} values, which is not "
                        f"supported (an RMSNorm over each head's {head_dim} is)")
    _, above = _upstream(norm.input, lambda value: None if value.producer() in nodes else False)
    if any(node.op_type in ("Cos", "Sin") for node in above):  # RoPE's rotation does not commute with the weight
        raise UserError(f"{where}: the attention's {what} is normed after RoPE, which is not supported (before is)")
    return found[0]


def _per_head_weight(columns: np.ndarray, groups: np.ndarray, scale: np.ndarray, head_dim: int, what: str,
                     where: str) -> np.ndarray:
    """A per-head norm's weight in the order of the lifted heads' `columns`: each head's columns must be one of
    the norm's `groups` (it normalises exactly one head's values together) and every head must read the weight in
    the same order (the block IR holds one weight for all heads)."""
    place = {int(c): (g, j) for g, row in enumerate(groups) for j, c in enumerate(row)}
    heads = columns.reshape(-1, head_dim)
    weight = None
    for head in heads:
        places = [place.get(int(c)) for c in head]
        if len(groups) != len(heads) or None in places or len({g for g, _ in places}) != 1:
            raise UserError(f"{where}: the {what} norm does not normalise each head's values by themselves "
                            "(unrecognised attention layout)")
        read = scale[[j for _, j in places]]
        if weight is not None and not np.array_equal(read, weight):
            raise UserError(f"{where}: the {what} heads read their norm's weight in different orders "
                            "(unrecognised attention layout)")
        weight = read
    return np.asarray(weight, np.float32)


def _take(lin: Linear, columns: np.ndarray) -> Linear:
    if np.array_equal(columns, np.arange(lin.weight.shape[1])):  # separate projections: already in order
        return lin
    return Linear(lin.input, lin.weight[:, columns], None if lin.bias is None else lin.bias[columns], lin.output, lin.matmul)


def _full_rotary(q: Linear, k: Linear, inv_freq: np.ndarray, heads: int, kv_heads: int, head_dim: int):
    """Partial RoPE (rotate-half over the first 2*r dims of each head, r = len(inv_freq)) as full-width RoPE:
    dims j, j + r become j, j + head_dim/2 and the pass-through dims take the places with frequency zero
    (cos 1, sin 0: unchanged). Query and key move alike, so their dot products stay the same. Also returns each
    head's new order of its dims (a per-head norm's weight moves with them)."""
    half, r = head_dim // 2, inv_freq.size
    passing = np.arange(2 * r, head_dim)
    order = np.concatenate([np.arange(r), passing[: half - r], np.arange(r, 2 * r), passing[half - r:]])
    per_head = lambda n: (np.arange(n)[:, None] * head_dim + order[None, :]).reshape(-1)  # noqa: E731
    full = np.concatenate([inv_freq, np.zeros(half - r)])
    return _take(q, per_head(heads)), _take(k, per_head(kv_heads)), full, order


def _find_attentions(model: ir.Model, linears: list[Linear], max_context: int | None = None) -> list[Attention]:
    graph = model.graph
    linear_by_output = {id(lin.output): lin for lin in linears}
    linear_by_node = {lin.matmul: lin for lin in linears}
    past_inputs = {id(v) for v in graph.inputs if v.name.startswith("past_key_values.")}

    def stop(value: ir.Value):
        if id(value) in linear_by_output:
            return linear_by_output[id(value)]
        producer = value.producer()
        if id(value) in past_inputs or value.const_value is not None or (producer is not None and producer.op_type in SHAPE_OF):
            return False  # a dead end (no data flows through shapes), not a hit: filtered below
        return None

    def projection(value: ir.Value, what: str, where: str) -> tuple[Linear, set[ir.Node]]:
        hits, nodes = _upstream(value, stop)
        hits = [h for h in hits if h is not False]
        if len(hits) != 1:
            raise UserError(f"{where}: cannot trace the attention's {what} back to one projection (found {len(hits)})")
        if hits[0].activation is not None:
            raise UserError(f"{where}: the attention's {what} projection applies {hits[0].activation}")
        return hits[0], nodes

    attentions, windows = [], {}
    for layer, (present_key, present_value) in sorted(_present_outputs(graph).items()):
        where = f"layer {layer}"
        k, key_nodes = projection(present_key, f"key (present.{layer}.key)", where)
        v, _ = projection(present_value, f"value (present.{layer}.value)", where)
        query = _query_side(present_key)
        if query is None:
            raise UserError(f"{where}: no score MatMul found below present.{layer}.key")
        q, query_nodes = projection(query, "query", where)
        o = _downstream_linear(present_value, linear_by_node)
        if o is None:
            raise UserError(f"{where}: no output projection found after the attention")
        norm = _match_norm(k.input)
        if norm is None:
            raise UserError(f"{where}: the attention input is not a recognised LayerNorm/RMSNorm (post-norm models are not supported yet)")
        num_kv_heads, head_dim = _kv_shape(graph, layer)
        norms = {what: found for what, nodes in (("query", query_nodes), ("key", key_nodes))
                 if (found := _head_norm(nodes, head_dim, what, where)) is not None}
        if len(norms) == 1:
            raise UserError(f"{where}: only the attention's {next(iter(norms))} heads are normed, which is not "
                            "supported (a norm of both the query's and the key's is)")
        q_cols, k_cols, v_cols, groups = _columns(model, layer, q, k, v, query, present_key, present_value, norms)
        if q_cols.size % head_dim or k_cols.size != num_kv_heads * head_dim or v_cols.size != k_cols.size:
            raise UserError(f"{where}: projection widths do not match {num_kv_heads} kv heads of size {head_dim}")
        num_heads = q_cols.size // head_dim
        qk_norm = None
        if norms:
            q_norm, k_norm = norms["query"].norm, norms["key"].norm
            if q_norm.epsilon != k_norm.epsilon:
                raise UserError(f"{where}: the query's and the key's per-head norms differ in epsilon ({q_norm.epsilon}"
                                f", {k_norm.epsilon}), which is not supported")
            qk_norm = QKNorm(_per_head_weight(q_cols, groups["query"], q_norm.scale, head_dim, "query", where),
                             _per_head_weight(k_cols, groups["key"], k_norm.scale, head_dim, "key", where),
                             q_norm.epsilon)
        q, k, v = _take(q, q_cols), _take(k, k_cols), _take(v, v_cols)
        inv_freq = _rope_frequencies(key_nodes, head_dim)
        if inv_freq is not None and inv_freq.size < head_dim // 2:
            q, k, inv_freq, order = _full_rotary(q, k, inv_freq, num_heads, num_kv_heads, head_dim)
            if qk_norm is not None:
                qk_norm = QKNorm(qk_norm.q[order], qk_norm.k[order], qk_norm.epsilon)
        scale, softcap, mask = _scores(model, where, present_key)
        if mask is not None and max_context is not None and id(mask) not in windows:  # (masks shared by layers)
            windows[id(mask)] = _window(model, where, mask, max_context)
        window = windows.get(id(mask), 0) if mask is not None else 0
        attentions.append(Attention(layer, norm, q, k, v, o, num_heads, num_kv_heads, head_dim, inv_freq, scale,
                                    softcap, window, _post_norm(o.output), qk_norm))
    return attentions


def find_embeddings(graph: ir.Graph) -> tuple[ir.Node, ir.Node | None]:
    """The token embedding Gather (reading input_ids) and the learned-position one, if any (None otherwise)."""
    input_ids = next(v for v in graph.inputs if v.name == "input_ids")
    token, position = None, None
    for node in graph:
        if node.op_type != "Gather" or (table := pir.const_matrix(node.inputs[0])) is None or table.ndim != 2:
            continue
        if _up(node.inputs[1]) is input_ids:
            token = node
        else:
            position = node
    if token is None:
        raise UserError("no token embedding found (a Gather of a constant table by input_ids)")
    return token, position


def _position_offset(model: ir.Model, gather: ir.Node) -> int:
    """Learned positions (OPT, GPT-2) index their table at position + offset; find the offset by running the
    graph's index computation in onnxruntime on a 3-token prompt after one cached token."""
    positions = np.asarray(_run_subgraph(model, [gather.inputs[1]], [], tokens=3, past=1)[0]).reshape(-1)
    if positions.size != 3 or not np.array_equal(np.diff(positions), [1, 1]):
        raise UserError(f"learned position embedding indexed in an unrecognised way ({positions.tolist()})")
    return int(positions[0]) - 1


def _refuse_unknown_contrib_ops(graph: ir.Graph) -> None:
    unknown = sorted({n.op_type for n in graph if n.domain == CONTRIB_DOMAIN and n.op_type not in RECOGNISED_CONTRIB})
    if unknown:
        raise UserError(
            f"onnxruntime op{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} ({CONTRIB_DOMAIN}) "
            f"{'are' if len(unknown) > 1 else 'is'} not supported: recognised are the plain ONNX export and what "
            f"onnxruntime's basic/extended optimisation levels fuse ({', '.join(sorted(RECOGNISED_CONTRIB))}); "
            "save the model before attention/rotary fusion (e.g. without onnxruntime.transformers.optimizer)")


def analyse(model: ir.Model, max_context: int | None = None) -> Decoder:
    """What the graph means. `max_context`: the build's context, within which sliding windows are measured (None:
    not measured, every attention taken as attending to every earlier position)."""
    graph = model.graph
    _refuse_unknown_contrib_ops(graph)
    linears = [lin for node in graph if (lin := _match_linear(node)) is not None]
    linear_by_output = {id(lin.output): lin for lin in linears}
    ffns = _find_ffns(graph, linear_by_output)
    ffn_linears = {id(l.matmul) for f in ffns for l in (f.up, f.down, f.gate) if l is not None}
    attentions = _find_attentions(model, linears, max_context)
    if not attentions:
        raise UserError("model has no decoder layers (no present.{i}.key/value outputs)")
    if len(ffns) != len(attentions):
        used = ffn_linears | {id(lin.matmul) for a in attentions for lin in (a.q, a.k, a.v, a.o)}
        raise UserError(
            f"found {len(attentions)} attention blocks but {len(ffns)} FFN blocks"
            + _unrecognised_ffn([lin for lin in linears if id(lin.matmul) not in used])
            + "; FFNs must be up -> Relu/Gelu/SiLU -> down or act(gate) * up -> down with constant weights"
        )
    order = {node: i for i, node in enumerate(graph)}
    ffns.sort(key=lambda f: order[f.down.matmul])
    for layer, ffn in enumerate(ffns):
        ffn.layer = layer
        ffn.norm = _match_norm((ffn.gate or ffn.up).input)
        if ffn.norm is None:
            raise UserError(f"layer {layer}: the FFN input is not a recognised LayerNorm/RMSNorm")
        if layer < len(attentions):
            ffn.parallel = _up(ffn.norm.input) is _up(attentions[layer].norm.input)
        ffn.post_norm = _post_norm(ffn.down.output)
    logits = next(v for v in graph.outputs if v.name == "logits")
    head_output, final_softcap = _final_softcap(logits, linear_by_output)
    lm_head = linear_by_output.get(id(_up(head_output)))
    if lm_head is None:
        raise UserError("the logits are not produced by a linear output layer")
    final_norm = _match_norm(lm_head.input)
    if final_norm is None:
        raise UserError("no final norm before the output layer")
    token, position = find_embeddings(graph)
    positions = None
    if position is not None:
        offset = _position_offset(model, position)
        positions = pir.const_array(position.inputs[0])[offset:].astype(np.float32)
    decoder = Decoder(pir.weight_array(pir.const_matrix(token.inputs[0])), positions, attentions, ffns, final_norm, lm_head,
                      embed_scale=_embedding_scale(token), final_softcap=final_softcap)
    _check_shapes(decoder)
    return decoder


def _check_context(decoder: Decoder, max_context: int) -> None:
    """--max-context must fit the model's learned positions and the machine's memory (KV cache + a step's logits:
    they hold prefill_rows rows, whatever the context)."""
    if decoder.positions is not None and decoder.positions.shape[0] < max_context:
        raise UserError(f"--max-context {max_context} exceeds the model's {decoder.positions.shape[0]} learned positions")
    cache_bytes = kv_cache_bytes([(a.num_kv_heads, a.head_dim) for a in decoder.attentions], max_context)
    logits_bytes = nbytes([prefill_rows(max_context), decoder.lm_head.weight.shape[1]], "float32")
    available = available_memory_bytes()
    if available is not None and cache_bytes + logits_bytes > available:
        raise UserError(f"--max-context {max_context} needs {format_size(cache_bytes + logits_bytes)} for the KV cache "
                        f"and logits but only {format_size(available)} is available; choose a smaller --max-context")


def _unrecognised_ffn(leftovers: list[Linear]) -> str:
    """Why a linear left over after recognition is not an FFN: the op that follows it, named."""
    for lin in leftovers:
        users = _consumers(lin.output)
        if len(users) == 1 and users[0].op_type not in ("MatMul", "Gemm", "Add"):
            node = users[0]
            return (f"; linear {lin.matmul.name or lin.matmul.op_type} is followed by {node.op_type} "
                    f"(node {node.name or node.op_type}), which is not a supported FFN activation "
                    "(Relu; Gelu, exact or tanh, as the op or written out with Erf or Tanh; SiLU as x*Sigmoid(x)); "
                    "no build flag changes this")
    return ""


def _check_shapes(decoder: Decoder) -> None:
    """Every weight must be non-empty and agree with the model width: catches absurd or inconsistent
    shapes here, by name, rather than as a numpy or onnxruntime error passes later."""
    vocab, d_model = decoder.embed.shape
    if vocab == 0 or d_model == 0:
        raise UserError(f"the token embedding has shape {list(decoder.embed.shape)}: zero-size weights")

    def expect(lin: Linear, where: str, k: int | None, n: int | None = None) -> None:
        name = f"{where} ({lin.matmul.name or lin.matmul.op_type})"
        shape = list(lin.weight.shape)
        if lin.weight.size == 0:
            raise UserError(f"{name}: weight of shape {shape} has zero size")
        if (k is not None and shape[0] != k) or (n is not None and shape[1] != n):
            raise UserError(f"{name}: weight of shape {shape} does not fit: expected [{k or '?'}, {n or '?'}]")
        if lin.bias is not None and lin.bias.size != shape[1]:
            raise UserError(f"{name}: bias of {lin.bias.size} values for {shape[1]} outputs")

    def expect_norm(norm: Norm, where: str) -> None:
        if norm.scale.size != d_model or (norm.bias is not None and norm.bias.size != d_model):
            raise UserError(f"{where}: norm scale/bias of {norm.scale.size} values for a model width of {d_model}")

    for attention in decoder.attentions:
        where = f"layer {attention.layer} attention"
        for lin in (attention.q, attention.k, attention.v):
            expect(lin, where, d_model)
        expect(attention.o, f"{where} output projection", attention.q.weight.shape[1], d_model)
        expect_norm(attention.norm, where)
        if attention.post_norm is not None:
            expect_norm(attention.post_norm, f"{where} output")
    for ffn in decoder.ffns:
        where = f"layer {ffn.layer} FFN"
        expect(ffn.up, f"{where} up projection", d_model)
        width = ffn.up.weight.shape[1]
        if ffn.gate is not None:
            expect(ffn.gate, f"{where} gate projection", d_model, width)
        expect(ffn.down, f"{where} down projection", width, d_model)
        expect_norm(ffn.norm, where)
        if ffn.post_norm is not None:
            expect_norm(ffn.post_norm, f"{where} output")
    expect(decoder.lm_head, "output layer", d_model)
    expect_norm(decoder.final_norm, "final norm")
    if decoder.positions is not None and (decoder.positions.ndim != 2 or decoder.positions.shape[1] != d_model):
        raise UserError(f"the position embedding has shape {list(decoder.positions.shape)}; model width is {d_model}")


# ---------------------------------------------------------------- rebuilding as picompile ops


def _norm_node(graph: ir.Graph, norm: Norm, x: ir.Value, prefix: str) -> ir.Value:
    scale = pir.initializer(graph, f"{prefix}.scale", norm.scale)
    if norm.kind == "layer":
        bias = pir.initializer(graph, f"{prefix}.bias", norm.bias)
        node = ir.node("LayerNormalization", [x, scale, bias], {"axis": -1, "epsilon": norm.epsilon}, name=prefix)
    else:
        node = ir.node("RMSNormalization", [x, scale], {"axis": -1, "epsilon": norm.epsilon}, name=prefix)
    graph.append(node)
    node.outputs[0].name = f"{prefix}.out"
    return node.outputs[0]


def source_layer_input(attention: Attention) -> str:
    """The name of the residual stream entering the attention's layer in the source graph (its norm's input,
    above any cast: where the graph can be cut into layers)."""
    return _up(attention.norm.input).name


def _same_norm(a: Norm, b: Norm) -> bool:
    return (_up(a.input) is _up(b.input) and a.kind == b.kind and a.epsilon == b.epsilon
            and np.array_equal(a.scale, b.scale) and (a.bias is None) == (b.bias is None)
            and (a.bias is None or np.array_equal(a.bias, b.bias)))


def _side_by_side(weights: list):
    """[K, N] weights joined along N: a file's blocks stay blocks where every part is one (`FileMatrix.join`),
    else floats."""
    if all(isinstance(w, FileMatrix) for w in weights):
        return FileMatrix.join(weights)
    return np.concatenate([np.asarray(w, np.float32) if isinstance(w, FileMatrix) else w for w in weights], axis=1)


def _optional(graph: ir.Graph, name: str, array: np.ndarray | None) -> ir.Value | None:
    return None if array is None else pir.initializer(graph, name, array)


def build_graph(decoder: Decoder, after_layer=lambda: None) -> ir.Model:
    input_ids = ir.val("input_ids", ir.DataType.INT64, ["seq"])
    start = ir.val("start", ir.DataType.INT64, [])
    graph = ir.Graph([input_ids, start], [], nodes=[], name="decoder",
                     opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: pir.DOMAIN_VERSION})
    embed_inputs = [input_ids, start, pir.initializer(graph, "embed.tokens", decoder.embed)]
    if decoder.positions is not None:
        embed_inputs.append(pir.initializer(graph, "embed.positions", decoder.positions))
    embed = ir.node("Embed", embed_inputs, {"scale": decoder.embed_scale} if decoder.embed_scale != 1.0 else {},
                    domain=pir.DOMAIN, name="embed")
    graph.append(embed)
    h = embed.outputs[0]
    h.name = "embed.out"
    outputs = []
    for attention, ffn in zip(decoder.attentions, decoder.ffns):
        i = attention.layer
        p = f"layers.{i}"
        past_key = ir.val(f"past.{i}.key", ir.DataType.FLOAT, [attention.num_kv_heads, "context", attention.head_dim])
        past_value = ir.val(f"past.{i}.value", ir.DataType.FLOAT, [attention.num_kv_heads, "context", attention.head_dim])
        graph.inputs.extend([past_key, past_value])
        a = _norm_node(graph, attention.norm, h, f"{p}.attn_norm")
        lins = (attention.q, attention.k, attention.v)
        wqkv = _side_by_side([lin.weight for lin in lins])
        bqkv = None
        if any(lin.bias is not None for lin in lins):
            bqkv = np.concatenate([lin.bias if lin.bias is not None else np.zeros(lin.weight.shape[1], np.float32) for lin in lins])
        inputs = [a, start, past_key, past_value, pir.initializer(graph, f"{p}.attn.w_qkv", wqkv),
                  _optional(graph, f"{p}.attn.b_qkv", bqkv), pir.initializer(graph, f"{p}.attn.w_o", attention.o.weight),
                  _optional(graph, f"{p}.attn.b_o", attention.o.bias),
                  _optional(graph, f"{p}.attn.inv_freq", None if attention.inv_freq is None else attention.inv_freq.astype(np.float32))]
        scale = attention.scale if attention.scale is not None else float(attention.head_dim) ** -0.5
        attributes = {"layer": i, "num_heads": attention.num_heads, "num_kv_heads": attention.num_kv_heads,
                      "head_dim": attention.head_dim, "scale": scale,
                      **({"softcap": attention.softcap} if attention.softcap else {}),
                      **({"window": attention.window} if attention.window else {})}
        if attention.qk_norm is not None:
            inputs += [pir.initializer(graph, f"{p}.attn.q_norm", attention.qk_norm.q),
                       pir.initializer(graph, f"{p}.attn.k_norm", attention.qk_norm.k)]
            attributes["qk_norm_eps"] = float(attention.qk_norm.epsilon)
        node = ir.node("Attention", inputs, attributes, domain=pir.DOMAIN, num_outputs=3, name=f"{p}.attn")
        graph.append(node)
        node.outputs[0].name, node.outputs[1].name, node.outputs[2].name = f"{p}.attn.out", f"present.{i}.key", f"present.{i}.value"
        # the residual stream entering the layer in the source graph: where the profile may cut it into layers
        node.metadata_props["source.layer_input"] = source_layer_input(attention)
        outputs.extend(node.outputs[1:])
        layer_input = h
        attended = node.outputs[0]
        if attention.post_norm is not None:  # Gemma: the block's output normed inside the residual branch
            attended = _norm_node(graph, attention.post_norm, attended, f"{p}.attn_post_norm")
        add = ir.node("Add", [h, attended], name=f"{p}.attn_residual")
        graph.append(add)
        h = add.outputs[0]
        h.name = f"{p}.attn_residual.out"
        if not ffn.parallel:
            f = _norm_node(graph, ffn.norm, h, f"{p}.ffn_norm")
        elif _same_norm(ffn.norm, attention.norm):  # Falcon: one LayerNorm feeds both blocks
            f = a
        else:  # GPT-NeoX: the FFN's own norm, of the layer's input
            f = _norm_node(graph, ffn.norm, layer_input, f"{p}.ffn_norm")
        gated = ffn.gate is not None
        w_up = _side_by_side([ffn.gate.weight, ffn.up.weight]) if gated else ffn.up.weight
        b_up = None
        if gated and (ffn.gate.bias is not None or ffn.up.bias is not None):
            zeros = np.zeros(ffn.up.weight.shape[1], np.float32)
            b_up = np.concatenate([ffn.gate.bias if ffn.gate.bias is not None else zeros, ffn.up.bias if ffn.up.bias is not None else zeros])
        elif not gated:
            b_up = ffn.up.bias
        node = ir.node("FFN", [f, pir.initializer(graph, f"{p}.ffn.w_up", w_up), _optional(graph, f"{p}.ffn.b_up", b_up),
                               pir.initializer(graph, f"{p}.ffn.w_down", ffn.down.weight),
                               _optional(graph, f"{p}.ffn.b_down", ffn.down.bias)],
                       {"layer": i, "activation": ffn.activation, "gated": int(gated)}, domain=pir.DOMAIN, name=f"{p}.ffn")
        # Where the profiler finds this FFN's input and activation in the source graph.
        node.metadata_props["source.input"] = (ffn.gate or ffn.up).input.name
        node.metadata_props["source.activation"] = ffn.activation_output.name
        graph.append(node)
        node.outputs[0].name = f"{p}.ffn.out"
        ffn_out = node.outputs[0]
        if ffn.post_norm is not None:
            ffn_out = _norm_node(graph, ffn.post_norm, ffn_out, f"{p}.ffn_post_norm")
        add = ir.node("Add", [h, ffn_out], name=f"{p}.ffn_residual")
        graph.append(add)
        h = add.outputs[0]
        h.name = f"{p}.ffn_residual.out"
        after_layer()
    hn = _norm_node(graph, decoder.final_norm, h, "final_norm")
    head_inputs = [hn, pir.initializer(graph, "lm_head.weight", decoder.lm_head.weight)]
    head = ir.node("MatMul", head_inputs, name="lm_head")
    graph.append(head)
    logits = head.outputs[0]
    if decoder.lm_head.bias is not None:
        add = ir.node("Add", [logits, pir.initializer(graph, "lm_head.bias", decoder.lm_head.bias)], name="lm_head.bias_add")
        graph.append(add)
        logits = add.outputs[0]
    if decoder.final_softcap:  # Gemma 2: cap * tanh(logits / cap)
        capped = ir.node("Softcap", [logits], {"cap": decoder.final_softcap}, domain=pir.DOMAIN, name="lm_head.softcap")
        graph.append(capped)
        logits.name = "lm_head.out"
        logits = capped.outputs[0]
    logits.name = "logits"
    graph.outputs.extend([logits, *outputs])
    d_model = decoder.embed.shape[1]
    logits.shape = ir.Shape(["seq", decoder.lm_head.weight.shape[1]])
    for value, past in zip(outputs, graph.inputs[2:]):
        value.shape = past.shape
    for node in graph:  # every activation in the lifted graph is fp32, one row per token
        for value in node.outputs:
            value.dtype = value.dtype or ir.DataType.FLOAT
            value.shape = value.shape or ir.Shape(["seq", d_model])
    return ir.Model(graph, ir_version=10, producer_name="picompile")


def _windows(decoder: Decoder) -> str:
    windowed = [a.layer for a in decoder.attentions if a.window]
    if not windowed:
        return ""
    return f", a sliding window of {decoder.attentions[windowed[0]].window} in layers {windowed}"


SOURCE = "picompile.source"  # the lifted model's `meta` entry: the imported model it was lifted from
# the block IR: picompile's block ops (ops.Embed, Attention, FFN) in place of the exporter's graph, up to select-kernels
BLOCKS = Fact("the block IR", "recognise", lambda model: any(Embed.matches(node) for node in model.graph))


def source_model(lifted: ir.Model) -> ir.Model:
    """The imported (pre-recognise) model `lifted` came from: the profile pass's reference executor runs it."""
    source = lifted.meta.get(SOURCE)
    if source is None:
        raise ValueError("the IR does not carry its source model (run recognise first)")
    return source


@dataclass
class Recognise:
    name = "recognise"
    adds = (BLOCKS,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        decoder = analyse(model, ctx.build.max_context)
        _check_context(decoder, ctx.build.max_context)
        # the concatenated weights are copies: the source pages they were read from need not stay resident
        lifted = build_graph(decoder, after_layer=lambda: pir.release_mapped_pages(model))
        lifted.meta[SOURCE] = model
        for fact in (SourceQuantization, GGUFSource):  # facts about the weights, which the lifted graph keeps
            found = fact.of(model)
            if found is not None:
                found.attach(lifted)
        ctx.log(f"recognised {len(decoder.attentions)} layers: "
                f"{decoder.attentions[0].num_heads} heads ({decoder.attentions[0].num_kv_heads} kv) x {decoder.attentions[0].head_dim}, "
                f"FFN {decoder.ffns[0].activation}{' gated' if decoder.ffns[0].gate is not None else ''} "
                f"{decoder.ffns[0].up.weight.shape[1]}, rope {'yes' if decoder.attentions[0].inv_freq is not None else 'no'}"
                f"{', q/k norm per head' if decoder.attentions[0].qk_norm is not None else ''}"
                f"{', parallel attention and FFN' if decoder.ffns[0].parallel else ''}"
                f"{', norms after attention and the FFN' if decoder.attentions[0].post_norm is not None else ''}"
                f"{f', scores soft-capped at {decoder.attentions[0].softcap:g}' if decoder.attentions[0].softcap else ''}"
                f"{_windows(decoder)}{f', logits soft-capped at {decoder.final_softcap:g}' if decoder.final_softcap else ''}"
                f"{f', embedding scaled by {decoder.embed_scale:g}' if decoder.embed_scale != 1.0 else ''}")
        return PassResult(lifted, modified=True)
