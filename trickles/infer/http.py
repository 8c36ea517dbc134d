"""The server's HTTP plumbing apart from its routes: JSON errors, and three ASGI middlewares.

* :class:`RequestLog`: one line per request once its response has been sent whole (a stream's too),
  ``[trickles] 127.0.0.1 POST /v1/completions 200 183 ms``.
* :class:`ApiKey`: with a key, every path but ``/health`` needs ``Authorization: Bearer KEY`` (vLLM's
  ``--api-key``); the header is compared in constant time (``hmac.compare_digest``, a key of another length
  included) and a request without it gets 401 before its body is read.
* :class:`BodyLimit`: a body over ``limit`` bytes gets 413 before anything parses it: at once from its
  ``Content-Length``, or as soon as a chunked body passes the limit; a body within it is handed on whole.
"""

from __future__ import annotations

import hmac
import json
import sys
import time

__all__ = ["ApiKey", "BodyLimit", "RequestLog", "error_body", "send_error", "validation_message"]


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind}}


async def send_error(send, status: int, message: str, kind: str, headers: tuple = ()) -> None:
    """A JSON error answered straight from ASGI (no application involved)."""
    body = json.dumps(error_body(message, kind)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def validation_message(exc) -> str:
    """One line from pydantic's errors: what is wrong with which field."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            msg = str(e.get("msg")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


class RequestLog:
    """ASGI middleware: one line per HTTP request, to ``write`` (default: stderr)."""

    def __init__(self, app, write=None):
        self.app = app
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                client = (scope.get("client") or ("-",))[0]
                self.write(
                    f"[trickles] {client} {scope['method']} {scope['path']} {status[0]} "
                    f"{(time.perf_counter() - started) * 1e3:.0f} ms"
                )

        await self.app(scope, receive, logged)


class ApiKey:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every path but ``/health`` (see the module's notes)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await send_error(
                send,
                401,
                "a valid API key is required: send the header 'Authorization: Bearer "
                "KEY' with the key the server was started with",
                "authentication_error",
                ((b"www-authenticate", b"Bearer"),),
            )
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: request bodies of at most ``limit`` bytes (see the module's notes)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), [False]

        async def replay():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send):
        await send_error(
            send,
            413,
            f"the request body is larger than the server's limit of {self.limit} bytes: send a shorter prompt",
            "invalid_request_error",
        )
