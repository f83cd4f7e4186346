"""The artifact's manifest as typed data: the one place that knows its JSON keys.

The compiler's artifact writer builds a `Manifest` and writes `to_json()`; the runtime (and every other reader:
the CLI, the cost model, benchmarks) gets one from `load_manifest` and reads attributes. The sections that are a
fact a pass decides (the sparsity mode, the quality plan's expectation, the per-layer report, the calibration and
quantization summaries, the device rule) are defined here once and imported by the pass that writes them: the
runtime is the lowest layer, so both the compiler and the runtime can import them.

`to_json` reproduces the bytes the writer has always produced (key order, absent keys absent): the manifest is
hashed and sealed, so the same build must give the same file. A field marked `_optional()` is left out of the JSON
where it is None (the key was never written); any other None is written as null. `from_json` takes what the file
says without checking it: `load_manifest` checks the structure and `verify` the claims against the files.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def _optional(default=None):
    """A field whose key the JSON lacks where it is None."""
    return field(default=default, metadata={"optional": True})


def _encode(value):
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value.to_json() if hasattr(value, "to_json") else value


class _Section:
    """to_json / from_json by the dataclass's fields, in their order (the order the JSON has always had)."""

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            out[f.name] = _encode(value)
        return out

    @classmethod
    def from_json(cls, data: dict):
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} is {type(data).__name__}, not an object")
        values = {}
        for f in fields(cls):
            if f.name in data:
                values[f.name] = data[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                values[f.name] = None  # a hand-edited file may lack it: verify names what is wrong
        return cls(**values)


def kl_as_ppl_change(kl: float) -> float:
    """exp(KL) - 1: the perplexity change a mean KL per token makes on text the source model itself would write
    (capped where exp overflows: a path's far end can measure a KL in the thousands)."""
    return math.expm1(min(kl, 700.0))


@dataclass(frozen=True)
class QualityBudget(_Section):
    """`kind` "ppl": perplexity on held-out calibration tokens at most (1 + value) times the source model's, and so
    the perplexity the KL implies; "kl": the mean KL divergence per token from the source model's next-token
    distribution at most `value`. (--max-quality-loss; passes.budget parses it.)"""

    kind: str = "ppl"
    value: float = 0.01

    def judged(self, ppl_change: float, kl: float) -> float:
        """The figure the budget holds a plan to. A ppl budget takes the larger of the perplexity change on the
        held-out text and exp(KL) - 1, the change on text the source model itself would write, which varies far
        less from text to text: the furthest plan a search finds within one noisy measure is the one whose noise
        was kindest (SmolLM2's int4 plan at 1%: +1.0% on its held-out tokens, +2.0% in eval, its KL +1.9%)."""
        return max(ppl_change, kl_as_ppl_change(kl)) if self.kind == "ppl" else kl

    def met_by(self, ppl_change: float, kl: float) -> bool:
        return self.judged(ppl_change, kl) <= self.value

    def describe(self) -> str:
        return f"ppl +{self.value * 100:g}%" if self.kind == "ppl" else f"KL {self.value:g}"


OUTPUT_LAYER = -1  # a MatrixChoice's layer for the output layer (after every block)


@dataclass(frozen=True)
class MatrixChoice(_Section):
    """One knob of the quality plan as chosen, with what it was measured to cost: a linear input (predictor mode:
    an FFN's neurons) of one layer, the format its matrix is stored in, the share of held-out decode inputs
    (neurons) it does not read, the KL it alone adds at the logits over that input dense in the widest format the
    build allows (its local effect per fitting token; None where --sparsity fixed the level unmeasured), and the
    cost model's decode microseconds of its matrix at this choice and dense in the widest format."""

    layer: int  # OUTPUT_LAYER: the output layer
    site: str  # qkv, o, in (gate/up), down, head (the output layer's); predictor mode: neurons
    format: str
    dropped: float
    kl: float | None
    us: float
    dense_us: float

    def describe(self) -> str:
        level = f"drops {self.dropped:.2f}" if self.dropped > 0 else "dense"
        kl = "-" if self.kl is None else f"{self.kl:.1e}"
        return f"{self.site} {level} {self.format} KL {kl} {self.us:.1f}/{self.dense_us:.1f} us"


@dataclass(frozen=True)
class ExpectedQuality(_Section):
    """What the build expects `eval` to measure against the source model, on held-out calibration tokens (the
    quality pass's result). Its wall time is not part of it: the same build gives the same manifest."""

    budget: QualityBudget
    ppl_change: float
    kl: float
    top1: float
    tokens: int
    met: bool
    plan: str  # what was chosen, one line
    gave_up: str  # what the budget cost, one line ("" where nothing)
    # ppl_change's 95% interval over the held-out sequences (how much of it is which tokens they were)
    ppl_low: float | None = _optional()
    ppl_high: float | None = _optional()
    choices: tuple[MatrixChoice, ...] | None = _optional()  # per knob, by layer (what inspect and -v show)

    @classmethod
    def from_json(cls, data: dict) -> "ExpectedQuality":
        quality = super().from_json(data)
        choices = data.get("choices")
        return cls(**{**quality.__dict__, "budget": QualityBudget.from_json(data["budget"]),
                      "choices": None if choices is None else tuple(MatrixChoice.from_json(c) for c in choices)})

    def layer_lines(self) -> list[str]:
        """Per layer, each knob's choice and its measured cost, one line (-v and inspect print them)."""
        by_layer: dict[int, list[MatrixChoice]] = {}
        for choice in self.choices or ():
            by_layer.setdefault(choice.layer, []).append(choice)
        where = lambda layer: "in the output layer" if layer == OUTPUT_LAYER else f"in layer {layer}"  # noqa: E731
        return [f"{where(layer)}: " + "; ".join(c.describe() for c in choices)
                for layer, choices in sorted(by_layer.items(), key=lambda item: (item[0] == OUTPUT_LAYER, item[0]))]

    def line(self) -> str:
        interval = (f"95%: {self.ppl_low * 100:+.1f}..{self.ppl_high * 100:+.1f}%, "
                    if self.ppl_low is not None and self.ppl_high is not None else "")
        return (f"expected quality: ppl {self.ppl_change * 100:+.1f}% ({interval}budget {self.budget.describe()}), KL "
                f"{self.kl:.4f} (ppl {kl_as_ppl_change(self.kl) * 100:+.1f}% on the model's own text), "
                f"top-1 {self.top1:.2f} on {self.tokens:,} held-out calibration tokens")


@dataclass(frozen=True)
class Sparsity(_Section):
    """How decode skips FFN work in this model (the sparsity pass's decision)."""

    mode: str  # "predictor" or "threshold"
    sparsity: float | None  # threshold mode with --sparsity: the share of each FFN input dropped; else None
    reason: str  # why this mode (what `build` prints)

    def describe(self) -> str:
        """One line: the mode, its sparsity (threshold mode) and why."""
        level = (f" at {self.sparsity:.2f}" if self.sparsity is not None else
                 " (a level per linear input, within the quality budget)" if self.mode == "threshold" else "")
        return f"{self.mode} mode{level} ({self.reason})"


@dataclass
class LayerReport(_Section):
    """One layer's FFN as the lower pass built it. Predictor mode fills the neuron split and the profile's and
    predictor's figures; threshold mode (`mode` "threshold") each linear input's threshold (< 0: dense) and the
    share it drops on held-out tokens. `ffn` is "dense" where the FFN stayed dense (predictor mode says why)."""

    layer: int
    mode: str | None = _optional()
    threshold_in: float | None = _optional()
    sparsity_in: float | None = _optional()
    threshold_down: float | None = _optional()
    sparsity_down: float | None = _optional()
    threshold_qkv: float | None = _optional()
    sparsity_qkv: float | None = _optional()
    threshold_o: float | None = _optional()
    sparsity_o: float | None = _optional()
    gpu_neurons: int | None = _optional()
    cpu_neurons: int | None = _optional()
    gpu_activation_share: float | None = _optional()
    sparsity: float | None = _optional()
    skewness: float | None = _optional()
    hot80_share: float | None = _optional()
    predictor_rank: int | None = _optional()
    predictor_threshold: float | None = _optional()
    predictor_recall: float | None = _optional()
    predictor_precision: float | None = _optional()
    predictor_active: float | None = _optional()
    ffn: str | None = _optional()
    dense_reason: str | None = _optional()

    @property
    def dense(self) -> bool:
        return self.ffn == "dense"


@dataclass(frozen=True)
class Calibration(_Section):
    """The calibration tokens the profile pass ran (what the fits had). Sampling's wall time is printed by the
    build, not kept: the same build gives the same manifest."""

    tokens: int
    given_tokens: int
    source: str  # the --calib file, or "random tokens"
    sampled_sequences: int
    sequence_tokens: int
    wanted_tokens: int


@dataclass(frozen=True)
class Quantization(_Section):
    """What the quantize pass stored (for inspect and -v)."""

    format: str
    method: str
    block: int
    scale_dtype: str
    matrices: int
    scope: str  # "weights", or "predictors" (a float build quantizes only its predictors)
    weights: int
    float32_bytes: int
    bytes: int
    mean_relative_error: float
    kept_in_floats: list[str]
    exact_matrices: int
    planned_floats: list[str]
    planned_formats: dict[str, int]
    source_blocks_rerounded: int
    source_floats_kept: list[str]
    source_formats_kept: dict[str, int]
    channel_scales: dict  # the AWQ pass's report, as it wrote it (passes.awq)


@dataclass(frozen=True)
class Devices(_Section):
    """The place pass's rule for which blocks went to the GPU (keys in sorted order, as it has always written)."""

    budget_bytes: int | None = _optional()
    gpu_layers: list[int] | None = _optional()
    model_bytes: int | None = _optional()
    rule: str | None = _optional()


@dataclass(frozen=True)
class Stage(_Section):
    """One node of a model split across machines (`build --nodes`): the decoder layers it runs, [first_layer,
    stop_layer), contiguous, stage 0 first (it also runs the embedding; the last stage the final norm and the
    output layer). The split pass (passes.split_nodes) writes the stages; each call of the schedule names its
    stage (`Call.stage`), and a token's hidden state crosses from one stage to the next in a hand-over call."""

    name: str
    first_layer: int
    stop_layer: int
    memory_bytes: int  # what the node offers the model (weights and KV caches)
    target: str  # "cpu", or the GPU target (passes.targets.TARGETS) the node's card is
    resources: dict  # Ray custom resources the stage's actor asks for ({}: none; it is then placed by memory)
    weight_bytes: int  # the stage's weights and KV caches, as the split priced them
    expected_step_s: float  # the cost model's seconds of the stage's part of one decode step
    handover_bytes: int  # the hidden-state bytes one token sends to the next stage (0 for the last)
    gpu_bytes: int | None = _optional()  # what the node's card may hold of the model (None: no card)

    def layers_text(self) -> str:
        """'layer 3' or 'layers 0-8': what the logs and `inspect` call its range."""
        last = self.stop_layer - 1
        return f"layer {last}" if last == self.first_layer else f"layers {self.first_layer}-{last}"


@dataclass(frozen=True)
class TargetFacts(_Section):
    """The hardware the artifact was built for."""

    name: str
    cpu_isa: str
    cpu_features: list[str]  # the CPU flags its kernels need
    cuda_arch: str | None


@dataclass(frozen=True)
class ModelFacts(_Section):
    vocab_size: int
    max_context: int
    num_layers: int
    num_calls: int
    max_batch: int = 0  # sequences of the batch phase (0: none)
    source: str | None = None  # the model file built from


@dataclass(frozen=True)
class BuildOptions(_Section):
    dense: bool
    max_context: int
    weight_dtype: str


@dataclass(frozen=True)
class IO(_Section):
    inputs: list[str]
    outputs: list[str]


@dataclass
class Buffer(_Section):
    """One buffer of the program (keys sorted, as the kernel IR has always written them)."""

    device: str | None = _optional()  # "gpu" where it lives on the GPU
    dtype: str | None = None
    format: str | None = _optional()  # a quantized weight's format
    kind: str | None = None  # weight, activation, input, cache, scratch
    layout: str | None = _optional()
    logical_columns: int | None = _optional()
    matrix: list[int] | None = _optional()  # a quantized weight's logical matrix shape
    shape: list[int] | None = None


@dataclass(frozen=True)
class TokenizerListing(_Section):
    source: str  # the directory the build copied them from
    files: list[str]  # relative to the artifact


def structure_problem(data: dict) -> str | None:
    """What is wrong with the shape of the sections the runtime reads (None where nothing): a hand-edited manifest
    fails here, not deep in the engine. (`load_manifest` has checked the format, its version and the digest.)"""
    expected = {"files": dict, "model": dict, "buffers": dict, "target": dict}
    for key, kind in expected.items():
        if not isinstance(data.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    for key in ("max_context", "vocab_size"):
        if not isinstance(data["model"].get(key), int):
            return f"model.{key} is missing or not an integer"
    for relative, digest in data["files"].items():
        if not (isinstance(digest, str) and len(digest) == 64):
            return f"the sha256 of {relative} is malformed"
    return None


@dataclass(frozen=True)
class Header:
    """What a reader checks first, whatever the rest holds: the format, its version and the digest."""

    format: Any
    format_version: Any
    manifest_sha256: Any

    @classmethod
    def of(cls, data) -> "Header | None":
        """None where `data` is not a JSON object."""
        if not isinstance(data, dict):
            return None
        return cls(data.get("format"), data.get("format_version"), data.get("manifest_sha256"))


@dataclass
class Manifest:
    """The artifact's manifest. Empty sections are written as the writer always wrote them: `{}` (sparsity,
    calibration, quantization, devices, placement), `[]` (layers), null (quality, tokenizer)."""

    format: str
    format_version: int
    picompile_version: str
    target: TargetFacts
    model: ModelFacts
    options: BuildOptions | None
    io: IO
    buffers: dict[str, Buffer]
    files: dict[str, str]  # relative path -> sha256
    sparsity: Sparsity | None = None
    layers: list[LayerReport] = field(default_factory=list)
    calibration: Calibration | None = None
    quantization: Quantization | None = None
    quality: ExpectedQuality | None = None
    placement: dict[str, Any] = field(default_factory=dict)  # the partition pass's report, as it wrote it
    devices: Devices | None = None
    tokenizer: TokenizerListing | None = None
    estimate: dict[str, Any] | None = None  # passes.costmodel.Estimate, as asdict wrote it
    stages: list[Stage] = field(default_factory=list)  # a model split across machines; [] on one machine
    manifest_sha256: str | None = None  # the digest of the rest (runtime.artifact.seal_manifest)

    def to_json(self) -> dict:
        out = {
            "format": self.format,
            "format_version": self.format_version,
            "picompile_version": self.picompile_version,
            "target": self.target.to_json(),
            "model": self.model.to_json(),
            "options": None if self.options is None else self.options.to_json(),
            "sparsity": {} if self.sparsity is None else self.sparsity.to_json(),
            "io": self.io.to_json(),
            "buffers": {name: buffer.to_json() for name, buffer in self.buffers.items()},
            "layers": [layer.to_json() for layer in self.layers],
            "calibration": {} if self.calibration is None else self.calibration.to_json(),
            "quantization": {} if self.quantization is None else self.quantization.to_json(),
            "quality": None if self.quality is None else self.quality.to_json(),
            "placement": self.placement,
            "devices": {} if self.devices is None else self.devices.to_json(),
            "tokenizer": None if self.tokenizer is None else self.tokenizer.to_json(),
            "files": self.files,
        }
        if self.estimate is not None:
            out["estimate"] = self.estimate
        if self.stages:  # (absent on one machine: an unsplit artifact's manifest is what it always was)
            out["stages"] = [stage.to_json() for stage in self.stages]
        if self.manifest_sha256 is not None:
            out["manifest_sha256"] = self.manifest_sha256
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        """The manifest a file holds (ValueError, TypeError, KeyError or AttributeError where a section is not the
        shape it must have: `load_manifest` says the file is damaged). A section the file lacks is None, even
        target and model: `load_manifest` refuses such a file first; tools reading old artifacts (benchmarks)
        get what there is."""
        def section(kind, key):
            value = data.get(key)
            return kind.from_json(value) if value else None  # {} and null: no such section

        buffers = data.get("buffers") or {}
        for name, info in buffers.items():
            if not isinstance(info, dict):
                raise ValueError(f"buffers.{name} is not a buffer entry")
        options = data.get("options")
        return cls(
            format=data.get("format"),
            format_version=data.get("format_version"),
            picompile_version=data.get("picompile_version"),
            target=section(TargetFacts, "target"),
            model=section(ModelFacts, "model"),
            options=BuildOptions.from_json(options) if isinstance(options, dict) else None,
            io=section(IO, "io"),
            buffers={name: Buffer.from_json(info) for name, info in buffers.items()},
            files=dict(data.get("files") or {}),
            sparsity=section(Sparsity, "sparsity"),
            layers=[LayerReport.from_json(layer) for layer in data.get("layers") or []],
            calibration=section(Calibration, "calibration"),
            quantization=section(Quantization, "quantization"),
            quality=section(ExpectedQuality, "quality"),
            placement=dict(data.get("placement") or {}),
            devices=section(Devices, "devices"),
            tokenizer=section(TokenizerListing, "tokenizer"),
            estimate=data.get("estimate"),
            stages=[Stage.from_json(stage) for stage in data.get("stages") or []],
            manifest_sha256=data.get("manifest_sha256"),
        )
