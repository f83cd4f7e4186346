"""The executor: binds the artifact's buffers to its kernels and runs the schedule, one token or many.

Buffers are allocated once at load, 64-byte aligned; every kernel call of a decode step is bound in
advance, so a step is a loop of FFI calls. The DAG's `order` attribute is the execution order.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .artifact import ArtifactError, aligned_zeros, load_manifest, read_safetensors

START = "start"  # the argument that carries the number of tokens already in the KV cache


def _tvm_runtime():
    """TVM's runtime library and FFI only; the compiler library is not loaded by a fresh process."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import tvm.runtime
    import tvm_ffi

    return tvm.runtime, tvm_ffi


class Engine:
    def __init__(self, directory: str | Path, *, check_hashes: bool = True):
        self.directory = Path(directory)
        self.manifest = load_manifest(self.directory, check_hashes=check_hashes)
        if self.manifest["target"].get("cuda_arch"):
            raise ArtifactError(
                f"artifact was built for GPU target {self.manifest['target']['name']}; this runtime build runs CPU artifacts only"
            )
        self.max_context = int(self.manifest["model"]["max_context"])
        self.vocab_size = int(self.manifest["model"]["vocab_size"])
        tvm_runtime, self._ffi = _tvm_runtime()
        library = tvm_runtime.load_module(str(self.directory / "kernels" / "cpu.so"))
        weights = read_safetensors(self.directory / "weights" / "cpu.safetensors")
        self.buffers: dict[str, np.ndarray] = {}
        for name, info in self.manifest["buffers"].items():
            if info["kind"] == "weight":
                if name not in weights:
                    raise ArtifactError(f"weight {name} is missing from the artifact")
                self.buffers[name] = weights[name]
            else:
                self.buffers[name] = aligned_zeros(info["shape"], np.dtype(info["dtype"]))
        self._row_buffers = {n for n, info in self.manifest["buffers"].items() if info["kind"] in ("activation", "input")}
        schedule = json.loads((self.directory / "schedule.json").read_text())
        nodes = sorted(schedule["nodes"], key=lambda node: node["order"])
        try:
            self.calls = [(library[n["decode"]], library[n["prefill"]], n["args"], n["op_class"], n["id"]) for n in nodes]
        except Exception as error:
            raise ArtifactError(f"kernel library does not provide a scheduled kernel: {error}") from None
        self._decode = [self._bind(decode, args, rows=1) for decode, _, args, _, _ in self.calls]
        self.position = 0
        self.profile: dict[str, float] | None = None

    def _bind(self, function, args: list[str], rows: int):
        tensors = []
        for name in args:
            if name == START:
                tensors.append(0)
            else:
                array = self.buffers[name][:rows] if name in self._row_buffers else self.buffers[name]
                tensors.append(self._ffi.from_dlpack(array))
        start_index = args.index(START) if START in args else -1
        return function, tensors, start_index

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
        bound = self._decode if rows == 1 else [self._bind(p, args, rows) for _, p, args, _, _ in self.calls]
        if self.profile is None:
            for function, tensors, start_index in bound:
                if start_index >= 0:
                    tensors[start_index] = self.position
                function(*tensors)
        else:
            self._run_profiled(bound)
        self.position += rows
        return self.buffers["logits"][:rows].copy()

    def _run_profiled(self, bound) -> None:
        clock = time.perf_counter
        for (function, tensors, start_index), call in zip(bound, self.calls):
            began = clock()
            if start_index >= 0:
                tensors[start_index] = self.position
            function(*tensors)
            self.profile[call[3]] = self.profile.get(call[3], 0.0) + clock() - began
