"""ZeRO stages 1 and 2: optimizer state (stage 1) and gradients (stage 2) sharded over dp ranks.

Layout. The parameters become views into one flat buffer laid out by
:class:`~trickles.parallel.flat.FlatLayout`: buckets of ``bucket_bytes``, each padded to a
multiple of ``N = dp`` and split into ``N`` equal shards; rank ``r`` owns shard ``r`` of every
bucket. The rank's :class:`~trickles.optim.sharded.ShardedOptimizer` updates only the segments it
owns, with the owned slices of the flat buffer as fp32 master weights.

One optimizer step, per bucket:

* **stage 1** -- gradients accumulate, full size, in a flat gradient buffer (no communication
  during accumulation micro-steps); on the last micro-step, as soon as all of a bucket's
  parameters have their gradients, the bucket is reduce-scattered (mean) in place, so that
  each rank's owned slice holds the averaged gradient; backward continues meanwhile;
* **stage 2** -- there is no full gradient buffer. A bucket's gradients collect in a bucket-
  sized buffer that exists only while that bucket is being filled and reduced; it is
  reduce-scattered on *every* micro-step into a persistent shard of ``P / N`` elements
  (accumulating across micro-steps) and released as soon as the reduction is done;
* then every rank clips with the global norm (one all-reduce of ``sum g^2`` over owned
  elements), updates its segments, and the buckets are all-gathered so every rank holds the
  new parameters; the gathers run in the background until the next forward reaches the
  layers they hold.

Bytes per rank (fp32 parameters, Adam, ``P`` parameters): parameters ``4P``; gradients ``4P``
(stage 1) or ``4P/N`` plus at most two buckets in flight (stage 2); optimizer ``8P/N``.
Communication per step: reduce-scatter ``(N-1)/N * 4P`` plus all-gather ``(N-1)/N * 4P`` --
the same volume as an all-reduce (stage 2 repeats the reduce-scatter on every micro-step).

With expert parallelism the experts' buckets are sharded over their ``edp`` group (``N_e = R / ep`` ranks)
and every other weight's over all ``R`` replicas, as Megatron's distributed optimizer does
(:class:`~trickles.parallel.flat.FlatLayout`, "Groups"): per rank, optimizer state ``8 (P_d / R + P_e / N_e)``
for ``P_d`` dense and ``P_e`` expert parameters held.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..comm import GroupComm, Handle
from ..optim.adamw import decay_flags
from ..optim.settings import OptimizerSettings
from ..optim.sharded import ShardedOptimizer
from .engine import FIRST_BUCKET_BYTES, Engine, unique_named_parameters, weak_method
from .flat import FlatLayout

MAX_INFLIGHT = 2  # stage 2: bucket buffers alive at once while reductions finish


class ZeroDataParallel(Engine):
    """ZeRO stage 1 or 2 over ``comm`` (see module docstring)."""

    def __init__(self, model: nn.Module, comm: GroupComm, stage: int, optim: OptimizerSettings, bucket_bytes: int | None,
                 offload: bool = False, grad_dtype: torch.dtype = torch.float32, tp: GroupComm | None = None,
                 ep: GroupComm | None = None, edp: GroupComm | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, not {stage}")
        super().__init__(model, comm, tp, ep, edp)
        self.stage = stage
        self.named = unique_named_parameters(model)
        self.params = [p for _, p in self.named]
        p0 = self.params[0]
        self.layout = FlatLayout(self.named, [g.size for g in self.groups], bucket_bytes, first_bucket_bytes=FIRST_BUCKET_BYTES,
                                 group_of=self.group_of)
        # parameters become views of one flat buffer, so the all-gather lands in them directly
        self.param_buffer = torch.empty(self.layout.total, dtype=p0.dtype, device=p0.device)
        self.layout.pack(self.param_buffer)
        for slot, view in zip(self.layout.slots, self.layout.views(self.param_buffer)):
            slot.param.data = view
        self.segments = self.layout.segments(self.group_ranks)
        if stage == 1:
            self.grad_buffer = torch.zeros(self.layout.total, dtype=grad_dtype, device=p0.device)
            self._main = dict(zip((id(s.param) for s in self.layout.slots), self.layout.views(self.grad_buffer)))
            grad_of = lambda s: self.grad_buffer[s.flat_range[0]:s.flat_range[1]]  # noqa: E731
        else:
            self.shard_grads = torch.zeros(self.layout.shard_numel, dtype=grad_dtype, device=p0.device)
            self._buffers: dict[int, torch.Tensor] = {}
            self._inflight: list[tuple[int, torch.Tensor, torch.Tensor, Handle]] = []
            grad_of = lambda s: self.shard_grads[s.shard_offset:s.shard_offset + s.numel]  # noqa: E731
        self.optimizer = ShardedOptimizer(self.segments, lambda s: self.param_buffer[s.flat_range[0]:s.flat_range[1]], grad_of,
                                          decay_flags(model), optim, offload, self.norm_provider(self.named, p0.device))
        self._slot_of = {id(s.param): s for s in self.layout.slots}
        self._param_handles: dict[int, Handle] = {}
        self._install_param_waits(model)
        self._pending: list[int] = []
        self._launched: set[int] = set()
        self._handles: list[Handle] = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_method(self._on_grad))
        self.zero_grad()  # ready for a plain backward()

    # ---- backward ------------------------------------------------------------------------
    def _reset_reduction(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._launched = set()
        self._next = [r.start for r in self.layout.group_buckets]  # each group's buckets go in index order (_launch_ready)

    def _begin_micro_step(self, last: bool) -> None:
        if self.stage == 2:
            self._reset_reduction()

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor:
        if self.stage != 1:
            raise NotImplementedError("ZeRO-2 keeps no whole gradient of a parameter")
        return self._main[id(p)]

    def _on_grad(self, p: torch.Tensor) -> None:
        slot = self._slot_of[id(p)]
        if self.stage == 1:
            self._accumulate(p, self._main[id(p)])
        else:
            buf = self._buffers.get(slot.bucket)
            if buf is None:
                b = self.layout.buckets[slot.bucket]
                buf = self._buffers[slot.bucket] = torch.zeros(b.size, dtype=self.shard_grads.dtype, device=p.device)
            start = slot.offset - self.layout.buckets[slot.bucket].start
            buf[start:start + slot.numel].view(slot.shape).add_(p.grad)
            p.grad = None
        if (self.stage == 2 or self._reduce) and id(p) not in self._deferred:
            self._pending[slot.bucket] -= 1
            self._launch_ready(self.layout.buckets[slot.bucket].group)

    def _launch(self, b: int) -> None:
        self._launched.add(b)
        bucket = self.layout.buckets[b]
        comm = self.groups[bucket.group]
        if self.stage == 1:
            lo, hi = bucket.rank_range(comm.rank)
            self._handles.append(comm.reduce_scatter(self.grad_buffer[bucket.start:bucket.end], op="mean", async_op=True,
                                                          out=self.grad_buffer[lo:hi]))
            return
        self._retire(done_only=True)
        while len(self._inflight) >= MAX_INFLIGHT:
            self._retire_oldest()
        buf = self._buffers.pop(b, None)
        if buf is None:  # no parameter of this bucket got a gradient in this micro-step
            buf = torch.zeros(bucket.size, dtype=self.shard_grads.dtype, device=self.shard_grads.device)
        out = torch.empty(bucket.shard_size, dtype=buf.dtype, device=buf.device)
        self._inflight.append((b, buf, out, comm.reduce_scatter(buf, op="mean", async_op=True, out=out)))

    def _retire_oldest(self) -> None:
        b, buf, out, handle = self._inflight.pop(0)
        handle.wait()
        lo, hi = self.layout.shard_range(self.layout.buckets[b])
        self.shard_grads[lo:hi].add_(out)
        del buf  # the bucket's full-size gradients are gone from here on

    def _retire(self, done_only: bool) -> None:
        while self._inflight and (not done_only or self._inflight[0][3].done()):
            self._retire_oldest()

    def _finish_micro_step(self) -> None:
        for b in range(len(self.layout.buckets)):  # the rest, in order
            if b not in self._launched:
                self._launch(b)
        if self.stage == 1:
            for h in self._handles:
                h.wait()
            self._handles = []
        else:
            self._retire(done_only=False)
        self._reset_reduction()

    def _end_micro_step(self, last: bool) -> None:
        if self.stage == 2 and not last:
            self._finish_micro_step()  # stage 2 reduces (and frees) on every micro-step

    def _finish_reduction(self) -> None:
        self._finish_micro_step()

    # ---- update --------------------------------------------------------------------------
    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(s.slot.param, g) for s, g in zip(self.segments, self.optimizer.grads)]

    def step(self, lr: float) -> None:
        """Updates the owned segments, then starts the all-gathers of the new parameters.

        The gathers run in forward order (the last bucket holds the first layers) and are waited
        for by each module just before its next forward, so they overlap the next step's
        beginning (Megatron's overlapped parameter gather).
        """
        self.wait_for_parameters()
        self.optimizer.step(lr)
        for bucket in reversed(self.layout.buckets):
            comm = self.groups[bucket.group]
            lo, hi = bucket.rank_range(comm.rank)
            self._param_handles[bucket.index] = comm.all_gather(
                self.param_buffer[lo:hi], async_op=True, out=self.param_buffer[bucket.start:bucket.end])

    def wait_for_parameters(self, buckets=None) -> None:
        """Blocks until the updated parameters of ``buckets`` (default: all) have arrived."""
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

    def zero_grad(self) -> None:
        if self.stage == 1:
            self.grad_buffer.zero_()
            self._bind_grads(self._main)
        else:
            for p in self.params:
                p.grad = None
            self.shard_grads.zero_()
        self._reset_reduction()  # a plain backward() after zero_grad() also reduces

    # ---- accounting and checkpoints ------------------------------------------------------
    def memory(self) -> dict[str, int]:
        grads = self.grad_buffer if self.stage == 1 else self.shard_grads
        transient = sum(t.numel() * t.element_size() for t in self._buffers.values()) if self.stage == 2 else 0
        return {"parameters": self.param_buffer.numel() * self.param_buffer.element_size(),
                "gradients": grads.numel() * grads.element_size() + transient,
                "optimizer": self.optimizer.state_bytes()}

    def full_state(self) -> dict[str, torch.Tensor]:
        self.wait_for_parameters()
        return super().full_state()

    def save(self, directory: str, rank: int) -> None:
        self.wait_for_parameters()
        super().save(directory, rank)

    def load(self, directory: str) -> None:
        self.wait_for_parameters()
        super().load(directory)


def _param_wait_hook(engine: ZeroDataParallel, buckets: list[int]):
    ref = weakref.ref(engine)

    @torch.compiler.disable  # a compiled block breaks its graph here, before any of its compute
    def hook(module, args):
        e = ref()
        if e is not None and e._param_handles:
            e.wait_for_parameters(buckets)
    return hook
