"""Speculative decoding on a repetitive workload: our :class:`~trickles.infer.engine.Engine` decoding plainly vs with
n-gram proposals (prompt lookup) vs with a draft model, same target weights, greedy, tokens checked equal first.

**The model continues repetitive text because it was trained to** (a random model does not repeat itself, so it
would accept next to nothing). The setup trains, in this run and for ``--train-steps`` steps of AdamW, the target
(``--layers`` x ``--d-model``) and a draft (one layer, half the width) on one fixed code-like text of about 250 bytes
(``def f3(x):`` lines) repeated end to end, windows of ``--seq`` bytes at random offsets: both learn to recite it.
The workload: ``--requests`` prompts, each the text once and then its first ``r`` bytes (``r`` random), continued by
``--max-tokens`` greedy tokens; the continuation is the text going on, which the prompt already holds, so the n-gram
proposer finds it and the target agrees with it. That is the case prompt lookup is for (code edits, quoting,
summaries that copy); on text that does not repeat it proposes little (``docs/speculative-decoding.md``).

Reported per contestant: generated tokens/s over the whole workload (all requests submitted at once, ``--max-batch``
running together), engine iterations, drafts proposed and accepted; with ``--rounds R``, medians and paired ratios.
Target (CPU): ngram >= 1.5x plain tokens/s; the draft model's ratio is reported.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, one_device, table, write_json  # noqa: E402

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer import Sampling  # noqa: E402
from trickles.infer.engine import Engine, EngineConfig  # noqa: E402
from trickles.models import ModelConfig, build_model  # noqa: E402

TOK = ByteTokenizer()
CONTESTANTS = ("plain", "ngram", "draft")


def text() -> list[int]:
    """The repeated text: code-like lines, about 110 bytes."""
    lines = [f"def f{i}(x):\n    return x * {i + 2} + {7 * i % 10}\n" for i in range(3)]
    return TOK.encode("".join(lines))


def train(cfg: ModelConfig, steps: int, seq: int, batch: int, device, seed: int, lr: float = 1e-2):
    """A model of ``cfg`` trained for ``steps`` AdamW steps on windows of the repeated :func:`text`; its last loss."""
    model = build_model(cfg, seed=seed).to(device)
    stream = torch.tensor(text() * (2 + 2 * seq // len(text())), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        starts = torch.randint(0, len(text()), (batch,), generator=g).tolist()
        x = torch.stack([stream[s : s + seq + 1] for s in starts])
        for group in opt.param_groups:  # warm up, then decay linearly
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / max(1, steps))
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval(), loss.item()


def workload(args) -> list[list[int]]:
    rng, base = random.Random(args.seed), text()
    return [base + base[: rng.randrange(8, len(base) - 8)] for _ in range(args.requests)]


def run(model, prompts, args, **spec) -> dict:
    """Every prompt submitted at once, the engine stepped here until idle; the record of the run."""
    engine = Engine(model, TOK, EngineConfig(max_batch=args.max_batch, block_size=args.block_size, **spec))
    sampling = Sampling(max_new_tokens=args.max_tokens, temperature=0)
    start = time.perf_counter()
    requests = [engine.submit(p, sampling) for p in prompts]
    engine.run_until_idle()
    wall = time.perf_counter() - start
    tokens = [r.result[0].tokens for r in requests]
    spec = engine.spec
    return {
        "wall_s": wall,
        "tokens": sum(len(t) for t in tokens),
        "tokens_per_s": sum(len(t) for t in tokens) / wall,
        "steps": engine.steps,
        "drafted": spec.drafted if spec else 0,
        "accepted": spec.accepted if spec else 0,
        "ids": tokens,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--layers", type=int, default=2, help="the target's layers (default 2)")
    p.add_argument("--d-model", type=int, default=128, help="the target's width (default 128)")
    p.add_argument("--draft-layers", type=int, default=2, help="the draft's layers, at half the width (default 2)")
    p.add_argument("--seq", type=int, default=384, help="training window, the longest prompt + reply (default 384)")
    p.add_argument("--train-steps", type=int, default=100, help="AdamW steps training each model (default 100)")
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (default 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = one_device(args.device, args.threads)
    context = max(args.seq, 2 * len(text()) + args.max_tokens)
    heads = max(2, args.d_model // 32)

    def shape(layers: int, width: int, h: int) -> ModelConfig:
        return ModelConfig(
            n_layers=layers, d_model=width, n_heads=h, n_kv_heads=max(1, h // 2), vocab_size=260, max_seq_len=context
        )

    started = time.perf_counter()
    target, loss = train(
        shape(args.layers, args.d_model, heads), args.train_steps, args.seq, args.train_batch, device, 0
    )
    draft, draft_loss = train(
        shape(args.draft_layers, args.d_model // 2, max(2, heads // 2)),
        args.train_steps,
        args.seq,
        args.train_batch,
        device,
        1,
    )
    print(
        f"speculative decoding benchmark: target {args.layers} layers d={args.d_model} (loss {loss:.3f}), draft "
        f"{args.draft_layers} layers d={args.d_model // 2} (loss {draft_loss:.3f}), trained {args.train_steps} steps "
        f"each in {time.perf_counter() - started:.0f} s; {args.requests} requests of {args.max_tokens} tokens, "
        f"K={args.k}, {device_name(device)}"
    )
    prompts = workload(args)
    specs = {
        "plain": {},
        "ngram": {"speculative": "ngram", "num_speculative_tokens": args.k},
        "draft": {"speculative": "draft", "num_speculative_tokens": args.k, "draft_model": draft},
    }
    rounds = []
    for r in range(args.rounds):
        names = CONTESTANTS[r % 3 :] + CONTESTANTS[: r % 3]  # each round starts one contestant further on
        rounds.append({n: run(target, prompts, args, **specs[n]) for n in names})
        print(f"  round {r + 1}: " + ", ".join(f"{n} {x['tokens_per_s']:.0f} tokens/s" for n, x in rounds[-1].items()))
    first = rounds[0]
    for n in CONTESTANTS[1:]:
        if first[n]["ids"] != first["plain"]["ids"]:
            differ = [i for i, (a, b) in enumerate(zip(first[n]["ids"], first["plain"]["ids"])) if a != b]
            print(f"disagreement: {n} answers requests {differ[:5]} differently from plain decoding")
            return 1
    print(f"agreement: every request's greedy tokens are the same for {', '.join(CONTESTANTS)}")
    keys = ("tokens_per_s", "wall_s", "tokens", "steps", "drafted", "accepted")
    med = {n: {k: statistics.median(r[n][k] for r in rounds) for k in keys} for n in CONTESTANTS}
    rows = [
        [
            n,
            f"{m['tokens_per_s']:.0f}",
            f"{m['steps']:.0f}",
            f"{m['tokens'] / m['steps']:.2f}",
            f"{m['drafted']:.0f}",
            f"{m['accepted'] / m['drafted']:.2f}" if m["drafted"] else "-",
        ]
        for n, m in med.items()
    ]
    print(f"medians over {len(rounds)} round(s):")
    print(table(["contestant", "tokens/s", "iterations", "tokens/iteration", "drafted", "accepted/drafted"], rows))
    ratios = {}
    for n in CONTESTANTS[1:]:
        per_round = [r[n]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rounds]
        ratios[f"{n}_over_plain_tokens_per_s"] = statistics.median(per_round)
        listed = ", ".join(f"{x:.2f}" for x in per_round)
        print(f"{n}/plain tokens/s: {statistics.median(per_round):.2f}x (rounds: {listed})")
    write_json(
        args.json,
        {
            "args": vars(args),
            "device": device_name(device),
            "losses": {"target": loss, "draft": draft_loss},
            "ratios": ratios,
            "medians": med,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
