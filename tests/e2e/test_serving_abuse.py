"""Serving under abuse: the continuous-batching server on loopback takes about 200 requests from 16 clients, a third
of them abandoned at random points (the connection closed before, during or after the stream's first events), mixed
with a fixed corpus of over 100 malformed and hostile bodies (seeded: wrong types, huge numbers, deep nesting, invalid
UTF-8 and lone surrogates, unknown fields, huge ``max_tokens``, negative values, empty and huge prompts). Afterwards
nothing answered 5xx, every bad body got a 4xx with an OpenAI-style JSON error, every finished stream was whole, the
KV pool is empty, and no asyncio task, thread or resident memory was left behind."""

from __future__ import annotations

import gc
import http.client
import json
import random
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", exc_type=ImportError)  # the serve extra (CI installs it: a skip there fails)
pytest.importorskip("uvicorn", exc_type=ImportError)

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer.engine import EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.models import ModelConfig, build_model  # noqa: E402

CLIENTS, REQUESTS, LIMIT = 16, 200, 1 << 16
RSS_SLACK_MB = 24  # allocator noise after a warm-up round; a leak of 100 KB a request would show 20 MB


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _corpus(rng: random.Random) -> list[tuple[str, bytes]]:
    """``(path, raw body)`` of requests every one of which must get a 4xx with a JSON error."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    values = {  # field -> bad values (each a JSON text)
        "prompt": ["123", "null", "true", "{}", "[1, 2]", '[["a"]]', "[]", '"\\ud800"', '["a", "\\udfff"]'],
        "max_tokens": ['"10"', "1.5", "-1", "-99999999999999999999", "true", "[]", "1e400"],
        "temperature": ['"hot"', "-0.5", "1e400", "-1e400", "NaN", "Infinity", "null", "[1]"],
        "top_p": ["0", "1.5", "-1", '"x"', "1e400"],
        "top_k": ["-1", "2.5", '"5"', "-99999999999999999999999"],
        "n": ["0", "17", "-3", "1.5", '"2"', "99999999999999999999999999"],
        "seed": ['"x"', "1.5", "99999999999999999999999999", "-99999999999999999999999999"],
        "repetition_penalty": ["0", "-1", "1e400", '"x"'],
        "stop": ['""', '["a", ""]', "[1]", "{}", "5", '"\\ud800"'],
        "stream": ['"yes"', "2", "{}"],
        "stream_options": ['{"include_usage": "x"}', '{"x": 1}', "[]", "1"],
        "model": ["1", "[]", '"\\udbff"'],
        "logprobs": ['"5"', "-1", "21", "1.5"],
        "echo": ['"true"', "1"],
        "presence_penalty": ["2.5", '"x"', "1e400"],
        "suffix": ['"x"'],
    }
    out = []
    for field, bad in values.items():
        for v in bad:
            out.append((c, f'{{"prompt": "hi", "max_tokens": 2, "{field}": {v}}}'.encode()))
    chat = [
        '{"messages": []}',
        '{"messages": "hi"}',
        '{"messages": [{}]}',
        '{"messages": [{"role": "user"}], "n": 0}',
        '{"messages": [{"role": "robot", "content": "x"}]}',
        '{"messages": [{"role": "user", "content": 5}]}',
        '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
        '{"messages": [{"role": "user", "content": "\\ud800"}]}',
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        '{"messages": [{"role": "user", "content": "hi", "x": 1}]}',
        '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}',
        '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "lots"}',
        '{"messages": [{"role": "user", "content": "' + "y" * 3000 + '"}]}',
        '{"messages": [{"role": "user", "content": "hi"}], "tools": []}',
    ]
    out += [(ch, b.encode()) for b in chat]
    raw = [
        b"",
        b"null",
        b"[]",
        b'"text"',
        b"42",
        b"{",
        b'{"prompt": "a"',
        b'{"prompt": "\xff\xfe\xfd"}',
        b'{"prompt": "a\xc3"}',
        b"\xef\xbb\xbf{}",
        b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}",
        b'{"prompt": "a", "stop": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}",
        b'{"prompt": "' + b"z" * 300 + b'"}',  # over the context
        b'{"prompt": "' + b"z" * (LIMIT + 10) + b'"}',  # over the body limit: 413
        json.dumps({"prompt": ["a"] * 2000}).encode(),  # more sequences than the server ever queues
        json.dumps({"prompt": ["a"] * 40, "n": 16}).encode(),
        b'{"prompt": "a", "prompt": 5}',
        b'{"prompt": "a", "max_tokens": 2, "temperature": 0, "extra_body": {"x": 1}}',
    ]
    out += [(c, b) for b in raw]
    out += [(ch, b) for b in raw[:10]]
    for _ in range(20):  # random bytes, and valid bodies with one byte flipped into garbage
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        out.append((rng.choice((c, ch)), junk))
    return out


def _send(port, path, body: bytes, timeout=60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _good(rng: random.Random, i: int, abandon: bool) -> tuple[str, dict]:
    prompt = "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(0, 40)))
    common = {
        "max_tokens": 24 if abandon else rng.randrange(1, 7),  # one to abandon: long enough to be cut off
        "temperature": rng.choice((0, 0.8)),
        "seed": i,
        "n": rng.choice((1, 1, 2)),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.3:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    return "/v1/completions", {"prompt": prompt, **common}


def _whole(status: int, raw: bytes, stream: bool) -> str | None:
    """What is wrong with a finished request's answer, else None."""
    if status != 200:
        return f"status {status}: {raw[:200]!r}"
    if not stream:
        body = json.loads(raw)
        return None if body.get("choices") and "usage" in body else f"no choices: {raw[:200]!r}"
    events = [x[6:] for x in raw.split(b"\n") if x.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return f"a stream without [DONE]: {raw[-200:]!r}"
    if any(b'"error"' in e for e in events):
        return f"an error event: {raw[-300:]!r}"
    return None


def _abandon(port, path, body: dict, rng: random.Random) -> None:
    """Sends ``body`` and closes the connection at a random point: before the answer, after its headers, or after
    a few of its events (sometimes with a reset instead of a clean close)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        for _ in range(rng.randrange(0, 4)):
            if not sock.recv(rng.choice((1, 64, 4096))):
                break
        if rng.random() < 0.3:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    finally:
        sock.close()


def _wait(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def test_the_server_survives_abuse_and_leaves_nothing_behind():
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more intra-op threads only contend with the clients and the server
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=260, max_seq_len=128)
    model = build_model(cfg, seed=0).eval()
    config = EngineConfig(max_batch=8, block_size=4, num_blocks=96, prefill_chunk=64)
    app = create_app(model, ByteTokenizer(), name="tiny", max_body_bytes=LIMIT, max_waiting=256, engine_config=config)
    server = BackgroundServer(app)
    port, engine, rng = server.port, app.state.engine, random.Random(0)
    corpus = _corpus(rng)

    def cancels() -> float:
        return app.state.metrics.registry.get_sample_value("trickles_requests_total", {"outcome": "cancelled"}) or 0

    assert len(corpus) >= 100

    def round_(n_good: int, bad: list) -> tuple[list[str], int]:
        kinds = ["abandon" if rng.random() < 1 / 3 else "good" for _ in range(n_good)]
        jobs = [(k, *_good(rng, i, k == "abandon")) for i, k in enumerate(kinds)] + [("bad", *x) for x in bad]
        rng.shuffle(jobs)
        problems, abandoned, lock, seeds = [], [], threading.Lock(), iter(range(10**6))

        def client(seed):
            r = random.Random(seed)
            while True:
                with lock:
                    if not jobs:
                        return
                    kind, path, body = jobs.pop()
                try:
                    if kind == "bad":
                        status, raw = _send(port, path, body)
                        err = json.loads(raw).get("error", {}) if raw[:1] == b"{" else {}
                        if not (400 <= status < 500 and isinstance(err.get("message"), str) and err.get("type")):
                            problems.append(f"{body[:80]!r} -> {status} {raw[:200]!r}")
                    elif kind == "abandon":
                        _abandon(port, path, body, r)
                        abandoned.append(body)
                    else:
                        status, raw = _send(port, path, json.dumps(body).encode())
                        why = _whole(status, raw, body["stream"])
                        if why:
                            problems.append(f"{body} -> {why}")
                except Exception as e:  # noqa: BLE001 -- reported with the others
                    problems.append(f"{kind} {path}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=client, args=(next(seeds),)) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client is still waiting for its answer"
        _wait(lambda: engine.idle and engine.pool.used == 0, lambda: f"KV blocks still held: {engine.pool.used}")
        return problems, len(abandoned)

    try:
        assert round_(24, corpus[:8])[0] == []  # warm-up: the allocator's and the model's first-call costs
        gc.collect()
        tasks, threads, rss = server.tasks(), {t.ident for t in threading.enumerate()}, _rss_mb()
        cancelled = cancels()
        problems, abandoned = round_(REQUESTS, corpus)
        assert problems == [], "\n".join(problems[:20])
        cut = cancels() - cancelled
        assert REQUESTS / 4 < abandoned < REQUESTS / 2.5 and cut >= abandoned / 4, (abandoned, cut)
        assert engine.pool.used == 0 and not engine.running and not engine.waiting
        _wait(
            lambda: server.tasks() == tasks, lambda: f"asyncio tasks left: {sorted(set(server.tasks()) - set(tasks))}"
        )
        _wait(
            lambda: {t.ident for t in threading.enumerate()} <= threads,
            lambda: f"threads left: {[t.name for t in threading.enumerate() if t.ident not in threads]}",
        )
        gc.collect()
        assert _rss_mb() - rss < RSS_SLACK_MB, f"resident memory grew from {rss:.0f} MB to {_rss_mb():.0f} MB"
    finally:
        server.stop()
        torch.set_num_threads(threads_before)
