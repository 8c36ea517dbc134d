"""Small timing helpers shared by the benchmarks.

Every benchmark measures trickles against a peer *in the same run*, interleaving the two step by
step so that machine noise (other processes, frequency scaling, a warm or cold cache) falls on
both alike. Times are wall-clock seconds from ``time.perf_counter``; on CUDA the device is
synchronized before the clock starts and before it stops, so a step's time includes its kernels.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any, Callable

import torch


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())


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
