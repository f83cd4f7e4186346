"""profile: run calibration tokens through the dense model and count how often each FFN neuron fires.

Reads: the block IR's `picompile.FFN` nodes (their `source.input` / `source.activation` metadata name the
tensors in the source graph), the source graph itself (`recognise.source_model`, on the IR's `meta`), which
onnxruntime runs as the reference executor, and its fields: the calibration file `calib` (None: random
tokens), `calib_tokens`, `max_context` (sequences are cut to min(max_context, 128) tokens) and `seed`.
Adds per FFN layer: an initializer `layers.{i}.ffn.frequency` (float32 [ffn]: fraction of calibration
tokens on which each neuron was active) and float attributes `sparsity`, `skewness` (of the frequency
distribution) and `hot80_share` (the share of neurons that carry 80% of all activations). The FFN inputs and
activity masks, too large to serialise, ride on the IR's `meta` as one `ProfiledActivations` for the predict
and threshold passes. The activation CDF per layer is plotted into the artifact (`plots/activation_cdf.png`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.errors import UserError
from picompile.pipeline import Context, Options
from picompile.tokens import read_tokens
from runtime.artifact import first_line

from .recognise import source_model

PROFILED = "picompile.profiled_activations"  # the IR's `meta` entry


@dataclass
class LayerActivations:
    """One FFN layer over the profiled tokens (sequence-major)."""

    inputs: np.ndarray  # [tokens, d_model] float32: the FFN's input after its norm (what gate and up read)
    active: np.ndarray  # [tokens, ffn] bool: which neurons fired (activation output != 0)


@dataclass
class ProfiledActivations:
    """What the profile pass saw, per layer, for the passes that fit to it (predict, threshold)."""

    layers: dict[int, LayerActivations]

    def attach(self, model: ir.Model) -> None:
        model.meta[PROFILED] = self

    @classmethod
    def of(cls, model: ir.Model) -> "ProfiledActivations":
        profiled = model.meta.get(PROFILED)
        if profiled is None:
            raise ValueError("the IR carries no profiled activations (run the profile pass first)")
        return profiled

    def layer(self, index: int) -> LayerActivations:
        if index not in self.layers:
            raise ValueError(f"layer {index} was not profiled (run the profile pass first)")
        return self.layers[index]


@dataclass
class LayerStats:
    frequency: np.ndarray
    sparsity: float
    skewness: float
    hot80_share: float


def layer_stats(active: np.ndarray) -> LayerStats:
    frequency = active.mean(axis=0, dtype=np.float64)
    centred = frequency - frequency.mean()
    spread = frequency.std()
    skewness = float((centred**3).mean() / spread**3) if spread > 0 else 0.0
    ranked = np.sort(frequency)[::-1]
    total = ranked.sum()
    hot80 = 1.0 if total == 0 else float((np.searchsorted(np.cumsum(ranked), 0.8 * total) + 1) / ranked.size)
    return LayerStats(frequency.astype(np.float32), float(1.0 - frequency.mean()), skewness, hot80)


def calibration_tokens(calib: Path | None, budget: int, length: int, seed: int, vocab_size: int,
                       log=lambda message: None) -> list[np.ndarray]:
    """The sequences of `calib` cut to `length` tokens, or random tokens (fit only for synthetic models),
    up to `budget` tokens."""
    if calib is None:
        log("profile: no --calib file: profiling on random tokens, which is only fit for synthetic models")
        rng = np.random.default_rng(seed)
        return [rng.integers(0, vocab_size, size=length) for _ in range(max(1, budget // length))]
    sequences, used = [], 0
    for sequence in read_tokens(calib):
        if int(sequence.max()) >= vocab_size:
            raise UserError(f"{calib} holds token id {int(sequence.max())}, outside the vocabulary ({vocab_size})")
        for begin in range(0, len(sequence), length):
            if used >= budget:
                return sequences
            sequences.append(sequence[begin: begin + length])
            used += len(sequences[-1])
    return sequences


def run_reference(source: ir.Model, wanted: list[str], sequences: list[np.ndarray], workdir: Path):
    """Yield the wanted source-graph tensors for each sequence, run by onnxruntime (empty KV cache)."""
    import onnxruntime as ort

    values = {v.name: v for node in source.graph for v in node.outputs}
    for name in wanted:
        value = values[name]
        value.dtype = value.dtype or ir.DataType.FLOAT
        if value not in source.graph.outputs:
            source.graph.outputs.append(value)
    path = workdir / "profile-source.onnx"
    pir.save(source, path)
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime's own exception types: the source model is not valid ONNX
        reason = first_line(error, type(error).__name__)
        raise UserError(f"onnxruntime cannot load the model to profile it: {reason}") from None
    inputs = {i.name: i for i in session.get_inputs()}
    for sequence in sequences:
        feeds = {"input_ids": sequence.astype(np.int64)[None]}
        for name, info in inputs.items():
            if name == "attention_mask":
                feeds[name] = np.ones((1, len(sequence)), np.int64)
            elif name == "position_ids":
                feeds[name] = np.arange(len(sequence), dtype=np.int64)[None]
            elif name.startswith("past_key_values."):
                feeds[name] = np.zeros((1, info.shape[1], 0, info.shape[3]), np.float32)
        try:
            results = session.run(wanted, feeds)
        except Exception as error:  # onnxruntime's own types: a node of the source model fails on real tokens
            reason = first_line(error, type(error).__name__)
            raise UserError(f"onnxruntime cannot run the model on calibration tokens: {reason}") from None
        yield dict(zip(wanted, results))


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


@dataclass
class Profile:
    name = "profile"
    calib: Path | None = Options.calib
    calib_tokens: int = Options.calib_tokens
    max_context: int = Options.max_context
    seed: int = Options.seed

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        source = source_model(model)
        ffns = pir.nodes_in_domain(model, "FFN")
        vocab_size = pir.const_array(model.graph.initializers["embed.tokens"]).shape[0]
        sequences = calibration_tokens(self.calib, self.calib_tokens, min(self.max_context, SEQUENCE_TOKENS),
                                       self.seed, vocab_size, ctx.log)
        wanted = [name for node in ffns for name in (node.metadata_props["source.input"], node.metadata_props["source.activation"])]
        collected: dict[str, list[np.ndarray]] = {name: [] for name in wanted}
        with ctx.progress("profile: calibration sequences", len(sequences)) as advance:
            for outputs in run_reference(source, wanted, sequences, Path(ctx.workdir)):
                for name, array in outputs.items():
                    collected[name].append(array.reshape(-1, array.shape[-1]))
                advance()
        stats, profiled = {}, ProfiledActivations({})
        for node in ffns:
            layer = pir.attr(node, "layer")
            with ctx.layer(layer):
                inputs = np.concatenate(collected[node.metadata_props["source.input"]]).astype(np.float32)
                active = np.concatenate(collected[node.metadata_props["source.activation"]]) != 0
                profiled.layers[layer] = LayerActivations(inputs, active)
                s = stats[layer] = layer_stats(active)
                pir.initializer(model.graph, f"layers.{layer}.ffn.frequency", s.frequency)
                for key in ("sparsity", "skewness", "hot80_share"):
                    node.attributes[key] = ir.AttrFloat32(key, getattr(s, key))
        profiled.attach(model)
        plot = Path(ctx.workdir) / "plots" / "activation_cdf.png"
        plot_cdf(stats, plot)
        ctx.artifact_files["plots/activation_cdf.png"] = plot
        tokens = sum(len(s) for s in sequences)
        mean_sparsity = float(np.mean([s.sparsity for s in stats.values()]))
        ctx.log(f"profile: {tokens} tokens, mean sparsity {mean_sparsity:.3f}, "
                f"hot 80% carried by {np.mean([s.hot80_share for s in stats.values()]) * 100:.1f}% of neurons")
        return PassResult(model, modified=True)
