"""1-D tensor parallelism: the loss from logits split over the vocabulary, never gathered.

The output projection is column-parallel over the vocabulary: rank ``i`` of ``tp`` holds the logits
``z[:, start_i : start_i + V/tp]``. The loss needs three statistics of each row over the whole vocabulary, each one
all-reduce of ``[N]`` fp32 over the group (``3 * 2 (tp-1)/tp * 4 N`` bytes on the wire per rank): the maximum ``m``,
the target's shifted logit (zero on ranks not holding it) and ``S = sum_j exp(z_j - m)``; then
``loss = log S - (z_t - m)``. Backward is local: ``softmax_j - [j = t]`` on the rank's slice, and the column-parallel
projection's own backward completes ``dh`` across the group. The fused variant
(:func:`~trickles.kernels.cross_entropy.linear_cross_entropy` with a communicator) reduces the same statistics per
chunk without materializing the logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import GroupComm
from ...kernels.cross_entropy import IGNORE_INDEX, OutputLoss, cross_entropy, linear_cross_entropy
from .layers import TPContext


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy of logits split over the vocabulary; three small all-reduces of ``[N]``.

    ``m = max_j z_j`` (all-reduce max), ``S = sum_j exp(z_j - m)`` (all-reduce sum), the target's
    logit (all-reduce sum, zero on ranks not holding it); ``loss = log S - (z_t - m)``, zero on rows
    whose target is ignored (``-100``). Backward: ``softmax_j - [j = t]`` on the local vocabulary slice
    (zero on ignored rows: their saved probabilities are zeroed in forward).
    """

    @staticmethod
    def forward(ctx, logits, target, comm, start):
        logits = logits.float()
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op="max")
        shifted = logits - m.unsqueeze(-1)
        local_v = logits.shape[-1]
        inside = (target >= start) & (target < start + local_v)
        idx = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        comm.all_reduce(picked)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total)
        ignored = target == IGNORE_INDEX
        loss = (total.log() - picked).masked_fill_(ignored, 0.0)
        softmax = exp.div_(total.unsqueeze(-1)).masked_fill_(ignored.unsqueeze(-1), 0.0)
        ctx.save_for_backward(softmax, idx, inside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, inside = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: GroupComm, start: int
) -> torch.Tensor:
    """Mean cross-entropy over the tokens not ignored from ``logits [..., V/tp]`` holding vocabulary ``[start, start + V/tp)``."""
    if comm.size == 1:
        return cross_entropy(logits, target)
    target = target.flatten().to(logits.device)
    losses = _VocabParallelCE.apply(logits.flatten(0, -2), target, comm, start)
    return losses.sum() / (target != IGNORE_INDEX).sum(dtype=torch.float32).clamp(min=1.0)


class VocabParallelLoss(OutputLoss):
    """The loss head under tensor parallelism: the output layer holds a vocabulary slice of the weight.

    Unfused: the logit shards, then :func:`vocab_parallel_cross_entropy`. Fused: :func:`~trickles.kernels.
    cross_entropy.linear_cross_entropy` over the slice, with the row statistics reduced over the group per
    chunk. Either way ``h`` is the input the region's entry delivered (all positions), whose backward
    completes ``dh`` across the group.
    """

    def __init__(self, ctx: TPContext, fused: bool | None, chunk: int, kernels: str):
        super().__init__(fused, chunk, kernels)
        self.ctx = ctx

    def forward(self, h: torch.Tensor, output: nn.Module, target: torch.Tensor) -> torch.Tensor:
        comm = self.ctx.comm
        if self.is_fused(h):
            return linear_cross_entropy(
                h,
                output.weight,
                target,
                output.bias,
                self.chunk,
                self.kernels,
                comm if comm.size > 1 else None,
                self.ctx.vocab_start,
            )
        return vocab_parallel_cross_entropy(output(h), target, comm, self.ctx.vocab_start)
