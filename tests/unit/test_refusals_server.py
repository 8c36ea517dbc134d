"""Every refusal of a bad request to ``trickles serve`` is pinned: a 4xx with an OpenAI-style error naming the field
(docs/testing.md, "Refusals"). The cases tests/e2e/test_inference.py sends through a real server are not repeated;
these call the application in this process (ASGI), before anything is decoded (no engine runs: a request the
checks let through times out)."""

from __future__ import annotations

import asyncio
import json

import pytest


def _app(log_requests: bool = False, **options):
    from trickles.data import ByteTokenizer
    from trickles.infer.server import create_app
    from trickles.models import ModelConfig, build_model

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=260, max_seq_len=8)
    return create_app(
        build_model(cfg, seed=0).eval(), ByteTokenizer(), name="tiny", log_requests=log_requests, **options
    )


@pytest.fixture(scope="module")
def app():
    return _app()


def _post(
    app, body, path: str = "/v1/completions", headers=(), chunks: list[bytes] | None = None, method: str = "POST"
) -> tuple[int, dict]:
    """``POST path`` with ``body`` (JSON; or the raw ``chunks`` of a chunked body) through the ASGI application:
    ``(status, json body)``."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    chunks = chunks if chunks is not None else [json.dumps(body).encode()]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    out = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        out.append(message)

    # a request that gets past the checks waits for the batcher, which is not running here: fail, do not hang
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
    status = next(m["status"] for m in out if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"))


@pytest.mark.parametrize(
    "body,words",
    [
        ({"prompt": []}, "prompt: give a string or a non-empty list of strings"),
        ({"prompt": "a", "stop": ["x", ""]}, "stop: stop strings must not be empty"),
        ({"prompt": ["a", "yyyyyyyy"]}, "prompt[1] is 8 tokens; this model's context is 8 tokens"),
        ({"prompt": "a", "temperature": -1}, "temperature: Input should be greater than or equal to 0"),
        ({"prompt": "a", "top_k": -1}, "top_k: Input should be greater than or equal to 0"),
        ({"prompt": "a", "top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty: Input should be greater than or equal to 0.01"),
        ({"prompt": "a", "seed": 2**64}, "seed: Input should be less than or equal to 9223372036854775807"),
        ({"prompt": "\ud800"}, "prompt: text must be valid Unicode: character 0 is a lone surrogate"),
        ({"prompt": "a", "stop": ["x", "\udfff"]}, "stop: text must be valid Unicode"),
        ({"prompt": ["a"] * 1025}, "this request asks for 1025 sequences (1025 prompts x n=1); the server queues at"),
        ({"prompt": "a", "n": 0}, "n: Input should be greater than or equal to 1"),
        ({"prompt": "a", "n": 17}, "n: Input should be less than or equal to 16"),
    ],
    ids=[
        "empty-list",
        "empty-stop",
        "long-in-list",
        "temperature",
        "top_k",
        "top_p-above-1",
        "repetition_penalty",
        "seed-over-64-bits",
        "lone-surrogate",
        "lone-surrogate-in-stop",
        "more-sequences-than-ever-queued",
        "n-0",
        "n-17",
    ],
)
def test_bad_requests_are_refused_with_a_400_naming_the_field(app, body, words):
    status, reply = _post(app, body)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", (status, reply)
    assert words in reply["error"]["message"], reply


def test_the_server_logs_one_line_per_request_when_asked(capsys):
    """``trickles serve`` logs each request (``log_requests``): one line on stderr with the client, method, path,
    status and time, refused requests too; an application made without it logs nothing."""
    assert _post(_app(log_requests=True), {"prompt": []})[0] == 400
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[trickles] 127.0.0.1 POST /v1/completions 400 "), lines
    assert _post(_app(), {"prompt": []})[0] == 400
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "body,words",
    [
        ({"messages": []}, "messages: give at least one message"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            "messages.0.role: unknown role 'robot'; use one of system",
        ),
        ({"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "unknown field 'messages.0.mood'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        (
            {"messages": [{"role": "user", "content": "y" * 8}]},
            "the conversation is 32 tokens; this model's context is 8",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {}}, "unknown field 'logit_bias'"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content: text must be valid Unicode"),
    ],
    ids=[
        "empty",
        "unknown-role",
        "unknown-message-field",
        "image-part",
        "negative-tokens",
        "too-long",
        "unknown-field",
        "lone-surrogate",
    ],
)
def test_bad_chat_requests_are_refused_with_a_400(app, body, words):
    status, reply = _post(app, body, "/v1/chat/completions")
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", (status, reply)
    assert words in reply["error"]["message"], reply


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"Bearer wrong-key-0",
        b"Bearer wrong-key-00",
        b"Bearer secret-key-2",
        b"Bearer k",
        b"secret-key-1",
        b"Bearer secret-key-12",
    ],
    ids=["none", "wrong", "wrong-same-length", "last-character", "shorter", "no-bearer", "longer"],
)
def test_without_the_api_key_every_endpoint_but_health_answers_401(header):
    """A request without the header, with a wrong key (of another length, of the same length, or differing only in
    its last character), a key of another length or no ``Bearer`` gets 401 and never reaches the engine (nothing
    queued); ``/health`` needs no key, and the right key passes (to the 400 here). A server that compared only the
    lengths, or stopped before the last character, would let two of these through."""
    keyed = _app(api_key="secret-key-1")
    headers = () if header is None else ((b"authorization", header),)
    for path, method in (
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/v1/models", "GET"),
        ("/metrics", "GET"),
    ):
        status, reply = _post(keyed, {"prompt": "a"}, path, headers, method=method)
        assert status == 401 and reply["error"]["type"] == "authentication_error", (path, status, reply)
    assert keyed.state.engine.backlog == 0
    assert _post(keyed, None, "/health", headers, chunks=[b""], method="GET")[0] == 200
    assert _post(keyed, {"prompt": []}, headers=((b"authorization", b"Bearer secret-key-1"),))[0] == 400


def test_a_body_over_the_limit_gets_413_before_it_is_parsed():
    """Refused from its Content-Length at once, or, sent in chunks without one, as soon as it passes the limit
    (the rest is never read: the chunks are not even valid JSON)."""
    small = _app(max_body_bytes=100)
    status, reply = _post(small, None, headers=((b"content-length", b"101"),), chunks=[b"x" * 101])
    assert status == 413 and "larger than the server's limit of 100 bytes" in reply["error"]["message"]
    status, reply = _post(small, None, chunks=[b"{" * 60, b"[" * 60, b"never read"])
    assert status == 413
    assert _post(small, {"prompt": []})[0] == 400  # within the limit: parsed and checked as usual
