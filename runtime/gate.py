"""The server's gate: who may use it and how much one request may take, checked before an endpoint runs.

`Gate` is ASGI middleware around the app (`serve.create_app`), over a `Policy`:
- keys: with `api_keys`, every path but /health needs `Authorization: Bearer KEY` with one of them (401 without);
- requests at once: past `max_requests` answered or streaming, a request is refused (429, Retry-After);
- body size: a body over `max_body_bytes` is refused (413) before the endpoint sees any of it, by its
  Content-Length where it sends one, else as its bytes arrive;
- CORS: browsers' cross-origin requests only from `cors_origins` (none unless asked).
Each refusal is the OpenAI error body (`error_response`) and is counted in `refused` (by reason) for /metrics.
Starlette (the serve extra) is imported where a response is made, so the command line reads `Policy`'s defaults
without it.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

RETRY_AFTER_S = 1  # what a refusal for a full queue or too many requests tells the client to wait
MAX_BODY_BYTES = 1 << 20  # a request body's bound: a prompt of the longest context as ids is ~10 bytes a token
MAX_REQUESTS = 256  # requests answered at once (each holds a connection and a task; a slot or a queue place)
PUBLIC_PATHS = frozenset({"/health"})  # answered without a key: a load balancer's probe holds none
KEY_VARIABLE = "PICOMPILE_API_KEY"  # the environment variable `serve` reads a key from


@dataclass(frozen=True)
class Policy:
    api_keys: frozenset[str] = frozenset()  # empty: no key asked
    max_body_bytes: int = MAX_BODY_BYTES
    max_requests: int = MAX_REQUESTS
    cors_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class ApiError:
    """An error answer: its status, the OpenAI error body's fields and the headers beside it."""

    status: int
    message: str
    kind: str  # the body's "type"
    param: str | None = None
    code: str | None = None
    headers: dict | None = None

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}: a whole answer's body, a stream's error chunk."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self):
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_unavailable(message: str) -> ApiError:
    """503 `engine_unavailable`: the engine (a stage, a replica) could not run the request now; it may be sent
    again after Retry-After."""
    return ApiError(503, message, "server_unavailable", code="engine_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None):
    """The OpenAI error body's response (`ApiError`)."""
    return ApiError(status, message, kind, param, code, headers).response()


def read_keys(keys: list[str], key_file: Path | None, environment: dict | None = None) -> frozenset[str]:
    """The keys a server takes: `keys` (--api-key), the lines of `key_file` (--api-key-file; blank lines and
    lines starting with # skipped) and the environment's PICOMPILE_API_KEY. ValueError for a key file that
    cannot be read or holds no key, or a key with whitespace in it."""
    found = list(keys)
    if key_file is not None:
        try:
            lines = key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or error
            raise ValueError(f"cannot read the key file {key_file}: {reason}") from None
        listed = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not listed:
            raise ValueError(f"the key file {key_file} holds no key (one per line)")
        found += listed
    variable = (os.environ if environment is None else environment).get(KEY_VARIABLE, "").strip()
    if variable:
        found.append(variable)
    for key in found:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be one word, without spaces")
    return frozenset(found)


class Gate:
    """ASGI middleware holding `app` behind `policy` (see the module's docstring)."""

    def __init__(self, app, policy: Policy, refused: dict[str, int]):
        from starlette.middleware.cors import CORSMiddleware

        self.policy, self.refused = policy, refused
        self.app = (CORSMiddleware(app, allow_origins=list(policy.cors_origins), allow_methods=["GET", "POST"],
                                   allow_headers=["Authorization", "Content-Type"])
                    if policy.cors_origins else app)
        self._keys = [key.encode() for key in policy.api_keys]
        self.in_flight = 0  # the event loop's only: no lock

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # (the lifespan)
            return await self.app(scope, receive, send)
        if scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        if scope["method"] != "OPTIONS" and not self._authorized(scope):  # (a CORS preflight carries no key)
            return await self._refuse("unauthorized", error_response(
                401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'", "invalid_request_error",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), scope, receive, send)
        if self.in_flight >= self.policy.max_requests:
            return await self._refuse("too_many_requests", error_response(
                429, f"server busy: {self.policy.max_requests} requests are being answered; retry later",
                "server_busy", code="too_many_requests", headers={"Retry-After": str(RETRY_AFTER_S)}),
                scope, receive, send)
        self.in_flight += 1
        try:
            if scope["method"] == "POST":
                body = await self._body(scope, receive)
                if body is None:
                    return await self._refuse("body_too_large", error_response(
                        413, f"the request body is larger than this server takes ({self.policy.max_body_bytes} "
                        "bytes)", "invalid_request_error", code="body_too_large"), scope, receive, send)
                receive = replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _authorized(self, scope) -> bool:
        if not self._keys:
            return True
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        # every key compared, each in constant time: how long a refusal takes says nothing of the keys
        matched = [hmac.compare_digest(token, key) for key in self._keys]
        return scheme.lower() == b"bearer" and any(matched)

    async def _body(self, scope, receive) -> bytes | None:
        """The whole request body, or None once it is over the bound (by its Content-Length, or as it arrives)."""
        limit = self.policy.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _refuse(self, reason: str, response, scope, receive, send) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        await response(scope, receive, send)


def replay(body: bytes, receive):
    """A receive that gives the body read already, then the connection's own messages (its disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
