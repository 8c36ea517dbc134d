"""Data parallelism, naive form: average every gradient over the data-parallel group.

Each of the ``dp`` ranks runs forward and backward on its own slice of the global batch; after
the last accumulation micro-step every gradient is all-reduced and divided by ``dp``, so all
replicas apply the same update, equal to the single-process update on the whole batch (the
loss being a mean over equally sized slices). One all-reduce per parameter, after backward:
``2 (dp-1)/dp * 4 * P`` bytes sent per rank per step in fp32. This is the oracle that
bucketed, overlapped reduction is checked against.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..comm import GroupComm


def average_gradients(params: Iterable[torch.nn.Parameter], comm: GroupComm) -> None:
    """``p.grad <- mean over the group of p.grad`` for every parameter that has a gradient."""
    if comm.size == 1:
        return
    for p in params:
        if p.grad is not None:
            comm.all_reduce(p.grad, op="mean")
