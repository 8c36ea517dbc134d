"""Flat, bucketed, rank-sharded layout of a set of parameters.

Parameters are laid end to end in one flat 1-D space, in the *reverse* of the order given
(gradients become ready roughly in reverse registration order during backward, so the first
bucket fills first). Consecutive parameters are grouped into buckets of about ``bucket_bytes``
(the first one at most ``first_bucket_bytes``, so that communication starts early in backward,
as in PyTorch DDP);
each bucket is padded to a multiple of ``world * align`` elements so that it splits into
``world`` equal, aligned shards:

    bucket b = [start_b, end_b),   shard_b = (end_b - start_b) / world
    rank r owns [start_b + r * shard_b, start_b + (r + 1) * shard_b) of every bucket.

A parameter lives in exactly one bucket, so a rank's slice of that bucket meets it in at most
one contiguous range: a :class:`Segment`. A rank's *shard buffer* is its slices of all buckets
concatenated in bucket order (``sum_b shard_b`` elements); data-parallel reductions are one
all-reduce or reduce-scatter per bucket, and ZeRO's optimizer works on the segments.

Groups. Parameters may be reduced over different groups of ranks (expert parallelism: the experts over the
``edp`` ranks holding the same experts, every other weight over all replicas). ``group_of(param)`` then
names each parameter's group ``g`` and ``world[g]`` its size: the parameters of group 0 come first (in
the reverse order as above), then those of group 1, and so on; a bucket holds one group's parameters, is
padded to a multiple of ``world[g] * align`` and split into ``world[g]`` shards (:attr:`Bucket.group`);
``segments`` takes the rank's place in each group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Slot:
    """One parameter's place in the flat space."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    numel: int
    offset: int  # flat position of its first element
    bucket: int


@dataclass
class Bucket:
    """A padded run of the flat space reduced in one collective."""

    index: int
    start: int
    end: int  # padded
    slots: list[Slot] = field(default_factory=list)
    world: int = 1
    group: int = 0  # which group of ranks reduces it (see the module docstring: "Groups")

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.size // self.world

    def rank_range(self, rank: int) -> tuple[int, int]:
        s = self.start + rank * self.shard_size
        return s, s + self.shard_size


@dataclass
class Segment:
    """The part of one parameter that one rank owns.

    ``param_range`` is the range of the flattened parameter, ``flat_range`` the same elements in
    the flat space, ``shard_offset`` their position in the rank's shard buffer.
    """

    slot: Slot
    param_range: tuple[int, int]
    flat_range: tuple[int, int]
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.param_range[1] - self.param_range[0]

    @property
    def name(self) -> str:
        return self.slot.name


class FlatLayout:
    """Buckets, padding and per-rank segments for ``named_params`` over ``world`` ranks (one size per group
    with ``group_of``)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        world: int | Sequence[int],
        bucket_bytes: int | None,
        align: int = 16,
        first_bucket_bytes: int | None = None,
        group_of: Callable[[nn.Parameter], int] | None = None,
    ):
        self.worlds = [world] if isinstance(world, int) else list(world)
        self.world = self.worlds[0]
        seen, ordered = set(), []
        for name, p in named_params:
            if id(p) not in seen:
                seen.add(id(p))
                ordered.append((name, p))
        ordered.reverse()
        self.slots: list[Slot] = []
        self.buckets: list[Bucket] = []
        self.group_buckets: list[range] = []  # the bucket indices of each group
        pos = 0
        for g, n in enumerate(self.worlds):
            first = len(self.buckets)
            members = [(name, p) for name, p in ordered if (group_of(p) if group_of else 0) == g]
            pos = self._lay_out(members, n, g, pos, n * align, bucket_bytes, first_bucket_bytes)
            self.group_buckets.append(range(first, len(self.buckets)))
        self.total = pos
        self.numel = sum(s.numel for s in self.slots)
        self.shard_numel = sum(b.shard_size for b in self.buckets)
        self._shard_starts = []
        acc = 0
        for b in self.buckets:
            self._shard_starts.append(acc)
            acc += b.shard_size

    def _lay_out(self, ordered, world: int, group: int, pos: int, unit: int, bucket_bytes, first_bucket_bytes) -> int:
        """Buckets of one group from flat position ``pos``; returns the position after its last bucket."""
        if not ordered and group > 0:
            return pos  # no parameter in this group: no bucket (group 0 keeps one, possibly empty)
        bucket = Bucket(len(self.buckets), pos, pos, world=world, group=group)
        filled, opened = 0, len(self.buckets)
        for name, p in ordered:
            cap = bucket_bytes
            if len(self.buckets) == opened and first_bucket_bytes is not None and cap is not None:
                cap = min(cap, first_bucket_bytes)
            if bucket.slots and cap is not None and filled >= cap:
                bucket.end = bucket.start + _round_up(pos - bucket.start, unit)
                self.buckets.append(bucket)
                pos = bucket.end
                bucket = Bucket(len(self.buckets), pos, pos, world=world, group=group)
                filled = 0
            slot = Slot(name, p, tuple(p.shape), p.numel(), pos, bucket.index)
            bucket.slots.append(slot)
            self.slots.append(slot)
            pos += p.numel()
            filled += p.numel() * p.element_size()
        bucket.end = bucket.start + _round_up(max(pos - bucket.start, 1), unit)
        self.buckets.append(bucket)
        return bucket.end

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """Where ``bucket``'s slice sits in a rank's shard buffer."""
        s = self._shard_starts[bucket.index]
        return s, s + bucket.shard_size

    def segments(self, rank: int | Sequence[int]) -> list[Segment]:
        """The parts of parameters that ``rank`` owns (its rank in each group), in flat order."""
        ranks = [rank] if isinstance(rank, int) else list(rank)
        out = []
        for b in self.buckets:
            lo, hi = b.rank_range(ranks[b.group])
            shard_base = self._shard_starts[b.index]
            for s in b.slots:
                a, e = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < e:
                    out.append(Segment(s, (a - s.offset, e - s.offset), (a, e), shard_base + (a - lo)))
        return out

    def whole_segments(self) -> list[Segment]:
        """Every parameter as one segment (for a replicated optimizer); ``shard_offset`` is its flat offset."""
        return [Segment(s, (0, s.numel), (s.offset, s.offset + s.numel), s.offset) for s in self.slots]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view (in its shape) into a flat tensor of ``total`` elements."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def pack(self, flat: torch.Tensor) -> None:
        """Copies every parameter's current value into its place in ``flat`` (padding zeroed)."""
        flat.zero_()
        with torch.no_grad():
            for s in self.slots:
                flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
