"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

    lr(s) = lr * (s + 1) / warmup                                   for s < warmup
    lr(s) = lr * (r + (1 - r) * (1 + cos(pi * p)) / 2),  p = (s - warmup) / (steps - warmup)

with ``s`` the 0-based index of the optimizer step about to run and ``r = min_lr_ratio``.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    p = min(1.0, (step - warmup) / span)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))
