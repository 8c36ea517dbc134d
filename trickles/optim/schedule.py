"""Learning-rate schedule: linear warm-up, then cosine or polynomial decay to ``min_lr_ratio * lr``.

    lr(s) = lr * (s + 1) / warmup                                   for s < warmup
    lr(s) = lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)              cosine
    lr(s) = lr * (r + (1 - r) * (1 - p) ** power)                   poly (LARS's: power 2, You et al. 2017)
    p = (s - warmup) / (steps - warmup)

with ``s`` the 0-based index of the optimizer step about to run and ``r = min_lr_ratio``.
"""

from __future__ import annotations

import math


def lr_at(
    step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float, kind: str = "cosine", power: float = 2.0
) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    p = min(1.0, (step - warmup) / span)
    shape = (1.0 - p) ** power if kind == "poly" else 0.5 * (1.0 + math.cos(math.pi * p))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)


def schedule_kind(t) -> str:
    """The decay ``train.schedule`` picks: ``auto`` is poly for LARS, cosine otherwise."""
    return t.schedule if t.schedule != "auto" else ("poly" if t.optimizer == "lars" else "cosine")
