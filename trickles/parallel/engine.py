"""The contract between the trainer and a data-parallel strategy.

An :class:`Engine` owns how gradients are reduced over the data-parallel group, how the
optimizer updates the parameters, and how both are checkpointed. The trainer drives one
optimizer step as::

    engine.zero_grad()
    for i, batch in enumerate(micro_batches):
        with engine.micro_step(last=i == len(micro_batches) - 1):
            (loss(batch) / len(micro_batches)).backward()
    engine.finish_backward()          # wait for the reductions still in flight
    norm = engine.clip_grad_norm(max_norm)
    engine.step(lr)

Implementations: :class:`~trickles.parallel.data.DataParallel` (ZeRO stage 0),
:class:`~trickles.parallel.zero.ZeroDataParallel` (stages 1 and 2) and
:class:`~trickles.parallel.zero3.Zero3DataParallel` (stage 3).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch import nn

from ..comm import GroupComm


class Engine:
    """Base class: data-parallel gradient reduction, optimizer step and checkpoint I/O."""

    stage: int = 0

    def __init__(self, model: nn.Module, comm: GroupComm):
        self.model = model
        self.comm = comm
        self._reduce = True

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        """Backward inside this block belongs to one micro-batch; ``last`` marks the step's final one."""
        self._reduce = last
        self._begin_micro_step(last)
        yield
        self._end_micro_step(last)
        self._reduce = True

    def _begin_micro_step(self, last: bool) -> None:
        pass

    def _end_micro_step(self, last: bool) -> None:
        pass

    def finish_backward(self) -> None:
        raise NotImplementedError

    def owned_grads(self) -> list[torch.Tensor]:
        """The reduced gradients this rank updates from (the whole buffer, or its shards)."""
        raise NotImplementedError

    def scale_grads(self, factor: float) -> None:
        """Multiplies the reduced gradients by ``factor`` (unscaling a loss-scaled backward)."""
        grads = self.owned_grads()
        if grads:
            torch._foreach_mul_(grads, factor)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clips the reduced gradients to ``max_norm`` by global norm; returns the norm (fp32, all ranks agree)."""
        raise NotImplementedError

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer whole, by name (a collective under ZeRO-3)."""
        from ..train.checkpoint import unique_state

        return {k: v.detach() for k, v in unique_state(self.model).items()}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: ``{"parameters", "gradients", "optimizer"}``."""
        raise NotImplementedError

    def save(self, directory: str, rank: int) -> None:
        """Writes this rank's part of the model and optimizer state into ``directory``."""
        raise NotImplementedError

    def load(self, directory: str) -> None:
        """Restores model and optimizer state from a checkpoint directory (any data-parallel layout)."""
        raise NotImplementedError


def sharded_clip(grads: list[torch.Tensor], max_norm: float, comm: GroupComm | None) -> torch.Tensor:
    """Global-norm clipping of gradients split disjointly over ``comm``: one all-reduce of ``sum g^2``.

    ``norm = sqrt(sum over ranks of sum over owned elements g^2)``, accumulated in fp32 (``comm``
    None: the gradients are replicated and every rank has them all); every gradient is scaled by
    ``min(1, max_norm / (norm + 1e-6))`` (torch's ``clip_grad_norm_`` rule). ``max_norm <= 0``
    only measures. An inf or NaN anywhere makes the norm non-finite on every rank.
    """
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]).sum()
    else:
        sq = torch.zeros((), device=device)
    if comm is not None and comm.size > 1:
        sq = comm.all_reduce(sq.reshape(1)).reshape(())
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm


def weak_method(method):
    """A callable that forwards to a bound ``method`` without keeping its object alive.

    Hooks live on tensors inside autograd (C++), where Python's garbage collector cannot see
    the cycle ``parameter -> hook -> engine -> parameter``; a strong reference would leak the
    engine and everything it holds.
    """
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        m = ref()
        return m(*args, **kwargs) if m is not None else None
    return call


def unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


FIRST_BUCKET_BYTES = 1 << 20  # PyTorch DDP's first bucket: the output layer's gradients leave early


def bucket_bytes(mb: float) -> int | None:
    return None if mb <= 0 or math.isinf(mb) else int(mb * 2**20)
