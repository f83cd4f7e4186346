"""What the quantization method costs in quality: int8 / int4 builds with --quant-method rtn and awq, dense and
sparse, each evaluated against onnxruntime fp32 on held-out tokens (KL per position, top-1, perplexity).

    python benchmarks/bench_quant_method.py [--model synthetic|text] [--preset small] [--predictability 0.6]
        [--dtypes int4] [--max-context 256] [--sequences 8] [--json PATH]

`--model synthetic` is examples/models.py's OPT with 90% synthetic sparsity at `--predictability`; `text` is
the OPT trained on Python's standard library (examples/text_model.py: its activations, outliers included, come
from training, not from the maker's choices). Artifacts are cached like the decode suite's (by model, options
and compiler source). Speed does not depend on the method (the same kernels read the same bytes): see
benchmarks/bench_cpu_decode.py for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("rtn", "awq")


def model_files(args):
    if args.model == "text":
        from examples.text_model import cached_text_model

        return cached_text_model(args.preset, log=print)
    from examples.models import cached_model

    return cached_model("opt", preset=args.preset, sparsity=0.9, predictability=args.predictability, log=print)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["synthetic", "text"], default="synthetic")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--predictability", type=float, default=0.6)
    parser.add_argument("--dtypes", default="int4", help="comma-separated quantized weight dtypes: int8, int4")
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=8, help="held-out sequences evaluated")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(dtypes) <= {"int8", "int4"}:
        parser.error("--dtypes takes int8 and int4")

    from examples.bench_decode import ensure_artifact, quality
    from passes.reference import OrtDecoder
    from runtime import load_manifest

    files = model_files(args)
    reference = OrtDecoder(files.onnx)
    rows = []
    for dtype in dtypes:
        for dense in (True, False):
            for method in METHODS:
                name = f"{'dense' if dense else 'sparse'}-{dtype}-{method}"
                artifact = ensure_artifact(files, name, args.max_context, dense=dense, weight_dtype=dtype,
                                           quant_method=method)
                q = quality(files, artifact, sequences=args.sequences, reference=reference)
                manifest = load_manifest(artifact, check_hashes=False)
                rows.append({"build": "dense" if dense else "sparse", "dtype": dtype, "method": method,
                             "weight_error": manifest.quantization.mean_relative_error, **q})
                print(f"{name}: KL {q['kl_mean']:.3e}, top-1 {q['top1_agreement']:.3f}, "
                      f"ppl {q['ppl_compiled']:.3f} (reference {q['ppl_reference']:.3f})", flush=True)
    print(f"\n{files.dir.name}, {rows[0]['positions']} positions of {args.sequences} held-out sequences")
    print("| build | dtype | method | KL/position | awq / rtn | top-1 | perplexity (onnxruntime fp32) | weight error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        rtn = next(r for r in rows if r["build"] == row["build"] and r["dtype"] == row["dtype"] and r["method"] == "rtn")
        ratio = f"{row['kl_mean'] / rtn['kl_mean']:.3f}" if row["method"] == "awq" else "-"
        print(f"| {row['build']} | {row['dtype']} | {row['method']} | {row['kl_mean']:.3e} | {ratio} | "
              f"{row['top1_agreement']:.3f} | {row['ppl_compiled']:.3f} ({row['ppl_reference']:.3f}) | "
              f"{row['weight_error']:.4f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": files.dir.name, "rows": rows}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
