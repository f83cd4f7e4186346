"""place: decide the device of every block of the IR. The one pass that does; kernel selection reads it.

Reads: the block IR (after fuse; in predictor mode after lower: `picompile.SparseFFN` parts carry `part`
"gpu"/"cpu"), partition's plan (`PlacementReport.of(model).plan`: the embedding's, each layer's attention block's
and the output layer's device, each FFN's `placed`), the target and the budget.
Adds: the device ("cpu" or "gpu") of every node, in its `picompile.device` metadata (standard ONNX ops
may not carry foreign attributes; `device_of` reads it), and `picompile.devices` (a `Devices`: the rule, the
layers with a block on the GPU and, for layer offload, the model's and the budget's bytes) that `inspect` and
`-v` show.

- No GPU on the target: everything on the CPU.
- With partition's plan (dense and predictor builds): each node where the plan puts its block
  (`pir.node_blocks`): a layer's nodes with its attention block (norms, residual adds, the predictor and the FFN's
  merge run where the residual stream is), except a dense FFN (where `placed` says) and a sparse FFN's parts
  (each on its own device); the embedding's and the output layer's nodes where the plan puts them.
- Without one (threshold mode): whole layers in order while they fit the budget (llama.cpp's layer offload),
  the embedding and output layer on the CPU (the budget: `ctx.build.gpu`, less its reserve); weights priced at the precision the GPU stores them in
  (`sizes.gpu_bytes`: fp16 matrices), each layer with its KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import PassResult

from .facts import read_entry, write_entry
from . import ir as pir
from .ops import FFN, Attention, SparseFFN
from .pipeline import Context, Fact
from .recognise import BLOCKS
from .sizes import gpu_bytes, kv_cache_bytes
from .targets import format_size

from runtime.manifest import Devices
from .costmodel import Plan
from .partition import PlacementReport

DEVICE_KEY = "picompile.device"
DEVICES_KEY = "picompile.devices"  # metadata: the rule (runtime.manifest.Devices)


def devices_of(model: ir.Model) -> Devices | None:
    """The place pass's rule (None where it did not run)."""
    return read_entry(model, DEVICES_KEY, Devices)


def device_of(node: ir.Node) -> str:
    """The device place chose for a node."""
    return node.metadata_props[DEVICE_KEY]


def set_device(node: ir.Node, device: str) -> None:
    """Place a node a later pass adds (a hand-over between machines) on `device`."""
    node.metadata_props[DEVICE_KEY] = device


PLACED = Fact("a device for every node", "place",
              lambda model: all(DEVICE_KEY in node.metadata_props for node in model.graph))


def _gpu_bytes(node: ir.Node, max_context: int) -> int:
    """What the node keeps on the GPU: its weights (at the GPU's precision) and, for attention, its KV cache."""
    total = sum(gpu_bytes(value.const_value.shape) for value in node.inputs
                if value is not None and value.const_value is not None)
    if Attention.matches(node):
        total += kv_cache_bytes([(Attention(node).num_kv_heads, Attention(node).head_dim)], max_context)
    return total


@dataclass
class Place:
    name = "place"
    requires = (BLOCKS,)
    adds = (PLACED,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        nodes = list(model.graph)
        if not ctx.target.has_gpu:
            devices = {node: "cpu" for node in nodes}
            summary = {"rule": "no GPU on the target"}
        elif (report := PlacementReport.of(model)) is not None:
            devices, summary = self._planned(model, nodes, report.plan)
        else:
            devices, summary = self._layer_offload(model.graph, nodes, ctx)
        for node, device in devices.items():
            node.metadata_props[DEVICE_KEY] = device
        write_entry(model, DEVICES_KEY, Devices(**summary))
        on_gpu = sum(1 for device in devices.values() if device == "gpu")
        ctx.log(f"place: {on_gpu} of {len(nodes)} blocks on the GPU ({summary['rule']})")
        return PassResult(model, modified=True)

    @staticmethod
    def _planned(model: ir.Model, nodes: list[ir.Node], plan: Plan) -> tuple[dict, dict]:
        blocks = pir.node_blocks(model.graph)
        devices = {}
        for node in nodes:
            block = blocks[node]
            if SparseFFN.matches(node):
                devices[node] = SparseFFN(node).part
            elif FFN.matches(node):
                devices[node] = FFN(node).placed
            elif block == pir.EMBED:
                devices[node] = plan.embed
            elif block == pir.HEAD:
                devices[node] = plan.head
            else:
                devices[node] = plan.attention[block]
        gpu_layers = sorted({blocks[n] for n, d in devices.items() if d == "gpu" and isinstance(blocks[n], int)})
        on_gpu = [name for name, device in (("embedding", plan.embed), ("output layer", plan.head))
                  if device == "gpu"]
        rule = (f"partition's plan: {len(gpu_layers)} layers with blocks on the GPU"
                + (f", the {' and '.join(on_gpu)}" if on_gpu else ""))
        return devices, {"rule": rule, "gpu_layers": gpu_layers}

    def _layer_offload(self, graph: ir.Graph, nodes: list[ir.Node], ctx: Context) -> tuple[dict, dict]:
        budget = ctx.build.gpu.usable_bytes  # partition's budget: the same reserve
        layers = pir.node_layers(graph)
        per_layer: dict[int | None, int] = {}
        for node in nodes:
            per_layer[layers[node]] = per_layer.get(layers[node], 0) + _gpu_bytes(node, ctx.build.max_context)
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
