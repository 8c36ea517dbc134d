"""The router of a mixture-of-experts block: scores, the choice of each token's experts and their weights, and the
routing bias that auxiliary-loss-free balancing moves.

A token ``x`` (``[d]``) gets the logits ``l = W_r x`` (``W_r: [E, d]``, fp32 whatever the precision policy) and the
scores ``s = softmax(l)`` (``model.moe_router_score=softmax``: Mixtral, Qwen) or ``s_e = sigmoid(l_e)``
(``sigmoid``: DeepSeek-V3). Experts are chosen on the biased scores ``c = s + b`` (``b``: the routing bias,
``e_score_correction_bias [E]``; zero without one):

* without groups, the ``k`` experts of highest ``c``;
* group-limited (``model.moe_groups = G > 1``, ``model.moe_topk_groups = g``): the ``E`` experts form ``G`` groups of
  ``E / G`` consecutive ones; a group's score is the sum of its two highest ``c``; the token may route only into its
  ``g`` best groups, and takes the ``k`` experts of highest ``c`` among theirs (DeepSeek-V3's ``n_group``,
  ``topk_group``).

The weights come from the unbiased scores, ``w_j = s_{e_j}``, divided by their sum when ``model.moe_norm_topk``
(default: when ``k > 1``, as Mixtral; ``k = 1`` keeps the raw score, as Switch, so the router still gets a gradient),
then multiplied by ``model.moe_routed_scale`` (``routed_scaling_factor``). The bias only chooses: it never weights.

**Auxiliary-loss-free balancing** (``model.moe_bias_rate = u > 0``, DeepSeek-V3 section 2.1.2). Each router counts
the assignments its training forwards route to each expert (not a forward recomputed in backward, not evaluation);
after each optimizer step :func:`update_router_bias` sums those loads over every rank that routed tokens of the same
model part (the data-parallel and expert-parallel replicas, the context-parallel and sequence-parallel shards) and
moves ``b_e += u sign(mean_e load - load_e)``: an overloaded expert's bias falls, an idle one's rises. Every rank
applies the same update to the same bias, so all hold the same bias. The bias is a persistent buffer (fp32): it is
saved in checkpoints and reshards like any replicated tensor. A sigmoid router always carries one (DeepSeek-V3's
checkpoints hold it), fixed when ``u = 0``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

if TYPE_CHECKING:
    from ..comm import GroupComm


def graph_task() -> int:
    """-1 outside backward (a recomputed forward runs inside one)."""
    probe = getattr(torch._C, "_current_graph_task_id", None)
    return probe() if probe is not None else -1


def has_bias(cfg: ModelConfig) -> bool:
    """Whether the routers carry ``e_score_correction_bias``: a sigmoid score or bias balancing."""
    return cfg.moe_router_score == "sigmoid" or cfg.moe_bias_rate > 0


class Router(nn.Module):
    """``weight [E, d]`` and, when :func:`has_bias`, the buffer ``e_score_correction_bias [E]`` (fp32); logits in fp32
    (or the input's type when wider), never autocast. :meth:`choose` picks the experts (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.moe_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.d_model))
        self.k, self.score = cfg.moe_top_k, cfg.moe_router_score
        self.groups = cfg.moe_groups
        self.topk_groups = cfg.moe_groups if cfg.moe_topk_groups is None else cfg.moe_topk_groups
        self.norm = cfg.moe_top_k > 1 if cfg.moe_norm_topk is None else cfg.moe_norm_topk
        self.scale = cfg.moe_routed_scale
        self.rate = cfg.moe_bias_rate
        self.routed: torch.Tensor | None = None  # assignments per expert since the last update (int64 [E])
        if has_bias(cfg):
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def reset_bias(self) -> None:
        """Zeroes the bias (after ``to_empty``; a checkpoint's bias is loaded afterwards)."""
        if self.e_score_correction_bias is not None:
            with torch.no_grad():
                self.e_score_correction_bias.zero_()
        self.routed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logits [..., E]`` (fp32) -> ``probs [..., E]`` (the scores normalized to sum 1 over the experts, for the
        load-balancing loss), ``experts [..., k]`` (int64), ``weights [..., k]`` (fp32, differentiable)."""
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.to(choice.dtype)
        if self.topk_groups < self.groups:
            grouped = choice.unflatten(-1, (self.groups, -1))
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(self.k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        probs = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        if self.training and self.rate > 0 and graph_task() == -1:
            counts = torch.bincount(experts.flatten(), minlength=scores.shape[-1])
            self.routed = counts if self.routed is None else self.routed + counts
        return probs, experts, weights


def balanced_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` that balance by bias (``model.moe_bias_rate > 0``), in module order."""
    return [m for m in model.modules() if isinstance(m, Router) and m.rate > 0]


@torch.no_grad()
def update_router_bias(model: nn.Module, comms: Iterable[GroupComm | None] | None) -> None:
    """After an optimizer step: every balancing router's loads since the last call summed over ``comms`` (in order;
    the ranks that routed other tokens of the same layers), then ``bias += rate x sign(mean load - load)``. ``comms``
    None (a skipped step): the loads are forgotten, the bias kept. Every rank of ``comms`` must call it."""
    routers = balanced_routers(model)
    if not routers:
        return
    if comms is not None:
        bias = routers[0].e_score_correction_bias
        zero = torch.zeros_like(bias, dtype=torch.float64)
        loads = torch.stack([zero if r.routed is None else r.routed.to(zero) for r in routers])
        for comm in comms:
            if comm is not None:
                loads = comm.all_reduce(loads)
        for r, load in zip(routers, loads):
            step = torch.sign(load.mean() - load) * r.rate
            r.e_score_correction_bias.add_(step.to(r.e_score_correction_bias.dtype))
    for r in routers:
        r.routed = None
