"""runtime/relay.py, the front and replica halves of `serve --ray` without Ray: a request relayed as ASGI messages
equals the app's own answer; a far side that fails before, during or after an answer; a client that leaves; the
body bound; an app's lifespan run by hand. (tests/test_ray_serve.py runs them on Ray, a replica killed.)"""

import asyncio
import contextlib
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runtime.gate import replay
from runtime.relay import AppLifespan, Relay, asgi_messages

SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
         "path": "/echo", "raw_path": b"/echo", "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1),
         "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")]}


def make_app(events: list):
    async def echo(request):
        return JSONResponse({"got": (await request.body()).decode()})

    async def stream(request):
        async def chunks():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        events.append("started")
        yield
        events.append("stopped")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream, methods=["POST"])],
                     lifespan=lifespan)


async def client(app, scope, body: bytes, leave_after: int | None = None):
    """Send `body` to `app`, collect what it sends (stopping, as a client that leaves, after `leave_after`
    messages): (status, headers, body bytes)."""
    sent, left = [], asyncio.Event()

    async def disconnect():
        await left.wait()
        return {"type": "http.disconnect"}

    receive = replay(body, disconnect)

    async def send(message):
        sent.append(message)
        if leave_after is not None and len(sent) >= leave_after:
            left.set()

    await asyncio.wait_for(app(scope, receive, send), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def far(app):
    """A call to `app` as the front makes one (the scope crossing as plain data)."""
    return lambda scope, body: asgi_messages(app, scope, body)


def test_a_relayed_request_is_answered_as_the_app_answers_it():
    app = make_app([])
    direct = asyncio.run(client(app, SCOPE, b'{"a": 1}'))
    relayed = asyncio.run(client(Relay(far(app), 1 << 20), SCOPE, b'{"a": 1}'))
    assert relayed == direct and json.loads(relayed[2]) == {"got": '{"a": 1}'}


def test_a_body_past_the_bound_reaches_the_app_cut_one_byte_past_it():
    app = make_app([])
    status, _, body = asyncio.run(client(Relay(far(app), 10), SCOPE, b"x" * 100))
    assert status == 200 and json.loads(body)["got"] == "x" * 11


def failing(before: int):
    """A far side that sends `before` messages of a streamed answer, then dies."""
    async def call(scope, body):
        if before:
            yield {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
        for i in range(before - 1):
            yield {"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True}
        raise ConnectionError("the replica died")
    return call


def test_a_far_side_that_dies_before_answering_is_a_503_error_body():
    status, headers, body = asyncio.run(client(Relay(failing(0), 1 << 20), SCOPE, b"{}"))
    assert status == 503 and headers[b"retry-after"] == b"1"
    error = json.loads(body)["error"]
    assert error["code"] == "engine_unavailable" and "ConnectionError" in error["message"]


def test_a_stream_whose_far_side_dies_ends_with_the_error_event_and_done():
    status, _, body = asyncio.run(client(Relay(failing(3), 1 << 20), SCOPE, b"{}"))
    events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[:2] == ["0", "1"] and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"


def test_a_client_that_leaves_closes_the_far_apps_stream():
    events = []
    app = make_app(events)
    scope = {**SCOPE, "path": "/stream", "raw_path": b"/stream"}
    status, _, body = asyncio.run(client(Relay(far(app), 1 << 20), scope, b"", leave_after=4))
    assert status == 200 and body.startswith(b"data: 0\n\n")
    assert events == ["stream closed"]  # (ended at the disconnect, not after its 1000 chunks)


def test_an_apps_lifespan_run_by_hand():
    events = []

    async def run():
        lifespan = AppLifespan(make_app(events))
        await lifespan.startup()
        assert events == ["started"]
        await lifespan.shutdown()

    asyncio.run(run())
    assert events == ["started", "stopped"]

    async def broken(scope, receive, send):
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no engine"})

    with pytest.raises(RuntimeError, match="no engine"):
        asyncio.run(AppLifespan(broken).startup())
