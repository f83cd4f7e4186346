"""Tokenizer files for tests, written with the `tokenizers` library: a byte-level one (ids 0..255 are the
UTF-8 bytes, so any text round-trips exactly and a character can split across tokens), with BOS/EOS and
padding after the bytes, as save_pretrained lays them out."""

from __future__ import annotations

import json
from pathlib import Path

BOS, PAD = 256, 257  # BOS doubles as EOS
VOCAB = 258
# a small chat template in the usual style: turns marked by role, the special tokens as text
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer():
    """The byte-level `tokenizers.Tokenizer`: BPE without merges over the ByteLevel alphabet, byte b = id b."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    # GPT-2's byte -> character map (what the ByteLevel pre-tokenizer and decoder use)
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("<pad>", special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return tokenizer


def write_byte_tokenizer(directory: Path, chat_template: str | None = None, generation_eos: bool = True) -> Path:
    """tokenizer.json, tokenizer_config.json (with `chat_template` where given) and generation_config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<s>", "pad_token": "<pad>", "model_max_length": 64,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos:
        (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": BOS}))
    return directory
