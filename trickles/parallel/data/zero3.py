"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over the dp ranks.

The model is cut into *units*: chosen child modules (for the transformer, each block) plus
the root, which keeps whatever the units do not own (embeddings, final norm, output head).
Each unit's parameters are laid out flat (:class:`~trickles.parallel.data.flat.FlatLayout`, one
bucket padded to a multiple of ``N = dp``) and rank ``r`` keeps only shard ``r``: a 1-D
``nn.Parameter`` of ``ceil(P_unit / N)`` elements, registered on the unit as ``flat_shard``.
The original parameters are removed from the modules; whole parameters never exist on a rank
outside the moments described below, also not during set-up (each one is computed and sliced
as it is initialized). A unit's frozen parameters (a LoRA run's base) are a second flat part of
their own, sharded alike (``flat_shard_frozen``): :mod:`~trickles.parallel.data.zero3_units`.

Per unit and step:

* **forward**: just before the unit runs, its shards are all-gathered into a unit-sized buffer
  whose pieces are installed as the modules' weights; the next unit's gather is started
  (prefetch) so it overlaps this unit's compute; after the unit, the buffer's storage is freed
  (the root's after the whole forward: it holds the embedding and the output head);
* **backward**: a hook on the unit's output fires before the unit's backward, re-gathers the
  buffer into the same storage (tensors saved for backward point into it) and prefetches the
  previous unit; when the unit's backward is done, the gradient of the whole buffer is
  reduce-scattered (mean), asynchronously, into the rank's gradient shard, and the buffer is
  freed again.

The gather is the autograd function ``GatherUnit``: all-gather forward, reduce-scatter
backward. Per step each rank sends ``3 (N-1)/N * 4P`` bytes (fp32): two all-gathers and one
reduce-scatter. Bytes per rank: ``16P / N`` for parameters, gradients and Adam state, plus the
gathered buffers of at most two units and the root at a time.

**Frozen parameters** (``requires_grad=False``, a LoRA run's base; ``P_f`` frozen and ``P_t``
trainable elements, each part padded on its own) are gathered like the trainable ones, for forward
and again for backward (their views are saved for the input gradients), but installed outside
autograd: no gradient is computed or reduced for them, and they hold no gradient shard and no
optimizer state. Their buffer is freed with the trainable one when the unit's backward is done (a
unit without trainable parameters: when the gradient of its input is complete; whatever is left,
such as the root's, at the end of the micro-step). Per micro-step each rank sends the frozen
buffers' all-gathers twice, and the trainable buffers' all-gathers twice and reduce-scatter once,
with ``p`` and ``g`` bytes per parameter and gradient element::

    bytes sent = 2 (N-1)/N * p (P_f + P_t)  +  (N-1)/N * g P_t    (fp32: (N-1)/N * (8 P_f + 12 P_t))

-- two thirds of the full model's ZeRO-3 volume when ``P_t << P_f``. A rank holds ``p (P_f + P_t) / N``
bytes of parameters, ``g P_t / N`` of gradients and ``k P_t / N`` of optimizer state: ``4 (P_f + 4 P_t) / N``
in fp32 with Adam, plus the gathered buffers as above.

With expert parallelism each mixture-of-experts block's experts (its ``Experts`` module) are a unit of their
own, sharded over their ``edp`` group (``R / ep`` ranks), and the rest of the model over all ``R`` replicas:
the experts' gather and reduce-scatter run over ``edp``, just around the experts' own forward and backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from ...comm import GroupComm, Handle
from ...optim.adamw import decay_flags
from ...optim.settings import OptimizerSettings
from ...optim.sharded import ShardedOptimizer
from ...train import checkpoint as ckpt
from ..engine import Engine
from .zero import MAX_INFLIGHT
from .zero3_units import GatherUnit, Unit, materialize_buffers, owned_parameters


class Zero3DataParallel(Engine):
    """ZeRO stage 3 of ``model`` over ``comm``, one unit per module in ``units`` plus the root."""

    stage = 3

    def __init__(
        self,
        model: nn.Module,
        comm: GroupComm,
        units: list[nn.Module],
        optim: OptimizerSettings,
        init_value: Callable[[str, nn.Parameter], torch.Tensor] | None,
        device: torch.device,
        offload: bool = False,
        prefetch: bool = True,
        param_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype = torch.float32,
        tp: GroupComm | None = None,
        ep: GroupComm | None = None,
        edp: GroupComm | None = None,
        expert_units: list[nn.Module] = (),
    ):
        super().__init__(model, comm, tp, ep, edp)
        units = [*units, *(expert_units if self.ep is not None else ())]
        expert_ids = {id(m) for m in expert_units}
        self.prefetch = prefetch
        decay = decay_flags(model)
        names = {id(m): n for n, m in model.named_modules()}
        unit_ids = {id(m) for m in units}
        dtype = param_dtype or next(model.parameters()).dtype
        self.units: list[Unit] = []
        for module in [*units, model]:
            named, owners = owned_parameters(module, names[id(module)], unit_ids - {id(module)})
            group = self.groups[1] if id(module) in expert_ids and self.ep is not None else comm
            unit = Unit(names[id(module)] or "<root>", module, named, owners, group, device, dtype, grad_dtype)
            for part in unit.parts:
                part.fill(init_value)
                for slot_owners in part.owners:
                    for mod, attr in slot_owners:
                        mod._parameters.pop(attr, None)
                module.register_parameter("flat_shard" if part.trainable else "flat_shard_frozen", part.shard)
            module.register_forward_pre_hook(self._make_pre_forward(unit))
            module.register_forward_hook(self._make_post_forward(unit))
            self.units.append(unit)
        materialize_buffers(model, device)
        self.order: list[Unit] = []
        self._chunk = None  # the pipeline chunk running now (run_chunk)
        self._inflight: list[tuple[Unit, torch.Tensor, torch.Tensor, Handle]] = []
        segments, params, grads = [], {}, {}
        for unit in self.units:  # the optimizer sees the trainable parts only
            for seg in unit.segments:
                segments.append(seg)
                params[id(seg)] = unit.shard.data[seg.shard_offset : seg.shard_offset + seg.numel]
                grads[id(seg)] = unit.grad_shard[seg.shard_offset : seg.shard_offset + seg.numel]
        named = [(slot.name, slot.param) for unit in self.units if unit.train for slot in unit.layout.slots]
        self.optimizer = ShardedOptimizer(
            segments,
            lambda s: params[id(s)],
            lambda s: grads[id(s)],
            decay,
            optim,
            offload,
            self.norm_provider(named, device),
        )

    # ---- hooks ---------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        return lambda module, args: self._before(unit)

    def _make_post_forward(self, unit: Unit):
        return lambda module, args, output: self._after(unit, output, args)

    def _before(self, unit: Unit) -> None:
        """Gathers ``unit`` (its trainable part through autograd where a graph is recorded), installs its weights,
        prefetches the next."""
        if unit.index < 0:
            unit.index, unit.chunk = len(self.order), self._chunk
            self.order.append(unit)
        unit.gather(async_op=False)
        for part in unit.parts:
            graph = part.trainable and torch.is_grad_enabled()
            part.install(GatherUnit.apply(part.shard, unit, self) if graph else part.full)
        self._prefetch(unit, +1)

    def _prefetch(self, unit: Unit, step: int) -> None:
        """Starts gathering the unit after ``unit`` in forward order (``step`` -1: before it, for backward), if the same
        pipeline chunk runs it: another chunk's turn comes after other work, which the gathered buffer would outlive."""
        i = unit.index + step
        if self.prefetch and 0 <= i < len(self.order) and self.order[i].chunk is unit.chunk:
            self.order[i].gather(async_op=True)

    def _after(self, unit: Unit, output, args=()):
        """Frees ``unit``'s buffers; where a graph was recorded, its backward gathers them again first, and a unit
        without trainable part frees them once the gradient of an input made in the graph is complete."""
        graph = torch.is_grad_enabled()
        unit.free()
        if graph:
            outs = [
                t
                for t in (output if isinstance(output, (tuple, list)) else (output,))
                if torch.is_tensor(t) and t.requires_grad
            ]
            if outs:
                engine, fired = weakref.ref(self), []

                def pre_backward(grad):
                    e = engine()
                    if not fired and e is not None:
                        fired.append(True)
                        unit.gather(async_op=False)
                        e._prefetch(unit, -1)
                    return grad

                for t in outs:
                    t.register_hook(pre_backward)
                if unit.train is None:  # no GatherUnit to free the frozen buffer (see zero3_units)

                    def backward_done(grad):
                        if fired:
                            unit.free()
                        return grad

                    for t in args:
                        if torch.is_tensor(t) and t.grad_fn is not None:
                            t.register_hook(backward_done)
        return output

    def run_chunk(self, chunk, call):
        """A pipeline chunk with the embedding or the head runs inside the root unit's gather, as the whole model's
        forward does (a chunk calls the blocks, whose own hooks gather them, but not the root's forward)."""
        self._chunk = chunk
        try:
            if not (chunk.first or chunk.last):
                return call()
            root = self.units[-1]
            self._before(root)
            return self._after(root, call())
        finally:
            self._chunk = None

    def _reduce_unit(self, unit: Unit, grad: torch.Tensor) -> None:
        self._retire(done_only=True)
        while len(self._inflight) >= MAX_INFLIGHT:  # a unit's gradient stays only while its reduction runs
            self._retire_oldest()
        grad = grad.to(unit.grad_shard.dtype).contiguous()  # reduced in the gradient type
        out = torch.empty(unit.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        self._inflight.append((unit, grad, out, unit.comm.reduce_scatter(grad, op="mean", async_op=True, out=out)))

    def _retire(self, done_only: bool) -> None:
        while self._inflight and (not done_only or self._inflight[0][3].done()):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        unit, _, out, handle = self._inflight.pop(0)
        handle.wait()
        unit.grad_shard.add_(out)

    # ---- engine --------------------------------------------------------------------------
    def _end_micro_step(self, last: bool) -> None:
        self._retire(done_only=False)  # a micro-batch's reductions end with its backward: none is held past it
        for unit in self.units:  # frozen buffers no GatherUnit or input gradient freed (the root's, say)
            if unit.frozen is not None:
                unit.frozen.free()

    def _finish_reduction(self) -> None:
        self._retire(done_only=False)

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(s.slot.param, g) for s, g in zip(self.optimizer.segments, self.optimizer.grads)]

    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_(self._grad_shards(), factor)

    def step(self, lr: float) -> None:
        self.optimizer.step(lr)

    def zero_grad(self) -> None:
        for g in self._grad_shards():
            g.zero_()

    def _grad_shards(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units if u.grad_shard is not None]

    def gathered_storages(self) -> set[int]:
        """Storages of the currently gathered unit buffers (model state, not activations)."""
        return {p.full.untyped_storage().data_ptr() for u in self.units for p in u.parts if p.gathered_bytes()}

    def memory(self) -> dict[str, int]:
        """Shards and gathered buffers of both parts; gradient shards, reductions in flight and optimizer state of
        the trainable parts only."""
        shard = sum(p.shard.numel() * p.shard.element_size() for u in self.units for p in u.parts)
        gathered = sum(u.gathered_bytes() for u in self.units)
        inflight = sum(g.numel() * g.element_size() + o.numel() * o.element_size() for _, g, o, _ in self._inflight)
        return {
            "parameters": shard + gathered,
            "gradients": sum(g.numel() * g.element_size() for g in self._grad_shards()) + inflight,
            "optimizer": self.optimizer.state_bytes(),
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, gathered from all ranks (a collective: call it on every rank)."""
        out = {}
        with torch.no_grad():
            for unit in self.units:
                for part in unit.parts:
                    full = unit.comm.all_gather(part.shard.detach())
                    for slot in part.layout.slots:
                        out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        out.update({n: b.detach().clone() for n, b in self._buffers().items()})
        return out

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers (routing biases): whole on every rank, not sharded."""
        persistent = self.model.state_dict(keep_vars=True)
        return {n: b for n, b in self.model.named_buffers() if n in persistent}

    def placements(self) -> dict[str, object]:
        return {slot.name: getattr(slot.param, "tp_spec", None) for u in self.units for slot in u.slots}

    def _model_tensors(self) -> dict:
        """Every part's pieces, frozen and trainable alike (a checkpoint holds the whole model)."""
        tensors = {}
        for unit in self.units:
            for part in unit.parts:
                for seg in part.segments:
                    if not self.writes(seg.slot.param):
                        continue
                    piece = part.shard.detach()[seg.shard_offset : seg.shard_offset + seg.numel]
                    tensors[seg.name] = (piece, ckpt.describe(seg.slot.param, seg.param_range))
        for n, b in self._buffers().items():
            if self.writes(b) and self._first_of_group(b):
                tensors[n] = (b, ckpt.describe(b))
        return tensors

    def load(self, directory: str) -> None:
        reader = ckpt.PieceReader(directory, "model")
        buffers = self._buffers()
        params = {s.name: s.param for u in self.units for s in u.slots}
        ckpt.check_fits(reader, {**params, **buffers}, directory, part=self.pipeline is not None)
        with torch.no_grad():
            for n, b in buffers.items():
                b.copy_(reader.read(n, ckpt.region_of(b)))
            for unit in self.units:
                for part in unit.parts:
                    for seg in part.segments:
                        param = seg.slot.param
                        part.shard[seg.shard_offset : seg.shard_offset + seg.numel].copy_(
                            reader.read(
                                seg.name, ckpt.region_of(param), seg.param_range, layout=ckpt.fused_layout(param)
                            )
                        )
        self._load_optimizer(directory)
