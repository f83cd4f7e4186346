"""The device executor: runs the GPU part of a schedule on a TVM device, beside the caller's CPU calls.

Its buffers are TVM tensors allocated on its device: the weights the GPU calls read (uploaded once, at
load, and kept resident), the GPU's KV cache, activations and scratch. COPY calls move activation rows
between those tensors and the host's numpy buffers (prefill steps copy a row-prefix view). Every
device operation (kernel launches and copies) is issued by the executor's one thread on the device's
default stream, so they run in issue order; the thread synchronises the device before it signals a
step that a CPU call waits for (a device->host copy, or a host->device copy whose source the CPU will
overwrite), and at the end of each program.

On a GPU machine the device is `tvm.cuda(0)` and the kernels come from `kernels/cuda_<arch>.so`.
With --emulate-gpu the same class runs on `tvm.cpu(0)` with the CPU versions of the GPU calls' kernels
(`kernels/cpu.so` holds every kernel), so emulation exercises this executor's allocation, copies,
waits and overlap; only the CUDA specifics (the library, the device, asynchronous launches) differ.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np

from .artifact import ArtifactError, first_line
from .manifest import Buffer, TargetFacts

EMULATE_HINT = ("pass --emulate-gpu to run its GPU part on a second CPU executor (checks the split, not the speed), "
                "or rebuild it with --target cpu")


def load_cuda_runtime() -> None:
    """Load TVM's CUDA runtime library, `libtvm_runtime_cuda.so`, from the directory of the loaded libtvm_runtime.

    With TVM_USE_RUNTIME_LIB=1, TVM 0.27 loads only libtvm_runtime (the backend autoload that loads this
    library, tvm/backend/cuda, is part of the compiler side), so `tvm.cuda(0)` does not exist and CUDA
    modules do not load until it is loaded; loading it registers the CUDA device API and module loader.
    Loaded as TVM's own autoload does (RTLD_LOCAL, recorded in tvm.base._LOADED_LIBS, so it is loaded once).
    It links libcudart.so.13 and libcuda.so.1: OSError when they are missing (no NVIDIA driver), RuntimeError
    when the library is not found."""
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    if "tvm_runtime_cuda" not in _LOADED_LIBS:
        runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_LOCAL",
                                                           extra_lib_paths=[runtime_dir])


def sm_version(arch: str) -> tuple[int, int]:
    """("sm_89" | "8.9") -> (8, 9)."""
    if arch.startswith("sm_"):
        digits = arch[3:]
        return int(digits[:-1]), int(digits[-1])
    major, minor = arch.split(".")[:2]
    return int(major), int(minor)


def arch_problem(arch: str, compute_version: str, device_name: str) -> str | None:
    """Why kernels built for `arch` cannot run on a GPU of `compute_version`, or None when they can.

    The compile pass ships a fatbin with SASS for `arch` and PTX for `compute_<arch>` (passes/kernels/cuda.py
    `nvcc_flags`): the SASS runs on that arch, and the driver JIT-compiles the PTX for any newer one, so
    only an older GPU is refused."""
    built, have = sm_version(arch), sm_version(compute_version)
    if have >= built:
        return None
    return (f"its GPU kernels were compiled for {arch} (SASS + PTX), which {device_name} (compute capability "
            f"{compute_version}) cannot run: rebuild it for a target whose cuda arch is at most sm_{have[0]}{have[1]}")


def cuda_device(target: TargetFacts, tvm_runtime):
    """tvm.cuda(0) for an artifact built for `target` (its manifest entry), or an ArtifactError saying why not."""
    what = (f"artifact was built for GPU target {target.name} ({target.cuda_arch}) and runs part of "
            "the model on the GPU")
    try:
        load_cuda_runtime()
    except (OSError, RuntimeError) as error:
        reason = first_line(error, type(error).__name__)
        raise ArtifactError(f"{what}, but TVM's CUDA runtime cannot be loaded here ({reason}); "
                            f"{EMULATE_HINT}") from None
    device = tvm_runtime.cuda(0)
    if not device.exist:
        raise ArtifactError(f"{what}, but this machine has no CUDA GPU (tvm.cuda(0) does not exist); {EMULATE_HINT}")
    problem = arch_problem(target.cuda_arch, device.compute_version, device.device_name)
    if problem:
        raise ArtifactError(f"{what}, but {problem}")
    return device


def _host(array) -> np.ndarray:
    """A numpy array's own data, or a device tensor's copied to the host (profiling reads counts this way)."""
    return array if isinstance(array, np.ndarray) else array.numpy()


class DeviceExecutor:
    """The GPU part of an engine: its buffers on `device`, its kernels from `library`, its own thread.

    buffers: name -> manifest entry of every buffer the GPU calls use (weights included);
    weights: name -> numpy array of the weights among them (uploaded here, once);
    row_buffers: the names holding one row per token (a step of `rows` tokens uses their first rows)."""

    def __init__(self, tvm_runtime, device, library, buffers: dict[str, Buffer], weights: dict[str, np.ndarray],
                 row_buffers: set[str]):
        self.device, self.library = device, library
        self._runtime = tvm_runtime
        self._row_buffers = row_buffers
        self.tensors = {}
        self.uploads = 0  # weight tensors copied to the device (at load only)
        self.uploaded_bytes = 0
        self.copied_bytes = {"to_device": 0, "to_host": 0}  # by COPY calls
        for name, info in buffers.items():
            if info.kind == "weight":
                self.tensors[name] = self._upload(weights[name])
            else:  # zeroed like the host's buffers, so no step ever reads stale device memory
                tensor = tvm_runtime.empty(info.shape, info.dtype, device)
                tensor.copyfrom(np.zeros(info.shape, info.dtype))
                self.tensors[name] = tensor
        self._kernels: dict[str, object] = {}
        self._jobs = _device_jobs()

    def _upload(self, array: np.ndarray):
        self.uploads += 1
        self.uploaded_bytes += array.nbytes
        return self._runtime.tensor(array, self.device)

    # ---------------------------------------------------------------- binding

    def kernel(self, name: str):
        if name not in self._kernels:
            try:
                function = self.library[name]
            except Exception as error:
                raise ArtifactError(f"the GPU kernel library does not provide scheduled kernel {name}: {error}") from None
            function.release_gil = True  # the CPU thread runs while this one waits on the device
            self._kernels[name] = function
        return self._kernels[name]

    def view(self, name: str, rows: int):
        """The tensor, or for a row buffer a view of its first `rows` rows (same memory)."""
        tensor = self.tensors[name]
        if name not in self._row_buffers or rows == tensor.shape[0]:
            return tensor
        return tensor._create_view([rows, *tensor.shape[1:]])

    def bind_call(self, kernel: str, args: list, start_index: int | None):
        """A kernel call; `args` are device buffer names, with None at `start_index` for the position."""
        function = self.kernel(kernel)
        if start_index is None:
            return lambda position: function(*args)

        def run(position):
            args[start_index] = position
            function(*args)

        return run

    def bind_copy(self, host: np.ndarray, name: str, rows: int, to_device: bool):
        """A COPY call between a host buffer's rows (`host`, already sliced) and device buffer `name`'s."""
        device_side, host_side = self.view(name, rows), self._runtime.from_dlpack(host)
        if tuple(device_side.shape) != tuple(host.shape):
            raise ArtifactError(f"copy of {name}: host rows {host.shape} and device rows {tuple(device_side.shape)} differ")
        source, target = (host_side, device_side) if to_device else (device_side, host_side)
        nbytes, direction, counts = host.nbytes, "to_device" if to_device else "to_host", self.copied_bytes

        def run(position):
            source.copyto(target)  # TVM's copy on the default stream: ordered after the launches before it
            counts[direction] += nbytes

        return run

    # ---------------------------------------------------------------- running

    def sync(self) -> None:
        self.device.sync()

    def run(self, program: list, position: int, record) -> None:
        """Run a program: its GPU steps on this executor's thread, its CPU steps on the caller's."""
        done = [threading.Event() for _ in program]
        failure: list[BaseException] = []
        self._jobs.put((program, position, record, done, failure, self.sync))
        execute(program, "cpu", position, record, done, failure)
        for event in done:
            event.wait()
        if failure:
            raise failure[0]


_JOBS: queue.SimpleQueue | None = None
_JOBS_LOCK = threading.Lock()


def _device_jobs() -> queue.SimpleQueue:
    """The queue of the process's one device thread, started on first use. One thread for every executor, never
    ending: the GPU runs one stream's work in order anyway, and a thread that ran TVM's parallel CPU kernels (an
    emulated GPU's) aborts the process when it exits while the process lives (TVM's per-thread worker pool is
    torn down with joinable threads). The thread holds only the queue, so a dropped engine frees its memory."""
    global _JOBS
    with _JOBS_LOCK:
        if _JOBS is None:
            _JOBS = queue.SimpleQueue()
            threading.Thread(target=_device_loop, args=(_JOBS,), name="picompile-gpu-executor", daemon=True).start()
        return _JOBS


def _device_loop(jobs: queue.SimpleQueue) -> None:
    while True:
        program, position, record, done, failure, sync = jobs.get()
        execute(program, "gpu", position, record, done, failure, sync)


def execute(program: list, device: str, position: int, record, done, failure, sync=None) -> None:
    """Run `device`'s steps of `program` in order, each after the other device's steps it waits for. With
    `sync` (the device executor) the device is synchronised after a step marked `sync_after` (one the other
    device waits for, or the program's last), and after every step when profiling, so the time is the work's."""
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
                if sync is not None and (step.sync_after or record is not None):
                    sync()
                if record is not None:
                    record(step.role, clock() - began, step.bytes_read())
        except BaseException as error:  # surfaced by the caller; keep signalling so nobody hangs
            failure.append(error)
        done[index].set()


def device_library(directory: Path, target: dict, tvm_runtime):
    """The artifact's CUDA kernel module for its arch (call after `cuda_device`)."""
    path = Path(directory) / "kernels" / f"cuda_{target['cuda_arch']}.so"
    if not path.is_file():
        raise ArtifactError(f"artifact has GPU calls but no {path.relative_to(directory)}; rebuild it")
    try:
        return tvm_runtime.load_module(str(path))
    except Exception as error:
        raise ArtifactError(f"cannot load {path.name} on this GPU: {first_line(error, type(error).__name__)}") from None
