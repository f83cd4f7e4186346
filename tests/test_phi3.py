"""GGUF phi3 (transformers' Phi3ForCausalLM: Phi-3, Phi-3.5, Phi-4): its fused attn_qkv and ffn_up (gate, then up)
are taken apart into whole rows of the file, so that a build computes transformers' Phi-3 (a short prompt and decode
steps, fp32, within 1e-4) and a quantized file's blocks reach the artifact bit for bit. The files: a tiny random
Phi-3 made with transformers and converted by llama.cpp's own converter (where its source is here), and one written
by tests/gguf_files.py (always). LongRoPE files are refused in one line; the file's sliding window is not applied,
as llama.cpp does not apply it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gguf_files as gf
from passes.import_gguf import reference_onnx
from passes.kernels import kquant, quant
from passes.reference import OrtDecoder
from picompile.cli import main
from runtime import Engine
from runtime.artifact import read_safetensors
from runtime.dtypes import WEIGHT_FORMATS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llama_cpp  # noqa: E402

T = gf.T
PROMPT = [3, 14, 15, 92, 65, 35, 89]
FED = [79, 32, 38, 46]  # decode steps, the same tokens for every model (greedy choices could part at a near tie)
CONTEXT = 32
TINY = gf.Tiny(arch="phi3", d_model=64, ffn=96, heads=4, kv_heads=2, vocab=300)
# the fused tensors in blocks: q, k, v in Q8_0 (int8), gate and up in Q4_K (whose 256-blocks need d_model 256); every
# other matrix in Q8_0, which auto's build keeps too
QUANTIZED = gf.Tiny(arch="phi3", d_model=256, ffn=256, heads=4, kv_heads=2, vocab=300, tied=True, default=T.Q8_0,
                    formats={"ffn_up": T.Q4_K})


def _config(tiny: gf.Tiny, sliding_window: int | None = None, **extra):
    from transformers import Phi3Config

    return Phi3Config(vocab_size=tiny.vocab, hidden_size=tiny.d_model, intermediate_size=tiny.ffn,
                      num_hidden_layers=tiny.layers, num_attention_heads=tiny.heads,
                      num_key_value_heads=tiny.kv_heads, rms_norm_eps=tiny.eps, max_position_embeddings=256,
                      tie_word_embeddings=tiny.tied, sliding_window=sliding_window, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, **extra)


def _transformers(weights: dict[str, np.ndarray], tiny: gf.Tiny, sliding_window: int | None = None):
    """transformers' Phi-3 whose weights are the file's tensors (dequantized), named as llama.cpp's converter maps
    them (attn_qkv is qkv_proj, ffn_up is gate_up_proj)."""
    from transformers import Phi3ForCausalLM

    names = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
    state = {"model.embed_tokens.weight": weights["token_embd.weight"],
             "model.norm.weight": weights["output_norm.weight"],
             "lm_head.weight": weights.get("output.weight", weights["token_embd.weight"])}
    for i in range(tiny.layers):
        state.update({f"model.layers.{i}.{hf}.weight": weights[f"blk.{i}.{name}.weight"] for name, hf in names.items()})
    model = Phi3ForCausalLM(_config(tiny, sliding_window)).eval()
    model.load_state_dict({name: torch.tensor(np.asarray(w, np.float32)) for name, w in state.items()})
    return model


def _random_transformers(tiny: gf.Tiny, seed: int = 0):
    """A random tiny Phi-3, its weights at the scale of tests/gguf_files.py's (transformers' 0.02 gives logits near
    zero, which would hide a wrong matrix)."""
    from transformers import Phi3ForCausalLM

    torch.manual_seed(seed)
    model = Phi3ForCausalLM(_config(tiny)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.copy_(1.0 + 0.1 * torch.randn_like(weight))
            else:
                weight.copy_((0.5 if "embed" in name else 0.15) * torch.randn_like(weight))
    return model


def _expected(model) -> np.ndarray:
    """transformers' logits of the prompt and each fed token."""
    with torch.no_grad():
        return model(torch.tensor([PROMPT + FED])).logits[0].numpy()


def _logits(engine) -> np.ndarray:
    """The prompt's logits, then each decode step's on the fed tokens (an artifact's Engine, or onnxruntime's)."""
    engine.reset()
    rows = [np.asarray(engine.forward(np.array(PROMPT))).reshape(len(PROMPT), -1)]
    rows += [np.asarray(engine.forward([token])).reshape(1, -1) for token in FED]
    return np.concatenate(rows)


def _build(path: Path, out: Path, *extra: str) -> None:
    assert main(["build", str(path), "--target", "cpu", "--dense", "-o", str(out), "--max-context", str(CONTEXT),
                 *extra]) == 0


def _converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py, where scripts/build_llama_cpp.sh unpacked its source (the newest)."""
    found = sorted(llama_cpp.default_root().glob("src-*/convert_hf_to_gguf.py"))
    return found[-1] if found else None


# The converter as llama.cpp ships it, with its own gguf-py, but for the vocabulary: Phi-3's wants sentencepiece's
# tokenizer.model (or a BPE tokenizer whose pre-tokenizer it knows by hash), which a test cannot make without
# sentencepiece; the weights and the metadata are the converter's own.
DRIVER = """
import sys
source = sys.argv[1]
sys.path[:0] = [source + "/gguf-py", source]
import convert_hf_to_gguf
from conversion import phi
phi.Phi3MiniModel.set_vocab = lambda self: None
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def _convert(model, directory: Path, outtype: str) -> Path:
    converter = _converter()
    if converter is None:
        pytest.skip(f"llama.cpp's source is not under {llama_cpp.default_root()} (scripts/build_llama_cpp.sh "
                    "unpacks it)")
    hf, out = directory / "hf", directory / f"phi3-{outtype}.gguf"
    if not hf.is_dir():
        model.save_pretrained(hf)
    driver = directory / "convert.py"
    driver.write_text(DRIVER)
    done = subprocess.run([sys.executable, str(driver), str(converter.parent), str(hf), "--outfile", str(out),
                           "--outtype", outtype], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _file_tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_a_written_phi3_file_computes_transformers_phi3(tmp_path):
    """tests/gguf_files.py's Phi-3, its attn_qkv in F16 and its ffn_up in F32 (each split as floats), and a sliding
    window as wide as the build's context (within which it changes nothing): the dense fp32 build's logits are those
    of transformers' Phi-3 over the file's tensors, which masks by the window."""
    tiny = dataclasses.replace(TINY, formats={"attn_qkv": T.F16}, sliding_window=CONTEXT)
    path = tmp_path / "phi3.gguf"
    weights = gf.write(path, tiny)
    assert weights["blk.0.attn_qkv.weight"].shape == (2 * tiny.d_model, tiny.d_model)  # q + k + v rows, fused
    out = tmp_path / "phi3.pic"
    _build(path, out, "--weight-dtype", "fp32")
    expected = _expected(_transformers(weights, tiny, sliding_window=CONTEXT))
    np.testing.assert_allclose(_logits(Engine(out)), expected, atol=1e-4, rtol=0)


def test_llama_cpps_converter_writes_what_builds_into_transformers_phi3(tmp_path):
    """A random Phi-3 from transformers, converted by llama.cpp's converter in F32: the dense fp32 build computes
    transformers' logits."""
    model = _random_transformers(TINY)
    path = _convert(model, tmp_path, "f32")
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= set(_file_tensors(path))
    out = tmp_path / "phi3.pic"
    _build(path, out, "--weight-dtype", "fp32")
    np.testing.assert_allclose(_logits(Engine(out)), _expected(model), atol=1e-4, rtol=0)


def _int8_blocks(tensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's integers [N, K] and fp16 scales [N, K/32] as the file stores them."""
    N, K = (int(d) for d in reversed(tensor.shape.tolist()))
    blocks = np.asarray(tensor.data).reshape(N, K // 32, -1)
    return blocks[..., 2:].view(np.int8).reshape(N, K), np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]


def _assert_int8_rows(stored: dict, name: str, tensor) -> None:
    """The artifact's int8 matrix `name` is the Q8_0 tensor's rows, as stored (integers and scales)."""
    q, d = _int8_blocks(tensor)
    packed, scales = quant.pack_panels(np.ascontiguousarray(q.T), np.ascontiguousarray(d.T), WEIGHT_FORMATS["int8"])
    assert np.array_equal(stored[name + ".q"], packed), name
    assert np.array_equal(stored[name + ".q.scales"], scales), name


def test_llama_cpps_q8_0_file_keeps_its_fused_blocks(tmp_path):
    """The converter's Q8_0 file (llama.cpp's own rounding): the default build stores w_qkv and w_up as the file's
    attn_qkv and ffn_up rows, block for block, and computes the file's model with fp32 activations."""
    path = _convert(_random_transformers(TINY), tmp_path, "q8_0")
    tensors = _file_tensors(path)
    assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == "Q8_0"
    out = tmp_path / "phi3-q8_0.pic"
    _build(path, out, "--no-int8-activations")
    stored = read_safetensors(out / "weights" / "cpu.safetensors")
    for i in range(TINY.layers):
        _assert_int8_rows(stored, f"layers.{i}.attn.w_qkv", tensors[f"blk.{i}.attn_qkv.weight"])
        _assert_int8_rows(stored, f"layers.{i}.ffn.w_up", tensors[f"blk.{i}.ffn_up.weight"])
    np.testing.assert_allclose(_logits(Engine(out)), _logits(OrtDecoder(reference_onnx(path))), atol=1e-4, rtol=0)


def test_fused_tensors_in_blocks_reach_the_artifact_bit_for_bit(tmp_path, capsys):
    """A written Phi-3 whose attn_qkv is Q8_0 and ffn_up Q4_K: the default build keeps both in the file's blocks
    (the split matrices, joined again by recognise, are the file's rows as stored), and its logits with fp32
    activations are transformers' over the file's values."""
    path = tmp_path / "phi3-blocks.gguf"
    weights = gf.write(path, QUANTIZED)
    out = tmp_path / "phi3-blocks.pic"
    _build(path, out, "--no-int8-activations")
    assert "re-rounded" not in capsys.readouterr().err
    stored = read_safetensors(out / "weights" / "cpu.safetensors")
    tensors = _file_tensors(path)
    for i in range(QUANTIZED.layers):
        _assert_int8_rows(stored, f"layers.{i}.attn.w_qkv", tensors[f"blk.{i}.attn_qkv.weight"])
        name, fmt = f"layers.{i}.ffn.w_up", WEIGHT_FORMATS["q4_k"]
        expected = weights[f"blk.{i}.ffn_up.weight"].T  # gate's rows, then up's: w_up's columns
        blocks = kquant.unpack_panels(stored[name], stored[name + ".scales"], fmt, *expected.shape)
        assert np.array_equal(blocks.dequantize(), expected), name
        assert stored[name].nbytes + stored[name + ".scales"].nbytes <= 1.05 * tensors[f"blk.{i}.ffn_up.weight"].n_bytes
    np.testing.assert_allclose(_logits(Engine(out)), _expected(_transformers(weights, QUANTIZED)), atol=1e-4, rtol=0)


def _longrope(tensors):
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        tensors[name] = (np.ones(TINY.head_dim // 2, np.float32), T.F32)


@pytest.mark.parametrize("case,edit,metadata,words", [
    ("longrope", _longrope, None, "tensor rope_factors_long.weight is LongRoPE's"),
    ("attn_factor", None, {"phi3.rope.scaling.attn_factor": 1.19}, "rope.scaling.attn_factor 1.19 is not supported"),
])
def test_what_phi3_refuses_is_one_line(tmp_path, capsys, case, edit, metadata, words):
    """LongRoPE's factors (and the attention factor it comes with) refused: exit 2, one `error:` line naming the
    feature, nothing written."""
    path = tmp_path / f"{case}.gguf"
    gf.write(path, TINY, edit=edit, tokenizer=metadata)
    out = tmp_path / f"{case}.pic"
    assert main(["build", str(path), "--target", "cpu", "--dense", "-o", str(out), "--max-context",
                 str(CONTEXT)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
    assert not out.exists()


def test_a_phi3_files_sliding_window_is_not_applied_as_llama_cpp_does_not(tmp_path):
    """A window (4) narrower than the prompt (7 tokens) and the build's context: llama.cpp attends to every position
    of a phi3 file (its SWA disabled), and so does the build: transformers' Phi-3 without a window."""
    tiny = dataclasses.replace(TINY, sliding_window=4)
    path = tmp_path / "phi3.gguf"
    weights = gf.write(path, tiny)
    out = tmp_path / "phi3.pic"
    _build(path, out, "--weight-dtype", "fp32")
    np.testing.assert_allclose(_logits(Engine(out)), _expected(_transformers(weights, tiny)), atol=1e-4, rtol=0)


def test_llama_cpps_longrope_file_is_refused(tmp_path, capsys):
    """Phi-3.5's LongRoPE as the converter writes it (rope_factors_long / _short, rope.scaling.attn_factor)."""
    from transformers import Phi3ForCausalLM

    half = TINY.head_dim // 2
    config = _config(TINY, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.5] * half,
                                            "short_factor": [1.0] * half, "original_max_position_embeddings": 64})
    path = _convert(Phi3ForCausalLM(config), tmp_path, "f32")
    capsys.readouterr()  # (transformers' advice on the config)
    assert main(["build", str(path), "--target", "cpu", "--dense", "-o", str(tmp_path / "x.pic")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "tensor rope_factors_long.weight is LongRoPE's" in lines[0], lines
