"""Large-batch training: LAMB against AdamW at 8x the demo's global batch, at the same number of tokens seen.

Runs, one after another in this process, the demo model (``trickles train``'s defaults) on the same data:

* ``adamw`` at the demo's batch ``B`` and learning rate ``lr`` (the baseline),
* ``lamb`` at batch ``B`` and ``--lamb-lr`` (LAMB's learning rate is a relative step, ``||dw|| = lr ||w||``, so it
  has its own base value),
* ``adamw`` and ``lamb`` at batch ``k B`` (``--scale``, default 8) with square-root learning-rate scaling
  (``lr sqrt(k)``), for ``1/k`` of the steps,

every run seeing ``--sequences`` training sequences in all, with a warm-up of the same fraction of its steps and the
same cosine decay. The held-out loss is measured every ``--eval-sequences`` sequences seen, on the same held-out
sequences for every run. Prints the table, writes ``--out``/large_batch.json and, with matplotlib,
``--out``/large_batch.png (held-out loss against tokens seen).

    python benchmarks/large_batch.py                                # CPU: about 25 minutes on 2 cores
    python benchmarks/large_batch.py --sequences 16000 --scale 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from trickles.config import Config  # noqa: E402
from trickles.topology import ParallelDims  # noqa: E402
from trickles.train.trainer import Trainer  # noqa: E402


def run(name: str, optimizer: str, batch: int, lr: float, args) -> dict:
    steps = args.sequences // batch
    every = max(1, args.eval_sequences // batch)
    cfg = Config.load(
        None,
        [
            f"train.optimizer={optimizer}",
            f"train.global_batch={batch}",
            f"train.lr={lr}",
            f"train.steps={steps}",
            f"train.warmup_steps={max(1, round(args.warmup * steps))}",
            f"train.eval_every={every}",
            f"train.eval_batches={max(1, args.held_out // batch)}",
            "train.sample_tokens=0",
            "train.plot=false",
            f"train.out_dir={args.out}/{name}",
            f"train.checkpoint_every={10**9}",
            *args.set,
        ],
    )
    t0 = time.perf_counter()
    tr = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    history = tr.fit()
    curve = [(r["step"] * batch * cfg.data.seq_len, r["val_loss"]) for r in history if r.get("val_loss") is not None]
    out = {
        "name": name,
        "optimizer": optimizer,
        "batch": batch,
        "lr": lr,
        "steps": steps,
        "curve": curve,
        "final_val": curve[-1][1],
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"{name:<22} batch {batch:>4}  lr {lr:<9.4g} steps {steps:>5}  final held-out loss {out['final_val']:.4f}  "
        f"({out['seconds']:.0f} s)",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=8192, help="training sequences each run sees")
    ap.add_argument("--batch", type=int, default=16, help="the base global batch (the demo's)")
    ap.add_argument("--scale", type=int, default=8, help="the large batch is scale x batch")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate at the base batch (the demo's)")
    ap.add_argument("--lamb-lr", type=float, default=0.02, help="LAMB's learning rate at the base batch")
    ap.add_argument("--warmup", type=float, default=0.08, help="warm-up, as a fraction of each run's steps")
    ap.add_argument("--eval-sequences", type=int, default=1024, help="evaluate every this many sequences seen")
    ap.add_argument("--held-out", type=int, default=128, help="held-out sequences per evaluation")
    ap.add_argument("--only", nargs="*", default=None, help="run only these of the four runs (by name)")
    ap.add_argument("--set", action="append", default=[], help="extra section.key=value for every run")
    ap.add_argument("--out", default="runs/large_batch")
    args = ap.parse_args()
    big, root = args.batch * args.scale, math.sqrt(args.scale)
    plan = [
        (f"adamw-b{args.batch}", "adamw", args.batch, args.lr),
        (f"lamb-b{args.batch}", "lamb", args.batch, args.lamb_lr),
        (f"adamw-b{big}-sqrt", "adamw", big, args.lr * root),
        (f"lamb-b{big}-sqrt", "lamb", big, args.lamb_lr * root),
    ]
    results = [run(*p, args) for p in plan if args.only is None or p[0] in args.only]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "large_batch.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs, ys = zip(*r["curve"])
        ax.plot([x / 1e6 for x in xs], ys, marker="o", ms=3, label=f"{r['name']} (lr {r['lr']:.3g})")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(f"demo model, {args.sequences} sequences: batch {args.batch} vs {big}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "large_batch.png"), dpi=120)
    print(f"plot: {os.path.join(args.out, 'large_batch.png')}")


if __name__ == "__main__":
    main()
