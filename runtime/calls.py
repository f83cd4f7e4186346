"""What each kernel call of an artifact does, as data: the contract between the compiler's back end, the
runtime, the cost model and `inspect`.

Kernel selection (`passes/select_kernels.py`) writes one `Call` per kernel call; plan-buffers and schedule
carry it into the schedule (`schedule.json`, node attribute `call`); the runtime binds and counts bytes from
it, the cost model prices it, `inspect` tabulates it. Nobody outside kernel selection looks inside a
kernel's name, a call's label or an argument's position to learn what a call does.

Byte facts describe a one-token (decode) step, the phase whose speed is bound by the weights it reads;
prompts (prefill) read every weight whole. A batch step (one new token for each of several sequences, CPU
artifacts only) reads each weight once for the whole batch, and a sparse call's selection is the union of the
batch's selections.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from .dtypes import nbytes
from .manifest import Buffer

START = "start"  # the scalar argument: how many tokens the KV cache already holds
# decode: one token of one sequence; prefill: many tokens of one sequence; batch: one token of each of up to
# the artifact's max_batch sequences (each with its own KV cache and position)
PHASES = ("decode", "prefill", "batch")


class Role(str, Enum):
    """What a call computes: the runtime's profile classes and the cost model's groups."""

    EMBED = "embed"
    NORM = "norm"
    ATTENTION = "attention"
    PREDICTOR = "predictor"  # the predictor's GEMVs and the selection of the neurons it predicts
    FFN = "ffn"  # the CPU's fused sparse up+down pass
    FFN_UP = "ffn_up"
    FFN_DOWN = "ffn_down"
    MERGE = "merge"
    HEAD = "head"  # the output layer
    COPY = "copy"  # a host<->device transfer: the runtime's own, not a kernel
    # a token's hidden state sent from one stage (machine) of a split model to the next: the runtime's own, no
    # kernel; it reads the sending stage's buffer and writes the receiving stage's (passes/handover.py)
    HANDOVER = "handover"


class Access(str, Enum):
    """How a call touches one argument in a decode step."""

    WHOLE = "whole"  # reads every byte
    GATHER = "gather"  # reads one row per token (an embedding table): `row_bytes`
    CONTEXT = "context"  # reads the cached positions only (a KV cache in attention)
    SELECTED_ROWS = "selected_rows"  # reads `row_bytes` per selected entry (the call's `count`), plus
    # `nonzero_row_bytes` per selected entry whose `hidden` value is not 0 (a fused ReLU FFN skips the rest)
    WRITE = "write"  # overwrites it (the step's rows), reads nothing
    UPDATE = "update"  # writes some rows and keeps the others (a KV cache write): ordered like a read and a write

    @property
    def reads(self) -> bool:
        return self is not Access.WRITE

    @property
    def writes(self) -> bool:
        return self in (Access.WRITE, Access.UPDATE)


@dataclass(frozen=True)
class Arg:
    buffer: str  # a buffer of the manifest, or START
    access: Access = Access.WHOLE
    row_bytes: int = 0  # GATHER, SELECTED_ROWS: bytes read per row (per selected entry)
    nonzero_row_bytes: int = 0  # SELECTED_ROWS: more bytes per selected entry whose hidden value is not 0
    written: bool = False  # also written by a call that reads it (an in-place epilogue)

    @property
    def reads(self) -> bool:
        return self.buffer != START and self.access.reads

    @property
    def writes(self) -> bool:
        return self.written or self.access.writes


@dataclass(frozen=True)
class Selection:
    """Which rows a sparse decode call reads, as the layer's statistics describe them: the neurons a
    predictor lets through (`by` "predictor", `part` the GPU's hot part or the CPU's cold one), or the
    input channels a magnitude threshold keeps (`by` "threshold", `part` "up" or "down" (an FFN's gate/up or down
    projection), "qkv" or "o" (attention's), "head" (the output layer's)."""

    by: str
    part: str
    count: str  # the [1, 1] int32 buffer holding how many entries were selected
    capacity: int  # how many entries it can select (the index buffer's length)
    hidden: str | None = None  # the values whose non-zero entries decide the `nonzero_row_bytes` reads
    kept: float | None = None  # the share of `capacity` expected through, where no layer report says (the output layer)


@dataclass(frozen=True)
class Call:
    id: str  # unique in the schedule: what the IR, the profile and inspect call it
    device: str  # "cpu" or "gpu"
    role: Role
    decode: str  # kernel for one-token steps ("" if prefill-only; "copy" for a transfer)
    prefill: str  # kernel for multi-token steps ("" if decode-only)
    args: tuple[Arg, ...]  # in the kernel's argument order
    layer: int | None = None  # the decoder layer, None outside the layers
    selection: Selection | None = None  # sparse decode calls only
    batch: str = ""  # kernel for batch steps ("" if the artifact has no batch phase); see `per_sequence`
    stage: int = 0  # the stage (machine) of a split model that runs it; a hand-over's: the sending stage

    @property
    def runtime_own(self) -> bool:
        """A copy or a hand-over: done by the runtime itself, no kernel of the library."""
        return self.role in (Role.COPY, Role.HANDOVER)

    @property
    def transfer(self) -> tuple[str, str]:
        """A copy's or hand-over's (source, target): the buffer it reads and the one it writes."""
        return (next(arg.buffer for arg in self.args if not arg.writes),
                next(arg.buffer for arg in self.args if arg.writes))

    def kernel(self, phase: str) -> str:
        return {"decode": self.decode, "prefill": self.prefill, "batch": self.batch}[phase]

    @property
    def per_sequence(self) -> bool:
        """Whether a batch step runs this call once per sequence (its `batch` kernel then being its decode
        kernel, bound to each row, that sequence's caches and its position): it reads or writes a KV cache,
        or reads the position (`start`), which differ between the sequences of a batch."""
        return any(arg.buffer == START or arg.access in (Access.CONTEXT, Access.UPDATE) for arg in self.args)

    def buffers(self) -> list[str]:
        return [arg.buffer for arg in self.args if arg.buffer != START]

    def reads(self) -> list[str]:
        return [arg.buffer for arg in self.args if arg.reads]

    def writes(self) -> list[str]:
        return [arg.buffer for arg in self.args if arg.writes]

    def to_json(self) -> dict:
        data = asdict(self)
        data["role"] = self.role.value
        data["args"] = [{**asdict(arg), "access": arg.access.value} for arg in self.args]
        if not self.stage:  # an unsplit artifact's schedule stays as it was
            del data["stage"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Call":
        """Raises KeyError, TypeError or ValueError on a malformed entry (the artifact reader says which)."""
        selection = data.get("selection")
        return cls(id=str(data["id"]), device=str(data["device"]), role=Role(data["role"]),
                   decode=str(data["decode"]), prefill=str(data["prefill"]),
                   args=tuple(Arg(**{**arg, "access": Access(arg["access"])}) for arg in data["args"]),
                   layer=None if data.get("layer") is None else int(data["layer"]),
                   selection=None if selection is None else Selection(**selection),
                   batch=str(data.get("batch", "")),  # (absent in artifacts made before the batch phase)
                   stage=int(data.get("stage", 0)))  # (absent: stage 0, the one stage of an unsplit model)


@dataclass
class DecodeReads:
    """The weight bytes a decode call reads: `fixed` whatever the input, plus `per_selected` for each entry
    its selection let through and `per_nonzero` for each of those whose hidden value was not 0."""

    fixed: int = 0
    per_selected: int = 0
    per_nonzero: int = 0


def decode_weight_reads(call: Call, buffers: dict[str, Buffer], tokens: int = 1) -> DecodeReads:
    """What `call` reads of the weights in `buffers` (manifest entries) in one decode step, or in a batch step
    of `tokens` sequences (a gathered row per token; everything else once). The runtime's byte count and the
    cost model both start from this."""
    reads = DecodeReads()
    for arg in call.args:
        info = buffers.get(arg.buffer)
        if info is None or info.kind != "weight" or not arg.reads:
            continue
        if arg.access is Access.GATHER:
            reads.fixed += tokens * arg.row_bytes
        elif arg.access is Access.SELECTED_ROWS:
            reads.per_selected += arg.row_bytes
            reads.per_nonzero += arg.nonzero_row_bytes
        else:
            reads.fixed += nbytes(info.shape, info.dtype)
    return reads


def schedule_calls(schedule: dict) -> list[Call]:
    """The schedule's calls in execution order (its nodes' `order`)."""
    nodes = sorted(schedule["nodes"], key=lambda node: node["order"])
    return [Call.from_json(node["call"]) for node in nodes]
