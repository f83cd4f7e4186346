"""The manifest is typed data with one home (runtime/manifest.py): what the writer writes, `Manifest.from_json`
reads back into the same bytes, and no other module of the project reads the manifest's JSON by its keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime import load_manifest
from runtime.manifest import Devices, LayerReport, Manifest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("picompile", "passes", "runtime", "examples", "benchmarks", "scripts")
HOME = ROOT / "runtime" / "manifest.py"
# a literal-key read of a manifest: manifest["model"], engine.manifest.get("quality"), or the parsed file's
# json.loads((artifact / "manifest.json").read_text())["model"]
LITERAL_READ = re.compile(r"""manifest(\.get\(|\[)["']|manifest\.json["']\)\.read_text\(\)\)(\[|\.get\()""")


def test_a_built_manifest_round_trips_to_the_same_bytes(tiny_sparse_artifact):
    """A sparse build's manifest carries every kind of section (sparsity, layers, calibration, quantization,
    quality, placement, devices, estimate): its typed form writes exactly the file's bytes."""
    text = (tiny_sparse_artifact / "manifest.json").read_text()
    manifest = load_manifest(tiny_sparse_artifact)
    assert json.dumps(manifest.to_json(), indent=1) == text
    assert json.dumps(Manifest.from_json(json.loads(text)).to_json(), indent=1) == text
    assert manifest.sparsity.mode == "predictor" and manifest.quality is not None and manifest.layers
    # build wall times are not facts of the artifact: two builds of the same model give the same bytes
    data = json.loads(text)
    assert "sample_seconds" not in data["calibration"] and "seconds" not in data["quality"]
    assert "solve_time_s" not in data["placement"]


def test_sections_keep_their_keys_and_order():
    """The per-layer report of each mode and the place pass's rules keep the keys they had, in their order, and
    no key the pass did not write."""
    threshold = {"layer": 0, "mode": "threshold", "threshold_in": 1.5, "sparsity_in": 0.9, "threshold_down": -1.0,
                 "sparsity_down": 0.0, "threshold_qkv": -1.0, "sparsity_qkv": 0.0, "threshold_o": -1.0,
                 "sparsity_o": 0.0, "ffn": "dense"}
    predicted = {"layer": 1, "gpu_neurons": 0, "cpu_neurons": 256, "gpu_activation_share": 0.0, "sparsity": 0.5,
                 "predictor_rank": 32, "predictor_active": 0.7, "ffn": "dense", "dense_reason": "placed dense"}
    offload = {"budget_bytes": 10, "gpu_layers": [0], "model_bytes": 20, "rule": "1 whole layers fit"}
    for data, kind in ((threshold, LayerReport), (predicted, LayerReport), (offload, Devices),
                       ({"rule": "no GPU on the target"}, Devices)):
        assert json.dumps(kind.from_json(data).to_json()) == json.dumps(data)


def test_no_module_reads_the_manifest_by_literal_keys():
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == HOME:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if LITERAL_READ.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "read the typed manifest (runtime.manifest) instead:\n" + "\n".join(found)
