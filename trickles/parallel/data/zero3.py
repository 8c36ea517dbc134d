"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over the dp ranks.

The model is cut into *units*: chosen child modules (for the transformer, each block) plus
the root, which keeps whatever the units do not own (embeddings, final norm, output head).
Each unit's parameters are laid out flat (:class:`~trickles.parallel.data.flat.FlatLayout`, one
bucket padded to a multiple of ``N = dp``) and rank ``r`` keeps only shard ``r``: a 1-D
``nn.Parameter`` of ``ceil(P_unit / N)`` elements, registered on the unit as ``flat_shard``.
The original parameters are removed from the modules; whole parameters never exist on a rank
outside the moments described below, also not during set-up (each one is computed and sliced
as it is initialized).

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

The gather is the autograd function ``_GatherUnit``: all-gather forward, reduce-scatter
backward. Per step each rank sends ``3 (N-1)/N * 4P`` bytes (fp32): two all-gathers and one
reduce-scatter. Bytes per rank: ``16P / N`` for parameters, gradients and Adam state, plus the
gathered buffers of at most two units and the root at a time.

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
from .flat import FlatLayout, Slot
from .zero import MAX_INFLIGHT


class _Unit:
    """One unit's shard, its transient gathered buffer and where its parameters plug in."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        named: list[tuple[str, nn.Parameter]],
        owners: dict[int, list[tuple[nn.Module, str]]],
        comm: GroupComm,
        device,
        dtype,
        grad_dtype,
    ):
        self.name, self.module, self.comm = name, module, comm
        self.layout = FlatLayout(named, comm.size, bucket_bytes=None)
        self.owners = [owners[id(s.param)] for s in self.layout.slots]
        self.segments = self.layout.segments(comm.rank)
        self.shard = nn.Parameter(torch.zeros(self.layout.shard_numel, dtype=dtype, device=device))
        self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=grad_dtype, device=device)
        self.full = torch.empty(self.layout.total, dtype=dtype, device=device)
        self._bytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.handle: Handle | None = None
        self.gathered = False
        self.index = -1  # position in forward order
        self.chunk = None  # the pipeline chunk that runs it (prefetches stay within one)

    # ---- the gathered buffer -------------------------------------------------------------
    def gather(self, async_op: bool) -> None:
        if self.gathered:
            return
        if self.handle is not None:  # prefetched: it is on its way
            if not async_op:
                self.wait()
            return
        storage = self.full.untyped_storage()
        storage.resize_(self._bytes)
        # write through an alias with its own version counter: autograd's saved views of the
        # buffer must not see this refill as an in-place modification
        alias = torch.empty(0, dtype=self.full.dtype, device=self.full.device).set_(storage, 0, self.full.shape)
        self.handle = self.comm.all_gather(self.shard.detach(), async_op=True, out=alias)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.gathered = True

    def free(self) -> None:
        self.wait()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def install(self, full: torch.Tensor) -> None:
        pieces = torch.split(full[: self.layout.numel], [s.numel for s in self.layout.slots])
        for slot, piece, owners in zip(self.layout.slots, pieces, self.owners):
            view = piece.view(slot.shape)
            for module, attr in owners:
                setattr(module, attr, view)

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()


class _GatherUnit(torch.autograd.Function):
    """All-gather a unit's shards in forward; reduce-scatter the gradient of the whole in backward."""

    @staticmethod
    def forward(ctx, shard, unit, engine):
        unit.gather(async_op=False)
        ctx.unit, ctx.engine = weakref.ref(unit), weakref.ref(engine)  # the graph may outlive them
        return unit.full.view_as(unit.full)

    @staticmethod
    def backward(ctx, grad):
        unit, engine = ctx.unit(), ctx.engine()
        if unit is None or engine is None:
            return None, None, None
        unit.free()  # (the reduction needs only the gradient; another graph of the unit gathers it again first)
        engine._reduce_unit(unit, grad)
        return None, None, None


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
        self.units: list[_Unit] = []
        for module in [*units, model]:
            named, owners = _owned(module, names[id(module)], unit_ids - {id(module)})
            group = self.groups[1] if id(module) in expert_ids and self.ep is not None else comm
            unit = _Unit(names[id(module)] or "<root>", module, named, owners, group, device, dtype, grad_dtype)
            _fill_shard(unit, init_value)
            for slot_owners in unit.owners:
                for mod, attr in slot_owners:
                    mod._parameters.pop(attr, None)
            module.register_parameter("flat_shard", unit.shard)
            module.register_forward_pre_hook(self._make_pre_forward(unit))
            module.register_forward_hook(self._make_post_forward(unit))
            self.units.append(unit)
        _materialize_buffers(model, device)
        self.order: list[_Unit] = []
        self._chunk = None  # the pipeline chunk running now (run_chunk)
        self._inflight: list[tuple[_Unit, torch.Tensor, torch.Tensor, Handle]] = []
        segments, params, grads = [], {}, {}
        for unit in self.units:
            for seg in unit.segments:
                segments.append(seg)
                params[id(seg)] = unit.shard.data[seg.shard_offset : seg.shard_offset + seg.numel]
                grads[id(seg)] = unit.grad_shard[seg.shard_offset : seg.shard_offset + seg.numel]
        named = [(slot.name, slot.param) for unit in self.units for slot in unit.layout.slots]
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
    def _make_pre_forward(self, unit: _Unit):
        return lambda module, args: self._before(unit)

    def _make_post_forward(self, unit: _Unit):
        return lambda module, args, output: self._after(unit, output)

    def _before(self, unit: _Unit) -> None:
        """Gathers ``unit`` (through autograd where a graph is recorded), installs its weights, prefetches the next."""
        if unit.index < 0:
            unit.index, unit.chunk = len(self.order), self._chunk
            self.order.append(unit)
        if torch.is_grad_enabled():
            full = _GatherUnit.apply(unit.shard, unit, self)
        else:
            unit.gather(async_op=False)
            full = unit.full
        unit.install(full)
        self._prefetch(unit, +1)

    def _prefetch(self, unit: _Unit, step: int) -> None:
        """Starts gathering the unit after ``unit`` in forward order (``step`` -1: before it, for backward), if the same
        pipeline chunk runs it: another chunk's turn comes after other work, which the gathered buffer would outlive."""
        i = unit.index + step
        if self.prefetch and 0 <= i < len(self.order) and self.order[i].chunk is unit.chunk:
            self.order[i].gather(async_op=True)

    def _after(self, unit: _Unit, output):
        """Frees ``unit``'s buffer; where a graph was recorded, its backward gathers it again first."""
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

    def _reduce_unit(self, unit: _Unit, grad: torch.Tensor) -> None:
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

    def _finish_reduction(self) -> None:
        self._retire(done_only=False)

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(s.slot.param, g) for s, g in zip(self.optimizer.segments, self.optimizer.grads)]

    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_([u.grad_shard for u in self.units], factor)

    def step(self, lr: float) -> None:
        self.optimizer.step(lr)

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_shard.zero_()

    def gathered_storages(self) -> set[int]:
        """Storages of the currently gathered unit buffers (model state, not activations)."""
        return {u.full.untyped_storage().data_ptr() for u in self.units if u.gathered_bytes()}

    def memory(self) -> dict[str, int]:
        shard = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        gathered = sum(u.gathered_bytes() for u in self.units)
        inflight = sum(g.numel() * g.element_size() + o.numel() * o.element_size() for _, g, o, _ in self._inflight)
        return {
            "parameters": shard + gathered,
            "gradients": sum(u.grad_shard.numel() * u.grad_shard.element_size() for u in self.units) + inflight,
            "optimizer": self.optimizer.state_bytes(),
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, gathered from all ranks (a collective: call it on every rank)."""
        out = {}
        with torch.no_grad():
            for unit in self.units:
                full = unit.comm.all_gather(unit.shard.detach())
                for slot in unit.layout.slots:
                    out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        return out

    def placements(self) -> dict[str, object]:
        return {slot.name: getattr(slot.param, "tp_spec", None) for u in self.units for slot in u.layout.slots}

    def _model_tensors(self) -> dict:
        tensors = {}
        for unit in self.units:
            for seg in unit.segments:
                if not self.writes(seg.slot.param):
                    continue
                piece = unit.shard.detach()[seg.shard_offset : seg.shard_offset + seg.numel]
                tensors[seg.name] = (piece, ckpt.describe(seg.slot.param, seg.param_range))
        return tensors

    def load(self, directory: str) -> None:
        reader = ckpt.PieceReader(directory, "model")
        ckpt.check_fits(
            reader,
            {s.name: s.param for u in self.units for s in u.layout.slots},
            directory,
            part=self.pipeline is not None,
        )
        with torch.no_grad():
            for unit in self.units:
                for seg in unit.segments:
                    param = seg.slot.param
                    unit.shard[seg.shard_offset : seg.shard_offset + seg.numel].copy_(
                        reader.read(seg.name, ckpt.region_of(param), seg.param_range, layout=ckpt.fused_layout(param))
                    )
        self._load_optimizer(directory)


def _owned(module: nn.Module, prefix: str, other_units: set[int]):
    """Parameters of ``module`` not inside another unit: ``[(fqn, param)]`` and their (module, attr) owners."""
    named, owners = [], {}
    stack = [(prefix, module)]
    while stack:
        path, m = stack.pop()
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if id(p) not in owners:
                owners[id(p)] = []
                named.append((f"{path}.{attr}" if path else attr, p))
            owners[id(p)].append((m, attr))
        for child_name, child in reversed(list(m._modules.items())):
            if child is not None and id(child) not in other_units:
                stack.append((f"{path}.{child_name}" if path else child_name, child))
    return named, owners


def _fill_shard(unit: _Unit, init_value) -> None:
    """Writes the rank's part of each parameter into the shard, one whole parameter at a time."""
    with torch.no_grad():
        for seg in unit.segments:
            slot: Slot = seg.slot
            if slot.param.is_meta:
                if init_value is None:
                    raise ValueError(f"{slot.name} is on the meta device; pass init_value to compute it")
                full = init_value(slot.name, slot.param)  # this rank's whole (tensor-parallel) parameter
            else:
                full = slot.param.detach()
            a, b = seg.param_range
            unit.shard[seg.shard_offset : seg.shard_offset + seg.numel].copy_(full.reshape(-1)[a:b])


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()
