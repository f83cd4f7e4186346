"""FFN activations: every exported spelling of GELU lifts to its own activation, exact or tanh (never one for
the other), and a GeGLU model (Gemma's FFN: down(gelu_tanh(gate(x)) * up(x))) builds and runs as onnxruntime
computes it. The kernels' arithmetic is test_kernels.py's (test_gelu_tanh_accuracy) and test_cuda_kernels.py's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from block_reference import run_blocks
from examples import models
from passes import ir as pir
from passes.reference import OrtDecoder
from picompile.cli import main
from test_recognise import lift
from test_sparse import assert_matches_onnxruntime

# The tiny LLaMA's gate pre-activations (std 0.16) scaled to spread over about [-8, 8], where exact and tanh
# GELU differ by up to 5e-4, and its logits (std 0.16) scaled too: then the two GELUs' logits differ by ten
# times the 1e-4 the checks allow.
GATE_SCALE, HEAD_SCALE = 12.0, 20.0
PROMPT = np.array([11, 22, 33, 44, 55], np.int64)


@pytest.fixture(scope="module")
def geglu(tmp_path_factory):
    """A tiny GeGLU LLaMA (gelu_pytorch_tanh) with its gates and output layer scaled up, exported with GELU written out (opset 18,
    dynamo: Pow, Tanh, Mul, Add) and as the ONNX Gelu op (opset 20, approximate="tanh"), and its calibration
    tokens."""
    model, _ = models.build_model("llama", hidden_act="gelu_pytorch_tanh")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight *= GATE_SCALE
        model.lm_head.weight *= HEAD_SCALE
    root = tmp_path_factory.mktemp("geglu")
    calib = models.random_tokens(model.config.vocab_size, 16, 64, seed=1, avoid=[])
    return {"written": models.export_onnx(model, root / "written", "dynamo"),
            "op": models.export_onnx(model, root / "op", "legacy", opset=20),
            "calib": models.write_tokens(root / "calib.npy", calib)}


def with_approximation(source, approximate: str, path):
    """The model with every Gelu node's `approximate` set."""
    proto = onnx.load(str(source))
    gelus = [node for node in proto.graph.node if node.op_type == "Gelu"]
    assert gelus
    for node in gelus:
        attribute = next(a for a in node.attribute if a.name == "approximate")
        attribute.s = approximate.encode()
    onnx.save(proto, str(path))
    return path


def assert_blocks_match(model, onnx_path):
    """The lifted blocks (numpy) give onnxruntime's logits on a prompt and decode steps, within 1e-4."""
    reference, caches = OrtDecoder(onnx_path), {}
    for begin, end in ((0, 3), (3, 4), (4, 5)):  # a prefill, then decode steps
        np.testing.assert_allclose(run_blocks(model, PROMPT[begin:end], caches, begin),
                                   reference.forward(PROMPT[begin:end]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("approximate, activation", [("none", "gelu"), ("tanh", "gelu_tanh")])
def test_gelu_op_lifts_to_its_approximation(geglu, tmp_path, approximate, activation):
    path = with_approximation(geglu["op"], approximate, tmp_path / "model.onnx")
    model = lift(path)
    ffns = pir.nodes_in_domain(model, "FFN")
    assert [(pir.attr(n, "activation"), pir.attr(n, "gated")) for n in ffns] == [(activation, 1)] * 2
    assert_blocks_match(model, path)


def test_the_two_gelus_give_visibly_different_logits(geglu, tmp_path):
    """What makes the tests here tell the activations apart: had tanh GELU been lifted as exact GELU (as
    before it had a name of its own), its logits would miss onnxruntime's by far more than 1e-4."""
    exact = OrtDecoder(with_approximation(geglu["op"], "none", tmp_path / "exact.onnx")).forward(PROMPT)
    tanh = OrtDecoder(geglu["op"]).forward(PROMPT)
    assert np.abs(exact - tanh).max() > 1e-3


def test_the_interpreter_computes_the_geglu_model(geglu):
    """passes.ir_reference (what the quality plan and the threshold calibration compute with) on GELU (tanh)."""
    from passes.ir_reference import Interpreter

    lifted = lift(geglu["written"])
    sequences = np.load(geglu["calib"])[:2, :12]
    got = Interpreter(lifted).logits(sequences).numpy()
    decoder = OrtDecoder(geglu["written"])
    for row, sequence in zip(got, sequences):
        decoder.reset()
        np.testing.assert_allclose(row, decoder.run(sequence[None], ["logits"])["logits"][0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
@pytest.mark.parametrize("hidden_act, activation", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_written_out_gelu_lifts_by_its_values(tiny_models, exporter, hidden_act, activation):
    """Below opset 20 both exporters write GELU out (Erf or Tanh among Mul, Add, Div, Pow), each in its own
    order of operations: recognise knows it by the values it computes."""
    files = tiny_models("llama", exporter, hidden_act=hidden_act)
    ops = {node.op_type for node in onnx.load(str(files.onnx)).graph.node}
    assert "Gelu" not in ops and ("Erf" if activation == "gelu" else "Tanh") in ops
    model = lift(files.onnx)
    assert [pir.attr(n, "activation") for n in pir.nodes_in_domain(model, "FFN")] == [activation] * 2
    assert_blocks_match(model, files.onnx)


def test_gpt2_gelu_new_lifts_as_tanh_gelu(tmp_path):
    """GPT-2's own tanh GELU (gelu_new: 0.5 x first, then the rest), ungated after a biased up projection."""
    import transformers

    config = models.make_config("gpt2")
    config.activation_function = "gelu_new"
    torch.manual_seed(0)
    path = models.export_onnx(transformers.GPT2LMHeadModel(config).eval(), tmp_path, "legacy")
    model = lift(path)
    assert [(pir.attr(n, "activation"), pir.attr(n, "gated")) for n in pir.nodes_in_domain(model, "FFN")] == \
        [("gelu_tanh", 0)] * 2
    assert_blocks_match(model, path)


def test_a_near_gelu_is_refused(tiny_models, tmp_path, capsys):
    """A written-out activation that is almost tanh GELU (0.05 for 0.044715) is no known activation: refused
    as an unsupported FFN activation, not lifted as the nearest one."""
    proto = onnx.load(str(tiny_models("llama", "legacy", hidden_act="gelu_pytorch_tanh").onnx))
    values = {node.name: onnx.numpy_helper.to_array(node.attribute[0].t)
              for node in proto.graph.node if node.op_type == "Constant"}
    constants = [node for node in proto.graph.node if node.op_type == "Constant" and values[node.name].size == 1
                 and values[node.name].dtype == np.float32 and values[node.name].item() == np.float32(0.044715)]
    assert constants
    for node in constants:
        node.attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(np.array(0.05, np.float32)))
    onnx.save(proto, str(tmp_path / "near.onnx"))
    assert main(["build", str(tmp_path / "near.onnx"), "-o", str(tmp_path / "m.pic"), "--dense"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error:") and "not a supported FFN activation" in error, error


@pytest.mark.parametrize("form", ["written", "op"])
def test_geglu_builds_and_runs_as_onnxruntime(geglu, tmp_path, capsys, form):
    """`picompile build` in the default (auto) mode picks threshold sparsity for GELU (tanh) and says why;
    at --sparsity 0 every input is kept, so the engine gives onnxruntime's logits, prompt and decode steps."""
    out = tmp_path / "geglu.pic"
    assert main(["build", str(geglu[form]), "-o", str(out), "--calib", str(geglu["calib"]), "--max-context", "32",
                 "--sparsity", "0"]) == 0
    assert "(layer FFNs use GELU (tanh): neurons are rarely exactly zero" in capsys.readouterr().out
    assert_matches_onnxruntime(out, geglu[form], decode_steps=4)
