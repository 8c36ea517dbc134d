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
body over the limit (:class:`~.http.BodyLimit`); 400 for a request of more sequences (prompts times ``n``) than
``max_waiting``, 503 with ``Retry-After`` when ``max_waiting`` sequences already wait; with LoRA adapters, 404 for
a ``model`` that is neither the served model's name nor an adapter's (without adapters any name is the one model);
500 when decoding fails. A request's ``model`` chooses an adapter of the engine's bank by name
(``EngineConfig.adapters``; ``/v1/models`` lists them, each with its ``root`` directory and its ``parent``, the
base). With ``n > 1`` choice ``j`` of a seeded request uses ``seed + j``; a list
of prompts answers choice ``i * n + j`` for prompt ``i``'s ``j``-th.

Around it: the streams' plumbing in :mod:`.sse`, the middlewares in :mod:`.http`, the bodies in :mod:`.protocol`, and
running it on a socket (:func:`~.listen.serve`) or in a thread (:class:`~.listen.BackgroundServer`) in :mod:`.listen`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .chat import render_chat
from .decode import Sampling
from .engine import Engine, EngineConfig
from .http import ApiKey, BodyLimit, RequestLog, error_body, validation_message
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import CONTENT_TYPE_LATEST, ServingMetrics
from .protocol import ChatRequest, CompletionRequest, chat_body, completion_body
from .sse import Mailbox, event_stream
from .static import StaticBackend

__all__ = ["create_app", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 1 << 20  #: default limit of a request body (a prompt of the longest context fits many times)


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
    forward=None,
):
    """The FastAPI application serving ``model``. Its scheduler (``app.state.engine``: an :class:`Engine`, or a
    :class:`StaticBackend` with ``batching="static"``, which uses ``window_s``) starts and stops with the app;
    ``app.state.metrics`` are its Prometheus metrics. ``log_requests``: one line per request on stderr. ``forward``: the
    engine's model call when other ranks make it too (:class:`~.ranks.Leader`; continuous batching only)."""
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    metrics = ServingMetrics()
    if batching == "static":
        if engine_config is not None and engine_config.adapters is not None:
            raise ValueError("LoRA adapters are served with continuous batching only")
        backend = StaticBackend(model, tokenizer, max_batch, window_s, logits_fn, metrics)
    else:
        config = engine_config or EngineConfig(max_batch=max_batch)
        backend = Engine(model, tokenizer, config, logits_fn=logits_fn, metrics=metrics, forward=forward)
        metrics.watch(backend)
    context = model.cfg.max_seq_len
    bank = None if batching == "static" else backend.config.adapters

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
        now = int(time.time())
        base = {"id": name, "object": "model", "created": now, "owned_by": "trickles", "max_model_len": context}
        loras = [
            {**base, "id": a, "root": bank.paths[a], "parent": name} for a in (bank.names if bank is not None else ())
        ]
        return {"object": "list", "data": [{**base, "root": name, "parent": None}, *loras]}

    def adapter_of(model_name: str | None):
        """The adapter a request's ``model`` names (None: the base model), or a 404 for a name not served here (with
        adapters only: without any, every name is the one model, as before adapters existed)."""
        if model_name is None or model_name == name or bank is None:
            return None
        if bank is not None and model_name in bank.names:
            return model_name
        served = [name, *(bank.names if bank is not None else ())]
        return error(404, f"the model {model_name!r} is not served here; choose one of {served} (GET /v1/models)")

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def encode(text: str, which: str, chat: bool = False) -> list[int] | JSONResponse:
        # a prompt gets the tokenizer's own special tokens, a rendered chat none (its template wrote them)
        tokens = (tokenizer.encode(text) if chat else tokenizer.encode_prompt(text)) or [tokenizer.eos_id]
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
        adapter: str | None = None,
    ):
        if n * len(prompts) > max_waiting:  # never fits, however long the client waits: not a 503 to retry
            metrics.on_request("rejected")
            return error(
                400,
                f"this request asks for {n * len(prompts)} sequences ({len(prompts)} prompts x n={n}); the server "
                f"queues at most {max_waiting}: send fewer prompts per request or a smaller n",
            )
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
                        **({} if adapter is None else {"adapter": adapter}),
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
                event_stream(events, len(prompts), n, head, chunk, include_usage, cancel_all),
                media_type="text/event-stream",
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
        adapter = adapter_of(req.model)
        if isinstance(adapter, JSONResponse):
            return adapter
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

        echo = [t if req.echo else "" for t in texts]
        offsets: dict[int, int] = {}  # streamed: each choice's text so far, for its tokens' text_offset

        def logprobs(k, records, prompt_records, first):
            start, prompt = offsets.get(k, 0), prompts[k // req.n] if req.echo and first else None
            out = completion_logprobs(tokenizer, records, prompt, prompt_records, start)
            offsets[k] = out.pop("end")
            return out

        def chunk(k, ev, first, records):
            lp = None if req.logprobs is None else logprobs(k, records, ev.prompt_logprobs, first)
            text = (echo[k // req.n] if first else "") + ev.text
            return {**head, "choices": [{"text": text, "index": k, "logprobs": lp, "finish_reason": ev.finish_reason}]}

        def body(h, results):
            out = completion_body(h, results)
            for k, (choice, c) in enumerate(zip(out["choices"], results)):
                choice["text"] = echo[k // req.n] + choice["text"]
                if req.logprobs is not None:
                    choice["logprobs"] = logprobs(k, c.logprobs, c.prompt_logprobs, True)
            return out

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(http, prompts, req.sampling(16), req.n, req.stream, head, chunk, body, include, adapter)

    async def chat(req: ChatRequest, http: HTTPRequest):
        adapter = adapter_of(req.model)
        if isinstance(adapter, JSONResponse):
            return adapter
        try:
            text = render_chat([{"role": m.role, "content": m.text()} for m in req.messages], tokenizer)
        except ValueError as e:
            return error(400, f"messages: {e}")
        tokens = encode(text, "the conversation", chat=True)
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

        def chunk(k, ev, first, records):
            delta = (
                ({"role": "assistant", "content": ev.text} if first else {"content": ev.text})
                if ev.text or first
                else {}
            )
            return {
                **head,
                "choices": [{"index": k, "delta": delta, "logprobs": lp(records), "finish_reason": ev.finish_reason}],
            }

        def lp(records):
            return chat_logprobs(tokenizer, records) if req.logprobs else None

        def body(h, results):
            out = chat_body({**h, "object": "chat.completion"}, results)
            for choice, c in zip(out["choices"], results):
                choice["logprobs"] = lp(c.logprobs)
            return out

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(http, [tokens], sampling, req.n, req.stream, head, chunk, body, include, adapter)

    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat)
    return app
