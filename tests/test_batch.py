"""Batch steps: one decode step of several sequences, where a sparse layer reads the union of their predicted
neurons once (neuron.select / sparse_ffn / sparse_ffn_q over rows=None, Engine.forward_batch, the scheduler)."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import tvm
import tvm_ffi

from passes.kernels import cpu, neuron, quant
from passes.targets import CPU_ISAS
from runtime.dtypes import WEIGHT_FORMATS
from kernel_reference import act_ref, aligned

N = 37  # neurons: no multiple of 8 (uneven task slices)
MAX_BATCH = 4
FLOAT = {"relu": (36, False, "relu", "float32"), "gated_relu_f16": (36, True, "relu", "float16"),
         "gated_silu": (36, True, "silu", "float32")}  # (D, gated, activation, weight dtype); D = 36: 4-lane vectors
COLUMNS = {"cols": (False, "none", False, "float32"), "cols_gated_silu_f16": (True, "silu", False, "float16"),
           "cols_relu_bias": (False, "relu", True, "float32")}  # sparse_columns: (gated, act, bias, weight dtype)
CK, CN = 40, 48  # input channels (no multiple of the row group), columns
QUANT = {"int8_relu": (96, "int8", False, "relu", "float16"), "int4_gated_relu": (96, "int4", True, "relu", "float16"),
         "int4_relu": (256, "int4", False, "relu", "float32"),
         "int4a_gated_relu": (96, "int4a", True, "relu", "float16")}  # (D, format, gated, activation, scale dtype)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    funcs = [neuron.select("select_batch", N, rows=None)]
    for name, (D, gated, act, dtype) in FLOAT.items():
        funcs += [neuron.sparse_ffn(f"{name}_{phase}", D, N, rows=rows, gated=gated, act=act, wdtype=dtype,
                                    max_batch=MAX_BATCH) for phase, rows in (("decode", 1), ("batch", None))]
    for name, (D, form, gated, act, sdtype) in QUANT.items():
        has_min = {"has_min": True} if WEIGHT_FORMATS[form].has_min else {}
        funcs += [neuron.sparse_ffn_q(f"{name}_{phase}", D, N, rows=rows, gated=gated, act=act,
                                      bits=WEIGHT_FORMATS[form].bits, sdtype=sdtype, max_batch=MAX_BATCH, **has_min)
                  for phase, rows in (("decode", 1), ("batch", None))]
    for name, (gated, act, bias, dtype) in COLUMNS.items():
        funcs += [neuron.sparse_columns(f"{name}_{phase}", CK, CN, rows=rows, gated=gated, act=act, bias=bias,
                                        wdtype=dtype, max_batch=MAX_BATCH)
                  for phase, rows in (("decode", 1), ("batch", None))]
    funcs.append(neuron.select("select_abs_batch", CK, rows=None, magnitude=True))
    path = tmp_path_factory.mktemp("batch") / "batch.so"
    cpu.build(funcs, CPU_ISAS["avx2"].llvm_target(), str(path))
    return tvm.runtime.load_module(str(path))


def call(lib, name, *arrays):
    lib[name](*[tvm_ffi.from_dlpack(a) for a in arrays])


def test_select_takes_the_union_of_the_rows(lib):
    rng = np.random.default_rng(0)
    scores = aligned(rng.standard_normal((3, N)).astype(np.float32))
    scores[:, 5] = [-1, -1, 2]  # only the last row lets neuron 5 through
    scores[:, 6] = -1  # no row lets neuron 6 through
    index, count = aligned(np.full((1, N), -7, np.int32)), aligned(np.zeros((1, 1), np.int32))
    call(lib, "select_batch", scores, aligned(np.array([0.5], np.float32)), index, count)
    expected = np.nonzero((scores > 0.5).any(axis=0))[0]
    assert 5 in expected and 6 not in expected
    k = int(count[0, 0])
    assert k == len(expected) and np.array_equal(index[0, :k], expected)
    for row in scores:  # the union holds every row's own selection
        assert set(np.nonzero(row > 0.5)[0]) <= set(index[0, :k])


def float_part(rng, D, gated, dtype):
    up = rng.standard_normal(((2 if gated else 1) * N, D)).astype(dtype)
    bias = rng.standard_normal((2 if gated else 1) * N).astype(np.float32)
    down = rng.standard_normal((N, D)).astype(dtype)
    return [aligned(up)], aligned(bias), [aligned(down)], up.astype(np.float64), down.astype(np.float64)


def quant_part(rng, D, form, gated, sdtype):
    fmt = replace(WEIGHT_FORMATS[form], scale_dtype=sdtype)

    def rows(shape):
        q, scales, *mins = quant.quantize(rng.standard_normal(shape).astype(np.float32), fmt, axis=1)
        packed, packed_scales = quant.pack_rows(q, scales, fmt, *mins)
        return [aligned(packed), aligned(packed_scales)], quant.dequantize(q, scales, 1, *mins).astype(np.float64)

    up, up_ref = rows(((2 if gated else 1) * N, D))
    down, down_ref = rows((N, D))
    return up, aligned(rng.standard_normal((2 if gated else 1) * N).astype(np.float32)), down, up_ref, down_ref


def reference(x, up, bias, down, selected, gated, act):
    """out[r] = sum over the selected neurons of h[r, k] * down[k], in float64."""
    pre = x @ up[selected].T + bias[selected]
    hidden = act_ref(pre, act)
    if gated:
        hidden = hidden * (x @ up[N + selected].T + bias[N + selected])
    return hidden, hidden @ down[selected]


def run_ffn(lib, name, x, index, count, up, bias, down, D):
    m = x.shape[0]
    hidden, fired = aligned(np.full((m, N), 99.0, np.float32)), aligned(np.zeros((1, N), np.int32))
    scratch = aligned(np.full((neuron.FFN_TASKS, MAX_BATCH * D), 7.0, np.float32))
    out = aligned(np.full((m, D), 5.0, np.float32))
    call(lib, name, x, index, count, *up, bias, *down, hidden, fired, scratch, out)
    return hidden, out


CASES = [(kind, name, m) for kind, table in (("float", FLOAT), ("quant", QUANT)) for name in table for m in (1, 3, 4)]


@pytest.mark.parametrize("kind,name,m", CASES)
def test_sparse_ffn_batch_against_numpy_and_each_row_alone(lib, kind, name, m):
    rng = np.random.default_rng(m)
    if kind == "float":
        D, gated, act, dtype = FLOAT[name]
        up, bias, down, up_ref, down_ref = float_part(rng, D, gated, dtype)
    else:
        D, form, gated, act, sdtype = QUANT[name]
        up, bias, down, up_ref, down_ref = quant_part(rng, D, form, gated, sdtype)
    x = aligned(rng.standard_normal((m, D)).astype(np.float32))
    selected = np.sort(rng.choice(N, size=23, replace=False)).astype(np.int32)
    index, count = aligned(np.zeros((1, N), np.int32)), aligned(np.array([[len(selected)]], np.int32))
    index[0, :len(selected)] = selected
    # a selected neuron no row fires (ReLU): its down row (and, gated, its up row) must not be read
    silent = selected[3]
    first = up[0]
    if act == "relu":
        if kind == "float":
            first[silent] = 0
            bias[silent] = -1
            down[0][silent] = np.nan
            if gated:
                first[N + silent] = np.nan
        else:  # a zero row of quantized values, the bias negative; the down row's scales NaN
            fmt = WEIGHT_FORMATS[QUANT[name][1]]  # (int4 stores q + 8; int4a's zero row: q 0 with min 0)
            first[silent] = 0 if fmt.bits == 8 else (fmt.offset | fmt.offset << 4)
            if fmt.has_min:
                up[1][silent, 1::2] = 0
            bias[silent] = -1
            down[1][silent] = np.nan
            if gated:
                up[1][N + silent] = np.nan  # the up row's scales
        up_ref[silent], down_ref[silent] = 0, 0
        if gated:
            up_ref[N + silent] = 0
    hidden, out = run_ffn(lib, f"{name}_batch", x, index, count, up, bias, down, D)
    want_hidden, want_out = reference(x.astype(np.float64), up_ref, bias, down_ref, selected, gated, act)
    k = len(selected)
    assert np.all(np.isfinite(out))  # the silent neuron's NaN rows were not read
    np.testing.assert_allclose(hidden[:, :k], want_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-3)
    assert np.all(hidden[:, k:] == 99.0)  # nothing written past the selected neurons
    if act == "relu":  # rows where a neuron did not fire while another row's did: computed as zero there
        mixed = [(r, j) for j in range(k) for r in range(m) if hidden[r, j] == 0 and np.any(hidden[:, j] != 0)]
        assert mixed or m == 1
    for r in range(m):  # each row as its own decode step, over the same selection: the same sums, but for their
        # order (a batch step's dot product runs in one accumulator per row of x, decode's over rows in lockstep)
        _, alone = run_ffn(lib, f"{name}_decode", aligned(x[r:r + 1].copy()), index, count, up, bias, down, D)
        np.testing.assert_allclose(out[r], alone[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("kernel", sorted(COLUMNS))
def test_sparse_columns_batch_over_the_union_of_kept_channels(lib, kernel, m):
    gated, act, bias, dtype = COLUMNS[kernel]
    rng = np.random.default_rng(m)
    v = aligned(rng.standard_normal((m, CK)).astype(np.float32))
    index, count = aligned(np.full((1, CK), -7, np.int32)), aligned(np.zeros((1, 1), np.int32))
    call(lib, "select_abs_batch", v, aligned(np.array([1.0], np.float32)), index, count)
    kept = np.nonzero((np.abs(v) > 1.0).any(axis=0))[0]
    k = int(count[0, 0])
    assert k == len(kept) and np.array_equal(index[0, :k], kept)
    assert m == 1 or len(kept) > max(np.count_nonzero(np.abs(row) > 1.0) for row in v)  # a union, larger
    w = aligned(rng.standard_normal((CK, CN)).astype(dtype))
    b = aligned(rng.standard_normal(CN).astype(np.float32))
    width = CN // 2 if gated else CN

    def run(name, rows):
        scratch = aligned(np.full((neuron.COLUMN_TASKS, MAX_BATCH * CN), 5.0, np.float32))  # stale sums must not leak
        y = aligned(np.full((rows.shape[0], width), 99.0, np.float32))
        call(lib, name, rows, index, count, w, *([b] if bias else []), scratch, y)
        return y

    y = run(f"{kernel}_batch", v)
    pre = v[:, kept].astype(np.float64) @ w[kept].astype(np.float64) + (b if bias else 0)  # every row: the union
    actf = {"none": lambda z: z, "silu": lambda z: z / (1 + np.exp(-z)), "relu": lambda z: np.maximum(z, 0)}[act]
    expected = actf(pre[:, :width]) * pre[:, width:] if gated else actf(pre)
    np.testing.assert_allclose(y, expected, atol=1e-4, rtol=1e-5)
    for r in range(m):  # each row as its own decode step over the same channels: the same sums, in the same order
        np.testing.assert_allclose(y[r], run(f"{kernel}_decode", aligned(v[r:r + 1].copy()))[0], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny_all_neurons_artifact(tiny_models, tmp_path_factory):
    """The tiny OPT built sparse with every neuron let through: batch steps must give each slot's own logits."""
    from picompile.compiler import build
    from passes.pipeline import Options
    from passes.targets import get_target

    files = tiny_models("opt", sparsity=0.9)
    out = tmp_path_factory.mktemp("batch") / "opt-all.pic"
    build(files.onnx, out, get_target("cpu"), Options(max_context=64, all_neurons=True, max_batch=4))
    return out


def _prefill(engine, prompts):
    return {slot: int(np.argmax(engine.forward(prompt, slot=slot)[-1])) for slot, prompt in enumerate(prompts)}


PROMPTS = [[1, 2, 3], [50, 60, 70, 80, 90], [100], [7, 7]]


def test_batch_steps_give_each_slots_own_logits_with_every_neuron(tiny_all_neurons_artifact):
    from runtime import Engine

    engine, alone = Engine(tiny_all_neurons_artifact, slots=4), Engine(tiny_all_neurons_artifact, slots=4)
    assert engine.batched and engine.max_batch == 4
    tokens, _ = _prefill(engine, PROMPTS), _prefill(alone, PROMPTS)
    for slots in ([0, 1, 2, 3], [2, 0], [3, 1, 0], [1]):  # orders and subsets: a new program for each
        ids = [tokens[s] for s in slots]
        got = engine.forward_batch(ids, slots)
        assert got.shape == (len(slots), engine.vocab_size)
        for row, slot in enumerate(slots):
            np.testing.assert_allclose(got[row], alone.forward([tokens[slot]], slot=slot)[0], rtol=0, atol=1e-5)
            tokens[slot] = int(np.argmax(got[row]))
    assert engine.positions == alone.positions


def test_batch_steps_read_the_union_of_the_rows_neurons(tiny_sparse_artifact):
    """Step by step through one bound batch program: each fused FFN call reads the union of the rows' own
    selections (select's scores, row by row), and its byte count is the union's, each row counted once."""
    from passes.costmodel import weight_bytes
    from runtime import Engine

    engine = Engine(tiny_sparse_artifact, slots=3)
    tokens = _prefill(engine, PROMPTS[:3])
    slots = [2, 0, 1]
    calls, buffers = {call.id: call for call in engine.calls}, engine.manifest.buffers
    engine.buffers["input_ids"][:3] = [tokens[s] for s in slots]
    positions = [engine.positions[s] for s in slots]
    counts = {call.selection.count for call in engine.calls if call.selection is not None}
    own, checked = {}, 0  # count buffer -> each row's own selection, from the select call that wrote it
    for step in engine.batch_steps(slots):
        step.run(positions if step.sequence is None else positions[step.sequence])
        call = calls[step.name]
        written = set(call.writes()) & counts
        if call.selection is None and written:  # a select: its scores, a row per sequence, against its threshold
            scores = next(b for b in call.reads() if buffers[b].kind == "activation")
            threshold = next(b for b in call.reads() if buffers[b].kind == "weight")
            rows = engine.buffers[scores][:3] > engine.buffers[threshold][0]
            own[written.pop()] = [set(np.nonzero(row)[0]) for row in rows]
        elif call.selection is not None:
            selection, index = call.selection, next(b for b in call.reads() if buffers[b].dtype == "int32"
                                                    and b != call.selection.count)
            count = int(engine.buffers[selection.count][0, 0])
            rows = own[selection.count]
            assert set(engine.buffers[index][0, :count]) == set().union(*rows)
            assert max(map(len, rows)) <= count <= sum(map(len, rows))
            hidden = engine.buffers[selection.hidden][:3, :count]
            fired = int(np.count_nonzero(np.any(hidden != 0, axis=0)))
            assert max(np.count_nonzero(hidden, axis=1)) <= fired <= np.count_nonzero(hidden)
            assert step.bytes_read() == weight_bytes(call, buffers, count, fired)
            checked += 1
    assert checked == engine.manifest.model.num_layers


def test_sparse_batch_rows_are_as_close_to_the_dense_model_as_alone(tiny_sparse_artifact,
                                                                    tiny_all_neurons_artifact):
    """Each row of a sparse batch step computes the union's neurons: at least those its own step would."""
    from runtime import Engine

    sparse, alone = Engine(tiny_sparse_artifact, slots=3), Engine(tiny_sparse_artifact, slots=3)
    dense = Engine(tiny_all_neurons_artifact, slots=3)
    tokens = _prefill(dense, PROMPTS[:3])
    _prefill(sparse, PROMPTS[:3]), _prefill(alone, PROMPTS[:3])
    slots, worse = [0, 1, 2], []
    for _ in range(6):
        ids = [tokens[s] for s in slots]
        want = dense.forward_batch(ids, slots)
        got = sparse.forward_batch(ids, slots)
        for row, slot in enumerate(slots):
            batch_error = np.abs(got[row] - want[row]).max()
            alone_error = np.abs(alone.forward([ids[row]], slot=slot)[0] - want[row]).max()
            worse.append(batch_error - alone_error)
            assert batch_error <= max(alone_error, 1e-4) + 1e-4
        tokens = {slot: int(np.argmax(want[row])) for row, slot in enumerate(slots)}
    print("batch error - alone error: max", max(worse), "min", min(worse))


def test_forward_batch_refuses_bad_batches(tiny_sparse_artifact):
    from runtime import Engine

    engine = Engine(tiny_sparse_artifact, slots=2)
    with pytest.raises(ValueError, match="distinct"):
        engine.forward_batch([1, 2], [0, 0])
    with pytest.raises(ValueError, match="one token id per slot"):
        engine.forward_batch([1], [0, 1])
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
        engine.forward_batch([1, 2], [0, 2])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.forward_batch([1, 10**6], [0, 1])
    with pytest.raises(ValueError, match="at least one"):
        engine.forward_batch([], [])
    assert engine.positions == [0, 0]  # nothing ran
    engine.forward(list(range(1, 65)), slot=1)  # its context now full
    with pytest.raises(ValueError, match="context full"):
        engine.forward_batch([1, 2], [0, 1])
    assert engine.positions == [0, 64]


def test_more_slots_than_max_batch_are_chunked(tiny_all_neurons_artifact):
    from runtime import Engine

    engine, alone = Engine(tiny_all_neurons_artifact, slots=6), Engine(tiny_all_neurons_artifact, slots=6)
    prompts = [[i + 1, i + 2] for i in range(6)]
    tokens, _ = _prefill(engine, prompts), _prefill(alone, prompts)
    slots = [5, 0, 3, 1, 4, 2]  # 6 > max_batch 4: two batch steps
    got = engine.forward_batch([tokens[s] for s in slots], slots)
    for row, slot in enumerate(slots):
        np.testing.assert_allclose(got[row], alone.forward([tokens[slot]], slot=slot)[0], rtol=0, atol=1e-5)


def test_an_int4_build_batches_too(tiny_models, tmp_path_factory):
    """Block-quantized rows (int4, fp32 dot products on both sides): batch rows equal each slot's own logits."""
    from picompile.compiler import build
    from passes.pipeline import Options
    from passes.targets import get_target
    from runtime import Engine

    out = tmp_path_factory.mktemp("batch") / "opt-int4.pic"
    build(tiny_models("opt", sparsity=0.9).onnx, out, get_target("cpu"),
          Options(max_context=32, all_neurons=True, max_batch=4, weight_dtype="int4", quant_method="rtn",
                  int8_activations=False))
    engine, alone = Engine(out, slots=3), Engine(out, slots=3)
    assert engine.batched
    tokens, _ = _prefill(engine, PROMPTS[:3]), _prefill(alone, PROMPTS[:3])
    for slots in ([0, 1, 2], [2, 1]):
        got = engine.forward_batch([tokens[s] for s in slots], slots)
        for row, slot in enumerate(slots):
            np.testing.assert_allclose(got[row], alone.forward([tokens[slot]], slot=slot)[0], rtol=0, atol=1e-4)
            tokens[slot] = int(np.argmax(got[row]))


# ---------------------------------------------------------------- the scheduler


def test_concurrent_greedy_requests_decode_as_one_batch_and_match_sequential_ones(tiny_sparse_artifact,
                                                                                 monkeypatch):
    from runtime import Engine, generate
    from runtime.scheduler import FinishEvent, Job, Sampling, Scheduler, TokenEvent

    engine = Engine(tiny_sparse_artifact, slots=3)
    batches = []
    forward_batch = engine.forward_batch

    def counted(ids, slots):
        batches.append(len(slots))
        return forward_batch(ids, slots)

    monkeypatch.setattr(engine, "forward_batch", counted)
    prompts = [[4, 8, 15], [16, 23, 42, 7], [99]]
    lengths = [12, 9, 14]
    scheduler = Scheduler(engine)
    finished, results = threading.Semaphore(0), {}

    def submit(i):
        tokens = results.setdefault(i, [])

        def on_event(event):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            elif isinstance(event, FinishEvent):
                finished.release()

        scheduler.submit(Job(prompts[i], Sampling(max_tokens=lengths[i]), on_event))

    for i in range(len(prompts)):
        submit(i)
    scheduler.start()
    assert all(finished.acquire(timeout=120) for _ in prompts)
    scheduler.close()
    expected = {i: generate(Engine(tiny_sparse_artifact), prompts[i], lengths[i])["generated_ids"]
                for i in range(len(prompts))}
    assert results == expected
    assert max(batches) == 3  # the three requests' decode steps ran together


def test_long_prompts_are_prefilled_in_parts_between_the_running_requests_steps(tiny_sparse_artifact,
                                                                                monkeypatch):
    from runtime import Engine, generate
    from runtime.scheduler import FinishEvent, Job, Sampling, Scheduler, TokenEvent

    engine = Engine(tiny_sparse_artifact, slots=4)
    calls = []  # ("prefill", rows) or ("batch", sequences), in the order they ran
    forward, forward_batch = engine.forward, engine.forward_batch

    def prefill(ids, slot=0, **options):
        if options.get("as_prompt"):
            calls.append(("prefill", len(ids)))
        return forward(ids, slot, **options)

    def batch(ids, slots):
        calls.append(("batch", len(slots)))
        return forward_batch(ids, slots)

    monkeypatch.setattr(engine, "forward", prefill)
    monkeypatch.setattr(engine, "forward_batch", batch)
    prompts = [[4, 8], list(range(20, 31)), list(range(40, 47)), list(range(50, 61))]
    lengths = [16, 4, 3, 6]
    scheduler = Scheduler(engine, prefill_chunk=4)
    finished, results, ends = threading.Semaphore(0), {}, {}

    def on_event(i):
        def record(event):
            if isinstance(event, TokenEvent):
                results.setdefault(i, []).append(event.token_id)
                if i == 0 and len(results[0]) == 1:  # the others arrive while the first request decodes
                    for job in jobs[1:]:
                        scheduler.submit(job)
                if i == 2 and len(results[2]) == 1:  # the fourth's client leaves while its prompt is prefilled
                    jobs[3].cancel()
            elif isinstance(event, FinishEvent):
                ends[i] = event
                finished.release()
        return record

    jobs = [Job(prompt, Sampling(max_tokens=length), on_event(i))
            for i, (prompt, length) in enumerate(zip(prompts, lengths))]
    scheduler.submit(jobs[0])
    scheduler.start()
    assert all(finished.acquire(timeout=120) for _ in prompts)
    scheduler.close()
    assert [ends[i].reason for i in range(4)] == ["length", "length", "length", "cancelled"]
    for i in (0, 1, 2):  # the answers of whole prefills
        assert results[i] == generate(Engine(tiny_sparse_artifact), prompts[i], lengths[i])["generated_ids"]
    # the fourth prompt was begun (the step the third's prefill ended in had tokens to spare) and not finished
    prefilled = sum(rows for kind, rows in calls if kind == "prefill")
    assert sum(map(len, prompts[:3])) < prefilled < sum(map(len, prompts))
    # each step ran the decoding requests' batch, then at most 4 prompt tokens (of one prompt, or the end of one
    # and the start of the next): never more than 4 without a decode step between them
    assert calls[0] == ("prefill", 2)
    since = 0
    for kind, size in calls[1:]:
        since = 0 if kind == "batch" else since + size
        assert since <= 4
    assert sum(kind == "prefill" for kind, _ in calls) >= 1 + 3 + 2 + 1


class _FakeEngine:
    """Slots whose logits pick token slot + 1; slot 1's context is full after its prefill; forward_batch refuses
    (a ValueError, as the engine's own) any batch with slot 1 in it."""

    slots, vocab, prefill_chunk = 3, 8, 64

    def __init__(self):
        self.batches = []

    def prefix_length(self, prompt_ids, slot):
        return 0

    def resume(self, prompt_ids, slot):
        return 0

    def forward(self, ids, slot=0, **options):
        if slot == 1 and len(ids) == 1:
            raise ValueError("context full")
        logits = np.zeros((len(ids), self.vocab), np.float32)
        logits[:, slot + 1] = 1
        return logits

    def forward_batch(self, ids, slots):
        self.batches.append(list(slots))
        if 1 in slots:
            raise ValueError("context full: slot 1")
        return np.concatenate([self.forward([token], slot) for token, slot in zip(ids, slots)])


def test_a_refused_batch_fails_only_the_request_it_is_refused_for():
    from runtime.scheduler import FinishEvent, Job, Sampling, Scheduler, TokenEvent

    engine = _FakeEngine()
    scheduler = Scheduler(engine)
    finished, events = threading.Semaphore(0), {i: [] for i in range(3)}

    def on_event(i):
        def record(event):
            events[i].append(event)
            if isinstance(event, FinishEvent):
                finished.release()
        return record

    for i in range(3):
        scheduler.submit(Job([1, 2], Sampling(max_tokens=4), on_event(i)))
    scheduler.start()
    assert all(finished.acquire(timeout=30) for _ in range(3))
    scheduler.close()
    ends = {i: events[i][-1] for i in range(3)}
    assert [ends[i].reason for i in range(3)] == ["length", "error", "length"]
    assert "context full" in ends[1].error
    for i in (0, 2):
        assert [e.token_id for e in events[i] if isinstance(e, TokenEvent)] == [i + 1] * 4
    assert [0, 1, 2] in engine.batches and [0, 2] in engine.batches  # refused with slot 1, then batched without
