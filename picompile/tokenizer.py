"""Finding the model's tokenizer for a build: `--tokenizer DIR`, else the files beside the ONNX file (where
optimum's export and `save_pretrained` put them), or those the GGUF front end made from a GGUF file's metadata. The artifact writer copies them into `tokenizer/`; the
profile pass reads text calibration with them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from runtime.text import OPTIONAL_FILES, TOKENIZER_FILE, TextTokenizer

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


def find_tokenizer(model: Path, directory: Path | None = None) -> TokenizerFiles | None:
    """The tokenizer of `directory` (`--tokenizer`; an error without a readable tokenizer.json), else the one
    beside `model` if there is one or, for a GGUF file, the one its metadata describes (else None). Either is
    read once here, so that a broken one is refused before the build."""
    if directory is not None:
        directory = Path(directory)
        if not directory.is_dir():
            raise UserError(f"--tokenizer {directory}: not a directory (it should hold the model's {TOKENIZER_FILE})")
        if not (directory / TOKENIZER_FILE).is_file():
            raise UserError(f"--tokenizer {directory} holds no {TOKENIZER_FILE} (the file save_pretrained and "
                            "optimum write beside the model)")
    else:
        from passes.import_gguf import converted, is_gguf  # here: the passes import this module's TokenizerFiles

        if is_gguf(model):  # the tokenizer its metadata describes, written beside the file's conversion
            directory = converted(model).tokenizer
            if directory is None:
                return None
        else:
            directory = Path(model).parent
            if not (directory / TOKENIZER_FILE).is_file():
                return None
    found = TokenizerFiles(directory, (TOKENIZER_FILE, *(name for name in OPTIONAL_FILES
                                                         if (directory / name).is_file())))
    try:
        found.tokenizer
    except ValueError as error:
        raise UserError(f"the model's tokenizer cannot be read: {error}") from None
    return found


def check_vocabulary(files: TokenizerFiles, vocab_size: int) -> None:
    """A tokenizer whose ids reach past the model's embedding table (`vocab_size` rows) is another model's."""
    tokens = files.tokenizer.vocab_size
    if tokens > vocab_size:
        raise UserError(f"the tokenizer in {files.directory} has {tokens} tokens but the model's "
                        f"vocabulary is {vocab_size}: it is another model's tokenizer (choose the model's with --tokenizer)")
