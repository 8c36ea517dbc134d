"""Ring attention with a sliding window against the same ring with full causal attention, same run.

What is compared
    One layer's attention core -- forward and backward -- on a sequence split over ``N`` context-parallel ranks
    (``--world``, 2 unless told), in the ring's load-balanced layout (rank ``i`` holding chunks ``i`` and ``2N-1-i``),
    as ``Attention.core`` calls it: ``trickles.parallel.ring.ring_attention`` on this rank's ``q [B, H, t, D]``,
    ``k, v [B, H_kv, t, D]`` (``t = T / N``), to the output and back to the gradients of ``q``, ``k`` and ``v``:

    * ``ring, window``: a sliding window of ``--window`` tokens (a quarter of the sequence unless told): blocks wholly
      outside it are skipped, blocks its edge crosses computed in slabs of query rows
      (``trickles/parallel/ring_plan.py``);
    * ``ring, causal`` (the peer): the same ring without a window.

How
    * Same data on every rank from a fixed generator; each rank takes its tokens of it.
    * Agreement check before timing: every rank's output and gradients gathered in sequence order and compared with
      fp32 SDPA on the whole sequence with the same mask (``trickles.models.masks.window_mask``, or causal); relative
      error ``||a - b|| / ||b||`` at most ``--tol`` (1e-5), else the run stops.
    * What each computes: the scores every rank's block kernels are handed (a causal block counted as its triangle)
      and the blocks skipped, from the ring's own plan; the bytes each rank sends, from the topology's ``CommLedger``
      (with the window only the chunks some rank further on sees travel, ``trickles.parallel.ring_plan.route``).
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds of one step each, the order alternating; a step
      starts after a barrier and ends when its backward has returned; its time is the slowest rank's. CPU:
      ``torch.set_num_threads(cores // N)`` per rank, gloo; CUDA: one GPU per rank under ``torchrun``.

Target
    causal / window median step time >= 1.5x at a window of a quarter of the sequence and cp=2.

Examples::

    python benchmarks/context_window.py                    # CPU, 2 ranks, B 1, H 8, T 2048, D 64, window 512, fp32
    python benchmarks/context_window.py --world 4 --window 256
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import (  # noqa: E402
    PAIRED_NOTE,
    Contestant,
    compare_times,
    device_line,
    entry,
    finish,
    gather,
    refuse,
    setup_rank,
    time_rounds,
    times_table,
)
from _timing import rel_error, table, write_json  # noqa: E402

from trickles.models.masks import window_mask  # noqa: E402
from trickles.parallel.ring import ring_attention  # noqa: E402
from trickles.parallel.ring_plan import chunk_ids, plain_blocks  # noqa: E402
from trickles.parallel.sequence import positions, unshard_sequence  # noqa: E402
from trickles.topology import ParallelDims  # noqa: E402

WINDOW, CAUSAL = "ring, window", "ring, causal"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--world", type=int, default=2, help="context-parallel degree (processes)")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--heads", type=int, default=8, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence T")
    p.add_argument("--window", type=int, default=None, help="sliding window (default: a quarter of --seq)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each per round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds after the agreement check")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads per rank on CPU")
    p.add_argument("--tol", type=float, default=1e-5, help="largest relative error allowed in the agreement check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH (rank 0)")
    return p.parse_args(argv)


class Ring(Contestant):
    """This rank's ring attention core, with ``window`` or without."""

    def __init__(self, name, peer, window, whole, dout, comm):
        super().__init__(name)
        self.peer, self.window, self.comm = peer, window, comm
        pos = positions(dout.shape[2], comm.size, comm.rank, "ring").to(dout.device)
        self.inputs = [x[:, :, pos].detach().clone().requires_grad_() for x in whole]
        self.dout = dout[:, :, pos].contiguous()
        self.none = torch.zeros((), device=dout.device)

    def forward(self):
        return ring_attention(*self.inputs, self.comm, window=self.window)

    def step(self, x=None, y=None):
        for p in self.inputs:
            p.grad = None
        self.forward().backward(self.dout)
        return self.none


def check(c: Ring, ref: list[torch.Tensor]) -> list[float]:
    """Relative errors of the output and the gradients of q, k, v, every rank's tokens put back in order."""
    c.step()
    out = c.forward().detach()
    errors = []
    for got, want in zip([out, *(p.grad for p in c.inputs)], ref):
        mine = got.transpose(1, 2).contiguous()  # [B, t, H, D]: sequence second, as unshard_sequence takes it
        parts = [torch.empty_like(mine) for _ in range(c.comm.size)]
        dist.all_gather(parts, mine)
        errors.append(rel_error(unshard_sequence(parts, "ring").transpose(1, 2).float(), want))
    return errors


def work(rank: int, world: int, c: int, window: int | None) -> tuple[int, int, int]:
    """``(scores computed, kernel calls, chunk pairs skipped)`` of this rank in one forward, from the ring's plan."""
    scores = calls = skipped = 0
    for step in range(world):
        src = (rank - step) % world
        blocks = plain_blocks(rank, src, world, c, window, "cpu")
        for qs, ks, causal, _ in blocks:
            rows, keys = qs.stop - qs.start, ks.stop - ks.start
            scores += keys * (keys + 1) // 2 + (rows - keys) * keys if causal else rows * keys
        calls += len(blocks)
        covered = {(qs.start // c, ks.start // c) for qs, ks, _, _ in blocks}
        below = {
            (i, j) for i, a in enumerate(chunk_ids(rank, world)) for j, b in enumerate(chunk_ids(src, world)) if b <= a
        }
        skipped += len(below - covered)
    return scores, calls, skipped


def rank_main(args) -> int:
    device, rank, world = setup_rank(args)
    b, h, t, d = args.batch, args.heads, args.seq, args.head_dim
    h_kv, window = args.kv_heads or h, args.window or args.seq // 4
    if t % (2 * world) or h % h_kv or not 0 < window <= t:
        return refuse(
            f"context_window.py: --seq {t} must divide by 2 x --world, --heads {h} by --kv-heads {h_kv}, and "
            f"--window {window} lie in 1..--seq; change them"
        )
    topo = ParallelDims(cp=world).build(device)
    comm = topo.comm("cp")
    g = torch.Generator().manual_seed(args.seed)
    whole = [torch.randn(b, n, t, d, generator=g).to(device) for n in (h, h_kv, h_kv)]
    dout = torch.randn(b, h, t, d, generator=g).to(device)

    refs = {}
    for name, w in ((WINDOW, window), (CAUSAL, None)):
        inputs = [x.clone().requires_grad_() for x in whole]
        mask = window_mask(0, t, t, w or t, device)
        out = F.scaled_dot_product_attention(*inputs, attn_mask=mask, enable_gqa=h != h_kv)
        out.backward(dout)
        refs[name] = [out.detach(), *(x.grad for x in inputs)]
    contestants = [Ring(WINDOW, CAUSAL, window, whole, dout, comm), Ring(CAUSAL, None, None, whole, dout, comm)]
    errors = {c.name: check(c, refs[c.name]) for c in contestants}
    del refs
    sent = {}
    for c in contestants:
        topo.ledger.reset()
        c.step()
        sent[c.name] = sum(v["wire_bytes"] for k, v in topo.ledger.snapshot().items() if k.startswith("send/"))
    time_rounds(contestants, None, None, args, device)
    c_len = t // (2 * world)
    mine = {
        "times": {c.name: c.times for c in contestants},
        "sent": sent,
        "work": {WINDOW: work(rank, world, c_len, window), CAUSAL: work(rank, world, c_len, None)},
    }
    everyone = gather(mine)
    status = 0
    if rank == 0:
        status = report(args, everyone, contestants, errors, window, device, world)
    return finish(status, device)


def report(args, everyone, contestants, errors, window, device, world) -> int:
    print(
        f"trickles ring attention with a sliding window vs the same ring fully causal, attention core forward + "
        f"backward, cp={world}"
    )
    print(
        f"  shape   B {args.batch}, H {args.heads}, H_kv {args.kv_heads or args.heads}, T {args.seq} "
        f"({args.seq // world} tokens per rank), D {args.head_dim}, fp32; window {window} ({window / args.seq:.2f} T)"
    )
    print(device_line(device))
    rows, ok = [], True
    for n, e in errors.items():
        ok &= max(e) <= args.tol
        rows.append([n, *(f"{x:.1e}" for x in e), "ok" if max(e) <= args.tol else "MISMATCH"])
    print(f"\nagreement check vs fp32 SDPA on the whole sequence with the same mask (tolerance {args.tol:g}):")
    print(table(["implementation", "out", "dq", "dk", "dv", ""], rows))
    if not ok:
        print("a ring disagrees with SDPA: the timings would be meaningless", file=sys.stderr)
        return 1
    results, cells = compare_times(everyone, contestants, args.steps, args.batch * args.seq)
    header = ["implementation", "median ms", "mean ms", "stdev ms", "tokens/s", "peer", "vs peer", "paired"]
    header += ["scores (max rank)", "kernel calls", "chunk pairs skipped", "sent MiB"]
    table_rows = []
    for c in contestants:
        w = [r["work"][c.name] for r in everyone]
        table_rows.append(
            [
                *cells[c.name],
                f"{max(x[0] for x in w):,}",
                "/".join(str(x[1]) for x in w),
                "/".join(str(x[2]) for x in w),
                f"{max(r['sent'][c.name] for r in everyone) / 2**20:.2f}",
            ]
        )
    times_table(
        args,
        table_rows,
        header,
        note=PAIRED_NOTE + ". scores: per forward, the largest rank's (a causal block its triangle); kernel calls "
        "and chunk pairs skipped: per rank (rank 0/1/...); sent: bytes a rank sends per step (CommLedger).",
    )
    r = results[WINDOW]
    speedup, paired = 1 / r["ratio"], 1 / r["paired_ratio"]
    verdict = "met" if speedup >= 1.5 else "NOT met"
    print(f"\ntarget causal/window >= 1.5x:  {speedup:.2f}x (paired {paired:.2f}x): {verdict}")
    if args.json:
        per_rank = {f: {c.name: [r[f][c.name] for r in everyone] for c in contestants} for f in ("work", "sent")}
        doc = {"args": vars(args), "world": world, "window": window, "errors": errors, "results": results}
        write_json(args.json, {**doc, **per_rank})
    return 0


main = entry(parse_args, rank_main)


if __name__ == "__main__":
    sys.exit(main())
