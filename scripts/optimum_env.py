"""Make the optimum environment the tests' optimum rows export with (once; later runs find it and return).

    python scripts/optimum_env.py

optimum-onnx needs transformers < 4.58 and picompile uses 5.x, so optimum runs in a virtual environment of its
own that sees this Python's packages and adds only optimum-onnx, optimum and transformers 4.57 (with the older
huggingface-hub and tokenizers they need, and requests where this Python lacks it); torch, numpy, onnx and
onnxruntime stay this environment's, pinned to its versions, so nothing heavy is installed. It lives at
``$PICOMPILE_OPTIMUM_VENV`` or under the cache (``$PICOMPILE_CACHE`` or ``~/.cache/picompile``), one per
project environment. Needs PyPI (or a mirror) the first time. The README's test command runs this before pytest;
see examples/models.py ``make_optimum_venv``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import models  # noqa: E402


def main() -> int:
    try:
        python = models.make_optimum_venv(log=print)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"optimum environment ready: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
