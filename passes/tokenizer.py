"""The model's tokenizer files a build carries (found by `passes.front_end.find_tokenizer`). The artifact
writer copies them into `tokenizer/`; the profile pass reads text calibration with them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from runtime.text import TextTokenizer

from .errors import UserError


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer found for a build: the directory and the names of its tokenizer files in it."""

    directory: Path
    names: tuple[str, ...]  # tokenizer.json first, then the optional files present

    @cached_property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer itself, as the runtime reads it from the artifact (read once per build: a large
        vocabulary's tokenizer.json takes a while to parse)."""
        return TextTokenizer(self.directory)


def check_vocabulary(files: TokenizerFiles, vocab_size: int) -> None:
    """A tokenizer whose ids reach past the model's embedding table (`vocab_size` rows) is another model's."""
    tokens = files.tokenizer.vocab_size
    if tokens > vocab_size:
        raise UserError(f"the tokenizer in {files.directory} has {tokens} tokens but the model's "
                        f"vocabulary is {vocab_size}: it is another model's tokenizer (choose the model's with --tokenizer)")
