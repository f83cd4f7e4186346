"""The GGUF front end: tiny GGUF files written on the fly (tests/gguf_files.py) import into an ONNX decoder that
onnxruntime runs as llama.cpp computes the file, keep the file's values (F32 / F16 as stored, Q8_0 / Q4_0 blocks
bit for bit in the artifact's int8 / int4 blocks, everything else dequantized exactly), build, and carry the
file's tokenizer. Bad files: tests/test_bad_inputs.py."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

import gguf_files as gf
from passes.gguf_graph import rope_rows
from passes.file_blocks import file_matrix
from passes.import_gguf import ImportGGUF, converted, load, reference_onnx
from passes.kernels import quant
from passes import ir as pir
from picompile.cli import main
from passes.pipeline import Context
from passes.reference import OrtDecoder
from passes.targets import get_target, host_cpu_isa
from runtime import Engine, load_manifest
from runtime.artifact import read_safetensors
from runtime.dtypes import WEIGHT_FORMATS

T = gf.T
PROMPT = np.array([3, 14, 15, 92, 65, 35, 89], np.int64)
# every type the front end treats its own way, in one llama: the file's blocks (Q8_0, Q4_0, Q4_1, Q4_K, a Q8_0
# embedding table), half matrices behind a Cast (F16, BF16), float32 as stored; and LLaMA 3.1's rope_freqs
MIXED = gf.Tiny(d_model=256, heads=8, kv_heads=2, ffn=256, rope_freqs=True, formats={
    "attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.F16, "ffn_up": T.BF16,
    "ffn_down": T.Q4_K, "token_embd": T.Q8_0, "output": T.Q4_0})
MODELS = {"llama": gf.Tiny(), "qwen2": gf.Tiny(arch="qwen2", tied=True), "mixed": MIXED,
          "f16_tied": gf.Tiny(default=T.F16, tied=True), "phi3": gf.Tiny(arch="phi3", formats={"attn_qkv": T.Q8_0}),
          "qwen3": gf.Tiny(arch="qwen3", key_length=32),
          # a window shorter than the prompt, caps its scores and logits reach (tests/test_gemma.py: the rest)
          "gemma2": gf.Tiny(arch="gemma2", layers=3, window=4, attn_softcap=2.0, final_softcap=3.0)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (path, the file's tensors dequantized), written once."""
    root, made = tmp_path_factory.mktemp("gguf"), {}

    def get(name: str, tiny: gf.Tiny | None = None, **kwargs):
        if name not in made:
            path = root / f"{name}.gguf"
            made[name] = path, gf.write(path, tiny or MODELS[name], **kwargs)
        return made[name]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_onnxruntime_on_the_import_computes_what_llama_cpp_computes(files, name):
    """A numpy forward with llama.cpp's RoPE (adjacent pairs over the permuted q / k rows for llama, NeoX pairs
    for qwen2 and phi3, whose fused tensors it splits itself) on the file's dequantized tensors is what onnxruntime
    computes on the front end's ONNX."""
    path, weights = files(name)
    reference = gf.forward(weights, MODELS[name], PROMPT)
    logits = OrtDecoder(reference_onnx(path)).forward(PROMPT).reshape(reference.shape)
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_the_import_holds_the_files_values_exactly(files):
    """After the import pass, every weight is the file's: each block-quantized matrix a `FileTensor` over the file's
    blocks whose values are exactly `gguf.quants.dequantize`'s (q and k rows in rotate-half order), the F16 matrix
    as stored; and the source's formats are a fact on the model."""
    path, weights = files("mixed")
    model = ImportGGUF().apply(load(path), Context(get_target("cpu"))).model
    graph = model.graph
    q_rows = rope_rows(MIXED.heads, MIXED.head_dim)
    k_rows = rope_rows(MIXED.kv_heads, MIXED.head_dim)
    expected = {"blk.0.attn_q": weights["blk.0.attn_q.weight"][q_rows].T,
                "blk.0.attn_k": weights["blk.0.attn_k.weight"][k_rows].T,
                "blk.0.attn_v": weights["blk.0.attn_v.weight"].T,
                "blk.0.attn_output": weights["blk.0.attn_output.weight"].T,
                "blk.0.ffn_down": weights["blk.0.ffn_down.weight"].T,
                "blk.0.ffn_up": weights["blk.0.ffn_up.weight"].T,
                "token_embd.weight": weights["token_embd.weight"],
                "output": weights["output.weight"].T}
    for name, values in expected.items():
        stored = pir.const_array(graph.initializers[name])
        assert np.array_equal(np.asarray(stored, np.float32), values.astype(np.float32)), name
    assert graph.initializers["blk.0.attn_output"].const_value.dtype == pir.ir.DataType.FLOAT16
    assert graph.initializers["blk.0.ffn_up"].const_value.dtype == pir.ir.DataType.BFLOAT16
    from passes.import_gguf import GGUFSource
    from passes.import_onnx import SourceQuantization

    source = GGUFSource.of(model)
    formats = {t.name: t.format for t in source.tensors}
    assert formats["blk.0.attn_v.weight"] == "Q4_1" and formats["blk.1.ffn_down.weight"] == "Q4_K"
    assert source.weight_dtype() == "int8"  # Q8_0 holds the most weights
    assert source.changed("int4") and not source.changed("fp32")
    assert SourceQuantization.of(model) is None  # no MatMulNBits: the file's blocks are FileTensors
    held = {name: file_matrix(value) for name, value in graph.initializers.items()}
    assert {name: matrix.stored_format().name for name, matrix in held.items() if matrix is not None} == {
        **{f"blk.{i}.{name}": fmt for i in range(MIXED.layers)
           for name, fmt in (("attn_q", "int8"), ("attn_k", "int4"), ("attn_v", "int4a"), ("ffn_down", "q4_k"))},
        "token_embd.weight": "int8", "output": "int4"}


def _logits(engine, steps: int = 4, fed: list[int] | None = None) -> list[np.ndarray]:
    """Logits of the prompt, then of `steps` greedy decode steps (or of decode steps on the tokens `fed`)."""
    engine.reset()
    rows = [np.asarray(engine.forward(PROMPT)).reshape(len(PROMPT), -1)]
    for step in range(steps if fed is None else len(fed)):
        token = int(np.argmax(rows[-1][-1])) if fed is None else fed[step]
        rows.append(np.asarray(engine.forward([token])).reshape(1, -1))
    return rows


def test_a_dense_fp32_build_matches_onnxruntime_on_the_import_and_writes_text(files, tmp_path, capsys):
    """The mixed file, with a tokenizer in its metadata: fp32 holds every value of the file (no re-rounding
    warning), the artifact's logits are onnxruntime's on the import, prompt and decode steps, `run -p` reads
    text with the file's tokenizer, and `eval --reference FILE.gguf` measures the artifact against the file."""
    path, _ = files("mixed-tokenized", MIXED, tokenizer=_metadata()[0])
    out = tmp_path / "mixed.pic"
    assert main(["build", str(path), "--target", "cpu", "--dense", "--weight-dtype", "fp32", "-o", str(out),
                 "--max-context", "32"]) == 0
    err = capsys.readouterr().err
    assert "re-rounded" not in err and "tokenizer" not in err
    for ours, reference in zip(_logits(Engine(out)), _logits(OrtDecoder(reference_onnx(path)))):
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert main(["run", str(out), "-p", "the quick", "-n", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    tokens = tmp_path / "tokens.txt"  # eval takes the file itself as its reference
    tokens.write_text("3 14 15 92 65 35 89 79 32 38 46 26\n")
    assert main(["eval", str(out), "--reference", str(path), "--tokens", str(tokens), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top1_agreement"] == 1.0 and report["kl_mean"] < 1e-8


def test_a_file_without_a_tokenizer_says_so(files):
    from passes.front_end import find_tokenizer

    path, _ = files("qwen2")
    assert find_tokenizer(path) is None
    assert any("no tokenizer in its metadata" in note for note in converted(path).source.notes)


def test_the_readers_arrays_are_the_gguf_packages_and_a_damaged_one_is_one_error(tmp_path):
    """import_gguf reads arrays of strings and numbers in one pass (a vocabulary's in a fraction of a second): the
    same fields as the gguf package's reader; a string that says it runs past the end of the file is refused."""
    from passes.errors import UserError
    from passes.import_gguf import _read

    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "", "ünï", "x" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0, -0.5])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 6])
    writer.add_string("general.name", "arrays")
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = _read(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.contents(), mine.types, mine.data) == (field.contents(), field.types, field.data), key
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts], key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[3] == "ünï"
    assert [t.name for t in ours.tensors] == ["w"] and ours.tensors[0].data.tolist() == list(range(8))

    damaged = gguf.GGUFReader(str(path), "r+")
    # the second string's length (parts: key length, key, type, item type, count, then length and bytes a string)
    damaged.fields["tokenizer.ggml.tokens"].parts[7][0] = 1 << 40
    damaged.data.flush()
    del damaged
    with pytest.raises(UserError, match="truncated or damaged"):
        _read(path)


def _blocks(raw: np.ndarray, kind: str, shape) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 / Q4_0 tensor's integers [N, K] and scales [N, K/32] as the file stores them."""
    N, K = shape
    blocks = raw.reshape(N, K // 32, -1)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if kind == "Q8_0":
        return blocks[..., 2:].view(np.int8).reshape(N, K), d
    codes = np.concatenate([blocks[..., 2:] & 0xF, blocks[..., 2:] >> 4], axis=-1).astype(np.int8) - 8
    return codes.reshape(N, K), d


@pytest.mark.parametrize("kind,weight_dtype", [("Q4_0", "int4"), ("Q8_0", "int8")])
def test_q4_0_and_q8_0_blocks_reach_the_artifact_bit_for_bit(files, tmp_path, capsys, kind, weight_dtype):
    """Every matrix of a Q4_0 (Q8_0) file is in the int4 (int8) artifact with the file's integers and scales
    (Q8_0's d = max|w| / 127 too, which no rounding rule gives back), and computes the file's model."""
    tiny = gf.Tiny(default=getattr(T, kind), tied=kind == "Q8_0")
    path, _ = files(kind, tiny)
    out = tmp_path / f"{kind}.pic"
    assert main(["build", str(path), "--target", "cpu", "--dense", "-o", str(out), "--max-context", "32",
                 "--no-int8-activations"]) == 0  # auto: the file's own format
    assert "re-rounded" not in capsys.readouterr().err
    stored = read_safetensors(out / "weights" / "cpu.safetensors")
    fmt = WEIGHT_FORMATS[weight_dtype]
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def file_blocks(name, rows=None):
        t = tensors[name]
        q, d = _blocks(t.data, kind, tuple(reversed(t.shape.tolist())))
        return (q, d) if rows is None else (q[rows], d[rows])

    for layer in range(tiny.layers):
        p, a = f"blk.{layer}.", f"layers.{layer}."
        parts = [file_blocks(p + "attn_q.weight", rope_rows(tiny.heads, tiny.head_dim)),
                 file_blocks(p + "attn_k.weight", rope_rows(tiny.kv_heads, tiny.head_dim)),
                 file_blocks(p + "attn_v.weight")]
        qkv = (np.concatenate([q for q, _ in parts]).T, np.concatenate([d for _, d in parts]).T)
        gate_up = [file_blocks(p + "ffn_gate.weight"), file_blocks(p + "ffn_up.weight")]
        up = (np.concatenate([q for q, _ in gate_up]).T, np.concatenate([d for _, d in gate_up]).T)
        for name, (q, d) in ((a + "attn.w_qkv", qkv), (a + "attn.w_o", file_blocks(p + "attn_output.weight")),
                             (a + "ffn.w_up", up), (a + "ffn.w_down", file_blocks(p + "ffn_down.weight"))):
            if name.endswith(("w_o", "w_down")):
                q, d = q.T, d.T
            packed, scales = quant.pack_panels(np.ascontiguousarray(q), np.ascontiguousarray(d), fmt)
            assert np.array_equal(stored[name + ".q"], packed), name
            assert np.array_equal(stored[name + ".q.scales"], scales), name
    if kind == "Q8_0":  # the tied table: the embedding's rows and the output layer, both the file's blocks
        q, d = file_blocks("token_embd.weight")
        packed, scales = quant.pack_rows(q, d, fmt)
        assert np.array_equal(stored["embed.tokens.q"], packed)
        assert np.array_equal(stored["embed.tokens.q.scales"], scales)
    # the stored values are the file's: fp32 activations compute the file's model
    for ours, reference in zip(_logits(Engine(out)), _logits(OrtDecoder(reference_onnx(path)))):
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


TEXTS = ["The capital of France is Paris.", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
         "naïve café, 日本語のテキスト, emoji 🙂 and ünïcödé", "tabs\tand   runs of    spaces\n\n\nand newlines  ",
         "<|im_start|>user\nhi there<|im_end|>\n", "12345 + 678 = 13023", ""]


def _trained_bpe():
    """A byte-level BPE trained here (GPT-2's pre-tokenizer), with two control tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog " * 4, "import numpy as np\n" * 4]
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def _metadata():
    """The trained tokenizer as llama.cpp's converter writes it into the metadata (tokens in id order, token
    types, merges, pre-tokenizer name, special ids, a chat template); and the trained tokenizer."""
    import json

    trained = _trained_bpe()
    vocab = trained.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(pair) for pair in json.loads(trained.to_str())["model"]["merges"]]
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t.startswith("<|") else 1 for t in tokens],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
            "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"], "tokenizer.chat_template": template}, trained


def test_a_gpt2_tokenizer_round_trips_through_the_metadata(files):
    """A tokenizer trained here, written into a GGUF's metadata, comes back encoding every text (English,
    code, Unicode, whitespace runs, control tokens) to the same ids, with its special ids and chat template."""
    metadata, trained = _metadata()
    vocab = trained.get_vocab()
    path, _ = files("tokenized", gf.Tiny(vocab=len(vocab)), tokenizer=metadata)
    from passes.front_end import find_tokenizer

    found = find_tokenizer(path).tokenizer
    for text in TEXTS:
        assert found.encode(text) == trained.encode(text).ids, text
        assert found.decode(found.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert found.eos_ids == {vocab["<|im_end|>"]} and found.bos_id == vocab["<|im_start|>"]
    assert found.chat_prompt([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_a_sentencepiece_vocabulary_merges_by_score_with_byte_fallback(files):
    """llama's vocabulary type: pieces merge by their score, a space prefix, unknown characters as <0xXX>."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
             ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "or", "▁w", "▁wor",
              "ld", "▁world"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    scores[pieces.index("▁hello")] = 5.0
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0}
    path, _ = files("spm", gf.Tiny(vocab=len(pieces)), tokenizer=metadata)
    from passes.front_end import find_tokenizer

    found = find_tokenizer(path).tokenizer
    ids = found.encode("hello world 日")
    assert ids[:3] == [1, pieces.index("▁hello"), pieces.index("▁world")]  # BOS: llama's default
    assert [pieces[i] for i in ids[3:]] == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]
    assert found.decode(ids) == "hello world 日"


def test_a_quantized_files_build_expects_the_quality_its_kernels_measure(files, tmp_path, capsys, monkeypatch):
    """auto's build of a Q4_1 file whose tied output layer is Q8_0 (SmolLM2's Q4_1 file, small): the quality
    pass's reference computes what the kernels compute (the file's own blocks, the output layer in the int8
    blocks it came in, each quantized GEMV's and prefill GEMM's input rounded to int8 where the kernel reads
    int8), so the KL the build expects on its held-out tokens is the KL eval measures on the same tokens (it
    was 0.0065 against 0.0081 with the output layer's and the prompt rows' rounding left out)."""
    import passes.quality as quality
    from passes.budget import PROMPT_TOKENS

    tiny = gf.Tiny(default=T.Q4_1, tied=True, formats={"token_embd": T.Q8_0}, d_model=128, ffn=256, vocab=512)
    path, _ = files("q4_1-tied-q8_0", tiny)
    rng = np.random.default_rng(1)
    calib, held_out = tmp_path / "calib.npy", rng.integers(0, tiny.vocab, (4, 48))
    np.save(calib, rng.integers(0, tiny.vocab, (16, 48)))
    split = quality._split
    monkeypatch.setattr(quality, "_split",
                        lambda sequences, parameters: (split(sequences, parameters)[0], list(held_out)))
    out = tmp_path / "q4_1.pic"
    assert main(["build", str(path), "--target", "cpu", "--calib", str(calib), "--max-context", "64",
                 "-o", str(out)]) == 0
    expected = load_manifest(out).quality
    tokens = tmp_path / "held_out.txt"
    tokens.write_text("".join(" ".join(map(str, row)) + "\n" for row in held_out))
    capsys.readouterr()
    assert main(["eval", str(out), "--reference", str(path), "--tokens", str(tokens), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert expected.tokens == measured["positions"] == held_out.size - len(held_out) * PROMPT_TOKENS  # scored the same
    assert measured["kl_mean"] == pytest.approx(expected.kl, rel=0.05), (measured, expected)
    # inspect names each layer's formats (int4a's values are buffers of their own name)
    assert main(["inspect", str(out)]) == 0
    assert capsys.readouterr().out.count("int4a/int4a/int4a/int4a") == tiny.layers


# a llama in the blocks of the files people download (Q4_K_M, Q5_K_M, Q6_K mix these): every kept format once; q, k
# and v in two formats (layer 0: Q5_0 and Q6_K, stored run by run; layer 1: Q5_0 and Q8_0, joined in int8, which
# holds both), the table's rows in Q5_0, the output layer in Q6_K
KEPT = gf.Tiny(d_model=256, heads=4, kv_heads=2, ffn=512, vocab=300, formats={
    "attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.Q5_K,
    "ffn_up": T.Q5_K, "ffn_down": T.Q6_K, "token_embd": T.Q5_0, "output": T.Q6_K})


def _rows(name: str):
    """The rows the import puts q's and k's in (rotate-half order, as the graph computes RoPE)."""
    if name == "attn_q":
        return rope_rows(KEPT.heads, KEPT.head_dim)
    return rope_rows(KEPT.kv_heads, KEPT.head_dim) if name == "attn_k" else slice(None)


def _layer_1_v_in_q8_0(tensors):
    name = "blk.1.attn_v.weight"
    raw, kind = tensors[name]
    tensors[name] = (gguf.quants.quantize(gguf.quants.dequantize(raw, kind), T.Q8_0), T.Q8_0)


def test_kept_blocks_reach_the_artifact_as_the_file_stores_them(files, tmp_path, capsys):
    """An auto build of a file in K-quant and 5-bit blocks keeps every matrix in the file's own blocks (the
    kernels' layouts hold exactly the file's values, at its bytes), computes the file's model with fp32
    activations, writes no float copy of the model, and with int8 activations stays within their rounding (its
    prefill GEMM computing, row by row, what its decode GEMV computes)."""
    from passes.import_gguf import cache_root
    from passes.kernels import kquant

    path, weights = files("kept", KEPT, edit=_layer_1_v_in_q8_0)
    out = tmp_path / "kept.pic"
    assert main(["build", str(path), "--target", "cpu", "--dense", "-o", str(out), "--max-context", "32",
                 "--no-int8-activations"]) == 0
    assert "re-rounded" not in capsys.readouterr().err
    assert not list(cache_root().glob(f"{path.stem}-*/model.onnx*"))  # the build wrote no float copy
    stored = read_safetensors(out / "weights" / "cpu.safetensors")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    kept = {"attn.w_o": (["attn_output"], "q4_k"), "ffn.w_up": (["ffn_gate", "ffn_up"], "q5_k"),
            "ffn.w_down": (["ffn_down"], "q6_k"), "attn.w_qkv.run0": (["attn_q", "attn_k"], "q5_0"),
            "attn.w_qkv.run1": (["attn_v"], "q6_k")}
    for layer in range(KEPT.layers):
        for name, (source, fmt_name) in kept.items():
            if layer == 1 and name.startswith("attn.w_qkv"):
                continue
            name, fmt = f"layers.{layer}.{name}", WEIGHT_FORMATS[fmt_name]
            expected = np.concatenate([weights[f"blk.{layer}.{s}.weight"][_rows(s)] for s in source]).T
            blocks = kquant.unpack_panels(stored[name], stored[name + ".scales"], fmt, *expected.shape)
            assert np.array_equal(blocks.dequantize(), expected), name  # the file's values bit for bit
            packed = stored[name].nbytes + stored[name + ".scales"].nbytes
            assert packed == pytest.approx(expected.size * fmt.bytes_per_weight, rel=0.01), name
            file_bytes = sum(int(tensors[f"blk.{layer}.{s}.weight"].n_bytes) for s in source)
            assert packed <= 1.05 * file_bytes, name  # a token reads the file's bytes, not more
    assert stored["layers.1.attn.w_qkv.q"].dtype == np.int8  # Q5_0 and Q8_0 joined in int8, which holds both
    table = kquant.unpack_rows(stored["embed.tokens"], stored["embed.tokens.scales"], WEIGHT_FORMATS["q5_0"])
    assert np.array_equal(table.dequantize(), weights["token_embd.weight"])  # the table's rows, the file's blocks
    for ours, reference in zip(_logits(Engine(out)), _logits(OrtDecoder(reference_onnx(path)))):
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    int8 = tmp_path / "kept-x8.pic"
    assert main(["build", str(path), "--target", "cpu", "--dense", "-o", str(int8), "--max-context", "32"]) == 0
    steps = [3, 14, 15, 92]  # the same tokens for both (greedy choices could part at a near tie)
    engine = Engine(int8)
    for ours, reference in zip(_logits(engine, fed=steps), _logits(OrtDecoder(reference_onnx(path)), fed=steps)):
        assert np.abs(ours - reference).max() < 0.1 * np.abs(reference).max()  # int8 activations' rounding
    prompt = _logits(engine, steps=0)[0]
    # a batch phase only where the kq blocks' GEMM takes int8 activations: with fp32 ones it dequantizes every
    # weight, and a batch step costs more than a decode step per sequence
    assert Engine(out).max_batch == 0
    assert engine.max_batch > 1
    engine.reset()  # the kq prefill GEMMs quantize x as the decode GEMVs do, row by row; the int8 matrix (layer 1's
    # q, k, v) in both phases or neither on AVX-512, but on AVX2 in its prompt GEMM only (its GEMV takes fp32 x)
    exact = host_cpu_isa().gemm_panels > 1
    tolerance = (1e-4 if exact else 2e-2) * np.abs(prompt).max()
    expected = np.concatenate([np.asarray(engine.forward([token])).reshape(1, -1) for token in PROMPT])
    np.testing.assert_allclose(prompt, expected, atol=tolerance, rtol=0)
    # batch steps of 2 and 3 rows (one row tile, its codes built from the stored bytes) as each slot's decode step
    batched, alone = Engine(int8, slots=3), Engine(int8, slots=3)
    for e in (batched, alone):
        for slot in range(3):
            e.forward(PROMPT[slot:], slot=slot)
    for slots, ids in (([0, 1, 2], [5, 6, 7]), ([2, 0], [8, 9])):
        got = batched.forward_batch(ids, slots)
        for row, (slot, token) in enumerate(zip(slots, ids)):
            want = alone.forward([token], slot=slot)[0]
            np.testing.assert_allclose(got[row], want, atol=tolerance, rtol=0)


def test_a_thresholded_build_gathers_the_files_own_blocks(files, tmp_path):
    """--sparsity 0.5 on the kept-blocks file: the FFN matrices a threshold thins stay in the file's blocks (its
    own q5_k and q6_k, in kquant's columns layout: nothing re-rounded, no second copy for prompts), and decode
    steps compute the file's model with the FFN inputs below the thresholds zeroed (the prompt dense)."""
    path, weights = files("kept", KEPT, edit=_layer_1_v_in_q8_0)
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(2).integers(0, KEPT.vocab, (16, 48)))
    out = tmp_path / "kept-half.pic"
    assert main(["build", str(path), "--target", "cpu", "--calib", str(calib), "--max-context", "64",
                 "--sparsity", "0.5", "--no-int8-activations", "-o", str(out)]) == 0  # (fp32 inputs: the reference's)
    manifest = load_manifest(out)
    for layer in range(KEPT.layers):
        for matrix, fmt in (("w_up", "q5_k"), ("w_down", "q6_k")):
            buffer = manifest.buffers[f"layers.{layer}.ffn.{matrix}"]
            assert (buffer.layout, buffer.format) == ("kq_columns", fmt), (layer, matrix)
    thresholds = {layer.layer: (layer.threshold_in, layer.threshold_down) for layer in manifest.layers}
    assert all(t_in > 0 and t_down > 0 for t_in, t_down in thresholds.values())
    engine = Engine(out)
    got = _logits(engine, steps=4)
    tokens = list(PROMPT) + [int(np.argmax(rows[-1])) for rows in got[:-1]]
    expected = gf.forward(weights, KEPT, tokens, thinned=(len(PROMPT), thresholds))
    dense = gf.forward(weights, KEPT, tokens)
    steps = np.concatenate([rows.reshape(-1, KEPT.vocab) for rows in got])
    np.testing.assert_allclose(steps, expected, atol=1e-4 * np.abs(expected).max(), rtol=0)
    assert np.abs(dense[len(PROMPT):] - expected[len(PROMPT):]).max() > 1e-2 * np.abs(expected).max()  # (it thins)


def test_a_default_build_prices_a_files_matrices_in_the_blocks_they_are_stored_in(files, tmp_path):
    """The quality plan of an auto build of the kept-blocks file prices each matrix it leaves dense in the file's
    own blocks (q4_k's 4.5 bits a weight, q6_k's 6.56), not in the build's one format: a sparse plan is weighed
    against what the dense build really reads, and one that rounds a matrix's rows to int8 to gather them is
    priced in int8."""
    from passes import costmodel

    path, weights = files("kept", KEPT, edit=_layer_1_v_in_q8_0)
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(2).integers(0, KEPT.vocab, (16, 48)))
    out = tmp_path / "kept-default.pic"
    assert main(["build", str(path), "--target", "cpu", "--calib", str(calib), "--max-context", "64",
                 "-o", str(out)]) == 0
    choices = load_manifest(out).quality.choices
    bandwidth = get_target("cpu").cpu_bandwidth_gbs * 1e9
    files_format = {"o": ("attn_output", "q4_k"), "in": ("ffn_gate", "q5_k"), "down": ("ffn_down", "q6_k")}
    priced = 0
    for choice in choices:
        if choice.site not in files_format or choice.dropped:
            continue
        name, fmt = files_format[choice.site]
        size = weights[f"blk.{choice.layer}.{name}.weight"].size * (2 if choice.site == "in" else 1)
        assert choice.format == fmt, choice
        expected = costmodel.linear_seconds(size * WEIGHT_FORMATS[fmt].bytes_per_weight, bandwidth) * 1e6
        assert choice.us == pytest.approx(expected, rel=1e-3), choice
        priced += 1
    assert priced >= KEPT.layers * 2
    for choice in choices:  # a thinned input gathers its matrix's rows in the file's own blocks, priced so
        if choice.dropped and choice.site in files_format:
            assert choice.format == files_format[choice.site][1], choice
