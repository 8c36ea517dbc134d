"""trickles serve: OpenAI-style completions over HTTP from a trained checkpoint, requests from several clients
batched, streamed and plain answers equal to trickles generate's greedy text, bad requests answered with a 4xx, clean
shutdown."""

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", exc_type=ImportError)  # the serve extra (CI installs it: a skip there fails)
uvicorn = pytest.importorskip("uvicorn", exc_type=ImportError)

from helpers import cli_here, trained_checkpoint  # noqa: E402

from trickles.infer import Sampling, decode  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.infer.static import Batcher, Job  # noqa: E402
from trickles.testing import run_command  # noqa: E402
from trickles.train.load import load_for_inference  # noqa: E402

PROMPTS = ["def ", "import os\n", "class Foo(object):\n    ", "x"]
# greedy decoding of a model trained for a few steps repeats a space; the penalty makes its text varied
GREEDY = {"temperature": 0, "repetition_penalty": 1.3, "max_tokens": 24}
TIMEOUT = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("serve"), 4)


@pytest.fixture(scope="module")
def cli_text(checkpoint):
    """What ``trickles generate`` prints for every prompt, greedily with the same penalty (one batch of 4 prompts)."""
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    r = run_command(
        [
            sys.executable,
            "-m",
            "trickles",
            "generate",
            checkpoint,
            *args,
            "--temperature",
            "0",
            "--repetition-penalty",
            "1.3",
            "--max-new-tokens",
            "24",
        ],
        text=False,
        timeout=TIMEOUT,
        env=dict(os.environ, PYTHONIOENCODING="utf-8"),
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    out = r.stdout.decode("utf-8")
    expected = "".join(f"--- sample {i + 1} ---\n{{}}\n" for i in range(len(PROMPTS)))
    parts = out.split("--- sample ")[1:]
    texts = [p.split(" ---\n", 1)[1][:-1] for p in parts]
    assert out == expected.format(*texts)
    assert [t[: len(p)] for t, p in zip(texts, PROMPTS)] == PROMPTS
    return {p: t[len(p) :] for p, t in zip(PROMPTS, texts)}


@pytest.fixture(scope="module")
def server(checkpoint):
    model, tokenizer, _ = load_for_inference(checkpoint, "cpu")
    app = create_app(model, tokenizer, name="tiny", max_batch=8, window_s=0.05)
    background = BackgroundServer(app)
    yield f"http://127.0.0.1:{background.port}", app, model.cfg.max_seq_len
    background.stop()
    assert app.state.engine._thread is None  # the engine's worker stopped with it


def post(url, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode("utf-8")


def streamed(url, body):
    status, ctype, text = post(url, {**body, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream"), (status, text)
    events = [line[len("data: ") :] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    texts, reasons = {}, {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"] is not None:
                reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons


def test_health(server):
    url, _, context = server
    with urllib.request.urlopen(url + "/health", timeout=TIMEOUT) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok", "model": "tiny", "context": context}


def test_concurrent_clients_get_generate_text(server, cli_text):
    """8 requests from 4 client threads at once (each prompt plain and streamed) come back with trickles
    generate's greedy text, whatever they were batched with, and every KV block is back in the pool after them."""
    url, app, context = server

    def plain(p):
        status, _, text = post(url, {"prompt": p, **GREEDY})
        assert status == 200, text
        return json.loads(text)

    def stream(p):
        return streamed(url, {"prompt": p, **GREEDY})

    with ThreadPoolExecutor(4) as pool:
        plains = list(pool.map(plain, PROMPTS))
        streams = list(pool.map(stream, PROMPTS))
    for p, body, (texts, reasons) in zip(PROMPTS, plains, streams):
        [choice] = body["choices"]
        assert choice["text"] == cli_text[p] and choice["index"] == 0
        assert choice["finish_reason"] == "length"
        new = min(24, context - len(p.encode()))  # max_tokens shortened to fit the model's context
        assert body["usage"] == {
            "prompt_tokens": len(p.encode()),
            "completion_tokens": new,
            "total_tokens": len(p.encode()) + new,
        }
        assert texts == {0: cli_text[p]} and reasons == {0: "length"}
    assert app.state.engine.pool.used == 0  # every block back in the pool


def test_list_prompt_n_stop_and_seed(server, cli_text):
    url, _, _ = server
    status, _, text = post(url, {"prompt": PROMPTS[:2], **GREEDY, "n": 2})
    body = json.loads(text)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [cli_text[PROMPTS[0]]] * 2 + [cli_text[PROMPTS[1]]] * 2
    full = cli_text[PROMPTS[2]]
    stop = full[5:7]
    status, _, text = post(url, {"prompt": PROMPTS[2], **GREEDY, "stop": stop})
    [choice] = json.loads(text)["choices"]
    assert choice["text"] == full[: full.find(stop)] and choice["finish_reason"] == "stop"
    texts, reasons = streamed(url, {"prompt": PROMPTS[2], **GREEDY, "stop": [stop]})
    assert texts == {0: full[: full.find(stop)]} and reasons == {0: "stop"}
    sampled = {"prompt": "def ", "temperature": 1.0, "max_tokens": 16, "seed": 7}
    a, b = (json.loads(post(url, sampled)[2])["choices"][0]["text"] for _ in range(2))
    assert a == b


@pytest.mark.parametrize(
    "body, raw, words",
    [
        (None, b'{"prompt": "def ", "max_tokens": ', "not valid JSON"),
        ({"prompt": "def ", "max_token": 5}, None, "unknown field 'max_token'"),
        ({"prompt": "def ", "max_tokens": -1}, None, "max_tokens"),
        ({"prompt": "def ", "top_p": 0}, None, "top_p"),
        ({"max_tokens": 3}, None, "prompt"),
        ("LONG", None, "context is"),
    ],
)
def test_bad_requests_get_a_4xx_with_a_message(server, body, raw, words):
    url, _, context = server
    if body == "LONG":
        body = {"prompt": "y" * context}
    status, ctype, text = post(url, body, raw)
    assert 400 <= status < 500 and ctype.startswith("application/json"), (status, text)
    err = json.loads(text)["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    status, _, text = post(url, {"prompt": "def ", **GREEDY})  # and the server goes on
    assert status == 200


def test_unknown_routes_and_methods_answer_json_errors(server):
    url, _, _ = server
    for req, status in (
        (urllib.request.Request(url + "/v1/nothing"), 404),
        (urllib.request.Request(url + "/v1/completions"), 405),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=TIMEOUT)
        assert e.value.code == status and "message" in json.loads(e.value.read())["error"]


def test_batcher_decodes_waiting_jobs_together(checkpoint):
    """Jobs queued before the worker starts run as one batch, each row as it would alone."""
    model, tokenizer, _ = load_for_inference(checkpoint, "cpu")
    batcher = Batcher(model, tokenizer, max_batch=8, window_s=0.0)
    results = {}
    settings = Sampling(max_new_tokens=10, temperature=0, repetition_penalty=1.3)
    for i, p in enumerate(PROMPTS[:3]):
        batcher.submit(Job([tokenizer.encode(p)], [settings], finish=lambda r, i=i: results.__setitem__(i, r)))
    batcher.start()
    batcher.stop()
    assert batcher.batches == [3]
    for i, p in enumerate(PROMPTS[:3]):
        [alone] = decode(model, [tokenizer.encode(p)], settings, eos_id=tokenizer.eos_id, tokenizer=tokenizer)
        assert results[i][0].text == alone.text


def test_a_stopping_batcher_refuses_the_jobs_still_waiting():
    """Jobs queued behind the stop are finished with an error ("shutting down"), not left waiting forever."""
    batcher = Batcher(None, None, max_batch=8, window_s=0.0)
    batcher.queue.put(None)  # what stop() sends, here ahead of two jobs
    results = []
    for _ in range(2):
        batcher.submit(Job([[1, 2]], [Sampling(max_new_tokens=2)], finish=results.append))
    batcher.start()
    batcher.stop()
    assert len(results) == 2 and all(isinstance(r, RuntimeError) and "shutting down" in str(r) for r in results)


def test_serve_command_starts_and_stops(checkpoint):
    """``trickles serve CKPT --port 0`` prints its address, answers /health, and exits cleanly on SIGINT."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trickles", "serve", checkpoint, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        line = proc.stdout.readline()
        assert "serving" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split(" on ", 1)[1].split()[0]
        assert address.startswith("http://127.0.0.1:")
        for _ in range(100):  # the socket is bound before the line is printed; accepting may take a moment
            try:
                with urllib.request.urlopen(address + "/health", timeout=TIMEOUT) as r:
                    assert json.loads(r.read())["status"] == "ok"
                break
            except urllib.error.URLError:
                threading.Event().wait(0.1)
        else:
            pytest.fail("trickles serve did not answer /health")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "--port must be in 0..65535 (0: any free port), got 70000"),
        (["--max-batch", "0"], "--max-batch must be at least 1, got 0"),
        (["--block-size", "0"], "--block-size must be at least 1, got 0"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
        (["--kv-cache-gb", "0"], "--kv-cache-gb must be a number of gigabytes > 0, got 0"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1, got 0"),
        (["--api-key", " "], "--api-key must not be empty; leave it out to serve without a key"),
        (  # given explicitly, even at its default value: refused rather than ignored
            ["--batching", "static", "--block-size", "16"],
            "--block-size applies to --batching continuous only (the static batcher has no paged KV pool and no "
            "chunked prefill): drop it or serve with continuous batching",
        ),
        (
            ["--batching", "static", "--prefill-chunk", "64", "--kv-cache-gb", "1"],
            "--prefill-chunk and --kv-cache-gb apply to --batching continuous only (the static batcher has no paged "
            "KV pool and no chunked prefill): drop them or serve with continuous batching",
        ),
        (
            ["--kv-cache-gb", "0.0000001"],
            "a KV pool of 100 bytes holds no block of 16 positions (8192 bytes each): "
            "raise --kv-cache-gb to at least 0.000008192",
        ),
    ],
)
def test_serve_bad_options(checkpoint, args, message):
    if args[0] == "--port":  # through a real process
        r = run_command([sys.executable, "-m", "trickles", "serve", checkpoint, *args], text=True, timeout=TIMEOUT)
    else:
        r = cli_here("serve", checkpoint, *args)
    assert r.returncode == 2 and r.stderr == f"error: {message}\n" and r.stdout == ""


# ---- trickles generate: several prompts, beam search ------------------------------------------------------------


def generate_cli(*args):
    return run_command(
        [sys.executable, "-m", "trickles", "generate", *args],
        text=False,
        timeout=TIMEOUT,
        env=dict(os.environ, PYTHONIOENCODING="utf-8"),
    )


def test_generate_beams_over_several_prompts(checkpoint):
    """``--prompt a --prompt bb --beams 3``: each prompt's best beam, as trickles.infer.beam_search gives it in this
    process (the wiring; the search itself is checked against transformers in tests/unit/test_infer.py)."""
    from trickles.infer import beam_search

    model, tokenizer, _ = load_for_inference(checkpoint, "cpu")
    prompts = ["a", "def f(bb"]
    args = [checkpoint, "--prompt", prompts[0], "--prompt", prompts[1], "--beams", "3", "--max-new-tokens", "12"]
    for lp in ("-2",):
        r = generate_cli(*args, "--length-penalty", lp)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        best = beam_search(
            model,
            [tokenizer.encode(p) for p in prompts],
            3,
            12,
            length_penalty=float(lp),
            eos_id=tokenizer.eos_id,
            tokenizer=tokenizer,
        )
        assert r.stdout.decode("utf-8") == "".join(
            f"--- sample {i + 1} ---\n{p}{b.text}\n" for i, (p, b) in enumerate(zip(prompts, best))
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beams", "0"], "--beams must be at least 1, got 0"),
        (["--beams", "3", "--temperature", "0.5"], "--beams searches deterministically; leave out --temperature"),
        (
            ["--beams", "2", "--num-samples", "2", "--top-k", "3"],
            "--beams searches deterministically; leave out --top-k, --num-samples",
        ),
        (["--length-penalty", "2"], "--length-penalty and --early-stopping apply to beam search; add --beams N"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be a number > 0 (1: off), got 0"),
        (["--stop", ""], "--stop needs a non-empty text"),
    ],
)
def test_generate_bad_options(tmp_path, args, message):
    r = cli_here("generate", tmp_path, *args)  # refused before anything starts (a real process: the serve test below)
    assert r.returncode == 2 and r.stderr == f"error: {message}\n" and r.stdout == ""


def test_serving_beyond_loopback_without_a_key_warns_once(checkpoint, capsys, monkeypatch):
    """``serve`` on an address other than loopback without an API key prints one warning line; with a key, or on
    loopback, none (uvicorn is not started here: its ``run`` is replaced)."""
    from trickles.infer.listen import serve

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    model, tokenizer, _ = load_for_inference(checkpoint, "cpu")
    serve(model, tokenizer, host="0.0.0.0", port=0)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[trickles] warning: listening on 0.0.0.0 without --api-key: anyone who can reach this address may "
        "use the model"
    ]
    serve(model, tokenizer, host="0.0.0.0", port=0, api_key="k")
    serve(model, tokenizer, host="127.0.0.1", port=0)
    assert capsys.readouterr().err == ""
