"""The harness every benchmark shares: timing rounds, paired ratios, tables and JSON.

Every benchmark measures trickles against a peer *in the same run*, interleaving the two step by
step so that machine noise (other processes, frequency scaling, a warm or cold cache) falls on
both alike. Times are wall-clock seconds from ``time.perf_counter``; on CUDA the device is
synchronized before the clock starts and before it stops, so a step's time includes its kernels.
What only the multi-rank benchmarks share (ranks, their verdicts and reports) is in ``_ranks.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def model_options(p: argparse.ArgumentParser, seq: int, presets) -> None:
    """The model options of a one-device benchmark: device, dtype, preset, batch and sequence length (default
    ``seq``)."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--preset", default="demo", choices=sorted(presets))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=seq)


def timing_options(p: argparse.ArgumentParser) -> None:
    """Rounds, warm-up, CPU threads and the JSON output, as the one-device benchmarks take them."""
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: 1 on a CPU)")
    p.add_argument("--json", default=None, help="write the results here")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())


def one_device(choice: str, threads: int | None = None) -> torch.device:
    """The device of a one-process benchmark's ``--device`` (``auto``: CUDA where there is one); on a CPU,
    ``--threads`` threads (default 1, so that the contestants' times do not depend on the core count)."""
    device = torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(threads or 1)
    return device


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """``(seconds, fn())`` with the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def rotations(names: list[str], rounds: int):
    """Yields ``(round, name)`` ``rounds`` times over ``names``, starting each round one further on.

    Rotating the order keeps any effect of "who ran just before me" from always favouring the
    same contestant.
    """
    n = len(names)
    for r in range(rounds):
        for j in range(n):
            yield r, names[(r + j) % n]


def interleaved(
    names: list[str], prepare: Callable[[str], Callable[[], Any]], rounds: int, device: torch.device, warmup: int = 0
) -> dict[str, list[float]]:
    """Each name's step times over ``rounds`` timed rounds after ``warmup`` untimed ones, every name once a round in
    :func:`rotations`' order; ``prepare(name)`` runs off the clock and returns the step to time."""
    times: dict[str, list[float]] = {n: [] for n in names}
    for r, name in rotations(names, warmup + rounds):
        step = prepare(name)
        seconds, _ = timed(step, device)
        if r >= warmup:
            times[name].append(seconds)
    return times


def paired(times: list[float], peer: list[float]) -> float:
    """The median over rounds of ``times / peer`` in the same round: steadier than the ratio of medians when the
    machine's speed drifts."""
    return statistics.median(a / b for a, b in zip(times, peer))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32, the agreement checks' measure (0 where both are zero)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def summarize(times: list[float]) -> dict[str, float]:
    """Median, mean, standard deviation, min and max of a list of step times (seconds)."""
    return {
        "median": statistics.median(times),
        "mean": statistics.fmean(times),
        "stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
        "min": min(times),
        "max": max(times),
        "n": len(times),
    }


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A plain left-aligned text table (first column left, the others right-aligned)."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def si(value: float | None, unit: str = "", digits: int = 3) -> str:
    """``12.3 G`` style formatting; ``-`` for None."""
    if value is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}".rstrip()
    return f"{value:.{digits}g} {unit}".rstrip()


def write_json(path: str | None, doc: dict) -> None:
    """``doc`` as JSON at ``path``, its folder made (nothing without a path)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    print(f"wrote {path}")


def add_to_json(path: str, key: str, doc: dict) -> None:
    """Adds ``{key: doc}`` to the JSON object at ``path`` (the parts of one run sharing a file), its folder made."""
    old = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = {}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**old, key: doc}, f, indent=2, default=str)
    print(f"wrote {path} ({key})")
