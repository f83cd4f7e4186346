"""plan-buffers: give each device its own instances of the buffers it uses, with copies between them.

Reads: the kernel-call IR (`passes.kernel_ir`) after select-kernels, each call with its device.
Adds: per device an instance of every activation, input and cache buffer its calls use (`name` on the
CPU, `name@gpu` on the GPU; the manifest entry says `device`), and a `copy` call (role copy, run by the
GPU's executor) wherever a call reads a value last written on the other device. Done per phase (decode and
prefill run different calls), so each copy carries the phases that need it. The logits end on the CPU.
Weights are not instanced: each device's weight file holds the weights its calls read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import onnx_ir as ir
from onnx_ir.passes import PassResult

from .pipeline import Context
from runtime.calls import PHASES, Access, Arg, Call, Role

from .kernel_ir import KERNEL_CALLS, KernelProgram, carried_metadata

COPY = "copy"  # the runtime's own transfer op (host<->device memcpy), not a TVM kernel
RESIDENT_KINDS = ("activation", "input", "cache")  # buffers that live on one device at a time


def instance(buffer: str, device: str) -> str:
    return buffer if device == "cpu" else f"{buffer}@{device}"


def _copies_needed(program: KernelProgram) -> dict[tuple[int, str, str, str], set[str]]:
    """(before call index, buffer, from device, to device) -> the phases that need that copy."""
    needed: dict[tuple[int, str, str, str], set[str]] = {}
    for phase in PHASES:
        resident = {"input_ids": {"cpu"}}
        for index, call in enumerate(program.calls + [None]):
            if call is None:  # after the last call: the runtime reads the logits on the CPU
                reads, device, writes = ["logits"], "cpu", []
            elif not call.kernel(phase):
                continue
            else:
                reads, device, writes = call.reads(), call.device, call.writes()
            for buffer in reads:
                info = program.buffers.get(buffer)
                if info is None or info["kind"] not in RESIDENT_KINDS:
                    continue
                holders = resident.setdefault(buffer, {device})  # caches live where first used
                if device not in holders:
                    needed.setdefault((index, buffer, sorted(holders)[0], device), set()).add(phase)
                    holders.add(device)
            for buffer in writes:
                resident[buffer] = {device}
    return needed


def _on_device(call: Call, buffers: dict) -> Call:
    """The call with its resident buffers renamed to its device's instances."""
    def local(arg: Arg) -> Arg:
        info = buffers.get(arg.buffer)
        if info is None or info["kind"] not in RESIDENT_KINDS:
            return arg
        return replace(arg, buffer=instance(arg.buffer, call.device))
    def named(buffer: str | None) -> str | None:
        return None if buffer is None else local(Arg(buffer)).buffer

    selection = call.selection and replace(call.selection, count=named(call.selection.count),
                                           hidden=named(call.selection.hidden))
    return replace(call, args=tuple(local(arg) for arg in call.args), selection=selection)


def plan(program: KernelProgram) -> KernelProgram:
    if {call.device for call in program.calls} == {"cpu"}:
        for info in program.buffers.values():
            if info["kind"] != "weight":
                info["device"] = "cpu"
        return program
    needed = _copies_needed(program)
    last_stage = max(call.stage for call in program.calls)
    calls = []
    for index, call in enumerate(program.calls + [None]):
        for (at, buffer, source, target), phases in sorted(needed.items()):
            if at == index:
                reader = "output" if call is None else call.id
                # the reader's stage (a split model: its machine's card copies); the logits: the last stage's
                stage = last_stage if call is None else call.stage
                calls.append(Call(f"{reader}.copy_{buffer}_to_{target}", "gpu", Role.COPY,
                                  COPY if "decode" in phases else "", COPY if "prefill" in phases else "",
                                  (Arg(instance(buffer, source)), Arg(instance(buffer, target), Access.WRITE)),
                                  None if call is None else call.layer, stage=stage))
        if call is not None:
            calls.append(_on_device(call, program.buffers))
    instances = {instance(name, device): (name, device) for name in program.buffers for device in ("cpu", "gpu")}
    buffers = {}
    for call in calls:
        for arg in call.args:
            if arg.buffer in instances and arg.buffer not in buffers:
                base, device = instances[arg.buffer]
                info = program.buffers[base]
                buffers[arg.buffer] = dict(info) if info["kind"] == "weight" else {**info, "device": device}
    for name in ("input_ids", "logits"):
        buffers[name] = {**program.buffers[name], "device": "cpu"}
    return KernelProgram(calls, buffers, program.weights, program.kernels)


@dataclass
class PlanBuffers:
    name = "plan-buffers"
    requires = (KERNEL_CALLS,)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        program = KernelProgram.from_model(model)
        planned = plan(program)
        copies = sum(1 for call in planned.calls if call.role is Role.COPY)
        ctx.log(f"plan-buffers: {len(planned.buffers)} buffers, {copies} copies between devices")
        return PassResult(planned.to_model(carried_metadata(model)), modified=True)  # every buffer gets its device
