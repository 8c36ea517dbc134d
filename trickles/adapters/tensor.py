"""LoRA adapters under 1-D tensor parallelism: each adapter split the way its base weight is.

:func:`apply_lora_tensor_parallel` runs after :func:`~trickles.parallel.tensor.plan.apply_tensor_parallel` has
swapped the adapted linears for parallel ones (which dropped the adapters), and puts adapters back on the parallel
layers, keeping every name (``q_proj.weight``, ``q_proj.lora_A.weight``). With ``tp`` ranks, rank ``i``:

* **column-parallel** ``y_i = x W_i^T`` (``W`` split by output rows; ``q_proj``, ``k_proj``, ``v_proj``,
  ``gate_proj``, ``up_proj``, fused ``qkv_proj`` / ``gate_up_proj``): ``B`` is split like ``W``, by rows, ``B_i``
  ``[out / tp, r]``; ``A`` ``[r, in]`` is whole on every rank. ``y_i += s B_i A x``. The gradient of ``A`` is the sum
  of every rank's ``B_i^T dy_i`` term: replicated with its gradient summed over tp (like a per-head norm's). The
  input's gradient ``A^T B_i^T dy_i`` is partial per rank and is summed by the region entry's backward, with the
  base's. A fused projection's part ``p`` has ``B_p`` split by whole groups, as the fused rows are.
* **row-parallel** ``y = sum_i x_i W_i^T`` (``o_proj``, ``down_proj``; ``x`` split by input columns): ``A`` is split
  like ``W``, by columns, ``A_i`` ``[r, in / tp]``; ``B`` ``[out, r]`` is whole. ``u_i = A_i x_i`` and ``s B u_i`` is
  added to the rank's partial output **before** the region's exit, so the exit's all-reduce (or reduce-scatter) sums
  ``s B sum_i u_i = s B A x`` with the base's partial sums: no collective of its own. ``B``'s gradient
  ``dy^T u_i`` is partial per rank: summed over tp.
* a key/value projection kept whole (:class:`~trickles.parallel.tensor.layers.ReplicatedKV`, ``n_kv_heads`` not
  divisible by ``tp``): its adapter is whole too, its gradients summed over tp, like its weight's.

Extra bytes per step: none sent; ``A`` (column) and ``B`` (row) gradients join the replicated parameters' sum over
tp, ``r (in + out)`` values per adapter at most.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..models.fused import FusedLayout
from ..parallel.tensor.layers import (
    ColumnParallelLinear,
    ReplicatedKV,
    RowParallelLinear,
    TPSpec,
    replicated_spec,
    set_spec,
)
from .lora import FusedLoRALinear, LoRALinear


def _frozen(module: nn.Module, base: nn.Module) -> None:
    module.weight, module.bias = base.weight, base.bias
    for p in (module.weight, module.bias):
        if p is not None:
            p.requires_grad_(False)


def _linear(n_in: int, n_out: int, spec: TPSpec, device) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=False, device=device)
    set_spec(lin.weight, spec)
    return lin


class ColumnLoRA(ColumnParallelLinear):
    """A column-parallel linear with its adapter: ``B`` split by rows, ``A`` whole (module doc)."""

    def __init__(self, base: ColumnParallelLinear | ReplicatedKV, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.ctx, self.regather = base.ctx, base.regather
        self.in_features, self.out_features = base.in_features, base.out_features
        _frozen(self, base)
        spec, dev = base.weight.tp_spec, base.weight.device
        rows, offset = base.weight.shape[0], spec.offset[0]
        self.lora_A = _linear(self.in_features, rank, replicated_spec((rank, self.in_features), True), dev)
        whole = spec.replicated
        b_spec = replicated_spec((rows, rank), True) if whole else TPSpec((spec.global_shape[0], rank), (offset, 0))
        self.lora_B = _linear(rank, rows, b_spec, dev)
        self.scaling = scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        base = self.ctx.linear(x, self.weight, self.bias, self.regather)
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class ReplicatedKVLoRA(ColumnLoRA):
    """:class:`ReplicatedKV` (whole on every rank, this rank's heads picked) with its whole adapter."""

    def __init__(self, base: ReplicatedKV, rank: int, scaling: float, dropout: float):
        super().__init__(base, rank, scaling, dropout)
        self._heads, self.head_dim = base._heads, base.head_dim

    def forward(self, x):
        kv = super().forward(x)
        kv = kv.view(*kv.shape[:-1], -1, self.head_dim)[..., self._heads, :]
        return kv.reshape(*kv.shape[:-2], -1)


class FusedColumnLoRA(ColumnParallelLinear):
    """A fused column-parallel projection with one adapter per adapted part: ``A_p`` whole, ``B_p`` this rank's
    groups' rows of the part (module doc); the updates land in the parts' rows of this rank's fused output."""

    def __init__(self, base: ColumnParallelLinear, old: FusedLoRALinear, tp: int):
        nn.Module.__init__(self)
        self.ctx, self.regather = base.ctx, base.regather
        self.in_features, self.out_features = base.in_features, base.out_features
        _frozen(self, base)
        lay = old.layout
        self.layout = FusedLayout(lay.module, lay.parts, lay.sizes, lay.groups // tp)
        group0, dev = base.weight.tp_spec.offset[0] // lay.per_group, base.weight.device
        rank = next(iter(old.lora_A.values())).out_features
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        for p, n in zip(lay.parts, lay.sizes):
            if p in old.lora_A:
                self.lora_A[p] = _linear(self.in_features, rank, replicated_spec((rank, self.in_features), True), dev)
                spec = TPSpec((lay.groups * n, rank), (group0 * n, 0))
                self.lora_B[p] = _linear(rank, self.layout.groups * n, spec, dev)
        self.scaling = old.scaling
        self.lora_dropout = (
            nn.Dropout(old.lora_dropout.p) if isinstance(old.lora_dropout, nn.Dropout) else nn.Identity()
        )

    _fused_rows = FusedLoRALinear._fused_rows

    def forward(self, x):
        h = self.lora_dropout(x)
        delta = {p: self.lora_B[p](self.lora_A[p](h)) for p in self.lora_A}
        base = self.ctx.linear(x, self.weight, self.bias, self.regather)
        return base + self._fused_rows(delta, x.shape[:-1], x) * self.scaling


class RowLoRA(RowParallelLinear):
    """A row-parallel linear with its adapter: ``A`` split by columns, ``B`` whole, the update summed by the region's
    exit with the base's partial sums (module doc)."""

    def __init__(self, base: RowParallelLinear, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.ctx = base.ctx
        self.in_features, self.out_features = base.in_features, base.out_features
        _frozen(self, base)
        spec, dev = base.weight.tp_spec, base.weight.device
        self.lora_A = _linear(self.in_features, rank, TPSpec((rank, spec.global_shape[1]), (0, spec.offset[1])), dev)
        self.lora_B = _linear(rank, self.out_features, replicated_spec((self.out_features, rank), True), dev)
        self.scaling = scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        partial = F.linear(x, self.weight) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        y = self.ctx.leave(partial)
        return y + self.bias if self.bias is not None else y


def adapted_modules(model: nn.Module) -> dict[str, LoRALinear | FusedLoRALinear]:
    """The modules of ``model`` that carry LoRA adapters, by name (recorded before a parallel plan swaps them)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, FusedLoRALinear))}


def apply_lora_tensor_parallel(model: nn.Module, adapted: dict[str, nn.Module], tp: int) -> None:
    """Puts the adapters ``adapted`` (:func:`adapted_modules` before tensor parallelism) back on the parallel layers
    that replaced their linears, split as the module doc says (in place)."""
    for name, old in adapted.items():
        new = model.get_submodule(name)
        if isinstance(old, FusedLoRALinear):
            swapped = FusedColumnLoRA(new, old, tp)
        else:
            args = (old.lora_A.out_features, old.scaling, getattr(old.lora_dropout, "p", 0.0))
            kind = {ReplicatedKV: ReplicatedKVLoRA, ColumnParallelLinear: ColumnLoRA, RowParallelLinear: RowLoRA}
            if type(new) not in kind:
                raise TypeError(f"no tensor-parallel LoRA for {name} ({type(new).__name__})")
            swapped = kind[type(new)](new, *args)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, swapped)
