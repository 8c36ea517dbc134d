"""Many LoRA adapters served at once over one base model: each row of a batch uses its own adapter, or none, and its
update is computed from its own adapter's factors (a gathered product; no weight is merged). S-LoRA's and Punica's
idea, as vLLM serves it.

**Slots.** The bank holds ``max_loras`` slots on the model's device. For an adapted linear ``m`` (``W [out, in]``),
slot ``s`` is ``A_m[s] [R_m, in]`` and ``B_m[s] [out, R_m]`` (``B`` already times the adapter's scaling), ``R_m``
the largest rank any adapter has there; a smaller rank is zero-padded (zero rows of ``A`` and columns of ``B`` add
nothing, so the product is exact) and an adapter that leaves ``m`` alone has zeros. Bytes on the device:
``(max_loras + 1) * R_m * (in + out) * element size`` per adapted linear (the last slot stays zero: the base's).
Every adapter given stays on the host as its padded tensors; one that a sequence needs and no slot holds is copied
into a free slot, or into the least recently used slot no running sequence holds (:meth:`AdapterBank.acquire`).
When every slot is held, the sequence waits.

**One call.** Before the model runs, :meth:`AdapterBank.select` takes each row's slot (None: the base, which reads
the zero slot) on the host. Each adapted linear computes ``y = x W^T + b`` as before, and a forward hook on it adds
each row's update: with rows of several slots, the gathered product ``y_b += (x_b A_{s_b}^T) B_{s_b}^T`` -- the rows'
factors gathered (``index_select`` of ``A`` and ``B``: ``B R_m (in + out)`` values, freed after the linear) and two
batched products (``bmm``, ``baddbmm_`` in place), ``2 B T R_m (in + out)`` FLOPs, base rows included at zero; with
every row of one adapter, ``y += (x A_s^T) B_s^T`` in place; with no adapter in the call, nothing. The model keeps its
modules. The slots are read from the host's list, so the device is never waited for. (Measured on a CPU, a decode
step of 16 rows over 4 adapters and the base: the gathered product costs 0.6x of one segmented product per group.)

**Fused projections** (``model.fused_proj``: ``qkv_proj``, ``gate_up_proj``, :mod:`trickles.models.fused`). The
parts' adapters ``(A_p, B_p)`` of one adapter become one of rank ``sum r_p``: ``A = [A_q; A_k; A_v]``, and ``B`` holds
``B_p`` in part ``p``'s rows (interleaved by group as the fused weight's rows are) and in ``p``'s columns, zeros
elsewhere, so ``B A x`` is each part's ``B_p A_p x`` in its own rows (the block-diagonal form
:mod:`trickles.adapters.peft` writes for PEFT).

**Tensor parallelism** (``trickles serve --tp``, each rank's bank over its shard of the model): each slot holds the
rank's part of the adapter, split as the base weight is (:mod:`trickles.adapters.tensor`'s split for training). A
column-parallel linear (its rows of ``W``) keeps ``B``'s same rows and the whole ``A``, so ``y_i += (x A^T) B_i^T``,
no communication; a row-parallel one (its columns of ``W``, its output already summed over the ranks) keeps ``A``'s
same columns and the whole ``B``: ``u = sum_i x_i A_i^T`` is all-reduced over the tensor-parallel group (``n_g T R``
values a group and layer, far less than the ``n_g T out`` of the output itself) and ``y += u B^T``; a key/value
projection kept whole on every rank keeps ``B``'s rows of the heads it outputs. Rank 0 decides the slots and sends
each call's slots and what each slot holds (:mod:`trickles.infer.ranks`), so every rank's bank selects alike.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import GroupComm
from ..errors import ConfigError
from ..models.fused import fused_name, layout_of
from ..parallel.tensor.layers import ColumnParallelLinear, ReplicatedKV, RowParallelLinear

__all__ = ["AdapterBank"]


@dataclass
class _Target:
    """One adapted linear's slots and its part of each adapter (module doc)."""

    a: torch.Tensor  # [S, R, in held]
    b: torch.Tensor  # [S, out held, R]
    rows: torch.Tensor | None  # the rows of the whole B its output holds (None: all)
    cols: slice | None  # the columns of the whole A its input holds (None: all)
    comm: GroupComm | None  # sums u = x A^T over the tensor-parallel group (row-parallel), or None


def _view(module: nn.Module) -> tuple[tuple[int, int], torch.Tensor | None, slice | None, GroupComm | None]:
    """``((out, in) of the whole weight, rows, cols, comm)`` of a linear of a served model (module doc); None for a
    module the bank cannot update."""
    out, d_in = module.weight.shape
    if type(module) is nn.Linear:
        return (out, d_in), None, None, None
    if type(module) is ColumnParallelLinear:
        shape, first = module.weight.tp_spec.global_shape, module.weight.tp_spec.offset[0]
        return shape, torch.arange(first, first + out), None, None
    if type(module) is RowParallelLinear:
        shape, first = module.weight.tp_spec.global_shape, module.weight.tp_spec.offset[1]
        return shape, None, slice(first, first + d_in), module.ctx.comm
    if type(module) is ReplicatedKV:
        d = module.head_dim
        return (out, d_in), torch.tensor([h * d + i for h in module._heads for i in range(d)]), None, None
    return None


class AdapterBank:
    """The adapters a server holds, ``max_loras`` of them on the device at once (module doc).

    ``adapters``: objects with ``name`` and ``weights`` (``{unfused module name: (A [r, in], B [out, r] scaled)}``,
    :class:`~trickles.adapters.loaded.LoadedAdapter`). Hooks each linear of ``model`` that some adapter updates (the
    model, on one process or a tensor-parallel rank's shard of it, is otherwise unchanged); ConfigError naming the
    adapter and module when one does not fit the model."""

    def __init__(self, model: nn.Module, adapters: Sequence, max_loras: int):
        if max_loras < 1:
            raise ConfigError(f"max_loras must be at least 1, got {max_loras}")
        names = [a.name for a in adapters]
        if len(set(names)) != len(names):
            raise ConfigError(f"adapter names must differ; {names} repeats one")
        self.max_loras = max_loras
        self.names = names
        self.paths = {a.name: getattr(a, "path", None) for a in adapters}  #: where each adapter was read from
        self.rows: torch.Tensor | int | None = None  # the call's slot per row, one slot for every row, or None
        self.selected: list[int | None] = []  #: each row's slot in the latest call
        cfg = model.cfg
        p = next(model.parameters())
        self.device, dtype = p.device, p.dtype
        # per adapter, per served linear: the parts' (A, B) by part index (0 for an unfused linear)
        parts: dict[str, dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
        for a in adapters:
            for module, (A, B) in a.weights.items():
                hit = fused_name(cfg, module + ".weight")
                owner, index = (hit[0].rsplit(".", 1)[0], hit[1]) if hit else (module, 0)
                parts.setdefault(a.name, {}).setdefault(owner, {})[index] = (A, B)
        modules = dict(model.named_modules())
        views = {}
        self.host: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {a.name: {} for a in adapters}
        for name, by_module in parts.items():
            for owner, by_part in by_module.items():
                if owner not in modules or not hasattr(modules[owner], "weight"):
                    raise ConfigError(
                        f"adapter {name!r} updates {owner}, which is no linear of the served model; it was made "
                        "for another model"
                    )
                view = _view(modules[owner])
                if view is None:
                    raise ConfigError(
                        f"adapter {name!r} updates {owner}, a {type(modules[owner]).__name__} here, which adapters "
                        "are not served on yet; serve it on one process"
                    )
                views[owner] = view
                self.host[name][owner] = _combine(name, owner, view[0], layout_of(cfg, owner + ".weight"), by_part)
        self.targets: dict[str, _Target] = {}
        for owner in sorted(views):
            (out, d_in), rows, cols, comm = views[owner]
            rank = max(by[owner][0].shape[0] for by in self.host.values() if owner in by)
            for by in self.host.values():  # this rank's part, padded to the rank of the slots
                if owner in by:
                    a, b = by[owner]
                    a, b = (a if cols is None else a[:, cols]), (b if rows is None else b[rows])
                    by[owner] = (_pad(a, rank, 0).to(dtype), _pad(b, rank, 1).to(dtype))
            held_out, held_in = modules[owner].weight.shape
            held_out = held_out if rows is None else len(rows)
            target = _Target(
                p.new_zeros(max_loras + 1, rank, held_in, dtype=dtype),  # (slot max_loras: zeros, the base's)
                p.new_zeros(max_loras + 1, held_out, rank, dtype=dtype),
                rows,
                cols,
                comm,
            )
            self.targets[owner] = target
            modules[owner].register_forward_hook(self._hook(target))
        self.slot_of: dict[str, int] = {}  # resident adapters
        self.holds = [0] * max_loras  # running sequences per slot
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(max_loras))
        self.loads = 0

    def _hook(self, t: _Target):
        def add_updates(module, args, y):
            """``y`` plus each row's ``(x A^T) B^T`` (module doc)."""
            rows = self.rows
            if rows is None:
                return y
            x = args[0]
            if isinstance(rows, int):  # every row of one adapter: added in place
                u = x.reshape(-1, x.shape[-1]) @ t.a[rows].t()
                if t.comm is not None:
                    u = t.comm.all_reduce(u.contiguous())
                y.view(-1, y.shape[-1]).addmm_(u, t.b[rows].t())
                return y
            u = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), t.a.index_select(0, rows).transpose(1, 2))
            if t.comm is not None:
                u = t.comm.all_reduce(u.contiguous())
            y.view(y.shape[0], -1, y.shape[-1]).baddbmm_(u, t.b.index_select(0, rows).transpose(1, 2))
            return y

        return add_updates

    def residency(self) -> list[int]:
        """Per slot, the index (in :attr:`names`) of the adapter it holds, -1 for none."""
        out = [-1] * self.max_loras
        for name, slot in self.slot_of.items():
            out[slot] = self.names.index(name)
        return out

    def mirror(self, residency: Sequence[int]) -> None:
        """Loads what :meth:`residency` of another rank's bank says each slot holds, where this one differs."""
        mine = self.residency()
        for slot, (want, have) in enumerate(zip(residency, mine)):
            if want != have:
                self._place(self.names[want] if want >= 0 else None, slot)

    def acquire(self, name: str) -> int | None:
        """A slot holding adapter ``name`` for one more sequence (loaded into a free or least recently used unheld
        slot when none holds it); None when every slot is held by running sequences."""
        slot = self.slot_of.get(name)
        if slot is None:
            free = [s for s in self.lru if self.holds[s] == 0]
            if not free:
                return None
            slot = free[0]
            self._place(name, slot)
        self.holds[slot] += 1
        self.lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        """One sequence fewer holds ``slot``."""
        self.holds[slot] -= 1

    def select(self, slots: Sequence[int | None]) -> None:
        """The rows of the next model call and their slots (None: the base), as the hooks read them (module doc)."""
        self.selected = list(slots)
        used = set(self.selected)
        if used <= {None}:
            self.rows = None
        elif len(used) == 1:
            self.rows = self.selected[0]
        else:
            base = self.max_loras  # the zero slot
            self.rows = torch.tensor([base if s is None else s for s in slots], device=self.device)

    def _place(self, name: str | None, slot: int) -> None:
        """Puts adapter ``name`` (None: none) in ``slot``, in place of what it held."""
        for old in [n for n, s in self.slot_of.items() if s == slot]:
            del self.slot_of[old]
        if name is not None:
            self._load(name, slot)
            self.slot_of[name] = slot

    @torch.no_grad()
    def _load(self, name: str, slot: int) -> None:
        for owner, t in self.targets.items():
            ab = self.host[name].get(owner)
            if ab is None:
                t.a[slot].zero_()
                t.b[slot].zero_()
            else:
                t.a[slot].copy_(ab[0], non_blocking=True)
                t.b[slot].copy_(ab[1], non_blocking=True)
        self.loads += 1


def _combine(name: str, owner: str, shape, layout, by_part: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole ``(A, B)`` for the linear ``owner`` of weight ``shape`` ``(out, in)`` from its parts' adapters (a
    fused projection's: module doc)."""
    d_out, d_in = shape
    if layout is None:
        a, b = by_part[0]
        _check(name, owner, a, b, d_in, d_out)
        return a.float(), b.float()
    ranks = [by_part[i][0].shape[0] if i in by_part else 0 for i in range(len(layout.parts))]
    col, bs = 0, []
    for i, (part, n) in enumerate(zip(layout.parts, layout.sizes)):
        rows = layout.groups * n
        b = torch.zeros(rows, sum(ranks))
        if i in by_part:
            a_i, b_i = by_part[i]
            _check(name, owner.rsplit(".", 1)[0] + "." + part, a_i, b_i, d_in, rows)
            b[:, col : col + ranks[i]] = b_i.float()
            col += ranks[i]
        bs.append(b)
    a = torch.cat([by_part[i][0].float() for i in range(len(layout.parts)) if i in by_part])
    return a, layout.fuse(bs)


def _check(name: str, module: str, a: torch.Tensor, b: torch.Tensor, d_in: int, d_out: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != a.shape[0]:
        raise ConfigError(
            f"adapter {name!r}: {module} has A {list(a.shape)} and B {list(b.shape)}, the served model's linear "
            f"is [{d_out}, {d_in}] (A [r, {d_in}], B [{d_out}, r]); the adapter was made for another model"
        )


def _pad(t: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``rank``."""
    extra = rank - t.shape[dim]
    if extra == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)
