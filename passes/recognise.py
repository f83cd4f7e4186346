"""recognise: lift an exported decoder graph to picompile's block-level ops.

Reads: the imported IR (constants folded, batch 1) from any exporter. Finds, by dataflow from the KV
cache outputs and by patterns around the weights, per layer the attention block (q/k/v/o projections,
heads, RoPE) and the FFN block (ReLU: up(+bias) -> act -> down(+bias); gated: act(gate) * up -> down),
their norms, the token (and learned position) embedding and the output layer.
Adds: a new graph with one `picompile.Embed`, per layer a norm, a `picompile.Attention`, a residual Add,
a norm, a `picompile.FFN` and an Add, then the final norm and the output MatMul. Weights become named
initializers (`layers.3.ffn.w_up`, ...). What it cannot recognise it refuses with a message naming it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from passes.import_onnx import available_memory_bytes
from picompile import ir as pir
from picompile.errors import UserError
from picompile.pipeline import Context
from picompile.targets import format_size

# Ops that move or retype an activation without changing its values.
PASS_THROUGH = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast"}
# Ops whose output is a tensor's shape, not its data: dataflow walks stop there.
SHAPE_OF = {"Shape", "Size"}
ACTIVATIONS = {"Relu": "relu", "Gelu": "gelu"}


@dataclass
class Linear:
    """y = x @ weight (+ bias), weight in [K, N] (ONNX MatMul) layout."""

    input: ir.Value
    weight: np.ndarray
    bias: np.ndarray | None
    output: ir.Value
    matmul: ir.Node


@dataclass
class Norm:
    kind: str  # "layer" or "rms"
    input: ir.Value
    scale: np.ndarray
    bias: np.ndarray | None
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


@dataclass
class FFN:
    norm: Norm
    up: Linear
    down: Linear
    activation: str
    activation_output: ir.Value  # in the source graph: zero exactly where a neuron is inactive
    gate: Linear | None = None
    layer: int = -1


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


# ---------------------------------------------------------------- graph helpers


def _up(value: ir.Value) -> ir.Value:
    """Follow pass-through ops upwards to the value that carries the data."""
    while (node := value.producer()) is not None and node.op_type in PASS_THROUGH and node.inputs:
        value = node.inputs[0]
    return value


def _consumers(value: ir.Value) -> list[ir.Node]:
    """Consumers of a value, looking through pass-through ops."""
    found = []
    for node in value.consumers():
        if node.op_type in PASS_THROUGH:
            found.extend(_consumers(node.outputs[0]))
        else:
            found.append(node)
    return found


def _const_weight(value: ir.Value) -> np.ndarray | None:
    """A constant matrix, or the transpose of one (tied output layers: folding skips large transposes)."""
    array = pir.const_array(value)
    if array is not None:
        return array
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and list(pir.attr(node, "perm", [1, 0])) == [1, 0]:
        source = pir.const_array(node.inputs[0])
        return None if source is None or source.ndim != 2 else source.T
    return None


def _match_linear(node: ir.Node) -> Linear | None:
    if node.op_type == "MatMul":
        weight = _const_weight(node.inputs[1])
        if weight is None or weight.ndim != 2 or pir.const_array(node.inputs[0]) is not None:
            return None
        bias = None
    elif node.op_type == "Gemm":
        weight = _const_weight(node.inputs[1])
        if weight is None or pir.attr(node, "transA", 0) or pir.attr(node, "alpha", 1.0) != 1.0:
            return None
        if pir.attr(node, "transB", 0):
            weight = weight.T
        bias = pir.const_array(node.inputs[2]) if len(node.inputs) > 2 else None
        if bias is not None:
            bias = np.broadcast_to(bias * pir.attr(node, "beta", 1.0), (weight.shape[1],))
    else:
        return None
    output = node.outputs[0]
    users = list(output.uses())
    if bias is None and len(users) == 1 and users[0][0].op_type == "Add":
        add = users[0][0]
        other = add.inputs[1 - users[0][1]]
        candidate = pir.const_array(other)
        if candidate is not None and candidate.size == weight.shape[1]:
            bias, output = candidate.reshape(-1), add.outputs[0]
    return Linear(node.inputs[0], np.asarray(weight, np.float32),
                  None if bias is None else np.asarray(bias, np.float32), output, node)


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


# ---------------------------------------------------------------- recognition


def _find_ffns(graph: ir.Graph, linear_by_output: dict[int, Linear]) -> list[FFN]:
    def linear_of(value: ir.Value) -> Linear | None:
        return linear_by_output.get(id(_up(value)))

    ffns = []
    for node in graph:
        if node.op_type not in ACTIVATIONS and node.op_type != "Sigmoid":
            continue
        if node.op_type == "Sigmoid":  # SiLU exported as x * sigmoid(x)
            muls = [c for c in node.outputs[0].consumers() if c.op_type == "Mul" and node.inputs[0] in c.inputs]
            if not muls:
                continue
            activation, act_out = "silu", muls[0].outputs[0]
        else:
            activation, act_out = ACTIVATIONS[node.op_type], node.outputs[0]
        first = linear_of(node.inputs[0])
        if first is None:
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


def _kv_shape(graph: ir.Graph, layer: int) -> tuple[int, int]:
    for value in graph.inputs:
        if value.name == f"past_key_values.{layer}.key":
            shape = value.shape
            if shape is not None and len(shape) == 4 and isinstance(shape[1], int) and isinstance(shape[3], int):
                return shape[1], shape[3]
    raise UserError(f"input past_key_values.{layer}.key is missing or has no static [batch, kv_heads, past, head_dim] shape")


def _inv_freq(nodes: set[ir.Node], head_dim: int) -> np.ndarray | None:
    """RoPE: find the Cos op among the nodes feeding the key cache; its frequencies are the constant of
    head_dim/2 values upstream of it (the `inv_freq` buffer of HF models, any scaling already applied)."""
    cos = [n for n in nodes if n.op_type == "Cos"]
    if not cos:
        return None
    found, _ = _upstream(cos[0].inputs[0], lambda v: a if (a := pir.const_array(v)) is not None and a.size == head_dim // 2 else None)
    if len(found) != 1:
        raise UserError("attention uses RoPE but its frequency table (inv_freq) could not be found")
    return found[0].reshape(-1).astype(np.float64)


def _find_attentions(graph: ir.Graph, linears: list[Linear], ffn_linears: set[int]) -> list[Attention]:
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

    attentions = []
    for layer, (present_key, present_value) in sorted(_present_outputs(graph).items()):
        where = f"layer {layer}"
        key_hits, key_nodes = _upstream(present_key, stop)
        value_hits, _ = _upstream(present_value, stop)
        key_hits = [h for h in key_hits if h is not False]
        value_hits = [h for h in value_hits if h is not False]
        if len(key_hits) != 1 or len(value_hits) != 1:
            raise UserError(f"{where}: cannot trace present.{layer}.key/value back to one key and one value projection")
        k, v = key_hits[0], value_hits[0]
        q_candidates = [
            lin for lin in linears
            if _up(lin.input) is _up(k.input) and lin is not k and lin is not v and id(lin.matmul) not in ffn_linears
        ]
        if len(q_candidates) != 1:
            raise UserError(f"{where}: expected one query projection beside the key projection, found {len(q_candidates)}")
        q = q_candidates[0]
        o = _downstream_linear(present_value, linear_by_node)
        if o is None:
            raise UserError(f"{where}: no output projection found after the attention")
        norm = _match_norm(k.input)
        if norm is None:
            raise UserError(f"{where}: the attention input is not a recognised LayerNorm/RMSNorm (post-norm models are not supported yet)")
        num_kv_heads, head_dim = _kv_shape(graph, layer)
        if q.weight.shape[1] % head_dim or k.weight.shape[1] != num_kv_heads * head_dim:
            raise UserError(f"{where}: projection widths do not match {num_kv_heads} kv heads of size {head_dim}")
        attentions.append(Attention(
            layer, norm, q, k, v, o, q.weight.shape[1] // head_dim, num_kv_heads, head_dim,
            _inv_freq(key_nodes, head_dim),
        ))
    return attentions


def _find_embeddings(graph: ir.Graph) -> tuple[ir.Node, ir.Node | None]:
    input_ids = next(v for v in graph.inputs if v.name == "input_ids")
    token, position = None, None
    for node in graph:
        if node.op_type != "Gather" or (table := pir.const_array(node.inputs[0])) is None or table.ndim != 2:
            continue
        if _up(node.inputs[1]) is input_ids:
            token = node
        else:
            position = node
    if token is None:
        raise UserError("no token embedding found (a Gather of a constant table by input_ids)")
    return token, position


def _position_offset(model: ir.Model, gather: ir.Node) -> int:
    """Learned positions (OPT) index their table at position + offset; find the offset by running the
    graph's index computation in onnxruntime on a 3-token prompt after one cached token."""
    import onnxruntime as ort

    index = gather.inputs[1]
    probe = _subgraph_proto(model, index.name).SerializeToString()
    try:
        session = ort.InferenceSession(probe, providers=["CPUExecutionProvider"])
        positions = np.asarray(session.run([index.name], _probe_feeds(session.get_inputs()))[0]).reshape(-1)
    except Exception as error:  # onnxruntime raises its own types for invalid graphs and mistyped inputs
        raise UserError(f"onnxruntime cannot run the position index computation of {gather.name or 'Gather'} "
                        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    if positions.size != 3 or not np.array_equal(np.diff(positions), [1, 1]):
        raise UserError(f"learned position embedding indexed in an unrecognised way ({positions.tolist()})")
    return int(positions[0]) - 1


def _probe_feeds(inputs) -> dict[str, np.ndarray]:
    """A 3-token prompt after one cached token."""
    feeds = {}
    for value in inputs:
        if value.name == "input_ids":
            feeds[value.name] = np.zeros((1, 3), np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, 4), np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(1, 4, dtype=np.int64)[None]
        else:
            shape = [1 if not isinstance(d, int) else d for d in value.shape]
            feeds[value.name] = np.zeros(shape, np.float32)
    return feeds


def _subgraph_proto(model: ir.Model, output: str):
    """An ONNX proto computing only `output`: the nodes it depends on and their (in-memory) constants."""
    import onnx

    proto = ir.to_proto(model)
    producers = {out: node for node in proto.graph.node for out in node.output}
    needed, stack = set(), [output]
    while stack:
        name = stack.pop()
        node = producers.get(name)
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(node.input)
    nodes = [node for node in proto.graph.node if id(node) in needed]
    used = {name for node in nodes for name in node.input}
    initializers = [onnx.numpy_helper.from_array(model.graph.initializers[name].const_value.numpy(), name)
                    for name in used if name in model.graph.initializers]
    graph = onnx.helper.make_graph(nodes, "probe", [i for i in proto.graph.input if i.name in used],
                                   [onnx.helper.make_empty_tensor_value_info(output)], initializers)
    return onnx.helper.make_model(graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)


def analyse(model: ir.Model) -> Decoder:
    graph = model.graph
    linears = [lin for node in graph if (lin := _match_linear(node)) is not None]
    linear_by_output = {id(lin.output): lin for lin in linears}
    ffns = _find_ffns(graph, linear_by_output)
    ffn_linears = {id(l.matmul) for f in ffns for l in (f.up, f.down, f.gate) if l is not None}
    attentions = _find_attentions(graph, linears, ffn_linears)
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
    logits = next(v for v in graph.outputs if v.name == "logits")
    lm_head = linear_by_output.get(id(_up(logits)))
    if lm_head is None:
        raise UserError("the logits are not produced by a linear output layer")
    final_norm = _match_norm(lm_head.input)
    if final_norm is None:
        raise UserError("no final norm before the output layer")
    token, position = _find_embeddings(graph)
    positions = None
    if position is not None:
        offset = _position_offset(model, position)
        positions = pir.const_array(position.inputs[0])[offset:].astype(np.float32)
    decoder = Decoder(pir.const_array(token.inputs[0]).astype(np.float32), positions, attentions, ffns, final_norm, lm_head)
    _check_shapes(decoder)
    return decoder


def _check_context(decoder: Decoder, max_context: int) -> None:
    """--max-context must fit the model's learned positions and the machine's memory (KV cache + logits)."""
    if decoder.positions is not None and decoder.positions.shape[0] < max_context:
        raise UserError(f"--max-context {max_context} exceeds the model's {decoder.positions.shape[0]} learned positions")
    cache_bytes = sum(2 * a.num_kv_heads * a.head_dim for a in decoder.attentions) * max_context * 4
    logits_bytes = max_context * decoder.lm_head.weight.shape[1] * 4
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
                    "(Relu, Gelu, SiLU as x*Sigmoid(x)); no build flag changes this")
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
    for ffn in decoder.ffns:
        where = f"layer {ffn.layer} FFN"
        expect(ffn.up, f"{where} up projection", d_model)
        width = ffn.up.weight.shape[1]
        if ffn.gate is not None:
            expect(ffn.gate, f"{where} gate projection", d_model, width)
        expect(ffn.down, f"{where} down projection", width, d_model)
        expect_norm(ffn.norm, where)
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


def _optional(graph: ir.Graph, name: str, array: np.ndarray | None) -> ir.Value | None:
    return None if array is None else pir.initializer(graph, name, array)


def build_graph(decoder: Decoder) -> ir.Model:
    input_ids = ir.val("input_ids", ir.DataType.INT64, ["seq"])
    start = ir.val("start", ir.DataType.INT64, [])
    graph = ir.Graph([input_ids, start], [], nodes=[], name="decoder",
                     opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: pir.DOMAIN_VERSION})
    embed_inputs = [input_ids, start, pir.initializer(graph, "embed.tokens", decoder.embed)]
    if decoder.positions is not None:
        embed_inputs.append(pir.initializer(graph, "embed.positions", decoder.positions))
    embed = ir.node("Embed", embed_inputs, domain=pir.DOMAIN, name="embed")
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
        wqkv = np.concatenate([lin.weight for lin in lins], axis=1)
        bqkv = None
        if any(lin.bias is not None for lin in lins):
            bqkv = np.concatenate([lin.bias if lin.bias is not None else np.zeros(lin.weight.shape[1], np.float32) for lin in lins])
        inputs = [a, start, past_key, past_value, pir.initializer(graph, f"{p}.attn.w_qkv", wqkv),
                  _optional(graph, f"{p}.attn.b_qkv", bqkv), pir.initializer(graph, f"{p}.attn.w_o", attention.o.weight),
                  _optional(graph, f"{p}.attn.b_o", attention.o.bias),
                  _optional(graph, f"{p}.attn.inv_freq", None if attention.inv_freq is None else attention.inv_freq.astype(np.float32))]
        node = ir.node("Attention", inputs, {
            "layer": i, "num_heads": attention.num_heads, "num_kv_heads": attention.num_kv_heads,
            "head_dim": attention.head_dim, "scale": float(attention.head_dim) ** -0.5,
        }, domain=pir.DOMAIN, num_outputs=3, name=f"{p}.attn")
        graph.append(node)
        node.outputs[0].name, node.outputs[1].name, node.outputs[2].name = f"{p}.attn.out", f"present.{i}.key", f"present.{i}.value"
        outputs.extend(node.outputs[1:])
        add = ir.node("Add", [h, node.outputs[0]], name=f"{p}.attn_residual")
        graph.append(add)
        h = add.outputs[0]
        h.name = f"{p}.attn_residual.out"
        f = _norm_node(graph, ffn.norm, h, f"{p}.ffn_norm")
        gated = ffn.gate is not None
        w_up = np.concatenate([ffn.gate.weight, ffn.up.weight], axis=1) if gated else ffn.up.weight
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
        add = ir.node("Add", [h, node.outputs[0]], name=f"{p}.ffn_residual")
        graph.append(add)
        h = add.outputs[0]
        h.name = f"{p}.ffn_residual.out"
    hn = _norm_node(graph, decoder.final_norm, h, "final_norm")
    head_inputs = [hn, pir.initializer(graph, "lm_head.weight", decoder.lm_head.weight)]
    head = ir.node("MatMul", head_inputs, name="lm_head")
    graph.append(head)
    logits = head.outputs[0]
    if decoder.lm_head.bias is not None:
        add = ir.node("Add", [logits, pir.initializer(graph, "lm_head.bias", decoder.lm_head.bias)], name="lm_head.bias_add")
        graph.append(add)
        logits = add.outputs[0]
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


@dataclass
class Recognise:
    name = "recognise"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        decoder = analyse(model)
        _check_context(decoder, ctx.options.max_context)
        lifted = build_graph(decoder)
        ctx.source = model  # the profile pass runs the source graph as its reference executor
        ctx.log(f"recognised {len(decoder.attentions)} layers: "
                f"{decoder.attentions[0].num_heads} heads ({decoder.attentions[0].num_kv_heads} kv) x {decoder.attentions[0].head_dim}, "
                f"FFN {decoder.ffns[0].activation}{' gated' if decoder.ffns[0].gate is not None else ''} "
                f"{decoder.ffns[0].up.weight.shape[1]}, rope {'yes' if decoder.attentions[0].inv_freq is not None else 'no'}")
        return PassResult(lifted, modified=True)
