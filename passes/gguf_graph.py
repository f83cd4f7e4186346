"""The ONNX decoder of a GGUF file (the GGUF front end's graph; `passes.import_gguf` reads and checks the file
and caches what this writes).

Standard ONNX ops computed as transformers' LLaMA / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 exports compute them:
RMSNorm as x * 1/sqrt(mean(x^2) + eps) * w (Qwen3's and Gemma 3's q / k norms too, over each head's values before
RoPE), rotate-half RoPE from an `inv_freq` constant and `position_ids` (sliding-window layers with their own base and
scaling where the file says), a causal mask with `attention_mask` (and, for sliding-window layers, a second one that
also closes the keys W or more positions back), grouped-query attention by repeating the cache's kv heads, scores
scaled then soft-capped (cap * tanh(s / cap)) where the architecture does, SwiGLU as gate * sigmoid(gate) * up and
GeGLU with GELU's tanh form written out; Gemma's embedding times sqrt(d_model), its norms after attention and the FFN
inside the residual branch, its soft-capped logits; the KV cache in optimum's convention. Weights: F32 as stored,
F16 / BF16 as stored behind a Cast to float32, a block type some picompile format holds exactly
(`passes.formats.ggml`) as a `FileTensor` over the file's blocks (a float tensor to every pass, computed when read;
select-kernels packs the blocks themselves), any other dequantized to float32 when read (`onnx_ir.LazyTensor`: one
tensor at a time). What differs between architectures is read from their `passes.architectures.Architecture`: q / k
rows stored permuted (LLaMA's) are put back in rotate-half order (`rope_rows`), a fused tensor (Phi-3's attn_qkv,
its gate/up ffn_up) is taken apart into the matrices it stacks, each its range of the file's rows
(`FileMatrix.take`: whole rows, blocks as stored; a float tensor's rows likewise), so that recognise sees LLaMA's
graph; the norm and the FFN's activation come from its tables here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .architectures import Activation, Architecture, EmbeddingScale, Norm, NormPlacement, QKRows
from .file_blocks import FileMatrix, FileRows, FileTensor
from .formats import ggml

OPSET = 18
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Hyper:
    """The architecture and its numbers, from the metadata."""

    architecture: Architecture
    layers: int
    d_model: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_base: float
    rope_scale: float  # linear RoPE scaling: positions divided by it
    attn_softcap: float = 0.0  # the attention scores' soft-cap, cap * tanh(s / cap) (0: none)
    final_softcap: float = 0.0  # the logits' soft-cap (0: none)
    window: int = 0  # sliding-window attention's window, in positions (0: none)
    sliding: tuple[bool, ...] = ()  # per layer, whether it attends through the window (none listed: no layer)
    rope_base_swa: float | None = None  # the sliding layers' RoPE base (None: rope_base)
    rope_scale_swa: float | None = None  # the sliding layers' linear RoPE scaling (None: rope_scale)

    def slides(self, layer: int) -> bool:
        return self.window > 0 and layer < len(self.sliding) and self.sliding[layer]

    def rope_of(self, layer: int) -> tuple[float, float]:
        """(RoPE base, linear scaling) of a layer: a sliding layer's own where the file gives them."""
        if self.slides(layer):
            return (self.rope_base if self.rope_base_swa is None else self.rope_base_swa,
                    self.rope_scale if self.rope_scale_swa is None else self.rope_scale_swa)
        return self.rope_base, self.rope_scale


def _float_array(tensor) -> np.ndarray:
    """A tensor's values in numpy order: F32 / F16 as stored (memory-mapped views), BF16 as ml_dtypes'
    bfloat16, anything quantized dequantized to float32 (exactly `gguf.quants.dequantize`)."""
    import gguf
    import ml_dtypes

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type.name
    if kind in ("F32", "F16"):
        return tensor.data.reshape(shape)
    if kind == "BF16":
        return tensor.data.view(ml_dtypes.bfloat16).reshape(shape)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def kept_in_blocks(tensor) -> bool:
    """Whether a tensor of the file stays in its own blocks (a block type a picompile format holds exactly)."""
    found = ggml.GGML_TYPES.get(tensor.tensor_type.name)
    return found is not None and found.kept_in_blocks


def file_matrix(tensor, transposed: bool = True) -> FileMatrix:
    """A quantized tensor of the file as a `FileMatrix` over its memory-mapped blocks: the [K, N] a linear
    computes with (`transposed`), or the file's [R, C] (a table whose rows are gathered)."""
    N, K = (int(d) for d in reversed(tensor.shape.tolist()))
    raw = np.asarray(tensor.data).reshape(N, -1)
    return FileMatrix((FileRows(tensor.tensor_type.name, raw, K),), transposed)


def rope_rows(heads: int, head_dim: int) -> np.ndarray:
    """The row order that undoes llama.cpp's convert permutation of attn_q / attn_k: row h*d + p*d/2 + i of
    transformers' layout (rotate-half pairs i, i + d/2) is row h*d + 2i + p of the file (adjacent pairs)."""
    index = np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2)
    return index.transpose(0, 2, 1).reshape(-1)


# ---------------------------------------------------------------- the ONNX graph


class _Graph:
    """A small builder over onnx_ir for the decoder graph."""

    def __init__(self):
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []
        self.count = 0

    def const(self, name: str, tensor) -> ir.Value:
        if isinstance(tensor, np.ndarray):
            tensor = ir.tensor(tensor, name=name)
        value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape))
        self.initializers.append(value)
        return value

    def lazy(self, name: str, make, dtype: ir.DataType, shape) -> ir.Value:
        """An initializer computed when it is saved (dequantized matrices never all held at once)."""
        return self.const(name, ir.LazyTensor(lambda: ir.tensor(make(), name=name), dtype, ir.Shape(list(shape)),
                                              name=name))

    def op(self, op_type: str, inputs, attributes=None, domain: str = "", name: str | None = None,
           outputs: int = 1):
        self.count += 1
        node = ir.node(op_type, list(inputs), attributes or {}, domain=domain, num_outputs=outputs,
                       name=name or f"{op_type}_{self.count}")
        self.nodes.append(node)
        for index, value in enumerate(node.outputs):
            value.name = f"{node.name}/out{index}" if outputs > 1 else f"{node.name}/out"
        return node.outputs[0] if outputs == 1 else node.outputs

    def scalar(self, name: str, value, dtype=np.float32) -> ir.Value:
        return self.const(name, np.array(value, dtype))

    def ints(self, name: str, values) -> ir.Value:
        return self.const(name, np.array(values, np.int64))


HALF = {"F16": ir.DataType.FLOAT16, "BF16": ir.DataType.BFLOAT16}


def _weight(g: _Graph, name: str, tensor, rows: np.ndarray | None = None) -> ir.Value:
    """A linear's (not Q8_0 / Q4_0) weight as an ONNX value [K, N], made when the model is saved (one matrix
    held at a time): float32 (F32 as stored, anything quantized dequantized), or a half matrix as stored,
    behind a Cast to float32."""
    kind = tensor.tensor_type.name
    N, K = (int(d) for d in reversed(tensor.shape.tolist()))
    N = N if rows is None else len(rows)

    def make():
        array = _float_array(tensor)
        array = array if rows is None else array[rows]
        return np.ascontiguousarray(array.T if kind in HALF else array.T.astype(np.float32))

    stored = g.lazy(name, make, HALF.get(kind, ir.DataType.FLOAT), (K, N))
    if kind not in HALF:
        return stored
    return g.op("Cast", [stored], {"to": ir.DataType.FLOAT}, name=f"{name}/fp32")


def _linear(g: _Graph, x: ir.Value, name: str, tensor, bias=None, rows: np.ndarray | None = None,
            bias_rows: np.ndarray | None = None) -> ir.Value:
    """x @ W^T (+ b) for W [N, K], the file's `rows` of `tensor` (None: all, as stored): MatMul over [K, N], the
    file's blocks where they are kept (`FileTensor`; whole rows taken, blocks as stored), else floats. `bias_rows`:
    the bias's (its own tensor's)."""
    if kept_in_blocks(tensor):
        matrix = file_matrix(tensor)
        weight = g.const(name, FileTensor(matrix if rows is None else matrix.take(rows), name=name))
    else:
        weight = _weight(g, name, tensor, rows)
    y = g.op("MatMul", [x, weight], name=name)
    if bias is not None:
        b = _float_array(bias).astype(np.float32)
        b = b if bias_rows is None else b[bias_rows]
        y = g.op("Add", [y, g.const(f"{name}.bias", np.ascontiguousarray(b))], name=f"{name}/bias")
    return y


def _rms_norm(g: _Graph, x: ir.Value, tensor, eps: float, name: str) -> ir.Value:
    two, epsilon, axes = g.scalar(f"{name}.two", 2.0), g.scalar(f"{name}.eps", eps), g.ints(f"{name}.axes", [-1])
    square = g.op("Pow", [x, two])
    mean = g.op("ReduceMean", [square, axes], {"keepdims": 1})
    root = g.op("Sqrt", [g.op("Add", [mean, epsilon])])
    normed = g.op("Mul", [x, g.op("Reciprocal", [root])])
    weight = g.const(f"{name}.weight", np.ascontiguousarray(_float_array(tensor).astype(np.float32)))
    return g.op("Mul", [normed, weight], name=name)


def _silu(g: _Graph, x: ir.Value) -> ir.Value:
    return g.op("Mul", [x, g.op("Sigmoid", [x])])


def _gelu_tanh(g: _Graph, x: ir.Value) -> ir.Value:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): transformers' gelu_pytorch_tanh, written out (opset 18 has
    no Gelu op)."""
    n = g.count
    cube = g.op("Mul", [g.op("Mul", [x, x]), x])
    inner = g.op("Add", [x, g.op("Mul", [cube, g.scalar(f"gelu{n}.c3", 0.044715)])])
    t = g.op("Tanh", [g.op("Mul", [inner, g.scalar(f"gelu{n}.c1", np.sqrt(2.0 / np.pi))])])
    half = g.op("Mul", [x, g.scalar(f"gelu{n}.half", 0.5)])
    return g.op("Mul", [half, g.op("Add", [t, g.scalar(f"gelu{n}.one", 1.0)])])


def _softcap(g: _Graph, x: ir.Value, cap: float, name: str) -> ir.Value:
    """cap * tanh(x / cap), as transformers' Gemma 2 computes it (divide, tanh, multiply)."""
    c = g.scalar(f"{name}.cap", cap)
    return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, c])]), c], name=name)


NORMS = {Norm.RMS: _rms_norm}
ACTIVATIONS = {Activation.SILU: _silu, Activation.GELU_TANH: _gelu_tanh}


def _heads(g: _Graph, x: ir.Value, heads: int, head_dim: int, shape_name: str, norm=None, eps: float = 0.0,
           norm_name: str = "") -> ir.Value:
    """[B, S, heads*d] -> [B, heads, S, d]; with `norm` (the file's [d] weight) each head's d values RMS-normed
    first, as transformers' Qwen3 does before the transpose (q_norm(q_proj(x).view(...)).transpose(1, 2))."""
    shaped = g.op("Reshape", [x, g.ints(shape_name, [0, 0, heads, head_dim])])
    if norm is not None:
        shaped = _rms_norm(g, shaped, norm, eps, norm_name)
    return g.op("Transpose", [shaped], {"perm": [0, 2, 1, 3]})


def _rotate(g: _Graph, x: ir.Value, cos: ir.Value, sin: ir.Value, half: tuple[ir.Value, ...]) -> ir.Value:
    """x * cos + rotate_half(x) * sin (transformers' RoPE)."""
    zero, mid, end, axis = half
    x1 = g.op("Slice", [x, zero, mid, axis])
    x2 = g.op("Slice", [x, mid, end, axis])
    rotated = g.op("Concat", [g.op("Neg", [x2]), x1], {"axis": -1})
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])


def build_graph(h: Hyper, found: dict, vocab: int) -> ir.Model:
    """The ONNX decoder of a GGUF file of a registered architecture (see the module doc)."""
    arch = h.architecture
    norm, activation = NORMS[arch.norm], ACTIVATIONS[arch.activation]
    post_norms = arch.norm_placement is NormPlacement.SANDWICH  # norms after attention and the FFN too
    g = _Graph()
    batch, seq, past, total = "batch", "sequence", "past_sequence", "total_sequence"
    input_ids = ir.val("input_ids", ir.DataType.INT64, [batch, seq])
    attention_mask = ir.val("attention_mask", ir.DataType.INT64, [batch, total])
    position_ids = ir.val("position_ids", ir.DataType.INT64, [batch, seq])
    inputs, outputs = [input_ids, attention_mask, position_ids], []
    pasts = []
    for i in range(h.layers):
        key = ir.val(f"past_key_values.{i}.key", ir.DataType.FLOAT, [batch, h.kv_heads, past, h.head_dim])
        value = ir.val(f"past_key_values.{i}.value", ir.DataType.FLOAT, [batch, h.kv_heads, past, h.head_dim])
        inputs.extend([key, value])
        pasts.append((key, value))

    # token embedding: floats (a Gather reads them), half tables behind a Cast
    embed = found["token_embd.weight"]
    if embed.tensor_type.name in ("F16", "BF16"):
        table = g.op("Cast", [g.const("token_embd.weight", _float_array(embed))], {"to": ir.DataType.FLOAT},
                     name="token_embd.weight/fp32")
    elif embed.tensor_type.name == "F32":
        table = g.const("token_embd.weight", _float_array(embed))
    elif kept_in_blocks(embed):
        table = g.const("token_embd.weight", FileTensor(file_matrix(embed, transposed=False), name="token_embd.weight"))
    else:
        table = g.lazy("token_embd.weight", lambda: _float_array(embed).astype(np.float32), ir.DataType.FLOAT,
                       (vocab, h.d_model))
    x = g.op("Gather", [table, input_ids], {"axis": 0}, name="embed")
    if arch.embedding_scale is EmbeddingScale.SQRT_D_MODEL:  # transformers: sqrt(hidden_size) as a float32 tensor
        x = g.op("Mul", [x, g.scalar("embed.scale", np.float32(np.sqrt(h.d_model)))], name="embed.scaled")

    # RoPE tables: inv_freq (llama3's rope_freqs divide it, linear scaling too) times the positions, one pair of
    # tables per RoPE base (sliding-window layers may have their own)
    positions = g.op("Unsqueeze", [g.op("Cast", [position_ids], {"to": ir.DataType.FLOAT}), g.ints("rope.axis", [-1])])
    head_axis = g.ints("rope.head_axis", [1])
    tables: dict[tuple[float, float], tuple[ir.Value, ir.Value]] = {}

    def rotation(base: float, scale: float) -> tuple[ir.Value, ir.Value]:
        if (base, scale) not in tables:
            p = "rope" if not tables else f"rope{len(tables)}"
            inv_freq = 1.0 / (base ** (np.arange(0, h.head_dim, 2, dtype=np.float64) / h.head_dim))
            if "rope_freqs.weight" in found:
                inv_freq = inv_freq / _float_array(found["rope_freqs.weight"]).astype(np.float64)
            inv_freq = (inv_freq / scale).astype(np.float32)
            freqs = g.op("Mul", [positions, g.const(f"{p}.inv_freq", inv_freq)])
            emb = g.op("Concat", [freqs, freqs], {"axis": -1})
            tables[base, scale] = (g.op("Unsqueeze", [g.op("Cos", [emb]), head_axis], name=f"{p}.cos"),
                            g.op("Unsqueeze", [g.op("Sin", [emb]), head_axis], name=f"{p}.sin"))
        return tables[base, scale]

    half = (g.ints("rope.zero", [0]), g.ints("rope.mid", [h.head_dim // 2]), g.ints("rope.end", [h.head_dim]),
            g.ints("rope.last", [-1]))

    # causal mask with the attention mask: [B, 1, S, P + S], 0 where a query may attend, else the float minimum
    seq_len = g.op("Shape", [input_ids], {"start": 1, "end": 2})
    past_len = g.op("Shape", [pasts[0][0]], {"start": 2, "end": 3})
    total_len = g.op("Add", [past_len, seq_len])
    scalar = lambda v: g.op("Squeeze", [v, g.ints(f"mask.squeeze{g.count}", [0])])  # noqa: E731
    one = g.const("mask.one", np.array(1, np.int64))
    key_count = scalar(total_len)
    keys = g.op("Range", [g.const("mask.zero", np.array(0, np.int64)), key_count, one])
    queries = g.op("Range", [scalar(past_len), key_count, one])
    key_rows = g.op("Unsqueeze", [keys, g.ints("mask.rows", [0])])
    query_cols = g.op("Unsqueeze", [queries, g.ints("mask.cols", [1])])
    causal = g.op("LessOrEqual", [key_rows, query_cols])
    padded = g.op("Unsqueeze", [g.op("Cast", [attention_mask], {"to": ir.DataType.BOOL}), g.ints("mask.axes", [1, 2])])
    allowed = g.op("And", [causal, padded])
    mask = g.op("Where", [allowed, g.scalar("mask.open", 0.0),
                          g.scalar("mask.closed", np.finfo(np.float32).min)], name="mask")
    sliding_mask = None
    if any(h.slides(i) for i in range(h.layers)):  # ... and the keys the window still holds: key > query - W
        near = g.op("Greater", [key_rows, g.op("Sub", [query_cols, g.const("mask.window", np.array(h.window, np.int64))])])
        sliding_mask = g.op("Where", [g.op("And", [allowed, near]), g.scalar("mask.swa_open", 0.0),
                                      g.scalar("mask.swa_closed", np.finfo(np.float32).min)], name="mask.swa")

    scale = g.scalar("attn.scale", arch.query_scale.value(h))
    groups = h.heads // h.kv_heads
    permute = arch.qk_rows is QKRows.PERMUTED
    order = {"attn_q": rope_rows(h.heads, h.head_dim) if permute else None,  # a matrix's rows, in the graph's order
             "attn_k": rope_rows(h.kv_heads, h.head_dim) if permute else None}
    held = arch.held(h, vocab)  # the block's matrices a fused tensor holds, and its rows that are theirs

    def linear(x: ir.Value, p: str, name: str, bias: bool = False) -> ir.Value:
        """Block `p`'s linear `name` (attn_q, ...): its own tensor, or its rows of the fused one that holds it."""
        rows, tensor = order.get(name), found.get(f"{p}{name}.weight")
        if f"{name}.weight" in held:
            fused, span = held[f"{name}.weight"]
            tensor, rows = found[p + fused], np.arange(span.start, span.stop) if rows is None else span.start + rows
        return _linear(g, x, p + name, tensor, found.get(f"{p}{name}.bias") if bias else None, rows, order.get(name))

    for i in range(h.layers):
        p = f"blk.{i}."
        get = lambda name: found.get(p + name)  # noqa: E731
        a = norm(g, x, get("attn_norm.weight"), h.eps, p + "attn_norm")
        q = linear(a, p, "attn_q", bias=True)
        k = linear(a, p, "attn_k", bias=True)
        v = linear(a, p, "attn_v", bias=True)
        cos, sin = rotation(*h.rope_of(i))
        # an RMSNorm over each head's query and key, before RoPE, where the architecture has one
        q_norm, k_norm = (get("attn_q_norm.weight"), get("attn_k_norm.weight")) if arch.qk_norm else (None, None)
        q = _rotate(g, _heads(g, q, h.heads, h.head_dim, p + "q_shape", q_norm, h.eps, p + "attn_q_norm"),
                    cos, sin, half)
        k = _rotate(g, _heads(g, k, h.kv_heads, h.head_dim, p + "k_shape", k_norm, h.eps, p + "attn_k_norm"),
                    cos, sin, half)
        slides = h.slides(i)
        v = _heads(g, v, h.kv_heads, h.head_dim, p + "v_shape")
        present_key = g.op("Concat", [pasts[i][0], k], {"axis": 2}, name=f"present.{i}.key")
        present_value = g.op("Concat", [pasts[i][1], v], {"axis": 2}, name=f"present.{i}.value")
        present_key.name, present_value.name = f"present.{i}.key", f"present.{i}.value"
        present_key.dtype = present_value.dtype = ir.DataType.FLOAT
        present_key.shape = ir.Shape([batch, h.kv_heads, total, h.head_dim])
        present_value.shape = ir.Shape([batch, h.kv_heads, total, h.head_dim])
        outputs.extend([present_key, present_value])
        if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
            repeats = g.ints(p + "kv_repeats", [1, 1, groups, 1, 1])
            merged = g.ints(p + "kv_shape", [0, h.heads, -1, h.head_dim])

            def expand(t):  # [B, kv, T, d] -> [B, kv, groups, T, d] -> [B, heads, T, d]
                unsqueezed = g.op("Unsqueeze", [t, g.ints(f"{p}kv_axis{g.count}", [2])])
                return g.op("Reshape", [g.op("Tile", [unsqueezed, repeats]), merged])

            keys_all, values_all = expand(present_key), expand(present_value)
        else:
            keys_all, values_all = present_key, present_value
        scores = g.op("MatMul", [q, g.op("Transpose", [keys_all], {"perm": [0, 1, 3, 2]})], name=p + "scores")
        scores = g.op("Mul", [scores, scale])
        if h.attn_softcap:
            scores = _softcap(g, scores, h.attn_softcap, p + "softcap")
        weights = g.op("Softmax", [g.op("Add", [scores, sliding_mask if slides else mask])], {"axis": -1})
        context = g.op("MatMul", [weights, values_all])
        context = g.op("Reshape", [g.op("Transpose", [context], {"perm": [0, 2, 1, 3]}),
                                   g.ints(p + "o_shape", [0, 0, h.heads * h.head_dim])])
        attended = linear(context, p, "attn_output")
        if post_norms:
            attended = norm(g, attended, get("post_attention_norm.weight"), h.eps, p + "post_attention_norm")
        x = g.op("Add", [x, attended], name=p + "attn_residual")
        f = norm(g, x, get("ffn_norm.weight"), h.eps, p + "ffn_norm")
        gate = activation(g, linear(f, p, "ffn_gate"))
        up = linear(f, p, "ffn_up")
        down = linear(g.op("Mul", [gate, up]), p, "ffn_down")
        if post_norms:
            down = norm(g, down, get("post_ffw_norm.weight"), h.eps, p + "post_ffw_norm")
        x = g.op("Add", [x, down], name=p + "ffn_residual")

    x = norm(g, x, found["output_norm.weight"], h.eps, "output_norm")
    if "output.weight" in found:
        logits = _linear(g, x, "output", found["output.weight"])
    else:  # tied: the embedding table, transposed
        logits = g.op("MatMul", [x, g.op("Transpose", [table], {"perm": [1, 0]})], name="output")
    if h.final_softcap:
        logits = _softcap(g, logits, h.final_softcap, "output.softcap")
    logits.name, logits.dtype, logits.shape = "logits", ir.DataType.FLOAT, ir.Shape([batch, seq, vocab])
    graph = ir.Graph(inputs, [logits, *outputs], nodes=g.nodes, initializers=g.initializers, name="gguf",
                     opset_imports={"": OPSET, "com.microsoft": 1})
    return ir.Model(graph, ir_version=10, producer_name="picompile-gguf")
