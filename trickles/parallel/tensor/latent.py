"""1-D tensor parallelism of multi-head latent attention (:mod:`trickles.models.mla`): heads split, compressions kept.

With ``H`` heads over ``tp`` ranks, rank ``i`` holds heads ``[i H / tp, (i + 1) H / tp)``:

* ``q_b_proj`` (or ``q_proj`` without a query rank) ``[H (n + r), q_lora_rank]`` and ``kv_b_proj``
  ``[H (n + v), L]`` are column-parallel by heads (a rank's rows are its heads' ``n + r`` / ``n + v`` rows), and
  ``o_proj`` ``[d, H v]`` row-parallel, leaving the region (all-reduce, or reduce-scatter under sequence
  parallelism) as in a multi-head block;
* the compressions ``q_a_proj`` ``[q_lora_rank, d]`` and ``kv_a_proj_with_mqa`` ``[L + r, d]`` and their norms
  ``q_a_layernorm``, ``kv_a_layernorm`` are **replicated**: every rank computes the same latent ``c``, rotary key
  and query latent from the region's input (which entering all-gathered under sequence parallelism, the
  projections keeping only this rank's sequence shard for backward, like the column-parallel ones:
  :meth:`~.layers.TPContext.linear`). A rank's backward reaches them only through its own heads, so their weight
  gradients are partial, summed over the group with the other replicated parameters'; their input gradients
  join the region entry's all-reduce (reduce-scatter) with the column-parallel ones'.

No collective of its own: the region's one all-reduce each way (or all-gather and reduce-scatter) is all, and
the replicated projections add ``(q_lora_rank + L + r) d`` values of gradient to that sum. The decoding cache of a
rank holds the whole latent (every rank needs it for its heads): ``(L + r)`` values a token per layer on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear, TPContext


class ReplicatedLinear(nn.Module):
    """``y = x W^T + b`` whole on every rank, reading the region's input: under sequence parallelism it keeps only
    this rank's shard of that input for backward (:meth:`~.layers.TPContext.linear`). Its parameters carry no
    :class:`~.layers.TPSpec` here; the plan marks them replicated with a partial gradient."""

    def __init__(self, linear: nn.Linear, ctx: TPContext, regather: bool = True, device=None):
        super().__init__()
        self.ctx, self.regather = ctx, regather
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(torch.empty(linear.out_features, linear.in_features, device=device))
        self.bias = nn.Parameter(torch.empty(linear.out_features, device=device)) if linear.bias is not None else None

    def forward(self, x):
        return self.ctx.linear(x, self.weight, self.bias, self.regather)


def split_latent_attention(attn: nn.Module, cfg, ctx: TPContext, regather: bool, device) -> None:
    """Swaps ``attn``'s (a :class:`~trickles.models.mla.LatentAttention`) projections for their tensor-parallel
    forms in place (module docstring); its norms stay, replicated."""
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        attn.q_proj = ColumnParallelLinear(cfg.d_model, cfg.n_heads * qk, False, ctx, device=device, regather=regather)
    else:
        attn.q_a_proj = ReplicatedLinear(attn.q_a_proj, ctx, regather, device)
        attn.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * qk, False, ctx, device=device)
    attn.kv_a_proj_with_mqa = ReplicatedLinear(attn.kv_a_proj_with_mqa, ctx, regather, device)
    attn.kv_b_proj = ColumnParallelLinear(
        cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + v), False, ctx, device=device
    )
    attn.o_proj = RowParallelLinear(cfg.n_heads * v, cfg.d_model, cfg.bias("o"), ctx, device=device)
