"""LoRA: low-rank adapters on a built model's linears, the base frozen (Hu et al., 2021).

A target linear ``y = x W^T + b`` (``W [out, in]``) becomes

    ``y = x W^T + b + s * dropout(x) A^T B^T``,  ``A [r, in]``, ``B [out, r]``, ``s = alpha / r``

(``s = alpha / sqrt(r)`` with rank-stabilized scaling). ``W`` and ``b`` are frozen (``requires_grad=False``: no
gradient, no optimizer state); only ``A`` and ``B`` train, ``r (in + out)`` values per target instead of
``in * out``. ``A`` starts uniform in ``+-1/sqrt(in)`` (PyTorch's and PEFT's ``kaiming_uniform_(a=sqrt(5))``
bound), ``B`` at zero, so a run starts exactly at its base model. Each starting value is a pure function of
``(seed, name)``, like every other parameter's (:func:`initial_value`), so it does not depend on the layout.

Applied from outside, like parallelism: :func:`apply_lora` swaps each target ``nn.Linear`` of a built model
(usually on the meta device, before ``parallelize``) for a :class:`LoRALinear` holding the **same** weight and
bias under the same names (``layers.0.attn.q_proj.weight``), plus ``lora_A.weight`` and ``lora_B.weight`` beside
them: the names PEFT gives the adapter of a module of that name, so exporting only adds PEFT's
``base_model.model.`` prefix and the family's module path (:mod:`trickles.adapters.peft`).

Targets are module names as Hugging Face models spell them (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``): a target matches every linear whose last name component equals it.
The experts of a mixture-of-experts block are not linears of those names and are never adapted. A fused projection
(``model.fused_proj``: ``qkv_proj``, ``gate_up_proj``) answers to its parts' names and keeps one adapter per adapted
part (:class:`FusedLoRALinear`), so it computes what the unfused model with the same adapters computes.

With ``base="int8"`` (``train.lora_base``) every adapted linear holds its frozen weight as per-row int8 codes and
scales (:mod:`trickles.adapters.int8_base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..models.fused import FUSED_PARTS, FusedLayout, layout_of
from .int8_base import BASES, base_linear, dense_weight, hold_int8

#: every attention and MLP projection of a llama-style block
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASettings:
    """What :func:`apply_lora` adds (from ``train.lora_*``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False
    base: str = "same"  # the frozen base's type: the run's, or per-row int8 (trickles.adapters.int8_base)

    @property
    def scaling(self) -> float:
        """``s``: the factor of the low-rank update."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"train.lora_rank must be at least 1 to add adapters (0: off), got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"train.lora_dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError("train.lora_targets is empty; name the projections to adapt, e.g. ['q_proj', 'v_proj']")
        if self.base not in BASES:
            raise ConfigError(f"train.lora_base must be one of {list(BASES)}, got {self.base!r}")


class AddLowRank(torch.autograd.Function):
    """``y + s (h A^T) B^T`` for the base's output ``y [..., out]`` and the adapter's input ``h [..., in]``.

    One product adds the update to ``y`` (``addmm``), in the type ``y`` was computed in (autocast's, or the
    parameters'), so no ``[..., out]`` temporary is made for ``B``'s output or its scaling, in forward or backward.
    Saved: ``h`` (in that type) and ``u = h A^T`` ``[..., r]``, what ``A``'s and ``B``'s gradients need, as
    ``nn.Linear`` modules would keep them; with ``du = s dy B``: ``dh = du A``, ``dA = du^T h``, ``dB = s dy^T u``,
    and ``dy`` passes to ``y`` unchanged."""

    @staticmethod
    def forward(ctx, y, h, a, b, scaling):
        dt = y.dtype
        with torch.autocast(y.device.type, enabled=False):
            h = h.to(dt)
            u = h.reshape(-1, h.shape[-1]) @ a.to(dt).t()
            out = torch.addmm(y.reshape(-1, y.shape[-1]), u, b.to(dt).t(), alpha=scaling)
        ctx.save_for_backward(h, u, a, b)
        ctx.scaling = scaling
        return out.view(y.shape)

    @staticmethod
    def backward(ctx, dy):
        h, u, a, b = ctx.saved_tensors
        s, need = ctx.scaling, ctx.needs_input_grad
        dh = da = db = None
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            du = (dy2 @ b.to(dy.dtype)).mul_(s)
            if need[1]:
                dh = (du @ a.to(dy.dtype)).view(h.shape)
            if need[2]:
                da = du.t() @ h.reshape(-1, h.shape[-1])
            if need[3]:
                db = (dy2.t() @ u).mul_(s)
        return dy, dh, da, db, None


def add_low_rank(y: torch.Tensor, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``y + scaling * (h A^T) B^T``: :class:`AddLowRank` where autograd records, else the same two products."""
    if torch.is_grad_enabled() and (y.requires_grad or h.requires_grad or a.requires_grad or b.requires_grad):
        return AddLowRank.apply(y, h, a, b, scaling)
    dt = y.dtype
    with torch.autocast(y.device.type, enabled=False):
        u = h.reshape(-1, h.shape[-1]).to(dt) @ a.to(dt).t()
        return torch.addmm(y.reshape(-1, y.shape[-1]), u, b.to(dt).t(), alpha=scaling).view(y.shape)


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update: ``F.linear(x, W, b) + s * B(A(dropout(x)))`` (module doc).

    The weight and bias keep their names and are frozen; ``lora_A: in -> r`` and ``lora_B: r -> out`` (no bias)
    are the trainable parameters."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        self.scaling = scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_low_rank(
            base_linear(self, x), self.lora_dropout(x), self.lora_A.weight, self.lora_B.weight, self.scaling
        )

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + s B A``: the weight of the plain linear this one computes (without dropout)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (dense_weight(self) + self.scaling * delta).to(self.lora_A.weight.dtype)


class FusedLoRALinear(nn.Linear):
    """A fused projection (``qkv_proj``, ``gate_up_proj``: :mod:`trickles.models.fused`) with one adapter per adapted
    part: part ``p`` has ``lora_A.<p>: in -> r`` and ``lora_B.<p>: r -> rows of p``, and its update lands in the
    part's rows of the fused output, interleaved by group as the fused weight's rows are. It computes what the
    unfused model with the same adapters computes."""

    def __init__(self, base: nn.Linear, layout: FusedLayout, parts: list[str], rank: int, scaling: float, dropout):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.layout = layout
        device, dtype = base.weight.device, base.weight.dtype
        rows = {p: layout.groups * n for p, n in zip(layout.parts, layout.sizes)}
        self.lora_A = nn.ModuleDict(
            {p: nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype) for p in parts}
        )
        self.lora_B = nn.ModuleDict(
            {p: nn.Linear(rank, rows[p], bias=False, device=device, dtype=dtype) for p in parts}
        )
        self.scaling = scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def _fused_rows(self, per_part: dict[str, torch.Tensor], lead: tuple[int, ...], like: torch.Tensor):
        """The parts' tensors ``[..., groups * n_p]`` side by side in the fused layout (zeros for a part without an
        adapter)."""
        g = self.layout.groups
        pieces = [
            per_part[p].reshape(*lead, g, n) if p in per_part else like.new_zeros(*lead, g, n)
            for p, n in zip(self.layout.parts, self.layout.sizes)
        ]
        return torch.cat(pieces, dim=-1).reshape(*lead, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lora_dropout(x)
        delta = {p: self.lora_B[p](self.lora_A[p](h)) for p in self.lora_A}
        return base_linear(self, x) + self._fused_rows(delta, x.shape[:-1], x) * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        delta = {p: (self.lora_B[p].weight.float() @ self.lora_A[p].weight.float()).t() for p in self.lora_A}
        w = dense_weight(self)
        fused = self._fused_rows(delta, (self.in_features,), w).t()
        return (w + self.scaling * fused).to(next(self.lora_A.parameters()).dtype)

    def part_adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{part: (A, B)}`` of the adapted parts."""
        return {p: (self.lora_A[p].weight, self.lora_B[p].weight) for p in self.lora_A}


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to an adapter (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def _parts(leaf: str) -> tuple[str, ...]:
    """The names a linear answers to as a target: its own, and a fused projection's parts'."""
    return (leaf, *FUSED_PARTS.get(leaf, ()))


def target_linears(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Linear, list[str]]]:
    """``(name, linear, parts)`` of every plain ``nn.Linear`` of ``model`` whose last name component, or one of whose
    fused parts (``parts``), is in ``targets``; ConfigError naming a target that matches nothing."""
    found = []
    for n, m in model.named_modules():
        if type(m) is nn.Linear:
            leaf = n.rsplit(".", 1)[-1]
            hit = [p for p in _parts(leaf) if p in targets]
            if hit:
                found.append((n, m, [p for p in FUSED_PARTS.get(leaf, ()) if p in targets or leaf in targets]))
    matched = {p for n, _, parts in found for p in (n.rsplit(".", 1)[-1], *parts)}
    missing = [t for t in targets if t not in matched]
    if missing:
        names = sorted(
            {p for n, m in model.named_modules() if type(m) is nn.Linear for p in _parts(n.rsplit(".", 1)[-1])}
        )
        raise ConfigError(
            f"train.lora_targets names {missing[0]!r}, which is no linear of this model; choose from {names}"
        )
    return found


def check_lora(model: nn.Module, settings: LoRASettings) -> list[tuple[str, nn.Linear]]:
    """The target linears of ``model`` (which may live on the meta device); ConfigError for settings that cannot
    apply to it: a target that names no linear, a rank above a target weight's smaller dimension."""
    settings.check()
    found = target_linears(model, settings.targets)
    cfg = getattr(model, "cfg", None)
    for name, lin, parts in found:
        rows = [lin.out_features]
        if parts:
            layout = layout_of(cfg, name + ".weight")
            rows = [layout.groups * layout.sizes[layout.parts.index(p)] for p in parts]
        for out in rows:
            if settings.rank > min(lin.in_features, out):
                raise ConfigError(
                    f"train.lora_rank={settings.rank} is larger than {name}'s weight [{out}, {lin.in_features}] "
                    f"allows; use at most {min(lin.in_features, out)}"
                )
    return found


def apply_lora(model: nn.Module, settings: LoRASettings) -> list[str]:
    """Freezes every parameter of ``model`` and swaps each target linear for a :class:`LoRALinear` (in place);
    returns the adapted modules' names (:func:`check_lora` refuses what cannot apply)."""
    found = check_lora(model, settings)
    for name, lin, parts in found:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        args = (settings.rank, settings.scaling, settings.dropout)
        if parts:
            adapted = FusedLoRALinear(lin, layout_of(model.cfg, name + ".weight"), parts, *args)
        else:
            adapted = LoRALinear(lin, *args)
        if settings.base == "int8":  # the frozen base weight as per-row int8 codes and scales
            hold_int8(adapted)
        setattr(parent, leaf, adapted)
    freeze_base(model)
    return [n for n, _, _ in found]


def part_name(name: str) -> str:
    """The name an adapter parameter has in an unfused model: a fused projection's part adapter
    ``...qkv_proj.lora_A.q_proj.weight`` is ``...q_proj.lora_A.weight``; others are their own."""
    for module, parts in FUSED_PARTS.items():
        for part in parts:
            for ab in ("lora_A", "lora_B"):
                fused = f"{module}.{ab}.{part}."
                if fused in name:
                    return name.replace(fused, f"{part}.{ab}.", 1)
    return name


def adapter_initial_value(name: str, shape: tuple[int, ...], seed: int, param_seed) -> torch.Tensor:
    """The starting value of adapter parameter ``name`` (module doc): ``lora_A`` uniform in ``+-1/sqrt(in)`` from
    the generator ``param_seed(seed, part_name(name))`` seeds (so fused and unfused projections start alike),
    ``lora_B`` zero."""
    if ".lora_B." in name or name.startswith("lora_B."):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(param_seed(seed, part_name(name)))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def freeze_base(model: nn.Module) -> None:
    """Freezes every parameter of ``model`` but the adapters'."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters of ``model`` by name."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Folds every adapter into its base weight (``W <- W + s B A``) and puts plain ``nn.Linear`` modules back, in
    place; the model then computes what it computed with the adapters (dropout aside)."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (LoRALinear, FusedLoRALinear)):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            lin.weight = nn.Parameter(mod.merged_weight(), requires_grad=False)
            lin.bias = mod.bias
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, lin)
    return model
