"""The GGUF architecture registry (passes/architectures/): an unknown architecture's one-line refusal, each
registered architecture's tensors for a tiny model, what its features admit in a file, and no architecture named
anywhere else in the compiler's or the runtime's sources."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import gguf_files as gf
from passes.architectures import ARCHITECTURES, architecture_of
from passes.errors import UserError
from passes.gguf_graph import Hyper
from passes.import_gguf import _expected_shapes, hyper, read, tensors

ROOT = Path(__file__).resolve().parents[1]

# a tiny model whose every size differs: d_model 8, ffn 16, 2 heads and 1 kv head of 6, 10 tokens
TINY = dict(layers=1, d_model=8, ffn=16, heads=2, kv_heads=1, head_dim=6, eps=1e-5, rope_base=1e4, rope_scale=1.0)
VOCAB = 10
BLOCK = {  # name -> (numpy-order shape, weight matrix, required)
    "blk.0.attn_norm.weight": ((8,), False, True),
    "blk.0.attn_q.weight": ((12, 8), True, True),
    "blk.0.attn_k.weight": ((6, 8), True, True),
    "blk.0.attn_v.weight": ((6, 8), True, True),
    "blk.0.attn_output.weight": ((8, 12), True, True),
    "blk.0.ffn_norm.weight": ((8,), False, True),
    "blk.0.ffn_gate.weight": ((16, 8), True, True),
    "blk.0.ffn_up.weight": ((16, 8), True, True),
    "blk.0.ffn_down.weight": ((8, 16), True, True),
}
MODEL = {"token_embd.weight": ((10, 8), True, True), "output_norm.weight": ((8,), False, True),
         "output.weight": ((10, 8), True, False)}


def _biases(required: bool) -> dict:
    return {"blk.0.attn_q.bias": ((12,), False, required), "blk.0.attn_k.bias": ((6,), False, required),
            "blk.0.attn_v.bias": ((6,), False, required)}


def _fused() -> dict:
    """phi3's block: q, k, v in attn_qkv [12 + 6 + 6, 8]; gate and up in ffn_up [16 + 16, 8]."""
    block = {name: spec for name, spec in BLOCK.items() if not name.endswith(("attn_q.weight", "attn_k.weight",
                                                                             "attn_v.weight", "ffn_gate.weight"))}
    return {**block, "blk.0.attn_qkv.weight": ((24, 8), True, True), "blk.0.ffn_up.weight": ((32, 8), True, True)}


EXPECTED = {
    "llama": {**MODEL, "rope_freqs.weight": ((3,), False, False), **BLOCK, **_biases(required=False)},
    "qwen2": {**MODEL, **BLOCK, **_biases(required=True)},
    "phi3": {**MODEL, **_fused()},
    "qwen3": {**MODEL, **BLOCK, "blk.0.attn_q_norm.weight": ((6,), False, True),
              "blk.0.attn_k_norm.weight": ((6,), False, True), **_biases(required=False)},
}


def test_every_registered_architecture_has_its_expected_tensors_here():
    assert set(EXPECTED) == set(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_an_architectures_tensors_for_a_tiny_model(name):
    h = Hyper(architecture_of(name), **TINY)
    assert _expected_shapes(h, VOCAB) == EXPECTED[name]


def test_a_fused_tensor_holds_its_matrices_in_row_ranges():
    """phi3's attn_qkv holds q, k and v, in that order; its ffn_up holds gate's rows, then up's (ggml_swiglu's
    halves); every other matrix is a tensor of its own."""
    h = Hyper(architecture_of("phi3"), **TINY)
    assert architecture_of("phi3").held(h, VOCAB) == {
        "attn_q.weight": ("attn_qkv.weight", range(0, 12)), "attn_k.weight": ("attn_qkv.weight", range(12, 18)),
        "attn_v.weight": ("attn_qkv.weight", range(18, 24)), "ffn_gate.weight": ("ffn_up.weight", range(0, 16)),
        "ffn_up.weight": ("ffn_up.weight", range(16, 32))}
    assert architecture_of("llama").held(Hyper(architecture_of("llama"), **TINY), VOCAB) == {}


@pytest.mark.parametrize("parts", [("attn_q.weight", "attn_output.weight"),  # of different widths
                                   ("attn_q.weight", "attn_norm.weight"),  # a norm is no matrix
                                   ("attn_q.weight", "attn_x.weight")])  # no block tensor
def test_a_fused_tensor_stacks_block_matrices_of_one_width(parts):
    from dataclasses import replace

    from passes.architectures import Fused

    with pytest.raises(ValueError, match="must stack block matrices of one width"):
        replace(architecture_of("phi3"), fused=(Fused("attn_qo.weight", parts),))


def test_an_unknown_architecture_is_refused_in_one_line_naming_it_and_the_supported_ones(tmp_path):
    with pytest.raises(UserError) as refused:
        architecture_of("gemma3")
    assert str(refused.value) == ("architecture 'gemma3' is not supported (picompile compiles GGUF llama, qwen2, qwen3, "
                                  "phi3)")
    path = tmp_path / "gemma3.gguf"
    gf.write(path, gf.Tiny(arch="gemma3"))
    with pytest.raises(UserError) as refused:
        hyper(read(path), path)
    message = str(refused.value)
    assert message == f"{path}: architecture 'gemma3' is not supported (picompile compiles GGUF " \
                      f"{', '.join(ARCHITECTURES)})" and "\n" not in message


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_a_tiny_file_of_each_architecture_reads(tmp_path, name):
    """The writer of tests/gguf_files.py writes what llama.cpp's converter writes: its tensors are the
    architecture's (every required one there) and its metadata the hyper-parameters it was made with."""
    tiny = gf.Tiny(arch=name)
    path = tmp_path / f"{name}.gguf"
    gf.write(path, tiny)
    reader = read(path)
    h = hyper(reader, path)
    found, vocab = tensors(reader, h, path)
    expected = _expected_shapes(h, vocab)
    assert h.architecture is ARCHITECTURES[name] and vocab == tiny.vocab
    assert (h.layers, h.d_model, h.ffn, h.heads, h.kv_heads, h.head_dim) == (
        tiny.layers, tiny.d_model, tiny.ffn, tiny.heads, tiny.kv_heads, tiny.head_dim)
    assert {n for n, (_, _, required) in expected.items() if required} <= set(found) <= set(expected)


def _with_biases(tensors):
    for name, width in (("attn_q", 64), ("attn_k", 32), ("attn_v", 32)):
        tensors[f"blk.0.{name}.bias"] = (np.zeros(width, np.float32), gf.T.F32)


@pytest.mark.parametrize("name,tiny,edit,refusal", [
    ("llama_with_biases", gf.Tiny(), _with_biases, None),  # llama.cpp reads a llama's q/k/v biases where present
    ("qwen2_without_a_bias", gf.Tiny(arch="qwen2"), lambda t: t.pop("blk.1.attn_k.bias"),
     "tensor blk.1.attn_k.bias is missing"),
    ("qwen2_with_rope_freqs", gf.Tiny(arch="qwen2", rope_freqs=True), None,
     "tensor rope_freqs.weight is not part of a qwen2 model"),  # llama.cpp's qwen2 has none either
    ("qwen3_without_a_k_norm", gf.Tiny(arch="qwen3"), lambda t: t.pop("blk.0.attn_k_norm.weight"),
     "tensor blk.0.attn_k_norm.weight is missing"),
    ("qwen3_with_biases", gf.Tiny(arch="qwen3"), _with_biases, None),  # as llama.cpp's qwen3 reads them
])
def test_what_an_architectures_features_admit(tmp_path, name, tiny, edit, refusal):
    path = tmp_path / f"{name}.gguf"
    gf.write(path, tiny, edit=edit)
    reader = read(path)
    if refusal is None:
        tensors(reader, hyper(reader, path), path)
        return
    with pytest.raises(UserError, match=refusal):
        tensors(reader, hyper(reader, path), path)


@pytest.mark.parametrize("metadata,scale", [
    ({}, 1.0),
    ({"llama.rope.scaling.factor": 4.0}, 4.0),  # llama.cpp's default type is linear
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, 1.0),  # none never scales
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope scaling 'yarn' is not supported"),
    ({"llama.rope.scaling.attn_factor": 1.0}, 1.0),
    # llama.cpp multiplies RoPE's cos and sin by it, for every architecture
    ({"llama.rope.scaling.attn_factor": 1.25}, "rope.scaling.attn_factor 1.25 is not supported"),
])
def test_rope_scaling_reads_as_llama_cpp_reads_it(tmp_path, metadata, scale):
    path = tmp_path / "scaled.gguf"
    gf.write(path, gf.Tiny(), tokenizer=metadata)
    if isinstance(scale, str):
        with pytest.raises(UserError, match=scale):
            hyper(read(path), path)
    else:
        assert hyper(read(path), path).rope_scale == scale


# Where a registered architecture's name may appear outside the registry, because it names something else:
# tokenizer.ggml.model's SentencePiece type ("llama") and llama.cpp's pre-tokenizer names ("qwen2")
NOT_ARCHITECTURES = {"passes/gguf_tokenizer.py": {"SENTENCEPIECE", "PRE_TOKENIZERS"}}


def _architecture_names(source: str, allowed: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, name) of every string constant in `source` that is a registered architecture's name, outside the
    module-level assignments to the names in `allowed`."""
    found = []
    for statement in ast.parse(source).body:
        targets = statement.targets if isinstance(statement, ast.Assign) else \
            [statement.target] if isinstance(statement, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id in allowed for t in targets):
            continue
        found += [(node.lineno, node.value) for node in ast.walk(statement)
                  if isinstance(node, ast.Constant) and node.value in ARCHITECTURES]
    return found


def test_no_source_outside_the_registry_names_an_architecture():
    """What an architecture is lives in its module: a comparison with its name elsewhere (`h.architecture ==
    "llama"`) would be a second home for one of its facts."""
    registry = ROOT / "passes" / "architectures"
    named = {}
    for path in sorted(p for floor in ("picompile", "passes", "runtime") for p in (ROOT / floor).rglob("*.py")):
        if registry in path.parents:
            continue
        relative = path.relative_to(ROOT).as_posix()
        found = _architecture_names(path.read_text(), NOT_ARCHITECTURES.get(relative, set()))
        if found:
            named[relative] = found
    assert not named, f"architecture names outside passes/architectures/: {named}"


def test_the_scan_sees_a_comparison_and_passes_the_allowed_assignments():
    source = 'SENTENCEPIECE = "llama"\ndef f(h):\n    return h.architecture == "qwen2" or h in ("llama",)\n'
    assert sorted(_architecture_names(source, {"SENTENCEPIECE"})) == [(3, "llama"), (3, "qwen2")]
