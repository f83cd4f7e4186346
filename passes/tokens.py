"""Token files: `.npy` integer arrays ([n, len] or 1-D), or text with whitespace- or comma-separated
ids, one sequence per line. Calibration (`read_calibration`) also takes text, tokenized with the model's
tokenizer: a directory of `.txt` / `.md` / `.py` files, or a file that is not ids (a `.npy` file is ids, and
so is a file whose every non-blank line is integers separated by commas or whitespace; any other file is
text)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py")  # the files of a calibration directory that are read
_IDS_LINE = re.compile(r"[\d\s,-]*")  # negative ids too: read_tokens refuses them by name


def parse_ids(text: str, what: str = "token ids") -> list[int]:
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts:
        raise UserError(f"{what} are empty")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise UserError(f"{what} must be integers separated by commas or spaces, got {text!r}") from None
    if min(ids) < 0:
        raise UserError(f"{what} must not be negative")
    return ids


def read_tokens(path: Path) -> list[np.ndarray]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file not found: {path}")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as error:
            if "Object arrays" in str(error):  # what np.save makes of sequences of unequal length
                raise UserError(f"{path} holds an object array (ragged sequences?): save equal-length sequences as a "
                                "2-D integer array, or write a text file with one sequence per line") from None
            raise UserError(f"{path} is not a readable .npy file: {error}") from None
        except Exception as error:
            raise UserError(f"{path} is not a readable .npy file: {error}") from None
        if array.dtype.kind not in "iu":
            raise UserError(f"{path} holds {array.dtype} values; token ids must be integers")
        sequences = [array] if array.ndim == 1 else list(array) if array.ndim == 2 else None
        if sequences is None:
            raise UserError(f"{path} must be a 1-D or 2-D integer array, got shape {array.shape}")
    else:
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            raise UserError(f"{path} is neither .npy nor text") from None
        sequences = [np.array(parse_ids(line, f"{path.name} line {n + 1}")) for n, line in enumerate(lines) if line.strip()]
    sequences = [np.asarray(s, np.int64) for s in sequences if len(s)]
    if not sequences:
        raise UserError(f"{path} holds no token sequences")
    if min(int(s.min()) for s in sequences) < 0:
        raise UserError(f"{path} holds negative token ids")
    return sequences


def _text_files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file() and path.suffix in TEXT_SUFFIXES)


def _first_text_line(path: Path) -> int | None:
    """The number of the first line of a calibration file that is not token ids (see the module's
    docstring); None: the file is ids (or not text at all, which read_tokens reports)."""
    if path.suffix == ".npy":
        return None
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        return None
    return next((number + 1 for number, line in enumerate(lines) if not _IDS_LINE.fullmatch(line)), None)


def calibration_is_text(path: Path) -> bool:
    """Whether --calib `path` is text, which needs the model's tokenizer; a missing path is an error."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"calibration file not found: {path}")
    return path.is_dir() or _first_text_line(path) is not None


def check_calibration(path: Path, has_tokenizer: bool) -> None:
    """Refuse up front, before a build, what `read_calibration` would refuse without reading the text: a
    missing path, text without a tokenizer, a directory without text files."""
    path = Path(path)
    if not calibration_is_text(path):
        return
    if not has_tokenizer:
        what = ("a directory of text" if path.is_dir() else
                f"text, not token ids (line {_first_text_line(path)} is not integers)")
        raise UserError(f"--calib {path} is {what}, and tokenizing text needs the model's tokenizer: put its "
                        "tokenizer.json beside the ONNX file or pass --tokenizer DIR (or give token ids)")
    if path.is_dir() and not any(file.stat().st_size for file in _text_files(path)):
        raise UserError(f"--calib {path} holds no text (no non-empty {'/'.join(TEXT_SUFFIXES)} files)")


def read_calibration(path: Path, tokenizer=None, max_length: int | None = None) -> list[np.ndarray]:
    """--calib's token sequences: `read_tokens` for ids; text (see the module's docstring) tokenized with
    `tokenizer` (a runtime.text.TextTokenizer), each file one sequence (with the tokenizer's BOS) cut into
    pieces of at most `max_length` tokens."""
    path = Path(path)
    check_calibration(path, tokenizer is not None)
    if not calibration_is_text(path):
        return read_tokens(path)
    files = _text_files(path) if path.is_dir() else [path]
    sequences = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"--calib {file} is not UTF-8 text") from None
        if not text.strip():
            continue
        ids = np.asarray(tokenizer.encode(text), np.int64)
        step = max_length or len(ids)
        sequences += [ids[begin: begin + step] for begin in range(0, len(ids), step)]
    if not sequences:
        raise UserError(f"--calib {path} holds no text" +
                        (f" (no non-empty {'/'.join(TEXT_SUFFIXES)} files)" if path.is_dir() else ""))
    return sequences
