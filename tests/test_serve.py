"""`picompile serve`: live uvicorn servers on 127.0.0.1 over the tiny artifact, driven by the openai client."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import openai
import pytest

from byte_tokenizer import ByteTokenizer
from runtime import Engine, generate
from runtime.scheduler import FinishEvent, Job, QueueFull, Sampling, Scheduler, TokenEvent
from runtime.serve import StopMatcher, bind, create_app, make_server
from test_runtime_thin import ROOT, run_without_compiler_stack

WAIT_S = 60  # how long a test waits for a server to reach a state before it fails (never a measured time)
# ... for a new worker process (a Ray Serve replica, a stage actor) to load TVM and an artifact: 60 s was too short
# beside a build's torch threads (a bound, not a measured time)
START_WAIT_S = 240


def wait_until(condition, what: str, poll_s: float = 0.01, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(poll_s)


@contextmanager
def live_server(engine, **options):
    """The app on a uvicorn server in a thread, on a free port of 127.0.0.1; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(engine, **options), log_level="warning", graceful_shutdown_s=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


class GatedEngine:
    """An engine whose steps wait for permits while held: the tests decide when the scheduler may go on."""

    def __init__(self, engine):
        self._engine = engine
        self._permits: threading.Semaphore | None = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def hold(self):
        self._permits = threading.Semaphore(0)

    def step(self, count: int = 1):
        self._permits.release(count)

    def open(self):
        permits, self._permits = self._permits, None
        if permits is not None:
            permits.release(10_000)

    def forward(self, token_ids, slot: int = 0, **options):
        permits = self._permits
        if permits is not None:
            permits.acquire()
        return self._engine.forward(token_ids, slot, **options)

    def forward_batch(self, token_ids, slots):  # the scheduler's decode steps: one permit a batch step
        permits = self._permits
        if permits is not None:
            permits.acquire()
        return self._engine.forward_batch(token_ids, slots)


@pytest.fixture(scope="module")
def text_server(tiny_sparse_artifact):
    """4 slots, the byte tokenizer (no end-of-sequence id, so greedy runs go to max_tokens)."""
    with live_server(Engine(tiny_sparse_artifact, slots=4), tokenizer=ByteTokenizer(), parallel=4, queue=16) as url:
        yield url


@pytest.fixture(scope="module")
def ids_engine(tiny_sparse_artifact):
    return GatedEngine(Engine(tiny_sparse_artifact, slots=1))


@pytest.fixture(scope="module")
def ids_server(ids_engine):
    """1 slot, a queue of 1, no tokenizer, steps gated by the test."""
    with live_server(ids_engine, tokenizer=None, parallel=1, queue=1) as url:
        yield url


@pytest.fixture(scope="module")
def reference(tiny_sparse_artifact):
    engine = Engine(tiny_sparse_artifact)  # a fresh single-slot engine

    def run(prompt_ids, max_tokens, **sampling):
        return generate(engine, prompt_ids, max_tokens, **sampling)["generated_ids"]

    return run


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


TOKENIZER = ByteTokenizer()


# ---------------------------------------------------------------- answers


def test_models_health_and_metrics(text_server):
    models = client(text_server).models.list()
    assert [model.id for model in models.data] == ["opt-tiny.pic"]
    assert health(text_server) == {"status": "ok", "slots_idle": 4, "slots_processing": 0, "queue_depth": 0}
    found = metrics(text_server)
    assert found["picompile_slots_total"] == 4 and found["picompile_slots_busy"] == 0
    assert found["picompile_queue_depth"] == 0


def test_completion_of_token_ids_equals_generate(text_server, reference):
    prompt = [3, 14, 15, 92, 65]
    answer = client(text_server).completions.create(model="any", prompt=prompt, max_tokens=12, temperature=0)
    expected = reference(prompt, 12)
    choice = answer.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == TOKENIZER.decode(expected)
    assert choice.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (5, 12, 17)


def test_string_prompt_and_chat_are_encoded_by_the_tokenizer(text_server, reference):
    api = client(text_server)
    answer = api.completions.create(model="any", prompt="Hello", max_tokens=8, temperature=0)
    assert answer.choices[0].model_extra["token_ids"] == reference(TOKENIZER.encode("Hello"), 8)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = api.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0)
    expected = reference(TOKENIZER.encode(TOKENIZER.chat_prompt(messages)), 8)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == TOKENIZER.decode(expected)
    assert chat.usage.prompt_tokens == len("system: be brief\nuser: hi\nassistant:")


def test_a_conversations_next_turn_reuses_its_slots_cache(text_server, reference):
    api = client(text_server)
    messages = [{"role": "user", "content": "hi"}]  # (the artifact's context: 64 tokens)
    first = api.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0)
    before = metrics(text_server)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "go"}]
    second = api.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0)
    prompt = TOKENIZER.encode(TOKENIZER.chat_prompt(messages))
    assert second.choices[0].model_extra["token_ids"] == reference(prompt, 6)  # what a cold prefill answers
    after = metrics(text_server)
    assert after["picompile_prefix_cache_hits_total"] == before["picompile_prefix_cache_hits_total"] + 1
    cached = after["picompile_prompt_tokens_cached_total"] - before["picompile_prompt_tokens_cached_total"]
    first_prompt = TOKENIZER.encode(TOKENIZER.chat_prompt(messages[:1]))
    assert len(first_prompt) - 1 <= cached < len(prompt)  # the first turn's prompt at least, never the whole
    before = after
    again = api.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0,
                                        extra_body={"cache_prompt": False})
    assert again.choices[0].model_extra["token_ids"] == second.choices[0].model_extra["token_ids"]
    after = metrics(text_server)
    assert after["picompile_prompt_tokens_cached_total"] == before["picompile_prompt_tokens_cached_total"]


def stream_completion(url: str, prompt: list[int], max_tokens: int, into: dict) -> None:
    """A greedy streamed completion read raw into `into`: the answer's `headers` (once it started), its token `ids`,
    the `error` chunk's message (or the cut connection's), and whether it ended with [DONE] (`done`)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    into.update(ids=[], done=False, error=None)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=WAIT_S) as response:
            into["headers"] = dict(response.headers)
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    into["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        into["error"], into["error_code"] = chunk["error"]["message"], chunk["error"]["code"]
                    else:
                        into["ids"] += chunk["choices"][0]["token_ids"]
    except httpx.HTTPError as error:  # the connection cut short (a server process that died)
        into["error"] = repr(error)
    finally:
        into.setdefault("headers", {})


def stream_and_whole(api, sampling: dict) -> tuple[list, list]:
    """The same sampled completion streamed (its chunks, and those with a choice) and whole, checked equal in
    text and tokens: what every server of the API (plain, Ray Serve) must give."""
    whole = api.completions.create(prompt=[7, 8, 9], **sampling).choices[0]
    chunks = list(api.completions.create(prompt=[7, 8, 9], stream=True, stream_options={"include_usage": True},
                                         **sampling))
    streamed = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in streamed) == whole.text
    assert [i for c in streamed for i in c.choices[0].model_extra["token_ids"]] == whole.model_extra["token_ids"]
    return chunks, streamed


def test_streaming_gives_the_same_tokens_as_a_whole_answer(text_server):
    api = client(text_server)
    sampling = dict(model="any", max_tokens=10, temperature=1.0, top_p=0.9, seed=5)
    chunks, streamed = stream_and_whole(api, sampling)
    assert streamed[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10  # the usage chunk comes last

    messages = [{"role": "user", "content": "stream"}]
    chat_whole = api.chat.completions.create(messages=messages, **sampling).choices[0].message.content
    chat_chunks = list(api.chat.completions.create(messages=messages, stream=True, **sampling))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_clients_get_their_sequential_answers(text_server, reference):
    """4 clients at once on 4 slots: greedy and seeded sampled runs equal the same requests one at a time and
    runtime.generate on a single-slot engine (a slot reading another's cache would change them)."""
    api = client(text_server)
    requests = [dict(prompt=[1, 2, 3], max_tokens=24, temperature=0),
                dict(prompt=[50, 60, 70, 80], max_tokens=30, temperature=0),
                dict(prompt=[100, 5], max_tokens=20, temperature=1.0, seed=11),
                dict(prompt=[9] * 7, max_tokens=28, temperature=0.8, top_p=0.9, seed=3)]

    def ask(request):
        return api.completions.create(model="any", **request).choices[0].model_extra["token_ids"]

    sequential = [ask(request) for request in requests]
    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, requests)) == sequential
    expected = [reference(r["prompt"], r["max_tokens"], temperature=r["temperature"], top_p=r.get("top_p", 1.0),
                          seed=r.get("seed")) for r in requests]
    assert sequential == expected
    assert len({tuple(ids) for ids in sequential}) == 4  # the requests do differ


def test_stop_strings_cut_the_text_whole_and_streamed(text_server):
    api = client(text_server)
    sampling = dict(model="any", prompt="abc", max_tokens=40, temperature=1.0, seed=2)
    text = api.completions.create(**sampling).choices[0].text
    stop = text[5:7]
    expected = text[:text.index(stop)]
    cut = api.completions.create(stop=[stop, "never-there"], **sampling).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    streamed = list(api.completions.create(stop=stop, stream=True, **sampling))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- bad requests

BAD = [
    ("chat/completions", {"model": "m"}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [1, 2], "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": [1, 2], "max_tokens": 63}, "max_tokens"),  # 2 + 63 > 64
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000},
     "max_completion_tokens"),
    ("completions", {"prompt": [1, 2], "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("completions", {"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": [1, 2], "seed": -1}, "seed"),
    ("completions", {"prompt": [1, 2], "stop": [3]}, "stop"),
    ("completions", {"prompt": [1, 2], "stream": "yes"}, "stream"),
    ("completions", {"prompt": [1, 2], "n": 2}, "n"),
    ("completions", {"prompt": [1, 2], "logprobs": 3}, "logprobs"),
    ("completions", {"prompt": [1, 2], "echo": True}, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ("completions", {"prompt": [1, 128]}, "prompt"),  # the vocabulary is 128 tokens
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": list(range(64))}, "prompt"),  # fills the context
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_a_bad_request_is_a_400_naming_its_field(text_server, endpoint, body, param):
    response = httpx.post(f"{text_server}/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[1, 2]", b""])
def test_a_body_that_is_not_a_json_object_is_a_400(text_server, raw):
    response = httpx.post(f"{text_server}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_openai_client_sees_a_bad_request_error(text_server):
    with pytest.raises(openai.BadRequestError) as raised:
        client(text_server).completions.create(model="any", prompt=[1], max_tokens=1, top_p=2.0)
    assert raised.value.status_code == 400 and raised.value.param == "top_p"


# ---------------------------------------------------------------- no tokenizer, slots, queue


def test_without_a_tokenizer_prompts_are_ids_and_text_is_the_ids(ids_server, reference):
    api = client(ids_server)
    choice = api.completions.create(model="any", prompt=[4, 8, 15], max_tokens=6, temperature=0).choices[0]
    expected = reference([4, 8, 15], 6)
    assert choice.text == " ".join(map(str, expected)) and choice.model_extra["token_ids"] == expected
    streamed = list(api.completions.create(model="any", prompt=[4, 8, 15], max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    for endpoint, body, param in [("completions", {"prompt": "text"}, "prompt"),
                                  ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                                  ("completions", {"prompt": [1], "stop": "x"}, "stop")]:
        response = httpx.post(f"{ids_server}/v1/{endpoint}", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert "tokenizer" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(ids_server, ids_engine, stream):
    """A raw HTTP client sends a long request, (streamed: reads its first token,) and closes the connection; the
    scheduler, stepped one token at a time, cancels the request long before max_tokens."""
    import socket

    body = json.dumps({"prompt": [1, 2], "max_tokens": 60, "temperature": 0, "stream": stream}).encode()
    host, port = ids_server.removeprefix("http://").split(":")
    before = metrics(ids_server)
    ids_engine.hold()
    try:
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: health(ids_server)["slots_processing"] == 1, "the request to take the slot")
            ids_engine.step()  # the prefill, and its token
            if stream:
                received = b""
                while b"token_ids" not in received:
                    received += connection.recv(4096)
        # closed; the scheduler goes on one step at a time until it frees the slot
        finished = 'picompile_requests_finished_total{reason="cancelled"}'
        for _ in range(55):
            if metrics(ids_server)[finished] > before[finished]:
                break
            ids_engine.step()
        assert metrics(ids_server)[finished] == before[finished] + 1  # cancelled, not run to max_tokens
    finally:
        ids_engine.open()
    wait_until(lambda: health(ids_server)["slots_idle"] == 1, "the slot to be free")
    answer = client(ids_server).completions.create(model="any", prompt=[3], max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"


def test_a_client_gone_before_its_stream_starts_cancels_its_job(tiny_sparse_artifact):
    """The ASGI app called directly: the client's disconnect arrives right after its request, so the stream is
    cancelled while its response head is still being sent, before its body generator ran; the job must still
    end (cancelled), not run to max_tokens for nobody."""
    import asyncio

    engine = GatedEngine(Engine(tiny_sparse_artifact, slots=1))
    app = create_app(engine, tokenizer=None, parallel=1, queue=1)
    scheduler = app.state.endpoints.scheduler
    body = json.dumps({"prompt": [1, 2], "max_tokens": 30, "temperature": 0, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):  # a slow network: the disconnect lands while the head is on its way
        await asyncio.sleep(0.2)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    async def serve_then_wait():  # the loop lives on after the answer, as a server's does
        await app(scope, receive, send)
        engine.open()
        deadline = time.monotonic() + WAIT_S
        while sum(scheduler.stats().requests_finished.values()) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    engine.hold()  # no step until the app has answered
    scheduler.start()
    try:
        asyncio.run(serve_then_wait())
        stats = scheduler.stats()
        assert stats.requests_finished["cancelled"] == 1 and stats.tokens_generated < 30
    finally:
        engine.open()
        scheduler.close()


def test_a_full_queue_answers_429_with_retry_after(ids_server, ids_engine):
    """1 slot, queue 1: with one request running and one waiting, the next ones are refused."""
    body = {"prompt": [1, 2, 3], "max_tokens": 20, "temperature": 0}
    ids_engine.hold()
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, f"{ids_server}/v1/completions", json=body, timeout=WAIT_S)
            wait_until(lambda: health(ids_server)["slots_processing"] == 1, "the first request to take the slot")
            waiting = pool.submit(httpx.post, f"{ids_server}/v1/completions", json=body, timeout=WAIT_S)
            wait_until(lambda: health(ids_server)["queue_depth"] == 1, "the second request to wait")
            refused = [httpx.post(f"{ids_server}/v1/completions", json=body) for _ in range(3)]
            assert [r.status_code for r in refused] == [429] * 3
            assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
            with pytest.raises(openai.APIStatusError) as raised:
                client(ids_server).completions.create(model="any", **body)
            assert raised.value.status_code == 429
            ids_engine.open()
            assert running.result().status_code == waiting.result().status_code == 200
    finally:
        ids_engine.open()
    assert metrics(ids_server)['picompile_requests_rejected_total{reason="queue_full"}'] >= 4


class FailingEngine(GatedEngine):
    """Decode steps fail as a split model's do when a stage died (EngineUnavailable), or with a plain error."""

    def __init__(self, engine, error: Exception):
        super().__init__(engine)
        self.error = error

    def forward_batch(self, token_ids, slots):
        raise self.error


@pytest.mark.parametrize("unavailable", [True, False])
def test_a_step_that_fails_ends_its_request_with_the_error_body(tiny_sparse_artifact, unavailable):
    from runtime.scheduler import EngineUnavailable

    error = EngineUnavailable("a stage died") if unavailable else RuntimeError("a kernel failed")
    with live_server(FailingEngine(Engine(tiny_sparse_artifact), error), tokenizer=None) as url:
        whole = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=WAIT_S)
        assert whole.status_code == (503 if unavailable else 500)
        code = "engine_unavailable" if unavailable else None
        assert whole.json()["error"]["code"] == code and str(error) in whole.json()["error"]["message"]
        if unavailable:
            assert whole.headers["retry-after"] == "1"
        into: dict = {}
        stream_completion(url, [1, 2], 4, into)
        assert into["error_code"] == code and len(into["ids"]) == 1 and into["done"]


# ---------------------------------------------------------------- the scheduler alone


def test_scheduler_stops_at_an_end_of_sequence_id_and_counts(tiny_sparse_artifact, reference):
    expected = reference([1, 2, 3], 12)
    stop_id = expected[4]
    first_stop = expected.index(stop_id)
    scheduler = Scheduler(Engine(tiny_sparse_artifact, slots=2), queue_size=0)
    events, done = [], threading.Event()

    def on_event(event):
        events.append(event)
        if isinstance(event, FinishEvent):
            done.set()

    scheduler.start()
    try:
        scheduler.submit(Job([1, 2, 3], Sampling(12, stop_ids=frozenset({stop_id})), on_event))
        assert done.wait(WAIT_S)
    finally:
        scheduler.close()
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == expected[:first_stop]
    assert events[-1] == FinishEvent("stop", 3, first_stop + 1)
    stats = scheduler.stats()
    assert stats.requests_finished["stop"] == 1 and stats.tokens_generated == first_stop + 1
    assert stats.slots_busy == 0 and stats.queue_depth == 0


def test_scheduler_refuses_past_its_slots_and_queue_and_cancels_on_close(tiny_sparse_artifact):
    engine = GatedEngine(Engine(tiny_sparse_artifact, slots=1))
    engine.hold()
    scheduler = Scheduler(engine, queue_size=1)  # not started: nothing is admitted yet
    finishes = []
    jobs = [Job([1], Sampling(5), lambda e: finishes.append(e) if isinstance(e, FinishEvent) else None)
            for _ in range(3)]
    scheduler.submit(jobs[0])  # a free slot
    scheduler.submit(jobs[1])  # the queue's place
    with pytest.raises(QueueFull):
        scheduler.submit(jobs[2])
    scheduler.start()
    wait_until(lambda: scheduler.stats().slots_busy == 1, "a job to take the slot")
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    engine.open()
    closer.join(WAIT_S)
    assert sorted(f.reason for f in finishes) == ["cancelled", "cancelled"]


def test_stop_matcher_holds_back_a_possible_stop_string():
    matcher = StopMatcher(("END",))
    assert matcher.push("abcE") == ("abc", False)
    assert matcher.push("N") == ("", False)
    assert matcher.push("x") == ("ENx", False)
    assert matcher.push("yEN") == ("y", False)
    assert matcher.push("Dzz") == ("", True)


# ---------------------------------------------------------------- the runtime stays thin; the command


def test_the_server_runs_without_the_compiler_stack(tiny_sparse_artifact):
    """runtime/serve.py needs the serve extra and the runtime only, as the runtime does."""
    out = run_without_compiler_stack(
        "from runtime.serve import create_app\nfrom starlette.testclient import TestClient\n"
        f"with TestClient(create_app({str(tiny_sparse_artifact)!r})) as http:\n"
        "    print(http.post('/v1/completions', json={'prompt': [1, 2], 'max_tokens': 3}).json()['usage'])")
    assert out.strip() == "{'prompt_tokens': 2, 'completion_tokens': 3, 'total_tokens': 5}"


def test_an_artifact_without_a_tokenizer_serves_ids(tiny_sparse_artifact):
    from runtime.serve import artifact_tokenizer

    assert artifact_tokenizer(tiny_sparse_artifact) is None  # so create_app's default serves token ids


def test_picompile_serve_serves_and_stops_on_sigint(tiny_sparse_artifact):
    """Started as a shell starts a background job (SIGINT ignored), Ctrl-C's signal still stops it."""
    process = subprocess.Popen([sys.executable, "-m", "picompile.cli", "serve", str(tiny_sparse_artifact),
                                "--port", "0", "--parallel", "2"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        line = process.stderr.readline()
        assert line.startswith("serving "), line
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:")
        wait_until(lambda: _answers(f"{url}/health"), "the server to answer")
        answer = client(url).completions.create(model="any", prompt=[1, 2], max_tokens=3, temperature=0)
        assert len(answer.choices[0].model_extra["token_ids"]) == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


def test_picompile_serve_errors_are_one_line(tiny_sparse_artifact, tmp_path):
    def serve(*args, block_serve_extra=False):
        code = ("import sys\n" + ("sys.modules['starlette'] = None\n" if block_serve_extra else "")
                + "from picompile.cli import main\nsys.exit(main(sys.argv[1:]))")
        result = subprocess.run([sys.executable, "-c", code, "serve", *args], cwd=ROOT, capture_output=True,
                                text=True, timeout=WAIT_S)
        return result.returncode, result.stderr.strip().splitlines()

    code, lines = serve(str(tmp_path / "missing.pic"))
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "missing.pic" in lines[0]
    code, lines = serve(str(tiny_sparse_artifact), block_serve_extra=True)
    assert code == 2 and lines == ["error: picompile serve needs the serve extra (starlette is not installed): "
                                   "pip install 'picompile[serve]'"]
    taken = bind("127.0.0.1", 0)
    try:
        code, lines = serve(str(tiny_sparse_artifact), "--port", str(taken.getsockname()[1]))
    finally:
        taken.close()
    assert code == 2 and len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0] and "in use" in lines[0]
    for option in ("--parallel", "--prefill-chunk"):
        code, lines = serve(str(tiny_sparse_artifact), option, "0")
        assert code == 2 and len(lines) == 1 and option in lines[0]


def test_sampled_answers_depend_on_the_seed(text_server):
    api = client(text_server)
    runs = [api.completions.create(model="any", prompt=[5, 6], max_tokens=16, temperature=1.5, seed=seed)
            .choices[0].model_extra["token_ids"] for seed in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]
    assert np.all(np.array(runs) < 128)


def test_text_outside_the_vocabulary_and_refused_templates_are_400s(text_server):
    """The byte tokenizer makes ids up to 255 of non-ASCII text; the tiny model has 128 tokens."""
    response = httpx.post(f"{text_server}/v1/completions", json={"prompt": "é"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    response = httpx.post(f"{text_server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "é"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = httpx.post(f"{text_server}/v1/completions",
                          json={"prompt": [1], "stream": True, "stream_options": {"include_usage": 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    from runtime.serve import RequestError, parse_generation

    class Strict(ByteTokenizer):
        def chat_prompt(self, messages):
            raise ValueError("conversation roles must alternate user/assistant")

    with pytest.raises(RequestError) as raised:
        parse_generation({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                         chat=True, tokenizer=Strict(), vocab_size=128, max_context=64)
    assert raised.value.param == "messages" and "alternate" in raised.value.message


def test_shutdown_with_a_request_in_flight_ends_it_and_stops(tiny_sparse_artifact):
    """The server stops while a streamed request runs (its engine held mid-request): after the grace period the
    stream is cut, the request cancelled, the scheduler's thread gone and no slot busy."""
    engine = GatedEngine(Engine(tiny_sparse_artifact, slots=1))
    engine.hold()
    sock = bind("127.0.0.1", 0)
    app = create_app(engine, tokenizer=None, parallel=1, queue=1)
    server = make_server(app, log_level="warning", graceful_shutdown_s=1)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the server to start")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    lines = []

    def stream():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=WAIT_S,
                              json={"prompt": [1, 2], "max_tokens": 60, "temperature": 0, "stream": True}) as response:
                lines.extend(line for line in response.iter_lines() if line)
        except httpx.TransportError:  # cut by the shutdown: as clean as a client can see it
            lines.append("cut")

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: health(url)["slots_processing"] == 1, "the request to take the slot")
    engine.step(3)  # the prefill and two decode steps; the fourth waits
    server.should_exit = True
    wait_until(lambda: not reader.is_alive(), "the shutdown to end the stream")  # the engine still held
    engine.open()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    stats = app.state.endpoints.scheduler.stats()
    assert stats.slots_busy == 0 and stats.queue_depth == 0
    assert stats.requests_finished["cancelled"] == stats.requests_submitted == 1
    assert len(lines) >= 1 and "data: [DONE]" not in lines
    sock.close()


def test_a_stream_whose_client_stops_reading_ends_and_cancels_its_job():
    """A chunk that waits longer than the send timeout to be sent (the client's connection open, nothing read)
    ends the stream and cancels its job, so its slot is freed: ASGI 2.4 and 2.3 servers alike."""
    import asyncio

    from runtime.serve import _JobStream

    for spec in ("2.4", "2.3"):
        job = Job([1], Sampling(5), lambda event: None)
        sent = []

        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"

        async def receive():
            await asyncio.sleep(30)  # the client says nothing, not even that it left
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                await asyncio.sleep(30)  # its buffer full: no chunk is taken
            sent.append(message)

        async def respond():
            stream = _JobStream(job, asyncio.Queue(), chunks(), send_timeout_s=0.2)
            await stream({"type": "http", "asgi": {"spec_version": spec}}, receive, send)

        began = time.monotonic()
        asyncio.run(asyncio.wait_for(respond(), 10))
        assert time.monotonic() - began < 5 and job.cancelled
        assert [m["type"] for m in sent] == ["http.response.start"]  # no chunk went, and the stream stopped trying
