"""``trickles serve --nproc 2 --tp 2``: rank 0 serves HTTP and schedules, both ranks run every model call
(:mod:`trickles.infer.ranks`). 32 concurrent requests -- greedy and seeded samples, plain and streamed, with
log-probabilities of the new tokens and of an echoed prompt, chat -- get what a one-process server of the same
checkpoint answers, also when requests choose two LoRA adapters sharing one slot (every rank mirroring rank 0's
slots); a follower that fails takes the server down with one line per rank involved and a nonzero exit,
never a hang; bad layouts are refused in one line before any process starts."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi", exc_type=ImportError)  # the serve extra (CI installs it: a skip there fails)
pytest.importorskip("uvicorn", exc_type=ImportError)

from helpers import cli_here, trained_checkpoint  # noqa: E402

from trickles.adapters import LoRASettings, apply_lora  # noqa: E402
from trickles.adapters.loaded import load_adapter  # noqa: E402
from trickles.adapters.multi import AdapterBank  # noqa: E402
from trickles.adapters.peft import save_peft  # noqa: E402
from trickles.infer.engine import EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.train.load import load_for_inference  # noqa: E402

TIMEOUT = 120
ENGINE = ["--max-batch", "8", "--block-size", "4", "--prefill-chunk", "16"]
PROMPTS = ["def ", "import os\n", "class A:", "x = 1", "hello", "for i in", "# note", "return "]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # a wide initialization: varied text, and top-2 logit gaps far above the float rounding of a split matmul
    return trained_checkpoint(tmp_path_factory.mktemp("serve-tp"), 1, "model.init_std=0.3")


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Two PEFT adapter directories for the checkpoint's model: ``{name: dir}``."""
    root, out = tmp_path_factory.mktemp("serve-tp-lora"), {}
    for i, (name, targets) in enumerate({"a": ("q_proj", "v_proj", "o_proj"), "b": ("k_proj", "down_proj")}.items()):
        model, _, _ = load_for_inference(checkpoint)
        settings = LoRASettings(rank=2 + i, alpha=4.0, targets=targets)
        apply_lora(model, settings)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        out[name] = str(save_peft(model, root / name, settings))
    return out


@pytest.fixture(scope="module")
def tp_server(checkpoint, adapters, tmp_path_factory):
    """The two-rank server, with the two adapters sharing one slot; its follower raises at its first model call once
    the file ``fail`` exists."""
    fail = str(tmp_path_factory.mktemp("serve-tp-fault") / "fail")
    loras = [x for name, path in adapters.items() for x in ("--lora", f"{name}={path}")]
    yield from _server(checkpoint, fail, *loras, "--max-loras", "1")


def _server(checkpoint: str, fail: str, *extra: str):
    """``(port, process, fail)`` of a two-rank server started with ``extra`` flags, killed when the caller is done."""
    command = [sys.executable, "-m", "trickles", "serve", checkpoint, "--port", "0", "--device", "cpu"]
    proc = subprocess.Popen(
        [*command, "--nproc", "2", "--tp", "2", *ENGINE, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", TRICKLES_FAIL_SERVING=fail),
    )
    try:
        line = proc.stdout.readline()
        assert "serving" in line and "2 ranks: --tp 2 --ep 1" in line, (line, proc.poll())
        port = int(line.split(" on ", 1)[1].split()[0].rsplit(":", 1)[1])
        deadline = time.monotonic() + TIMEOUT
        while True:  # the socket is bound before the line is printed; accepting may take a moment
            try:
                assert _post(port, "/health", None)[0] == 200
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "the server did not answer /health"
                time.sleep(0.1)
        yield port, proc, fail
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def one_process(checkpoint, adapters):
    model, tokenizer, _ = load_for_inference(checkpoint)
    bank = AdapterBank(model, [load_adapter(path, model.cfg, name) for name, path in adapters.items()], 1)
    config = EngineConfig(max_batch=8, block_size=4, prefill_chunk=16, adapters=bank)
    name = os.path.basename(checkpoint)  # the name trickles serve gives it: requests choose the base by it
    background = BackgroundServer(create_app(model, tokenizer, name=name, engine_config=config))
    yield background.port
    background.stop()


def _post(port: int, path: str, body: dict | None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    if body is None:
        conn.request("GET", path)
    else:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read().decode()


def _requests() -> list[tuple[str, dict]]:
    out = []
    for i in range(24):  # greedy, plain and streamed, some with penalties and log-probabilities
        body = {"prompt": PROMPTS[i % 8], "max_tokens": 6 + i % 5, "temperature": 0, "stream": i % 2 == 1}
        body.update({"presence_penalty": 0.5} if i % 3 == 0 else {})
        body.update({"logprobs": 2} if i % 4 == 0 else {})
        out.append(("/v1/completions", body))
    for i in range(4):  # seeded samples, two choices each
        out.append(("/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 8, "temperature": 1.0, "seed": i, "n": 2}))
        out[-1][1]["stream"] = i % 2 == 1
    for i in range(2):  # the prompt's log-probabilities too: every position's logits gathered
        out.append(
            (
                "/v1/completions",
                {"prompt": PROMPTS[i + 4], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1},
            )
        )
    for i in range(2):
        messages = [{"role": "user", "content": PROMPTS[i + 6]}]
        out.append(
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, "stream": i == 1})
        )
    assert len(out) == 32
    return out


def _choices(status: int, text: str, stream: bool) -> dict:
    """index -> (text, finish_reason, token log-probabilities) of a reply, streamed or not."""
    assert status == 200, text
    if not stream:
        got = {}
        for c in json.loads(text)["choices"]:
            lp = (c.get("logprobs") or {}).get("token_logprobs", [])
            got[c["index"]] = (c["text"] if "text" in c else c["message"]["content"], c["finish_reason"], lp)
        return got
    got = {}
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[6:])["choices"]:
            t, finish, lp = got.get(c["index"], ("", None, []))
            piece = c["text"] if "text" in c else c["delta"].get("content") or ""
            lp = lp + (c.get("logprobs") or {}).get("token_logprobs", [])
            got[c["index"]] = (t + piece, c["finish_reason"] or finish, lp)
    return got


def _answers(port: int) -> list[dict]:
    requests = _requests()
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda r: _post(port, r[0], r[1]), requests))
    return [_choices(*reply, bool(r[1].get("stream"))) for reply, r in zip(replies, requests)]


def test_two_ranks_answer_as_one_process(tp_server, one_process):
    port, proc, _ = tp_server
    got, want = _answers(port), _answers(one_process)
    assert proc.poll() is None
    texts = set()
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            assert g[k][:2] == w[k][:2]  # the same tokens (text) and finish reason
            assert len(g[k][2]) == len(w[k][2])
            # the full vocabulary's log-softmax, split over two ranks: measured gap below 1e-6
            assert all(a == b or abs(a - b) < 1e-4 for a, b in zip(g[k][2], w[k][2]))
            texts.add(g[k][0])
    assert len(texts) > 16  # varied text, not one reply repeated


def test_lora_adapters_on_two_ranks_answer_as_one_process(checkpoint, tp_server, one_process):
    """Requests of two adapters (one slot: they wait for it and reload it) and of the base, in flight together."""
    port, proc, _ = tp_server
    base = os.path.basename(checkpoint)
    requests = [  # prompt j for each of a, b and the base; the first prompt sampled (seeded), the others greedy
        ("/v1/completions", {"model": ["a", "b", base][i % 3], "prompt": PROMPTS[i // 3], "max_tokens": 6})
        for i in range(12)
    ]
    for i, (_, body) in enumerate(requests):
        body.update({"temperature": 1.0, "seed": i} if i < 3 else {"temperature": 0})

    def answers(at):
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda r: _post(at, *r), requests))
        return [_choices(*reply, False)[0][:2] for reply in replies]

    got, want = answers(port), answers(one_process)
    assert got == want and proc.poll() is None
    assert all(len({text for text, _ in got[j : j + 3]}) == 3 for j in range(3, 12, 3))  # a, b and the base differ


def test_ngram_speculation_on_two_ranks_gives_the_greedy_text(checkpoint, one_process, tmp_path):
    """``--speculative ngram`` on two tensor-parallel ranks: every rank runs the verifying call (several positions
    of each row), and every greedy reply equals one process's without speculation."""
    greedy = [(path, body) for path, body in _requests() if body.get("temperature", 1.0) == 0 and body.get("n", 1) == 1]
    assert len(greedy) >= 8
    for port, proc, _ in _server(checkpoint, str(tmp_path / "fail"), "--speculative", "ngram"):
        for path, body in greedy:
            stream = bool(body.get("stream"))
            got = _choices(*_post(port, path, body), stream)
            want = _choices(*_post(one_process, path, body), stream)
            assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}, (path, body)
        metrics = _post(port, "/metrics", None)[1]
        drafted = [line for line in metrics.splitlines() if line.startswith("trickles_spec_decode_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0  # the verifying calls ran, on both ranks
        assert proc.poll() is None


def test_a_failing_follower_stops_the_server(tp_server):
    port, proc, fail = tp_server
    open(fail, "w").close()
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _post(port, "/v1/completions", {"prompt": "def ", "max_tokens": 4})
    assert proc.wait(TIMEOUT) == 1  # (a hang would fail here)
    err = proc.stderr.read()
    assert "[trickles] rank 1: model call " in err and "RuntimeError: injected fault (TRICKLES_FAIL_SERVING)" in err
    assert "[trickles] rank 1 exited with status 1; stopped the other ranks" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "3", "--tp", "2"], "--nproc 3 must be --tp x --ep = 2 x 1 = 2: every rank serves its own part"),
        (["--tp", "3"], "model.n_heads (4) must be divisible by --tp (3): each rank takes whole heads"),
        (["--tp", "2", "--ep", "2"], "--ep=2 splits the experts of mixture-of-experts blocks, but model.moe_experts"),
        (
            ["--tp", "2", "--speculative", "draft", "--draft", "{checkpoint}"],
            "--speculative draft cannot serve on several ranks yet: drop it or serve",
        ),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    ],
)
def test_bad_layouts_are_refused_in_one_line(checkpoint, args, message):
    r = cli_here("serve", checkpoint, "--port", "0", *(a.format(checkpoint=checkpoint) for a in args))
    assert r.returncode == 2 and r.stderr.startswith(f"error: {message}") and r.stderr.count("\n") == 1, r.stderr
