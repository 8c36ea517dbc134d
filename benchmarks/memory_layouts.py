"""The memory model against measured runs, through the command line, for every dimension and option.

What is compared
    For each layout of :data:`LAYOUTS` (data parallel and ZeRO 1-3, optimizer offload, recomputation full and
    selective, dropout, 1-D tensor parallel with and without sequence parallelism, each pipeline schedule, context
    parallel ring and all-to-all, expert parallel, 2-D / 2.5-D / 3-D tensor parallelism, bf16, and mixes of them),
    ``trickles memory --measure STEPS --nproc N --set ...`` predicts the bytes per device and measures them in a
    real run of that layout. This script reads the predicted and measured ``held`` (model states on the device +
    the saved activations of what is in flight) and ``peak`` rows of the table it prints (under pipeline
    parallelism the most-loaded stage's table, and each stage's summary line when it prints them) and reports
    measured / predicted.

The model
    The demo model (llama, 4 layers, d_model 256, byte vocabulary) at sequence 128, global batch 8 unless a layout
    says otherwise; the MoE layouts give it 4 experts. On a CPU the measured peak is the model states plus the most
    the last step allocates above them (the profiler's record), see ``trickles/memory/report.py``.

Target
    ``held`` and ``peak`` within 5% of the prediction for every layout (``--tol``); the exit status is 1 otherwise.
    Expert parallelism is predicted for a balanced load and a learned router is not balanced: its row also shows
    the prediction at the routing the run saw (``trickles/memory/routing.py``), which is not what is judged.

Usage
    python benchmarks/memory_layouts.py                   # every layout (about 10-15 minutes on 2 cores)
    python benchmarks/memory_layouts.py --only zero pp    # layouts whose name contains one of these
    python benchmarks/memory_layouts.py --json out/memory_layouts.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

BASE = ["model.preset=demo", "data.seq_len=128", "train.global_batch=8", "train.eval_every=0"]
MOE = ["model.moe_experts=4", "model.moe_top_k=2"]

#: name -> (ranks, overrides): every dimension and memory option the library has, alone and mixed.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one process": (1, []),
    "dp2 zero0": (2, ["parallel.zero=0"]),
    "dp2 zero1": (2, ["parallel.zero=1"]),
    "dp2 zero2": (2, ["parallel.zero=2"]),
    "dp2 zero3": (2, ["parallel.zero=3"]),
    "dp2 zero2 offload": (2, ["parallel.zero=2", "memory.offload_optimizer=true"]),
    "dp2 zero3 offload": (2, ["parallel.zero=3", "memory.offload_optimizer=true"]),
    "recompute full": (1, ["memory.recompute=full"]),
    "recompute selective": (1, ["memory.recompute=selective"]),
    "recompute elementwise": (1, ["memory.recompute=elementwise"]),
    "dropout 0.1": (1, ["model.dropout=0.1"]),
    "dp2 zero1 bf16": (2, ["parallel.zero=1", "memory.precision=bf16"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2 sequence parallel dropout": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1"]),
    "pp2 gpipe": (2, ["parallel.pp=2", "parallel.schedule=gpipe", "train.micro_batch=2"]),
    "pp2 1f1b": (2, ["parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=2"]),
    "pp2 interleaved v2": (
        2,
        ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "train.micro_batch=2"],
    ),
    "pp2 1f1b dropout recompute full": (
        2,
        ["parallel.pp=2", "train.micro_batch=2", "model.dropout=0.1", "memory.recompute=full"],
    ),
    "pp2 interleaved v2 recompute full:1 + elementwise": (
        2,
        [
            "parallel.pp=2",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "train.micro_batch=2",
            "memory.recompute=full",
            "memory.recompute_num_layers=1",
            "memory.recompute_rest=elementwise",
        ],
    ),
    "cp2 ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "cp2 ulysses": (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "moe ep2 zero1": (2, [*MOE, "parallel.ep=2", "parallel.zero=1"]),
    "tp4 2d": (4, ["parallel.tp=4", "parallel.tp_mode=2d"]),
    "dp2 pp2 zero1 1f1b": (4, ["parallel.pp=2", "parallel.zero=1", "train.micro_batch=2"]),
    "pp2 tp2 sequence parallel": (
        4,
        ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=2"],
    ),
    "tp8 2.5d": (8, ["parallel.tp=8", "parallel.tp_mode=2.5d", "parallel.tp_depth=2", "train.global_batch=16"]),
    "tp8 3d": (8, ["parallel.tp=8", "parallel.tp_mode=3d", "train.global_batch=16"]),
}

_SIZE = r"([\d,.]+ (?:GiB|MiB|KiB|B))"
_ROW = re.compile(rf"^(held|peak)\s+{_SIZE}\s+{_SIZE}")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def _bytes(text: str) -> float:
    value, unit = text.rsplit(" ", 1)
    return float(value.replace(",", "")) * _UNITS[unit]


def parse(output: str) -> dict[str, tuple[float, float]]:
    """``{"held": (predicted, measured), "peak": (...)}`` from the first table ``trickles memory`` prints."""
    rows: dict[str, tuple[float, float]] = {}
    host_columns = False  # with optimizer offload: device, host, measured device, measured host
    for line in output.splitlines():
        if "measured device" in line:
            host_columns = True
        m = _ROW.match(line.strip())
        if m and m.group(1) not in rows:
            sizes = re.findall(_SIZE, line)
            rows[m.group(1)] = (_bytes(sizes[0]), _bytes(sizes[2] if host_columns else sizes[1]))
    return rows


def run_layout(name: str, ranks: int, overrides: list[str], steps: int, workdir: str) -> dict:
    sets = [*BASE, f"train.out_dir={workdir}/{re.sub(r'[^a-z0-9]+', '_', name)}", *overrides]
    cmd = [sys.executable, "-m", "trickles", "memory", "--measure", str(steps), "--nproc", str(ranks)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - t0
    rows = parse(proc.stdout)
    out = {"name": name, "ranks": ranks, "overrides": overrides, "seconds": round(took, 1), "status": proc.returncode}
    if proc.returncode or set(rows) != {"held", "peak"}:
        out["error"] = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return out
    for key, (pred, meas) in rows.items():
        out[key] = {"predicted": pred, "measured": meas, "ratio": meas / pred if pred else float("nan")}
    for key in ("held", "peak"):  # expert parallelism: the prediction at the routing the run saw (memory/routing.py)
        m = re.search(rf"{key} at the routing seen: {_SIZE}", proc.stdout)
        if m:
            out[f"{key}_at_routing"] = {
                "predicted": _bytes(m.group(1)),
                "ratio": out[key]["measured"] / _bytes(m.group(1)),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="run the layouts whose name contains one of these words")
    ap.add_argument("--steps", type=int, default=2, help="training steps each measurement runs")
    ap.add_argument("--tol", type=float, default=0.05, help="largest |measured / predicted - 1| accepted")
    ap.add_argument("--json", default=None, help="write every row to this JSON file")
    args = ap.parse_args(argv)
    chosen = {k: v for k, v in LAYOUTS.items() if not args.only or any(w in k for w in args.only)}
    results, failed = [], 0
    print(f"{'layout':<34}{'ranks':>6}{'held pred':>13}{'meas/pred':>11}{'peak pred':>13}{'meas/pred':>11}{'s':>7}")
    with tempfile.TemporaryDirectory(prefix="memory_layouts_") as work:
        for name, (ranks, overrides) in chosen.items():
            r = run_layout(name, ranks, overrides, args.steps, work)
            results.append(r)
            if "error" in r:
                failed += 1
                print(f"{name:<34}{ranks:>6}  error: {r['error']}")
                continue
            bad = any(abs(r[k]["ratio"] - 1) > args.tol for k in ("held", "peak"))
            failed += bad
            print(
                f"{name:<34}{ranks:>6}{r['held']['predicted'] / 2**20:>10.2f} Mi{r['held']['ratio']:>11.3f}"
                f"{r['peak']['predicted'] / 2**20:>10.2f} Mi{r['peak']['ratio']:>11.3f}{r['seconds']:>7.0f}"
                + ("  <- outside the tolerance" if bad else ""),
                flush=True,
            )
            if "held_at_routing" in r:  # expert parallelism: under its own row
                print(
                    f"{'  at the routing seen':<40}{r['held_at_routing']['predicted'] / 2**20:>10.2f} Mi"
                    f"{r['held_at_routing']['ratio']:>11.3f}{r['peak_at_routing']['predicted'] / 2**20:>10.2f} Mi"
                    f"{r['peak_at_routing']['ratio']:>11.3f}",
                    flush=True,
                )
    print(f"\n{len(results) - failed} of {len(results)} layouts within {args.tol:.0%} (held and peak)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
