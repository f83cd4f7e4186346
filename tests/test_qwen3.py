"""Qwen3 (GGUF architecture `qwen3`, transformers' Qwen3ForCausalLM): Qwen2's block with an RMSNorm over each
head's query and key before RoPE. A tiny random Qwen3 made with transformers (head_dim 32, not d_model / heads) is
the reference: its GGUF file, written by llama.cpp's own converter where llama.cpp's source is here and by the
`gguf` package's writer always, and its ONNX exports build dense and give its logits, prompt and decode steps; the
ONNX path lifts the q / k norm into `picompile.Attention` (and refuses a norm it cannot lift, naming it); the block
IR's interpreter computes the same, and a build with its attention on the (emulated) GPU too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf_files as gf
from examples import models
from examples.byte_tokenizer import write_byte_tokenizer
from passes.errors import UserError
from passes.front_end import load
from passes.import_onnx import Import
from passes.ir_reference import Interpreter
from passes.ops import Attention
from passes.pipeline import Context, Options, run_passes
from passes.recognise import Recognise
from passes.targets import get_target
from picompile.cli import main
from picompile.compiler import build
from runtime.calls import schedule_calls
from test_sparse import assert_matches_onnxruntime
from tiny_targets import SLOW_CPU_RTX4090
from transformers_reference import artifact_logits, transformers_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llama_cpp  # noqa: E402

HEAD_DIM = 32
CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_theta=10000.0)
PROMPT = [11, 22, 33, 44, 55]
DECODE_STEPS = 4
# transformers' names of a decoder layer's tensors -> llama.cpp's (what its converter maps them to)
LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """tied -> (the transformers model, the directory it is saved in with a byte-level tokenizer), made once."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    made = {}

    def get(tied: bool):
        if tied not in made:
            torch.manual_seed(int(tied))
            model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, tie_word_embeddings=tied)).eval()
            with torch.no_grad():  # norms away from 1 (the default): a norm left out or misread shows
                for name, parameter in model.named_parameters():
                    parameter.copy_(1 + 0.2 * torch.randn_like(parameter) if "norm" in name
                                    else 0.1 * torch.randn_like(parameter))
            directory = tmp_path_factory.mktemp(f"qwen3-{'tied' if tied else 'untied'}")
            model.save_pretrained(directory)
            write_byte_tokenizer(directory)
            made[tied] = model, directory
        return made[tied]

    return get


def _builds_to_transformers_logits(model, source: Path, out: Path) -> None:
    assert main(["build", str(source), "--dense", "--weight-dtype", "fp32", "--target", "cpu", "-o", str(out),
                 "--max-context", "32"]) == 0
    ours, ids = artifact_logits(out, PROMPT, DECODE_STEPS)
    np.testing.assert_allclose(ours, transformers_logits(model, ids), atol=1e-4, rtol=0)


def _written_by_the_gguf_writer(model, tied: bool, path: Path) -> Path:
    """The model's tensors in a GGUF file of the `gguf` package's writer (tests/gguf_files.py), named as llama.cpp's
    converter names them."""
    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    if not tied:
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(CONFIG["num_hidden_layers"]):
        tensors.update({f"blk.{i}.{gguf_name}.weight": state[f"model.layers.{i}.{name}.weight"]
                        for name, gguf_name in LAYER_TENSORS.items()})
    tiny = gf.Tiny(arch="qwen3", layers=CONFIG["num_hidden_layers"], d_model=CONFIG["hidden_size"],
                   ffn=CONFIG["intermediate_size"], heads=CONFIG["num_attention_heads"],
                   kv_heads=CONFIG["num_key_value_heads"], vocab=CONFIG["vocab_size"], tied=tied,
                   eps=CONFIG["rms_norm_eps"], rope_base=CONFIG["rope_theta"], key_length=HEAD_DIM)

    def edit(written):
        assert set(written) == set(tensors)
        written.update({name: (array, gf.T.F32) for name, array in tensors.items()})

    gf.write(path, tiny, edit=edit)
    return path


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_qwen3_gguf_of_the_gguf_writer_builds_to_transformers_logits(qwen3, tmp_path, tied):
    model, _ = qwen3(tied)
    path = _written_by_the_gguf_writer(model, tied, tmp_path / "qwen3.gguf")
    _builds_to_transformers_logits(model, path, tmp_path / "qwen3.pic")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_qwen3_gguf_of_llama_cpps_converter_builds_to_transformers_logits(qwen3, tmp_path, tied):
    converter = llama_cpp.converter()
    if converter is None:
        pytest.skip(f"llama.cpp's source is not in {llama_cpp.default_root()} (scripts/build_llama_cpp.sh unpacks it)")
    model, directory = qwen3(tied)
    path = gf.convert_with_llama_cpp(converter, directory, tmp_path / "qwen3.gguf")
    _builds_to_transformers_logits(model, path, tmp_path / "qwen3.pic")


def _lifted(onnx_path: Path):
    return run_passes(load(onnx_path), [Import(), Recognise()],
                      Context(get_target("cpu"), options=Options(max_context=32)))


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_an_onnx_export_of_qwen3_lifts_the_qk_norm_and_builds_to_transformers_logits(qwen3, tmp_path, exporter):
    """recognise puts each layer's q / k norm weights and eps on its Attention (the lifted graph's heads are the
    projections' own order here); the block IR's interpreter and the dense build compute transformers' logits, and
    the build onnxruntime's on the exported file."""
    model, _ = qwen3(False)
    onnx_path = models.export_onnx(model, tmp_path / exporter, exporter)
    lifted = _lifted(onnx_path)
    attentions = [Attention(node) for node in Attention.nodes(lifted)]
    assert len(attentions) == CONFIG["num_hidden_layers"]
    for attention, layer in zip(attentions, model.model.layers):
        for name, norm in (("q_norm", layer.self_attn.q_norm), ("k_norm", layer.self_attn.k_norm)):
            lifted_weight = attention.input(name).const_value.numpy()
            np.testing.assert_array_equal(lifted_weight, norm.weight.detach().numpy())
        assert attention.qk_norm_eps == pytest.approx(CONFIG["rms_norm_eps"], rel=1e-6)
    ids = PROMPT + [7, 8, 9]
    interpreted = Interpreter(lifted).logits(np.array([ids])).numpy()[0]
    np.testing.assert_allclose(interpreted, transformers_logits(model, ids), atol=1e-4, rtol=0)
    out = tmp_path / "qwen3.pic"
    _builds_to_transformers_logits(model, onnx_path, out)
    assert_matches_onnxruntime(out, onnx_path, decode_steps=3)


def test_a_qwen3_build_with_its_attention_on_the_gpu_matches_onnxruntime(qwen3, tmp_path):
    """On a GPU target the q / k norm weights go with the attention to the (emulated) GPU's rope kernel; the CUDA
    kernel's own numbers are tests/test_cuda_kernels.py's."""
    model, _ = qwen3(False)
    onnx_path = models.export_onnx(model, tmp_path / "legacy", "legacy")
    artifact = build(onnx_path, tmp_path / "gpu.pic", SLOW_CPU_RTX4090, Options(dense=True, max_context=32))
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    assert {call.device for call in calls if call.id.endswith(".rope_kv")} == {"gpu"}
    assert_matches_onnxruntime(artifact, onnx_path, emulate_gpu=True, decode_steps=3)


def test_a_norm_of_the_key_heads_alone_is_refused_not_dropped(qwen3, tmp_path):
    """A q / k norm recognise cannot lift is refused in one line naming it: here the query's is gone."""
    from transformers import Qwen3ForCausalLM

    _, directory = qwen3(False)
    model = Qwen3ForCausalLM.from_pretrained(directory).eval()
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
    onnx_path = models.export_onnx(model, tmp_path / "key-only", "legacy")
    with pytest.raises(UserError, match="layer 0: only the attention's key heads are normed"):
        _lifted(onnx_path)
