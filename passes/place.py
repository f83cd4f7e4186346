"""place: decide the device of every block of the IR. The one pass that does; kernel selection reads it.

Reads: the block IR (after recognise, fuse and, in predictor mode, lower: `picompile.SparseFFN` parts
carry `part` "gpu"/"cpu" and `picompile.Predict` its device, as partition's solve made them), partition's
report (`picompile.placement`: the FFN budget left after the dense part), the target and the budget.
Adds: the device ("cpu" or "gpu") of every node, in its `picompile.device` metadata (standard ONNX ops
may not carry foreign attributes; `device_of` reads it), and `picompile.devices` (a JSON summary:
which layers' dense blocks are on the GPU, their bytes, the budget) that `inspect` and `-v` show.

- No GPU on the target: everything on the CPU.
- Neuron-split FFNs (predictor mode): each part where partition put it; the dense blocks (attention,
  norms, embedding, output layer, merges) on the GPU when partition found room for them (its FFN budget
  is what is left after them), else on the CPU.
- Otherwise (dense builds): the whole model on the GPU if it fits the budget (the target's GPU memory or
  `--vram-budget`, less partition's reserve); if not, whole layers in order while they fit (llama.cpp's
  layer offload), the embedding and the output layer on the CPU.
Weights are priced at the precision the GPU stores them in (`sizes.gpu_bytes`: fp16 matrices) and each layer
with its KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import PassResult

from picompile import ir as pir
from picompile.pipeline import Context
from picompile.sizes import gpu_bytes, kv_cache_bytes
from picompile.targets import format_size

from .partition import RESERVE_FRACTION

DEVICE_KEY = "picompile.device"


def device_of(node: ir.Node) -> str:
    """The device place chose for a node."""
    return node.metadata_props[DEVICE_KEY]


def node_layers(graph: ir.Graph) -> dict[ir.Node, int | None]:
    """Each node's decoder layer: its `layer` attribute, else the lowest layer among the nodes that read it
    (a norm belongs to the block it feeds); None outside the layers (embedding, final norm, output layer)."""
    layers: dict[ir.Node, int | None] = {}
    for node in reversed(list(graph)):
        if "layer" in node.attributes:
            layers[node] = int(pir.attr(node, "layer"))
            continue
        readers = [layers.get(user) for value in node.outputs for user in value.consumers()]
        known = [layer for layer in readers if layer is not None]
        layers[node] = min(known) if known else None
    return layers


def _gpu_bytes(node: ir.Node, max_context: int) -> int:
    """What the node keeps on the GPU: its weights (at the GPU's precision) and, for attention, its KV cache."""
    total = sum(gpu_bytes(value.const_value.shape) for value in node.inputs
                if value is not None and value.const_value is not None)
    if node.op_type == "Attention":
        total += kv_cache_bytes([(pir.attr(node, "num_kv_heads"), pir.attr(node, "head_dim"))], max_context)
    return total


@dataclass
class Place:
    name = "place"
    vram_budget_bytes: int | None = None  # overrides the target's GPU memory
    max_context: int = 256

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        nodes = list(model.graph)
        if not ctx.target.has_gpu:
            devices = {node: "cpu" for node in nodes}
            summary = {"rule": "no GPU on the target"}
        elif any(node.op_type == "SparseFFN" for node in nodes):
            devices, summary = self._neuron_split(model, nodes)
        else:
            devices, summary = self._layer_offload(model.graph, nodes, ctx)
        for node, device in devices.items():
            node.metadata_props[DEVICE_KEY] = device
        model.metadata_props["picompile.devices"] = json.dumps(summary, sort_keys=True)
        on_gpu = sum(1 for device in devices.values() if device == "gpu")
        ctx.log(f"place: {on_gpu} of {len(nodes)} blocks on the GPU ({summary['rule']})")
        return PassResult(model, modified=True)

    @staticmethod
    def _neuron_split(model: ir.Model, nodes: list[ir.Node]) -> tuple[dict, dict]:
        placement = json.loads(model.metadata_props.get("picompile.placement", "{}"))
        dense_fits = placement.get("budget_bytes", 0) > 0  # partition's FFN budget is what the dense part left
        dense = "gpu" if dense_fits else "cpu"
        devices = {}
        for node in nodes:
            if node.op_type == "SparseFFN":
                devices[node] = pir.attr(node, "part")
            elif node.op_type == "Predict":
                devices[node] = pir.attr(node, "device")
            else:
                devices[node] = dense
        rule = "dense blocks on the GPU, FFN neurons split by partition" if dense_fits else \
            "the dense part does not fit the GPU budget: all on the CPU"
        return devices, {"rule": rule}

    def _layer_offload(self, graph: ir.Graph, nodes: list[ir.Node], ctx: Context) -> tuple[dict, dict]:
        budget_total = self.vram_budget_bytes if self.vram_budget_bytes is not None else ctx.target.gpu_memory_bytes
        budget = int(budget_total * (1 - RESERVE_FRACTION))
        layers = node_layers(graph)
        per_layer: dict[int | None, int] = {}
        for node in nodes:
            per_layer[layers[node]] = per_layer.get(layers[node], 0) + _gpu_bytes(node, self.max_context)
        total = sum(per_layer.values())
        if total <= budget:
            gpu_layers = set(per_layer)
        else:
            gpu_layers, used = set(), 0
            for layer in sorted(key for key in per_layer if key is not None):
                if used + per_layer[layer] > budget:
                    break
                gpu_layers.add(layer)
                used += per_layer[layer]
        devices = {node: "gpu" if layers[node] in gpu_layers else "cpu" for node in nodes}
        layered = sorted(layer for layer in gpu_layers if layer is not None)
        rule = ("the whole model fits the GPU budget" if total <= budget else
                f"{len(layered)} whole layers fit the GPU budget ({format_size(budget)} of {format_size(total)})")
        return devices, {"rule": rule, "gpu_layers": layered, "model_bytes": total, "budget_bytes": budget}
