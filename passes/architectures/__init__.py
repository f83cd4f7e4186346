"""The GGUF architectures picompile compiles, one module each, as typed facts: which metadata an architecture
reads, which tensors its files hold, and how its decoder block computes (`Architecture`). `ARCHITECTURES` is the
registry, `architecture_of` its door.

Every registered architecture is a value of the one decoder block the GGUF front end builds
(`passes.gguf_graph`): token embedding; per block a norm, attention with RoPE (grouped-query, optional q/k/v
biases, optionally an RMSNorm over each head's query and key before RoPE), a norm and a gated FFN; a final norm
and an output layer (or the embedding table, tied). An architecture whose features are values this block already
has is one module here plus one line in `ARCHITECTURES`; a new feature is a new enum value here, and the graph's
code for it. How a file lays the block's matrices out is data too: a `Fused` tensor holds several of them stacked
along its rows (Phi-3's attn_qkv), which the graph takes apart into the matrices a file of separate tensors holds,
so that nothing after it sees the fusion.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from ..errors import UserError


class QKRows(Enum):
    """How a file stores attn_q's and attn_k's rows (the graph computes transformers' rotate-half RoPE)."""

    PERMUTED = "permuted"  # llama.cpp's converter permuted them for adjacent-pair RoPE: put back when read
    ROTATE_HALF = "rotate-half"  # stored as transformers computes them (llama.cpp's NeoX RoPE)


class Need(Enum):
    """Whether a file of the architecture has a tensor."""

    REQUIRED = "required"
    OPTIONAL = "optional"
    ABSENT = "absent"


class Norm(Enum):
    RMS = "rms"  # x / sqrt(mean(x^2) + eps) * w


class NormPlacement(Enum):
    PRE = "pre"  # one norm before attention, one before the FFN, each inside its residual branch


class Activation(Enum):
    """The gated FFN's activation: act(gate) * up -> down."""

    SILU = "silu"


class Rope(Enum):
    """RoPE variants a file may use besides plain RoPE at rope.freq_base (always taken)."""

    LINEAR = "linear"  # rope.scaling.type linear: positions divided by rope.scaling.factor
    FREQS = "rope_freqs"  # rope_freqs.weight: per-frequency divisors of the angles (LLaMA 3.1)


class Dim(Enum):
    """A tensor dimension, as the hyper-parameters size it."""

    VOCAB = "vocab"  # the rows of token_embd.weight (no metadata key: the table itself says)
    D_MODEL = "d_model"
    FFN = "ffn"
    Q = "heads x head_dim"
    KV = "kv_heads x head_dim"
    HEAD = "head_dim"
    HALF_HEAD = "head_dim / 2"

    def size(self, h, vocab: int) -> int:
        """The size in a model of hyper-parameters `h` (`passes.gguf_graph.Hyper`) and `vocab` tokens."""
        return {Dim.VOCAB: vocab, Dim.D_MODEL: h.d_model, Dim.FFN: h.ffn, Dim.Q: h.heads * h.head_dim,
                Dim.KV: h.kv_heads * h.head_dim, Dim.HEAD: h.head_dim, Dim.HALF_HEAD: h.head_dim // 2}[self]


@dataclass(frozen=True)
class Param:
    """A hyper-parameter: metadata `<architecture>.<key>`, read as `name`. `default`: None where the file must
    have it, else llama.cpp's value where it is absent (a function of the values read before it, or a value)."""

    name: str
    key: str
    kind: type = int  # int: at least `minimum`, one value for every layer; float; str
    default: object | Callable[[dict], object] = None
    minimum: int = 1  # an int's least value (0 where the key's 0 means "none", as attention.sliding_window's)


# A tensor dimension: a Dim, or a tuple of them stacked (a fused tensor's rows: the sum of its parts')
Rows = Dim | tuple[Dim, ...]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a file holds: its GGUF name (a block's without the `blk.{i}.` before it), numpy-order shape
    (GGUF lists dimensions the other way round), whether a file must have it, and whether it is a weight matrix
    (a linear layer or the embedding table: what --weight-dtype stores) rather than a norm or a bias."""

    name: str
    shape: tuple[Rows, ...]
    required: bool
    matrix: bool
    per_block: bool = False

    def size(self, h, vocab: int) -> tuple[int, ...]:
        return tuple(sum(part.size(h, vocab) for part in d) if isinstance(d, tuple) else d.size(h, vocab)
                     for d in self.shape)


@dataclass(frozen=True)
class Fused:
    """A block tensor of the file that holds several of the block's matrices stacked along its rows, in order
    (llama.cpp's fused QKV, gate/up): `tensor`'s rows are those of `parts` (the names a file of separate tensors
    gives them), one after the other. Rows are whole: each part is a range of the file's rows, its blocks as stored."""

    tensor: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """A tensor a file of the architecture may hold for a feature picompile does not compile yet: such a file is
    refused in one line saying why (`why` completes "tensor NAME is ...")."""

    tensor: str
    why: str


# a block's norm weights (RMSNorm has no bias) where each placement puts norms
_NORMS = {NormPlacement.PRE: ("attn_norm.weight", "ffn_norm.weight")}

# The hyper-parameters of llama.cpp's LLaMA-family decoders, with llama.cpp's defaults (src/llama-model.cpp;
# it requires the norm's epsilon, which picompile takes as 1e-5 where a file lacks it)
DECODER_PARAMS = (
    Param("layers", "block_count"),
    Param("d_model", "embedding_length"),
    Param("ffn", "feed_forward_length"),
    Param("heads", "attention.head_count"),
    Param("kv_heads", "attention.head_count_kv", default=lambda got: got["heads"]),
    Param("head_dim", "attention.key_length", default=lambda got: max(got["d_model"] // got["heads"], 1)),
    Param("value_dim", "attention.value_length", default=lambda got: got["head_dim"]),
    Param("rope_dims", "rope.dimension_count", default=lambda got: got["head_dim"]),
    Param("rope_scaling", "rope.scaling.type", str, "linear"),  # a factor without a type scales linearly
    Param("rope_factor", "rope.scaling.factor", float, 1.0),
    Param("eps", "attention.layer_norm_rms_epsilon", float, 1e-5),
    Param("rope_base", "rope.freq_base", float, 10000.0),
    # llama.cpp multiplies RoPE's cos and sin by it (every architecture's; LongRoPE's converters write it): the
    # graph has no such factor, so a file whose factor is not 1 is refused
    Param("rope_attn_factor", "rope.scaling.attn_factor", float, 1.0),
)


@dataclass(frozen=True)
class Architecture:
    """A GGUF `general.architecture`: the facts the front end reads a file of it by, and builds its graph from."""

    name: str  # general.architecture's value, and the prefix of its metadata keys
    params: tuple[Param, ...]
    qk_rows: QKRows
    qkv_bias: Need
    norm: Norm
    norm_placement: NormPlacement
    activation: Activation
    rope: frozenset[Rope]
    tied_output: bool  # the output layer may be absent: the embedding table, transposed, computes the logits
    # an RMSNorm over each head's query and key (attn_q_norm / attn_k_norm, one weight of head_dim shared by the
    # heads, the block's eps), after the projections and before RoPE (Qwen3)
    qk_norm: bool = False
    fused: tuple[Fused, ...] = ()  # block tensors holding several of the block's matrices
    refused: tuple[Refused, ...] = ()  # tensors of features picompile does not compile yet

    def __post_init__(self):
        block = {name: (shape, matrix) for name, shape, matrix in self._block()}
        for fused in self.fused:
            parts = [block.get(part) for part in fused.parts]
            if None in parts or not all(matrix for _, matrix in parts) or len({s[1:] for s, _ in parts}) != 1:
                raise ValueError(f"{self.name}: {fused.tensor} must stack block matrices of one width")

    def _block(self) -> list[tuple[str, tuple[Dim, ...], bool]]:
        """One block's tensors as a file of separate matrices holds them: (name, shape, weight matrix)."""
        D, F, Q, KV = Dim.D_MODEL, Dim.FFN, Dim.Q, Dim.KV
        before_attention, before_ffn = _NORMS[self.norm_placement]
        return [(before_attention, (D,), False), ("attn_q.weight", (Q, D), True), ("attn_k.weight", (KV, D), True),
                ("attn_v.weight", (KV, D), True), ("attn_output.weight", (D, Q), True),
                (before_ffn, (D,), False), ("ffn_gate.weight", (F, D), True),
                ("ffn_up.weight", (F, D), True), ("ffn_down.weight", (D, F), True),
                *((("attn_q_norm.weight", (Dim.HEAD,), False), ("attn_k_norm.weight", (Dim.HEAD,), False))
                  if self.qk_norm else ())]

    def held(self, h, vocab: int = 0) -> dict[str, tuple[str, range]]:
        """Where the file holds each of the block's matrices that a fused tensor holds: name -> (the fused tensor,
        its rows there). A matrix not named here is a tensor of its own name."""
        rows_of = {name: shape[0].size(h, vocab) for name, shape, _ in self._block()}
        found = {}
        for fused in self.fused:
            start = 0
            for part in fused.parts:
                found[part] = (fused.tensor, range(start, start + rows_of[part]))
                start += rows_of[part]
        return found

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The tensors a file of this architecture holds (the model's, then one block's), in the order the front end
        checks them."""
        D, Q, KV = Dim.D_MODEL, Dim.Q, Dim.KV
        model = [TensorSpec("token_embd.weight", (Dim.VOCAB, D), True, True),
                 TensorSpec("output_norm.weight", (D,), True, False),
                 TensorSpec("output.weight", (Dim.VOCAB, D), not self.tied_output, True)]
        if Rope.FREQS in self.rope:
            model.append(TensorSpec("rope_freqs.weight", (Dim.HALF_HEAD,), False, False))
        block = self._block()
        shapes = {name: shape for name, shape, _ in block}
        fused_in = {part: fused for fused in self.fused for part in fused.parts}
        specs, placed = [], set()
        for name, shape, matrix in block:
            fused = fused_in.get(name)
            if fused is None:
                specs.append(TensorSpec(name, shape, True, matrix, per_block=True))
            elif fused.tensor not in placed:  # the fused tensor, where the first of its parts would be
                placed.add(fused.tensor)
                rows = tuple(shapes[part][0] for part in fused.parts)
                specs.append(TensorSpec(fused.tensor, (rows, *shape[1:]), True, matrix, per_block=True))
        if self.qkv_bias is not Need.ABSENT:
            specs += [TensorSpec(f"attn_{name}.bias", (dim,), self.qkv_bias is Need.REQUIRED, False, per_block=True)
                      for name, dim in (("q", Q), ("k", KV), ("v", KV))]
        return (*model, *specs)


from .llama import LLAMA  # noqa: E402  (the modules build on the classes above)
from .phi3 import PHI3  # noqa: E402
from .qwen2 import QWEN2  # noqa: E402
from .qwen3 import QWEN3  # noqa: E402

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, PHI3)}


def architecture_of(name) -> Architecture:
    """The registered architecture `name` (a file's general.architecture), or the one-line refusal."""
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise UserError(f"architecture {name!r} is not supported (picompile compiles GGUF "
                        f"{', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]
