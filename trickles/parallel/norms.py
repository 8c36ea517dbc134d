"""Per-weight norms from the pieces each rank holds: the norm provider the data-parallel engines give
LAMB and LARS (:mod:`trickles.optim.norms`).

A *norm unit* is one whole weight of the single-device model -- or one expert of a stacked expert
weight ``[E, ...]``, as ``E`` separate linears would be. The units are numbered the same way on every
rank: parameters by name, sorted, each taking ``1`` (or ``E``, by global expert index) consecutive
numbers, ``U`` in all. One call of :meth:`ShardNorms.norms` with ``L`` lists of tensors:

1. each rank cuts its tensors into pieces of one unit each (a ZeRO segment cuts a weight anywhere, and
   may hold the end of one expert and the start of the next) and adds every piece's ``sum x^2`` into a
   vector of ``L U`` fp32 zeros at its unit's place -- only the pieces this rank *counts*
   (:meth:`~trickles.parallel.engine.Engine.counts`: what every tensor-parallel rank holds alike counts on
   tp rank 0; without ZeRO what every replica holds alike counts on the first of them);
2. the engine sums the vector over the ranks holding the other pieces
   (:meth:`~trickles.parallel.engine.Engine.sum_parts`): the replicas under ZeRO >= 1 or expert
   parallelism, then the tensor-parallel group;
3. every piece reads its unit's ``sqrt``.

Bytes per call: one all-reduce of ``4 L U`` bytes over the replicas (when they shard) and one over
``tp`` (when ``tp > 1``) -- LAMB and LARS make one call per step with ``L = 2`` (the weights and the
updates, or the gradients). Pipeline stages hold different weights, so no sum runs over them; a weight
tied across stages is whole and equal on both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..optim.norms import pieces
from ..train.pieces import global_shape
from .data.flat import Segment


class ShardNorms:
    """Norm provider over the parameters ``named`` (every parameter the engine holds, on every rank alike).

    ``stacked``: ids of the stacked expert weights (one unit per expert); ``counts(p)``: whether this rank's
    part of ``p`` counts; ``sum_parts(t)``: sums partial sums in place over the ranks holding the other parts;
    ``device``: where the sums are reduced.
    """

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        stacked: set[int],
        counts: Callable[[torch.Tensor], bool],
        sum_parts: Callable[[torch.Tensor], None],
        device: torch.device,
    ):
        self.stacked, self.counts, self.sum_parts, self.device = stacked, counts, sum_parts, device
        self.base: dict[str, int] = {}
        total = 0
        for name, p in sorted(named, key=lambda x: x[0]):
            self.base[name] = total
            total += global_shape(p)[0] if id(p) in stacked else 1
        self.total = total
        self._info: dict[
            int, tuple[list[int], list[int], bool]
        ] = {}  # tensor id -> (piece sizes, unit numbers, counted)
        self._plans: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self, segments: list[Segment], tensors: list[torch.Tensor]) -> None:
        """``tensors[i]`` (1-D) holds the elements ``segments[i].param_range`` of its parameter."""
        for s, t in zip(segments, tensors):
            p = s.slot.param
            base = self.base[s.name]
            if id(p) in self.stacked:
                spec = getattr(p, "tp_spec", None)
                first = spec.offset[0] if spec is not None else 0
                per = s.slot.numel // s.slot.shape[0]  # elements of one expert
                a, b = s.param_range
                cuts = [a, *range((a // per + 1) * per, b, per), b]
                sizes = [hi - lo for lo, hi in zip(cuts, cuts[1:])]
                units = [base + first + lo // per for lo in cuts[:-1]]
            else:
                sizes, units = [t.numel()], [base]
            self._info[id(t)] = (sizes, units, self.counts(p))

    def sizes(self, t: torch.Tensor) -> list[int]:
        return self._info[id(t)][0]

    def _plan(self, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every piece's unit number and whether this rank counts it, for this list of weights (the same list every
        step: computed once)."""
        key = tuple(map(id, weights))
        if key not in self._plans:
            units = [u for w in weights for u in self._info[id(w)][1]]
            counted = [self._info[id(w)][2] for w in weights for _ in self._info[id(w)][1]]
            self._plans[key] = (
                torch.tensor(units, dtype=torch.long, device=self.device),
                torch.tensor(counted, dtype=torch.bool, device=self.device),
            )
        return self._plans[key]

    def norms(self, weights: list[torch.Tensor], *others: list[torch.Tensor]) -> list[torch.Tensor]:
        lists = [weights, *others]
        units, counted = self._plan(weights)
        vec = torch.zeros(len(lists), self.total, dtype=torch.float32, device=self.device)
        if len(units):
            parts = [piece for ts in lists for piece in pieces(ts, weights, self)]
            sq = (torch.stack(torch._foreach_norm(parts)).to(self.device, torch.float32) ** 2).view(len(lists), -1)
            vec.index_add_(1, units, torch.where(counted, sq, torch.zeros_like(sq)))
        self.sum_parts(vec)
        dev = weights[0].device if weights else self.device
        return list(vec.sqrt()[:, units].to(dev).unbind())
