"""examples/streamed_models.py: the 7B/13B presets' maker (graph exported on the meta device, weights made
layer by layer into external data), run here at the tiny preset's size, fp16 as the big presets default."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from examples import models
from examples.streamed_models import make_streamed_model

PROMPT = [5, 17, 3, 99, 42]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return make_streamed_model(tmp_path_factory.mktemp("streamed"), preset="tiny", sparsity=0.9, seed=3)


def _torch_model(files: models.ModelFiles):
    """transformers' LlamaForCausalLM holding the weights the maker wrote, read back from the ONNX files."""
    import onnx_ir as ir
    import transformers

    meta = json.loads(files.config.read_text())
    config = transformers.LlamaConfig(**{k: v for k, v in meta["hf_config"].items() if k != "dtype"})
    model = transformers.LlamaForCausalLM(config).eval()
    graph = ir.load(files.onnx).graph
    state = {}
    for name, spec in meta["weights"].items():
        value = np.asarray(graph.initializers[name].const_value.numpy(), np.float32)
        state[spec["parameter"]] = torch.from_numpy(np.ascontiguousarray(value.T if spec["transposed"] else value))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model


def test_graph_and_weights_are_the_transformers_model(streamed):
    """onnxruntime on the written files computes what transformers computes with the written weights (the
    graph is the dynamo export of the real model; each weight is where the graph reads it, in its layout)."""
    import onnx

    proto = onnx.load(str(streamed.onnx), load_external_data=False)
    external = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) == 2 + 2 * 9 + 1  # embedding, per layer 7 linears + 2 norms, final norm, output layer
    assert {t.data_type for t in proto.graph.initializer if t.name in external} == {onnx.TensorProto.FLOAT16}

    steps = models.ort_logits_steps(streamed.onnx, PROMPT, 2)
    tokens = PROMPT + [int(np.argmax(steps[0][-1]))]
    with torch.no_grad():
        reference = _torch_model(streamed)(input_ids=torch.tensor([tokens])).logits[0].numpy()
    scale = np.abs(reference).max()
    assert np.abs(steps[0] - reference[: len(PROMPT)]).max() < 0.02 * scale  # fp16 arithmetic against fp32
    assert np.abs(steps[1] - reference[len(PROMPT)]).max() < 0.02 * scale


def test_sparsity_is_the_designed_one(streamed):
    """Each layer, calibrated on the hidden states it really sees, reaches the asked sparsity on held-out
    tokens, with the power-law skew (the top 20% of neurons carry most activations)."""
    assert len(streamed.layer_sparsity) == 2
    for sparsity in streamed.layer_sparsity:
        assert abs(sparsity - 0.9) <= models.SPARSITY_TOLERANCE
    assert min(streamed.top20_share) > 0.5
    stats = np.load(streamed.stats)
    assert stats["measured_freq"].shape == stats["target_p"].shape == (2, 256)
    # the neurons the design made hot are the ones that fire most
    for target, measured in zip(stats["target_p"], stats["measured_freq"]):
        assert np.corrcoef(target, measured)[0, 1] > 0.8


def test_streamed_presets_are_llamas_from_the_dynamo_exporter(tmp_path):
    for spec in (dict(family="opt", preset="7b"), dict(family="llama", preset="13b", exporter="legacy"),
                 dict(family="opt", preset="tiny", streamed=True)):  # streamed=True routes any preset so
        with pytest.raises(ValueError, match="layer by layer"):
            models.make_models([(spec, tmp_path)])
    config = models.make_config("llama", "7b")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (4096, 32, 11008)
    assert models.make_config("llama", "7b", num_key_value_heads=8).num_key_value_heads == 8  # GQA optional
