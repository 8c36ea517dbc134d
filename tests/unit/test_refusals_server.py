"""Every refusal of a bad request to ``trickles serve`` is pinned: a 400 with an OpenAI-style error naming the field
(docs/testing.md, "Refusals"). The cases tests/e2e/test_inference.py sends through a real server are not repeated;
these call the application in this process (ASGI), before anything is decoded (no batcher runs: a request the
checks let through times out)."""

from __future__ import annotations

import asyncio
import json

import pytest


def _app(log_requests: bool = False):
    from trickles.data import ByteTokenizer
    from trickles.infer.server import create_app
    from trickles.models import ModelConfig, build_model

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=260, max_seq_len=8)
    return create_app(build_model(cfg, seed=0).eval(), ByteTokenizer(), name="tiny", log_requests=log_requests)


@pytest.fixture(scope="module")
def app():
    return _app()


def _post(app, body) -> tuple[int, dict]:
    """``POST /v1/completions`` with ``body`` (JSON) through the ASGI application: ``(status, json body)``."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("test", 80)}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    out = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        out.append(message)

    # a request that gets past the checks waits for the batcher, which is not running here: fail, do not hang
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
    status = next(m["status"] for m in out if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"))


@pytest.mark.parametrize("body,words", [
    ({"prompt": []}, "prompt: give a string or a non-empty list of strings"),
    ({"prompt": "a", "stop": ["x", ""]}, "stop: stop strings must not be empty"),
    ({"prompt": ["a", "yyyyyyyy"]}, "prompt[1] is 8 tokens; this model's context is 8 tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature: Input should be greater than or equal to 0"),
    ({"prompt": "a", "top_k": -1}, "top_k: Input should be greater than or equal to 0"),
    ({"prompt": "a", "top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0"),
    ({"prompt": "a", "n": 0}, "n: Input should be greater than or equal to 1"),
    ({"prompt": "a", "n": 17}, "n: Input should be less than or equal to 16"),
], ids=["empty-list", "empty-stop", "long-in-list", "temperature", "top_k", "top_p-above-1", "repetition_penalty",
        "n-0", "n-17"])
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
