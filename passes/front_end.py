"""The front ends' door: a model file in, the ONNX front end's IR out (a GGUF file through its conversion to
ONNX, `passes.import_gguf`), and the tokenizer that goes with it: `--tokenizer DIR`, else the files beside the
ONNX file (where optimum's export and `save_pretrained` put them), or those the GGUF front end made from the
file's metadata."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from runtime.text import OPTIONAL_FILES, TOKENIZER_FILE

from . import import_gguf
from .errors import UserError
from .import_onnx import load_onnx
from .tokenizer import TokenizerFiles


def load(path: Path, for_build: bool = True) -> ir.Model:
    """The model at `path` (ONNX, or a GGUF file converted to ONNX), its weights checked readable; a build
    (`for_build`) first checks that the machine has the memory to compile it."""
    path = Path(path)
    if path.is_file() and import_gguf.is_gguf(path):
        return import_gguf.load(path, for_build=for_build)
    return load_onnx(path, for_build=for_build)


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
    elif import_gguf.is_gguf(model):  # the tokenizer its metadata describes, written beside the file's conversion
        directory = import_gguf.converted(model).tokenizer
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
