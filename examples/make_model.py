"""Make a random-weight ReLU decoder LLM (optionally with *synthetic* sparsity) as ONNX + token files.

    python examples/make_model.py {opt,llama,llama_tied,gpt2,neox,falcon} --preset tiny --sparsity 0.9 --skew zipf \
        --exporter {dynamo,legacy,ort_basic,ort_extended,optimum} -o DIR [--seed 0] [--set hidden_size=128 --set predictability=0.9]

Prints the paths it wrote, one per line. Without -o the model goes to the cache
(``$PICOMPILE_CACHE`` or ``~/.cache/picompile``) and is reused when it is already there.
``--sparsity none`` leaves the model dense-random. See examples/models.py for what is built.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import models  # noqa: E402


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _sparsity(text: str):
    return None if text.lower() in ("none", "dense", "") else float(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=models.FAMILIES)
    parser.add_argument("--preset", default="tiny", choices=sorted(models.PRESETS["opt"]))
    parser.add_argument("--sparsity", type=_sparsity, default=None,
                        help="synthetic FFN sparsity, e.g. 0.9; 'none' (default) keeps the model dense-random")
    parser.add_argument("--skew", default="zipf", help="'zipf', 'zipf:<alpha>', 'uniform' or a float alpha")
    parser.add_argument("--exporter", default="dynamo", choices=models.EXPORTERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field or a synthesis/token knob (repeatable)")
    parser.add_argument("-o", "--out", type=Path, default=None, help="output directory (default: the cache)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = _value(value.strip())
    skew = args.skew
    try:
        skew = float(skew)
    except ValueError:
        pass
    log = (lambda message: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    common = dict(preset=args.preset, sparsity=args.sparsity, skew=skew, exporter=args.exporter, seed=args.seed,
                  log=log, **overrides)
    if args.out is None:
        files = models.cached_model(args.family, **common)
    else:
        files = models.make_model(args.family, args.out, **common)
    if not args.quiet:
        if files.sparsity is not None:
            kind = "synthetic" if args.sparsity is not None else "dense-random"
            print(f"{kind} FFN sparsity measured on heldout: mean {files.sparsity:.4f}, per layer "
                  f"{[round(s, 4) for s in files.layer_sparsity]}, top-20% share "
                  f"{[round(s, 3) for s in files.top20_share]}", file=sys.stderr)
    for path in files.paths():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
