"""Serving under load: trickles' continuous batching vs its static batcher vs ``transformers``' continuous batching,
with rows for many LoRA adapters, for two tensor-parallel ranks, for prefix caching on a shared system prompt and for
speculative decoding on repetitive text.

The workload (``--workload``) is fixed by the seed: ``--requests`` prompts, each with a ``max_tokens`` from the cycle
``--output-lens`` (greedy decoding, the same model and weights for everyone; ours is exported with ``save_hf`` for
transformers). Its prompts:

* ``random`` (the default): random printable bytes whose lengths cycle through ``--prompt-lens``;
* ``shared-prefix``: one system prompt of ``--prefix-len`` random printable bytes (1,024 by default), the same for
  every request, followed by a short question of its own (random printable bytes, lengths from ``--prompt-lens``):
  a chat service's many questions under one long instruction. The untimed ``--warmup`` request leaves the prefix's
  full blocks in the prefix cache, as a running server's traffic would;
* ``repetitive``: code of three ``def`` lines that differ only in their numbers (as ``benchmarks/speculative.py``
  builds it), written out once and then again up to a random point, so that its continuation repeats text the prompt
  holds (the shape of code edits and quoting, what prompt lookup is for; ``--prompt-lens`` is not used). A random
  model does not go on with its prompt: its greedy reply soon falls into a loop of a few tokens, which prompt lookup
  drafts from the generated text whatever the prompt (``engine-ngram`` gains on ``random`` prompts too), so its ratio
  would not show prompt lookup at work. With this workload the model is therefore first trained in the run
  (:func:`recite`, ``--train-steps`` AdamW steps, 100 by default; 0 keeps the random model) to recite that code from
  any point at every position of its context, as a model trained on code goes on with code; every contestant serves
  the trained weights, and prompt lookup's drafts are the prompt's own text.

Arrivals: ``--concurrency C`` clients, each sending its next request as soon as its previous one is answered (closed
loop, the default), or ``--rate R`` requests a second in a Poisson process. A contestant's clock runs from the first
request sent to the last answer received (after ``--warmup`` untimed requests), bounded by ``--time-limit`` (a
request not answered by then counts as lost and fails the run).

Contestants (``--only`` names them; by default the first four with ``--workload random``, ``engine`` and
``engine-noprefix`` with ``shared-prefix``, ``engine`` and ``engine-ngram`` with ``repetitive``):

* ``continuous``: ``trickles serve``'s application (:mod:`trickles.infer.server`) under uvicorn on loopback, in a
  child process (so that the load generator's threads do not share its interpreter lock; on CUDA, which a forked
  process cannot use, in a thread), the clients streaming (server-sent events; a choice's first chunk is sent with
  its first token);
* ``static``: the same server with ``batching="static"`` (a batch runs to its end before the next starts);
* ``engine``: our :class:`~trickles.infer.engine.Engine` called in this process (no HTTP), next to
* ``transformers``: ``transformers``' continuous-batching manager (``init_continuous_batching``, the machinery of
  ``generate_batch``), requests added and results read in this process, streamed for the first token;
* ``engine-lora``: ``engine`` over the same model serving ``--adapters K`` random LoRA adapters (seeded, rank
  ``--lora-rank``, on all seven projections of every block; :class:`~trickles.adapters.multi.AdapterBank` with
  ``--max-loras`` slots, default K), request ``i`` choosing adapter ``i mod (K+1)`` (the last choice: the base), so
  every batch mixes adapters and the base;
* ``continuous-tp``: ``python -m trickles serve CKPT --nproc 2 --tp 2 --port 0`` (the model written as a trickles
  checkpoint with the byte tokenizer, one torch thread a rank; rank 0 serves HTTP) driven by the same streaming
  clients as ``continuous``; stopped (SIGINT, then SIGKILL) however the run ends. Refused in one line where it cannot
  run (``--device cuda`` with fewer than 2 GPUs). On a CPU of few cores it is slower than one process: a row to
  report, not a target;
* ``engine-noprefix``: ``engine`` with ``EngineConfig(prefix_caching=False)``: every prompt prefilled whole, the
  reference that shows what the prefix cache saves on ``shared-prefix`` (``engine``, like ``trickles serve``, caches
  prefixes by default);
* ``engine-ngram``: ``engine`` with ``EngineConfig(speculative="ngram")`` (prompt lookup, ``--num-speculative-tokens``
  drafts a sequence and step, verified in one call of the model inside the batch), for ``repetitive``.

With ``--rounds R`` every contestant runs R times, each round starting one contestant further on; the table holds the
median of each number, and each ratio is the median of the rounds' own ratios. Reported per contestant: generated
tokens/s, time to first token and end-to-end latency (p50, p99), requests sent
and answered, where answered means whole: a non-200, a stream that carries an ``{"error": ...}`` event, or one that
ends without its ``finish_reason``, usage or ``[DONE]``, is a failed request, and any failed request fails the run.
Ratios (when both sides ran): continuous/static (tokens/s, p99 time to first token), engine/transformers and
continuous/transformers (tokens/s), engine-lora/engine and continuous-tp/continuous (tokens/s), engine/engine-noprefix
(tokens/s, and time to first token p50 and p99: below 1 when the cache shortens it) and engine-ngram/engine
(tokens/s). Printed under the table: the prompt tokens each engine contestant found in its prefix cache (of those it
looked up; the warmup request's included), and engine-ngram's drafts proposed and accepted.
Agreement first: every request's greedy text must be the same from our contestants without adapters (continuous,
static, engine, continuous-tp). Each request transformers answers differently is printed with the reason, read from
our model's logits where the two answers part: a near-tie (the two tokens' logits within ``--tie-tolerance``, which
kernels' rounding may break either way) is reported, a disagreement without one fails the run. engine-noprefix and
engine-ngram must give engine's greedy tokens in every round (prefix caching and greedy speculative decoding are
exact up to the float rounding of differently batched products): a request one of them answers differently is
explained the same way, a disagreement without a near-tie fails the run, and so does engine-noprefix finding any
token in a prefix cache. engine-lora's replies to ``--lora-checks`` of the requests (the cheapest of
each choice, in turn) must equal the greedy tokens of that adapter merged into the weights (``W + B A``) and run
alone (:func:`trickles.infer.decode`), up to such a near-tie of the merged model; printed too: on how many of the
checked requests an adapter changes the base model's reply. Targets (CPU, 16 clients): continuous >= 2x
static's tokens/s with at most half its p99 time to first token, and engine >= 1.0x transformers'.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import http.client
import json
import math
import multiprocessing
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, one_device, table, write_json  # noqa: E402

from trickles.adapters.loaded import LoadedAdapter  # noqa: E402
from trickles.adapters.multi import AdapterBank  # noqa: E402
from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer import Sampling, decode  # noqa: E402
from trickles.infer.engine import Engine, EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.models import ModelConfig, apply_preset, build_model, save_hf  # noqa: E402
from trickles.models.fused import fuse_state, split_state  # noqa: E402
from trickles.train.checkpoint import model_pieces, write_model_dir  # noqa: E402

TOK = ByteTokenizer()
CONTESTANTS = (
    "continuous",
    "static",
    "engine",
    "transformers",
    "engine-lora",
    "continuous-tp",
    "engine-noprefix",
    "engine-ngram",
)
WORKLOADS = ("random", "shared-prefix", "repetitive")
#: the contestants run when --only is not given, per workload
DEFAULTS = {
    "random": CONTESTANTS[:4],
    "shared-prefix": ("engine", "engine-noprefix"),
    "repetitive": ("engine", "engine-ngram"),
}
DEFAULT = DEFAULTS["random"]
#: the engine's settings per engine contestant (besides --max-batch and --block-size)
VARIANTS = {"engine": {}, "engine-noprefix": {"prefix_caching": False}, "engine-ngram": {"speculative": "ngram"}}
OURS = ("continuous", "static", "engine", "continuous-tp")  # the contestants that must give the same texts
#: the projections the benchmark's adapters update, in every block
LORA_TARGETS = re.compile(r"^layers\.\d+\.(attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def workload(args) -> list[tuple[str, int]]:
    """``(prompt text, max_tokens)`` per request, of ``--workload``'s kind (see the module's notes)."""
    rng = random.Random(args.seed)
    plens, olens = [int(x) for x in args.prompt_lens.split(",")], [int(x) for x in args.output_lens.split(",")]

    def printable(n: int) -> str:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(n))

    if args.workload == "repetitive":
        return [(repetitive_prompt(rng), olens[i % len(olens)]) for i in range(args.requests)]
    prefix = printable(args.prefix_len) if args.workload == "shared-prefix" else ""
    return [(prefix + printable(plens[i % len(plens)]), olens[i % len(olens)]) for i in range(args.requests)]


def repetitive_code() -> str:
    """Three code-like lines that differ only in their numbers (about 110 bytes)."""
    return "".join(f"def f{i}(x):\n    return x * {i + 2} + {7 * i % 10}\n" for i in range(3))


def repetitive_prompt(rng: random.Random) -> str:
    """:func:`repetitive_code`, then the same lines again up to a random point: the text's continuation is already in
    the prompt."""
    code = repetitive_code()
    return code + code[: rng.randrange(8, len(code) - 8)]


def recite(model, steps: int, seed: int, batch: int = 2, lr: float = 3e-3):
    """Trains ``model`` in place for ``steps`` AdamW steps (learning rate ``lr``, warmed up over 20 steps, then decayed
    linearly) on windows as long as its context, at random offsets, of :func:`repetitive_code` written out again and
    again: it learns to go on reciting the code from any point, at every position a reply reaches. Returns the last
    loss."""
    rng, device, seq = random.Random(seed), next(model.parameters()).device, model.cfg.max_seq_len - 1
    code = TOK.encode(repetitive_code())
    stream = code * (2 + seq // len(code))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(steps):
        starts = [rng.randrange(len(code)) for _ in range(batch)]
        x = torch.tensor([stream[j : j + seq + 1] for j in starts], device=device)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
        logits = model(x[:, :-1])
        out = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        out.backward()
        opt.step()
        loss = out.item()
    model.eval()
    return loss


def arrivals(args, n: int) -> list[float] | None:
    """Send times (seconds from the start) of a Poisson process at ``--rate``, or None (closed loop)."""
    if not args.rate:
        return None
    rng, t, out = random.Random(args.seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(args.rate)
    return out


def drive(args, requests, send) -> dict:
    """Runs ``send(i) -> (first_token_s, text, tokens[, token ids])`` (times from the request's own start) under the
    arrival pattern; the contestant's record. A request whose ``send`` raises is not answered."""
    n, times = len(requests), arrivals(args, len(requests))
    for i in range(min(args.warmup, n)):  # untimed: first-call costs (transformers' manager warms up for seconds)
        send(i)
    out: dict[int, tuple] = {}
    lock, next_i = threading.Lock(), [0]
    start = time.perf_counter()

    def one(i):
        sent = time.perf_counter()
        try:
            first, text, tokens, *ids = send(i)
            out[i] = (first, time.perf_counter() - sent, text, tokens, ids[0] if ids else None)
        except Exception as e:  # noqa: BLE001 -- a failed request is reported, not raised in a thread
            out[i] = (None, None, f"error: {e}", 0, None)

    def client():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n:
                return
            one(i)

    def timed_one(i):
        time.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
        one(i)

    threads = (
        [threading.Thread(target=client) for _ in range(args.concurrency)]
        if times is None
        else [threading.Thread(target=timed_one, args=(i,)) for i in range(n)]
    )
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:
        t.join(max(0.0, args.time_limit - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    return record(out, n, wall)


def record(out: dict, n: int, wall: float) -> dict:
    ok = {i: v for i, v in out.items() if v[0] is not None}
    ttft = sorted(v[0] for v in ok.values())
    lat = sorted(v[1] for v in ok.values())
    tokens = sum(v[3] for v in ok.values())

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    return {
        "sent": n,
        "answered": len(ok),
        "errors": [v[2] for v in out.values() if v[0] is None][:3],
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "latency_p50": pct(lat, 0.5),
        "latency_p99": pct(lat, 0.99),
        "texts": {i: v[2] for i, v in ok.items()},
        "ids": {i: v[4] for i, v in ok.items() if v[4] is not None},
    }


def serve_http(app, device):
    """``(port, stop)``: ``app`` under uvicorn on a free loopback port in a child process (forked: it shares the model's
    weights), so that the clients' threads here do not share the server's interpreter lock; on CUDA, which a forked
    process cannot use, in a thread of this process."""
    if device.type == "cuda":
        background = BackgroundServer(app)
        return background.port, background.stop
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def run():
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        child.send(sock.getsockname()[1])
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])

    proc = ctx.Process(target=run, daemon=True)
    proc.start()
    port = parent.recv()
    for _ in range(600):  # until it answers
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                break
        except OSError:
            time.sleep(0.05)

    def stop():
        proc.terminate()  # uvicorn shuts down on SIGTERM: the app's engine or batcher stops with it
        proc.join(60)

    return port, stop


def http_send(port, requests):
    def send(i):
        prompt, max_tokens = requests[i]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        try:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
            return read_stream(r, started)
        finally:
            conn.close()

    return send


def read_stream(lines, started: float, clock=time.perf_counter) -> tuple[float, str, int]:
    """``(first_token_s, text, tokens)`` of one streamed completion (server-sent event lines, bytes). Answered means
    whole: a stream with an ``{"error": ...}`` event, or one that ends without its choice's ``finish_reason``, its
    usage or ``data: [DONE]`` (a connection cut short), raises RuntimeError saying which."""
    first, text, tokens, finish, done = None, [], None, None, False
    for line in lines:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if done:
            raise RuntimeError(f"data after [DONE]: {line[:200]!r}")
        if line == b"data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error'].get('message', chunk['error'])}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices", []):
            if first is None:  # a choice's first chunk comes with its first token (its text may be held back)
                first = clock() - started
            text.append(c["text"])
            finish = c.get("finish_reason") or finish
    missing = [w for w, ok in (("finish_reason", finish), ("usage", tokens is not None), ("[DONE]", done)) if not ok]
    if missing:
        raise RuntimeError(f"truncated stream: it ended without {', '.join(missing)} after {len(text)} chunks")
    return first if first is not None else clock() - started, "".join(text), tokens


def run_ours(args, model, requests, batching: str, device) -> dict:
    from trickles.infer.server import create_app

    app = create_app(
        model,
        TOK,
        name="bench",
        max_batch=args.max_batch,
        batching=batching,
        engine_config=EngineConfig(max_batch=args.max_batch, block_size=args.block_size),
    )
    port, stop = serve_http(
        app, device
    )  # uvicorn runs the app's lifespan: its engine or batcher starts and stops with it
    try:
        return drive(args, requests, http_send(port, requests))
    finally:
        stop()


def run_engine(args, model, requests, bank: AdapterBank | None = None, variant: str = "engine") -> dict:
    """Our engine in this process, set up as :data:`VARIANTS` says for ``variant``; with ``bank`` (engine-lora),
    request ``i`` chooses :func:`lora_choice`'s adapter. The record holds the engine's prefix-cache counts (prompt
    tokens looked up and found, the warmup's included) and its speculative drafts proposed and accepted."""
    config = dict(VARIANTS[variant])
    if config.get("speculative"):
        config["num_speculative_tokens"] = args.num_speculative_tokens
    engine = Engine(
        model, TOK, EngineConfig(max_batch=args.max_batch, block_size=args.block_size, adapters=bank, **config)
    )
    engine.start()

    def send(i):
        prompt, max_tokens = requests[i]
        started, first, toks = time.perf_counter(), None, []
        greedy = Sampling(max_new_tokens=max_tokens, temperature=0)
        adapter = lora_choice(i, bank.names) if bank is not None else None
        for ev in engine.submit(TOK.encode(prompt), greedy, adapter=adapter).events(600):
            if ev.token is not None:
                toks.append(ev.token)
                if first is None:
                    first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started, TOK.decode(toks), len(toks), toks

    try:
        record = drive(args, requests, send)
    finally:
        engine.stop()
    blocks = engine.pool.blocks
    record.update(prefix_queries=blocks.queries, prefix_hits=blocks.hits)
    record.update(
        drafted=engine.spec.drafted if engine.spec else 0, accepted=engine.spec.accepted if engine.spec else 0
    )
    return record


def lora_choice(i: int, names: list[str]) -> str | None:
    """The adapter request ``i`` chooses: ``names`` in turn, then the base (None)."""
    return ([*names, None])[i % (len(names) + 1)]


def random_adapters(model, k: int, rank: int, seed: int) -> list[LoadedAdapter]:
    """``k`` LoRA adapters ``lora0``, ``lora1``, ... of rank ``rank`` on every q/k/v/o/gate/up/down projection of
    ``model``'s blocks, from ``seed``: ``A ~ N(0, 1/in)`` and ``B ~ N(0, (s/2)^2 in / rank)``, ``s`` the base
    weight's standard deviation, so that ``B A``'s entries are about half the size of the weight's (a reply changes
    visibly)."""
    state = split_state(model.cfg, model.state_dict())
    targets = {n: t for n, t in state.items() if LORA_TARGETS.match(n)}
    if not targets:
        raise ValueError("the model has no q/k/v/o/gate/up/down projections in its blocks for the adapters")
    out = []
    for j in range(k):
        g = torch.Generator().manual_seed(seed * 1000 + j)
        weights = {}
        for n, w in sorted(targets.items()):
            d_out, d_in = w.shape
            a = torch.randn(rank, d_in, generator=g) / math.sqrt(d_in)
            scale = 0.5 * float(w.float().std()) * math.sqrt(d_in / rank)
            weights[n[: -len(".weight")]] = (a, torch.randn(d_out, rank, generator=g) * scale)
        out.append(LoadedAdapter(name=f"lora{j}", path=f"random:seed={seed},index={j}", weights=weights))
    return out


def merged(model, adapter: LoadedAdapter | None):
    """A copy of ``model`` with ``adapter``'s ``B A`` added to its weights (None: ``model`` itself)."""
    if adapter is None:
        return model
    out = copy.deepcopy(model)
    state = split_state(out.cfg, {k: v.clone() for k, v in out.state_dict().items()})
    for name, (a, b) in adapter.weights.items():
        w = state[name + ".weight"]
        w += (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)).to(w.dtype)
    out.load_state_dict(fuse_state(out.cfg, state))
    return out


def lora_checks(requests, k: int, count: int) -> list[int]:
    """The ``count`` requests whose engine-lora replies are checked: the cheapest (prompt bytes + max_tokens) of each
    of the ``k + 1`` choices in turn, then the next cheapest of each, and so on."""
    by_choice = [
        sorted(range(c, len(requests), k + 1), key=lambda i: (len(requests[i][0]) + requests[i][1], i))
        for c in range(k + 1)
    ]
    picks = [i for depth in range(len(requests)) for ids in by_choice if depth < len(ids) for i in [ids[depth]]]
    return sorted(picks[:count])


def lora_agree(model, requests, result: dict, adapters: list, checks: list[int], tolerance: float):
    """engine-lora's replies to ``checks`` against each adapter merged into ``model`` and run alone: ``(agreement
    record, the error or None)``. A reply that differs is printed with :func:`explain`'s reason (read from the merged
    model's logits); one without a near-tie fails the run."""
    names = [a.name for a in adapters]
    by_name = {a.name: a for a in adapters}
    models, base_replies = {}, {}
    ties, wrong, changed = [], [], []
    for i in checks:
        prompt, max_tokens = requests[i]
        choice = lora_choice(i, names)
        if choice not in models:
            models[choice] = merged(model, by_name.get(choice))
        greedy = Sampling(max_new_tokens=max_tokens, temperature=0)
        [alone] = decode(models[choice], [TOK.encode(prompt)], greedy, eos_id=TOK.eos_id)
        mine = result["ids"][i]
        if mine != alone.tokens:
            tie, why = explain(models[choice], TOK.encode(prompt), mine, alone.tokens, tolerance, "merged alone")
            (ties if tie else wrong).append(i)
            print(f"  engine-lora request {i} ({choice or 'base'}) differs from its adapter merged alone {why}")
        if choice is not None:
            [base] = decode(model, [TOK.encode(prompt)], greedy, eos_id=TOK.eos_id)
            base_replies[i] = base.tokens
            if base.tokens != alone.tokens:
                changed.append(i)
    record = {
        "checked": checks,
        "equal": len(checks) - len(ties) - len(wrong),
        "near_ties": ties,
        "disagreements": wrong,
        "adapter_changes_reply": f"{len(changed)}/{len(base_replies)}",
    }
    print(
        f"engine-lora agreement: {record['equal']}/{len(checks)} checked replies equal their adapter merged and run "
        f"alone, {len(ties)} differing at a near-tie; the adapter changes the base model's reply on "
        f"{record['adapter_changes_reply']} of them"
    )
    problem = f"engine-lora disagrees with its adapters merged alone on requests {wrong} without a tie"
    return record, (problem if wrong else None)


def tp_refusal(device) -> str | None:
    """Why ``continuous-tp`` cannot run on ``device`` (one line), or None."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return (
            f"continuous-tp: --tp 2 on --device cuda needs 2 GPUs, this machine has {torch.cuda.device_count()}; "
            "not run"
        )
    return None


def save_checkpoint(model, path: str) -> str:
    """``model`` written as a one-process trickles checkpoint at ``path`` with the byte tokenizer, which
    ``trickles serve`` reads (a Hugging Face directory would need a Hugging Face tokenizer)."""
    with tempfile.TemporaryDirectory() as tokenizer:
        TOK.save(tokenizer)
        return write_model_dir(path, model_pieces(model), tokenizer, {"model": dataclasses.asdict(model.cfg)})


READY = re.compile(r"\[trickles\] serving .* on http://\S+:(\d+) ")


@contextlib.contextmanager
def child_server(command: list[str], env: dict, timeout: float, grace: float = 30.0):
    """Starts ``command`` (a ``trickles serve ... --port 0`` line) and yields ``(port, process)`` once it prints the
    line naming its port; however the block is left (an error, Ctrl-C, SIGTERM to this process) the server is
    stopped: SIGINT, its normal way to stop, then SIGKILL after ``grace`` seconds, and waited for. RuntimeError with
    the server's last line when it exits, or prints no port within ``timeout`` seconds."""
    previous = signal.getsignal(signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:  # SIGTERM leaves the block through the finally clause (the default would leave the server running)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log = tempfile.TemporaryFile(mode="w+")
    proc = None
    try:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            # SIGINT as Python's default: a job started in the background by a shell inherits it ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + timeout
        while True:
            log.seek(0)
            text = log.read()
            found = READY.search(text)
            if found:
                break
            last = (text.strip().splitlines() or ["(no output)"])[-1]
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before serving: {last}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server printed no port within {timeout:g} s; its last line: {last}")
            time.sleep(0.1)
        yield int(found.group(1)), proc
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def wait_healthy(port: int, timeout: float) -> None:
    """Until ``GET /health`` on ``port`` answers 200 (the socket may be bound before it accepts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server on port {port} did not answer /health within {timeout:g} s")
        time.sleep(0.1)


def run_tp(args, checkpoint: str, requests, device) -> dict:
    """``continuous-tp``: ``trickles serve`` on two tensor-parallel ranks, one torch thread each on a CPU (``--threads``
    each), driven as ``continuous`` is."""
    command = [sys.executable, "-m", "trickles", "serve", checkpoint, "--nproc", "2", "--tp", "2", "--port", "0"]
    command += ["--device", device.type, "--max-batch", str(args.max_batch), "--block-size", str(args.block_size)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads or 1))
    env.pop("TRICKLES_API_KEY", None)  # (the clients send no key, as continuous's)
    limit = min(args.time_limit, 600.0)
    with child_server(command, env, limit) as (port, proc):
        wait_healthy(port, limit)
        record = drive(args, requests, http_send(port, requests))
        if proc.poll() is not None:
            record["errors"] = [f"the server exited with status {proc.returncode} during the run", *record["errors"]]
        return record


def run_transformers(args, hf, requests) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(m for _, m in requests), eos_token_id=TOK.eos_id, pad_token_id=0
    )
    # its cache sized as ours (--max-batch full contexts in blocks of --block-size) and its batch as ours; left to
    # size itself from the memory it finds, it spends seconds of CPU on zeroing its tensors
    context = hf.config.max_position_embeddings
    sizes = dict(num_blocks=args.max_batch * -(-context // args.block_size), max_batch_tokens=512 + args.max_batch)
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # transformers before 5.2x: the sizes are generation settings
        ContinuousBatchingConfig = None
    if ContinuousBatchingConfig is not None:
        manager = hf.init_continuous_batching(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(page_size=args.block_size, **sizes),
        )
    else:
        for k, v in {**sizes, "block_size": args.block_size}.items():
            setattr(config, k, v)
        manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    waiters: dict[str, tuple[threading.Event, list]] = {}
    lock = threading.Lock()

    def reader():
        while manager.is_running() or waiters:
            result = manager.get_result(timeout=0.05)
            if result is None:
                continue
            with lock:
                ev, box = waiters.get(result.request_id, (None, None))
            if ev is None:
                continue
            if box[0] is None and result.generated_tokens:
                box[0] = time.perf_counter()
            if result.is_finished():
                box[1] = result
                ev.set()

    threading.Thread(target=reader, daemon=True).start()

    def send(i):
        prompt, max_tokens = requests[i]
        ev, box = threading.Event(), [None, None]
        rid = f"r{i}"
        with lock:
            waiters[rid] = (ev, box)
        started = time.perf_counter()
        manager.add_request(TOK.encode(prompt), request_id=rid, max_new_tokens=max_tokens, streaming=True)
        ev.wait(600)
        with lock:
            del waiters[rid]
        result = box[1]
        if result is None or result.error:
            raise RuntimeError(f"transformers: {None if result is None else result.error}")
        toks = [t for t in result.generated_tokens if t != TOK.eos_id]
        return (box[0] or time.perf_counter()) - started, TOK.decode(toks), len(toks), toks

    try:
        return drive(args, requests, send)
    finally:
        manager.stop(block=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--preset", default="demo")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default 16)")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals at this many requests/s instead")
    p.add_argument("--workload", default="random", choices=WORKLOADS, help="the prompts' kind (default random)")
    p.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix: bytes of the shared system prompt (default 1024)"
    )
    p.add_argument(
        "--prompt-lens", default="32,128,16,64", help="random: prompt bytes; shared-prefix: question bytes (cycled)"
    )
    p.add_argument("--output-lens", default="16,512,32,8,128,64")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds a contestant may take")
    p.add_argument("--warmup", type=int, default=1, help="requests sent one by one, untimed, before the clock starts")
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        choices=CONTESTANTS,
        help=f"contestants to run (default: {' '.join(DEFAULT)}; with shared-prefix: engine engine-noprefix; with "
        "repetitive: engine engine-ngram)",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="repetitive: AdamW steps teaching the model to recite the workload's code first (default 100; 0: the "
        "random model)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="engine-ngram: drafts a sequence and step (default 4)"
    )
    p.add_argument("--adapters", type=int, default=4, help="engine-lora: random LoRA adapters served (default 4)")
    p.add_argument("--lora-rank", type=int, default=16, help="engine-lora: the adapters' rank (default 16)")
    p.add_argument("--max-loras", type=int, default=None, help="engine-lora: adapters resident at once (default: all)")
    p.add_argument(
        "--lora-checks",
        type=int,
        default=8,
        help="engine-lora: replies checked against their adapter merged and run alone (default 8)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="runs of every contestant, in rotated order (default 1)")
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=1e-3,
        help="largest logit gap at which a text differing from transformers' counts as a near-tie (default 1e-3)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.only is None:
        args.only = list(DEFAULTS[args.workload])
    if args.prefix_len < 0 or args.num_speculative_tokens < 1:
        p.error("--prefix-len must be at least 0 and --num-speculative-tokens at least 1")
    if args.train_steps is None:
        args.train_steps = 100 if args.workload == "repetitive" else 0
    if args.train_steps and args.workload != "repetitive":
        p.error("--train-steps teaches the model the repetitive workload's code: use it with --workload repetitive")
    device = one_device(args.device, args.threads)
    requests = workload(args)
    context = max(len(t) for t, _ in requests) + max(m for _, m in requests) + 1
    cfg = dataclasses.replace(apply_preset(ModelConfig(), args.preset), vocab_size=260, max_seq_len=context)
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layers=args.layers)
    model = build_model(cfg, seed=0).to(device).eval()
    if args.train_steps:
        started = time.perf_counter()
        loss = recite(model, args.train_steps, args.seed + 2)
        took = time.perf_counter() - started
        print(f"trained to recite code: {args.train_steps} steps in {took:.0f} s, loss {loss:.3f}")
    prompts = {
        "random": f"prompts {args.prompt_lens} bytes",
        "shared-prefix": f"a shared {args.prefix_len}-byte prefix + questions {args.prompt_lens} bytes",
        "repetitive": f"repetitive code prompts {min(len(t) for t, _ in requests)}-{max(len(t) for t, _ in requests)} "
        "bytes",
    }[args.workload]
    print(
        f"serving benchmark ({args.workload}): {args.requests} requests, {prompts}, outputs {args.output_lens} "
        f"tokens, {f'rate {args.rate:g}/s' if args.rate else f'{args.concurrency} clients'}, "
        f"{cfg.n_layers} layers d={cfg.d_model}, {device_name(device)}"
    )
    hf = bank = adapters = None
    names = list(dict.fromkeys(args.only))
    if "engine-lora" in names:
        if args.adapters < 1 or args.lora_rank < 1 or args.lora_checks < 0:
            p.error("--adapters and --lora-rank must be at least 1, --lora-checks at least 0")
        adapters = random_adapters(model, args.adapters, args.lora_rank, args.seed)
        lora_model = copy.deepcopy(model)  # (the bank swaps its linears; the other contestants keep the plain model)
        bank = AdapterBank(lora_model, adapters, args.max_loras or args.adapters)
    if "continuous-tp" in names and (refusal := tp_refusal(device)):
        print(refusal)
        names.remove("continuous-tp")
    if "transformers" in names:
        try:
            import transformers
        except ImportError:
            print("transformers: not installed, not run")
            names.remove("transformers")
        else:
            with tempfile.TemporaryDirectory() as d:
                save_hf(model, d)
                hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").to(device).eval()
    if not names:
        print("no contestant left to run")
        return 1
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = save_checkpoint(model, os.path.join(scratch, "model")) if "continuous-tp" in names else None
        rounds = []
        for r, _ in enumerate(range(args.rounds)):
            results = {}
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each round starts one further on
                if name == "transformers":
                    results[name] = run_transformers(args, hf, requests)
                elif name in VARIANTS:
                    results[name] = run_engine(args, model, requests, variant=name)
                elif name == "engine-lora":
                    results[name] = run_engine(args, lora_model, requests, bank)
                elif name == "continuous-tp":
                    try:
                        results[name] = run_tp(args, checkpoint, requests, device)
                    except RuntimeError as e:
                        print(f"continuous-tp: {e}")
                        return 1
                else:
                    results[name] = run_ours(args, model, requests, name, device)
                x = results[name]
                print(
                    f"  round {r + 1}, {name}: {x['answered']}/{x['sent']} answered in {x['wall_s']:.1f} s", flush=True
                )
            rounds.append({k: results[k] for k in names})
    return report(args, rounds, device, model, requests, adapters)


def check(results: dict) -> str | None:
    """What is wrong with one round (a request lost, our contestants disagreeing), else None."""
    lost = {k: r["errors"] or r["sent"] - r["answered"] for k, r in results.items() if r["answered"] < r["sent"]}
    if lost:
        return f"requests lost or failed: {lost}"
    ours = [k for k in OURS if k in results]
    for k in ours[1:]:
        differ = [i for i, t in results[ours[0]]["texts"].items() if results[k]["texts"][i] != t]
        if differ:
            return f"disagreement: {k} answers requests {differ[:5]} differently from {ours[0]}"
    return None


RATIOS = {  # name -> (numerator, denominator, metric)
    "continuous_over_static_tokens_per_s": ("continuous", "static", "tokens_per_s"),
    "continuous_over_static_ttft_p99": ("continuous", "static", "ttft_p99"),
    "engine_over_transformers_tokens_per_s": ("engine", "transformers", "tokens_per_s"),
    "continuous_over_transformers_tokens_per_s": ("continuous", "transformers", "tokens_per_s"),
    "engine_lora_over_engine_tokens_per_s": ("engine-lora", "engine", "tokens_per_s"),
    "continuous_tp_over_continuous_tokens_per_s": ("continuous-tp", "continuous", "tokens_per_s"),
    "engine_over_engine_noprefix_tokens_per_s": ("engine", "engine-noprefix", "tokens_per_s"),
    "engine_over_engine_noprefix_ttft_p50": ("engine", "engine-noprefix", "ttft_p50"),
    "engine_over_engine_noprefix_ttft_p99": ("engine", "engine-noprefix", "ttft_p99"),
    "engine_ngram_over_engine_tokens_per_s": ("engine-ngram", "engine", "tokens_per_s"),
}


@torch.no_grad()
def explain(
    model, prompt: list[int], ours: list[int], theirs: list[int], tolerance: float, who: str = "transformers"
) -> tuple[bool, str]:
    """Why two greedy answers to ``prompt`` differ (``theirs``: ``who``'s): ``(a tie, the reason)``. At the first
    token where they part, ``model``'s logits after the common prefix are read: when the two tokens' logits are
    within ``tolerance`` (a tie, or a near-tie that float rounding of different kernels may break either way) the
    difference is explained; otherwise one side did not pick the larger logit, and it is an error. An answer that
    ended there stands for end-of-text."""
    k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    context = torch.tensor([prompt + ours[:k]], device=next(model.parameters()).device)
    logits = model(context)[0, -1].float()
    a = ours[k] if k < len(ours) else TOK.eos_id
    b = theirs[k] if k < len(theirs) else TOK.eos_id
    gap = abs(float(logits[a] - logits[b]))
    tie = gap <= tolerance
    return tie, (
        f"at generated token {k}: ours {a} (logit {float(logits[a]):.6f}), {who} {b} (logit "
        f"{float(logits[b]):.6f}), gap {gap:.2e} {'<=' if tie else '>'} {tolerance:g}"
        f"{': a near-tie that rounding may break either way' if tie else ': no tie, a real disagreement'}"
    )


def agree(model, requests, results: dict, tolerance: float) -> tuple[dict, str | None]:
    """Our texts against transformers' per request: ``(agreement record, the error or None)``. Every request that
    differs is printed with :func:`explain`'s reason; one that differs without a tie fails the run."""
    ours = [k for k in ("engine", "continuous", "static", "continuous-tp") if k in results]
    if "transformers" not in results or not ours:
        return {}, None
    base, theirs = results[ours[0]], results["transformers"]
    differ = [i for i, t in base["texts"].items() if theirs["texts"][i] != t]
    ties, wrong = [], []
    for i in differ:
        prompt, max_tokens = requests[i]
        mine = base["ids"].get(i)
        if mine is None:  # an HTTP contestant: our model's greedy tokens for this prompt alone
            [alone] = decode(
                model, [TOK.encode(prompt)], Sampling(max_new_tokens=max_tokens, temperature=0), eos_id=TOK.eos_id
            )
            mine = alone.tokens
        tie, why = explain(model, TOK.encode(prompt), mine, theirs["ids"][i], tolerance)
        (ties if tie else wrong).append(i)
        print(f"  request {i} differs from transformers {why}")
    record = {"transformers_equal_rows": len(base["texts"]) - len(differ), "near_ties": ties, "disagreements": wrong}
    print(
        f"agreement: our contestants give every request the same text; transformers equal on "
        f"{record['transformers_equal_rows']}/{len(base['texts'])} requests, {len(ties)} differing at a near-tie"
    )
    return record, (f"transformers disagrees with us on requests {wrong} without a tie" if wrong else None)


def variant_agree(model, requests, results: dict, tolerance: float, summary: bool = True) -> tuple[dict, str | None]:
    """engine-noprefix's and engine-ngram's tokens against engine's per request in one round: ``(agreement record, the
    error or None)``. A request answered differently is printed with :func:`explain`'s reason; one without a near-tie
    fails the run, and so does engine-noprefix finding a token in a prefix cache (it has none). ``summary``: print a
    line per contestant."""
    if "engine" not in results:
        return {}, None
    base, out, problems = results["engine"], {}, []
    for name in [k for k in ("engine-noprefix", "engine-ngram") if k in results]:
        theirs, ties, wrong = results[name], [], []
        for i, mine in base["ids"].items():
            if theirs["ids"][i] != mine:
                tie, why = explain(model, TOK.encode(requests[i][0]), mine, theirs["ids"][i], tolerance, name)
                (ties if tie else wrong).append(i)
                print(f"  request {i}: engine and {name} differ {why}")
        out[name] = {"equal_rows": len(base["ids"]) - len(ties) - len(wrong), "near_ties": ties, "disagreements": wrong}
        if summary:
            print(
                f"agreement: {name} gives engine's greedy tokens on {out[name]['equal_rows']}/{len(base['ids'])} "
                f"requests, {len(ties)} differing at a near-tie"
            )
        if wrong:
            problems.append(f"{name} disagrees with engine on requests {wrong[:5]} without a tie")
    if results.get("engine-noprefix", {}).get("prefix_hits"):
        problems.append(
            f"engine-noprefix found {results['engine-noprefix']['prefix_hits']} prompt tokens in a prefix cache it "
            "should not have"
        )
    return out, "; ".join(problems) or None


def counters(results: dict) -> None:
    """Prints each engine contestant's prefix-cache hits and, where it speculated, its drafts accepted."""
    for name, r in results.items():
        if "prefix_queries" not in r:
            continue
        line = f"{name}: {r['prefix_hits']}/{r['prefix_queries']} prompt tokens found in the prefix cache"
        if r["drafted"]:
            line += f"; {r['accepted']}/{r['drafted']} drafts accepted ({r['accepted'] / r['drafted']:.2f})"
        print(line)


def report(args, rounds: list[dict], device, model, requests, adapters=None) -> int:
    """Every round checked; per contestant the median of each number over the rounds; each ratio the median of the
    rounds' own ratios (paired: a noisy round falls on both sides of it). ``adapters``: engine-lora's."""
    for r, results in enumerate(rounds):
        problem = check(results)
        if problem:
            print(f"round {r + 1}: {problem}")
            return 1
    first = rounds[0]
    same = [k for k in OURS if k in first]
    if len(same) > 1 and "transformers" not in first:
        print(f"agreement: {', '.join(same)} give every request the same text")
    agreement, problem = agree(model, requests, first, args.tie_tolerance)
    if problem:
        print(f"round 1: {problem}")
        return 1
    for r, results in enumerate(rounds):
        variants, problem = variant_agree(model, requests, results, args.tie_tolerance, summary=r == 0)
        if problem:
            print(f"round {r + 1}: {problem}")
            return 1
        if r == 0 and variants:
            agreement["variants"] = variants
    if "engine-lora" in first:
        checks = lora_checks(requests, len(adapters), args.lora_checks)
        lora, problem = lora_agree(model, requests, first["engine-lora"], adapters, checks, args.tie_tolerance)
        agreement["engine_lora"] = lora
        if problem:
            print(f"round 1: {problem}")
            return 1
    keys = ("tokens_per_s", "ttft_p50", "ttft_p99", "latency_p50", "latency_p99", "wall_s", "tokens")
    med = {k: {x: statistics.median(r[k][x] for r in rounds) for x in keys} for k in first}
    rows = [
        [
            k,
            f"{m['tokens_per_s']:.0f}",
            f"{m['ttft_p50'] * 1e3:.0f}",
            f"{m['ttft_p99'] * 1e3:.0f}",
            f"{m['latency_p50'] * 1e3:.0f}",
            f"{m['latency_p99'] * 1e3:.0f}",
            f"{sum(r[k]['answered'] for r in rounds)}/{sum(r[k]['sent'] for r in rounds)}",
        ]
        for k, m in med.items()
    ]
    print(f"medians over {len(rounds)} round(s):")
    print(
        table(
            ["contestant", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "latency p99 ms", "answered"],
            rows,
        )
    )
    counters(first)
    ratios, per_round = {}, {}
    for name, (a, b, metric) in RATIOS.items():
        if a in first and b in first:
            per_round[name] = [r[a][metric] / r[b][metric] for r in rounds]
            ratios[name] = statistics.median(per_round[name])
            print(f"{name}: {ratios[name]:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in per_round[name])})")
    write_json(
        args.json,
        {
            "args": vars(args),
            "device": device_name(device),
            "agreement": agreement,
            "ratios": ratios,
            "ratios_per_round": per_round,
            "medians": med,
            "results": {k: {x: y for x, y in r.items() if x not in ("texts", "ids")} for k, r in first.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
