"""1-D tensor parallelism: the loss from logits split over the vocabulary, never gathered.

The output projection is column-parallel over the vocabulary: rank ``i`` of ``tp`` holds the logits
``z[:, start_i : start_i + V/tp]``. The loss needs three statistics of each row over the whole vocabulary, each one
all-reduce of ``[N]`` fp32 over the group (``3 * 2 (tp-1)/tp * 4 N`` bytes on the wire per rank): the maximum ``m``,
the target's shifted logit (zero on ranks not holding it) and ``S = sum_j exp(z_j - m)``; then
``loss = log S - (z_t - m)``. Backward is local: ``softmax_j - [j = t]`` on the rank's slice, and the column-parallel
projection's own backward completes ``dh`` across the group. The fused variant
(:func:`~trickles.kernels.cross_entropy.linear_cross_entropy` with a communicator) reduces the same statistics per
chunk without materializing the logits. Soft-capped logits (``model.final_softcap``) are capped on each rank's
slice before the statistics (elementwise: no communication of their own), through autograd's ``tanh`` unfused (which
keeps the capped slice's ``tanh``, ``p N V/tp`` bytes) and inside the chunks fused.

The loss is a custom operator, ``trickles::vocab_parallel_cross_entropy`` (``torch.library.custom_op``, with a fake
implementation and its autograd formula registered), so ``torch.compile`` and AOTAutograd see one opaque node and
never trace into the collectives. Its group is an argument by name, as torch's functional collectives take one
(``ProcessGroup.group_name``): the operator runs its all-reduces through the counted :class:`~trickles.comm.GroupComm`
registered under that name (:mod:`trickles.kernels.groups`; :func:`vocab_parallel_losses` registers the one it is
given when eager, :class:`VocabParallelLoss` when built), so the byte ledger counts them under the communicator's name
as for any collective, and a compiled loss head holds the operator whole (``fullgraph=True``).
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import GroupComm
from ...kernels.cross_entropy import IGNORE_INDEX, OutputLoss, cross_entropy, linear_cross_entropy
from ...kernels.groups import comm_name, named_comm
from ...kernels.softcap import softcap
from .layers import TPContext


def _local_target(target: torch.Tensor, start: int, local_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's target column in this rank's slice (0 where another rank holds it) and whether this rank holds it."""
    inside = (target >= start) & (target < start + local_v)
    return (target - start).masked_fill(~inside, 0), inside


@torch.library.custom_op("trickles::vocab_parallel_cross_entropy", mutates_args=())
def vocab_parallel_ce_op(
    logits: torch.Tensor, target: torch.Tensor, group: str, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits split over the vocabulary; three small all-reduces of ``[N]`` over ``group``.

    ``m = max_j z_j`` (all-reduce max), the target's logit (all-reduce sum, zero on ranks not holding it),
    ``S = sum_j exp(z_j - m)`` (all-reduce sum); ``loss = log S - (z_t - m)``, zero on rows whose target is ignored
    (``-100``). Returns the fp32 losses ``[N]`` and the fp32 softmax of this rank's slice ``[N, V/tp]`` (zero on ignored
    rows), which backward turns into the gradient ``softmax_j - [j = t]``.
    """
    comm = named_comm(group)
    logits = logits.float()
    m = logits.max(dim=-1).values
    comm.all_reduce(m, op="max")
    shifted = logits - m.unsqueeze(-1)
    idx, inside = _local_target(target, start, logits.shape[-1])
    picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    comm.all_reduce(picked)
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    comm.all_reduce(total)
    ignored = target == IGNORE_INDEX
    loss = (total.log() - picked).masked_fill_(ignored, 0.0)
    softmax = exp.div_(total.unsqueeze(-1)).masked_fill_(ignored.unsqueeze(-1), 0.0)
    return loss, softmax


@vocab_parallel_ce_op.register_fake
def _(logits, target, group, start):
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32), logits.new_empty(logits.shape, dtype=torch.float32)


def _setup(ctx, inputs, output):
    """Saves the softmax, each row's local target column and whether this rank holds it (``4 V/tp + 9`` bytes a row)."""
    logits, target, _, start = inputs
    ctx.dtype = logits.dtype
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1], *_local_target(target, start, logits.shape[-1]))


def _backward(ctx, grad, _dsoftmax):
    """``(softmax - onehot(t)) * grad`` on the local slice, in the logits' type: one new ``[N, V/tp]`` fp32 tensor
    beside the saved softmax, which stays as the operator returned it."""
    softmax, idx, inside = ctx.saved_tensors
    g = softmax.scatter_add(-1, idx.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
    return g.mul_(grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


vocab_parallel_ce_op.register_autograd(_backward, setup_context=_setup)


def vocab_parallel_losses(logits: torch.Tensor, target: torch.Tensor, comm: GroupComm, start: int) -> torch.Tensor:
    """Per-row losses (zero on ignored rows) of ``logits [N, V/tp]`` holding vocabulary ``[start, start + V/tp)`` of
    ``comm``'s group, through the operator."""
    return vocab_parallel_ce_op(logits, target, comm_name(comm), start)[0]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: GroupComm, start: int
) -> torch.Tensor:
    """Mean cross-entropy over the tokens not ignored from ``logits [..., V/tp]`` holding vocabulary
    ``[start, start + V/tp)``."""
    if comm.size == 1:
        return cross_entropy(logits, target)
    target = target.flatten().to(logits.device)
    losses = vocab_parallel_losses(logits.flatten(0, -2), target, comm, start)
    return losses.sum() / (target != IGNORE_INDEX).sum(dtype=torch.float32).clamp(min=1.0)


class VocabParallelLoss(OutputLoss):
    """The loss head under tensor parallelism: the output layer holds a vocabulary slice of the weight.

    Unfused: the logit shards, then :func:`vocab_parallel_cross_entropy`. Fused: :func:`~trickles.kernels.
    cross_entropy.linear_cross_entropy` over the slice, with the row statistics reduced over the group per
    chunk. Either way ``h`` is the input the region's entry delivered (all positions), whose backward
    completes ``dh`` across the group.
    """

    def __init__(self, ctx: TPContext, fused: bool | None, chunk: int, kernels: str, cap: float | None = None):
        super().__init__(fused, chunk, kernels, cap)
        self.ctx = ctx
        if getattr(ctx.comm, "group", None) is not None:  # (a planner's stand-in has no group and runs no loss)
            comm_name(ctx.comm)  # named once outside any compiled region, so that a compiled head finds it

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
                self.softcap,
            )
        return vocab_parallel_cross_entropy(softcap(output(h), self.softcap), target, comm, self.ctx.vocab_start)
