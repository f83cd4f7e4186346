"""compile: make every kernel the program names and compile them, for the CPU (LLVM) and the GPU (nvcc).

Reads: the kernel-call IR's kernel specs (`picompile.kernels`) and calls (which device runs each kernel).
Adds: `kernels/cpu.so` (every kernel, for the CPU: it runs its own calls and stands in for the GPU when
emulating), `kernels/signatures.json` (each kernel's argument shapes and types, as the compiled code checks
them: the runtime checks the buffers against them at load) and, on a GPU target, `kernels/cuda_<arch>.so` (the GPU calls' kernels, scheduled for CUDA and
compiled by nvcc now, so the GPU machine needs no compiler) to the artifact's files. The IR is unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes import PassResult

from .errors import UserError
from .pipeline import Context
from runtime.calls import Role

from .kernel_ir import KERNEL_CALLS, KernelProgram, KernelSpec
from .kernels import cpu, ops


def kernel_signature(func) -> list:
    """Each parameter of a kernel, as the compiled code checks it at call time: {"shape", "dtype"} for a
    tensor (each dimension an int, or the name of a size variable: the rows of a prefill step), None for a
    scalar (`start`). The CUDA kernels are made from the same specifications, so they take the same."""
    from tvm import tirx

    signature = []
    for param in func.params:
        try:
            shape, dtype = list(param.shape), str(param.dtype)
        except AttributeError:  # a scalar parameter
            signature.append(None)
            continue
        signature.append({"shape": [int(d.value) if isinstance(d, tirx.IntImm) else str(d) for d in shape],
                          "dtype": dtype})
    return signature


def first_layers(program: KernelProgram) -> dict[str, int | None]:
    """Each kernel's first layer (of the first call that runs it), for the error of a kernel that fails."""
    layers: dict[str, int | None] = {}
    for call in program.calls:
        for name in (call.decode, call.prefill, call.batch):
            if name:
                layers.setdefault(name, call.layer)
    return layers


# (maker, kernel name, spec as JSON) -> its TVM function. Making one parses TVMScript (~0.2-0.5 s a kernel, most
# of a small build), and a process that builds several artifacts (dense and sparse, several formats) asks for
# the same kernels again; TVM functions are immutable, so one serves every build.
_MADE: dict[tuple, object] = {}


def _make(spec: KernelSpec, name: str, device: str):
    op = ops.get(spec.op)
    maker = op.cuda if device == "gpu" else op.cpu
    if maker is None:
        raise ValueError(f"kernel {name}: op {op.name} has no {device} version")
    key = (maker, name, json.dumps(spec.to_json(), sort_keys=True))
    if key not in _MADE:
        _MADE[key] = maker(name, *spec.args, rows=spec.rows, **spec.kwargs)
    return _MADE[key]


def make_kernels(program: KernelProgram, names: list[str], device: str, ctx: Context) -> list:
    """The TVM functions of kernels `names` for `device`, each made under the layer that first runs it (so a
    kernel that fails to generate is reported with its layer)."""
    layer_of = first_layers(program)
    funcs = []
    with ctx.progress(f"compile: making {'CUDA' if device == 'gpu' else 'CPU'} kernels", len(names)) as advance:
        for name in names:
            with ctx.layer(layer_of.get(name)):
                funcs.append(_make(program.kernels[name], name, device))
            advance()
    return funcs


@dataclass
class Compile:
    name = "compile"
    requires = (KERNEL_CALLS,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        program = KernelProgram.from_model(model)
        isa = ctx.build.cpu_isa  # the instruction set the CPU kernels are compiled for
        library = Path(ctx.workdir) / "kernels" / "cpu.so"
        library.parent.mkdir(parents=True, exist_ok=True)
        names = sorted(program.kernels)
        funcs = make_kernels(program, names, "cpu", ctx)
        with ctx.progress(f"compile: compiling {len(funcs)} CPU kernels (LLVM)"):
            cpu.build(funcs, isa.llvm_target(), str(library))
        ctx.artifact_files["kernels/cpu.so"] = library
        signatures = library.parent / "signatures.json"
        signatures.write_text(json.dumps({name: kernel_signature(func) for name, func in zip(names, funcs)},
                                         sort_keys=True))
        ctx.artifact_files["kernels/signatures.json"] = signatures
        if ctx.target.has_gpu:
            self.build_cuda(program, ctx)
        ctx.log(f"compile: {len(funcs)} CPU kernels for {isa.name}")
        return PassResult(model, modified=False)

    @staticmethod
    def build_cuda(program: KernelProgram, ctx: Context) -> None:
        from .kernels import cuda

        names = sorted({name for call in program.calls if call.device == "gpu" and call.role is not Role.COPY
                        for name in (call.decode, call.prefill) if name})
        if not names:
            return
        if cuda.nvcc_path() is None:
            raise UserError(f"building for {ctx.target.name} compiles its GPU kernels with nvcc, which is not installed "
                            "(install the CUDA toolkit or set CUDA_PATH), or build with --target cpu")
        funcs = make_kernels(program, names, "gpu", ctx)
        arch = ctx.target.cuda_arch
        library = Path(ctx.workdir) / "kernels" / f"cuda_{arch}.so"
        with ctx.progress(f"compile: compiling {len(funcs)} CUDA kernels (nvcc)"):
            facts = cuda.build(funcs, arch, str(library))
        ctx.artifact_files[f"kernels/cuda_{arch}.so"] = library
        ctx.log(f"compile: {len(funcs)} CUDA kernels for {arch} ({facts.get('binary_format')}, "
                f"nvcc {facts.get('nvcc_seconds', 0):.1f} s)")
