"""What the kernels compute, written once for every device: TE compute definitions and the TIR math they share.

`cpu.py`, `neuron.py` and `cuda.py` schedule these definitions for their device (or, for kernels whose loop
structure is the schedule, write TVMScript bodies that call the shared math here). Conventions of every kernel:

* fp32 arithmetic, row-major buffers; ``m`` is the number of token rows.
* ``rows=1`` is the decode variant (m fixed to 1); ``rows=None`` the prefill variant, whose first dimension is a
  symbolic ``int64`` var ``m`` bound from the arguments at call time.
* A TE definition returns its tensors in argument order, the output last; the blocks the schedules look up
  by name are named in each docstring.
* Indices that come from an input (token ids, positions, selected neurons and their count) are clamped to
  the buffer they index, so no input can drive a kernel out of its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import te, tirx
from tvm.s_tir import Schedule

from runtime.dtypes import INT4_OFFSET, QUANT_BLOCK

from ..activations import ACTIVATIONS as FFN_ACTIVATIONS

NEG_INF = -3.0e38  # "minus infinity" that stays finite through max/exp (softmax padding, running max)


# --------------------------------------------------------------------------------------------
# Scalar math as TIR expressions
# --------------------------------------------------------------------------------------------


def f32(v):
    return tirx.const(v, "float32")


def let(value, body, name="t"):
    """Bind ``value`` once (a Let) and build ``body(var)``: no re-evaluation, a readable IR."""
    var = tirx.Var(name, "float32")
    return tirx.Let(var, value, body(var))


def poly_exp(x):
    """float32 exp (Cephes expf: 2^n * P(r)), relative error ~2 ulp; clamps to finite range."""

    def poly(r, n):
        p = f32(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = p * r + f32(c)
        pow2n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
        return (p * r * r + r + f32(1.0)) * pow2n

    def reduce(x):  # x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two parts for accuracy)
        return let(
            tirx.floor(x * f32(1.4426950408889634) + f32(0.5)),
            lambda n: let(x - n * f32(0.693359375) + n * f32(2.12194440e-4), lambda r: poly(r, n), "r"),
            "n",
        )

    return let(tirx.max(tirx.min(x, f32(88.0)), f32(-87.33654)), reduce, "x")


def poly_erf(x):
    """erf by Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7; used inside GELU, where
    the absolute error is what counts), with the vectorisable poly_exp."""

    def body(x, a, t):
        p = f32(1.061405429)
        for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
            p = p * t + f32(c)
        sign = tirx.Select(x < f32(0.0), f32(-1.0), f32(1.0))
        # the poly_exp term (it holds Lets) must appear once: a Let var may be defined only once
        return sign * (f32(1.0) - p * t * poly_exp(-a * a))

    return let(
        x,
        lambda x: let(
            tirx.abs(x),
            lambda a: let(f32(1.0) / (f32(1.0) + f32(0.3275911) * a), lambda t: body(x, a, t), "t"),
            "a",
        ),
        "x",
    )


@dataclass(frozen=True)
class Math:
    """How a device evaluates exp and erf."""

    exp: Callable
    erf: Callable


POLYNOMIAL = Math(poly_exp, poly_erf)
"""The CPU's: LLVM lowers tirx.exp / tirx.erf to libm calls (expf, erff), which stops vectorisation; these
polynomials vectorise to plain vector arithmetic."""

NATIVE = Math(tirx.exp, tirx.erf)
"""The GPU's: CUDA's expf / erff, one thread per element, nothing to vectorise."""

ACTIVATIONS = ("none", *FFN_ACTIVATIONS)  # "none": a linear without one


# GELU (tanh) = 0.5 v (1 + tanh(u)) = v / (1 + exp(-2u)), u = sqrt(2/pi) (v + 0.044715 v^3); -2u = v (C1 + C3 v^2).
# No cancellation in 1 + tanh(u) for negative v, so it is more accurate in fp32 than the tanh form.
_GELU_C1 = -1.5957691216057308  # -2 sqrt(2/pi)
_GELU_C3 = -0.07135481627260025  # -2 sqrt(2/pi) 0.044715


def activation(act: str, math: Math) -> Callable:
    """The activation ``act`` as a function of a TIR expression, exp and erf taken from ``math``."""
    if act == "none":
        return lambda v: v
    if act == "relu":
        return lambda v: tirx.max(v, f32(0.0))
    if act == "gelu":  # exact (erf) GELU, as torch's default approximate="none"
        return lambda v: let(v, lambda v: f32(0.5) * v * (f32(1.0) + math.erf(v * f32(0.7071067811865476))), "v")
    if act == "gelu_tanh":  # torch's approximate="tanh", as v sigmoid(2u): exp alone, which the CPU vectorises
        return lambda v: let(v, lambda v: v / (f32(1.0) + math.exp(v * (f32(_GELU_C1) + f32(_GELU_C3) * v * v))), "v")
    if act == "silu":
        return lambda v: let(v, lambda v: v / (f32(1.0) + math.exp(-v)), "v")
    raise ValueError(f"unknown activation {act!r}; expected one of {sorted(ACTIVATIONS)}")


def glu_unit(actf, gate, up):
    """A GLU unit: act(gate) * up (the gate and up sums already carry their biases)."""
    return actf(gate) * up


def load_f32(value, wdtype):
    """A weight element as fp32 (weights may be stored in fp16; arithmetic is fp32)."""
    return value if wdtype == "float32" else tirx.Cast("float32", value)


def quant_storage(bits: int) -> str:
    """The element type of a rows-layout q (`passes.kernels.quant`): int8 values, or two int4 values a byte."""
    if bits not in (4, 8):
        raise ValueError(f"block-quantized weights are int8 or int4, not {bits}-bit")
    return "int8" if bits == 8 else "uint8"


def quant_width(columns: int, bits: int) -> int:
    """Stored elements of a rows-layout q row of `columns` weights (int4: two weights a byte)."""
    if columns % QUANT_BLOCK:
        raise ValueError(f"a quantized row is whole {QUANT_BLOCK}-blocks, not {columns} weights")
    return columns * bits // 8


def quant_value(q, row, block, half, i, bits, centred: bool = True, wide: bool = True):
    """Weight block * 32 + half * 16 + i of row `row` of a rows-layout q, as the fp32 integer it stands for
    (the scale not applied; int4 without `centred`: the stored nibble, the value + 8, for kernels that take the
    8 off once per block instead of once per weight). int4: byte 16 block + i holds the half-0 weight in its
    low nibble, the half-1 weight in its high one (quant's module doc); the (half, i) split keeps both an affine
    function of i, so a vector over i is one contiguous load. `wide`: the nibble is cut out of the byte widened
    to int32 (`int4_byte`); else in uint8, for TE definitions, whose int64 indices widen int32 lanes to int64."""
    if bits == 8:
        return tirx.Cast("float32", q[row, block * QUANT_BLOCK + half * (QUANT_BLOCK // 2) + i])
    if wide:
        nibble = int4_nibble(int4_byte(q, row, block, i), half)
    else:
        nibble = int4_nibble(q[row, block * (QUANT_BLOCK // 2) + i], half, "uint8")
    return nibble - f32(INT4_OFFSET) if centred else nibble


def int4_byte(q, row, block, i):
    """Byte i of block `block` of an int4 rows-layout row, as int32: the two nibbles are cut out of 32-bit lanes
    (one zero-extension a byte, then a shift and a mask; in 8-bit lanes x86 has no byte shift, so the high
    nibble costs a word shift, a mask and a second widening)."""
    return tirx.Cast("int32", q[row, block * (QUANT_BLOCK // 2) + i])


def int4_nibble(byte, half, kind: str = "int32"):
    """The stored int4 value (weight + 8) of `half` of a byte (an `int4_byte`, or a uint8 of `kind`), as fp32."""
    shifted = tirx.shift_right(byte, tirx.Cast(kind, half * 4))
    return tirx.Cast("float32", tirx.bitwise_and(shifted, tirx.const(15, kind)))


def clamp_index(value, extent):
    """An index taken from an input, held inside [0, extent): a min and a max, so no input leaves the buffer."""
    return tirx.max(tirx.min(value, extent - 1), 0)


def clamp_count(count, capacity):
    """A count taken from an input, held inside [0, capacity] (the length of the index buffer it counts)."""
    return tirx.max(tirx.min(count, capacity), 0)


def linear_epilogue(actf, bias: bool, residual: bool):
    """act(acc + b[col]) + res[row, col] as a TIR expression builder (flags fixed at build time)."""

    def apply(acc, b, res, row, col):
        value = acc + b[col] if bias else acc
        value = actf(value)
        return value + res[row, col] if residual else value

    return apply


def rope_low(low, high, cos, sin):
    """Rotate-half RoPE, first half of a head: x1 cos - x2 sin."""
    return low * cos - high * sin


def rope_high(low, high, cos, sin):
    """Rotate-half RoPE, second half of a head: x2 cos + x1 sin."""
    return high * cos + low * sin


def head_norm_scale(sum_sq, hd: int, eps: float):
    """A head's RMSNorm factor 1 / sqrt(mean(x^2) + eps) from its sum of squares (rope_kv_write's q / k norm;
    the value is then x * factor * w[j], as `rms_norm`'s)."""
    return tirx.rsqrt(sum_sq / f32(hd) + f32(eps))


def passes_threshold(score, threshold, magnitude: bool):
    """select's test: score > threshold (with `magnitude`: |score| > threshold)."""
    return (tirx.abs(score) if magnitude else score) > threshold


def prefetch(address, locality: int = 3):
    """Ask for a cache line before it is used (llvm.prefetch: a read; locality 3 keeps it in every cache level,
    prefetcht0; 2 from L2 outward, prefetcht1)."""
    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731
    return tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, u32(0), u32(locality), u32(1))


# --------------------------------------------------------------------------------------------
# Shapes and PrimFuncs
# --------------------------------------------------------------------------------------------


def row_dim(rows):
    """The row extent: 1 for decode, a symbolic int64 ``m`` for prefill."""
    if rows == 1:
        return 1
    if rows is None:
        return tirx.Var("m", "int64")
    raise ValueError(f"rows must be 1 (decode) or None (prefill), got {rows!r}")


def schedule(name, tensors):
    """A Schedule over the PrimFunc of TE ``tensors`` (int64 indices, so a symbolic ``m`` mixes freely)."""
    func = te.create_prim_func(tensors, index_dtype_override="int64").with_attr("global_symbol", name)
    sch = Schedule(tvm.IRModule({name: func}))
    sch.work_on(name)
    return sch


def drop_params(func, names):
    """The same kernel without the parameters its body never reads (bias, residual when absent):
    TVMScript has no optional parameters, so kernels are written with all of them."""
    keep = [p for p in func.params if p.name not in names]
    return tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


# --------------------------------------------------------------------------------------------
# TE compute definitions
# --------------------------------------------------------------------------------------------


def linear(K, N, rows, *, bias: bool, act: str, residual: bool, math: Math, wdtype="float32", w_rows=False,
           tile=None):
    """y[m, N] = act(x[m, K] @ w + b) + res with w [K, N] (or [N, K] when ``w_rows``).  Args: x, w, (b), (res), y.

    Blocks: ``acc`` (the product), ``y`` (the epilogue). With ``tile`` (a GEMM that stages operands in whole
    tiles), x and w are first copied into ``x_tile`` / ``w_tile``, zero-padded to multiples of ``tile`` rows
    and columns, and acc covers the padded shape: every loop of such a GEMM is whole, so no bound check
    leaves its buffers with a symbolic size (the CUDA code generator refuses those).
    """
    w = te.placeholder((N, K) if w_rows else (K, N), name="w", dtype=wdtype)
    w_rowmajor = (lambda kk, n: w[n, kk]) if w_rows else (lambda kk, n: w[kk, n])
    return _linear(K, N, rows, [w], lambda kk, n: load_f32(w_rowmajor(kk, n), wdtype), bias=bias, act=act,
                   residual=residual, math=math, w_rows=w_rows, tile=tile)


def _linear(K, N, rows, weights, w_at, *, bias: bool, act: str, residual: bool, math: Math, w_rows: bool, tile,
            product=None):
    """`linear` over any weight storage: ``weights`` are its placeholders (the arguments between x and b),
    ``w_at(k, n)`` the fp32 weight W[k, n] read from them. ``product(x, i, n)``, if given, is the untiled
    acc[i, n] (a reduction of its own axes) in place of sum over k of x[i, k] * w_at(k, n)."""
    epilogue = linear_epilogue(activation(act, math), bias, residual)
    m = row_dim(rows)
    x = te.placeholder((m, K), name="x")
    b = te.placeholder((N,), name="b") if bias else None
    res = te.placeholder((m, N), name="res") if residual else None
    k = te.reduce_axis((0, K), name="k")
    x_at, shape = (lambda i, kk: x[i, kk]), (m, N)
    if tile is not None:
        zero = f32(0.0)
        mp = (m + tile - 1) // tile * tile
        np_ = -(-N // tile) * tile
        element = w_at

        def padded_w(n, kk):
            return element(kk, n) if np_ == N else tirx.if_then_else(n < N, element(kk, n), zero)

        x_tile = te.compute((mp, K), lambda i, kk: tirx.if_then_else(i < m, x[i, kk], zero), name="x_tile")
        if w_rows:
            w_tile = te.compute((np_, K), padded_w, name="w_tile")
            w_at = lambda kk, n: w_tile[n, kk]  # noqa: E731
        else:
            w_tile = te.compute((K, np_), lambda kk, n: padded_w(n, kk), name="w_tile")
            w_at = lambda kk, n: w_tile[kk, n]  # noqa: E731
        x_at, shape = (lambda i, kk: x_tile[i, kk]), (mp, np_)
    if product is not None and tile is None:
        acc = te.compute(shape, lambda i, n: product(x, i, n), name="acc")
    else:
        acc = te.compute(shape, lambda i, n: te.sum(x_at(i, k) * w_at(k, n), axis=k), name="acc")
    y = te.compute((m, N), lambda i, n: epilogue(acc[i, n], b, res, i, n), name="y")
    return [x] + list(weights) + ([b] if bias else []) + ([res] if residual else []) + [y]


def glu(F, rows, *, act: str, math: Math):
    """y[m, F] = act(t[:, :F]) * t[:, F:] (gate first, then up).  Args: t, y.  Block ``y``."""
    actf = activation(act, math)
    m = row_dim(rows)
    t = te.placeholder((m, 2 * F), name="t")
    y = te.compute((m, F), lambda i, j: glu_unit(actf, t[i, j], t[i, F + j]), name="y")
    return [t, y]


def layer_norm(D, eps, rows):
    """y = (x - mean) / sqrt(var + eps) * g + b, biased variance (two-pass).  Args: x, g, b, y.

    Blocks: ``total`` (row sums), ``sq`` (row sums of squared deviations), ``y``.
    """
    m = row_dim(rows)
    x = te.placeholder((m, D), name="x")
    g = te.placeholder((D,), name="g")
    b = te.placeholder((D,), name="b")
    k1 = te.reduce_axis((0, D), name="k1")
    k2 = te.reduce_axis((0, D), name="k2")
    total = te.compute((m,), lambda i: te.sum(x[i, k1], axis=k1), name="total")
    sq = te.compute(
        (m,), lambda i: te.sum(let(x[i, k2] - total[i] / f32(D), lambda d: d * d, "d"), axis=k2), name="sq"
    )
    y = te.compute(
        (m, D),
        lambda i, j: (x[i, j] - total[i] / f32(D)) * tirx.rsqrt(sq[i] / f32(D) + f32(eps)) * g[j] + b[j],
        name="y",
    )
    return [x, g, b, y]


def rms_norm(D, eps, rows):
    """y = x / sqrt(mean(x^2) + eps) * g.  Args: x, g, y.  Blocks: ``sq`` (row sums of squares), ``y``."""
    m = row_dim(rows)
    x = te.placeholder((m, D), name="x")
    g = te.placeholder((D,), name="g")
    k = te.reduce_axis((0, D), name="k")
    sq = te.compute((m,), lambda i: te.sum(x[i, k] * x[i, k], axis=k), name="sq")
    y = te.compute((m, D), lambda i, j: x[i, j] * tirx.rsqrt(sq[i] / f32(D) + f32(eps)) * g[j], name="y")
    return [x, g, y]


def embed(V, D, rows, *, positions: int | None, wdtype="float32"):
    """y[i] = table[ids[i]] (+ pos_table[start + i]).  Args: ids, table, (pos_table, start), y.  Block ``y``.

    Token ids are clamped to the table's V rows and positions to the positions table's rows.
    """
    m = row_dim(rows)
    ids = te.placeholder((m,), "int64", name="ids")
    table = te.placeholder((V, D), name="table", dtype=wdtype)

    def token(i, j):
        return load_f32(table[clamp_index(ids[i], V), j], wdtype)

    return [ids, table] + _embedded(token, m, D, positions)


def embed_q(V, D, rows, *, positions: int | None, bits: int, sdtype="float16", has_min: bool = False):
    """`embed` over a block-quantized table in the rows layout (blocks along D): y[i, j] = q[ids[i], j] *
    scales[ids[i], j / 32] (+ pos_table[start + i]); int4a (`has_min`: table_s [V, 2 D / 32], each block's scale
    and min) q * scale + min.  Args: ids, table_q, table_s, (pos_table, start), y. Block ``y``."""
    m = row_dim(rows)
    ids = te.placeholder((m,), "int64", name="ids")
    table_q = te.placeholder((V, quant_width(D, bits)), name="table_q", dtype=quant_storage(bits))
    per = 2 if has_min else 1
    table_s = te.placeholder((V, D // QUANT_BLOCK * per), name="table_s", dtype=sdtype)
    half = QUANT_BLOCK // 2

    def token(i, j):
        row, blk = clamp_index(ids[i], V), j // QUANT_BLOCK
        value = quant_value(table_q, row, blk, j % QUANT_BLOCK // half, j % half, bits, centred=not has_min,
                            wide=False) * load_f32(table_s[row, blk * per], sdtype)
        return value + load_f32(table_s[row, blk * per + 1], sdtype) if has_min else value

    return [ids, table_q, table_s] + _embedded(token, m, D, positions)


def _embedded(token, m, D, positions):
    """The rest of an embedding's arguments, (pos_table, start,) y, for y[i, j] = token(i, j) (+ the position's
    row)."""
    if not positions:
        return [te.compute((m, D), token, name="y")]
    pos = te.placeholder((positions, D), name="pos_table")
    start = te.var("start", "int64")
    y = te.compute((m, D), lambda i, j: token(i, j) + pos[clamp_index(start + i, positions), j], name="y")
    return [pos, start, y]


def merge(D, parts: int, rows, *, bias: bool, residual: bool):
    """out = res + p_1 (+ p_2) + b.  Args: (res), p_1 (, p_2), (b), out; all [m, D] except b [D].  Block ``y``."""
    m = row_dim(rows)
    res = te.placeholder((m, D), name="res") if residual else None
    partials = [te.placeholder((m, D), name=f"p{i}") for i in range(parts)]
    b = te.placeholder((D,), name="b") if bias else None

    def add(i, j):
        total = partials[0][i, j]
        for p in partials[1:]:
            total = total + p[i, j]
        if bias:
            total = total + b[j]
        if residual:
            total = total + res[i, j]
        return total

    out = te.compute((m, D), add, name="y")
    return ([res] if residual else []) + partials + ([b] if bias else []) + [out]


def concat_columns(widths: tuple[int, ...], rows):
    """y = [p_1 p_2 ...] side by side.  Args: p_1 [m, w_1], p_2 [m, w_2], ..., y [m, sum w].  Block ``y``."""
    m = row_dim(rows)
    parts = [te.placeholder((m, w), name=f"p{i}") for i, w in enumerate(widths)]
    starts = [sum(widths[:i]) for i in range(len(widths))]

    def pick(i, j):
        value = parts[-1][i, j - starts[-1]]
        for part, start in zip(reversed(parts[:-1]), reversed(starts[:-1])):
            value = tirx.if_then_else(j < start + part.shape[1], part[i, j - start], value)
        return value

    return parts + [te.compute((m, sum(widths)), pick, name="y")]


# --------------------------------------------------------------------------------------------
# Block-quantized rows (``passes.kernels.quant``'s rows layout: blocks of QUANT_BLOCK along each row)
# --------------------------------------------------------------------------------------------


def qrows_check_sdtype(sdtype: str):
    if sdtype not in ("float16", "float32"):
        raise ValueError(f"block scales are float16 or float32, not {sdtype!r}")


def qrows_value(q, row, column, bits):
    """Weight ``column`` of row ``row`` of a rows-layout q as the fp32 integer it stands for (no scale):
    ``quant_value`` with the column split into (block, half, i), the nibble cut out in uint8."""
    half = QUANT_BLOCK // 2
    return quant_value(q, row, column // QUANT_BLOCK, column % QUANT_BLOCK // half, column % half, bits, wide=False)


def qrows_weight(q, s, row, column, bits, sdtype):
    """The dequantized fp32 weight [row, column] of a rows-layout (q, scales)."""
    return qrows_value(q, row, column, bits) * load_f32(s[row, column // QUANT_BLOCK], sdtype)


def qrows_placeholders(R, C, bits, sdtype, names=("w", "ws")):
    """(q [R, C * bits / 8], scales [R, C / 32]) placeholders of a rows-layout weight, named ``names``."""
    qrows_check_sdtype(sdtype)
    if C <= 0:
        raise ValueError("a quantized row has weights")
    q = te.placeholder((R, quant_width(C, bits)), name=names[0], dtype=quant_storage(bits))
    s = te.placeholder((R, C // QUANT_BLOCK), name=names[1], dtype=sdtype)
    return q, s


def linear_qrows(K, N, rows, *, bias: bool, act: str, residual: bool, math: Math, bits: int, sdtype="float16",
                 tile=None):
    """`linear` with W^T [N, K] stored as quant rows (blocks along K, one row per output: llama.cpp's GPU
    layout).  Args: x, w [N, K or K/2], ws [N, K/32], (b), (res), y (the names of quant's CPU linears).  Blocks
    as `linear`'s (w_rows).

    Untiled, acc reduces over three axes (``kb`` block, ``kh`` half, ``ki`` 0..15: k = 32 kb + 16 kh + ki), so
    that every byte address is affine in them (a single k would put k / 32 and k % 16 in the int4 address)."""
    w_q, w_s = qrows_placeholders(N, K, bits, sdtype)
    half = QUANT_BLOCK // 2

    def product(x, i, n):
        kb = te.reduce_axis((0, K // QUANT_BLOCK), name="kb")
        kh = te.reduce_axis((0, 2), name="kh")
        ki = te.reduce_axis((0, half), name="ki")
        value = quant_value(w_q, n, kb, kh, ki, bits, wide=False) * load_f32(w_s[n, kb], sdtype)
        return te.sum(x[i, kb * QUANT_BLOCK + kh * half + ki] * value, axis=[kb, kh, ki])

    return _linear(K, N, rows, [w_q, w_s], lambda kk, n: qrows_weight(w_q, w_s, n, kk, bits, sdtype), bias=bias,
                   act=act, residual=residual, math=math, w_rows=True, tile=tile, product=product)


def linear_kn_qrows(K, N, rows, *, bias: bool, act: str, residual: bool, math: Math, bits: int, sdtype="float16",
                    tile=None):
    """`linear` with W [K, N] stored as quant rows (blocks along N, one row per reduction index: the FFN down
    rows, quant's ``linear_kn_q``).  Args: x, w [K, N or N/2], ws [K, N/32], (b), (res), y."""
    w_q, w_s = qrows_placeholders(K, N, bits, sdtype)
    return _linear(K, N, rows, [w_q, w_s], lambda kk, n: qrows_weight(w_q, w_s, kk, n, bits, sdtype), bias=bias,
                   act=act, residual=residual, math=math, w_rows=False, tile=tile)
