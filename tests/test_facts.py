"""Facts between passes have one home and a type: each `model.metadata_props` entry is written and read only in
the module of the pass that adds it (by its `ModelFact`'s attach / of, or facts.py's read_entry / write_entry),
and every fact survives its JSON."""

import json
import re
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from passes.awq import AwqLayer, AwqReport
from passes.facts import MemoryFact, ModelFact
from passes.import_gguf import GGUFSource, GGUFTensor
from passes.import_onnx import QuantizedWeight, SourceQuantization
from passes.kernel_ir import Buffers, KernelSpec, Kernels
from passes.profile import CalibrationSequences, ProfiledActivations
from passes.quality import WeightPlan
from passes.schedule import CallSchedule
from passes.select_kernels import BatchPhase

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("picompile", "passes", "runtime")

# Each metadata entry's home: the module of the pass that writes it, the one module that reads its JSON.
HOMES = {
    "picompile.awq": "passes/awq.py",
    "picompile.gguf": "passes/import_gguf.py",
    "picompile.source_quantization": "passes/import_onnx.py",
    "picompile.buffers": "passes/kernel_ir.py",
    "picompile.kernels": "passes/kernel_ir.py",
    "picompile.max_batch": "passes/select_kernels.py",
    "picompile.schedule": "passes/schedule.py",
    "picompile.weight_plan": "passes/quality.py",
    "picompile.quality": "passes/quality.py",
    "picompile.sparsity": "passes/sparsity_mode.py",
    "picompile.calibration": "passes/profile.py",
    "picompile.layers": "passes/lower.py",
    "picompile.quantized": "passes/quantize.py",
    "picompile.kept_blocks": "passes/quantize.py",
    "picompile.placement": "passes/partition.py",
    "picompile.devices": "passes/place.py",
}
PENDING: set[tuple[str, str]] = set()  # reads by key outside the home that are allowed: none
GENERIC = "passes/facts.py"  # ModelFact's attach / of: the key is the fact's own

FACTS = [AwqReport, GGUFSource, SourceQuantization, Buffers, Kernels, BatchPhase, CallSchedule, WeightPlan]

DEFINITION = re.compile(r'^\s*(\w+)(?:\s*:\s*ClassVar\[str\])?\s*=\s*"(picompile\.\w+)"', re.M)
LITERAL = re.compile(r'"(picompile\.\w+)"')


def _sources() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for folder in FOLDERS
            for path in sorted((ROOT / folder).rglob("*.py"))}


def test_metadata_entries_are_read_and_written_only_in_their_home():
    sources = _sources()
    defined = {name: {m[1]: m[2] for m in DEFINITION.finditer(text)} for name, text in sources.items()}
    everywhere: dict[str, set[str]] = {}
    for constants in defined.values():
        for constant, key in constants.items():
            everywhere.setdefault(constant, set()).add(key)
    wrong = []
    for name, text in sources.items():
        for number, line in enumerate(text.splitlines(), 1):
            touches = "metadata_props" in line or re.search(r"\b(read|write)_entry\(", line)  # facts.py's accessors
            if not touches or re.search(r"\bnode\.metadata_props", line):
                continue  # (a node's own metadata, the device place gives it, is no model fact)
            keys = set(LITERAL.findall(line))
            for word in set(re.findall(r"\b[A-Z_][A-Z0-9_]*\b", line)):
                if word in defined[name]:
                    keys.add(defined[name][word])
                elif len(everywhere.get(word, ())) == 1:
                    keys |= everywhere[word]
            if not keys and "json.loads(" in line and name != GENERIC:
                wrong.append(f"{name}:{number}: json.loads of metadata_props with no fact's key: {line.strip()}")
            for key in keys:
                if key not in HOMES:
                    wrong.append(f"{name}:{number}: {key} has no home in tests/test_facts.py HOMES")
                elif name != HOMES[key] and (key, name) not in PENDING:
                    wrong.append(f"{name}:{number}: {key} outside its home {HOMES[key]}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_each_fact_lives_beside_the_pass_that_writes_it():
    for fact in FACTS:
        module = fact.__module__.replace(".", "/") + ".py"
        assert HOMES[fact.KEY] == module, fact


SAMPLES = [
    AwqReport((AwqLayer(0, 0.5, 0.012, 0.008), AwqLayer(1, 0.0, 0.01, 0.01)), (2,), 0.9),
    GGUFSource("m.gguf", "llama", (GGUFTensor("token_embd.weight", "Q8_0", (128, 64), True),
                                   GGUFTensor("blk.0.attn_norm.weight", "F32", (64,), False)), ("no tokenizer",)),
    SourceQuantization((QuantizedWeight("mm", "mm.weight", ("B", "scales"), 4, 32, True, "float16", 64, 32),), ),
    Buffers({"logits": {"kind": "activation", "shape": [8, 128], "dtype": "float32"}}),
    Kernels({"gemv": KernelSpec("linear", 1, (64, 32), {"bias": True})}),
    BatchPhase(8),
    CallSchedule({"directed": True, "multigraph": False, "graph": {}, "nodes": [{"id": "a", "order": 0}], "edges": []}),
    WeightPlan({"layers.0.ffn.w_up": "int8"}),
]


@pytest.mark.parametrize("fact", SAMPLES, ids=lambda f: type(f).__name__)
def test_facts_survive_their_json_and_the_model(fact):
    assert type(fact).from_json(json.loads(json.dumps(fact.to_json()))) == fact
    model = ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)
    assert type(fact).of(model) == type(fact).missing()
    fact.attach(model)
    assert set(model.metadata_props) == {fact.KEY}
    assert type(fact).of(model) == fact


def test_absent_facts_read_as_their_default():
    model = ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)
    assert BatchPhase.of(model).max_batch == 0 and Kernels.of(model).specs == {} and WeightPlan.of(model).formats == {}
    assert AwqReport.of(model) is None and GGUFSource.of(model) is None and Buffers.of(model) is None


def test_written_as_before():
    """The JSON each entry always had (the artifacts stay byte for byte): sorted keys where it sorted them."""
    model = ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)
    BatchPhase(8).attach(model)
    Buffers({"b": {}, "a": {}}).attach(model)
    AwqReport((AwqLayer(3, 0.25, 0.5, 0.25),), (), 0.5).attach(model)
    assert model.metadata_props["picompile.max_batch"] == "8"
    assert model.metadata_props["picompile.buffers"] == '{"a": {}, "b": {}}'
    assert json.loads(model.metadata_props["picompile.awq"]) == {
        "layers": [{"layer": 3, "alpha": 0.25, "unscaled_error": 0.5, "error": 0.25}], "unscaled": [], "error_ratio": 0.5}


def test_memory_facts_ride_on_the_in_memory_ir():
    model = ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)
    for fact in (CalibrationSequences, ProfiledActivations):
        assert issubclass(fact, MemoryFact)
        with pytest.raises(ValueError, match="run the profile pass first"):
            fact.of(model)
    sequences = CalibrationSequences([np.arange(4)])
    sequences.attach(model)
    assert CalibrationSequences.of(model) is sequences and not model.metadata_props
    assert issubclass(AwqReport, ModelFact)
