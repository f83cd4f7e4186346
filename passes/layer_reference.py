"""onnxruntime on the source graph one decoder layer at a time: the profile's reference executor for models whose
weights onnxruntime cannot hold at once (it widens a half-precision model's weights to fp32 as it loads them).

The source graph is cut at the residual stream entering each layer (the Attention node's `source.layer_input`,
which recognise records). Layer i's part reads that value, fed from the part before, and the graph inputs its
shared computations read (mask, positions, an empty past); it outputs the next layer's input and the tensors the
profile wants. Each part is saved into the workdir with its own weights only and runs every calibration sequence
before the next part is made, so onnxruntime holds one layer's weights at a time and the hidden states between
layers (tokens x d_model floats) are all that is carried. The first part reads input_ids (it holds the embedding).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx_ir as ir

from . import ir as pir
from .file_blocks import FileTensor
from . import memory
from .errors import UserError
from .ops import Attention
from .reference import OrtDecoder
from runtime import dtypes
from runtime.artifact import available_memory_bytes, first_line


@dataclass(frozen=True)
class LayerCut:
    """One part of the source graph: what it reads besides the graph inputs, and what it gives."""

    layer: int
    input: str | None  # the residual stream entering the layer (None: the first part, which starts at input_ids)
    next_input: str | None  # the residual stream entering the next layer (None: the last part)
    wanted: tuple[str, ...]  # the source tensors the caller wants from this layer

    @property
    def outputs(self) -> tuple[str, ...]:
        """What the part computes: the next layer's input (where there is one), then the wanted tensors."""
        return ((self.next_input,) if self.next_input else ()) + self.wanted


# onnxruntime holds a model's weights in fp32 (it widens fp16 ones as it loads them), beside the build's own
# working set: the whole source runs at once only where that fits in this share of the memory available
WHOLE_MODEL_MEMORY_SHARE = 0.5


def needs_layers(source: ir.Model) -> bool:
    """Whether onnxruntime could not hold the whole source model's weights, or the model keeps a file's blocks
    (`FileTensor`: onnxruntime would hold their float copy): run it layer by layer."""
    if any(isinstance(value.const_value, FileTensor) for value in source.graph.initializers.values()):
        return True
    available = available_memory_bytes()
    fp32_bytes = sum(dtypes.nbytes(list(value.const_value.shape), "float32")
                     for value in source.graph.initializers.values() if value.const_value is not None)
    return available is not None and fp32_bytes > WHOLE_MODEL_MEMORY_SHARE * available


def lifted_layer_inputs(lifted: ir.Model) -> dict[int, str]:
    """Each layer's residual stream in the source graph, as recognise recorded it on the lifted IR."""
    return {Attention(node).layer: node.metadata_props["source.layer_input"] for node in Attention.nodes(lifted)}


def layer_cuts(inputs: dict[int, str], wanted: dict[int, tuple[str, ...]]) -> list[LayerCut]:
    """The cuts of the source graph, one per decoder layer (`inputs`: each layer's residual stream)."""
    layers = sorted(inputs)
    return [LayerCut(layer, inputs[layer] if index else None,
                     inputs[layers[index + 1]] if index + 1 < len(layers) else None, tuple(wanted.get(layer, ())))
            for index, layer in enumerate(layers)]


def _reads(graph: ir.Graph, outputs: list[ir.Value], stop: ir.Value | None) -> tuple[list[ir.Value], set[str]]:
    """The graph inputs the computation of `outputs` reads when `stop` is given, and the names of every value
    it computes (to tell whether the part is bounded by `stop`)."""
    graph_inputs = {id(value) for value in graph.inputs}
    reached, computed, seen, queue = [], set(), set(), deque(outputs)
    while queue:
        value = queue.popleft()
        if id(value) in seen or value is stop:
            continue
        seen.add(id(value))
        if id(value) in graph_inputs:
            reached.append(value)
            continue
        node = value.producer()
        if node is None:
            continue
        computed.update(v.name for v in node.outputs)
        queue.extend(v for v in node.inputs if v is not None)
    order = {id(value): index for index, value in enumerate(graph.inputs)}
    return sorted(reached, key=lambda value: order[id(value)]), computed


def part_model(source: ir.Model, cut: LayerCut, previous: LayerCut | None) -> ir.Model:
    """Layer `cut.layer`'s part of the source graph, as a model of its own. Refuses (UserError) a graph whose
    layers do not come apart at their residual streams (the part would recompute the layer before)."""
    values = ir.convenience.create_value_mapping(source.graph)
    outputs = [values[name] for name in cut.outputs]
    for value in outputs:
        value.dtype = value.dtype or ir.DataType.FLOAT
    start = values[cut.input] if cut.input else None
    reads, computed = _reads(source.graph, outputs, start)
    if previous is not None and previous.input is not None and previous.input in computed:
        raise UserError(f"layer {cut.layer} of the model cannot be profiled on its own (its part of the graph "
                        f"recomputes layer {previous.layer}: an export that fuses across layers); profiling it whole "
                        "needs its fp32 weights in memory")
    graph = ir.convenience.extract(source.graph, [*([start] if start is not None else []), *reads], outputs)
    # weights still in the user's external data file stay so: `pir.save` copies them into the part's own file
    return ir.Model(graph, ir_version=source.ir_version)


def run_layers(source: ir.Model, cuts: list[LayerCut], sequences: list[np.ndarray],
               workdir: Path) -> Iterator[tuple[LayerCut, int, dict[str, np.ndarray]]]:
    """For each layer in order, for each sequence (from an empty KV cache): (cut, sequence index, the wanted
    tensors as [tokens, width] rows). One part's session and weights exist at a time."""
    hidden: list[np.ndarray | None] = [None] * len(sequences)
    previous = None
    for cut in cuts:
        path = workdir / f"profile-layer{cut.layer}.onnx"
        pir.save(part_model(source, cut, previous), path)
        pir.release_mapped_pages(source)  # the layer's weights were read from the file into the part
        try:
            decoder = OrtDecoder(path)
        except Exception as error:  # onnxruntime's own exception types
            raise UserError(f"onnxruntime cannot load layer {cut.layer} of the model to profile it: "
                            f"{first_line(error, type(error).__name__)}") from None
        for index, sequence in enumerate(sequences):
            decoder.reset()
            extra = {cut.input: hidden[index]} if cut.input else None
            try:
                results = decoder.run(sequence[None], list(cut.outputs), extra)
            except Exception as error:  # onnxruntime's own types: a node fails on real tokens
                raise UserError(f"onnxruntime cannot run layer {cut.layer} of the model on calibration tokens: "
                                f"{first_line(error, type(error).__name__)}") from None
            hidden[index] = results[cut.next_input] if cut.next_input else None
            yield cut, index, {name: results[name].reshape(-1, results[name].shape[-1]) for name in cut.wanted}
        del decoder
        for suffix in ("", ".data"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        memory.return_freed_memory()  # the part's session and protobuf: else the heap grows by a layer each
        previous = cut


class LayeredReference:
    """eval's reference where onnxruntime cannot hold the model: the user's ONNX run layer by layer (the
    profile's parts, the last one ending at the logits), for all of eval's sequences at once (`prepare`), each
    from an empty KV cache. `forward` then returns a prepared sequence's logits, as OrtDecoder.forward does."""

    def __init__(self, source: ir.Model, layer_inputs: dict[int, str], workdir: Path):
        self.source, self.workdir = source, Path(workdir)
        self.cuts = layer_cuts(layer_inputs, {max(layer_inputs): ("logits",)})
        self.logits: dict[bytes, np.ndarray] = {}

    def prepare(self, sequences: list[np.ndarray]) -> None:
        sequences = [np.asarray(s, np.int64) for s in sequences]
        for cut, index, outputs in run_layers(self.source, self.cuts, sequences, self.workdir):
            if "logits" in outputs:
                self.logits[sequences[index].tobytes()] = outputs["logits"]

    def reset(self) -> None:
        pass

    def forward(self, sequence) -> np.ndarray:
        key = np.asarray(sequence, np.int64).tobytes()
        if key not in self.logits:  # not prepared: one more pass over the layers
            self.prepare([sequence])
        return self.logits[key]
