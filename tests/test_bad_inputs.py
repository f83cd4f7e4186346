"""The bad-input corpus (tests/bad_inputs.py) through the CLI: exit 2, one `error:` line naming the problem (on
file descriptor 2: capfd also sees what onnxruntime or TVM would print from C++),
no traceback, nothing left at -o nor beside it, no build temp dirs; and resource limits refused up front.
(Empty files, garbage bytes and a graph without input_ids are in test_cli_errors.py.)"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

import bad_inputs
import passes.front_end
import passes.import_onnx
import passes.recognise
from passes.targets import format_size
from passes.sizes import PREFILL_ROWS
from test_cli_errors import assert_user_error, run_cli


@pytest.fixture(scope="session")
def base_model(tiny_models):
    """The legacy export of tiny OPT: Gemm FFNs with named nodes, the corpus's starting point."""
    return tiny_models("opt", "legacy").onnx


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path/work for inputs and outputs; build temp dirs go to tmp_path/tmp, checked empty afterwards."""
    (tmp_path / "work").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    yield tmp_path / "work"
    assert list((tmp_path / "tmp").iterdir()) == []


def build_fails(workdir, capfd, model, *extra, inputs=("model.onnx",)):
    """Run `build`; check the error contract and that nothing was written; return the error line."""
    out = workdir / "out.pic"
    code, err = run_cli(["build", model, "-o", out, *extra], capfd)
    assert_user_error(code, err)
    assert not out.exists()
    assert sorted(p.name for p in workdir.iterdir()) == sorted(inputs)  # no staging `.out.pic.tmp-*` left
    return err.strip()


@pytest.mark.parametrize("case", [c for c in bad_inputs.MODELS if c not in ("empty", "random_bytes")])
def test_bad_models(base_model, workdir, capfd, case, monkeypatch):
    make, words = bad_inputs.MODELS[case]
    model = workdir / "model.onnx"
    with monkeypatch.context() as patch:  # making the model is not the build under test: torch's export may
        patch.setattr(tempfile, "tempdir", None)  # leave its caches in the temp dir (torchinductor_root)
        make(base_model, model)
    line = build_fails(workdir, capfd, model, *bad_inputs.MODEL_ARGS.get(case, []))
    for word in words:
        assert word.lower() in line.lower(), line


@pytest.fixture(scope="session")
def base_gguf(tmp_path_factory):
    """A valid tiny LLaMA GGUF (tests/gguf_files.py), the GGUF cases' starting point."""
    import gguf_files

    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    gguf_files.write(path, gguf_files.Tiny())
    return path


@pytest.mark.parametrize("case", bad_inputs.GGUF_FILES)
def test_bad_gguf_files(base_gguf, workdir, capfd, case):
    make, words = bad_inputs.GGUF_FILES[case]
    model = workdir / "model.gguf"
    make(base_gguf, model)
    line = build_fails(workdir, capfd, model, "--dense", inputs=("model.gguf",))
    for word in words:
        assert word.lower() in line.lower(), line


def test_silu_ffn_is_lifted_for_a_dense_build(base_model, tmp_path):
    """The SiLU model refused for a predictor-mode build above is a model picompile lifts: recognise takes it."""
    from passes.import_onnx import Import
    from passes.front_end import load
    from passes.recognise import Recognise
    from passes import ir as pir
    from passes.pipeline import Context, run_passes
    from passes.targets import get_target

    bad_inputs.silu_ffn(base_model, tmp_path / "silu.onnx")
    model = run_passes(load(tmp_path / "silu.onnx"), [Import(), Recognise()], Context(get_target("cpu")))
    assert [pir.attr(n, "activation") for n in pir.nodes_in_domain(model, "FFN")] == ["silu", "silu"]


TOKEN_CASES = {
    "empty": "no token sequences",
    "blank_lines": "no token sequences",
    "ragged": "ragged",
    "three_d": "shape (2, 2, 2)",
    "floats": "float32",
    "not_numbers": "line 2",
}


@pytest.mark.parametrize("kind", ["ragged", "out_of_vocabulary"])  # the rest: read_tokens, as for eval below
def test_bad_calibration_files(base_model, workdir, capfd, kind):
    suffix = ".txt" if kind in ("empty", "blank_lines", "not_numbers") else ".npy"
    calib = bad_inputs.write_tokens(workdir / f"calib{suffix}", kind)
    line = build_fails(workdir, capfd, base_model, "--calib", calib, inputs=[calib.name])
    assert calib.name in line
    assert TOKEN_CASES.get(kind, "100000") in line and ("vocabulary" in line or kind != "out_of_vocabulary")


@pytest.mark.parametrize("kind", TOKEN_CASES)
def test_bad_eval_token_files(workdir, capfd, kind):
    suffix = ".txt" if kind in ("empty", "blank_lines", "not_numbers") else ".npy"
    tokens = bad_inputs.write_tokens(workdir / f"tokens{suffix}", kind)
    code, err = run_cli(["eval", workdir / "missing.pic", "--reference", workdir / "m.onnx", "--tokens", tokens], capfd)
    assert_user_error(code, err, tokens.name, TOKEN_CASES[kind])


@pytest.mark.parametrize("extra,words", [
    (["--vram-budget=-1GiB"], ["malformed size", "-1GiB"]),
    (["--max-context", "-5"], ["max-context", "positive integer"]),
    (["--target-recall", "2"], ["target-recall", "(0, 1]"]),
    (["--target-recall", "0"], ["target-recall", "(0, 1]"]),
    (["--target-recall", "nan"], ["target-recall", "(0, 1]"]),
    (["--placement-batch", "0"], ["placement-batch", "positive integer"]),
    (["--placement-time-limit", "-1"], ["placement-time-limit", "non-negative"]),
    (["--cpu-isa", "avx9"], ["cpu-isa", "avx9"]),
    (["--weight-dtype", "int3"], ["weight-dtype", "int3"]),
    (["--quant-method", "gptq"], ["quant-method", "gptq"]),
    # a budget larger than the card: refused before the model is even read (it does not exist here)
    (["--target", "rtx4090", "--vram-budget", "100GiB"], ["100.00 GiB", "24.00 GiB", "rtx4090"]),
    (["--vram-budget", "1GiB"], ["exceeds", "no GPU"]),
])
def test_bad_build_arguments(workdir, capfd, extra, words):
    line = build_fails(workdir, capfd, workdir / "absent.onnx", *extra, inputs=[])
    for word in words:
        assert word.lower() in line.lower(), line


def test_max_context_beyond_the_learned_positions(base_model, workdir, capfd):
    line = build_fails(workdir, capfd, base_model, "--max-context", "5000", inputs=[])
    assert "--max-context 5000" in line and "256 learned positions" in line


@pytest.mark.parametrize("args,words", [
    (["-n", "0"], ["positive integer"]),
    (["--temperature", "-1"], ["temperature", "non-negative"]),
    (["--temperature", "inf"], ["temperature", "non-negative"]),
    (["--top-k", "-2"], ["top-k", "non-negative"]),
    (["--seed", "-1"], ["seed", "non-negative"]),
    (["--top-p", "0"], ["top-p", "(0, 1]"]),
    (["--top-p", "1.5"], ["top-p", "(0, 1]"]),
    (["--prompt-ids", ""], ["prompt-ids", "empty"]),
    (["--prompt-ids=-1,2"], ["prompt-ids", "negative"]),
])
def test_bad_run_arguments(workdir, capfd, args, words):
    base = [] if any(a.startswith("--prompt-ids") for a in args) else ["--prompt-ids", "1,2"]
    code, err = run_cli(["run", workdir / "missing.pic", *base, *args], capfd)
    assert_user_error(code, err, *words)


def test_bad_eval_arguments(workdir, capfd):
    code, err = run_cli(["eval", workdir / "a.pic", "--reference", workdir / "m.onnx", "--tokens", workdir / "t.npy",
                         "--max-sequences", "0"], capfd)
    assert_user_error(code, err, "max-sequences", "positive integer")


def test_output_path_holding_something_else_is_left_alone(base_model, workdir, capfd):
    """-o naming a file or a user's directory is refused, not swapped out and deleted."""
    precious = workdir / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    code, err = run_cli(["build", base_model, "-o", precious], capfd)
    assert_user_error(code, err, "not a picompile artifact", str(precious))
    assert (precious / "notes.txt").read_text() == "keep me"
    code, err = run_cli(["build", base_model, "-o", precious / "notes.txt"], capfd)
    assert_user_error(code, err, "is a file")
    assert (precious / "notes.txt").read_text() == "keep me"
    # -o inside a file (was: exit 1, an internal FileExistsError), also a level deeper
    for inside in (precious / "notes.txt" / "out.pic", precious / "notes.txt" / "sub" / "out.pic"):
        code, err = run_cli(["build", base_model, "-o", inside], capfd)
        assert_user_error(code, err, str(inside), f"{precious / 'notes.txt'} is a file, not a directory")
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in precious.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- resource limits


def test_model_larger_than_available_memory_is_refused_up_front(base_model, workdir, capfd, monkeypatch):
    monkeypatch.setattr(passes.import_onnx, "available_memory_bytes", lambda: 1 << 20)
    loaded = []
    monkeypatch.setattr(passes.import_onnx.ir, "load", lambda *a, **k: loaded.append(a))
    line = build_fails(workdir, capfd, base_model, inputs=[])
    needed = int(base_model.stat().st_size * passes.import_onnx.WORKING_FACTOR) + passes.import_onnx.BASE_BYTES
    assert f"needs about {format_size(needed)}" in line and f"only {format_size(1 << 20)} is available" in line
    assert loaded == []  # refused before the weights were read


def test_external_weights_count_towards_the_memory_need(tiny_models, workdir, monkeypatch):
    """A model whose weights are in an external data file: its small .onnx passes the first check, the
    initializers' bytes (not read, only sized) fail the second."""
    import onnx

    model = onnx.load(str(tiny_models("opt", "legacy").onnx))
    path = workdir / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    weights = (workdir / "model.onnx.data").stat().st_size
    available = int(path.stat().st_size * passes.import_onnx.WORKING_FACTOR) + passes.import_onnx.BASE_BYTES + 1
    assert int(weights * passes.import_onnx.WORKING_FACTOR) + passes.import_onnx.BASE_BYTES > available
    monkeypatch.setattr(passes.import_onnx, "available_memory_bytes", lambda: available)
    with pytest.raises(passes.import_onnx.UserError, match=f"only {format_size(available)} is available"):
        passes.front_end.load(path)
    (workdir / "model.onnx.data").write_bytes(b"\0" * 100)  # truncated external data is named, not a crash
    monkeypatch.setattr(passes.import_onnx, "available_memory_bytes", lambda: None)
    with pytest.raises(passes.import_onnx.UserError, match="model.onnx.data is 100 bytes"):
        passes.front_end.load(path)


def test_kv_cache_larger_than_available_memory_is_refused(tiny_models, workdir, capfd, monkeypatch):
    """LLaMA has no learned positions to bound --max-context; the KV cache and logits must fit memory."""
    available = 700 << 20  # enough for the weights (about 516 MiB with the base), not for the cache
    monkeypatch.setattr(passes.import_onnx, "available_memory_bytes", lambda: available)
    monkeypatch.setattr(passes.recognise, "available_memory_bytes", lambda: available)
    line = build_fails(workdir, capfd, tiny_models("llama", "dynamo").onnx, "--max-context", "2000000", inputs=[])
    # 2 layers x (key + value) x 2 kv heads x 16 dims x 4 bytes per position, and a step's logits: 128 x 4 bytes
    # for each of its PREFILL_ROWS rows (whatever the context)
    needed = 2 * 2 * 2 * 16 * 4 * 2_000_000 + 128 * 4 * PREFILL_ROWS
    assert f"needs {format_size(needed)}" in line and f"only {format_size(available)}" in line
    assert "--max-context 2000000" in line


def test_available_memory_reads_the_machine():
    available = passes.import_onnx.available_memory_bytes()
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert available is not None and 0 < available <= total


def test_placement_stopped_by_its_time_limit_is_reported_as_such():
    """The ILP stops at --placement-time-limit; the report (manifest, `inspect`, -v log) says it is not optimal."""
    import onnx_ir as ir

    from passes.partition import Partition, PlacementReport
    from passes import ir as pir
    from passes.pipeline import Context, Options
    from test_powerinfer_placement import power_law
    from tiny_targets import SLOW_CPU_RTX4090

    rng = np.random.default_rng(0)
    layers, width, d_model = 8, 2000, 256
    graph = ir.Graph([], [], nodes=[], name="g", opset_imports={"": pir.ONNX_OPSET, pir.DOMAIN: pir.DOMAIN_VERSION})
    x = ir.val("x", ir.DataType.FLOAT, ["seq", d_model])
    graph.inputs.append(x)
    for layer in range(layers):
        p = f"layers.{layer}.ffn"
        w_up = pir.initializer(graph, f"{p}.w_up", np.zeros((d_model, width), np.float32))
        w_down = pir.initializer(graph, f"{p}.w_down", np.zeros((width, d_model), np.float32))
        graph.append(ir.node("FFN", [x, w_up, None, w_down, None], {"layer": layer, "activation": "relu", "gated": 0,
                                                                   "predictor_active": 0.2},
                             domain=pir.DOMAIN, name=p))
        pir.initializer(graph, f"{p}.frequency", power_law(rng, width, rng.uniform(0.6, 1.2)).astype(np.float32))
        pir.initializer(graph, f"{p}.predictor.w1", np.zeros((d_model, 16), np.float32))
        pir.initializer(graph, f"{p}.predictor.w2", np.zeros((16, width), np.float32))
    reports = {}
    for limit in (0.0, 30.0):
        lines = []
        partition = Partition(placement_batch=16, time_limit_s=limit)
        ctx = Context(SLOW_CPU_RTX4090, log=lines.append,
                      options=Options(vram_budget_bytes=int(layers * width * 2 * d_model * 2 * 0.3)))
        model = partition.apply(ir.Model(graph, ir_version=10), ctx).model
        reports[limit] = PlacementReport.of(model)
        assert f"{reports[limit].status}, gap" in lines[0]
        # stopped early or not, never behind a baseline by the cost model's own price
        assert reports[limit].expected_step_s <= min(reports[limit].layer_offload_step_s, reports[limit].cpu_only_step_s)
    assert reports[0.0].status == "Time limit reached" and (reports[0.0].gap is None or reports[0.0].gap > 0)
    assert reports[30.0].status == "Optimal"
    assert reports[30.0].expected_step_s <= reports[0.0].expected_step_s


def test_internal_errors_exit_1_naming_the_pass(base_model, workdir, capfd, monkeypatch):
    """A bug (not bad input) inside a pass: exit 1, one line naming the pass, no traceback."""
    def broken(model, *context):  # (analyse's arguments: the model, the build's context)
        raise KeyError("a bug")

    monkeypatch.setattr(passes.recognise, "analyse", broken)
    code, err = run_cli(["build", base_model, "-o", workdir / "out.pic"], capfd)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: pass recognise: KeyError")
    assert not (workdir / "out.pic").exists()

    def out_of_memory(model, *context):
        raise MemoryError()

    monkeypatch.setattr(passes.recognise, "analyse", out_of_memory)  # the machine's limit: exit 2, said so
    code, err = run_cli(["build", base_model, "-o", workdir / "out.pic"], capfd)
    assert_user_error(code, err, "out of memory in pass recognise")
