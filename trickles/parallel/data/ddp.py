"""Data parallelism (ZeRO stage 0): every rank holds everything, gradients are averaged.

Each of the ``dp`` ranks runs forward and backward on its own slice of the global batch; the
gradients are then averaged so that every replica applies the update one process would make
on the whole batch (the loss being a mean over equally sized slices).

* :func:`average_gradients`, the naive form: one all-reduce per parameter after backward. It is
  the oracle the bucketed form is tested against.
* :class:`DataParallel`, the bucketed, overlapped form. Gradients accumulate into one flat buffer laid out by
  :class:`~trickles.parallel.data.flat.FlatLayout` (reverse parameter order, buckets of ``bucket_bytes``). Each
  parameter's ``.grad`` is its view of that buffer when the dtypes agree, so autograd accumulates micro-batches in
  place (else a post-accumulate-grad hook adds the fresh gradient into its place); on the last accumulation
  micro-step, a bucket whose parameters have all reported is all-reduced (mean) asynchronously while backward goes on
  -- in bucket order (a complete bucket waits for the lower-numbered ones), so every rank issues the same collectives
  in the same order even where their backward graphs differ (mixture-of-experts ranks skip the experts no token
  reached). Earlier micro-steps only accumulate. Per step each rank sends ``2 (dp-1)/dp * 4 * P`` bytes in fp32. With
  expert parallelism the experts' buckets are all-reduced over their ``edp`` group and the rest over all replicas
  (each group's buckets in their own index order; :class:`~trickles.parallel.data.flat.FlatLayout`, "Groups").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...comm import GroupComm, Handle
from ...optim.adamw import decay_flags
from ...optim.settings import OptimizerSettings
from ...optim.sharded import ShardedOptimizer
from ..engine import Engine, trainable_named_parameters, unique_named_parameters, weak_method
from ..reduction import FIRST_BUCKET_BYTES
from .flat import FlatLayout


def average_gradients(params: Iterable[torch.nn.Parameter], comm: GroupComm) -> None:
    """``p.grad <- mean over the group of p.grad`` for every parameter that has a gradient."""
    if comm.size == 1:
        return
    for p in params:
        if p.grad is not None:
            comm.all_reduce(p.grad, op="mean")


class DataParallel(Engine):
    """Replicated parameters and optimizer; bucketed all-reduce of gradients overlapping backward.

    Gradients accumulate in a flat buffer of ``grad_dtype`` (fp32 by default, also for
    low-precision parameters); the optimizer keeps fp32 master weights when the parameters
    are in a lower precision.
    """

    stage = 0

    def __init__(
        self,
        model: nn.Module,
        comm: GroupComm,
        optim: OptimizerSettings,
        bucket_bytes: int | None,
        grad_dtype: torch.dtype = torch.float32,
        tp: GroupComm | None = None,
        ep: GroupComm | None = None,
        edp: GroupComm | None = None,
    ):
        super().__init__(model, comm, tp, ep, edp)
        self.named = trainable_named_parameters(model)
        self.params = [p for _, p in self.named]
        device = self.params[0].device
        self.layout = FlatLayout(
            self.named,
            [g.size for g in self.groups],
            bucket_bytes,
            first_bucket_bytes=FIRST_BUCKET_BYTES,
            group_of=self.group_of,
        )
        self.grad_buffer = torch.zeros(self.layout.total, dtype=grad_dtype, device=device)
        self.main_grads = dict(zip((id(s.param) for s in self.layout.slots), self.layout.views(self.grad_buffer)))
        self._bucket_of = {id(s.param): s.bucket for s in self.layout.slots}
        self._pending: list[int] = []
        self._handles: dict[int, Handle] = {}
        self.optimizer = ShardedOptimizer(
            self.layout.whole_segments(),
            lambda s: s.slot.param.data.view(-1),
            lambda s: self.grad_buffer[s.flat_range[0] : s.flat_range[1]],
            decay_flags(model),
            optim,
            norms=self.norm_provider(self.named, device),
        )
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_method(self._on_grad))
        self.zero_grad()  # ready for a plain backward()

    # ---- backward ------------------------------------------------------------------------
    def _reset_reduction(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._handles = {}
        self._next = [
            r.start for r in self.layout.group_buckets
        ]  # each group's buckets go in index order (see _on_grad)

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.main_grads[id(p)]

    def _on_grad(self, p: torch.Tensor) -> None:
        self._accumulate(p, self.main_grads[id(p)])
        if self._reduce and id(p) not in self._deferred:
            b = self._bucket_of[id(p)]
            self._pending[b] -= 1
            self._launch_ready(self.layout.buckets[b].group)

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        self._handles[b] = self.groups[bucket.group].all_reduce(
            self.grad_buffer[bucket.start : bucket.end], op="mean", async_op=True
        )

    def _finish_reduction(self) -> None:
        for b in range(len(self.layout.buckets)):  # buckets with a parameter that got no gradient
            if b not in self._handles:
                self._launch(b)
        for h in self._handles.values():
            h.wait()
        self._reset_reduction()

    # ---- update --------------------------------------------------------------------------
    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, self.main_grads[id(p)]) for p in self.params]

    def scale_grads(self, factor: float) -> None:
        self.grad_buffer.mul_(factor)

    def step(self, lr: float) -> None:
        self.optimizer.step(lr)

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()
        self._bind_grads(self.main_grads)
        self._reset_reduction()  # a plain backward() after zero_grad() also reduces

    # ---- accounting and checkpoints ------------------------------------------------------
    def memory(self) -> dict[str, int]:
        return {
            "parameters": sum(p.numel() * p.element_size() for _, p in unique_named_parameters(self.model)),
            "gradients": self.grad_buffer.numel() * self.grad_buffer.element_size(),
            "optimizer": self.optimizer.state_bytes(),
        }
