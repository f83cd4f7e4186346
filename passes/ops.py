"""picompile's own ops (the `picompile` domain), declared once: inputs, outputs and attributes with their types.

Each op is a view class over an `ir.Node`: its attributes are typed properties (`FFN(node).layer` is an int,
`SparseFFN(node).part` a str; an optional attribute reads as its declared default, else None when absent), and
the declaration is data the pass manager checks every graph against after every pass (`bad_nodes`, in
`pipeline.run_passes`, so in every build): an op not declared here, a wrong number of inputs or outputs, a required attribute missing, one of the wrong type or one
not declared. Standard ONNX ops are onnx's checker's business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, Iterator, TypeVar

import onnx_ir as ir

from .activations import ACTIVATIONS
from .ir import DOMAIN

T = TypeVar("T")
KEEP_ALL = -1.0  # a threshold every magnitude passes (|v| > -1): an absent threshold, the projection runs dense
ALL_NEURONS = -3.0e38  # a predictor threshold every score passes (lower, quality: the FFN computes every neuron)

INT, FLOAT, STRING = ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING


@dataclass(frozen=True)
class Port:
    """One input or output. `optional`: may be None, or left off at the end; `variadic`: the last port, repeated
    (at least once unless also optional)."""

    name: str
    optional: bool = False
    variadic: bool = False


class Attr(Generic[T]):
    """One declared attribute: its ONNX type, and for an optional one the value read where it is absent."""

    def __init__(self, type: ir.AttributeType, optional: bool = False, default: T | None = None, choices: tuple = ()):
        self.type, self.optional, self.default, self.choices = type, optional, default, choices
        self.name = ""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, view: "OpView | None", owner) -> T:
        if view is None:
            return self  # the declaration, read on the class
        found = view.node.attributes.get(self.name)
        return self.default if found is None else found.value

    def __set__(self, view: "OpView", value: T) -> None:
        """Write the attribute with its declared type (`FFN(node).gpu_neurons = 12`)."""
        view.node.attributes[self.name] = ir.Attr(self.name, self.type, value)

    def problem(self, node: ir.Node) -> str | None:
        """What is wrong with this attribute on `node`, or None."""
        found = node.attributes.get(self.name)
        if found is None:
            return None if self.optional else f"required attribute {self.name!r} is missing"
        if found.type != self.type:
            return f"attribute {self.name!r} is {found.type.name}, declared {self.type.name}"
        if self.choices and found.value not in self.choices:
            return f"attribute {self.name!r} is {found.value!r}, declared one of {self.choices}"
        return None


def Int(**kw) -> Attr[int]:
    return Attr(INT, **kw)


def Float(**kw) -> Attr[float]:
    return Attr(FLOAT, **kw)


def Str(**kw) -> Attr[str]:
    return Attr(STRING, **kw)


OPS: dict[str, type["OpView"]] = {}  # op type -> its declaration


class OpView:
    """A typed view of one node of a declared op. Subclasses declare `inputs`, `outputs` and `Attr`s."""

    op_type: ClassVar[str]
    inputs: ClassVar[tuple[Port, ...]] = ()
    outputs: ClassVar[tuple[Port, ...]] = (Port("out"),)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "inputs" in cls.__dict__:  # a concrete op (a base such as `Layered` declares attributes only)
            cls.op_type = cls.__name__
            OPS[cls.op_type] = cls

    def __init__(self, node: ir.Node):
        if not self.matches(node):
            raise ValueError(f"{node.name} is {node.domain or 'onnx'}.{node.op_type}, not {DOMAIN}.{self.op_type}")
        self.node = node

    @classmethod
    def matches(cls, node: ir.Node) -> bool:
        return node.domain == DOMAIN and node.op_type == cls.op_type

    @classmethod
    def nodes(cls, model: ir.Model) -> list[ir.Node]:
        """The model's nodes of this op, in graph order."""
        return [node for node in model.graph if cls.matches(node)]

    @classmethod
    def attributes(cls) -> dict[str, Attr]:
        """Every attribute the op declares, by name (its bases' too)."""
        found = cls.__dict__.get("_attributes")
        if found is None:  # once per class: the verify hook asks for every node of every graph
            found = {name: value for klass in reversed(cls.__mro__) for name, value in vars(klass).items()
                     if isinstance(value, Attr)}
            cls._attributes = found
        return found

    def input(self, name: str) -> ir.Value | None:
        """The value at the declared input port `name` (not a variadic one), None where it is left off: optional
        ports at the end may be absent, and a residual fuse folded in (the last input) is no port's."""
        index = next((i for i, port in enumerate(self.inputs) if port.name == name and not port.variadic), None)
        if index is None:
            raise KeyError(f"{DOMAIN}.{self.op_type} declares no input port {name!r}")
        folded = 1 if "residual" in self.attributes() and self.value("residual") else 0
        return self.node.inputs[index] if index < len(self.node.inputs) - folded else None

    def value(self, name: str):
        """A declared attribute read by a name the caller computes (`threshold_{site}`)."""
        return self._declared(name).__get__(self, type(self))

    def set(self, name: str, value) -> None:
        """A declared attribute written by a name the caller computes."""
        self._declared(name).__set__(self, value)

    def _declared(self, name: str) -> Attr:
        declared = self.attributes().get(name)
        if declared is None:
            raise KeyError(f"{DOMAIN}.{self.op_type} declares no attribute {name!r}")
        return declared


def view(node: ir.Node) -> OpView:
    """The typed view of a node of any declared op."""
    op = OPS.get(node.op_type) if node.domain == DOMAIN else None
    if op is None:
        raise ValueError(f"{node.name} ({node.domain or 'onnx'}.{node.op_type}) is not a declared {DOMAIN} op")
    return op(node)


class Layered(OpView):
    layer = Int()


class Folds(OpView):
    """An op fuse may fold the following residual Add into: the skip then is its last input."""

    residual = Int(optional=True, default=0)


# ------------------------------------------------------------------ the ops, in the order the passes add them


class Embed(OpView):
    """recognise: token rows (and position rows, for OPT) of the embedding tables."""

    inputs = (Port("input_ids"), Port("start"), Port("tokens"), Port("positions", optional=True))


class Attention(Layered, Folds):
    """recognise: a layer's attention block, norm excluded. `q_norm` / `k_norm` (Qwen3): an RMSNorm over each head's
    query and key, one weight [head_dim] for every head, eps `qk_norm_eps`, after the projections and before RoPE;
    both or neither. Thresholds (threshold mode, quality): a decode step reads only the rows of the kept channels
    of the qkv / o projection's input."""

    inputs = (Port("x"), Port("start"), Port("past_key"), Port("past_value"), Port("w_qkv"),
              Port("b_qkv", optional=True), Port("w_o"), Port("b_o", optional=True), Port("inv_freq", optional=True),
              Port("q_norm", optional=True), Port("k_norm", optional=True))
    outputs = (Port("out"), Port("present_key"), Port("present_value"))
    num_heads = Int()
    num_kv_heads = Int()
    head_dim = Int()
    scale = Float()
    qk_norm_eps = Float(optional=True)
    threshold_qkv = Float(optional=True, default=KEEP_ALL)
    threshold_o = Float(optional=True, default=KEEP_ALL)
    sparsity_qkv = Float(optional=True, default=0.0)
    sparsity_o = Float(optional=True, default=0.0)


class FFN(Layered, Folds):
    """recognise: a layer's dense FFN (w_up holds [gate | up] when gated); later passes add their facts to it."""

    inputs = (Port("x"), Port("w_up"), Port("b_up", optional=True), Port("w_down"), Port("b_down", optional=True))
    activation = Str(choices=tuple(ACTIVATIONS))
    gated = Int()
    # profile
    sparsity = Float(optional=True)
    skewness = Float(optional=True)
    hot80_share = Float(optional=True)
    # predict (the threshold, recall, precision and active share: quality's plan may replace them)
    predictor_rank = Int(optional=True)
    predictor_threshold = Float(optional=True)
    predictor_recall = Float(optional=True)
    predictor_precision = Float(optional=True)
    predictor_active = Float(optional=True)
    # partition
    gpu_neurons = Int(optional=True, default=0)
    placed = Str(optional=True, choices=("sparse", "gpu", "cpu"))  # absent: sparse (no placement ran)
    placed_reason = Str(optional=True)
    # threshold / quality (threshold mode)
    threshold_in = Float(optional=True, default=KEEP_ALL)
    threshold_down = Float(optional=True, default=KEEP_ALL)
    sparsity_in = Float(optional=True, default=0.0)
    sparsity_down = Float(optional=True, default=0.0)


class ThresholdFFN(Layered, Folds):
    """lower (threshold mode): the FFN without its down bias, decode reading the rows of the kept inputs."""

    inputs = (Port("x"), Port("w_up"), Port("b_up", optional=True), Port("w_down"))
    activation = Str(choices=tuple(ACTIVATIONS))
    gated = Int()
    threshold_in = Float()
    threshold_down = Float()


class Predict(Layered):
    """lower (predictor mode): x -> one score vector per part of the FFN (the predictor's w2 split by part)."""

    inputs = (Port("x"), Port("w1"), Port("w2", variadic=True))
    outputs = (Port("scores", variadic=True),)


class SparseFFN(Layered):
    """lower (predictor mode): one part's neurons whose score passes `threshold`, as gathered rows."""

    inputs = (Port("x"), Port("scores"), Port("up_rows"), Port("up_bias", optional=True), Port("down_rows"))
    part = Str(choices=("gpu", "cpu"))
    neurons = Int()
    threshold = Float()
    activation = Str(choices=tuple(ACTIVATIONS))
    gated = Int()


class MergePartial(Layered, Folds):
    """lower: the parts' sum plus the down bias."""

    inputs = (Port("partials", variadic=True), Port("bias", optional=True))


class Linear(Folds):
    """fuse (or lower, where the quality plan thresholds its input): the output layer, x @ W (+ b). A decode step
    reads only the rows of x's channels with |x| > threshold (`sparsity`: the share it drops on held-out tokens)."""

    inputs = (Port("x"), Port("weight"), Port("bias", optional=True))
    threshold = Float(optional=True, default=KEEP_ALL)
    sparsity = Float(optional=True, default=0.0)


class Handover(OpView):
    """handover: a token's hidden state (the residual stream) sent from one stage of a model split across machines
    to the next, at the layer boundary where the stage changes (passes/handover.py)."""

    inputs = (Port("x"),)
    from_stage = Int()
    to_stage = Int()


class Call(OpView):
    """select-kernels: one kernel call of the kernel-call IR (`passes.kernel_ir`), its facts in `call`."""

    inputs = (Port("reads", optional=True, variadic=True),)
    outputs = (Port("writes", optional=True, variadic=True),)
    call = Str()


# ------------------------------------------------------------------ verification


def _count_problem(what: str, ports: tuple[Port, ...], count: int) -> str | None:
    fixed = [p for p in ports if not p.variadic]
    variadic = next((p for p in ports if p.variadic), None)
    # optional ports at the end may be left off; a variadic one needs one value unless optional
    least = len(fixed)
    while least and fixed[least - 1].optional:
        least -= 1
    if variadic is not None and not variadic.optional:
        least = len(fixed) + 1
    most = None if variadic is not None else len(fixed)
    if count < least or (most is not None and count > most):
        wanted = f"{least}" if least == most else f"{least} to {most}" if most is not None else f"at least {least}"
        return f"{count} {what}, declared {wanted} ({', '.join(p.name for p in ports)})"
    return None


def node_problems(node: ir.Node) -> list[str]:
    """What is wrong with a picompile-domain node against its declaration ([] for other domains)."""
    if node.domain != DOMAIN:
        return []
    op = OPS.get(node.op_type)
    if op is None:
        return [f"{DOMAIN}.{node.op_type} is not a declared op (passes.ops)"]
    problems = []
    declared = op.attributes()
    folded = 1 if "residual" in declared and op(node).residual else 0
    for problem in (_count_problem("inputs", op.inputs, len(node.inputs) - folded),
                    _count_problem("outputs", op.outputs, len(node.outputs))):
        if problem:
            problems.append(problem)
    problems += [p for p in (a.problem(node) for a in declared.values()) if p]
    problems += [f"attribute {name!r} is not declared" for name in node.attributes if name not in declared]
    return problems


class OpError(ValueError):
    """A picompile op that does not fit its declaration."""

    def __init__(self, node: ir.Node, problems: list[str]):
        self.node = node
        super().__init__(f"node {node.name} ({node.domain}.{node.op_type}): {'; '.join(problems)}")


def bad_nodes(model: ir.Model) -> Iterator[tuple[ir.Node, list[str]]]:
    for node in model.graph:
        problems = node_problems(node)
        if problems:
            yield node, problems

