"""profile: run calibration tokens through the dense model and count how often each FFN neuron fires.

Reads: the block IR's `picompile.FFN` nodes (their `source.input` / `source.activation` metadata name the
tensors in the source graph; w_down [ffn, d_model] gives the width), the source graph itself
(`recognise.source_model`, on the IR's `meta`), which onnxruntime runs as the reference executor, and its
fields: the calibration file `calib` (None: RANDOM_TOKENS random tokens), `calib_tokens` (a cap; None: every
token of `calib`), `calib_samples` (sequences sampled from the model itself and profiled too; None: enough to
bring a short `calib` to MIN_TOKENS_PER_NEURON tokens per FFN neuron), `seed` and `wanted_tokens` (what the
passes after it want, where that is not MIN_TOKENS_PER_NEURON per FFN neuron: a dense build profiles for the awq
pass alone); the build's `max_context` (`ctx.build`: sequences are cut to min(max_context, SEQUENCE_TOKENS) tokens).
Adds per FFN layer: an initializer `layers.{i}.ffn.frequency` (float32 [ffn]: fraction of calibration
tokens on which each neuron was active) and float attributes `sparsity`, `skewness` (of the frequency
distribution) and `hot80_share` (the share of neurons that carry 80% of all activations); on the model,
`metadata_props["picompile.calibration"]` (a `Calibration`: tokens profiled, given, sampled, wanted). The FFN inputs and
activity masks, too large to hold (every calibration token is profiled), are spilled per layer into files
in the workdir as they come out of onnxruntime and ride on the IR's `meta` as one `ProfiledActivations` of
memory maps, for the predict and threshold passes. The activation CDF per layer is plotted into the
artifact (`plots/activation_cdf.png`). A calibration set below MIN_TOKENS_PER_NEURON gets one warning line.
Some of the user's sequences, spread over the file (`measured_sequences`; none with `hold_out=False`), are not
profiled: they ride last in `CalibrationSequences`, for the quality pass to measure plans on tokens no fit saw.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .errors import UserError
from .facts import MemoryFact, read_entry, write_entry
from .ops import FFN
from .pipeline import Context, Fact, Options
from .reference import OrtDecoder
from .tokenizer import TokenizerFiles
from .tokens import read_calibration
from runtime.artifact import first_line
from runtime.manifest import Calibration

from .import_onnx import source_file
from .layer_reference import layer_cuts, lifted_layer_inputs, needs_layers, run_layers
from .recognise import BLOCKS, source_model

PROFILED = "picompile.profiled_activations"  # the IR's `meta` entry
SEQUENCES = "picompile.calibration_sequences"  # the IR's `meta` entry
CALIBRATION_KEY = "picompile.calibration"  # metadata: what was profiled (runtime.manifest.Calibration)


def calibration_of(model: ir.Model) -> Calibration | None:
    """What the profile pass ran (None where it did not run: a dense build)."""
    return read_entry(model, CALIBRATION_KEY, Calibration)


@dataclass
class LayerActivations:
    """One FFN layer over the profiled tokens (sequence-major). The profile pass leaves both arrays as
    memory maps of its files in the build's workdir, so a consumer holds in memory only the layers
    it works on; `active` unpacks the bits on each access (a per-layer [tokens, ffn] bool array)."""

    inputs: np.ndarray  # [tokens, d_model] float32: the FFN's input after its norm (what gate and up read)
    bits: np.ndarray  # [tokens, ceil(ffn / 8)] uint8: np.packbits of which neurons fired, along the neuron axis
    ffn: int

    @classmethod
    def of(cls, inputs: np.ndarray, active: np.ndarray) -> "LayerActivations":
        """In memory, from the FFN inputs and the [tokens, ffn] bool activity."""
        active = np.asarray(active, bool)
        return cls(np.asarray(inputs, np.float32), np.packbits(active, axis=1), active.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def active_share(self) -> float:
        """The share of (token, neuron) pairs that fired: 1 - the layer's sparsity (padding bits are 0)."""
        return float(np.bitwise_count(self.bits).sum(dtype=np.int64) / max(self.tokens * self.ffn, 1))

    @property
    def active(self) -> np.ndarray:
        """[tokens, ffn] bool: which neurons fired (activation output != 0)."""
        return np.unpackbits(self.bits, axis=1, count=self.ffn).view(bool)


@dataclass
class ProfiledActivations(MemoryFact):
    """What the profile pass saw, per layer, for the passes that fit to it (predict, threshold)."""

    META_KEY: ClassVar[str] = PROFILED
    MISSING: ClassVar[str] = "the IR carries no profiled activations (run the profile pass first)"
    layers: dict[int, LayerActivations]

    def layer(self, index: int) -> LayerActivations:
        if index not in self.layers:
            raise ValueError(f"layer {index} was not profiled (run the profile pass first)")
        return self.layers[index]

    def scale_inputs(self, index: int, divisor: np.ndarray, chunk: int = 4096) -> None:
        """Divide layer `index`'s FFN inputs by `divisor` per channel (a pass rescaled what the norm puts out):
        in its file, a chunk of rows at a time, where the inputs are a memory map; else in memory."""
        layer = self.layer(index)
        path = getattr(layer.inputs, "filename", None)
        if path is None:
            layer.inputs = np.asarray(layer.inputs, np.float32) / divisor
            return
        writable = np.load(path, mmap_mode="r+")
        for begin in range(0, writable.shape[0], chunk):
            writable[begin: begin + chunk] /= divisor
        writable.flush()
        del writable
        layer.inputs = np.load(path, mmap_mode="c")


@dataclass
class CalibrationSequences(MemoryFact):
    """The calibration sequences in the profile pass's order (sampled ones first, the user's text last); the last
    `measured` of them (the user's, taken across the file by `measured_sequences`) were not profiled: no fit saw
    them, and the quality pass measures plans on them, on text like the user's."""

    META_KEY: ClassVar[str] = SEQUENCES
    MISSING: ClassVar[str] = "the IR carries no calibration sequences (run the profile pass first)"
    sequences: list[np.ndarray]
    measured: int = 0


@dataclass
class LayerStats:
    frequency: np.ndarray
    sparsity: float
    skewness: float
    hot80_share: float


def layer_stats(frequency: np.ndarray) -> LayerStats:
    """The statistics of a layer whose neuron j fired on a share frequency[j] of the profiled tokens."""
    frequency = np.asarray(frequency, np.float64)
    centred = frequency - frequency.mean()
    spread = frequency.std()
    skewness = float((centred**3).mean() / spread**3) if spread > 0 else 0.0
    ranked = np.sort(frequency)[::-1]
    total = ranked.sum()
    hot80 = 1.0 if total == 0 else float((np.searchsorted(np.cumsum(ranked), 0.8 * total) + 1) / ranked.size)
    return LayerStats(frequency.astype(np.float32), float(1.0 - frequency.mean()), skewness, hot80)


RANDOM_TOKENS = 4096  # random tokens profiled without a --calib file (unless --calib-tokens says otherwise)


def calibration_tokens(calib: Path | None, budget: int | None, length: int, seed: int, vocab_size: int,
                       log=lambda message: None, tokenizer: TokenizerFiles | None = None) -> list[np.ndarray]:
    """The sequences of `calib` (ids, or text tokenized with `tokenizer`: passes.tokens.read_calibration)
    cut into pieces of `length` tokens, or random tokens (fit only for synthetic models), `budget` tokens at
    most (None: all of `calib`, RANDOM_TOKENS random ones)."""
    if calib is None:
        log("profile: no --calib file: profiling on random tokens, which is only fit for synthetic models")
        rng = np.random.default_rng(seed)
        return [rng.integers(0, vocab_size, size=length)
                for _ in range(max(1, (budget or RANDOM_TOKENS) // length))]
    sequences, used = [], 0
    for sequence in read_calibration(calib, tokenizer.tokenizer if tokenizer else None, length):
        if int(sequence.max()) >= vocab_size:
            raise UserError(f"{calib} holds token id {int(sequence.max())}, outside the vocabulary ({vocab_size})")
        for begin in range(0, len(sequence), length):
            room = length if budget is None else min(length, budget - used)
            if room <= 0:
                return sequences
            sequences.append(sequence[begin: begin + room])
            used += len(sequences[-1])
    return sequences


def reference_decoder(source: ir.Model, wanted: list[str], workdir: Path) -> OrtDecoder:
    """onnxruntime on the source model with the `wanted` source-graph tensors made outputs too."""
    values = {v.name: v for node in source.graph for v in node.outputs}
    for name in wanted:
        value = values[name]
        value.dtype = value.dtype or ir.DataType.FLOAT
        if value not in source.graph.outputs:
            source.graph.outputs.append(value)
    path = workdir / "profile-source.onnx"
    pir.save(source, path)
    try:
        return OrtDecoder(path)
    except Exception as error:  # onnxruntime's own exception types: the source model is not valid ONNX
        reason = first_line(error, type(error).__name__)
        raise UserError(f"onnxruntime cannot load the model to profile it: {reason}") from None


def run_reference(decoder: OrtDecoder, wanted: list[str], sequences: list[np.ndarray]):
    """Yield the wanted tensors as [tokens, width] rows for each sequence, run by onnxruntime from an empty KV
    cache (one at a time: the imported source graph runs batch 1)."""
    for sequence in sequences:
        decoder.reset()
        try:
            results = decoder.run(sequence[None], wanted)
        except Exception as error:  # onnxruntime's own types: a node of the source model fails on real tokens
            reason = first_line(error, type(error).__name__)
            raise UserError(f"onnxruntime cannot run the model on calibration tokens: {reason}") from None
        yield {name: array.reshape(-1, array.shape[-1]) for name, array in results.items()}


def sample_sequences(model_file: Path, count: int, length: int, starts: list[np.ndarray], seed: int,
                     vocab_size: int) -> list[np.ndarray]:
    """`count` sequences of `length` tokens sampled from the model in `model_file` (temperature 1, one batch
    with the KV cache: the user's file takes any batch, unlike the imported graph), each from the first token
    of a calibration sequence (cycled), or from random tokens when there are none."""
    rng = np.random.default_rng([seed, 1])  # not the random calibration tokens' stream
    first = (np.array([int(starts[i % len(starts)][0]) for i in range(count)]) if starts
             else rng.integers(0, vocab_size, size=count))
    try:
        return list(OrtDecoder(model_file).sample(first, length, rng, vocab_size))
    except Exception as error:  # onnxruntime's own types, as in run_reference
        reason = first_line(error, type(error).__name__)
        raise UserError(f"onnxruntime cannot sample calibration tokens from {model_file} (--calib-samples 0 "
                        f"profiles without): {reason}") from None


class _Spill:
    """The profile's per-layer files, filled sequence by sequence: FFN inputs as float32 rows, activity as
    packed bits, plus per-neuron counts of activity (for the statistics)."""

    def __init__(self, directory: Path, tokens: int):
        self.directory, self.tokens = directory, tokens
        self.inputs: dict[int, np.memmap] = {}
        self.bits: dict[int, np.memmap] = {}
        self.counts: dict[int, np.ndarray] = {}

    def _file(self, name: str, width: int, dtype) -> np.memmap:
        return np.lib.format.open_memmap(self.directory / name, mode="w+", dtype=dtype, shape=(self.tokens, width))

    def write(self, layer: int, row: int, inputs: np.ndarray, output: np.ndarray) -> None:
        """One sequence's rows of one layer, from token `row` of the profiled set on."""
        active = output != 0
        if layer not in self.inputs:  # widths come with the first rows
            self.inputs[layer] = self._file(f"layer{layer}.inputs.npy", inputs.shape[1], np.float32)
            self.bits[layer] = self._file(f"layer{layer}.active.npy", (active.shape[1] + 7) // 8, np.uint8)
            self.counts[layer] = np.zeros(active.shape[1], np.int64)
        rows = slice(row, row + len(inputs))
        self.inputs[layer][rows] = inputs
        self.bits[layer][rows] = np.packbits(active, axis=1)
        self.counts[layer] += active.sum(0)

    def close(self) -> ProfiledActivations:
        """The files, mapped copy-on-write from here on: torch takes only writable arrays, and a consumer's
        writes stay its own (they never reach the files)."""
        layers = {}
        for layer, inputs in self.inputs.items():
            for array in (inputs, self.bits[layer]):
                array.flush()
            read = lambda kind: np.load(self.directory / f"layer{layer}.{kind}.npy", mmap_mode="c")  # noqa: E731
            layers[layer] = LayerActivations(read("inputs"), read("active"), self.counts[layer].size)
        self.inputs.clear(), self.bits.clear()
        return ProfiledActivations(layers)


def plot_cdf(stats: dict[int, LayerStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4.2), dpi=110)
    colours = plt.cm.viridis(np.linspace(0, 1, max(len(stats), 2)))
    for (layer, s), colour in zip(sorted(stats.items()), colours):
        ranked = np.sort(s.frequency)[::-1]
        share = np.cumsum(ranked) / max(ranked.sum(), 1e-12)
        axes.plot(np.arange(1, ranked.size + 1) / ranked.size * 100, share * 100, color=colour, lw=1.2,
                  label=f"layer {layer} (sparsity {s.sparsity:.2f})" if len(stats) <= 8 or layer % 4 == 0 else None)
    axes.axhline(80, color="grey", lw=0.6, ls="--")
    axes.set_xlabel("neurons, hottest first (%)")
    axes.set_ylabel("share of all activations (%)")
    axes.set_title("FFN activation CDF per layer")
    axes.legend(fontsize=7, loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


SEQUENCE_TOKENS = 128  # the longest calibration sequence (long prompts add little but time)
# A calibration set is small below this many tokens per FFN neuron (of the widest layer): a predictor fits an
# output column per neuron, and its least-squares start a d_model x d_model input covariance, on 80% of the
# tokens (the rest set its threshold). 2 per neuron is 8 d_model tokens at the usual ffn = 4 d_model, about
# the least at which those fits stay well determined: a rule of thumb, not a measured knee.
MIN_TOKENS_PER_NEURON = 2
# The user's calibration tokens kept out of every fit (predictors, their thresholds and checkpoints, awq,
# thresholds), for the quality pass to measure a plan on: about MEASURED_TOKENS of them, at most MEASURED_SHARE
# of the user's tokens (the fits keep the rest: their held-out tokens are the user's text too). On SmolLM2 1,116
# of them gave the default build's plan +0.9% (95%: +0.2..+1.7%): an interval wider than its 1% budget; 2,108 give
# it -0.1..+0.8%, for 5-23 s more of a 55-67 s build (an int4 budget measures four plans on them).
MEASURED_TOKENS = 2048
MEASURED_SHARE = 0.5


def measured_sequences(given: list[np.ndarray]) -> list[int]:
    """Which of the user's calibration sequences the fits do not see (about MEASURED_TOKENS, at most
    MEASURED_SHARE of the user's tokens; none of a single one), spread evenly over the file: a file's passages
    differ (a 10% plan's ppl change over 1,024-token stretches of one text spanned +4.5..+8.1%), and sequences
    taken across it measure the file, not its last passage."""
    total = sum(len(s) for s in given)
    mean = max(total / max(len(given), 1), 1.0)
    count = min(math.ceil(MEASURED_TOKENS / mean), int(MEASURED_SHARE * total / mean), len(given) - 1)
    if count <= 0:
        return []
    stride = len(given) / count
    return sorted({min(int((k + 0.5) * stride), len(given) - 1) for k in range(count)})


# the calibration sequences (`CalibrationSequences`), and the FFNs' inputs and activity (`ProfiledActivations`)
CALIBRATION_SEQUENCES = Fact("calibration sequences", "profile", lambda model: SEQUENCES in model.meta)
PROFILED_ACTIVATIONS = Fact("profiled FFN activations", "profile", lambda model: PROFILED in model.meta)


@dataclass
class Profile:
    name = "profile"
    requires = (BLOCKS,)
    calib: Path | None = Options.calib
    calib_tokens: int | None = Options.calib_tokens
    calib_samples: int | None = Options.calib_samples
    tokenizer: TokenizerFiles | None = Options.tokenizer  # reads a text --calib
    seed: int = Options.seed
    wanted_tokens: int | None = None  # the tokens the fits after it want (None: MIN_TOKENS_PER_NEURON per neuron)
    layered: bool | None = None  # run the source one layer at a time (passes.layer_reference); None: when needed
    # run the source over the sequences and record the FFNs' inputs and activity (False: the sequences alone, for
    # the quality pass, which runs the model itself)
    activations: bool = True
    hold_out: bool = True  # keep some of the user's sequences out of the profiled ones, for the quality pass

    @property
    def adds(self) -> tuple[Fact, ...]:
        return (CALIBRATION_SEQUENCES, PROFILED_ACTIVATIONS) if self.activations else (CALIBRATION_SEQUENCES,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        source = source_model(model)
        ffns = sorted(FFN.nodes(model), key=lambda n: FFN(n).layer)
        vocab_size = pir.const_matrix(model.graph.initializers["embed.tokens"]).shape[0]
        length = min(ctx.build.max_context, SEQUENCE_TOKENS)
        given = calibration_tokens(self.calib, self.calib_tokens, length, self.seed, vocab_size, ctx.log,
                                   self.tokenizer)
        wanted = [name for node in ffns for name in (node.metadata_props["source.input"], node.metadata_props["source.activation"])]

        width = max(node.inputs[3].const_value.shape[0] for node in ffns)  # w_down [ffn, d_model]
        needed = MIN_TOKENS_PER_NEURON * width if self.wanted_tokens is None else self.wanted_tokens
        given_tokens = sum(len(s) for s in given)
        kept_out = measured_sequences(given) if self.hold_out else []
        # the kept-out sequences go last (CalibrationSequences.measured counts them from the end)
        given = [s for i, s in enumerate(given) if i not in kept_out] + [given[i] for i in kept_out]
        measured = len(kept_out)
        fitted_given = sum(len(s) for s in given[: len(given) - measured])
        samples = self.calib_samples
        too_big = needs_layers(source)  # sampling runs the whole model in onnxruntime
        if samples is None:  # auto: make up a --calib file that falls short, unless --calib-tokens cut it short
            short = self.calib is not None and given_tokens < needed and given_tokens != self.calib_tokens
            samples = math.ceil((needed - fitted_given) / length) if short and not too_big else 0
            if short and too_big:
                ctx.warn(f"profile: {given_tokens} calibration tokens, fewer than the {needed} wanted, and the model is "
                         "too big for onnxruntime to sample more from it here: give more calibration text")
        elif samples and too_big:
            raise UserError(f"--calib-samples {samples}: sampling runs the whole model in onnxruntime, whose fp32 "
                            "weights do not fit in this machine's memory; give calibration text instead "
                            "(--calib-samples 0)")
        sampled, seconds = [], 0.0
        if samples:
            started = time.perf_counter()
            model_file = source_file(source)
            if model_file is None:
                raise ValueError("the source model was not loaded from a file: nothing to sample calibration from")
            with ctx.progress("profile: sampling calibration sequences from the model"):
                # from the fitted sequences' first tokens only: a measured sequence's first token would reach the
                # fits through the samples (a model's states hang on it; a predictor learns them)
                sampled = sample_sequences(model_file, samples, length,
                                           given[: len(given) - measured] if self.calib else [], self.seed, vocab_size)
            seconds = time.perf_counter() - started
        # The given tokens go last: the predictors' held-out tokens (the last ones) are then the user's text
        sequences = sampled + given
        CalibrationSequences(sequences, measured).attach(model)
        tokens = sum(len(s) for s in sequences)
        profiled_sequences = sequences[: len(sequences) - measured]  # what the fits see
        profiled_tokens = sum(len(s) for s in profiled_sequences)
        self._report(ctx, given_tokens, profiled_tokens, samples, length, seconds, width, needed)
        calibration = Calibration(tokens=tokens, given_tokens=given_tokens,  # inspect shows what the fits had
                                  source=str(self.calib) if self.calib else "random tokens", sampled_sequences=samples,
                                  sequence_tokens=length, wanted_tokens=needed)
        write_entry(model, CALIBRATION_KEY, calibration)
        kept = (f"; {tokens - profiled_tokens} of the user's, across the file, kept out of the fits" if measured
                else "")
        if not self.activations:
            ctx.log(f"profile: {tokens} tokens, {len(sequences)} sequences (the model is run by the passes after)"
                    + kept)
            return PassResult(model, modified=True)
        sequences, tokens = profiled_sequences, profiled_tokens

        # a directory of its own: an earlier profile's memory maps (say, in the same workdir) keep their files
        spill = _Spill(Path(tempfile.mkdtemp(prefix="activations-", dir=ctx.workdir)), tokens)
        layers = {FFN(node).layer: (node.metadata_props["source.input"],
                                                  node.metadata_props["source.activation"]) for node in ffns}
        starts = np.cumsum([0] + [len(s) for s in sequences])  # each sequence's first row
        layered = self.layered if self.layered is not None else too_big
        if layered:  # one layer's weights in onnxruntime at a time
            cuts = layer_cuts(lifted_layer_inputs(model), layers)
            with ctx.progress("profile: calibration sequences, layer by layer", len(cuts) * len(sequences)) as advance:
                for cut, index, outputs in run_layers(source, cuts, sequences, Path(ctx.workdir)):
                    with ctx.layer(cut.layer):
                        input_name, activation_name = layers[cut.layer]
                        spill.write(cut.layer, starts[index], outputs[input_name], outputs[activation_name])
                    advance()
        else:
            decoder = reference_decoder(source, wanted, Path(ctx.workdir))  # after sampling's session is gone
            with ctx.progress("profile: calibration sequences", len(sequences)) as advance:
                for index, outputs in enumerate(run_reference(decoder, wanted, sequences)):
                    for layer, (input_name, activation_name) in layers.items():
                        with ctx.layer(layer):
                            spill.write(layer, starts[index], outputs[input_name], outputs[activation_name])
                    advance()
            del decoder
        profiled = spill.close()
        stats = {}
        for node in ffns:
            layer = FFN(node).layer
            s = stats[layer] = layer_stats(spill.counts[layer] / max(tokens, 1))
            pir.initializer(model.graph, f"layers.{layer}.ffn.frequency", s.frequency)
            for key in ("sparsity", "skewness", "hot80_share"):
                FFN(node).set(key, getattr(s, key))
        profiled.attach(model)
        plot = Path(ctx.workdir) / "plots" / "activation_cdf.png"
        plot_cdf(stats, plot)
        ctx.artifact_files["plots/activation_cdf.png"] = plot
        mean_sparsity = float(np.mean([s.sparsity for s in stats.values()]))
        ctx.log(f"profile: {tokens} tokens, mean sparsity {mean_sparsity:.3f}, "
                f"hot 80% carried by {np.mean([s.hot80_share for s in stats.values()]) * 100:.1f}% of neurons{kept}")
        return PassResult(model, modified=True)

    def _report(self, ctx: Context, given: int, tokens: int, samples: int, length: int, seconds: float,
                width: int, needed: int) -> None:
        """One line on what was sampled and whether the calibration data is small for the model: a warning
        where the user should act, else a log line. Random tokens (no --calib) have their own line."""
        rule = (f"fewer than {MIN_TOKENS_PER_NEURON} per FFN neuron ({needed} for layers {width} wide)"
                if self.wanted_tokens is None else f"fewer than the {needed} wanted")
        drawn = f"sampled {samples} sequences of {length} tokens from the model in {seconds:.2f}s"
        if self.calib is not None and samples and self.calib_samples is None:
            ctx.warn(f"profile: {self.calib} gives {given} calibration tokens, {rule}: {drawn} "
                     f"(--calib-samples N sets how many, 0 none)")
        elif (self.calib is not None or samples) and tokens < needed:
            more = math.ceil((needed - tokens) / length)
            ctx.warn(f"profile: {tokens} calibration tokens, {rule}: what the build fits to them (predictors, "
                     f"placement, thresholds) rests on little data; give more calibration text or add "
                     f"--calib-samples {samples + more}")
        elif samples:
            ctx.log(f"profile: {drawn}")
