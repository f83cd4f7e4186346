"""The executor: binds the artifact's buffers to its kernels and runs the schedule, one token or many.

Buffers are allocated once at load, 64-byte aligned; every kernel call of a decode step is bound in
advance, so a step is a loop of FFI calls. The DAG's `order` attribute is the execution order. Each
call has a device: CPU calls run on the calling thread over numpy buffers; GPU calls and the copies
between devices run on the device executor (`runtime/device.py`: its own thread, its buffers TVM tensors
on the GPU, or on the CPU device when `emulate_gpu` is set), and waits on the DAG edges that cross
devices keep the two in step. An artifact with GPU calls and no usable GPU is refused unless emulated.

Slots: `Engine(directory, slots=N)` holds N sequences at once. Each slot has its own KV cache (the
manifest's buffers of kind "cache"), its own position and its own bound decode program; weights,
activations and scratch are shared, so the slots' steps run one after another on the calling thread.
Only CPU artifacts have more than one slot for now.

Batch steps: `forward_batch(token_ids, slots)` advances several slots by one token each in one program, the
artifact's batch phase (`batched`: built with max_batch > 1, CPU only): row-wise calls run once over a row per
sequence (the weights read once for all), a sparse layer selects and reads the union of the sequences'
predicted neurons once, and the calls that touch a KV cache or read the position run once per sequence, on
that row and that slot's cache. Batches larger than the artifact's `max_batch` run in chunks; an artifact
without a batch phase (GPU calls, --max-batch < 2, or built before the batch phase existed)
runs `forward_batch` as one decode step per slot. (Where a batch step's GEMM and decode's GEMV read x differently,
as an int8 matrix's do on AVX2, where the GEMM rounds x to int8 blocks and the GEMV reads fp32, its logits differ
from decode's by that rounding.)

Long prompts: every row buffer (activations, input_ids, the logits) holds `prefill_rows` rows (the build makes it
min(max_context, 512)), so the memory of a step does not grow with the context; `forward` runs a prompt longer
than `prefill_chunk` (at most prefill_rows) as consecutive steps of that many tokens, each attending over the
cache the steps before wrote: the same logits as one step over the whole prompt.

Stages: an artifact split across machines (`build --nodes`) runs whole here, every stage in order, each hand-over
call a copy of the step's rows from the sending stage's buffer to the receiving stage's. `Engine(directory,
stage=k)` is one stage alone (runtime/ray_stages.py runs one per Ray actor): its calls, the buffers they use, its
caches, and only the weights its calls read, from its own weight file; `forward_stage` / `forward_stage_batch`
take token ids (stage 0) or the hidden rows the stage before returned, and return hidden rows or the logits.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .artifact import (ArtifactError, aligned_zeros, available_memory_bytes, check_hash, format_size, host_bytes,
                       load_manifest, missing_cpu_features, read_safetensors)
from .calls import PHASES, START, Call, Role, decode_weight_reads
from .manifest import Buffer
from .device import DeviceExecutor, _host, cuda_device, device_library
from .dtypes import get_dtype
from .threads import CpuReading, ThreadGovernor, free_cores_since, prepare_pool_environment, step_kind, thread_pool
from .verify import check_files

# the profile's entries that are not seconds: bytes, steps, and the weight bytes per call role (a dict)
COUNTERS = ("weight_bytes", "decode_steps", "weight_bytes_by_role", "batch_steps", "batch_tokens")


def _tvm_runtime():
    """TVM's runtime library and FFI only; the compiler library is not loaded by a fresh process."""
    # Read once, when tvm is first imported; restored after so that processes started later (a build)
    # do not inherit it and find TVM without its compiler.
    chosen_by_user = "TVM_USE_RUNTIME_LIB" in os.environ
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    prepare_pool_environment()
    try:
        import tvm.runtime
        import tvm_ffi
    finally:
        if not chosen_by_user:
            os.environ.pop("TVM_USE_RUNTIME_LIB")

    return tvm.runtime, tvm_ffi


@dataclass
class Step:
    """One bound call of a program."""

    name: str
    role: str  # the call's Role value: its class in the profile
    device: str
    run: object  # a callable taking the position
    waits: list[int] = field(default_factory=list)  # program indices on the other device to wait for
    weight_bytes: int = 0  # weight bytes the call reads whatever the input (a decode step's; 0 in prefill)
    sync_after: bool = False  # a GPU step the CPU waits for (or the last): the device finishes it before signalling
    count: object = None  # sparse calls: the [1, 1] count (array or device tensor) of selected neurons they read rows for
    bytes_per_count: int = 0  # ... and the weight bytes read per selected neuron
    hidden: object = None  # fused ReLU calls: the hidden values; rows past the first are read ...
    bytes_per_active: int = 0  # ... only for the neurons whose value is not 0, this many bytes each

    sequence: int | None = None  # a batch step's per-sequence call: the row (and slot) it runs for

    def bytes_read(self) -> int:
        """Weight bytes this call read; for a sparse call, read its count (and hidden) buffers right after it.
        In a batch step the count is the union's, and a neuron's rows past the first are read once if any
        sequence's hidden value is not 0."""
        if self.count is None:
            return self.weight_bytes
        count = int(_host(self.count)[0, 0])
        active = 0 if self.hidden is None else int(np.count_nonzero(np.any(_host(self.hidden)[:, :count], axis=0)))
        return self.weight_bytes + count * self.bytes_per_count + active * self.bytes_per_active


class Engine:
    def __init__(self, directory: str | Path, *, check_hashes: bool = True, emulate_gpu: bool = False,
                 slots: int = 1, threads: int | None = None, stage: int | None = None,
                 prefill_chunk: int | None = None):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        loading = CpuReading.now()  # what other programs take of the CPUs while this loads: the first steps' threads
        self.directory = Path(directory)
        # one stage of a split model reads (and hashes) only the weight files it needs, below
        self.manifest = load_manifest(self.directory, check_hashes=check_hashes, weights_later=stage is not None)
        target = self.manifest.target
        missing = missing_cpu_features(target.cpu_features or [])
        if missing:  # loading would work; the first kernel call would die of an illegal instruction
            raise ArtifactError(f"this artifact's CPU kernels were built for {target.cpu_isa} and need "
                                f"{', '.join(missing)}, which this CPU lacks; rebuild it with --cpu-isa avx2")
        # The manifest's claims against the verified files, before any buffer is sized from it: weight shapes
        # and types from the weight files' headers, the vocabulary from the embedding table, buffer shapes
        # from the kernels' signatures. Nothing is read but headers and JSON, and no library is loaded.
        checked = check_files(self.directory, self.manifest)
        facts, schedule, headers = checked.facts, checked.schedule, checked.headers
        self._calls = checked.calls
        self.stage, self.stage_input, self.stage_output = stage, None, "logits"
        if stage is not None:
            self._calls, self.stage_input, self.stage_output = _stage_calls(self._calls, self.manifest, stage)
            headers = _stage_weight_files(self.directory, self.manifest, headers, self._calls, check_hashes)
        self.devices = sorted({call.device for call in self._calls})
        if slots > 1 and "gpu" in self.devices:  # the device executor holds one set of GPU caches
            raise ArtifactError(f"this artifact runs calls on the GPU, whose executor holds one sequence: slots={slots} "
                                "is supported for CPU artifacts only (build with --target cpu, or use one slot)")
        # the buffers this engine allocates: the manifest's, or one stage's (its calls', its input and output)
        used = (set(self.manifest.buffers) if stage is None else
                _used_buffers(self._calls, self.manifest.buffers, self.stage_input, self.stage_output))
        needed, available = host_bytes(self.manifest, slots, used), available_memory_bytes()
        if available is not None and needed > available:  # refused now, rather than swapping or being killed
            raise ArtifactError(f"this artifact needs {format_size(needed)} of memory (its weights, KV cache"
                                f"{f' for each of {slots} slots' if slots > 1 else ''} and buffers) but only {format_size(available)} is available; free memory, or rebuild "
                                "it with --weight-dtype fp16 or a smaller --max-context")
        self.max_context = facts.max_context
        # the most tokens one step takes (the rows of every row buffer); `forward` prefills longer prompts in steps
        # of `prefill_chunk` tokens (default: all of them)
        self.prefill_rows = facts.prefill_rows
        self.prefill_chunk = min(prefill_chunk or facts.prefill_rows, facts.prefill_rows)
        self.vocab_size = facts.vocab_size  # the embedding table's rows (its weight file's), = model.vocab_size
        tvm_runtime, self._ffi = _tvm_runtime()
        # how many of the pool's workers each kind of step runs on: `threads`, else measured (runtime/threads.py)
        pool = thread_pool(self._ffi)
        self.governor = ThreadGovernor(pool, fixed=threads, start=lambda: free_cores_since(loading, pool.size))
        device = None
        if "gpu" in self.devices and not emulate_gpu:  # refused here, before anything is read, if no GPU fits
            device = cuda_device(target, tvm_runtime)
        library = tvm_runtime.load_module(str(self.directory / "kernels" / "cpu.so"))
        weights = {}
        for path, header in headers.items():
            weights.update(read_safetensors(path, header, used))
        buffers = self.manifest.buffers
        self._row_buffers = {n for n, info in buffers.items() if info.kind in ("activation", "input")}
        self._gpu_buffers, host_buffers = _buffer_homes(self._calls, buffers)
        # the host's buffers: numpy, used by the CPU calls and the host side of copies
        self.buffers: dict[str, np.ndarray] = {
            name: weights[name] if info.kind == "weight" else aligned_zeros(info.shape, get_dtype(info.dtype).numpy)
            for name, info in buffers.items() if name in host_buffers and name in used}
        # each slot's view of the host buffers: slot 0's are self.buffers; later slots get their own caches
        self._slot_buffers = [self.buffers] + [
            {**self.buffers, **{name: aligned_zeros(info.shape, get_dtype(info.dtype).numpy)
                                for name, info in buffers.items()
                                if info.kind == "cache" and name in host_buffers and name in used}}
            for _ in range(slots - 1)]
        # the GPU's: tensors on its device (tvm.cuda(0), or tvm.cpu(0) when emulating)
        self.gpu: DeviceExecutor | None = None
        if "gpu" in self.devices:
            gpu_library = library if device is None else device_library(self.directory, target, tvm_runtime)
            self.gpu = DeviceExecutor(tvm_runtime, tvm_runtime.cpu(0) if device is None else device, gpu_library,
                                      {name: buffers[name] for name in self._gpu_buffers}, weights, self._row_buffers)
        del weights  # weights only the GPU reads now live on its device alone
        self._edges = schedule.get("edges", [])
        try:
            self._kernels = {name: library[name] for call in self._calls
                             if call.device == "cpu" and not call.runtime_own
                             for name in (call.decode, call.prefill, call.batch) if name}
        except Exception as error:
            raise ArtifactError(f"kernel library does not provide a scheduled kernel: {error}") from None
        for kernel in self._kernels.values():
            kernel.release_gil = True  # the two executors overlap only if calls release the GIL
        self.slots = slots
        # sequences one batch step holds (0: the artifact has no batch phase; absent from older artifacts)
        self.max_batch = int(self.manifest.model.max_batch) if self.gpu is None else 0
        self._batches: dict[tuple[int, ...], list[Step]] = {}  # bound batch programs, by their slots
        self._decodes = [self._program("decode", rows=1, slot=slot) for slot in range(slots)]
        self._decode = self._decodes[0]
        self.positions = [0] * slots  # per slot: the tokens its cache holds
        # per slot: the ids of those tokens (an engine of token ids: the whole model or a first stage), so that a
        # prompt that starts with them runs from where they end (`resume`); -1 where a position was set by hand
        self._held: list[list[int]] = [[] for _ in range(slots)]
        # token ids index these tables: forward checks them against the rows the loaded arrays really have
        self._token_rows = min(self.buffers[table].shape[0] if table in self.buffers else facts.vocab_size
                               for table in facts.token_tables)
        # Set to {} to profile: seconds per call role, "wall" and "overhead", and for decode (one-token)
        # steps "weight_bytes" (weight bytes the calls read), "weight_bytes_by_role" (the same per call role) and
        # "decode_steps".
        self.profile: dict[str, float] | None = None

    # ---------------------------------------------------------------- binding

    def _view(self, name: str, rows: int, slot: int = 0, first: int = 0):
        """The buffer as a call of a step of `rows` rows sees it (slot's caches; row buffers from row `first`)."""
        array = self._slot_buffers[slot][name]
        return array[first:first + rows] if name in self._row_buffers else array

    @property
    def batched(self) -> bool:
        """Whether `forward_batch` runs batch steps (else one decode step per slot)."""
        return self.max_batch > 1 and self.slots > 1

    @property
    def calls(self) -> list[Call]:
        """The schedule's calls in execution order, with their facts."""
        return self._calls

    @property
    def decode_steps(self) -> list[Step]:
        """The bound one-token program: a step's `bytes_read()` reads its selection's buffers after it ran."""
        return self._decode

    def read_buffer(self, name: str, device: str) -> np.ndarray:
        """A buffer's contents as `device`'s calls last left them, as a host array (a copy for the GPU's); for a
        cache, slot 0's."""
        return _host(self._buffer(name, device))

    def _buffer(self, name: str, device: str):
        """A buffer as the calls of `device` see it: a host array, or a device tensor."""
        return self.gpu.tensors[name] if device == "gpu" else self.buffers[name]

    def _bind(self, call: Call, phase: str, rows: int, slot: int = 0, first: int = 0):
        args = [arg.buffer for arg in call.args]
        if call.role is Role.HANDOVER:  # one process runs every stage: the hand-over is a copy of the step's rows
            source, target = call.transfer
            source_rows, target_rows = self._view(source, rows, slot, first), self._view(target, rows, slot, first)
            return lambda position: np.copyto(target_rows, source_rows)
        if call.role is Role.COPY:  # one argument read on one side, one written on the other
            if call.device != "gpu":
                raise ArtifactError(f"copy {call.id} is scheduled on the CPU; copies belong to the GPU's executor")
            source, target = call.transfer
            to_device = target in self._gpu_buffers
            host, device_side = (source, target) if to_device else (target, source)
            return self.gpu.bind_copy(self._view(host, rows), device_side, rows, to_device)
        kernel_name = call.kernel(phase)
        if call.device == "gpu":
            bound = [None if name == START else self.gpu.view(name, rows) for name in args]
            return self.gpu.bind_call(kernel_name, bound, args.index(START) if START in args else None)
        function = self._kernels[kernel_name]
        bound = [0 if name == START else self._ffi.from_dlpack(self._view(name, rows, slot, first)) for name in args]
        if START not in args:
            return lambda position: function(*bound)
        index = args.index(START)

        def run(position):
            bound[index] = position
            function(*bound)

        return run

    def _weight_reads(self, call: Call, rows: int = 1) -> dict:
        """The weight bytes a decode call (or a batch step's, of `rows` sequences) reads, from its facts: fixed
        bytes, plus per selected entry (read from its selection's count buffer after the call) and per selected
        entry whose hidden value is not 0 (in any of the rows)."""
        reads = decode_weight_reads(call, self.manifest.buffers, rows)
        if call.selection is None:
            return {"weight_bytes": reads.fixed}
        selection = call.selection
        facts = {"weight_bytes": reads.fixed, "count": self._buffer(selection.count, call.device),
                 "bytes_per_count": reads.per_selected}
        if selection.hidden is not None:
            hidden = self._buffer(selection.hidden, call.device)
            facts.update(hidden=hidden if call.device == "gpu" else hidden[:rows], bytes_per_active=reads.per_nonzero)
        else:
            facts["bytes_per_count"] += reads.per_nonzero
        return facts

    def _program(self, phase: str, rows: int, slot: int = 0, last_only: bool = False) -> list[Step]:
        """The bound program of `phase` for a step of `rows` rows; `last_only`: the output layer on the last row
        alone (`_bind_last`), the other rows' logits left unwritten."""
        calls = [call for call in self._calls if call.kernel(phase)]
        index = {call.id: i for i, call in enumerate(calls)}
        steps = [Step(call.id, call.role.value, call.device,
                      self._bind_last(call, rows, slot) if last_only and _last_row_call(call)
                      else self._bind(call, phase, rows, slot),
                      **(self._weight_reads(call) if phase == "decode" else {})) for call in calls]
        self._order(steps, calls, index, phase)
        return steps

    def _bind_last(self, call: Call, rows: int, slot: int):
        """`call` bound to the step's last row alone: its one-row (decode) kernel where it is dense, else its
        prefill kernel on one row (a sparse decode kernel reads selections a prefill does not make)."""
        phase = "decode" if call.decode and call.selection is None else "prefill"
        return self._bind(call, phase, 1, slot, first=rows - 1)

    def _batch_program(self, slots: tuple[int, ...]) -> list[Step]:
        """The bound batch step of `slots` (row b is slots[b]'s token): a call run per sequence is a step per
        row, over that row's views, that slot's caches and (`Step.sequence`) that slot's position."""
        program = self._batches.get(slots)
        if program is not None:
            return program
        rows, steps = len(slots), []
        for call in (call for call in self._calls if call.batch):
            if call.per_sequence:
                for row, slot in enumerate(slots):
                    steps.append(Step(call.id, call.role.value, call.device,
                                      self._bind(call, "batch", 1, slot, first=row), sequence=row,
                                      **self._weight_reads(call)))
            else:
                steps.append(Step(call.id, call.role.value, call.device, self._bind(call, "batch", rows),
                                  **self._weight_reads(call, rows)))
        if len(self._batches) >= 64:  # (bounded: a program per subset of the slots, in slot order)
            self._batches.pop(next(iter(self._batches)))
        self._batches[slots] = steps
        return steps

    def batch_steps(self, slots) -> list[Step]:
        """The bound batch program of `slots` (see `decode_steps`); run it with `forward_batch`."""
        return self._batch_program(tuple(self._slot(slot) for slot in slots))

    def _order(self, steps: list[Step], calls: list[Call], index: dict[str, int], phase: str) -> None:
        """The waits and syncs between devices on the DAG's edges of `phase`."""
        for edge in self._edges:
            source, target = index.get(edge["source"]), index.get(edge["target"])
            if (source is not None and target is not None and phase in edge.get("phases", PHASES)
                    and steps[source].device != steps[target].device):
                steps[target].waits.append(source)
                steps[source].sync_after = True  # the device finishes its work before the other side goes on
        for step, call in zip(steps, calls):  # a copy to the host is complete when it is signalled, whoever reads it
            if call.role is Role.COPY and not any(arg.writes and arg.buffer in self._gpu_buffers for arg in call.args):
                step.sync_after = True
        last_gpu = max((i for i, step in enumerate(steps) if step.device == "gpu"), default=None)
        if last_gpu is not None:  # the program ends with the device idle (and its errors raised)
            steps[last_gpu].sync_after = True

    # ---------------------------------------------------------------- running

    @property
    def position(self) -> int:
        """Slot 0's position: the tokens its cache holds."""
        return self.positions[0]

    @position.setter
    def position(self, value: int) -> None:
        self.positions[0] = value
        self._hold(0, value, [])

    def _slot(self, slot) -> int:
        """`slot` as an index of this engine's slots (any integer type), else a ValueError."""
        index = slot if isinstance(slot, (int, np.integer)) and not isinstance(slot, bool) else None
        if index is None or not 0 <= index < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}); got {slot!r}")
        return int(index)

    def hold_caches(self) -> int:
        """Make every slot's host KV cache resident: they come from fresh mappings, whose pages cost memory only
        once written (`aligned_zeros`), so each page is written once here, with the value it holds (what the
        caches hold is unchanged). A server holds them so: its caches take what they will at every slot's full
        context from its start, and a machine that cannot hold them fails then, not mid-conversation. Returns
        their bytes."""
        held = 0
        for buffers in self._slot_buffers:
            for name, info in self.manifest.buffers.items():
                if info.kind == "cache" and name in buffers:
                    flat = buffers[name].reshape(-1)
                    step = max(1, mmap.PAGESIZE // flat.itemsize)
                    flat[::step] = flat[::step]
                    held += flat.nbytes
        return held

    def reset(self, slot: int = 0) -> None:
        """Forget a slot's context (cache entries past its position are never read, so no clearing is needed)."""
        slot = self._slot(slot)
        self.positions[slot] = 0
        self._held[slot].clear()

    def prefix_length(self, prompt_ids, slot: int = 0) -> int:
        """How many of `prompt_ids`' first tokens `slot`'s cache holds already (the prompt's last token not
        counted: its logits are what a prefill is for)."""
        held, prompt = self._held[self._slot(slot)], [int(i) for i in prompt_ids]
        length = 0
        for have, want in zip(held, prompt[:-1]):
            if have != want:
                break
            length += 1
        return length

    def resume(self, prompt_ids, slot: int = 0) -> int:
        """Make `slot` ready for `prompt_ids`: keep the prefix of them its cache holds (`prefix_length`), forget the
        rest; returns how many tokens were kept, so that `forward(prompt_ids[kept:], slot)` gives the logits a
        prefill of the whole prompt from an empty cache gives (the kept keys and values are those tokens' at the
        same positions)."""
        slot = self._slot(slot)
        kept = self.prefix_length(prompt_ids, slot)
        self.positions[slot] = kept
        del self._held[slot][kept:]
        return kept

    def _hold(self, slot: int, position: int, ids) -> None:
        """Record that `slot`'s cache holds `ids` from `position` on (and nothing after them)."""
        held = self._held[slot]
        del held[position:]
        held.extend([-1] * (position - len(held)))  # (a position set by hand: tokens unknown, never matched)
        if self.stage_input is None:
            held.extend(int(i) for i in ids)
        else:  # hidden rows in: no ids to match a prompt against
            held.extend([-1] * len(ids))

    def _check_token_ids(self, ids: np.ndarray) -> None:
        """Token ids index the embedding tables: checked against the rows the loaded arrays really have, never
        a manifest claim."""
        if ids.min() < 0 or ids.max() >= self._token_rows:
            raise ValueError(f"token ids must be in [0, {self._token_rows}); got {ids.min()}..{ids.max()}")

    def _inputs(self, inputs) -> np.ndarray:
        """A step's inputs as the stage takes them: token ids (the first stage, or a whole model) or hidden rows
        [rows, width] (a later stage of a split model: what the stage before sent), checked."""
        if self.stage_input is None:
            ids = np.asarray(inputs, dtype=np.int64).reshape(-1)
            if ids.size:
                self._check_token_ids(ids)
            return ids
        width = self.manifest.buffers[self.stage_input].shape[1]
        hidden = np.asarray(inputs, dtype=np.float32)
        if hidden.ndim != 2 or hidden.shape[1] != width:
            raise ValueError(f"stage {self.stage} takes hidden rows [rows, {width}]; got shape {list(hidden.shape)}")
        return hidden

    def _write_inputs(self, inputs: np.ndarray) -> None:
        self.buffers["input_ids" if self.stage_input is None else self.stage_input][:len(inputs)] = inputs

    def forward(self, token_ids, slot: int = 0, last_only: bool = False, as_prompt: bool = False) -> np.ndarray:
        """Run the model on new tokens after the ones cached in `slot`; returns their logits [len, vocab], or with
        `last_only` the last token's alone [1, vocab] (what generation needs: a prompt's output layer then runs
        on its last row only, as llama.cpp's does). `as_prompt`: the prefill's kernels even for one token (the
        rest of a resumed prompt then gives the logits a whole prompt's prefill gives, not decode's sparse ones)."""
        if self.stage_input is not None or self.stage_output != "logits":
            raise ValueError(f"this engine runs stage {self.stage} of a split model only: use forward_stage")
        return self.forward_stage(token_ids, slot, last_only, as_prompt)

    def forward_stage(self, inputs, slot: int = 0, last_only: bool = False, as_prompt: bool = False) -> np.ndarray:
        """One stage of a split model (`Engine(directory, stage=k)`) on new rows after those cached in `slot`:
        token ids (stage 0) or the hidden rows the stage before returned; returns the hidden rows to send to the
        next stage [len, width], or the last stage's logits [len, vocab]. An engine of the whole model: forward.
        `last_only`: the last row's alone [1, ...] (the CPU's output layer then runs on that row alone)."""
        slot = self._slot(slot)
        inputs = self._inputs(inputs)
        rows = len(inputs)
        if rows == 0:
            raise ValueError("forward needs at least one token")
        position = self.positions[slot]
        if position + rows > self.max_context:
            raise ValueError(f"context full: {position} cached + {rows} new > max context {self.max_context}")
        if rows <= self.prefill_chunk:
            return self._step(inputs, slot, last_only, prefill=rows > 1 or as_prompt)
        # a long prompt: steps of at most prefill_chunk tokens (as even as can be), each attending over the cache
        # the ones before wrote; every step a prefill (a last step of one token too: not decode's sparse kernels)
        steps = -(-rows // self.prefill_chunk)
        bounds = [rows * k // steps for k in range(steps + 1)]
        outputs = []
        for k in range(steps):
            last = k == steps - 1
            out = self._step(inputs[bounds[k]:bounds[k + 1]], slot, last_only, prefill=True)
            if last or not last_only:  # (`last_only`: the earlier steps' last rows are not asked for)
                outputs.append(out)
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    def _step(self, inputs: np.ndarray, slot: int, last_only: bool, prefill: bool) -> np.ndarray:
        """One step over `inputs` (at most prefill_rows of them) after the rows cached in `slot`: the prefill
        program, or (one row, not `prefill`) the bound decode program."""
        rows, position = len(inputs), self.positions[slot]
        self._write_inputs(inputs)
        program = self._program("prefill", rows, slot, last_only) if prefill else self._decodes[slot]
        kind = step_kind("prefill" if prefill else "decode", rows)
        threads = self.governor.threads_for(kind)
        began = time.perf_counter()
        if self.gpu is None:
            self._run_serial(program, position)
        else:
            self.gpu.run(program, position, self._timer())
        self.governor.record(kind, threads, time.perf_counter() - began)
        if self.profile is not None:
            self._profile_wall(began)
            if not prefill:
                self.profile["decode_steps"] = self.profile.get("decode_steps", 0) + 1
        self.positions[slot] = position + rows
        self._hold(slot, position, inputs)
        return self.buffers[self.stage_output][rows - 1 if last_only else 0:rows].copy()

    def forward_batch(self, token_ids, slots) -> np.ndarray:
        """One new token for each of `slots` (distinct), after the tokens each has cached: their logits
        [len(slots), vocab], row b slots[b]'s. Each slot's position advances by one. Batch steps of up to
        `max_batch` sequences where the artifact has them (`batched`), else one decode step per slot."""
        if self.stage_input is not None or self.stage_output != "logits":
            raise ValueError(f"this engine runs stage {self.stage} of a split model only: use forward_stage_batch")
        return self.forward_stage_batch(token_ids, slots)

    def forward_stage_batch(self, inputs, slots) -> np.ndarray:
        """`forward_batch` of one stage of a split model: a token id (stage 0) or a hidden row (later stages) per
        slot; returns a hidden row per slot to send on, or the last stage's logits."""
        ids = self._inputs(inputs)
        slots = [self._slot(slot) for slot in slots]
        if len(ids) != len(slots):
            raise ValueError(f"forward_batch takes one token id per slot: {len(ids)} ids for {len(slots)} slots")
        if not slots:
            raise ValueError("forward_batch needs at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"forward_batch's slots must be distinct; got {slots}")
        full = [slot for slot in slots if self.positions[slot] + 1 > self.max_context]
        if full:
            raise ValueError(f"context full: slot {full[0]} holds {self.positions[full[0]]} tokens, the max context "
                             f"{self.max_context}")
        if not self.batched or len(slots) == 1:
            return np.concatenate([self.forward_stage(ids[i:i + 1], slot) for i, slot in enumerate(slots)])
        order = np.argsort(slots, kind="stable")
        if (order != np.arange(len(slots))).any():  # one bound program per set of slots, not one per order of them
            rows = self.forward_stage_batch(ids[order], [slots[i] for i in order])
            unordered = np.empty_like(rows)
            unordered[order] = rows
            return unordered
        chunks = [self._forward_chunk(ids[i:i + self.max_batch], tuple(slots[i:i + self.max_batch]))
                  for i in range(0, len(slots), self.max_batch)]
        return np.concatenate(chunks)

    def _forward_chunk(self, ids: np.ndarray, slots: tuple[int, ...]) -> np.ndarray:
        rows = len(slots)
        if rows == 1:
            return self.forward_stage(ids, slots[0])
        program = self._batch_program(slots)
        self._write_inputs(ids)
        kind = step_kind("batch", rows)
        threads = self.governor.threads_for(kind)
        began = time.perf_counter()
        self._run_serial(program, [self.positions[slot] for slot in slots])
        self.governor.record(kind, threads, time.perf_counter() - began)
        if self.profile is not None:
            self._profile_wall(began)
            self.profile["batch_steps"] = self.profile.get("batch_steps", 0) + 1
            self.profile["batch_tokens"] = self.profile.get("batch_tokens", 0) + rows
        for slot, token in zip(slots, ids):
            self._hold(slot, self.positions[slot], [token])
            self.positions[slot] += 1
        return self.buffers[self.stage_output][:rows].copy()

    def _profile_wall(self, began: float) -> None:
        """Wall time not spent inside a kernel or copy: the runtime's own cost."""
        kernels = sum(seconds for role, seconds in self.profile.items() if role not in ("overhead", "wall", *COUNTERS))
        self.profile["wall"] = self.profile.get("wall", 0.0) + time.perf_counter() - began
        self.profile["overhead"] = max(self.profile["wall"] - kernels, 0.0)

    def _timer(self):
        if self.profile is None:
            return None
        profile, lock = self.profile, threading.Lock()

        def record(role: str, seconds: float, weight_bytes: int) -> None:
            with lock:
                profile[role] = profile.get(role, 0.0) + seconds
                profile["weight_bytes"] = profile.get("weight_bytes", 0) + weight_bytes
                by_role = profile.setdefault("weight_bytes_by_role", {})
                by_role[role] = by_role.get(role, 0) + weight_bytes

        return record

    def _run_serial(self, program: list[Step], position: int | list[int]) -> None:
        """Run a program at `position` (a batch step: each sequence's, read by its per-sequence steps)."""
        if self.profile is None:
            for step in program:
                step.run(position if step.sequence is None else position[step.sequence])
            return
        record, clock = self._timer(), time.perf_counter
        for step in program:
            began = clock()
            step.run(position if step.sequence is None else position[step.sequence])
            record(step.role, clock() - began, step.bytes_read())


def _last_row_call(call: Call) -> bool:
    """A call a prefill that returns only its last row's logits runs on that row alone: the output layer's (a
    row of its output depends on that row of its input alone), on the CPU."""
    return call.role is Role.HEAD and call.device == "cpu" and not call.runtime_own


def _stage_calls(calls: list[Call], manifest, stage: int) -> tuple[list[Call], str | None, str]:
    """Stage `stage`'s calls of a split model, the buffer its hand-over in writes (None for the first stage: it
    takes token ids) and the buffer it sends on (the logits for the last)."""
    count = len(manifest.stages)
    if not count:
        raise ArtifactError(f"stage {stage} was asked of an artifact that is not split across machines (built "
                            "without --nodes): load it whole")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < count:
        raise ValueError(f"stage must be in [0, {count}) (the artifact's stages); got {stage!r}")
    handovers = {call.stage: call for call in calls if call.role is Role.HANDOVER}
    if sorted(handovers) != list(range(count - 1)):
        raise ArtifactError(f"schedule.json is damaged: its hand-overs leave stages {sorted(handovers)} of "
                            f"{count}; rebuild the artifact")

    incoming = None if stage == 0 else handovers[stage - 1].transfer[1]
    outgoing = "logits" if stage == count - 1 else handovers[stage].transfer[0]
    return [call for call in calls if call.stage == stage and call.role is not Role.HANDOVER], incoming, outgoing


def _used_buffers(calls: list[Call], buffers: dict[str, Buffer], *extra: str | None) -> set[str]:
    """The buffers `calls` pass or count with, input_ids and logits, and `extra` (a stage's in and out)."""
    used = {"input_ids", "logits", *(name for name in extra if name)}
    for call in calls:
        used.update(call.buffers())
        if call.selection is not None:
            used.update(name for name in (call.selection.count, call.selection.hidden) if name)
    return used & set(buffers)


def _stage_weight_files(directory: Path, manifest, headers: dict, calls: list[Call], check_hashes: bool) -> dict:
    """The weight files one stage reads (each weight from the file holding the most of the stage's weights: its
    own stage's file, never another stage's), each checked against its sha256 first; {path: header}."""
    needed = _used_buffers(calls, manifest.buffers) - {"input_ids", "logits"}
    chosen: dict = {}
    for path, header in sorted(headers.items(), key=lambda item: -len(needed & set(item[1]))):
        if needed & set(header):
            chosen[path] = header
            needed -= set(header)
    for path in chosen:
        relative = str(path.relative_to(directory))
        if check_hashes:
            check_hash(directory, relative, manifest.files[relative])
    return chosen


def _buffer_homes(calls: list[Call], buffers: dict[str, Buffer]) -> tuple[set[str], set[str]]:
    """(the GPU's buffers, the host's): a GPU call's arguments live on the GPU; a copy's are one on each side
    (each instance's manifest entry names its device); everything else, input_ids and logits included,
    lives on the host. A weight read on both sides has a copy on each; any other buffer on both sides would
    be a race, so it is refused."""
    gpu, cpu = set(), {"input_ids", "logits"}
    for call in calls:
        names = [name for name in call.buffers() if name in buffers]
        if call.role is Role.COPY:
            for name in names:
                (gpu if buffers[name].device == "gpu" else cpu).add(name)
        else:
            (gpu if call.device == "gpu" else cpu).update(names)
    shared = {name for name in gpu & cpu if buffers[name].kind != "weight"}
    if shared:
        raise ArtifactError(f"buffers used on both devices without a copy: {', '.join(sorted(shared))}")
    return gpu, (set(buffers) - gpu) | cpu
