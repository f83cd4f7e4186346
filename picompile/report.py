"""`picompile inspect --report`: what the compiler decided, as one self-contained HTML page or one PNG.

Reads only the artifact (its manifest, checked by the runtime's loader, and the profile pass's
`plots/activation_cdf.png`); draws with matplotlib. The HTML embeds its images as base64 PNGs, so the
file can be mailed or attached to an issue on its own.
"""

from __future__ import annotations

import base64
import html
import io
import os
import tempfile
from pathlib import Path

import numpy as np

from passes.errors import UserError
from runtime.manifest import LayerReport, Manifest

from .artifact import current_umask

# (heading, manifest key, format) of the per-layer table; the same columns `picompile inspect` prints
LAYER_COLUMNS = [
    ("layer", "layer", "{}"), ("sparsity", "sparsity", "{:.3f}"), ("hot 80%", "hot80_share", "{:.1%}"),
    ("GPU neurons", "gpu_neurons", "{}"), ("CPU neurons", "cpu_neurons", "{}"),
    ("GPU activation share", "gpu_activation_share", "{:.1%}"), ("predictor rank", "predictor_rank", "{}"),
    ("recall", "predictor_recall", "{:.4f}"), ("precision", "predictor_precision", "{:.4f}"),
    ("true active", "true_active", "{:.3f}"), ("predicted active", "predictor_active", "{:.3f}"),
    ("predicted/true active", "active_ratio", "{:.2f}x"),
]
# ... and of a threshold-mode build (no placement, no predictors)
THRESHOLD_COLUMNS = [
    ("layer", "layer", "{}"), ("qkv threshold", "threshold_qkv", "{:.4g}"), ("qkv inputs dropped", "sparsity_qkv", "{:.3f}"),
    ("o threshold", "threshold_o", "{:.4g}"), ("o inputs dropped", "sparsity_o", "{:.3f}"),
    ("gate/up threshold", "threshold_in", "{:.4g}"),
    ("gate/up inputs dropped", "sparsity_in", "{:.3f}"), ("down threshold", "threshold_down", "{:.4g}"),
    ("down inputs dropped", "sparsity_down", "{:.3f}"),
]


def with_shares(report: LayerReport) -> dict:
    """A layer's report as the manifest spells it, plus (predictor builds) `true_active`, the share of neurons that
    fired on the profiled tokens (1 - sparsity), and `active_ratio`, the predicted-active share over it (what the
    predictor makes decode compute beyond the truly active neurons): inspect and the report show both."""
    layer = report.to_json()
    if report.sparsity is None or report.threshold_in is not None:
        return layer
    true = 1.0 - float(report.sparsity)
    predicted = report.predictor_active
    return {**layer, "true_active": true,
            "active_ratio": None if predicted is None or true <= 0 else float(predicted) / true}


def _predictor_layers(layers: list[dict]) -> bool:
    return bool(layers) and "threshold_in" not in layers[0]


def _cell(layer: dict, key: str, fmt: str) -> str:
    value = layer.get(key)
    return "-" if value is None else fmt.format(value)


def _figure_png(figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_split(axes, layers: list[dict]) -> None:
    index = np.array([layer["layer"] for layer in layers])
    gpu = np.array([layer.get("gpu_neurons", 0) for layer in layers])
    cpu = np.array([layer.get("cpu_neurons", 0) for layer in layers])
    axes.bar(index, gpu, color="tab:green", label="GPU (hot)")
    axes.bar(index, cpu, bottom=gpu, color="tab:blue", label="CPU (cold)")
    axes.set_xticks(index)
    axes.set_xlabel("layer")
    axes.set_ylabel("FFN neurons")
    axes.set_title("neurons per layer: GPU / CPU split")
    axes.legend(fontsize=7)


def _plot_recall(axes, layers: list[dict]) -> None:
    index = np.array([layer["layer"] for layer in layers])
    for key, label, offset in (("predictor_recall", "recall", -0.2), ("predictor_precision", "precision", 0.0),
                               ("predictor_active", "predicted active", 0.2)):
        axes.bar(index + offset, [layer.get(key) or 0.0 for layer in layers], width=0.2, label=label)
    axes.set_ylim(0, 1.05)
    axes.set_xticks(index)
    axes.set_xlabel("layer")
    axes.set_title("predictors on held-out tokens")
    axes.legend(fontsize=7, loc="lower right")


def charts(directory: Path, manifest: Manifest) -> dict[str, bytes]:
    """title -> PNG bytes: the activation CDF (from the artifact), the GPU/CPU split and predictor recall."""
    plt = _pyplot()
    images = {}
    cdf = Path(directory) / "plots" / "activation_cdf.png"
    if "plots/activation_cdf.png" in manifest.files:  # listed, so load_manifest checked its hash
        images["FFN activation CDF per layer"] = cdf.read_bytes()
    layers = [layer.to_json() for layer in manifest.layers]
    if _predictor_layers(layers):  # threshold builds have no split or predictors to draw
        figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
        _plot_split(axes, layers)
        images["GPU / CPU neuron split per layer"] = _figure_png(figure)
        figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
        _plot_recall(axes, layers)
        images["predictor recall per layer"] = _figure_png(figure)
    return images


def html_report(directory: Path, manifest: Manifest, summary: list[str]) -> str:
    layers = [with_shares(layer) for layer in manifest.layers]
    columns = LAYER_COLUMNS if _predictor_layers(layers) else THRESHOLD_COLUMNS
    escape = html.escape
    rows = "".join("<tr>" + "".join(f"<td>{escape(_cell(layer, key, fmt))}</td>" for _, key, fmt in columns)
                   + "</tr>\n" for layer in layers)
    table = ("<table>\n<tr>" + "".join(f"<th>{escape(heading)}</th>" for heading, _, _ in columns)
             + f"</tr>\n{rows}</table>") if layers else \
        "<p>Dense build: no per-layer sparsity, placement or predictors.</p>"
    images = "".join(f'<figure><img alt="{escape(title)}" src="data:image/png;base64,'
                     f'{base64.b64encode(png).decode()}"><figcaption>{escape(title)}</figcaption></figure>\n'
                     for title, png in charts(directory, manifest).items())
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}pre{background:#f6f6f6;padding:1em}"
             "figure{display:inline-block;margin:0 1em 1em 0}")
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>picompile: {escape(str(directory))}</title>"
            f"<style>{style}</style></head><body>\n<h1>picompile artifact {escape(str(directory))}</h1>\n"
            f"<pre>{escape(chr(10).join(summary))}</pre>\n<h2>Layers</h2>\n{table}\n<h2>Charts</h2>\n{images}"
            "</body></html>\n")


def png_report(directory: Path, manifest: Manifest) -> bytes:
    """The charts side by side in one PNG."""
    images = charts(directory, manifest)
    if not images:
        raise UserError(f"{directory} is a dense build: it has no per-layer data to draw (use --report x.html)")
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(images), figsize=(6 * len(images), 4.2), dpi=100, squeeze=False)
    for ax, (title, png) in zip(axes[0], images.items()):
        ax.imshow(plt.imread(io.BytesIO(png), format="png"))
        ax.set_axis_off()
    return _figure_png(figure)


def write_report(directory: Path, manifest: Manifest, path: Path, summary: list[str]) -> Path:
    """Write the report for `path`'s suffix (.html or .png) under a temporary name, then rename it."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise UserError(f"--report {path}: the report is .html or .png")
    if not path.parent.is_dir():
        raise UserError(f"--report {path}: directory {path.parent} does not exist")
    data = png_report(directory, manifest) if suffix == ".png" else html_report(directory, manifest, summary).encode()
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(data)
        os.chmod(temporary, 0o666 & ~current_umask())  # mkstemp makes it private; a report is an ordinary file
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
