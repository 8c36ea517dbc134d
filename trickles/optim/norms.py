"""Per-tensor norms for the layer-wise optimizers (:mod:`~trickles.optim.lamb`, :mod:`~trickles.optim.lars`).

A trust ratio ``||w|| / ||update||`` is taken over a whole weight -- one *norm unit* -- while the
optimizer may hold only a piece of it (a ZeRO shard that cuts the tensor anywhere, a
tensor-parallel block). The optimizer therefore asks a *norm provider* for the norms instead of
computing them:

* ``sizes(w)``: how the optimizer's weight tensor ``w`` splits into pieces of one norm unit each
  (``w.split(sizes(w))``); usually one piece, several where ``w`` holds parts of several units (a
  stacked expert weight ``[E, out, in]`` is ``E`` units, one per expert, as ``E`` separate linears
  would be);
* ``norms(weights, *others)``: for the list of weights and each list of tensors shaped like them
  (the updates, the gradients), a 1-D tensor with the norm of the *whole unit* of every piece, pieces
  in the order ``w.split(sizes(w))`` for ``w`` in the weights. All lists are reduced together (one
  collective for all of them).

:class:`LocalNorms` is the provider of a plain, single-process optimizer: every tensor is one unit
and holds all of it. The data-parallel engines provide :class:`~trickles.parallel.norms.ShardNorms`,
which sums partial squares over exactly the ranks holding each unit's pieces.
"""

from __future__ import annotations

from typing import Protocol

import torch


class NormProvider(Protocol):
    def sizes(self, w: torch.Tensor) -> list[int]: ...

    def norms(self, weights: list[torch.Tensor], *others: list[torch.Tensor]) -> list[torch.Tensor]: ...


class LocalNorms:
    """Every tensor is a whole norm unit, held here: its own norm."""

    def sizes(self, w: torch.Tensor) -> list[int]:
        return [w.numel()]

    def norms(self, weights: list[torch.Tensor], *others: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.stack(torch._foreach_norm(ts)) if ts else torch.zeros(0) for ts in (weights, *others)]


class LayerwiseOptimizer(torch.optim.Optimizer):
    """What LAMB and LARS share: groups adapted by default (``adapt``), a norm provider (:class:`LocalNorms` when none
    is given), and each group's parameters that have a gradient."""

    def __init__(self, params, defaults: dict, norms: NormProvider | None):
        super().__init__(params, {**defaults, "adapt": True})
        self.provider = norms or LocalNorms()

    def _with_grads(self):
        """``(group, params with a gradient)`` for every group that has any."""
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if ps:
                yield group, ps


def pieces(tensors: list[torch.Tensor], weights: list[torch.Tensor], provider: NormProvider) -> list[torch.Tensor]:
    """Every tensor's pieces of one norm unit each (views), cut as the provider cuts the weight of the same place."""
    return [piece for t, w in zip(tensors, weights) for piece in t.reshape(-1).split(provider.sizes(w))]


def trust_ratio(num: torch.Tensor, den: torch.Tensor, clip: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``num / den``, at most ``clip`` when ``clip > 0``, where both are positive (and ``valid``); else 1 (a weight
    or an update at zero: no ratio to take, the plain step; the clip bounds ratios, not this)."""
    ok = (num > 0) & (den > 0) if valid is None else valid
    ratio = num / den.clamp_min(torch.finfo(den.dtype).tiny)
    if clip > 0:
        ratio = ratio.clamp(max=clip)
    return torch.where(ok, ratio, torch.ones_like(num))


def group_norms(
    provider: NormProvider, groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each ``(weights, others)`` pair of tensor lists: the unit norms of the weights' pieces and of the
    others' (same shapes, e.g. the updates), computed in one call of the provider -- which every rank makes
    once per step, with empty lists where it holds nothing, as the reduction behind it is a collective."""
    ws = [t for a, _ in groups for t in a]
    xs = [t for _, b in groups for t in b]
    wn, xn = provider.norms(ws, xs)
    out, pos = [], 0
    for a, _ in groups:
        k = sum(len(provider.sizes(t)) for t in a)
        out.append((wn[pos : pos + k], xn[pos : pos + k]))
        pos += k
    return out
