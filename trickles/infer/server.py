"""An HTTP server with OpenAI-style completions: ``POST /v1/completions`` and ``GET /health`` (FastAPI + uvicorn).

Requests from many clients are decoded together. Each request becomes a :class:`Job` (one row per prompt and
per choice ``n``) on a queue; one worker thread (:class:`Batcher`) owns the model: it takes the first waiting
job, gathers whatever else arrives within ``window_s`` (up to ``max_batch`` rows), and decodes all their rows
in one left-padded batch (:func:`trickles.infer.decode.decode`, each row with its own sampling settings, seed
and stopping). Text goes back to each request's event loop as it becomes final, so ``stream: true`` answers
with server-sent events (``data: {chunk}`` per piece, ``data: [DONE]`` at the end) and a plain request waits
for its whole completion. A batch runs to its end before the next starts (static batching).

Bad requests get a 4xx with ``{"error": {"message": ..., "type": "invalid_request_error"}}``: malformed JSON,
unknown fields, values out of range (negative ``max_tokens``, ...), a prompt that leaves no room in the
model's context. ``max_tokens`` beyond the context is shortened (``finish_reason: "length"``). With ``n > 1``,
choice ``j`` of a seeded request uses ``seed + j``. ``trickles serve`` logs one line per request on stderr
(client, method, path, status, milliseconds to the response's last byte).
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .decode import Completion, Sampling, decode

__all__ = ["Job", "Batcher", "create_app", "serve"]


@dataclass
class Job:
    """One request's rows. ``emit(row, text, finish_reason)`` and ``finish(completions or exception)`` are called
    from the worker thread."""

    prompts: list[list[int]]
    settings: list[Sampling]
    emit: Callable[[int, str, str | None], None] = lambda row, text, reason: None
    finish: Callable[[object], None] = lambda result: None


class Batcher:
    """The worker thread that owns the model and decodes waiting jobs together (see the module's notes)."""

    def __init__(self, model, tokenizer, max_batch: int = 32, window_s: float = 0.01, logits_fn=None):
        self.model, self.tokenizer, self.logits_fn = model, tokenizer, logits_fn
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.batches: list[int] = []  #: jobs per batch run so far
        self._thread: threading.Thread | None = None
        self._carry: Job | None = None

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trickles-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finishes the batch in progress, fails jobs still waiting, and ends the thread."""
        self.queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _next_batch(self) -> list[Job] | None:
        first = self._carry or self.queue.get()
        self._carry = None
        if first is None:
            return None
        jobs, rows = [first], len(first.prompts)
        deadline = time.monotonic() + self.window_s
        while rows < self.max_batch:
            try:
                job = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None or rows + len(job.prompts) > self.max_batch:
                self._carry = job  # the next batch starts with it (or stops)
                if job is None:
                    self.queue.put(None)
                    self._carry = None
                break
            jobs.append(job)
            rows += len(job.prompts)
        return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._next_batch()
            if jobs is None:
                break
            self.run(jobs)
        while True:  # refuse what is still waiting
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.finish(RuntimeError("the server is shutting down"))

    def run(self, jobs: list[Job]) -> None:
        """Decodes the rows of ``jobs`` in one batch (in the calling thread)."""
        self.batches.append(len(jobs))
        owner = [(j, r) for j in jobs for r in range(len(j.prompts))]
        try:
            out = decode(self.model, [p for j in jobs for p in j.prompts], [s for j in jobs for s in j.settings],
                         eos_id=self.tokenizer.eos_id, tokenizer=self.tokenizer, logits_fn=self.logits_fn,
                         on_text=lambda row, text, reason: owner[row][0].emit(owner[row][1], text, reason))
        except Exception as e:  # noqa: BLE001 -- reported to every request of the batch, the server goes on
            for j in jobs:
                j.finish(e)
            return
        start = 0
        for j in jobs:
            j.finish(out[start:start + len(j.prompts)])
            start += len(j.prompts)


def _request_model():
    from pydantic import BaseModel, ConfigDict, Field

    class CompletionRequest(BaseModel):
        """The body of ``POST /v1/completions`` (OpenAI's fields that apply; any other field is refused)."""

        model_config = ConfigDict(extra="forbid")
        prompt: str | list[str]
        model: str | None = None
        max_tokens: int = Field(16, ge=0)
        temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=0)
        repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
        stop: str | list[str] | None = None
        seed: int | None = None
        n: int = Field(1, ge=1, le=16)
        stream: bool = False

    return CompletionRequest


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


def _validation_message(exc) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


class RequestLog:
    """ASGI middleware: one line per HTTP request once its response has been sent whole (a stream's too):
    ``[trickles] 127.0.0.1 POST /v1/completions 200 183 ms``, to ``write`` (default: stderr)."""

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
                self.write(f"[trickles] {client} {scope['method']} {scope['path']} {status[0]} "
                           f"{(time.perf_counter() - started) * 1e3:.0f} ms")

        await self.app(scope, receive, logged)


def create_app(model, tokenizer, name: str = "trickles", max_batch: int = 32, window_s: float = 0.01, logits_fn=None,
               log_requests: bool = False):
    """The FastAPI application serving ``model``; its :class:`Batcher` starts and stops with the app (``app.state.batcher``).
    ``log_requests``: one line per request on stderr (:class:`RequestLog`)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.exceptions import HTTPException

    CompletionRequest = _request_model()
    batcher = Batcher(model, tokenizer, max_batch, window_s, logits_fn)
    context = model.cfg.max_seq_len

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, batcher.stop)

    app = FastAPI(title="trickles", lifespan=lifespan)
    app.state.batcher = batcher
    if log_requests:
        app.add_middleware(RequestLog)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "context": context}

    async def completions(req):
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts:
            return _error(400, "prompt: give a string or a non-empty list of strings")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if any(not s for s in stop):
            return _error(400, "stop: stop strings must not be empty")
        ids = []
        for i, p in enumerate(prompts):
            tokens = tokenizer.encode(p) or [tokenizer.eos_id]
            if len(tokens) >= context:
                which = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                return _error(400, f"{which} is {len(tokens)} tokens; this model's context is {context} tokens, "
                                   f"so a prompt may have at most {context - 1}")
            ids.append(tokens)
        rows, settings = [], []
        for p in ids:
            for j in range(req.n):
                rows.append(p)
                settings.append(Sampling(max_new_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                                         top_p=req.top_p, repetition_penalty=req.repetition_penalty, stop=stop,
                                         seed=None if req.seed is None else req.seed + j))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(rows, settings,
                  emit=lambda row, text, reason: loop.call_soon_threadsafe(events.put_nowait, ("text", row, text, reason)),
                  finish=lambda result: loop.call_soon_threadsafe(events.put_nowait, ("done", result, None, None)))
        batcher.submit(job)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or name}
        if req.stream:
            return StreamingResponse(_stream(events, head), media_type="text/event-stream")
        while True:
            kind, result, _, _ = await events.get()
            if kind == "done":
                break
        if isinstance(result, BaseException):
            return _error(500, f"decoding failed: {result}", "server_error")
        return _response(head, result)

    completions.__annotations__["req"] = CompletionRequest  # a class made here: FastAPI needs it, not its name
    app.post("/v1/completions")(completions)
    return app


def _response(head: dict, result: list[Completion]) -> dict:
    completion = sum(len(c.tokens) for c in result)
    prompt = sum(c.prompt_tokens for c in result)
    return {**head, "choices": [{"text": c.text, "index": i, "logprobs": None, "finish_reason": c.finish_reason}
                                for i, c in enumerate(result)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


async def _stream(events: asyncio.Queue, head: dict):
    def chunk(row, text, reason):
        body = {**head, "choices": [{"text": text, "index": row, "logprobs": None, "finish_reason": reason}]}
        return f"data: {json.dumps(body)}\n\n"

    while True:
        kind, a, b, c = await events.get()
        if kind == "done":
            if isinstance(a, BaseException):
                yield f"data: {json.dumps({'error': {'message': f'decoding failed: {a}', 'type': 'server_error'}})}\n\n"
            break
        yield chunk(a, b, c)
    yield "data: [DONE]\n\n"


def serve(model, tokenizer, host: str = "127.0.0.1", port: int = 8000, name: str = "trickles", max_batch: int = 32,
          on_ready: Callable[[str, int], None] | None = None) -> None:
    """Serves ``model`` until interrupted. The socket is bound here (``port=0``: a free port), and ``on_ready(host,
    port)`` is told the address before uvicorn starts accepting connections."""
    import socket

    import uvicorn

    app = create_app(model, tokenizer, name=name, max_batch=max_batch, log_requests=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    if on_ready is not None:
        on_ready(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
