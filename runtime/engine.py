"""The executor: binds the artifact's buffers to its kernels and runs the schedule, one token or many.

Buffers are allocated once at load, 64-byte aligned; every kernel call of a decode step is bound in
advance, so a step is a loop of FFI calls. The DAG's `order` attribute is the execution order. Each
call has a device: CPU calls run on the calling thread; GPU calls run on a second executor (a thread
with its own copies of the buffers it uses, standing in for the GPU when `emulate_gpu` is set), and
waits on the DAG edges that cross devices keep the two in step.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .artifact import ArtifactError, aligned_zeros, load_manifest, missing_cpu_features, read_safetensors

START = "start"  # the argument that carries the number of tokens already in the KV cache
COPY = "copy"  # a transfer between devices: the runtime's own, not a kernel
PHASES = ("decode", "prefill")
# decode calls that read only the rows selected before them (by a predictor, or by magnitude thresholds)
SPARSE_KERNELS = ("sparse_up", "sparse_down", "sparse_ffn", "sparse_columns")
FUSED_FFN = "sparse_ffn"  # the CPU's one-pass up+down: with ReLU it stops at a neuron's first row when that gives 0
COUNTERS = ("weight_bytes", "decode_steps")  # the profile's entries that are not seconds


def _tvm_runtime():
    """TVM's runtime library and FFI only; the compiler library is not loaded by a fresh process."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import tvm.runtime
    import tvm_ffi

    return tvm.runtime, tvm_ffi


@dataclass
class Step:
    """One bound call of a program."""

    name: str
    op_class: str
    device: str
    run: object  # a callable taking the position
    waits: list[int] = field(default_factory=list)  # program indices on the other device to wait for
    weight_bytes: int = 0  # weight bytes the call reads whatever the input (a decode step's; 0 in prefill)
    count: np.ndarray | None = None  # sparse calls: the [1, 1] count of selected neurons they read rows for
    bytes_per_count: int = 0  # ... and the weight bytes read per selected neuron
    hidden: np.ndarray | None = None  # fused ReLU calls: the hidden values; rows past the first are read ...
    bytes_per_active: int = 0  # ... only for the neurons whose value is not 0, this many bytes each

    def bytes_read(self) -> int:
        """Weight bytes this call read; for a sparse call, read its count (and hidden) buffers right after it."""
        if self.count is None:
            return self.weight_bytes
        count = int(self.count[0, 0])
        active = 0 if self.hidden is None else int(np.count_nonzero(self.hidden[0, :count]))
        return self.weight_bytes + count * self.bytes_per_count + active * self.bytes_per_active


class Engine:
    def __init__(self, directory: str | Path, *, check_hashes: bool = True, emulate_gpu: bool = False):
        self.directory = Path(directory)
        self.manifest = load_manifest(self.directory, check_hashes=check_hashes)
        target = self.manifest.get("target", {})
        missing = missing_cpu_features(target.get("cpu_features", []))
        if missing:  # loading would work; the first kernel call would die of an illegal instruction
            raise ArtifactError(f"this artifact's CPU kernels were built for {target.get('cpu_isa')} and need "
                                f"{', '.join(missing)}, which this CPU lacks; rebuild it with --cpu-isa avx2")
        self.max_context = int(self.manifest["model"]["max_context"])
        self.vocab_size = int(self.manifest["model"]["vocab_size"])
        schedule = json.loads((self.directory / "schedule.json").read_text())
        self._nodes = sorted(schedule["nodes"], key=lambda node: node["order"])
        self.devices = sorted({node["device"] for node in self._nodes})
        if "gpu" in self.devices and not emulate_gpu:
            raise ArtifactError(
                f"artifact was built for GPU target {self.manifest['target']['name']} and runs part of the model on "
                "the GPU; this runtime has no CUDA executor yet: pass --emulate-gpu to run the GPU part on a second "
                "CPU executor (checks the split, not the speed), or rebuild with --target cpu"
            )
        tvm_runtime, self._ffi = _tvm_runtime()
        library = tvm_runtime.load_module(str(self.directory / "kernels" / "cpu.so"))
        weights = {}
        for path in sorted((self.directory / "weights").glob("*.safetensors")):
            weights.update(read_safetensors(path))
        self.buffers: dict[str, np.ndarray] = {}
        for name, info in self.manifest["buffers"].items():
            if info["kind"] == "weight":
                if name not in weights:
                    raise ArtifactError(f"weight {name} is missing from the artifact")
                self.buffers[name] = weights[name]
            else:
                self.buffers[name] = aligned_zeros(info["shape"], np.dtype(info["dtype"]))
        self._row_buffers = {n for n, info in self.manifest["buffers"].items() if info["kind"] in ("activation", "input")}
        self._edges = schedule.get("edges", [])
        try:
            self._kernels = {name: library[name] for node in self._nodes for name in (node["decode"], node["prefill"])
                             if name and name != COPY}
        except Exception as error:
            raise ArtifactError(f"kernel library does not provide a scheduled kernel: {error}") from None
        for kernel in self._kernels.values():
            kernel.release_gil = True  # the two executors overlap only if calls release the GIL
        self._decode = self._program("decode", rows=1)
        self._worker = _DeviceWorker() if "gpu" in self.devices else None
        self.position = 0
        # Set to {} to profile: seconds per op class, "wall" and "overhead", and for decode (one-token)
        # steps "weight_bytes" (weight bytes the calls read) and "decode_steps".
        self.profile: dict[str, float] | None = None

    # ---------------------------------------------------------------- binding

    def _view(self, name: str, rows: int):
        array = self.buffers[name]
        return array[:rows] if name in self._row_buffers else array

    def _bind(self, node: dict, phase: str, rows: int):
        kernel_name = node[phase]
        if kernel_name == COPY:
            source, target = (self._view(name, rows) for name in node["args"])
            return lambda position: np.copyto(target, source)
        function = self._kernels[kernel_name]
        args = [0 if name == START else self._ffi.from_dlpack(self._view(name, rows)) for name in node["args"]]
        if START not in node["args"]:
            return lambda position: function(*args)
        index = node["args"].index(START)

        def run(position):
            args[index] = position
            function(*args)

        return run

    def _weight_reads(self, node: dict) -> dict:
        """The weight bytes a decode call reads: all of each weight buffer it takes, except an embedding
        gather (one row per table) and the sparse FFN calls, which read `count` rows of their row-major
        weights and biases (rows per neuron = rows / neurons: two for a gated up, gate and up)."""
        buffers = self.manifest["buffers"]
        sparse = node["decode"].startswith(SPARSE_KERNELS)
        fixed = per_count = 0
        for name in node["args"]:
            info = buffers.get(name)
            if info is None or info["kind"] != "weight":
                continue
            nbytes = math.prod(info["shape"]) * np.dtype(info["dtype"]).itemsize
            if node["op_class"] == "embed":
                fixed += nbytes // info["shape"][0]
            elif sparse and not (node["decode"].startswith("sparse_columns") and len(info["shape"]) == 1):
                # (a column-sparse call reads its bias whole: the rows are per input channel, the bias per output)  # args: (x or hidden), index [1, neurons], count [1, 1], rows...
                per_count += nbytes // buffers[node["args"][1]]["shape"][-1]
            else:
                fixed += nbytes
        if not sparse:
            return {"weight_bytes": fixed}
        reads = {"weight_bytes": fixed, "count": self.buffers[node["args"][2]], "bytes_per_count": per_count}
        if node["decode"].startswith(FUSED_FFN) and "_relu" in node["decode"]:
            # args: x, index, count, up rows, up bias, down rows, hidden, ...: the first up row (the gate's when
            # gated) and the bias are read for every selected neuron, the other rows only where it was not 0
            up, bias = (buffers[name] for name in node["args"][3:5])
            neurons = buffers[node["args"][1]]["shape"][-1]
            row = lambda info: info["shape"][-1] * np.dtype(info["dtype"]).itemsize  # noqa: E731
            first = row(up) + (math.prod(bias["shape"]) // neurons) * np.dtype(bias["dtype"]).itemsize
            reads.update(bytes_per_count=first, hidden=self.buffers[node["args"][6]], bytes_per_active=per_count - first)
        return reads

    def _program(self, phase: str, rows: int) -> list[Step]:
        nodes = [node for node in self._nodes if node[phase]]
        index = {node["id"]: i for i, node in enumerate(nodes)}
        steps = [Step(node["id"], node["op_class"], node["device"], self._bind(node, phase, rows),
                      **(self._weight_reads(node) if phase == "decode" else {})) for node in nodes]
        for edge in self._edges:
            source, target = index.get(edge["source"]), index.get(edge["target"])
            if (source is not None and target is not None and phase in edge.get("phases", PHASES)
                    and steps[source].device != steps[target].device):
                steps[target].waits.append(source)
        return steps

    # ---------------------------------------------------------------- running

    def reset(self) -> None:
        """Forget the context (cache entries past `position` are never read, so no clearing is needed)."""
        self.position = 0

    def forward(self, token_ids) -> np.ndarray:
        """Run the model on new tokens after the cached ones; returns their logits [len, vocab]."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        rows = ids.size
        if rows == 0:
            raise ValueError("forward needs at least one token")
        if self.position + rows > self.max_context:
            raise ValueError(f"context full: {self.position} cached + {rows} new > max context {self.max_context}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {ids.min()}..{ids.max()}")
        self.buffers["input_ids"][:rows] = ids
        program = self._decode if rows == 1 else self._program("prefill", rows)
        began = time.perf_counter()
        if self._worker is None:
            self._run_serial(program)
        else:
            self._worker.run(program, self.position, self._timer())
        if self.profile is not None:  # wall time not spent inside a kernel or copy: the runtime's own cost
            kernels = sum(seconds for op_class, seconds in self.profile.items()
                          if op_class not in ("overhead", "wall", *COUNTERS))
            self.profile["wall"] = self.profile.get("wall", 0.0) + time.perf_counter() - began
            self.profile["overhead"] = max(self.profile["wall"] - kernels, 0.0)
            if program is self._decode:
                self.profile["decode_steps"] = self.profile.get("decode_steps", 0) + 1
        self.position += rows
        return self.buffers["logits"][:rows].copy()

    def _timer(self):
        if self.profile is None:
            return None
        profile, lock = self.profile, threading.Lock()

        def record(op_class: str, seconds: float, weight_bytes: int) -> None:
            with lock:
                profile[op_class] = profile.get(op_class, 0.0) + seconds
                profile["weight_bytes"] = profile.get("weight_bytes", 0) + weight_bytes

        return record

    def _run_serial(self, program: list[Step]) -> None:
        position = self.position
        if self.profile is None:
            for step in program:
                step.run(position)
            return
        record, clock = self._timer(), time.perf_counter
        for step in program:
            began = clock()
            step.run(position)
            record(step.op_class, clock() - began, step.bytes_read())


class _DeviceWorker:
    """Runs a program's GPU steps on a second thread while the caller runs its CPU steps."""

    def __init__(self):
        self._jobs: list = []
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="picompile-gpu-executor", daemon=True)
        self._thread.start()

    def run(self, program: list[Step], position: int, record) -> None:
        done = [threading.Event() for _ in program]
        failure: list[BaseException] = []
        job = (program, position, record, done, failure)
        with self._ready:
            self._jobs.append(job)
            self._ready.notify()
        _execute(program, "cpu", position, record, done, failure)
        for event in done:
            event.wait()
        if failure:
            raise failure[0]

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                program, position, record, done, failure = self._jobs.pop(0)
            _execute(program, "gpu", position, record, done, failure)


def _execute(program: list[Step], device: str, position: int, record, done, failure) -> None:
    clock = time.perf_counter
    for index, step in enumerate(program):
        if step.device != device:
            continue
        for wait in step.waits:
            done[wait].wait()
        try:
            if not failure:
                began = clock()
                step.run(position)
                if record is not None:
                    record(step.op_class, clock() - began, step.bytes_read())
        except BaseException as error:  # surfaced by the caller; keep signalling so nobody hangs
            failure.append(error)
        done[index].set()
