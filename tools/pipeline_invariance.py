"""Pipeline layouts against one process through ``trickles train``, 12 steps each: the zero-bubble schedules,
pipelines under ZeRO-2/3, with tp+sp and with cp, uneven stages (fp32), and zb-h1 in bf16 against bf16 on one
process. Prints each case's largest relative loss gap. The suite's invariance tests run these layouts for 6 steps;
this is the longer check, run by hand (a few minutes on two cores).

  python3 tools/pipeline_invariance.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BASE = [
    "model.preset=tiny",
    "data.seq_len=32",
    "data.max_bytes=120000",
    "train.steps=12",
    "train.global_batch=8",
    "train.micro_batch=1",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "train.plot=false",
    "train.checkpoint_every=0",
]
CASES = [  # name, ranks, overrides, the one-process reference's overrides
    ("pp2 zb-h1", 2, ["parallel.pp=2", "parallel.schedule=zb-h1"], []),
    (
        "pp4 zb-v, 8 layers",
        4,
        ["parallel.pp=4", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "model.n_layers=8"],
        ["model.n_layers=8"],
    ),
    (
        "pp2 zb-h1 tp2+sp",
        4,
        ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.schedule=zb-h1"],
        [],
    ),
    ("dp2 x pp2 ZeRO-2", 4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2"], []),
    ("pp2 ZeRO-3", 2, ["parallel.pp=2", "parallel.zero=3"], []),
    ("dp2 x pp2 ZeRO-3", 4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3"], []),
    (
        "pp2 zb-v cp2, 4 layers",
        4,
        ["parallel.pp=2", "parallel.cp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "model.n_layers=4"],
        ["model.n_layers=4"],
    ),
    (
        "pp4 uneven [1,3,3,1]",
        4,
        ["parallel.pp=4", "model.n_layers=8", "parallel.pipeline_layers=[1, 3, 3, 1]"],
        ["model.n_layers=8"],
    ),
    (
        "pp2 zb-h1 bf16",
        2,
        ["parallel.pp=2", "parallel.schedule=zb-h1", "memory.precision=bf16"],
        ["memory.precision=bf16"],
    ),
]


def train(out: str, ranks: int, overrides: list[str], cache: str) -> list[float]:
    """Each step's loss of ``trickles train --nproc ranks`` with the base settings and ``overrides``."""
    cmd = [sys.executable, "-m", "trickles", "train", "--quiet", "--nproc", str(ranks)]
    for o in [*BASE, f"data.cache_dir={cache}", f"train.out_dir={out}", *overrides]:
        cmd += ["--set", o]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "step" in r and "loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/pipeline-invariance", help="where the runs write (default: %(default)s)")
    out = ap.parse_args().out
    cache = os.path.join(out, "cache")
    refs: dict[tuple, list[float]] = {}
    for i, (name, ranks, overrides, ref_overrides) in enumerate(CASES):
        if tuple(ref_overrides) not in refs:
            refs[tuple(ref_overrides)] = train(os.path.join(out, f"one-{len(refs)}"), 1, ref_overrides, cache)
        ref = refs[tuple(ref_overrides)]
        start = time.perf_counter()
        losses = train(os.path.join(out, f"case-{i}"), ranks, overrides, cache)
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        print(
            f"{name:26s} {ranks} ranks  {len(losses)} steps  largest relative loss gap {gap:.2e}"
            f"  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
