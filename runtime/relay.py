"""An HTTP request relayed to an app in another process, as a stream of ASGI messages, and its failures answered.

`serve --ray` puts a front before its replicas so that a replica that dies ends its requests with the project's
error body instead of Serve's bare 500 or a cut stream. Two halves, each a plain ASGI piece (no Ray here):

* `Relay`, the front's app: reads a request's body (up to a bound), hands the request to `call(scope, body)` (an
  async iterator of the ASGI messages the far app sends) and sends them on. Where the call fails (the far side
  died), the client gets a 503 `engine_unavailable` error body, or, when a streamed answer had started, that
  body as its last event and `[DONE]` (a whole answer that had started is cut: its status is already sent). A
  client that leaves cancels the call.
* `asgi_messages(app, scope, body)`, the replica's side: runs its app on the request and yields what the app
  sends; when its consumer stops (the client left, the call was cancelled), the app's `receive` reports the
  disconnect, so the request's job is cancelled as a direct client's would be. `AppLifespan` starts and stops
  such an app, which no server runs, through its ASGI lifespan.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from .gate import ApiError, engine_unavailable, replay
from .serve import SSE_DONE, sse

# what of an HTTP scope crosses to the far side (plain data; the app, its state and extensions stay here)
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
              "headers", "client", "server")
_END = object()


def unavailable(reason: str) -> ApiError:
    """The answer to a request whose replica failed under it (Serve starts a replacement within seconds)."""
    return engine_unavailable(f"the replica serving the request failed ({reason}); retry it")


def plain_scope(scope: dict) -> dict:
    """The parts of an HTTP scope another process can be given (bytes in headers as lists of pairs)."""
    out = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    out["headers"] = [(bytes(name), bytes(value)) for name, value in scope.get("headers", [])]
    return out


class Relay:
    """The front's ASGI app (see the module doc). `max_body_bytes`: the most of a body read and passed on (the far
    app's own limit answers a longer one: it sees the first bytes past its bound and the request's headers)."""

    def __init__(self, call: Callable[[dict, bytes], AsyncIterator[dict]], max_body_bytes: int):
        self.call, self.max_body_bytes = call, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # nothing of the front's own to start or stop
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body, gone = await self._body(receive)
        if gone:
            return
        relay = asyncio.ensure_future(self._relay(plain_scope(scope), body, send))
        watch = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not relay.done():  # the client left: the far call is cancelled with it
                relay.cancel()
        if relay.done() and not relay.cancelled():
            relay.result()

    async def _body(self, receive) -> tuple[bytes, bool]:
        """The request's body, cut past max_body_bytes + 1, and whether the client left while it was read."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            if size <= self.max_body_bytes:
                parts.append(chunk[: self.max_body_bytes + 1 - size])
                size += len(parts[-1])
            if not message.get("more_body", False):
                return b"".join(parts), False

    async def _relay(self, scope: dict, body: bytes, send) -> None:
        started, streamed, ended = False, False, False
        try:
            async for message in self.call(scope, body):
                if message["type"] == "http.response.start":
                    started = True
                    streamed = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                                   for name, value in message.get("headers", []))
                elif message["type"] == "http.response.body" and not message.get("more_body", False):
                    ended = True
                await send(message)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the far side failed (a replica that died); its app's own errors are answers
            if ended:
                return
            answer = unavailable(type(error).__name__)
            if not started:
                await answer.response()(scope, _no_receive, send)
            elif streamed:
                tail = (sse(answer.body()) + SSE_DONE).encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            else:
                raise  # a whole answer half sent: the connection is closed on the client


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _no_receive():  # (a whole answer's response reads nothing)
    return {"type": "http.disconnect"}


async def asgi_messages(app: Callable[..., Awaitable[None]], scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run `app` on one HTTP request of `body` and yield the messages it sends (see the module doc)."""
    queue: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()

    async def disconnect():
        await left.wait()
        return {"type": "http.disconnect"}

    receive = replay(body, disconnect)

    async def send(message):
        if left.is_set():
            raise OSError("the client left")  # (as a server's send to a closed connection)
        await queue.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            queue.put_nowait(_END)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not _END:
            yield message
        await task
    finally:
        left.set()  # a consumer that stopped early: the app sees its client leave and ends the request
        if not task.done():
            await asyncio.wait({task}, timeout=5)


class AppLifespan:
    """An ASGI app's lifespan, run by hand: `startup` before its first request, `shutdown` after its last."""

    def __init__(self, app):
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task = None

    async def _step(self, event: str) -> None:
        await self._to_app.put({"type": f"lifespan.{event}"})
        answer = await self._from_app.get()
        if answer["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(f"the app's {event} failed: {answer.get('message', answer['type'])}")

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._step("startup")

    async def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            await self._step("shutdown")
            await self._task
