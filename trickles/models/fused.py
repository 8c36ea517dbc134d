"""Fused projections: one linear for queries, keys and values, one for the gate and up projections.

With ``model.fused_proj`` a block computes ``q, k, v`` with one matmul ``x W_qkv^T`` and the gated MLP's
``gate, up`` with one ``x W_gu^T`` (fewer, larger matmuls; in backward one input-gradient matmul instead of
three or two, and no sum of their results). The fused weight's rows are the parts' rows **interleaved by
group**, so that any tensor-parallel split of the rows is a contiguous block that holds whole groups:

* ``attn.qkv_proj`` (``G = n_kv_heads`` groups, each ``rep = n_heads / G`` query heads, then that group's key
  head, then its value head, ``D`` rows per head): rows ``[g (rep + 2) D, (g + 1)(rep + 2) D)`` are
  ``q_proj`` rows ``[g rep D, (g + 1) rep D)``, ``k_proj`` rows ``[g D, (g + 1) D)``, ``v_proj`` rows likewise
  (Megatron-LM's layout). A tensor-parallel rank holding ``G / tp`` groups holds exactly its query heads and
  the key/value heads they use.
* ``mlp.gate_up_proj`` (``G = ffn`` groups of one ``gate_proj`` row and one ``up_proj`` row): the output
  ``[..., 2 f]`` read as ``[..., f, 2]`` gives ``gate = [..., 0]``, ``up = [..., 1]``; a split over ``tp``
  keeps matching gate and up channels together for any ``tp`` dividing ``f``.

A :class:`FusedLayout` says how to cut a fused tensor into its parts along dim 0 and back. The parts keep
their names everywhere outside the model: initialization computes each part's value by its own name (so a
fused model starts from the same weights as an unfused one), checkpoints show the parts' names
(:class:`~trickles.train.pieces.PieceReader`), Hugging Face import and export map through
:func:`split_state` / :func:`fuse_state`. ``split_heads`` and :func:`~trickles.kernels.activations.swiglu_packed`
take the fused outputs apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig

#: fused module -> its parts, in row order within a group
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class FusedLayout:
    """Dim 0 of a fused tensor: ``groups`` repeats of each part's ``sizes[i]`` rows, side by side."""

    module: str  # the fused module's name (``qkv_proj``)
    parts: tuple[str, ...]  # the parts' module names, in row order (``q_proj, k_proj, v_proj``)
    sizes: tuple[int, ...]  # rows of each part per group
    groups: int

    @property
    def per_group(self) -> int:
        return sum(self.sizes)

    def part_key(self, key: str, i: int) -> str:
        """The name ``key`` (a fused tensor's, or a state key beginning with it) has for part ``i``."""
        return key.replace(f".{self.module}.", f".{self.parts[i]}.", 1)

    def part_keys(self, key: str) -> list[str]:
        return [self.part_key(key, i) for i in range(len(self.parts))]

    def fuse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The fused tensor of whole parts (each ``[groups * sizes[i], ...]``)."""
        rest = parts[0].shape[1:]
        return torch.cat([p.reshape(self.groups, n, *rest) for p, n in zip(parts, self.sizes)], dim=1).reshape(
            -1, *rest
        )

    def split(self, fused: torch.Tensor) -> list[torch.Tensor]:
        """The whole parts of a fused tensor (copies)."""
        return self.split_rows(fused)

    def split_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each part's rows in a run of whole groups' rows of a fused tensor (every group is laid out alike)."""
        rest = rows.shape[1:]
        grouped = rows.reshape(-1, self.per_group, *rest)
        return [g.reshape(-1, *rest) for g in grouped.split(list(self.sizes), dim=1)]

    def to_meta(self) -> dict:
        return {"module": self.module, "parts": list(self.parts), "sizes": list(self.sizes), "groups": self.groups}

    @classmethod
    def from_meta(cls, meta: dict) -> FusedLayout:
        return cls(meta["module"], tuple(meta["parts"]), tuple(meta["sizes"]), int(meta["groups"]))


def layout_of(cfg: ModelConfig, name: str) -> FusedLayout | None:
    """The layout of parameter ``name`` of a model of ``cfg`` (None: not fused). Only the fused weight and bias
    themselves are: a module inside a fused projection (an adapter's ``qkv_proj.lora_A...``) has its own shape."""
    if name.rsplit(".", 1)[0].rsplit(".", 1)[-1] not in FUSED_PARTS:
        return None
    if ".attn.qkv_proj." in name:
        rep = cfg.n_heads // cfg.kv_heads
        d = cfg.head_dim
        return FusedLayout("qkv_proj", FUSED_PARTS["qkv_proj"], (rep * d, d, d), cfg.kv_heads)
    if ".mlp.gate_up_proj." in name:
        return FusedLayout("gate_up_proj", FUSED_PARTS["gate_up_proj"], (1, 1), cfg.ffn_dim)
    return None


def tag(model: nn.Module, cfg: ModelConfig) -> None:
    """Marks each fused parameter of ``model`` with its layout (``param.fused_layout``), which checkpoints read.

    Called when the model is built, after ``to_empty`` (new Parameter objects) and after a parallel plan
    swapped modules."""
    for name, p in model.named_parameters():
        layout = layout_of(cfg, name)
        if layout is not None:
            p.fused_layout = layout


def fused_name(cfg: ModelConfig, name: str) -> tuple[str, int] | None:
    """For a part's name (``layers.0.attn.k_proj.weight``) in a model of ``cfg``: the fused tensor's name and the
    part's index (None: the model keeps that tensor as it is)."""
    if not cfg.fuses_projections:
        return None
    for module, parts in FUSED_PARTS.items():
        if module == "gate_up_proj" and cfg.flavor != "llama":
            continue
        owner = ".attn." if module == "qkv_proj" else ".mlp."
        for i, part in enumerate(parts):
            if f"{owner}{part}." in name:
                return name.replace(f"{owner}{part}.", f"{owner}{module}.", 1), i
    return None


def split_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each fused tensor replaced by its parts (the names an unfused model has)."""
    out = {}
    for name, t in state.items():
        layout = layout_of(cfg, name)
        if layout is None:
            out[name] = t
        else:
            out.update(zip(layout.part_keys(name), layout.split(t)))
    return out


def fuse_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_state` for a model of ``cfg`` (unchanged when it fuses nothing)."""
    out, groups = {}, {}
    for name, t in state.items():
        hit = fused_name(cfg, name)
        if hit is None:
            out[name] = t
        else:
            groups.setdefault(hit[0], {})[hit[1]] = t
    for name, parts in groups.items():
        layout = layout_of(cfg, name)
        out[name] = layout.fuse([parts[i] for i in range(len(layout.parts))])
    return out


class _SplitHeads(torch.autograd.Function):
    """``qkv [B, T, G (rep + 2) D]`` -> contiguous ``q [B, T, G rep, D]``, ``k, v [B, T, G, D]``; backward puts
    the three gradients back side by side in one buffer (autograd's own view backward would allocate a full
    zero buffer per part and add them)."""

    @staticmethod
    def forward(ctx, qkv, rep: int, head_dim: int):
        b, t, _ = qkv.shape
        x = qkv.view(b, t, -1, rep + 2, head_dim)
        ctx.rep = rep
        q = x[:, :, :, :rep].reshape(b, t, -1, head_dim).clone(memory_format=torch.contiguous_format)
        return q, x[:, :, :, rep].contiguous(), x[:, :, :, rep + 1].contiguous()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        b, t, g, d = dk.shape
        dq = dq.reshape(b, t, g, ctx.rep, d) if dq is not None else dk.new_zeros(b, t, g, ctx.rep, d)
        dk = dk if dk is not None else dq.new_zeros(b, t, g, d)
        dv = dv if dv is not None else dq.new_zeros(b, t, g, d)
        return torch.cat([dq, dk[:, :, :, None], dv[:, :, :, None]], dim=3).reshape(b, t, -1), None, None


def split_heads(qkv: torch.Tensor, rep: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query, key and value heads ``[B, T, heads, D]`` of a fused projection's output (each its own storage,
    so the fused output is freed after the forward as the three separate outputs would be)."""
    return _SplitHeads.apply(qkv, rep, head_dim)
