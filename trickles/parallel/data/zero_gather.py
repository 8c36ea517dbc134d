"""ZeRO stages 1 and 2 after the update: the new parameters all-gathered, overlapping the next forward.

Each rank updates only its shard of every bucket (:class:`~trickles.parallel.data.flat.FlatLayout`: bucket ``b`` of
``S_b`` elements, padded to a multiple of ``N`` ranks, shard ``r`` of ``S_b / N`` on rank ``r``). The parameters
are views of one flat buffer, so bucket ``b``'s all-gather of the shards (``(N-1) S_b / N`` elements sent per rank;
with expert parallelism over the bucket's own group, :attr:`~trickles.parallel.engine.Engine.groups`) writes the new
values straight into every rank's parameters.

The gathers are issued in forward order (the last bucket holds the first layers) and run in the background: each
top-level piece of the model (a block, the embeddings, the head; the model itself for the rest) has a pre-forward
hook that waits only for the buckets holding its parameters, so the gathers overlap the next step's beginning
(Megatron's overlapped parameter gather). Whatever reads the parameters otherwise (:meth:`full_state`,
checkpoints) waits for all of them first. With the overlapped offload (:mod:`trickles.optim.offload`) a bucket's
gather also waits for its update on the host: they are issued from the main thread, in the same order on every
rank, as far as the next forward needs and as far as the host has finished.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ...comm import Handle
from ..engine import Engine
from .flat import FlatLayout, Slot


class GatheringEngine(Engine):
    """An engine whose parameters are views of :attr:`param_buffer`, all-gathered bucket by bucket after each update
    (module docstring): the part of ZeRO stages 1 and 2 (:class:`~trickles.parallel.data.zero.ZeroDataParallel`)
    that runs after the optimizer.

    The subclass sets the attributes below, calls :meth:`_install_param_waits` once its parameters are views, and
    provides ``_record(name, bucket)`` (the overlapped offload's event trace).
    """

    layout: FlatLayout
    param_buffer: torch.Tensor  # the flat parameters, every bucket whole
    _slot_of: dict[int, Slot]  # id(parameter) -> its place in the layout
    _unit_of: dict[int, int]  # bucket -> the overlapped offload's unit
    _param_handles: dict[int, Handle]  # bucket -> its all-gather in flight
    _gathers_due: list[int]  # overlapped offload: buckets whose all-gather waits for their host update

    def step(self, lr: float) -> None:
        """Updates the owned segments, then starts the all-gathers of the new parameters.

        The gathers run in forward order (the last bucket holds the first layers) and are waited
        for by each module just before its next forward, so they overlap the next step's
        beginning (Megatron's overlapped parameter gather).
        """
        self.wait_for_parameters()
        self.optimizer.step(lr)
        forward_order = [bucket.index for bucket in reversed(self.layout.buckets)]
        if self.optimizer.overlapped is not None:  # each gather waits for its bucket's host update (_issue_gathers)
            self._gathers_due = forward_order
            self._record("step_returned")
            return
        for b in forward_order:
            self._gather(b)

    def _gather(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        comm = self.groups[bucket.group]
        lo, hi = bucket.rank_range(comm.rank)
        self._param_handles[b] = comm.all_gather(
            self.param_buffer[lo:hi], async_op=True, out=self.param_buffer[bucket.start : bucket.end]
        )

    def _issue_gathers(self, needed) -> None:
        """Overlapped offload: issues the due all-gathers in forward order up to the last of ``needed`` (None: all),
        each once its bucket is back from the host, then the following ones already back. Every rank issues them in
        the same order, from this (the main) thread."""
        due = self._gathers_due
        last = max((due.index(b) for b in needed if b in due), default=-1) if needed is not None else len(due) - 1
        k = 0
        while k < len(due) and (k <= last or not self.optimizer.overlapped.pending(self._unit_of[due[k]])):
            self.optimizer.wait_unit(self._unit_of[due[k]])
            self._record("gather", due[k])
            self._gather(due[k])
            k += 1
        del due[:k]

    def wait_for_parameters(self, buckets=None) -> None:
        """Blocks until the updated parameters of ``buckets`` (default: all) have arrived."""
        if self._gathers_due:
            self._issue_gathers(buckets)
        for b in list(self._param_handles) if buckets is None else buckets:
            h = self._param_handles.pop(b, None)
            if h is not None:
                h.wait()

    def _install_param_waits(self, model: nn.Module) -> None:
        """A pre-forward hook on each top-level piece of the model (blocks, embeddings, head)."""
        targets = []
        for child in model.children():
            if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                targets.extend(child.children())
            else:
                targets.append(child)
        covered = set()
        for m in targets:
            buckets = sorted({self._slot_of[id(p)].bucket for p in m.parameters() if id(p) in self._slot_of})
            covered.update(id(p) for p in m.parameters())
            if buckets:
                m.register_forward_pre_hook(_param_wait_hook(self, buckets))
        rest = sorted({s.bucket for s in self.layout.slots if id(s.param) not in covered})
        if rest:
            model.register_forward_pre_hook(_param_wait_hook(self, rest))

    def full_state(self) -> dict[str, torch.Tensor]:
        self.wait_for_parameters()
        return super().full_state()

    def checkpoint_files(self, rank: int) -> dict[str, dict]:
        self.wait_for_parameters()
        return super().checkpoint_files(rank)

    def load(self, directory: str) -> None:
        self.wait_for_parameters()
        super().load(directory)


def _param_wait_hook(engine: GatheringEngine, buckets: list[int]):
    ref = weakref.ref(engine)

    @torch.compiler.disable  # a compiled block breaks its graph here, before any of its compute
    def hook(module, args):
        e = ref()
        if e is not None and (e._param_handles or e._gathers_due):
            e.wait_for_parameters(buckets)

    return hook
