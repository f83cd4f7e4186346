"""A GGUF file's tokenizer (passes/gguf_tokenizer.py) against llama.cpp's own: the vocabulary-only GGUF files
llama.cpp's source ships (models/ggml-vocab-*.gguf), each with the texts of its tokenizer test and the ids
llama.cpp gives them (`.inp` / `.out`, tokenized without special tokens). Where llama.cpp's source is not in the
cache (scripts/build_llama_cpp.sh puts it there) there is nothing to compare with."""

import tempfile
from pathlib import Path

import pytest

from benchmarks.llama_cpp import default_root

# the vocabularies of the families picompile compiles (and the pre-tokenizers they share)
VOCABULARIES = ("llama-bpe", "llama-spm", "phi-3", "qwen2", "qwen35", "gpt-2", "starcoder", "refact", "mpt",
                "command-r")


def _vocabulary(name: str) -> Path:
    found = sorted(default_root().glob(f"src-*/models/ggml-vocab-{name}.gguf"))
    if not found:
        pytest.skip(f"llama.cpp's source (its ggml-vocab-{name}.gguf) is not under {default_root()}: "
                    "scripts/build_llama_cpp.sh puts it there")
    return found[-1]


@pytest.mark.parametrize("name", VOCABULARIES)
def test_the_files_tokenizer_gives_llama_cpps_ids(name):
    from tokenizers import Tokenizer

    from passes import import_gguf
    from passes.gguf_tokenizer import write_tokenizer

    path = _vocabulary(name)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{path}.out").read_text().split("\n")
    with tempfile.TemporaryDirectory() as directory:
        notes = write_tokenizer(import_gguf.read(path), path, Path(directory), vocab_size=1 << 24)
        assert not notes, notes  # a known pre-tokenizer
        tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    assert len(texts) >= 40
    wrong = [(text, ids) for text, ids in zip(texts, expected)
             if tokenizer.encode(text, add_special_tokens=False).ids != [int(i) for i in ids.split()]]
    assert not wrong, wrong[:3]
