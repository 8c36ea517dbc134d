"""ZeRO stages 1 and 2: optimizer state (stage 1) and gradients (stage 2) sharded over dp ranks.

Layout. The parameters become views into one flat buffer laid out by
:class:`~trickles.parallel.data.flat.FlatLayout`: buckets of ``bucket_bytes``, each padded to a
multiple of ``N = dp`` and split into ``N`` equal shards; rank ``r`` owns shard ``r`` of every
bucket. The rank's :class:`~trickles.optim.sharded.ShardedOptimizer` updates only the segments it
owns, with the owned slices of the flat buffer as fp32 master weights.

One optimizer step, per bucket:

* **stage 1** with gradient accumulation (several micro-batches per step, or pipeline stages) --
  gradients accumulate, full size, in a flat gradient buffer (no communication during
  accumulation micro-steps); on the last micro-step, as soon as all of a bucket's parameters
  have their gradients, the bucket is reduce-scattered (mean) in place, so that each rank's
  owned slice holds the averaged gradient; backward continues meanwhile. **Without
  accumulation** stage 1 has nothing to accumulate, so it reduces as stage 2 does (below): the
  same one reduce-scatter per bucket, and only the shard held (as DeepSpeed's stage 1);
* **stage 2** -- there is no full gradient buffer. A bucket's gradients collect in a bucket-
  sized buffer that is in use only while that bucket is being filled and reduced; it is
  reduce-scattered on *every* micro-step into a persistent shard of ``P / N`` elements
  (accumulating across micro-steps) and handed to the next bucket as soon as the reduction is
  done (a backward allocates only as many as are filled or in flight at once, and releases them
  when it ends);
* **stage 2 under pipeline stages** (``pipelined``) -- a stage runs the backwards of all ``m`` micro-batches of
  the step interleaved with forwards, and reducing on every one would send ``m`` times stage 2's bytes. It
  reduces once per step instead, as stage 1 does: the gradients accumulate, full size, in a flat buffer that
  exists only during the step -- allocated by :meth:`zero_grad`, reduce-scattered bucket by bucket on each
  chunk's last backward (mean) straight into the persistent shard, and freed once every reduction is done. Its
  peak is stage 1's (the buffer lives through the step's backwards); between steps, and in the optimizer step,
  it holds the shard only;
* then every rank clips with the global norm (one all-reduce of ``sum g^2`` over owned
  elements), updates its segments, and the buckets are all-gathered so every rank holds the
  new parameters; the gathers run in the background until the next forward reaches the
  layers they hold (:mod:`~trickles.parallel.data.zero_gather`).

Bytes per rank (fp32 parameters, Adam, ``P`` parameters): parameters ``4P``; gradients ``4P``
(stage 1 accumulating) or ``4P/N`` plus at most two buckets in flight (stage 2, and stage 1 without
accumulation), or ``4P/N`` held and ``4P`` more during the step (stage 2 pipelined); optimizer ``8P/N``.
Communication per step: reduce-scatter ``(N-1)/N * 4P`` plus all-gather ``(N-1)/N * 4P`` --
the same volume as an all-reduce (stage 2 repeats the reduce-scatter on every micro-step).

With expert parallelism the experts' buckets are sharded over their ``edp`` group (``N_e = R / ep`` ranks)
and every other weight's over all ``R`` replicas, as Megatron's distributed optimizer does
(:class:`~trickles.parallel.data.flat.FlatLayout`, "Groups"): per rank, optimizer state ``8 (P_d / R + P_e / N_e)``
for ``P_d`` dense and ``P_e`` expert parameters held.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import GroupComm, Handle
from ...optim.adamw import decay_flags
from ...optim.settings import OptimizerSettings
from ...optim.sharded import ShardedOptimizer
from ..engine import _spec, trainable_named_parameters, unique_named_parameters, weak_method
from ..reduction import FIRST_BUCKET_BYTES
from .flat import FlatLayout
from .zero_gather import GatheringEngine

MAX_INFLIGHT = 2  # stage 2: bucket buffers alive at once while reductions finish


class ZeroDataParallel(GatheringEngine):
    """ZeRO stage 1 or 2 over ``comm`` (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        comm: GroupComm,
        stage: int,
        optim: OptimizerSettings,
        bucket_bytes: int | None,
        offload: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        tp: GroupComm | None = None,
        ep: GroupComm | None = None,
        edp: GroupComm | None = None,
        overlap: bool = True,
        accumulates: bool = True,
        pipelined: bool = False,
    ):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, not {stage}")
        super().__init__(model, comm, tp, ep, edp)
        self.stage = stage
        # stage 1 keeps a full gradient buffer only when it accumulates micro-batches: otherwise each bucket is
        # reduce-scattered into the rank's shard as stage 2 does (DeepSpeed's stage 1 frees what it does not own too);
        # stage 2 under pipeline stages has one during the step only (transient), reduced once into the shard
        self.transient = stage == 2 and pipelined
        self.full_grads = (stage == 1 and accumulates) or self.transient
        self.named = trainable_named_parameters(model)
        self.params = [p for _, p in self.named]
        p0 = self.params[0]
        self.layout = FlatLayout(
            self.named,
            [g.size for g in self.groups],
            bucket_bytes,
            first_bucket_bytes=FIRST_BUCKET_BYTES,
            group_of=self.group_of,
        )
        # parameters become views of one flat buffer, so the all-gather lands in them directly
        self.param_buffer = torch.empty(self.layout.total, dtype=p0.dtype, device=p0.device)
        self.layout.pack(self.param_buffer)
        for slot, view in zip(self.layout.slots, self.layout.views(self.param_buffer)):
            slot.param.data = view
        self.segments = self.layout.segments(self.group_ranks)
        if self.full_grads:
            self.grad_buffer = torch.zeros(self.layout.total, dtype=grad_dtype, device=p0.device)
            self._grad_bytes = self.grad_buffer.untyped_storage().nbytes()
            self._main = dict(zip((id(s.param) for s in self.layout.slots), self.layout.views(self.grad_buffer)))
        if self.full_grads and not self.transient:  # the optimizer reads the reduced slices in place

            def grad_of(s):
                return self.grad_buffer[s.flat_range[0] : s.flat_range[1]]

        else:
            self.shard_grads = torch.zeros(self.layout.shard_numel, dtype=grad_dtype, device=p0.device)

            def grad_of(s):
                return self.shard_grads[s.shard_offset : s.shard_offset + s.numel]

        if not self.full_grads:
            self._buffers: dict[int, torch.Tensor] = {}
            self._inflight: list[tuple[int, torch.Tensor, torch.Tensor, Handle]] = []
            self._largest = {
                "bucket": max(b.size for b in self.layout.buckets),
                "shard": max(b.shard_size for b in self.layout.buckets),
            }
            self._free: dict[str, list[torch.Tensor]] = {"bucket": [], "shard": []}
            self.buffers_allocated = 0  # bucket-sized buffers allocated since construction (reused within a backward)
        # the overlapped offload's units: the buckets in the order the next forward needs them (the last holds the
        # first layers)
        order = list(reversed(range(len(self.layout.buckets))))
        self._unit_of = {b: u for u, b in enumerate(order)}
        units = (
            [[i for i, s in enumerate(self.segments) if s.slot.bucket == b] for b in order]
            if offload and overlap
            else None
        )
        self.optimizer = ShardedOptimizer(
            self.segments,
            lambda s: self.param_buffer[s.flat_range[0] : s.flat_range[1]],
            grad_of,
            decay_flags(model),
            optim,
            offload,
            self.norm_provider(self.named, p0.device),
            units,
        )
        self._gathers_due: list[int] = []  # overlapped offload: buckets whose all-gather waits for their host update
        self.trace: list | None = None  # a list to record the overlapped offload's events into (tests)
        self._slot_of = {id(s.param): s for s in self.layout.slots}
        self._param_handles: dict[int, Handle] = {}
        self._install_param_waits(model)
        self._pending: list[int] = []
        self._launched: set[int] = set()
        self._handles: list[tuple[int, Handle]] = []  # stage 1: (bucket, its reduce-scatter)
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_method(self._on_grad))
        self.zero_grad()  # ready for a plain backward()

    # ---- backward ------------------------------------------------------------------------
    def _reset_reduction(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._launched = set()
        self._next = [
            r.start for r in self.layout.group_buckets
        ]  # each group's buckets go in index order (_launch_ready)

    def _begin_micro_step(self, last: bool) -> None:
        if not self.full_grads:
            self._reset_reduction()

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor:
        if not self.full_grads:
            raise NotImplementedError("ZeRO-2 (and ZeRO-1 without accumulation) keeps no whole gradient of a parameter")
        return self._main[id(p)]

    def _on_grad(self, p: torch.Tensor) -> None:
        slot = self._slot_of[id(p)]
        if self.full_grads:
            self._accumulate(p, self._main[id(p)])
        else:
            buf = self._buffers.get(slot.bucket)
            if buf is None:
                buf = self._buffers[slot.bucket] = self._take("bucket", self.layout.buckets[slot.bucket].size).zero_()
            start = slot.offset - self.layout.buckets[slot.bucket].start
            buf[start : start + slot.numel].view(slot.shape).add_(p.grad)
            p.grad = None
        if (not self.full_grads or self._reduce) and id(p) not in self._deferred:
            self._pending[slot.bucket] -= 1
            self._launch_ready(self.layout.buckets[slot.bucket].group)

    def _launch(self, b: int) -> None:
        self._launched.add(b)
        bucket = self.layout.buckets[b]
        comm = self.groups[bucket.group]
        if self.full_grads:
            if self.transient:  # straight into the shard, which accumulates nothing else
                lo, hi = self.layout.shard_range(bucket)
                out = self.shard_grads[lo:hi]
            else:
                lo, hi = bucket.rank_range(comm.rank)
                out = self.grad_buffer[lo:hi]
            self._handles.append(
                (b, comm.reduce_scatter(self.grad_buffer[bucket.start : bucket.end], op="mean", async_op=True, out=out))
            )
            self._copy_reduced()
            return
        self._retire(done_only=True)
        while len(self._inflight) >= MAX_INFLIGHT:
            self._retire_oldest()
        buf = self._buffers.pop(b, None)
        if buf is None:  # no parameter of this bucket got a gradient in this micro-step
            buf = self._take("bucket", bucket.size).zero_()
        out = self._take("shard", bucket.shard_size)
        self._inflight.append((b, buf, out, comm.reduce_scatter(buf, op="mean", async_op=True, out=out)))

    def _take(self, kind: str, numel: int) -> torch.Tensor:
        """A ``numel``-element view of a free buffer of the largest bucket's size (or shard's), allocated only when
        none is free: a backward cycles through as many as are filled or in flight at once, whatever the number of
        buckets, and :meth:`_finish_micro_step` releases them, so none is held between steps."""
        free = self._free[kind]
        if free:
            base = free.pop()
        else:
            base = torch.empty(self._largest[kind], dtype=self.shard_grads.dtype, device=self.shard_grads.device)
            self.buffers_allocated += kind == "bucket"
        return base[:numel]

    def _give_back(self, kind: str, view: torch.Tensor) -> None:
        self._free[kind].append(view._base if view._base is not None else view)

    def _retire_oldest(self) -> None:
        b, buf, out, handle = self._inflight.pop(0)
        handle.wait()
        lo, hi = self.layout.shard_range(self.layout.buckets[b])
        self.shard_grads[lo:hi].add_(out)
        self._give_back("bucket", buf)  # free for the next bucket to fill
        self._give_back("shard", out)
        if self._reduce and self._early_copies:  # the step's last micro-batch: this bucket's gradients are final
            self._to_host(b)

    def _retire(self, done_only: bool) -> None:
        while self._inflight and (not done_only or self._inflight[0][3].done()):
            self._retire_oldest()

    def _finish_micro_step(self) -> None:
        for b in range(len(self.layout.buckets)):  # the rest, in order
            if b not in self._launched:
                self._launch(b)
        if self.full_grads:
            for _, h in self._handles:
                h.wait()
            self._copy_reduced()
            self._handles = []
            if self.transient:  # every bucket is in the shard: the full buffer goes until the next step
                for p in self.params:
                    p.grad = None
                self.grad_buffer.untyped_storage().resize_(0)
        else:
            self._retire(done_only=False)
            self._free = {"bucket": [], "shard": []}  # nothing bucket-sized is held between micro-steps
        self._reset_reduction()

    # ---- the overlapped offload (trickles.optim.offload) ------------------------------------------
    @property
    def _early_copies(self) -> bool:
        """Whether a bucket's gradients are final when its reduction completes (nothing is added to them after: no
        tensor-parallel partial gradients, experts or weights tied across pipeline stages), so they can leave for the
        host during backward."""
        if self.optimizer.overlapped is None or self._deferred or self.ep is not None:
            return False
        return self.tp is None or self.tp.size == 1 or not any(_partial(p) for p in self.params)

    def _to_host(self, b: int) -> None:
        self._record("reduced", b)
        self.optimizer.grads_final(self._unit_of[b])

    def _copy_reduced(self) -> None:
        """Stage 1 (which reduces on the last micro-batch only): starts the host copy of every bucket whose
        reduce-scatter has completed, waiting for the oldest while more than ``MAX_INFLIGHT`` are in flight (as stage 2
        does), so the copies start during backward however fast it runs."""
        if not self._early_copies:
            return
        while self._handles and (len(self._handles) > MAX_INFLIGHT or self._handles[0][1].done()):
            b, handle = self._handles.pop(0)
            handle.wait()  # (on CUDA this orders the copy after it)
            self._to_host(b)

    def finish_backward(self) -> None:
        super().finish_backward()
        if self.optimizer.overlapped is not None:  # what has not left yet leaves now, before any scaling
            self._record("backward_end")
            for b in self._unit_of:
                self.optimizer.grads_final(self._unit_of[b])

    def _scaled(self, factor: torch.Tensor) -> None:
        self.optimizer.scale(factor)

    def _record(self, name: str, unit: int | None = None) -> None:
        if self.trace is not None:
            self.trace.append((name, unit))

    def set_trace(self, events: list | None) -> None:
        """Records the overlapped offload's events (the engine's and the host step's) into ``events``."""
        self.trace = events
        if self.optimizer.overlapped is not None:
            self.optimizer.overlapped.trace = events

    def _end_micro_step(self, last: bool) -> None:
        if last:
            self._record("backward_done")  # autograd's backward of the step's last micro-batch has returned
        if not self.full_grads and not last:
            self._finish_micro_step()  # stage 2 reduces (and frees) on every micro-step

    def _finish_reduction(self) -> None:
        self._finish_micro_step()

    # ---- update --------------------------------------------------------------------------
    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(s.slot.param, g) for s, g in zip(self.segments, self.optimizer.grads)]

    def zero_grad(self) -> None:
        if self.transient:
            self.grad_buffer.untyped_storage().resize_(self._grad_bytes)
            self.shard_grads.zero_()
        if self.full_grads:
            self.grad_buffer.zero_()
            self._bind_grads(self._main)
        else:
            for p in self.params:
                p.grad = None
            self.shard_grads.zero_()
        self._reset_reduction()  # a plain backward() after zero_grad() also reduces

    # ---- accounting ----------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        if self.full_grads:  # the full buffer (stage 2 pipelined: only while the step has it; then the shard too)
            grads = self.grad_buffer.untyped_storage().nbytes() + (_nbytes(self.shard_grads) if self.transient else 0)
        else:  # the shard and the bucket buffers filling
            grads = _nbytes(self.shard_grads) + sum(_nbytes(t) for t in self._buffers.values())
        frozen = sum(_nbytes(p) for _, p in unique_named_parameters(self.model) if not p.requires_grad)
        return {
            "parameters": _nbytes(self.param_buffer) + frozen,
            "gradients": grads,
            "optimizer": self.optimizer.state_bytes(),
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _partial(p: torch.Tensor) -> bool:
    return _spec(p, "partial_grad")
