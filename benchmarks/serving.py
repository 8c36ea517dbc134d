"""Serving under load: trickles' continuous batching vs its static batcher vs ``transformers``' continuous batching.

The workload is fixed by the seed: ``--requests`` prompts of random printable bytes whose lengths cycle through
``--prompt-lens`` and whose ``max_tokens`` cycle through ``--output-lens`` (greedy decoding, the same model and
weights for everyone; ours is exported with ``save_hf`` for transformers). Arrivals: ``--concurrency C`` clients,
each sending its next request as soon as its previous one is answered (closed loop, the default), or ``--rate R``
requests a second in a Poisson process. A contestant's clock runs from the first request sent to the last answer
received (after ``--warmup`` untimed requests), bounded by ``--time-limit`` (a request not answered by then counts
as lost and fails the run).

Contestants:

* ``continuous``: ``trickles serve``'s application (:mod:`trickles.infer.server`) under uvicorn on loopback, in a
  child process (so that the load generator's threads do not share its interpreter lock; on CUDA, which a forked
  process cannot use, in a thread), the clients streaming (server-sent events; a choice's first chunk is sent with
  its first token);
* ``static``: the same server with ``batching="static"`` (a batch runs to its end before the next starts);
* ``engine``: our :class:`~trickles.infer.engine.Engine` called in this process (no HTTP), next to
* ``transformers``: ``transformers``' continuous-batching manager (``init_continuous_batching``, the machinery of
  ``generate_batch``), requests added and results read in this process, streamed for the first token.

With ``--rounds R`` every contestant runs R times, each round starting one contestant further on; the table holds the
median of each number, and each ratio is the median of the rounds' own ratios. Reported per contestant: generated
tokens/s, time to first token and end-to-end latency (p50, p99), requests sent
and answered, where answered means whole: a non-200, a stream that carries an ``{"error": ...}`` event, or one that
ends without its ``finish_reason``, usage or ``[DONE]``, is a failed request, and any failed request fails the run.
Agreement first: every request's greedy text must be the same from our three contestants; each request transformers
answers differently is printed with the reason, read from our model's logits where the two answers part: a near-tie
(the two tokens' logits within ``--tie-tolerance``, which kernels' rounding may break either way) is reported, a
disagreement without one fails the run. Targets (CPU, 16 clients): continuous >= 2x
static's tokens/s with at most half its p99 time to first token, and engine >= 1.0x transformers'.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, one_device, table, write_json  # noqa: E402

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer import Sampling, decode  # noqa: E402
from trickles.infer.engine import Engine, EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.models import ModelConfig, apply_preset, build_model, save_hf  # noqa: E402

TOK = ByteTokenizer()
CONTESTANTS = ("continuous", "static", "engine", "transformers")


def workload(args) -> list[tuple[str, int]]:
    """``(prompt text, max_tokens)`` per request."""
    rng = random.Random(args.seed)
    plens, olens = [int(x) for x in args.prompt_lens.split(",")], [int(x) for x in args.output_lens.split(",")]
    return [
        ("".join(chr(rng.randrange(32, 127)) for _ in range(plens[i % len(plens)])), olens[i % len(olens)])
        for i in range(args.requests)
    ]


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


def run_engine(args, model, requests) -> dict:
    engine = Engine(model, TOK, EngineConfig(max_batch=args.max_batch, block_size=args.block_size))
    engine.start()

    def send(i):
        prompt, max_tokens = requests[i]
        started, first, toks = time.perf_counter(), None, []
        for ev in engine.submit(TOK.encode(prompt), Sampling(max_new_tokens=max_tokens, temperature=0)).events(600):
            if ev.token is not None:
                toks.append(ev.token)
                if first is None:
                    first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started, TOK.decode(toks), len(toks), toks

    try:
        return drive(args, requests, send)
    finally:
        engine.stop()


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
    p.add_argument("--prompt-lens", default="32,128,16,64")
    p.add_argument("--output-lens", default="16,512,32,8,128,64")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds a contestant may take")
    p.add_argument("--warmup", type=int, default=1, help="requests sent one by one, untimed, before the clock starts")
    p.add_argument("--only", nargs="*", default=list(CONTESTANTS), choices=CONTESTANTS)
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
    device = one_device(args.device, args.threads)
    requests = workload(args)
    context = max(len(t) for t, _ in requests) + max(m for _, m in requests) + 1
    cfg = dataclasses.replace(apply_preset(ModelConfig(), args.preset), vocab_size=260, max_seq_len=context)
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layers=args.layers)
    model = build_model(cfg, seed=0).to(device).eval()
    print(
        f"serving benchmark: {args.requests} requests, prompts {args.prompt_lens} bytes, outputs {args.output_lens} "
        f"tokens, {f'rate {args.rate:g}/s' if args.rate else f'{args.concurrency} clients'}, "
        f"{cfg.n_layers} layers d={cfg.d_model}, {device_name(device)}"
    )
    hf = None
    names = list(args.only)
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
    rounds = []
    for r, _ in enumerate(range(args.rounds)):
        results = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each round starts one contestant further on
            if name == "transformers":
                results[name] = run_transformers(args, hf, requests)
            elif name == "engine":
                results[name] = run_engine(args, model, requests)
            else:
                results[name] = run_ours(args, model, requests, name, device)
            x = results[name]
            print(f"  round {r + 1}, {name}: {x['answered']}/{x['sent']} answered in {x['wall_s']:.1f} s", flush=True)
        rounds.append({k: results[k] for k in names})
    return report(args, rounds, device, model, requests)


def check(results: dict) -> str | None:
    """What is wrong with one round (a request lost, our contestants disagreeing), else None."""
    lost = {k: r["errors"] or r["sent"] - r["answered"] for k, r in results.items() if r["answered"] < r["sent"]}
    if lost:
        return f"requests lost or failed: {lost}"
    ours = [k for k in ("continuous", "static", "engine") if k in results]
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
}


@torch.no_grad()
def explain(model, prompt: list[int], ours: list[int], theirs: list[int], tolerance: float) -> tuple[bool, str]:
    """Why two greedy answers to ``prompt`` differ: ``(a tie, the reason)``. At the first token where they part, our
    model's logits after the common prefix are read: when the two tokens' logits are within ``tolerance`` (a tie, or
    a near-tie that float rounding of different kernels may break either way) the difference is explained; otherwise
    one side did not pick the larger logit, and it is an error. An answer that ended there stands for end-of-text."""
    k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    context = torch.tensor([prompt + ours[:k]], device=next(model.parameters()).device)
    logits = model(context)[0, -1].float()
    a = ours[k] if k < len(ours) else TOK.eos_id
    b = theirs[k] if k < len(theirs) else TOK.eos_id
    gap = abs(float(logits[a] - logits[b]))
    tie = gap <= tolerance
    return tie, (
        f"at generated token {k}: ours {a} (logit {float(logits[a]):.6f}), transformers {b} (logit "
        f"{float(logits[b]):.6f}), gap {gap:.2e} {'<=' if tie else '>'} {tolerance:g}"
        f"{': a near-tie that rounding may break either way' if tie else ': no tie, a real disagreement'}"
    )


def agree(model, requests, results: dict, tolerance: float) -> tuple[dict, str | None]:
    """Our texts against transformers' per request: ``(agreement record, the error or None)``. Every request that
    differs is printed with :func:`explain`'s reason; one that differs without a tie fails the run."""
    ours = [k for k in ("engine", "continuous", "static") if k in results]
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
                model, [TOK.encode(prompt)], Sampling(max_new_tokens=max_tokens, temperature=0), TOK.eos_id
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


def report(args, rounds: list[dict], device, model, requests) -> int:
    """Every round checked; per contestant the median of each number over the rounds; each ratio the median of the
    rounds' own ratios (paired: a noisy round falls on both sides of it)."""
    for r, results in enumerate(rounds):
        problem = check(results)
        if problem:
            print(f"round {r + 1}: {problem}")
            return 1
    first = rounds[0]
    agreement, problem = agree(model, requests, first, args.tie_tolerance)
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
