"""Shared fixtures: tiny models made on the fly (cached under a per-session temp cache)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ is importable by tests


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """Tests never touch the user's cache: models go to a per-run directory unless PICOMPILE_CACHE is set.
    The optimum environment is the exception: scripts/optimum_env.py made it under the user's cache before
    the run, so its place is fixed before the cache moves."""
    from examples.models import optimum_venv

    os.environ.setdefault("PICOMPILE_OPTIMUM_VENV", str(optimum_venv()))
    if "PICOMPILE_CACHE" not in os.environ:
        os.environ["PICOMPILE_CACHE"] = str(tmp_path_factory.mktemp("picompile-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_models():
    """(family, exporter) -> ModelFiles for the tiny presets."""
    from examples.models import cached_model

    made = {}

    def get(family: str, exporter: str = "dynamo", **kwargs):
        key = (family, exporter, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = cached_model(family, preset="tiny", exporter=exporter, **kwargs)
        return made[key]

    return get
