"""`picompile serve`: an OpenAI-compatible HTTP server (as llama.cpp's llama-server) over a `Scheduler`.

Endpoints: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
`"stream": true`), GET /v1/models, /health and /metrics (Prometheus text). Starlette and uvicorn are
the optional `serve` extra (`pip install 'picompile[serve]'`); `import runtime` never imports this
module, so the runtime stays thin.

Decoding is the scheduler's: concurrent requests share the engine's slots, one token per running
request per step, the running requests' decode steps one batch step (`Engine.forward_batch`, whose sparse
layers read the union of their predicted neurons once; see runtime/scheduler.py).

Text: with a tokenizer (a `runtime.text.TextTokenizer`, or any object with its interface; by default the
artifact's, from `runtime.text.load_tokenizer`) prompts may be strings and chat works.
Without one, /v1/completions takes `prompt` as a list of token ids only, and each choice's `text` is
the generated ids as decimal numbers joined by single spaces. Every choice (and streamed chunk) also
carries the ids themselves in `token_ids`, an extension of the OpenAI format.

Defaults follow the OpenAI API: `temperature` 1, `top_p` 1; `max_tokens` defaults to the rest of the
artifact's context (as llama-server's `n_predict = -1`). `top_k` (0: off) is an extension, as in
llama-server. `model` is not checked: the server serves its one artifact whatever a request names.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from .gate import RETRY_AFTER_S, ApiError, Gate, Policy, engine_unavailable, error_response
from .scheduler import FinishEvent, Job, QueueFull, Sampling, Scheduler, SchedulerClosed, TokenEvent
from .text import TextTokenizer, load_tokenizer



FROM_ARTIFACT = object()  # create_app's default tokenizer: the artifact's own, where it has one


def artifact_tokenizer(directory) -> TextTokenizer | None:
    """The tokenizer the artifact carries, or None where it has none."""
    return load_tokenizer(directory)


# ---------------------------------------------------------------- requests

class RequestError(Exception):
    """What the client sent is wrong: a 400 with an OpenAI error body naming the field."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class Generation:
    """A validated request: what to generate and how to answer."""

    chat: bool
    prompt_ids: list[int]
    sampling: Sampling
    stop_strings: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    cache_prompt: bool = True  # (llama-server's field) false: prefilled whole, whatever a slot's cache holds


_MISSING = object()
# fields asking for what this server does not do, with the values that ask for nothing: refused rather than
# ignored, since an answer without them would pass for one with them
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "tools": (None, []), "response_format": (None, {"type": "text"})}


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _integer(body: dict, name: str, default, minimum: int):
    value = body.get(name)
    if value is None:
        return default
    if not _is_integer(value):
        raise RequestError(f"'{name}' must be an integer, got {json.dumps(value)}", name, "invalid_type")
    if value < minimum:
        raise RequestError(f"'{name}' must be at least {minimum}, got {value}", name, "invalid_value")
    return value


def _number(body: dict, name: str, default: float, accepts, expected: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise RequestError(f"'{name}' must be a number, got {json.dumps(value)}", name, "invalid_type")
    if not accepts(value):
        raise RequestError(f"'{name}' must be {expected}, got {value}", name, "invalid_value")
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {json.dumps(value)}", name, "invalid_type")
    return value


def _stop_strings(body: dict, tokenizer) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if stops and tokenizer is None:
        raise RequestError("'stop' strings need text, and this artifact has no tokenizer", "stop", "no_tokenizer")
    return tuple(stops)


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise RequestError("'prompt' is required", "prompt", "missing")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this artifact has no tokenizer: send 'prompt' as a list of token ids",
                               "prompt", "no_tokenizer")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and all(_is_integer(i) for i in prompt):
        ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("one prompt per request: 'prompt' must be a string or a list of token ids",
                           "prompt", "invalid_type")
    else:
        raise RequestError("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    return list(ids)


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)  # content parts: text only
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts", "messages",
                       "invalid_type")


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise RequestError("'messages' is required", "messages", "missing")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    turns = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] must be an object with a string 'role'", "messages",
                               "invalid_type")
        turns.append({"role": message["role"], "content": _message_text(message.get("content"), index)})
    if tokenizer is None:
        raise RequestError("this artifact has no tokenizer, which chat needs: use /v1/completions with 'prompt' as "
                           "a list of token ids", "messages", "no_tokenizer")
    try:  # a template may refuse a conversation (say, roles that do not alternate): the client's to fix
        return tokenizer.chat_ids(turns)
    except Exception as error:
        raise RequestError(f"the model's chat template refused the messages: {error}", "messages",
                           "invalid_value") from None


def parse_generation(body, *, chat: bool, tokenizer, vocab_size: int, max_context: int) -> Generation:
    """A request body checked field by field; a RequestError names the first wrong field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_type")
    prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    prompt_field = "messages" if chat else "prompt"
    if not prompt_ids:
        raise RequestError(f"'{prompt_field}' makes no tokens", prompt_field, "invalid_value")
    outside = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if outside:  # given so, or a tokenizer larger than the model's vocabulary
        raise RequestError(f"'{prompt_field}' holds token id {outside[0]}, outside the vocabulary [0, {vocab_size})",
                           prompt_field, "invalid_value")
    room = max_context - len(prompt_ids)
    if room < 1:
        raise RequestError(f"the prompt is {len(prompt_ids)} tokens, which leaves no room in the artifact's "
                           f"max context of {max_context} tokens", prompt_field, "context_length_exceeded")
    for name, nothing in UNSUPPORTED.items():
        if body.get(name) not in nothing:
            raise RequestError(f"'{name}' is not supported by this server", name, "unsupported")
    if _integer(body, "n", 1, 1) != 1:
        raise RequestError("'n' must be 1: one choice per request", "n", "invalid_value")
    # chat's newer name for max_tokens wins where both are given
    length_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, length_field, room, 1)
    if max_tokens > room:
        raise RequestError(f"'{length_field}' is {max_tokens}, but the prompt's {len(prompt_ids)} tokens leave "
                           f"room for {room} in the artifact's max context of {max_context}", length_field,
                           "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, lambda v: v >= 0, "at least 0")
    top_p = _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = _integer(body, "top_k", 0, 0)
    seed = _integer(body, "seed", None, 0)
    stop_strings = _stop_strings(body, tokenizer)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options", "invalid_type")
    try:
        include_usage = _boolean(options or {}, "include_usage", False)
    except RequestError as error:
        raise RequestError(error.message, "stream_options", error.code) from None
    cache_prompt = _boolean(body, "cache_prompt", True)
    eos_ids = frozenset(tokenizer.eos_ids) if tokenizer is not None else frozenset()
    return Generation(chat, prompt_ids, Sampling(max_tokens, temperature, top_k, top_p, seed, eos_ids),
                      stop_strings, stream, include_usage, cache_prompt)


# ---------------------------------------------------------------- text out

class StopMatcher:
    """Holds back text that may be the start of a stop string; cuts the text before the first stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self._held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(the text that is safe to send, whether a stop string was hit)."""
        held = self._held + text
        hits = [index for index in (held.find(stop) for stop in self.stops) if index >= 0]
        if hits:
            self._held = ""
            return held[:min(hits)], True
        keep = max((n for stop in self.stops for n in range(min(len(stop) - 1, len(held)), 0, -1)
                    if held.endswith(stop[:n])), default=0)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class Output:
    """A request's text as its tokens arrive: the tokenizer's incremental text, or the ids as numbers."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self._stream = tokenizer.stream() if tokenizer is not None else None
        self._stops = StopMatcher(stops)
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string ended the text

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self._stream is None:
            return str(token_id) if len(self.token_ids) == 1 else f" {token_id}"
        text, self.stopped = self._stops.push(self._stream.push(token_id))
        return text

    def finish(self) -> str:
        if self._stream is None or self.stopped:
            return ""
        text, self.stopped = self._stops.push(self._stream.flush())
        return text + ("" if self.stopped else self._stops.flush())


# ---------------------------------------------------------------- the app

@dataclass(frozen=True)
class ReplicaSet:
    """Where this server is one replica of several (`serve --ray`): which one answers, and the deployment's
    replicas as Ray Serve's controller sees them, so that /health and /metrics show a replica lost or
    being replaced."""

    replica: str  # the answering replica's id
    status: str  # the deployment's status (Serve's: HEALTHY, UPSCALING, UNHEALTHY, ...)
    replicas: dict[str, int]  # replicas by state (RUNNING, STARTING, ...)



_DISCONNECTED = object()
SEND_TIMEOUT_S = 60.0  # a streamed chunk its client has not taken in this long: the client is gone


class Endpoints:
    """The HTTP endpoints over one scheduler (and its engine), with the counters /metrics reports."""

    def __init__(self, engine, tokenizer: TextTokenizer | None, parallel: int | None, queue: int,
                 model_id: str, replica_set: Callable[[], Awaitable[ReplicaSet]] | None = None,
                 prefill_chunk: int | None = None):
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.replica_set = replica_set
        self.scheduler = Scheduler(engine, parallel=parallel, queue_size=queue, prefill_chunk=prefill_chunk)
        self.created = int(time.time())
        # requests refused, by reason: here (invalid, queue_full) and at the gate (`runtime/gate.py`); the event
        # loop's only: no lock
        self.rejected = dict.fromkeys(
            ("invalid", "queue_full", "unauthorized", "too_many_requests", "body_too_large"), 0)

    # -------------------------------------------------- endpoints

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "picompile",
            "meta": {"max_context": self.engine.max_context, "vocab_size": self.engine.vocab_size,
                     "slots": self.scheduler.parallel, "tokenizer": self.tokenizer is not None}}]})

    async def health(self, request: Request):
        stats = self.scheduler.stats()
        body = {"status": "ok", "slots_idle": stats.slots - stats.slots_busy,
                "slots_processing": stats.slots_busy, "queue_depth": stats.queue_depth}
        if self.replica_set is not None:
            replicas = await self.replica_set()
            body.update(replica=replicas.replica, deployment={"status": replicas.status, "replicas": replicas.replicas})
        return JSONResponse(body)

    async def metrics(self, request: Request):
        stats = self.scheduler.stats()
        lines = []

        def metric(name, kind, help_text, values):
            lines.extend([f"# HELP picompile_{name} {help_text}", f"# TYPE picompile_{name} {kind}"])
            for labels, value in values:
                lines.append(f"picompile_{name}{labels} {value}")

        metric("requests_total", "counter", "Requests admitted to the scheduler.", [("", stats.requests_submitted)])
        metric("requests_finished_total", "counter", "Requests finished, by reason.",
               [(f'{{reason="{reason}"}}', count) for reason, count in stats.requests_finished.items()])
        metric("requests_rejected_total", "counter", "Requests refused before scheduling, by reason.",
               [(f'{{reason="{reason}"}}', count) for reason, count in self.rejected.items()])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", stats.prompt_tokens)])
        metric("prompt_tokens_cached_total", "counter",
               "Prompt tokens a slot's cache held already (the prefix cache's hits: not prefilled again).",
               [("", stats.prompt_tokens_cached)])
        metric("prefix_cache_hits_total", "counter", "Requests that found a prefix of their prompt in a slot's cache.",
               [("", stats.prefix_hits)])
        metric("tokens_generated_total", "counter", "Tokens sampled.", [("", stats.tokens_generated)])
        metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", stats.queue_depth)])
        metric("slots_busy", "gauge", "Slots running a request.", [("", stats.slots_busy)])
        metric("slots_total", "gauge", "Slots (--parallel).", [("", stats.slots)])
        metric("tokens_per_second", "gauge", "Tokens sampled per second of stepping, all slots together.",
               [("", f"{stats.tokens_per_s:.6g}")])
        if self.replica_set is not None:  # the counters above are the answering replica's
            replicas = await self.replica_set()
            metric("replica_info", "gauge", "The replica that answered (its counters above are its own).",
                   [(f'{{replica="{replicas.replica}",deployment_status="{replicas.status}"}}', 1)])
            metric("replicas", "gauge", "The deployment's replicas, by state.",
                   [(f'{{state="{state}"}}', count) for state, count in sorted(replicas.replicas.items())])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -------------------------------------------------- generation

    async def _generate(self, request: Request, chat: bool):
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise RequestError(f"the request body is not valid JSON: {error}", None, "invalid_json") from None
            generation = parse_generation(body, chat=chat, tokenizer=self.tokenizer,
                                          vocab_size=self.engine.vocab_size, max_context=self.engine.max_context)
        except RequestError as error:
            self.rejected["invalid"] += 1
            return error_response(400, error.message, "invalid_request_error", error.param, error.code)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event):  # the scheduler's thread; a closed loop raises, and the scheduler cancels the job
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(generation.prompt_ids, generation.sampling, on_event, cache_prompt=generation.cache_prompt)
        try:
            self.scheduler.submit(job)
        except QueueFull as error:
            self.rejected["queue_full"] += 1
            return error_response(429, f"server busy: {error}; retry later", "server_busy", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
        except SchedulerClosed as error:
            return error_response(503, str(error), "server_shutting_down", code="shutting_down")
        answer = _Answer(self.model_id, generation, Output(self.tokenizer, generation.stop_strings))
        if generation.stream:
            return _JobStream(job, events, self._events(job, events, answer))
        return await self._collect(request, job, events, answer)

    async def _collect(self, request: Request, job: Job, events: asyncio.Queue, answer: _Answer):
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, job, events))
        try:
            text = []
            while True:
                event = await events.get()
                if event is _DISCONNECTED:
                    return PlainTextResponse("", status_code=499)  # nobody reads it
                if isinstance(event, TokenEvent):
                    text.append(answer.output.push(event.token_id))
                    if answer.output.stopped:
                        job.cancel()
                        return JSONResponse(answer.whole("".join(text), "stop", None))
                    continue
                if event.reason in ("stop", "length"):
                    text.append(answer.output.finish())
                    return JSONResponse(answer.whole("".join(text), event.reason, event))
                return (_failure(event) if event.reason == "error" else _SHUT_DOWN).response()
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once finished; frees the slot at the next step otherwise

    async def _events(self, job: Job, events: asyncio.Queue, answer: _Answer):
        try:
            if answer.chat:  # chat's first chunk names the role
                yield sse(answer.chunk("", None, first=True))
            while True:
                event = await events.get()
                if event is _DISCONNECTED:
                    return  # nobody reads the rest
                if isinstance(event, FinishEvent):
                    break
                yield sse(answer.chunk(answer.output.push(event.token_id), None, token_ids=[event.token_id]))
                if answer.output.stopped:
                    job.cancel()
                    event = None  # a stop string ended the text, not the scheduler
                    break
            if event is None or event.reason in ("stop", "length"):
                tail = answer.output.finish() if event is not None else ""
                if tail:
                    yield sse(answer.chunk(tail, None))
                yield sse(answer.chunk("", "stop" if event is None else event.reason))
                if answer.generation.include_usage:
                    yield sse(answer.usage_chunk(event))
            else:
                yield sse((_failure(event) if event.reason == "error" else _SHUT_DOWN).body())
            yield SSE_DONE
        finally:  # the stream ended or failed; a client that left is _JobStream's
            job.cancel()


_SHUT_DOWN = ApiError(503, "the request was cancelled: the server is shutting down", "server_shutting_down",
                      code="shutting_down")


def _failure(event: FinishEvent) -> ApiError:
    """The answer to a request whose generation failed: 503 where the engine could not run now (a stage that died:
    the request may be sent again), else 500."""
    if event.unavailable:
        return engine_unavailable(f"the engine could not run the request now ({event.error}); retry it")
    return ApiError(500, f"generation failed: {event.error}", "server_error")


async def _watch_disconnect(receive, job: Job, events: asyncio.Queue) -> None:
    """Cancel the job as soon as the client goes, and wake whoever waits on its events."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancel()
    events.put_nowait(_DISCONNECTED)


class _JobStream(StreamingResponse):
    """A streamed answer whose job ends with its connection. Starlette notices a client that left only when
    a chunk fails to send (ASGI 2.4) and never closes a body generator that had not started, so a request
    still queued, or waiting on its prefill, would run to max_tokens for nobody: the job is cancelled as
    soon as the disconnect arrives, and whenever the response ends. A client that stops reading (its
    connection open, the server's send buffer full) is one that left once a chunk has waited `send_timeout_s`
    to be sent: the stream ends there and its connection is closed."""

    def __init__(self, job: Job, events: asyncio.Queue, content, send_timeout_s: float = SEND_TIMEOUT_S):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.events, self.send_timeout_s = job, events, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.job, self.events))

        async def bounded_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:
                self.job.cancel()
                raise ClientDisconnect() from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except ClientDisconnect:  # the last chunk found the connection gone: nothing is left to answer
            pass
        finally:
            watcher.cancel()
            self.job.cancel()


SSE_DONE = "data: [DONE]\n\n"  # a stream's last event


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Answer:
    """The OpenAI JSON of one request's answer: whole, or chunk by chunk."""

    def __init__(self, model_id: str, generation: Generation, output: Output):
        self.model_id, self.generation, self.output = model_id, generation, output
        self.chat = generation.chat
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _usage(self, finish: FinishEvent | None) -> dict:
        completion = finish.completion_tokens if finish is not None else len(self.output.token_ids)
        prompt = len(self.generation.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}

    def whole(self, text: str, reason: str, finish: FinishEvent | None) -> dict:
        choice = {"index": 0, "finish_reason": reason, "token_ids": self.output.token_ids}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._head(False), "choices": [choice], "usage": self._usage(finish)}

    def chunk(self, text: str, reason: str | None, *, first: bool = False, token_ids: list[int] | None = None) -> dict:
        choice = {"index": 0, "finish_reason": reason, "token_ids": token_ids or []}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if first else
                               {} if reason is not None else {"content": text})
        else:
            choice.update(text=text, logprobs=None)
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, finish: FinishEvent | None) -> dict:
        return {**self._head(True), "choices": [], "usage": self._usage(finish)}


def create_app(engine, *, tokenizer=FROM_ARTIFACT, parallel: int | None = None, queue: int = 16,
               model_id: str | None = None, replica_set: Callable[[], Awaitable[ReplicaSet]] | None = None,
               policy: Policy = Policy(), prefill_chunk: int | None = None) -> Starlette:
    """The ASGI app. `engine`: an Engine (its slots bound `parallel`), or an artifact path (then loaded with
    `parallel` slots, default 1). `tokenizer`: a TextTokenizer, None (ids only), or by default the artifact's.
    `replica_set`: where the app is one replica of several, what /health and /metrics add about them.
    `policy`: keys and limits, held by the gate (`runtime/gate.py`) in front of every endpoint.
    `prefill_chunk`: the prompt tokens prefilled a scheduler step, between the running requests' decode steps
    (`Scheduler`; default: `scheduler.PREFILL_CHUNK`).
    The scheduler starts with the app (ASGI lifespan) and its shutdown cancels what is still running. The engine's
    KV caches are made resident here (`Engine.hold_caches`)."""
    if isinstance(engine, (str, Path)):
        from .engine import Engine

        engine = Engine(engine, slots=parallel or 1)
    if tokenizer is FROM_ARTIFACT:
        tokenizer = artifact_tokenizer(engine.directory)
    engine.hold_caches()  # (every slot's cache at full context from the start: no growth as conversations lengthen)
    endpoints = Endpoints(engine, tokenizer, parallel, queue, model_id or Path(engine.directory).name, replica_set,
                          prefill_chunk)

    @asynccontextmanager
    async def lifespan(app):
        endpoints.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(endpoints.scheduler.close)

    app = Starlette(routes=[
        Route("/v1/completions", endpoints.completions, methods=["POST"]),
        Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
        Route("/v1/models", endpoints.models, methods=["GET"]),
        Route("/health", endpoints.health, methods=["GET"]),
        Route("/metrics", endpoints.metrics, methods=["GET"]),
    ], lifespan=lifespan, middleware=[Middleware(Gate, policy=policy, refused=endpoints.rejected)])
    app.state.endpoints = endpoints
    return app


# ---------------------------------------------------------------- running it

def bind(host: str, port: int) -> socket.socket:
    """A listening socket; OSError (say, the port in use) before anything else starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP, and without that
    # a response's separate small writes wait out the client's delayed ACK (~40 ms per request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT from a last run, not a live server
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_server(app, *, log_level: str = "info", graceful_shutdown_s: int = 10):
    """A uvicorn server for the app; run it with `.run(sockets=[bind(...)])`. On SIGINT/SIGTERM it stops
    accepting, gives running requests `graceful_shutdown_s` to finish, then cancels the rest."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s,
                            lifespan="on")
    return uvicorn.Server(config)
