"""Shared fixtures: tiny models made on the fly (cached under a per-session temp cache)."""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ is importable by tests
# builds price their CPU kernels with the target's bandwidth, not this machine's measured rates: a test's plan must
# not depend on the machine that runs it (tests/test_machine_rates.py turns them on where it checks them)
os.environ["PICOMPILE_MEASURED_RATES"] = "0"


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """Tests never touch the user's cache: models go to a per-run directory unless PICOMPILE_CACHE is set.
    The optimum environment is the exception: scripts/optimum_env.py made it under the user's cache before
    the run, so its place is fixed before the cache moves."""
    from examples.models import optimum_venv

    os.environ.setdefault("PICOMPILE_OPTIMUM_VENV", str(optimum_venv()))
    if "PICOMPILE_CACHE" not in os.environ:
        cache = _run_directory(tmp_path_factory) / "picompile-cache"
        cache.mkdir(exist_ok=True)
        os.environ["PICOMPILE_CACHE"] = str(cache)
    yield


def _run_directory(tmp_path_factory) -> Path:
    """This run's temporary root, which pytest-xdist's workers share (each has its own basetemp below it):
    the model cache there is made once for all of them (examples.models.build_cached renames a finished
    model into place, so two workers making the same one both end with one whole copy)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _frames_of_no_module_looked_up_once():
    """TVMScript's T.prim_func takes inspect.stack() where a kernel is made, and inspect asks getmodule for each
    frame's module; a frame of code that is no module's ('<string>' and '<ast>', code run from strings;
    xdist/remote.py, which the workers run as a script) makes getmodule walk all of sys.modules (thousands of
    modules once torch is imported): ~15 walks a kernel made, a good part of a tiny build's time. That answer
    (None) depends on nothing but the loaded modules, so it is kept until sys.modules changes size. Every other
    lookup goes to inspect unchanged."""
    import inspect

    look_up = inspect.getmodule
    unresolved = {}  # a frame's file name -> len(sys.modules) when it last resolved to no module

    def getmodule(object, _filename=None):
        a_frame = _filename is not None and inspect.isframe(object)
        if a_frame and unresolved.get(_filename) == len(sys.modules):
            return None
        module = look_up(object, _filename)
        if a_frame and module is None:
            unresolved[_filename] = len(sys.modules)
        return module

    inspect.getmodule = getmodule
    yield
    inspect.getmodule = look_up


@pytest.fixture(scope="session", autouse=True)
def _script_macros_find_their_parser_by_walking_frames():
    """A TVMScript macro's call looks for the parser among its callers' globals through inspect.getouterframes,
    which also reads every caller's file and source line (a hundred frames under pytest, for each of the many
    macro calls of a kernel). Walking the frames' globals alone finds the same parser."""
    from tvm.script.parser.core.parser import ScriptMacro

    find = getattr(ScriptMacro, "_find_parser_def", None)
    if find is None:  # (a TVM without it: nothing to replace)
        yield
        return

    def find_parser_def(self):
        frame = sys._getframe(1)
        while frame is not None:
            parser = frame.f_globals.get(ScriptMacro.parser_object_name)
            if parser is not None:
                return parser
            frame = frame.f_back
        return find(self)  # (its error)

    ScriptMacro._find_parser_def = find_parser_def
    yield
    ScriptMacro._find_parser_def = find


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernel_libraries_compiled_once(tmp_path_factory):
    """Tests build many artifacts of the same few tiny models (one model through several exporters, the same
    build in several files), and every build LLVM-compiles its CPU kernels again: the slowest part of a tiny
    build. Here `cpu.build` compiles each distinct module (structurally equal TVM functions, same target)
    once per run and copies that .so to every later build asking for the same module; everything before
    (making the kernels) and after (loading and running them) is untouched. The compiled modules are kept in
    the run's directory, which pytest-xdist's workers share (each module's IR, TVM's JSON, beside its .so): a
    worker copies what the other compiled, compared structurally as its own. PICOMPILE_TEST_COMPILE_ALWAYS=1
    compiles every time."""
    if os.environ.get("PICOMPILE_TEST_COMPILE_ALWAYS") == "1":
        yield
        return
    import tvm
    import tvm_ffi

    from passes.kernels import cpu

    compile_module = cpu.build
    directory = _run_directory(tmp_path_factory) / "cpu-kernel-libraries"
    directory.mkdir(exist_ok=True)
    read = {}  # IR file -> its IRModule (this process's own, or read once)
    numbers = itertools.count(1)  # this process's compiled modules, for unique names

    def compiled(key: str):
        """(IRModule, .so path) of every module compiled this run, by either worker, under `key`."""
        for ir_path in sorted(directory.glob(f"{key}-*.json")):  # (written after its .so: both whole)
            if ir_path not in read:
                read[ir_path] = tvm.ir.load_json(ir_path.read_text())
            yield read[ir_path], ir_path.with_suffix(".so")

    def build_once(funcs, target, path):
        names = [str(f.attrs["global_symbol"]) for f in funcs]
        if len(set(names)) != len(names):  # cpu.build's own error
            return compile_module(funcs, target, path)
        module = tvm.IRModule(dict(zip(names, funcs)))
        key = hashlib.sha256(f"{target}|{tvm_ffi.structural_hash(module)}".encode()).hexdigest()[:24]
        for earlier, library in compiled(key):
            if tvm_ffi.structural_equal(earlier, module):
                shutil.copyfile(library, path)
                return None
        result = compile_module(funcs, target, path)
        stem = directory / f"{key}-{os.getpid()}-{next(numbers)}"
        for suffix, write in ((".so", lambda to: shutil.copyfile(path, to)),
                              (".json", lambda to: to.write_text(tvm.ir.save_json(module)))):
            staged = stem.with_suffix(suffix + ".tmp")
            write(staged)
            staged.rename(stem.with_suffix(suffix))  # another worker sees a whole file or none
        read[stem.with_suffix(".json")] = module
        return result

    cpu.build = build_once
    yield
    cpu.build = compile_module


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


@pytest.fixture(scope="session")
def tiny_sparse_artifact(tiny_models, tmp_path_factory):
    """The tiny OPT (90% sparse FFNs) built sparse for the CPU, 64 tokens of context: for the slot and server tests."""
    from picompile.compiler import build
    from passes.pipeline import Options
    from passes.targets import get_target

    files = tiny_models("opt", sparsity=0.9)
    out = tmp_path_factory.mktemp("serving") / "opt-tiny.pic"
    build(files.onnx, out, get_target("cpu"), Options(max_context=64))
    return out
