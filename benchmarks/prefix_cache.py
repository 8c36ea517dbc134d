"""Prefix caching: the time to first token of a long prompt sent again, against its first sending, in our
:class:`~trickles.infer.engine.Engine` with prefix caching on (the default), and the same with it off as reference.

Each of ``--prompts`` prompts of ``--prompt-len`` random bytes (2,000 by default) is sent, answered (``--max-tokens``
greedy tokens), then sent again; the engine runs in this process, stepped here, one request at a time, so a time to
first token is the prefill's: ``ceil(L / prefill_chunk)`` iterations the first time, one iteration over the last
block the second (every full block before it is found in the cache). Replies are checked equal between sendings and
between the two engines. Target: second / first sending <= 0.3x with the cache on (the reference, off, stays ~1x).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, one_device, table, write_json  # noqa: E402

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer import Sampling  # noqa: E402
from trickles.infer.engine import Engine, EngineConfig  # noqa: E402
from trickles.models import ModelConfig, apply_preset, build_model  # noqa: E402

TOK = ByteTokenizer()


def first_token(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """``(seconds to the first token, the reply's tokens)`` of one request, the engine stepped here."""
    start, first, tokens = time.perf_counter(), None, []
    for event in engine.generate(prompt, Sampling(max_new_tokens=max_tokens, temperature=0)):
        if event.token is not None:
            first = first if first is not None else time.perf_counter() - start
            tokens.append(event.token)
    return first if first is not None else time.perf_counter() - start, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--preset", default="demo")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = one_device(args.device, args.threads)
    context = args.prompt_len + args.max_tokens + args.block_size
    cfg = dataclasses.replace(apply_preset(ModelConfig(), args.preset), vocab_size=260, max_seq_len=context)
    model = build_model(cfg, seed=0).to(device).eval()
    print(
        f"prefix cache benchmark: {args.prompts} prompts of {args.prompt_len} tokens, each sent twice, "
        f"{cfg.n_layers} layers d={cfg.d_model}, prefill chunk {args.prefill_chunk}, {device_name(device)}"
    )
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    engines = {}
    for name, caching in (("cache on", True), ("cache off", False)):
        config = EngineConfig(
            max_batch=1, block_size=args.block_size, prefill_chunk=args.prefill_chunk, prefix_caching=caching
        )
        engines[name] = Engine(model, TOK, config)
    first_token(engines["cache off"], prompts[0][: args.block_size * 2], 1)  # warm-up (first-call costs)
    records = {name: [] for name in engines}
    for prompt in prompts:
        for name, engine in engines.items():
            first, reply = first_token(engine, prompt, args.max_tokens)
            again, reply_again = first_token(engine, prompt, args.max_tokens)
            records[name].append((first, again, reply, reply_again))
    replies = [{tuple(rs[i][j]) for rs in records.values() for j in (2, 3)} for i in range(len(prompts))]
    if any(len(r) != 1 for r in replies):
        print("disagreement: a prompt's reply differs between its sendings or between the engines")
        return 1
    print("agreement: every prompt gets the same reply at both sendings, with the cache on and off")
    rows, ratios = [], {}
    for name, rs in records.items():
        first = statistics.median(r[0] for r in rs)
        again = statistics.median(r[1] for r in rs)
        ratios[name] = statistics.median(r[1] / r[0] for r in rs)
        rows.append([name, f"{first * 1e3:.0f}", f"{again * 1e3:.0f}", f"{ratios[name]:.3f}"])
    print(table(["engine", "TTFT first ms", "TTFT again ms", "again/first"], rows))
    hits = engines["cache on"].pool.blocks.hits
    print(f"cache on: again/first {ratios['cache on']:.3f}x (target <= 0.3x); {hits} prompt tokens found in the cache")
    write_json(
        args.json,
        {"args": vars(args), "device": device_name(device), "ratios": ratios, "records": records, "hits": hits},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
