"""Gemma 2 and Gemma 3 (GGUF architectures `gemma2` and `gemma3`, transformers' Gemma2ForCausalLM and
Gemma3ForCausalLM). Tiny random models made with transformers are the reference: their GGUF files, written by
llama.cpp's own converter where llama.cpp's source is here and by the `gguf` package's writer always, build dense
and give transformers' logits (fp32, atol 1e-4), prompt and decode steps, past the sliding window (4 positions, the
prompt 6), with soft-caps the scores and logits reach (Gemma 2) and Gemma 3's per-head q / k norms, its sliding
layers' own RoPE base and its global layers' linear RoPE scaling.

llama.cpp scales the scores by 1/sqrt(head_dim), or by 1/sqrt(d_model / heads) for a model of the 27B's layer count
(46 layers for Gemma 2, 62 for Gemma 3): the file holds no query_pre_attn_scalar, so a build computes that rule, which
is transformers' query_pre_attn_scalar ** -0.5 for every published Gemma 2 / 3. The tests take query_pre_attn_scalar
as the rule has it: head_dim for the small models, and a 46-layer Gemma 2 whose head_dim (32) is not d_model / heads
(16) checks the other branch (a build scaling by 1/sqrt(head_dim) there is 1.4x off)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf_files as gf
from examples.byte_tokenizer import write_byte_tokenizer
from passes.errors import UserError
from passes.front_end import load
from passes.import_gguf import hyper, read
from passes.import_onnx import Import
from passes.ir_reference import Interpreter
from passes.ops import Attention
from passes.pipeline import Context, Options, run_passes
from passes.recognise import Recognise
from passes.targets import get_target
from picompile.cli import main
from picompile.compiler import build
from runtime import Engine
from runtime.calls import schedule_calls
from tiny_targets import SLOW_CPU_RTX4090
from transformers_reference import artifact_logits, transformers_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llama_cpp  # noqa: E402

VOCAB = 258  # the byte-level tokenizer's (Gemma 3's converter cuts the embedding table to the tokenizer's size)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=128, rms_norm_eps=1e-6,
              sliding_window=4, hidden_activation="gelu_pytorch_tanh")
GEMMA2 = dict(COMMON, num_hidden_layers=3, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
              rope_theta=10000.0)
# the 27B's layer count: scores scaled by 1/sqrt(d_model / heads), not 1/sqrt(head_dim)
GEMMA2_WIDE = dict(GEMMA2, num_hidden_layers=46, head_dim=32, query_pre_attn_scalar=16)
GEMMA3 = dict(COMMON, num_hidden_layers=7, final_logit_softcapping=2.5,  # layer 5 global, the others sliding
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                               "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}})
PROMPT = [11, 22, 33, 44, 55, 66]
DECODE_STEPS = 4
# transformers' names of a decoder layer's tensors -> llama.cpp's (what its converter maps them to)
LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _model(arch: str, config: dict, seed: int):
    import transformers

    torch.manual_seed(seed)
    if arch == "gemma2":
        made = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**config, attn_implementation="eager"))
    else:
        made = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config, attn_implementation="eager"))
    with torch.no_grad():  # Gemma's norms compute x * (1 + w): w away from 0 (the default), so a norm misread shows
        for name, parameter in made.named_parameters():
            parameter.copy_(0.2 * torch.randn_like(parameter) if "norm" in name else 0.15 * torch.randn_like(parameter))
    return made.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (arch, config, the transformers model, the directory it is saved in with a byte-level tokenizer)."""
    made = {}

    def get(name: str):
        if name not in made:
            arch, config = {"gemma2": ("gemma2", GEMMA2), "gemma2_wide": ("gemma2", GEMMA2_WIDE),
                            "gemma3": ("gemma3", GEMMA3)}[name]
            model = _model(arch, config, seed=len(made))
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            write_byte_tokenizer(directory)
            made[name] = arch, config, model, directory
        return made[name]

    return get


def _builds_to_transformers_logits(model, source: Path, out: Path) -> None:
    assert main(["build", str(source), "--dense", "--weight-dtype", "fp32", "--target", "cpu", "-o", str(out),
                 "--max-context", "32"]) == 0
    ours, ids = artifact_logits(out, PROMPT, DECODE_STEPS)
    theirs = transformers_logits(model, ids)
    assert np.abs(theirs).max() > 0.5 and np.abs(ours).max() > 0.5  # logits the soft-cap (2, 2.5) bends
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def _tiny(arch: str, config: dict) -> gf.Tiny:
    """The tests/gguf_files.py shape and metadata of a config, as llama.cpp's converter writes them."""
    rope = config.get("rope_parameters", {})
    full, sliding = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    return gf.Tiny(arch=arch, layers=config["num_hidden_layers"], d_model=config["hidden_size"],
                   ffn=config["intermediate_size"], heads=config["num_attention_heads"],
                   kv_heads=config["num_key_value_heads"], vocab=config["vocab_size"], tied=True,
                   eps=config["rms_norm_eps"], rope_base=full.get("rope_theta", config.get("rope_theta", 10000.0)),
                   key_length=config["head_dim"], window=config["sliding_window"],
                   attn_softcap=config.get("attn_logit_softcapping"),
                   final_softcap=config.get("final_logit_softcapping"), rope_base_swa=sliding.get("rope_theta"),
                   rope_factor=full.get("factor"))


def _written_by_the_gguf_writer(model, arch: str, config: dict, path: Path) -> Path:
    """The model's tensors in a GGUF file of the `gguf` package's writer (tests/gguf_files.py), named as llama.cpp's
    converter names them and its norms 1 + w, as the converter stores them."""
    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    shift = lambda name, w: w + 1 if name.endswith("norm.weight") else w  # noqa: E731
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"] + 1}
    for i in range(config["num_hidden_layers"]):
        tensors.update({f"blk.{i}.{gguf_name}.weight": shift(name + ".weight", state[f"model.layers.{i}.{name}.weight"])
                        for name, gguf_name in LAYER_TENSORS.items() if f"model.layers.{i}.{name}.weight" in state})

    def edit(written):
        assert set(written) == set(tensors)
        written.update({name: (array, gf.T.F32) for name, array in tensors.items()})

    gf.write(path, _tiny(arch, config), edit=edit)
    return path


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_gguf_of_the_gguf_writer_builds_to_transformers_logits(models, tmp_path, name):
    arch, config, model, _ = models(name)
    path = _written_by_the_gguf_writer(model, arch, config, tmp_path / f"{name}.gguf")
    _builds_to_transformers_logits(model, path, tmp_path / f"{name}.pic")
    # one RoPE table per (base, scaling) the layers use, shared by them: Gemma 3's sliding and global layers differ
    tables = set(re.findall(r'"(rope\.cos[^"]*)"', (tmp_path / f"{name}.pic" / "schedule.json").read_text()))
    assert len(tables) == (2 if arch == "gemma3" else 1), tables


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_gguf_of_llama_cpps_converter_builds_to_transformers_logits(models, tmp_path, name):
    converter = llama_cpp.converter()
    if converter is None:
        pytest.skip(f"llama.cpp's source is not in {llama_cpp.default_root()} (scripts/build_llama_cpp.sh unpacks it)")
    arch, config, model, directory = models(name)
    path = gf.convert_with_llama_cpp(converter, directory, tmp_path / f"{name}.gguf",
                                     bpe_for_sentencepiece=arch == "gemma2")
    h = hyper(read(path), path)  # what the converter wrote is what the test means
    assert (h.window, h.sliding) == (4, tuple(_sliding(arch, config["num_hidden_layers"])))
    _builds_to_transformers_logits(model, path, tmp_path / f"{name}.pic")


def _sliding(arch: str, layers: int) -> list[bool]:
    """transformers' layer_types for these configs: Gemma 2's even layers, Gemma 3's five of every six."""
    return [i % 2 == 0 if arch == "gemma2" else (i + 1) % 6 != 0 for i in range(layers)]


def test_a_46_layer_gemma2_scales_its_scores_by_d_model_over_heads(models, tmp_path):
    """llama.cpp's rule for Gemma 2's 27B (and transformers' query_pre_attn_scalar = d_model / heads there)."""
    arch, config, model, _ = models("gemma2_wide")
    path = _written_by_the_gguf_writer(model, arch, config, tmp_path / "wide.gguf")
    h = hyper(read(path), path)
    assert h.head_dim == 32 and h.architecture.query_scale.value(h) == pytest.approx(1 / 4)
    _builds_to_transformers_logits(model, path, tmp_path / "wide.pic")


@pytest.mark.parametrize("tiny", [gf.Tiny(arch="gemma2", layers=3, window=4, attn_softcap=2.0, final_softcap=3.0),
                                  gf.Tiny(arch="gemma3", layers=7, window=4, final_softcap=3.0, rope_base_swa=500.0,
                                          rope_factor=2.0, tied=False)],
                         ids=["gemma2", "gemma3"])
def test_a_gemma_gguf_builds_to_llama_cpps_numbers(tmp_path, tiny):
    """tests/gguf_files.py's forward pass, llama.cpp's graph in numpy (gemma3 here with an output layer of its own)."""
    path = tmp_path / f"{tiny.arch}.gguf"
    weights = gf.write(path, tiny, seed=3)
    out = tmp_path / f"{tiny.arch}.pic"
    assert main(["build", str(path), "--dense", "--weight-dtype", "fp32", "--target", "cpu", "-o", str(out),
                 "--max-context", "32"]) == 0
    ours, ids = artifact_logits(out, PROMPT, DECODE_STEPS)
    np.testing.assert_allclose(ours, gf.forward(weights, tiny, ids), atol=1e-4, rtol=0)


def test_gemma3s_windows_and_rope_read_as_llama_cpp_reads_them(tmp_path):
    """No window in the file: no layer slides and every layer takes rope.freq_base and its scaling; a window: five
    of six layers slide, their RoPE base rope.freq_base_swa (10000 where absent), their positions unscaled."""
    path = tmp_path / "plain.gguf"
    gf.write(path, gf.Tiny(arch="gemma3", layers=7, rope_base=1e6, rope_factor=8.0, tied=True))
    h = hyper(read(path), path)
    assert not any(h.slides(i) for i in range(7)) and {h.rope_of(i) for i in range(7)} == {(1e6, 8.0)}
    assert h.final_softcap == 0.0 and h.attn_softcap == 0.0
    path = tmp_path / "windowed.gguf"
    gf.write(path, gf.Tiny(arch="gemma3", layers=7, rope_base=1e6, rope_factor=8.0, window=512, tied=True))
    h = hyper(read(path), path)
    assert [h.slides(i) for i in range(7)] == [True] * 5 + [False, True] and h.window == 512
    assert [h.rope_of(i) for i in (0, 5)] == [(10000.0, 1.0), (1e6, 8.0)]


def test_a_vision_projector_file_is_refused_in_one_line(tmp_path):
    """Gemma 3's image half is a file of its own (llama.cpp's mmproj, general.architecture clip)."""
    path = tmp_path / "mmproj.gguf"
    gf.write(path, gf.Tiny(arch="clip"))
    with pytest.raises(UserError) as refused:
        hyper(read(path), path)
    assert "multimodal projector" in str(refused.value) and "\n" not in str(refused.value)


def _lifted(path: Path):
    return run_passes(load(path), [Import(), Recognise()], Context(get_target("cpu"), options=Options(max_context=32)))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_block_irs_interpreter_computes_transformers_logits(models, tmp_path, name):
    """recognise lifts the file's graph into picompile's blocks with the scale, soft-caps and windows as data (the
    scale here 1/sqrt(query_pre_attn_scalar)); the interpreter (the quality passes' reference) computes them."""
    arch, config, model, _ = models(name)
    lifted = _lifted(_written_by_the_gguf_writer(model, arch, config, tmp_path / f"{name}.gguf"))
    attentions = [Attention(node) for node in Attention.nodes(lifted)]
    assert [int(a.window) for a in attentions] == [4 if s else 0 for s in _sliding(arch, config["num_hidden_layers"])]
    assert {float(a.softcap) for a in attentions} == {config.get("attn_logit_softcapping") or 0.0}
    assert [float(a.scale) for a in attentions] == pytest.approx([config["query_pre_attn_scalar"] ** -0.5] * len(attentions))
    ids = PROMPT + [7, 8, 9, 10]
    interpreted = Interpreter(lifted).logits(np.array([ids])).numpy()[0]
    np.testing.assert_allclose(interpreted, transformers_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_build_with_its_attention_on_the_gpu_computes_transformers_logits(models, tmp_path, name):
    """On a GPU target the soft-capped, windowed attention runs on the (emulated) GPU: transformers' logits within
    the fp16 rounding of the weights the GPU holds (tests/test_cuda_kernels.py: the kernels' own numbers)."""
    arch, config, model, _ = models(name)
    path = _written_by_the_gguf_writer(model, arch, config, tmp_path / f"{name}.gguf")
    artifact = build(path, tmp_path / "gpu.pic", SLOW_CPU_RTX4090, Options(dense=True, max_context=32))
    calls = schedule_calls(json.loads((artifact / "schedule.json").read_text()))
    assert {call.device for call in calls if call.id.endswith(".attention")} == {"gpu"}
    engine = Engine(artifact, emulate_gpu=True)
    ids = list(PROMPT)
    got = [np.asarray(engine.forward(np.array(ids, np.int64))).reshape(len(ids), -1)]
    for token in (7, 8, 9):
        ids.append(token)
        got.append(np.asarray(engine.forward([token])).reshape(1, -1))
    expected = transformers_logits(model, ids)
    assert np.abs(np.concatenate(got) - expected).max() / expected.std() < 1e-2


@pytest.mark.parametrize("arch,layers,scale", [("gemma2", 42, 128 ** -0.5), ("gemma2", 46, 144 ** -0.5),
                                               ("gemma3", 48, 128 ** -0.5), ("gemma3", 62, 168 ** -0.5)])
def test_the_query_scale_is_llama_cpps_rule_for_the_27b(arch, layers, scale):
    """Gemma 2 27B (46 layers, d_model 4608, 32 heads of 128) and Gemma 3 27B (62 layers, 5376, 32 heads of 128)
    scale by 1/sqrt(d_model / heads), their query_pre_attn_scalar; the others by 1/sqrt(head_dim)."""
    from passes.architectures import architecture_of
    from passes.gguf_graph import Hyper

    d_model = {"gemma2": 4608, "gemma3": 5376}[arch]
    h = Hyper(architecture_of(arch), layers=layers, d_model=d_model, ffn=1, heads=32, kv_heads=16, head_dim=128,
              eps=1e-6, rope_base=1e4, rope_scale=1.0)
    assert h.architecture.query_scale.value(h) == pytest.approx(scale, rel=1e-12)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_an_onnx_export_of_gemma_carries_its_query_scale_and_builds_to_transformers_logits(tmp_path, name):
    """An ONNX export holds query_pre_attn_scalar's scale itself: here 10, not head_dim (16), so a build that took
    1/sqrt(head_dim) would be off; recognise lifts the graph's scale, caps, windows, post-norms and embedding scale."""
    from examples import models as examples

    arch, config = {"gemma2": ("gemma2", GEMMA2), "gemma3": ("gemma3", GEMMA3)}[name]
    model = _model(arch, dict(config, query_pre_attn_scalar=10), seed=5)
    onnx_path = examples.export_onnx(model, tmp_path / "legacy", "legacy")
    attentions = [Attention(node) for node in Attention.nodes(_lifted(onnx_path))]
    assert [float(a.scale) for a in attentions] == pytest.approx([10 ** -0.5] * len(attentions))
    assert [int(a.window) for a in attentions] == [4 if s else 0 for s in _sliding(arch, config["num_hidden_layers"])]
    _builds_to_transformers_logits(model, onnx_path, tmp_path / f"{name}.pic")
