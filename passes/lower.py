"""lower: replace each dense FFN with the sparse ops of the build's mode (one pass per mode).

`LowerPredicted` (predictor mode) splits each FFN into a hot (GPU) and a cold (CPU) part.
Reads: `picompile.FFN` nodes with what the earlier passes added: `placed`, `placed_reason`, `gpu_neurons` and
the initializer `layers.{i}.ffn.neuron_order` (partition), the predictor initializers and `predictor_threshold`
(predict), the profile statistics. An FFN partition placed dense (`placed` "gpu" or "cpu") stays as it is, the
layer report saying why. Adds, per other layer, in place of the FFN (place puts each part on its device, the
predictor and the merge with the layer's attention block):
  `picompile.Predict`     x -> one score vector per part (the predictor's d -> r -> ffn MLP, columns
                          permuted hottest first and split at gpu_neurons);
  `picompile.SparseFFN`   per part: neurons whose score passes the threshold are computed as a gathered-
                          row GEMV (up, and gate when gated; rows stored one per neuron) and an axpy over
                          the same rows of the down projection (PowerInfer's ffn_down_t); multi-token
                          prompts compute the whole part densely;
  `picompile.MergePartial` adds the parts and the down bias.
Weights are permuted so that each part is a contiguous block of rows. With its field `all_neurons`
(--all-neurons) the threshold admits every neuron: the split and merge are then exactly the dense FFN
(what tests check).

`LowerThresholded` (threshold mode: FFN nodes carrying `threshold_in` / `threshold_down`, from the
threshold pass) makes each FFN instead, on the CPU:
  `picompile.ThresholdFFN` x -> the FFN without its down bias, decode reading only the weight rows of the
                          inputs that pass: gate and up read the rows (one per input channel, w_up [D, 2F]
                          as stored) of the channels with |x| > threshold_in, down the rows (w_down [F, D])
                          of the neurons with |h| > threshold_down; multi-token prompts run densely;
  `picompile.MergePartial` adds the down bias.
A threshold < 0 (`threshold.KEEP_ALL`) means that projection runs dense; an FFN whose two thresholds are < 0 stays
the plain `FFN` (select-kernels lowers it as a dense build does). The layer report carries every projection
input's threshold and held-out dropped share, attention's (`threshold_qkv` / `threshold_o`, `sparsity_qkv` /
`sparsity_o` on the Attention node, read by select-kernels there) included: KEEP_ALL and 0.0 where absent or
dense. The cost model prices each threshold call by those shares (`costmodel.expected_share`). Where the quality
plan thins the output layer's input (`quality.HeadThreshold`), its MatMul becomes `picompile.Linear` with that
`threshold` and `sparsity` (fuse makes every other output layer a Linear).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .pipeline import Context, Options

from .ops import ALL_NEURONS, FFN, Attention, view as op_view
from .partition import PARTITIONED
from .predict import PREDICTORS
from .ir_reference import head_node
from .quality import HeadThreshold, WeightPlan
from .recognise import BLOCKS
from .threshold import KEEP_ALL
from runtime.manifest import LayerReport

LAYERS_KEY = "picompile.layers"  # metadata: the per-layer report (runtime.manifest.LayerReport, one per layer)
STATS = ("sparsity", "skewness", "hot80_share", "predictor_rank", "predictor_threshold", "predictor_recall",
         "predictor_precision", "predictor_active")


def attach_layers(model: ir.Model, layers: list[LayerReport]) -> None:
    model.metadata_props[LAYERS_KEY] = json.dumps([layer.to_json() for layer in layers])


def layers_of(model: ir.Model) -> list[LayerReport]:
    """The lower pass's per-layer report ([] where it did not run: a dense build)."""
    return [LayerReport.from_json(layer) for layer in json.loads(model.metadata_props.get(LAYERS_KEY, "[]"))]


def _rows(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A part's rows in the precision the weights are stored in (an fp16 model's stay fp16: widening them here
    doubled a 7B build's peak memory)."""
    return pir.initializer(graph, name, np.ascontiguousarray(pir.weight_array(array)))


@dataclass
class LowerThresholded:
    name = "lower"
    requires = (BLOCKS,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        graph = model.graph
        attention = {Attention(node).layer: node for node in Attention.nodes(model)}
        report = [self._lower_one(graph, node, attention.get(FFN(node).layer)) for node in FFN.nodes(model)]
        pir.drop_unused_initializers(graph)  # dense FFN weights, frequencies, orders: folded into the new ops
        attach_layers(model, [LayerReport(**r) for r in report])
        dense = [r["layer"] for r in report if r.get("ffn") == "dense"]
        head = HeadThreshold.of(model)
        if head is not None:
            _thin_output_layer(graph, head_node(model), head)
        ctx.log(f"lower: {len(report) - len(dense)} threshold FFNs"
                f"{f'; {len(dense)} dense (layers {dense})' if dense else ''}"
                f"{f'; the output layer drops {head.dropped:.2f} of its inputs' if head is not None else ''}")
        return PassResult(model, modified=True)

    def _lower_one(self, graph: ir.Graph, node: ir.Node, attention: ir.Node | None) -> dict:
        """The layer's FFN as ThresholdFFN + MergePartial, or left a dense FFN where both its thresholds are
        < 0 (KEEP_ALL: the plan runs it dense); its report: each projection input's threshold and held-out
        dropped share (attention's too: absent, or < 0, means dense, a share of 0)."""
        ffn = FFN(node)
        layer = ffn.layer
        prefix = f"layers.{layer}.ffn"
        report = {"layer": layer, "mode": "threshold", **_thresholds(node, FFN_INPUTS), **_thresholds(attention, ATTENTION_INPUTS)}
        if report["threshold_in"] < 0 and report["threshold_down"] < 0:
            return {**report, "ffn": "dense"}
        thresholded = ir.node("ThresholdFFN", list(node.inputs[:4]), {
            "layer": layer, "activation": ffn.activation, "gated": ffn.gated,
            "threshold_in": report["threshold_in"], "threshold_down": report["threshold_down"],
        }, domain=pir.DOMAIN, name=f"{prefix}.threshold")
        graph.insert_before(node, thresholded)
        merge = ir.node("MergePartial", [thresholded.outputs[0], node.inputs[4]], {"layer": layer},
                        domain=pir.DOMAIN, name=f"{prefix}.merge")
        graph.insert_before(node, merge)
        thresholded.outputs[0].name, merge.outputs[0].name = f"{prefix}.partial.cpu", f"{prefix}.merged"
        for value in (thresholded.outputs[0], merge.outputs[0]):
            value.dtype, value.shape = ir.DataType.FLOAT, node.outputs[0].shape
        node.outputs[0].replace_all_uses_with(merge.outputs[0])
        graph.remove(node, safe=True)
        return report


def _thin_output_layer(graph: ir.Graph, product: ir.Node, head: HeadThreshold) -> None:
    """The output layer's MatMul `product` as a `picompile.Linear` reading only the rows of its input channels
    above the threshold in decode steps."""
    linear = ir.node("Linear", list(product.inputs), {"threshold": head.threshold, "sparsity": head.dropped},
                     domain=pir.DOMAIN, name=product.name)
    graph.insert_before(product, linear)
    linear.outputs[0].dtype, linear.outputs[0].shape = product.outputs[0].dtype, product.outputs[0].shape
    name = product.outputs[0].name
    product.outputs[0].replace_all_uses_with(linear.outputs[0], replace_graph_outputs=True)
    graph.remove(product, safe=True)
    linear.outputs[0].name = name


# the thresholded inputs of each block: (threshold attribute, held-out sparsity attribute)
FFN_INPUTS = (("threshold_in", "sparsity_in"), ("threshold_down", "sparsity_down"))
ATTENTION_INPUTS = (("threshold_qkv", "sparsity_qkv"), ("threshold_o", "sparsity_o"))


def _thresholds(node: ir.Node | None, inputs) -> dict:
    """A block's thresholds and their held-out sparsities, KEEP_ALL and 0.0 where absent or dense."""
    found = {}
    for threshold, sparsity in inputs:
        t = float(op_view(node).value(threshold)) if node is not None else KEEP_ALL
        found[threshold] = t
        found[sparsity] = float(op_view(node).value(sparsity)) if t >= 0 else 0.0
    return found


def _stats(node: ir.Node) -> dict:
    """The FFN's profile and predictor figures its layer report carries, those it has."""
    ffn = FFN(node)
    return {key: ffn.value(key) for key in STATS if ffn.value(key) is not None}


@dataclass
class LowerPredicted:
    name = "lower"
    requires = (PREDICTORS, PARTITIONED)
    all_neurons: bool = Options.all_neurons  # every neuron passes the predictor (checks the split)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        graph = model.graph
        report = []
        plan = dict(WeightPlan.of(model).formats)  # the quality plan's formats, by matrix name
        for node in FFN.nodes(model):
            with ctx.layer(FFN(node).layer):
                dense = self._dense_reason(node)
                if dense is None:
                    report.append(self._lower_one(graph, node, plan))
                else:
                    report.append(self._keep_dense(node, dense))
                    ctx.log(f"lower: layer {report[-1]['layer']} FFN stays dense: {dense}")
        pir.drop_unused_initializers(graph)  # dense FFN weights, frequencies, orders: folded into the new ops
        WeightPlan({name: fmt for name, fmt in plan.items() if name in graph.initializers}).attach(model)
        attach_layers(model, [LayerReport(**r) for r in report])
        gpu = sum(r["gpu_neurons"] for r in report)
        total = sum(r["gpu_neurons"] + r["cpu_neurons"] for r in report)
        dense = [r["layer"] for r in report if r.get("ffn") == "dense"]
        ctx.log(f"lower: {len(report) - len(dense)} sparse FFNs, {gpu} of {total} neurons on the GPU"
                f"{', every neuron computed (--all-neurons)' if self.all_neurons else ''}"
                f"{f'; {len(dense)} dense (layers {dense})' if dense else ''}")
        return PassResult(model, modified=True)

    def _dense_reason(self, node: ir.Node) -> str | None:
        """Why this layer's FFN stays dense (partition's plan runs it dense on one device: `placed`), or None to
        lower it sparse; never with --all-neurons (which checks the split)."""
        ffn = FFN(node)
        if self.all_neurons or ffn.placed in (None, "sparse"):
            return None
        return f"placed dense on the {ffn.placed.upper()}: {ffn.placed_reason}"

    @staticmethod
    def _keep_dense(node: ir.Node, reason: str) -> dict:
        """The FFN stays as it is (select-kernels lowers it as a --dense build does; its predictor's initializers
        go unused and are dropped); the report says so, and why."""
        stats = _stats(node)
        ffn = pir.const_array(node.inputs[3]).shape[0]
        return {"layer": FFN(node).layer, "gpu_neurons": 0, "cpu_neurons": ffn, "gpu_activation_share": 0.0,
                **stats, "ffn": "dense", "dense_reason": reason}

    def _lower_one(self, graph: ir.Graph, node: ir.Node, plan: dict[str, str]) -> dict:
        """The FFN as its predictor and a SparseFFN per part; `plan` (the quality plan's formats by matrix name)
        gets the FFN's up and down matrices' format for each part's rows (quantize finds a format by name)."""
        block = FFN(node)
        layer = block.layer
        gated = bool(block.gated)
        prefix = f"layers.{layer}.ffn"
        x = node.inputs[0]
        w_up, b_up = pir.const_array(node.inputs[1]), pir.const_array(node.inputs[2])
        w_down, b_down = pir.const_array(node.inputs[3]), pir.const_array(node.inputs[4])
        order = pir.const_array(graph.initializers[f"{prefix}.neuron_order"])
        ffn = w_down.shape[0]
        n_gpu = int(block.gpu_neurons)
        parts = [(part, begin, end) for part, begin, end in (("gpu", 0, n_gpu), ("cpu", n_gpu, ffn)) if end > begin]
        w1 = graph.initializers[f"{prefix}.predictor.w1"]
        w2 = pir.const_array(graph.initializers[f"{prefix}.predictor.w2"])[:, order]
        threshold = ALL_NEURONS if self.all_neurons else float(block.predictor_threshold)
        predict = ir.node("Predict", [x, w1, *(_rows(graph, f"{prefix}.predictor.w2.{part}", w2[:, b:e]) for part, b, e in parts)],
                          {"layer": layer}, domain=pir.DOMAIN, num_outputs=len(parts),
                          name=f"{prefix}.predict")
        graph.insert_before(node, predict)
        partials = []
        for (part, begin, end), scores in zip(parts, predict.outputs):
            scores.name = f"{prefix}.scores.{part}"
            scores.shape = ir.Shape(["rows", int(end - begin)])
            neurons = order[begin:end]
            if gated:
                half = w_up.shape[1] // 2
                up_rows = np.concatenate([w_up[:, :half][:, neurons].T, w_up[:, half:][:, neurons].T])
                up_bias = None if b_up is None else np.concatenate([b_up[:half][neurons], b_up[half:][neurons]])
            else:
                up_rows, up_bias = w_up[:, neurons].T, None if b_up is None else b_up[neurons]
            inputs = [x, scores, _rows(graph, f"{prefix}.up_rows.{part}", up_rows),
                      None if up_bias is None else _rows(graph, f"{prefix}.up_bias.{part}", up_bias),
                      _rows(graph, f"{prefix}.down_rows.{part}", w_down[neurons])]
            for matrix, rows in ((node.inputs[1], inputs[2]), (node.inputs[3], inputs[4])):
                if matrix.name in plan:
                    plan[rows.name] = plan[matrix.name]
            sparse = ir.node("SparseFFN", inputs, {
                "layer": layer, "part": part, "neurons": int(end - begin), "threshold": threshold,
                "activation": block.activation, "gated": int(gated),
            }, domain=pir.DOMAIN, name=f"{prefix}.sparse.{part}")
            sparse.outputs[0].name = f"{prefix}.partial.{part}"
            graph.insert_before(node, sparse)
            partials.append(sparse.outputs[0])
        merge = ir.node("MergePartial", [*partials, None if b_down is None else node.inputs[4]],
                        {"layer": layer}, domain=pir.DOMAIN, name=f"{prefix}.merge")
        graph.insert_before(node, merge)
        merge.outputs[0].name = f"{prefix}.merged"
        for value in [*predict.outputs, *partials, merge.outputs[0]]:
            value.dtype = ir.DataType.FLOAT
        for value in [*partials, merge.outputs[0]]:
            value.shape = node.outputs[0].shape
        node.outputs[0].replace_all_uses_with(merge.outputs[0])
        dense_weights = node.inputs[1:5]
        graph.remove(node, safe=True)
        for value in dense_weights:  # now in the parts' rows: freed layer by layer, not at the end of the pass
            if value is not None and value.is_initializer() and not value.uses():
                graph.initializers.pop(value.name)
        stats = _stats(node)
        frequency = pir.const_array(graph.initializers[f"{prefix}.frequency"])
        hot_share = float(frequency[order[:n_gpu]].sum() / max(frequency.sum(), 1e-12))
        return {"layer": layer, "gpu_neurons": n_gpu, "cpu_neurons": ffn - n_gpu, "gpu_activation_share": hot_share, **stats}
