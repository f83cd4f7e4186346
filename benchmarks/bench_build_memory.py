"""Build time and peak resident memory per pass (issue 15): builds one model and prints -v's per-pass lines.

    python benchmarks/bench_build_memory.py --preset 7b|13b|1b [--weight-dtype fp16] [--dense]

The model is `examples.models.cached_model("llama", preset, sparsity=0.9)`, made layer by layer in fp16
(examples/streamed_models.py; `streamed=True` for the presets other than 7b / 13b), so 1b and 7b compare like for like;
built for the CPU from its own calibration tokens without sampling. The up-front memory check is switched off,
so the figures say what the build needs, not what the check expects.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import passes.import_onnx as import_onnx  # noqa: E402
from examples import models  # noqa: E402
from examples.streamed_models import STREAMED_PRESETS  # noqa: E402
from picompile.compiler import build  # noqa: E402
from passes.pipeline import Options  # noqa: E402
from passes.targets import get_target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="7b")
    parser.add_argument("--weight-dtype", default="fp16")
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("-o", "--output", type=Path, default=None)
    args = parser.parse_args()
    streamed = {} if args.preset in STREAMED_PRESETS else {"streamed": True}  # (7b / 13b always are)
    files = models.cached_model("llama", args.preset, sparsity=0.9, log=print, **streamed)
    output = args.output or models.cache_dir() / "bench" / f"build-memory-{args.preset}-{args.weight_dtype}.pic"
    import_onnx.WORKING_FACTOR = 0.0  # measure, do not refuse
    started = time.time()
    log = lambda message: print(f"[{time.time() - started:7.1f}s] {message}", flush=True)  # noqa: E731
    options = Options(weight_dtype=args.weight_dtype, calib=files.calib, calib_samples=0, max_context=256,
                      dense=args.dense)
    build(files.onnx, output, get_target("cpu"), options, log=log, warn=lambda message: log("warning: " + message))
    log(f"wrote {output}")


if __name__ == "__main__":
    main()
