"""An HTTP server with OpenAI's API (FastAPI + uvicorn) over the continuous-batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (messages rendered by :mod:`.chat`), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, :mod:`.metrics`). Each prompt becomes a request of
:class:`~trickles.infer.engine.Engine`, which owns the model in one worker thread and schedules per iteration;
``batching="static"`` puts the static batcher of :mod:`.static` in its place (for comparison). Text goes back to
the request's event loop as it becomes final, so ``stream: true`` answers with server-sent events (``data:
{chunk}`` per piece, ``data: [DONE]`` at the end) and a plain request waits for its whole answer. A client that
goes away (a stream closed, or a plain request's connection dropped) cancels its sequences, which free their
KV blocks at the engine's next iteration.

Refusals, each a JSON error ``{"error": {"message", "type"}}``, the server alive after each: 400 for malformed JSON,
unknown fields, values out of range, a prompt that leaves no room in the context or needs more KV blocks than
the pool has, empty ``messages`` or an unknown role; 401 without the API key (:class:`~.http.ApiKey`); 413 for a
body over the limit (:class:`~.http.BodyLimit`); 503 with ``Retry-After`` when ``max_waiting`` sequences already
wait; 500 when decoding fails. With ``n > 1`` choice ``j`` of a seeded request uses ``seed + j``; a list of
prompts answers choice ``i * n + j`` for prompt ``i``'s ``j``-th.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .chat import render_chat
from .decode import Sampling
from .engine import Engine, EngineConfig, Event
from .http import ApiKey, BodyLimit, RequestLog, error_body, validation_message
from .metrics import CONTENT_TYPE_LATEST, ServingMetrics
from .protocol import ChatRequest, CompletionRequest, chat_body, completion_body, usage
from .static import Batcher, Job

__all__ = ["create_app", "serve", "BackgroundServer", "StaticBackend", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 1 << 20  #: default limit of a request body (a prompt of the longest context fits many times)


class StaticBackend:
    """The static :class:`~.static.Batcher` behind the engine's ``submit`` (no cancellation: a batch runs out)."""

    def __init__(self, model, tokenizer, max_batch: int, window_s: float, logits_fn=None, metrics=None):
        self.batcher = Batcher(model, tokenizer, max_batch, window_s, logits_fn)
        self.metrics = metrics

    @property
    def backlog(self) -> int:
        """Jobs waiting for a batch."""
        return self.batcher.queue.qsize()

    def submit(self, prompt, sampling: Sampling, n: int = 1, *, on_event, on_finish) -> Job:
        settings = [sampling.for_choice(j) for j in range(n)]

        def finish(result):
            if self.metrics is not None:
                self.metrics.on_request("error" if isinstance(result, BaseException) else "ok")
                if not isinstance(result, BaseException):
                    self.metrics.on_tokens(sum(c.prompt_tokens for c in result), sum(len(c.tokens) for c in result))
            on_finish(result)

        job = Job(
            [list(prompt)] * n,
            settings,
            emit=lambda row, text, reason: on_event(Event(row, None, text, reason)),
            finish=finish,
        )
        self.batcher.submit(job)
        return job

    def cancel(self, handle) -> None:
        """A static batch cannot drop a row; the request's output is ignored."""

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()


class Mailbox:
    """Hands items from the engine's thread to queues of one event loop, waking the loop once per burst rather than
    once per item (an iteration of the engine posts a token to every running sequence)."""

    _boxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        box = cls._boxes.get(loop)
        if box is None:
            box = cls._boxes[loop] = cls(loop)
        return box

    def __call__(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def create_app(
    model,
    tokenizer,
    name: str = "trickles",
    max_batch: int = 32,
    window_s: float = 0.01,
    logits_fn=None,
    log_requests: bool = False,
    *,
    batching: str = "continuous",
    engine_config: EngineConfig | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_waiting: int = 1024,
):
    """The FastAPI application serving ``model``. Its scheduler (``app.state.engine``: an :class:`Engine`, or a
    :class:`StaticBackend` with ``batching="static"``, which uses ``window_s``) starts and stops with the app;
    ``app.state.metrics`` are its Prometheus metrics. ``log_requests``: one line per request on stderr."""
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    metrics = ServingMetrics()
    if batching == "static":
        backend = StaticBackend(model, tokenizer, max_batch, window_s, logits_fn, metrics)
    else:
        config = engine_config or EngineConfig(max_batch=max_batch)
        backend = Engine(model, tokenizer, config, logits_fn=logits_fn, metrics=metrics)
        metrics.watch(backend)
    context = model.cfg.max_seq_len

    @asynccontextmanager
    async def lifespan(app):
        backend.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, backend.stop)

    app = FastAPI(title="trickles", lifespan=lifespan)
    app.state.engine, app.state.metrics = backend, metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)  # added last = outermost: log, then key, then size
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    if log_requests:
        app.add_middleware(RequestLog)

    def error(status: int, message: str, kind: str = "invalid_request_error", headers=None):
        return JSONResponse(status_code=status, content=error_body(message, kind), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError):
        return error(400, validation_message(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, exc: HTTPException):
        return error(
            exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "invalid_request_error"
        )

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "context": context}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "trickles",
                    "max_model_len": context,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def encode(text: str, which: str) -> list[int] | JSONResponse:
        tokens = tokenizer.encode(text) or [tokenizer.eos_id]
        if len(tokens) >= context:
            return error(
                400,
                f"{which} is {len(tokens)} tokens; this model's context is {context} tokens, "
                f"so a prompt may have at most {context - 1}",
            )
        return tokens

    async def run(
        http: HTTPRequest,
        prompts: list[list[int]],
        sampling: Sampling,
        n: int,
        stream: bool,
        head: dict,
        chunk: Callable,
        body: Callable,
        include_usage: bool = False,
    ):
        if backend.backlog + n * len(prompts) > max_waiting:
            metrics.on_request("rejected")
            return error(
                503,
                f"the server is at capacity ({backend.backlog} waiting); retry shortly",
                "server_error",
                headers={"Retry-After": "1"},
            )
        post = Mailbox.of(asyncio.get_running_loop())
        events: asyncio.Queue = asyncio.Queue()
        handles = []
        try:
            for i, p in enumerate(prompts):
                handles.append(
                    backend.submit(
                        p,
                        sampling,
                        n,
                        on_event=lambda ev, i=i: post(events, ("event", i, ev)),
                        on_finish=lambda r, i=i: post(events, ("done", i, r)),
                    )
                )
        except ValueError as e:
            for h in handles:
                backend.cancel(h)
            metrics.on_request("rejected")
            return error(400, str(e))

        def cancel_all():
            for h in handles:
                backend.cancel(h)

        if stream:
            return StreamingResponse(
                _stream(events, len(prompts), n, head, chunk, include_usage, cancel_all), media_type="text/event-stream"
            )
        results: dict[int, object] = {}
        checked = time.monotonic()
        while len(results) < len(prompts):
            try:
                kind, i, x = await asyncio.wait_for(events.get(), timeout=0.25)
                if kind == "done":
                    results[i] = x
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - checked >= 0.25:  # every quarter second, events or not
                checked = time.monotonic()
                if await http.is_disconnected():
                    cancel_all()
                    return Response(status_code=499)
        failed = [r for r in results.values() if isinstance(r, BaseException)]
        if failed:
            return error(500, f"decoding failed: {failed[0]}", "server_error")
        return body(head, [c for i in range(len(prompts)) for c in results[i]])

    async def completions(req: CompletionRequest, http: HTTPRequest):
        texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not texts:
            return error(400, "prompt: give a string or a non-empty list of strings")
        prompts = []
        for i, t in enumerate(texts):
            tokens = encode(t, "prompt" if len(texts) == 1 else f"prompt[{i}]")
            if isinstance(tokens, JSONResponse):
                return tokens
            prompts.append(tokens)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or name,
        }

        def chunk(k, ev, first):
            return {
                **head,
                "choices": [{"text": ev.text, "index": k, "logprobs": None, "finish_reason": ev.finish_reason}],
            }

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(http, prompts, req.sampling(16), req.n, req.stream, head, chunk, completion_body, include)

    async def chat(req: ChatRequest, http: HTTPRequest):
        try:
            text = render_chat([{"role": m.role, "content": m.text()} for m in req.messages], tokenizer)
        except ValueError as e:
            return error(400, f"messages: {e}")
        tokens = encode(text, "the conversation")
        if isinstance(tokens, JSONResponse):
            return tokens
        sampling = req.sampling(context)
        if req.max_completion_tokens is not None:
            sampling.max_new_tokens = req.max_completion_tokens
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model or name,
        }

        def chunk(k, ev, first):
            delta = (
                ({"role": "assistant", "content": ev.text} if first else {"content": ev.text})
                if ev.text or first
                else {}
            )
            return {
                **head,
                "choices": [{"index": k, "delta": delta, "logprobs": None, "finish_reason": ev.finish_reason}],
            }

        def body(h, results):
            return chat_body({**h, "object": "chat.completion"}, results)

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(http, [tokens], sampling, req.n, req.stream, head, chunk, body, include)

    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat)
    return app


async def _stream(
    events: asyncio.Queue,
    prompts: int,
    n: int,
    head: dict,
    chunk: Callable,
    include_usage: bool,
    cancel: Callable[[], None],
):
    """Server-sent events of one request; closing the stream early cancels what is still decoding."""
    done, started, results, failed = 0, set(), [], False
    try:
        while done < prompts and not failed:
            out = []
            kind, i, x = await events.get()
            while True:  # everything already queued goes out in one write
                if kind == "done":
                    done += 1
                    if isinstance(x, BaseException):
                        out.append(f"data: {json.dumps(error_body(f'decoding failed: {x}', 'server_error'))}\n\n")
                        failed = True
                        break
                    results.extend(x)
                else:
                    ev: Event = x
                    k = i * n + ev.row
                    if ev.text or ev.finish_reason is not None or k not in started:
                        out.append(f"data: {json.dumps(chunk(k, ev, k not in started))}\n\n")
                        started.add(k)
                if events.empty():
                    break
                kind, i, x = events.get_nowait()
            if out:
                yield "".join(out)
        if include_usage and done == prompts and not failed:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(results)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if done < prompts:
            cancel()


def serve(
    model,
    tokenizer,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str = "trickles",
    max_batch: int = 32,
    on_ready: Callable[[str, int], None] | None = None,
    **app_options,
) -> None:
    """Serves ``model`` until interrupted. The socket is bound here (``port=0``: a free port), and ``on_ready(host,
    port)`` is told the address before uvicorn starts accepting connections. ``app_options`` go to
    :func:`create_app`; without ``api_key`` on an address other than loopback, one warning line goes to stderr."""
    import socket

    import uvicorn

    if not app_options.get("api_key") and not _loopback(host):
        print(
            f"[trickles] warning: listening on {host} without --api-key: anyone who can reach this address may "
            "use the model",
            file=sys.stderr,
            flush=True,
        )
    app = create_app(model, tokenizer, name=name, max_batch=max_batch, log_requests=True, **app_options)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    if on_ready is not None:
        on_ready(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


class BackgroundServer:
    """An application served by uvicorn in a thread of this process (tests, benchmarks, notebooks): ``port``, and
    ``stop()``, which shuts it down (the app's engine with it) and waits for the thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, port))
        self.port, self.timeout_s = sock.getsockname()[1], timeout_s
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {host}:{self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the server on port {self.port} did not shut down within {self.timeout_s:g} s")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
