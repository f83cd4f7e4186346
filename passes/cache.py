"""Where picompile keeps what it makes outside git: converted model files, measured machine rates, and (for the
examples and benchmarks) generated models and artifacts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$PICOMPILE_CACHE`` (default ``~/.cache/picompile``), or a folder in it."""
    return Path(os.environ.get("PICOMPILE_CACHE") or Path.home() / ".cache" / "picompile").joinpath(*parts)
