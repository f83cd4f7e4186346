"""The hybrid executor on a CPU-only machine (`--emulate-gpu`): the CPU and GPU programs run on two
threads that genuinely overlap, never deadlock, and give the same logits whatever the timing."""

from __future__ import annotations

import random
import threading
import time

import networkx as nx
import numpy as np
import pytest

from runtime import Engine
from runtime.calls import Role
from test_sparse import hybrid_build

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def hybrid(tiny_models, tmp_path_factory):
    """Hot rows on the emulated GPU, cold rows on the CPU, in the same layers (test_sparse's build)."""
    return hybrid_build(tiny_models("opt", sparsity=0.9), tmp_path_factory)


def decode_run(engine: Engine, steps: int = 6) -> list[np.ndarray]:
    engine.reset()
    outputs = [engine.forward(PROMPT)]
    for _ in range(steps):
        outputs.append(engine.forward([int(np.argmax(outputs[-1][-1]))]))
    return outputs


def wrap_steps(engine: Engine, wrapper) -> None:
    """Route every call of every program (decode's, and each prefill's as it is made) through wrapper(step, run)."""
    def wrap(steps):
        for step in steps:
            step.run = wrapper(step, step.run)
        return steps

    wrap(engine._decode)
    make_program = engine._program
    engine._program = lambda phase, rows, slot=0, last_only=False: wrap(make_program(phase, rows, slot, last_only))


def independent_pair(steps) -> tuple[int, int]:
    """A CPU call and a GPU call of a program with no dependency path between them (each device runs its
    calls in order; `waits` are the edges that cross devices)."""
    dag = nx.DiGraph()
    last: dict[str, int] = {}
    for index, step in enumerate(steps):
        dag.add_node(index)
        if step.device in last:
            dag.add_edge(last[step.device], index)
        last[step.device] = index
        dag.add_edges_from((wait, index) for wait in step.waits)
    closure = nx.transitive_closure_dag(dag)
    for i, cpu_step in enumerate(steps):
        for j, gpu_step in enumerate(steps):
            if (cpu_step.device, gpu_step.device) == ("cpu", "gpu") and not closure.has_edge(i, j) \
                    and not closure.has_edge(j, i):
                return i, j
    raise AssertionError("the hybrid schedule has no CPU call that could run beside a GPU call")


def test_cpu_and_gpu_programs_overlap(hybrid):
    """Two calls that the DAG lets run at once must meet at a barrier: if the executors took turns, the
    barrier would time out and the step would fail."""
    engine = Engine(hybrid, emulate_gpu=True)
    engine.forward(PROMPT)
    cpu_index, gpu_index = independent_pair(engine._decode)
    barrier = threading.Barrier(2, timeout=20)
    met: list[str] = []

    def meet(step, run):
        def at_barrier(position):
            barrier.wait()
            met.append(threading.current_thread().name)
            run(position)
        return at_barrier

    for index in (cpu_index, gpu_index):
        engine._decode[index].run = meet(engine._decode[index], engine._decode[index].run)
    engine.forward([3])
    assert len(met) == 2 and len(set(met)) == 2, met  # both calls were in flight at once, on two threads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_results_do_not_depend_on_timing(hybrid, seed):
    """Random delays before and after every call reorder the two executors' progress; a missing wait
    (a race on a copied or merged buffer) would change the logits. They stay bitwise equal."""
    expected = decode_run(Engine(hybrid, emulate_gpu=True))
    engine = Engine(hybrid, emulate_gpu=True)
    rng = random.Random(seed)
    lock = threading.Lock()

    def jitter(step, run):
        def delayed(position):
            with lock:
                before, after = rng.random() * 3e-4, rng.random() * 3e-4
            time.sleep(before)
            run(position)
            time.sleep(after)
        return delayed

    wrap_steps(engine, jitter)
    for got, want in zip(decode_run(engine), expected):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- the device executor

def cuda_gpu_present() -> bool:
    """Whether this process can use a CUDA GPU through TVM (loads libtvm_runtime_cuda where the driver is)."""
    import tvm.runtime

    from runtime.device import load_cuda_runtime

    try:
        load_cuda_runtime()
    except (OSError, RuntimeError):
        return False
    return tvm.runtime.cuda(0).exist


def gpu_kernel_buffers(engine: Engine) -> set[str]:
    return {name for call in engine._calls if call.device == "gpu" and call.role is not Role.COPY
            for name in call.buffers() if name in engine.manifest.buffers}


def test_emulated_gpu_buffers_are_device_tensors_and_weights_upload_once(hybrid):
    """--emulate-gpu runs the GPU executor itself on tvm.cpu(0): every buffer a GPU call reads is a TVM tensor
    on its device, sharing no memory with the host's numpy buffers; the weights go up once, at load, and a
    decode step moves only the activation rows its copies name."""
    import tvm.runtime

    from runtime.device import DeviceExecutor

    engine = Engine(hybrid, emulate_gpu=True)
    executor = engine.gpu
    assert isinstance(executor, DeviceExecutor) and executor.device == tvm.runtime.cpu(0)
    buffers = engine.manifest.buffers
    on_gpu = gpu_kernel_buffers(engine)
    assert any(buffers[name].kind == "cache" for name in on_gpu)  # the GPU layers' KV cache lives there
    host_arrays = list(engine.buffers.values())
    for name in on_gpu:
        tensor = executor.tensors[name]
        assert isinstance(tensor, tvm.runtime.Tensor) and tensor.device == executor.device, name
        assert list(tensor.shape) == buffers[name].shape, name
        assert not any(np.shares_memory(np.from_dlpack(tensor), array) for array in host_arrays), name
    cpu_reads = {name for call in engine._calls if call.device == "cpu" for name in call.buffers()}
    gpu_weights = {name for name in on_gpu if buffers[name].kind == "weight"}
    assert gpu_weights - cpu_reads and not (gpu_weights - cpu_reads) & set(engine.buffers)  # not kept on the host
    assert executor.uploads == len(gpu_weights)
    weight_bytes = sum(int(np.prod(buffers[n].shape)) * np.dtype(buffers[n].dtype).itemsize for n in gpu_weights)
    assert executor.uploaded_bytes == weight_bytes
    engine.forward(PROMPT)
    before = dict(executor.copied_bytes)
    steps = 4
    for token in range(steps):
        engine.forward([token + 1])
    assert executor.uploads == len(gpu_weights)  # no weight went up again
    # per decode step: one row of each buffer a decode copy moves, each way
    row = lambda name: int(np.prod(buffers[name].shape[1:])) * np.dtype(buffers[name].dtype).itemsize  # noqa: E731
    expected = {"to_device": 0, "to_host": 0}
    for call in engine._calls:
        if call.role is Role.COPY and call.decode:
            source, target = call.buffers()
            expected["to_device" if target in executor.tensors else "to_host"] += row(source)
    assert expected["to_device"] > 0 and expected["to_host"] > 0
    for direction in expected:
        assert executor.copied_bytes[direction] - before[direction] == steps * expected[direction], direction


def test_emulated_gpu_profile_reads_device_counts(hybrid):
    """Profiling synchronises the device after each of its calls and reads the sparse calls' neuron counts
    back from device tensors; the tokens are the same as without profiling."""
    from runtime import generate

    plain = generate(Engine(hybrid, emulate_gpu=True), PROMPT, 6)
    profiled = generate(Engine(hybrid, emulate_gpu=True), PROMPT, 6, profile=True)
    assert profiled["generated_ids"] == plain["generated_ids"]
    classes = profiled["profile_ms_per_token"]
    assert classes["copy"] > 0 and classes["ffn_up"] > 0 and profiled["weight_bytes_per_token"] > 0


def test_emulated_gpu_runs_without_the_compiler_stack(hybrid):
    """The device executor is part of the thin runtime: an emulated hybrid run in a process where torch, onnx,
    the compiler and the rest cannot be imported, and without libtvm_compiler."""
    from test_runtime_thin import run_without_compiler_stack

    out = run_without_compiler_stack(
        f"from runtime import Engine\nimport numpy as np\nengine = Engine({str(hybrid)!r}, emulate_gpu=True)\n"
        f"print(int(np.argmax(engine.forward({PROMPT})[-1])), type(engine.gpu).__name__)\n"
        "print('compiler' if 'libtvm_compiler' in open('/proc/self/maps').read() else 'no compiler')")
    expected = int(np.argmax(Engine(hybrid, emulate_gpu=True).forward(PROMPT)[-1]))
    assert out.split() == [str(expected), "DeviceExecutor", "no", "compiler"]


def test_engines_can_be_dropped_while_the_process_goes_on(hybrid):
    """An emulated GPU runs the CPU versions of its kernels, some with TVM's parallel loops, on the device thread.
    A thread that ran those must never end while the process lives (TVM tears its per-thread worker pool down with
    joinable threads and the process aborts: `picompile run` did, dropping its engine before exit), so every
    engine shares one device thread that outlives them; a dropped engine's successor works as it did."""
    import gc

    def device_threads():
        return [t for t in threading.enumerate() if t.name == "picompile-gpu-executor"]

    first = Engine(hybrid, emulate_gpu=True)
    expected = int(np.argmax(first.forward(PROMPT)[-1]))
    second = Engine(hybrid, emulate_gpu=True)
    assert len(device_threads()) == 1
    del first
    gc.collect()
    assert int(np.argmax(second.forward(PROMPT)[-1])) == expected
    del second
    gc.collect()
    time.sleep(0.05)
    assert [t.is_alive() for t in device_threads()] == [True]


def test_gpu_artifact_is_refused_without_a_gpu(hybrid, capsys):
    if cuda_gpu_present():
        pytest.skip("this machine has a CUDA GPU; the refusal is for machines without one")
    from picompile.cli import main

    assert main(["run", str(hybrid), "--prompt-ids", "1,2", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "rtx4090" in err[0] and "--emulate-gpu" in err[0] and "--target cpu" in err[0], err


def test_gpu_arch_check_refuses_only_older_gpus():
    """The artifact ships SASS for its arch plus PTX, so a newer GPU JIT-compiles the PTX; an older one cannot."""
    from runtime.device import arch_problem

    assert arch_problem("sm_89", "8.9", "RTX 4090") is None
    assert arch_problem("sm_89", "9.0", "H200") is None  # through the PTX
    assert arch_problem("sm_75", "12.0", "RTX 5090") is None
    problem = arch_problem("sm_89", "8.6", "RTX 3090")
    assert problem and "sm_89" in problem and "RTX 3090" in problem and "8.6" in problem
    assert arch_problem("sm_80", "7.5", "RTX 2080 Ti") is not None


def test_hybrid_on_the_real_gpu_matches_emulation(hybrid):
    """On a machine with a CUDA GPU: the same artifact without --emulate-gpu runs its GPU part on tvm.cuda(0)
    with the nvcc-built kernels, and the logits track the emulated run (different kernels: not bitwise)."""
    if not cuda_gpu_present():
        pytest.skip("no CUDA GPU (TVM's CUDA runtime or tvm.cuda(0) unavailable); scripts/gpu_check.sh runs this on one")
    import tvm.runtime

    from runtime import ArtifactError
    from runtime.device import arch_problem

    device = tvm.runtime.cuda(0)
    if arch_problem("sm_89", device.compute_version, device.device_name):
        with pytest.raises(ArtifactError, match="sm_89"):
            Engine(hybrid)
        return
    engine = Engine(hybrid)
    assert engine.gpu.device == device
    assert all(engine.gpu.tensors[name].device == device for name in gpu_kernel_buffers(engine))
    for got, want in zip(decode_run(engine), decode_run(Engine(hybrid, emulate_gpu=True))):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_device_work_is_synchronised_before_the_cpu_reads_it(hybrid):
    """GPU kernel launches are asynchronous on a real GPU, so the executor must synchronise the device after a
    step the CPU waits for (and after every copy to the host) before signalling it. Recorded here: when a CPU
    call starts, a sync has followed every GPU step it waits for; when a program ends, the device is idle."""
    engine = Engine(hybrid, emulate_gpu=True)
    log: list[tuple] = []
    lock = threading.Lock()
    problems: list[str] = []
    device_sync = engine.gpu.sync

    def sync():
        device_sync()
        with lock:
            log.append(("sync",))

    def check(step, run):
        index = next(i for i, s in enumerate(program[0]) if s is step)

        def checked(position):
            if step.device == "gpu":
                run(position)
                with lock:
                    log.append(("run", index))
                return
            with lock:
                for wait in step.waits:
                    ran = max(i for i, entry in enumerate(log) if entry == ("run", wait))
                    if ("sync",) not in log[ran + 1:]:
                        problems.append(f"{step.name} started before {program[0][wait].name} was synchronised")
            run(position)
        return checked

    engine.gpu.sync = sync
    program = [None]
    make_program = engine._program

    def wrapped(phase, rows, slot=0, last_only=False):
        program[0] = make_program(phase, rows, slot, last_only)
        for step in program[0]:
            step.run = check(step, step.run)
        return program[0]

    engine._program = wrapped
    engine._decodes[0] = engine._decode = wrapped("decode", 1)  # slot 0's decode program, as forward runs it
    decode = program[0]
    for tokens in (PROMPT, [3], [4]):
        if len(tokens) == 1:
            program[0] = decode
        log.clear()
        engine.forward(tokens)
        assert log and log[-1] == ("sync",), "the program ended with device work outstanding"
    assert any(step.device == "cpu" and step.waits for step in decode)
    assert not problems, problems
