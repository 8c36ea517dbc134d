"""ZeRO-3's units: a unit's parameters as flat shards, their transient gathered buffers, and the autograd function
that gathers them (:mod:`trickles.parallel.data.zero3` drives them).

A unit's parameters fall in at most two *parts*, each laid out flat on its own
(:class:`~trickles.parallel.data.flat.FlatLayout`, one bucket padded to a multiple of ``N = dp``) and sharded:

* the **trainable** part (every parameter, without LoRA): its gather is :class:`GatherUnit`, all-gather forward and
  reduce-scatter of the buffer's gradient backward, so its views carry gradients;
* the **frozen** part (``requires_grad=False``: a LoRA run's base, :mod:`trickles.adapters`): gathered alike, but
  its views are installed as plain tensors, outside autograd: no gradient is computed for them, none is reduced,
  and the part has no gradient shard and no optimizer state. Its shard is registered as ``flat_shard_frozen``.

A unit with no frozen parameter has only the trainable part (also when it has no parameter at all); a unit with no
trainable parameter (the root when the embedding and the head are frozen, a block without adapters) has only the
frozen part.

**When the frozen buffer may go.** Autograd's engine runs a graph's ready nodes in decreasing order of creation
(sequence number), so by the time a node runs, every node created after it has run. The nodes that read a unit's
weights are created after the unit's ``GatherUnit`` node and after the nodes that produced the unit's inputs: once
``GatherUnit.backward`` runs, or (a unit without trainable part) once the gradient of an input produced inside the
graph is complete, none of them is left, and the frozen buffer is freed there (the engine's end of micro-step frees
whatever is still gathered, the root's buffer for one).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ...comm import GroupComm, Handle
from .flat import FlatLayout, Slot


class Part:
    """One flat part of a unit (trainable or frozen): the rank's shard, the transient gathered buffer and where each
    parameter plugs in."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        owners: dict[int, list[tuple[nn.Module, str]]],
        comm: GroupComm,
        device,
        dtype,
        trainable: bool,
    ):
        self.comm, self.trainable = comm, trainable
        self.layout = FlatLayout(named, comm.size, bucket_bytes=None)
        self.owners = [owners[id(s.param)] for s in self.layout.slots]
        self.segments = self.layout.segments(comm.rank)
        shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device)
        self.shard = nn.Parameter(shard, requires_grad=trainable)
        self.full = torch.empty(self.layout.total, dtype=dtype, device=device)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.handle: Handle | None = None
        self.gathered = False

    def gather(self, async_op: bool) -> None:
        if self.gathered:
            return
        if self.handle is not None:  # prefetched: it is on its way
            if not async_op:
                self.wait()
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.nbytes)
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
        """Plugs each parameter's view of ``full`` (the gathered buffer, or :class:`GatherUnit`'s output) into its
        modules."""
        pieces = torch.split(full[: self.layout.numel], [s.numel for s in self.layout.slots])
        for slot, piece, owners in zip(self.layout.slots, pieces, self.owners):
            view = piece.view(slot.shape)
            for module, attr in owners:
                setattr(module, attr, view)

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    def fill(self, init_value) -> None:
        """Writes the rank's part of each parameter into the shard, one whole parameter at a time."""
        with torch.no_grad():
            for seg in self.segments:
                slot: Slot = seg.slot
                if slot.param.is_meta:
                    if init_value is None:
                        raise ValueError(f"{slot.name} is on the meta device; pass init_value to compute it")
                    full = init_value(slot.name, slot.param)  # this rank's whole (tensor-parallel) parameter
                else:
                    full = slot.param.detach()
                a, b = seg.param_range
                self.shard[seg.shard_offset : seg.shard_offset + seg.numel].copy_(full.reshape(-1)[a:b])


class Unit:
    """One unit: its trainable part (``train``) and frozen part (``frozen``), either possibly absent, and the
    trainable part's gradient shard. ``layout``, ``shard`` and ``segments`` are the trainable part's."""

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
        trainable, frozen = split_parts(named)
        self.train = Part(trainable, owners, comm, device, dtype, True) if trainable is not None else None
        self.frozen = Part(frozen, owners, comm, device, dtype, False) if frozen is not None else None
        self.parts = [p for p in (self.train, self.frozen) if p is not None]
        self.grad_shard = (
            torch.zeros(self.train.layout.shard_numel, dtype=grad_dtype, device=device) if self.train else None
        )
        self._bytes = sum(p.nbytes for p in self.parts)  # both parts gathered
        self.index = -1  # position in forward order
        self.chunk = None  # the pipeline chunk that runs it (prefetches stay within one)

    @property
    def layout(self) -> FlatLayout | None:
        return self.train.layout if self.train else None

    @property
    def shard(self) -> nn.Parameter | None:
        return self.train.shard if self.train else None

    @property
    def segments(self) -> list:
        return self.train.segments if self.train else []

    @property
    def slots(self) -> list[Slot]:
        """Every parameter of the unit, trainable and frozen."""
        return [s for p in self.parts for s in p.layout.slots]

    def gather(self, async_op: bool) -> None:
        for part in self.parts:
            part.gather(async_op=True)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        for part in self.parts:
            part.wait()

    def free(self) -> None:
        for part in self.parts:
            part.free()

    def gathered_bytes(self) -> int:
        return sum(p.gathered_bytes() for p in self.parts)


class GatherUnit(torch.autograd.Function):
    """All-gather a unit's trainable shard in forward; in backward free the unit's buffers (trainable and frozen:
    every node that reads them has run, see the module docstring) and reduce-scatter the gradient of the whole
    trainable buffer."""

    @staticmethod
    def forward(ctx, shard, unit, engine):
        unit.train.gather(async_op=False)
        ctx.unit, ctx.engine = weakref.ref(unit), weakref.ref(engine)  # the graph may outlive them
        return unit.train.full.view_as(unit.train.full)

    @staticmethod
    def backward(ctx, grad):
        unit, engine = ctx.unit(), ctx.engine()
        if unit is None or engine is None:
            return None, None, None
        unit.free()  # (the reduction needs only the gradient; another graph of the unit gathers it again first)
        engine._reduce_unit(unit, grad)
        return None, None, None


def split_parts(named: list[tuple[str, nn.Parameter]]):
    """``(trainable, frozen)``: a unit's named parameters in its two parts, None for a part it does not have (the
    trainable part exists unless every parameter is frozen; the memory report lays them out the same way)."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    return (trainable if trainable or not frozen else None), (frozen or None)


def owned_parameters(module: nn.Module, prefix: str, other_units: set[int]):
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


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()
