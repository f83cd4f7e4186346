"""A byte-level tokenizer as the `tokenizers` library saves it: ids 0..255 are the UTF-8 bytes (so any text
round-trips and a character can split across tokens), then BOS (also EOS) and PAD, laid out as
save_pretrained writes a model's tokenizer files. examples/text_model.py's vocabulary, and the tests'."""

from __future__ import annotations

import json
import os
from pathlib import Path

BOS, PAD = 256, 257  # BOS doubles as EOS
VOCAB = 258


def byte_tokenizer(bos: str = "<s>", pad: str = "<pad>"):
    """The `tokenizers.Tokenizer`: BPE without merges over the ByteLevel alphabet, byte b = id b; `bos` and
    `pad` are the special tokens' text (the library matches them in input text too, as every HF tokenizer
    does with its special tokens: choose text the model's corpus does not hold)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    # GPT-2's byte -> character map (what the ByteLevel pre-tokenizer and decoder use)
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(bos, special=True), AddedToken(pad, special=True)])  # ids 256, 257
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS)])
    return tokenizer


def write_byte_tokenizer(directory: Path, chat_template: str | None = None, generation_eos: bool = True,
                         bos: str = "<s>", pad: str = "<pad>", model_max_length: int = 64) -> Path:
    """This vocabulary's tokenizer files in ``directory`` (`write_tokenizer_files`)."""
    return write_tokenizer_files(directory, byte_tokenizer(bos, pad), bos=bos, pad=pad, bos_id=BOS, pad_id=PAD,
                                 chat_template=chat_template, generation_eos=generation_eos,
                                 model_max_length=model_max_length)


def write_tokenizer_files(directory: Path, tokenizer, *, bos: str, pad: str, bos_id: int, pad_id: int,
                          chat_template: str | None = None, generation_eos: bool = True,
                          model_max_length: int = 64) -> Path:
    """tokenizer.json (the `tokenizers.Tokenizer` given), tokenizer_config.json (naming ``bos`` = EOS and
    ``pad``; `chat_template` where given) and generation_config.json (unless not `generation_eos`) in
    `directory`, as save_pretrained lays them out. Each file appears whole (written beside it, then
    renamed), tokenizer.json last: a directory with it has the others too."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"bos_token": bos, "eos_token": bos, "pad_token": pad, "model_max_length": model_max_length,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    texts = {"tokenizer_config.json": json.dumps(config)}
    if generation_eos:
        texts["generation_config.json"] = json.dumps({"bos_token_id": bos_id, "eos_token_id": bos_id,
                                                      "pad_token_id": pad_id})
    texts["tokenizer.json"] = tokenizer.to_str(pretty=True)
    for name, text in texts.items():
        temporary = directory / f".{name}.{os.getpid()}.tmp"
        temporary.write_text(text)
        os.replace(temporary, directory / name)
    return directory
