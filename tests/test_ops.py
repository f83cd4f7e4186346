"""picompile's declared ops (passes.ops) and the passes' declared facts: the pass manager checks every graph
against the declarations after every pass, and each pass's requirements before it runs."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from onnx_ir.passes import PassResult

import gguf_files as gf
from passes import ir as pir
from passes import ops
from passes.compile import Compile
from passes.errors import PassError
from passes.fuse import FUSED
from passes.nodes import parse_nodes
from passes.front_end import load
from passes.pipeline import Context, Hook, Options, run_passes
from passes.predict import Predict
from passes.quality import QualityPlan
from passes.select_kernels import SelectKernels
from passes.targets import get_target
from picompile.compiler import pipeline


def _graph(*nodes: ir.Node) -> ir.Model:
    graph = ir.Graph([], [], nodes=list(nodes), name="g", opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: 1})
    return ir.Model(graph, ir_version=10)


def _embed() -> ir.Node:
    ids, start = ir.val("input_ids", ir.DataType.INT64, ["seq"]), ir.val("start", ir.DataType.INT64, [])
    table = ir.val("embed.tokens", const_value=ir.tensor(np.zeros((4, 2), np.float32)))
    return ir.node("Embed", [ids, start, table], domain=pir.DOMAIN, name="embed")


def _sparse_ffn(**attributes) -> ir.Node:
    inputs = [ir.val(name, ir.DataType.FLOAT, [1, 2]) for name in ("x", "scores", "up", "bias", "down")]
    return ir.node("SparseFFN", inputs, {"layer": 0, "part": "cpu", "neurons": 2, "threshold": 0.5,
                                         "activation": "relu", "gated": 0, **attributes},
                   domain=pir.DOMAIN, name="layers.0.ffn.sparse.cpu")


@dataclasses.dataclass
class _Returns:
    """A pass that returns the graph it is given (or `model`), declaring `adds`."""

    model: ir.Model | None = None
    name = "returns"
    adds = ()

    def apply(self, model, ctx):
        return PassResult(self.model or model, modified=True)


def test_a_well_formed_op_reads_through_its_typed_view():
    node = _sparse_ffn()
    assert ops.node_problems(node) == []
    view = ops.SparseFFN(node)
    assert (view.layer, view.part, view.neurons, view.threshold, view.gated) == (0, "cpu", 2, 0.5, 0)
    assert ops.view(node).value("activation") == "relu"
    with pytest.raises(ValueError, match="not picompile.FFN"):
        ops.FFN(node)
    ffn = ir.node("FFN", [None] * 5, {"layer": 1, "activation": "silu", "gated": 1}, domain=pir.DOMAIN)
    assert (ops.FFN(ffn).placed, ops.FFN(ffn).threshold_in, ops.FFN(ffn).residual) == (None, ops.KEEP_ALL, 0)
    ops.FFN(ffn).gpu_neurons = 3  # written with the declared type
    ops.view(ffn).set("threshold_in", 0.5)
    assert [(a.name, a.type, a.value) for a in list(ffn.attributes.values())[3:]] == [
        ("gpu_neurons", ir.AttributeType.INT, 3), ("threshold_in", ir.AttributeType.FLOAT, 0.5)]
    with pytest.raises(KeyError, match="picompile.FFN declares no attribute 'colour'"):
        ops.view(ffn).set("colour", "red")


@pytest.mark.parametrize("node,wanted", [
    (_sparse_ffn(neurons=2.0), "attribute 'neurons' is FLOAT, declared INT"),
    (_sparse_ffn(part="tpu"), "attribute 'part' is 'tpu', declared one of"),
    (_sparse_ffn(colour="red"), "attribute 'colour' is not declared"),
    (ir.node("SparseFFN", [None] * 4, {"layer": 0, "part": "gpu", "neurons": 1, "threshold": 0.0, "activation": "relu",
                                       "gated": 0}, domain=pir.DOMAIN, name="short"), "4 inputs, declared 5"),
    (ir.node("MergePartial", [None], {}, domain=pir.DOMAIN, name="merge"), "required attribute 'layer' is missing"),
    (ir.node("Bogus", [], domain=pir.DOMAIN, name="bogus"), "picompile.Bogus is not a declared op"),
])
def test_the_pass_manager_refuses_a_malformed_op_naming_pass_node_and_attribute(node, wanted):
    with pytest.raises(PassError) as raised:
        run_passes(_graph(node), [_Returns()], Context(get_target("cpu")))
    message = str(raised.value)
    assert message.startswith(f"pass returns{', layer 0' if 'layer' in node.attributes else ''}: OpError: ")
    assert f"node {node.name} (picompile.{node.op_type})" in message and wanted in message


def test_a_pass_whose_requirement_is_missing_fails_before_it_runs(monkeypatch):
    ran = []
    monkeypatch.setattr(SelectKernels, "apply", lambda self, model, ctx: ran.append(1))
    head = ir.node("MatMul", [ir.val("h", ir.DataType.FLOAT, [1, 2]), ir.val("w", ir.DataType.FLOAT, [2, 4])],
                   name="lm_head")
    with pytest.raises(PassError, match=r"pass select-kernels: FactError: requires residual Adds and the output layer "
                                        r"folded into the blocks \(added by fuse\), a device for every node \(added "
                                        r"by place\), which the IR does not hold"):
        run_passes(_graph(_embed(), head), [SelectKernels()], Context(get_target("cpu")))
    assert not ran


def test_a_pass_that_does_not_add_what_it_declares_fails():
    head = ir.node("MatMul", [ir.val("h", ir.DataType.FLOAT, [1, 2]), ir.val("w", ir.DataType.FLOAT, [2, 4])])
    claims = _Returns()
    claims.adds = (FUSED,)
    with pytest.raises(PassError, match="pass returns: FactError: declares it adds residual Adds"):
        run_passes(_graph(head), [claims], Context(get_target("cpu")))


class _SeenOps(Hook):
    """The picompile ops each pass leaves in the graph (run_passes has checked them against the declarations)."""

    def __init__(self):
        self.seen: Counter = Counter()

    def after_pass(self, index, compiler_pass, result, seconds, ctx):
        for node in result.model.graph:
            assert not ops.node_problems(node)
            if node.domain == pir.DOMAIN:
                self.seen[node.op_type] += 1


@dataclasses.dataclass
class _QuickPredictors(Predict):
    """Predict's facts without its training (seconds a build): a random rank-4 predictor per FFN."""

    def apply(self, model, ctx):
        rng = np.random.default_rng(0)
        for node in ops.FFN.nodes(model):
            d_model, width = node.inputs[3].const_value.shape[1], node.inputs[3].const_value.shape[0]
            prefix = f"layers.{ops.FFN(node).layer}.ffn.predictor"
            pir.initializer(model.graph, f"{prefix}.w1", rng.standard_normal((d_model, 4)).astype(np.float32))
            pir.initializer(model.graph, f"{prefix}.w2", rng.standard_normal((4, width)).astype(np.float32))
            node.attributes["predictor_rank"] = ir.AttrInt64("predictor_rank", 4)
            for key in ("predictor_threshold", "predictor_recall", "predictor_precision", "predictor_active"):
                node.attributes[key] = ir.AttrFloat32(key, 0.5)
        return PassResult(model, modified=True)


def test_declarations_cover_every_op_the_pipelines_emit(tiny_models, tmp_path):
    """Three builds up to the kernels' compilation, a threshold-mode int4 one and a predictor-mode one for a GPU
    (each FFN split in a GPU and a CPU part), the first split across two machines, and a dense one of a Gemma 2
    GGUF file (norms after attention and the FFN, soft-capped logits): every pass's graph fits the declarations
    (run_passes checks them), and every declared op is emitted by one of them."""
    seen = _SeenOps()
    split = Options(nodes=parse_nodes("2x1GiB"))  # (the build target's nodes: split-nodes reads them there)
    threshold = Options(max_context=32, sparsity_mode="threshold", sparsity=0.5, calib_tokens=128,
                        weight_dtype="int4", quant_method="rtn", nodes=split.nodes)
    predictor = Options(max_context=32, calib_tokens=64, all_neurons=True)
    gpu = get_target("rtx4090")
    builds = [(tiny_models("llama").onnx, pipeline(threshold, "threshold"), get_target("cpu"), split),
              (tiny_models("opt", sparsity=0.9).onnx,
               [_QuickPredictors() if isinstance(p, Predict) else p for p in pipeline(predictor, "predictor", gpu)
                if not isinstance(p, QualityPlan)], gpu, None)]
    gemma = tmp_path / "gemma2.gguf"
    gf.write(gemma, gf.Tiny(arch="gemma2", layers=2, window=4, attn_softcap=2.0, final_softcap=3.0))
    dense = Options(max_context=32, dense=True, weight_dtype="fp32")
    builds.append((gemma, pipeline(dense, "dense", gguf=True), get_target("cpu"), dense))
    for path, passes, target, options in builds:
        passes = [p for p in passes if not isinstance(p, Compile)]  # the IR it returns is the one it was given
        run_passes(load(path), passes, Context(target, workdir=tmp_path, options=options), [seen])
    assert set(seen.seen) == set(ops.OPS), f"declared but never emitted: {set(ops.OPS) - set(seen.seen)}"
