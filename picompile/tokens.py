"""Token files: `.npy` integer arrays ([n, len] or 1-D), or text with whitespace- or comma-separated
ids, one sequence per line."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .errors import UserError


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
