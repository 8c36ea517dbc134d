"""Multi-head latent attention (DeepSeek-V2/V3's MLA): the attention part of a block with ``model.attention = "mla"``.

With ``H`` heads, per-head query/key sizes ``n = qk_nope_head_dim`` (no position) and ``r = qk_rope_head_dim``
(rotary), value size ``v = v_head_dim`` and latent width ``L = kv_lora_rank``, on ``x [B, T, d]``:

* queries: ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (rank ``q_lora_rank``; without it one ``q_proj``),
  ``[B, T, H, n + r]``, split into ``q_nope`` and ``q_rot``;
* keys and values: ``kv_a_proj_with_mqa(x) [B, T, L + r]`` splits into the latent ``c = kv_a_layernorm(...)
  [B, T, L]`` and one rotary key ``k_rot [B, T, r]`` shared by every head; ``kv_b_proj(c)`` gives each head's
  ``k_nope [n]`` and value ``[v]``, so ``k = [k_nope, k_rot]`` per head;
* rotary turns ``q_rot`` and ``k_rot`` only (tables of size ``r``; with ``model.rope_interleave`` their dimensions,
  stored as pairs ``(x0, x1), (x2, x3), ...``, are first put in rotate-half order, evens then odds, as DeepSeek's
  checkpoints need: the same rotation, its output in that order);
* the scores' scale is ``(n + r) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn with
  ``model.rope_mscale_all_dim`` set (``mscale = 0.1 m ln(factor) + 1``, 1 for ``factor <= 1``), as DeepSeek's;
  the heads' outputs ``[B, T, H v]`` go through ``o_proj``. The two latent norms have DeepSeek's fixed epsilon 1e-6.

Training and a prefill run this uncompressed: keys and values up-projected, causal SDPA. A decoding cache
(:class:`~trickles.models.latent_cache.LatentCache`) keeps only ``[c, k_rot]``, ``L + r`` values a token per layer,
and a step of at most :attr:`LatentAttention.absorb_queries` new tokens attends in the latent space: with
``kv_b_proj``'s weight ``[H, n + v, L]`` split into ``W_UK [H, n, L]`` and ``W_UV [H, v, L]``,
``q_nope k_nope^T = (q_nope W_UK) c^T``, so the query ``[q_nope W_UK, q_rot]`` attends to the cached rows
``[c, k_rot]`` (one key head for all) with values ``c``, and each head's result times ``W_UV^T`` is its output.
Longer steps with a cache up-project the cached latent instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.norms import RMSNorm
from ..kernels.rotary import apply_rope
from .config import ModelConfig
from .latent_cache import LatentCache
from .masks import padded_attention_mask, window_mask
from .rope import RopeScaling, _yarn_mscale

#: the latent norms' epsilon (DeepSeek's, not ``model.norm_eps``)
LATENT_NORM_EPS = 1e-6


def mla_scale(cfg: ModelConfig) -> float:
    """The scores' scale of a latent attention layer of ``cfg`` (module docstring)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = RopeScaling.of(cfg)
    if s.type == "yarn" and s.mscale_all_dim:
        scale *= _yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(x0, x1), (x2, x3), ...`` along the last dimension in rotate-half order: evens, odds."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention (module docstring), its parameters named as transformers' ``DeepseekV3Attention``:
    ``q_a_proj: d -> q_lora_rank`` (bias where ``cfg.bias("qkv")``), ``q_a_layernorm``, ``q_b_proj: q_lora_rank ->
    H (n + r)`` (or ``q_proj: d -> H (n + r)``), ``kv_a_proj_with_mqa: d -> L + r`` (bias where ``cfg.bias("qkv")``),
    ``kv_a_layernorm``, ``kv_b_proj: L -> H (n + v)``, ``o_proj: H v -> d`` (bias where ``cfg.bias("o")``).
    The head count is read from ``kv_b_proj``'s shape at run time."""

    #: at most this many new queries over a cache take the absorbed path (more: the cached latent is up-projected)
    absorb_queries: int = 1

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale: float = mla_scale(cfg)
        # what code reading an attention part's options finds (no window, cap, or local rotary tables here)
        self.window = self.softcap = None
        self.rope_part = 0
        self.interleave = cfg.rope_interleave
        self.dropout = cfg.dropout
        bias, qk = cfg.bias("qkv"), self.nope + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, cfg.kernels, cfg.norm_unit_offset)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.d_model, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, cfg.kernels, cfg.norm_unit_offset)
        self.kv_b_proj = nn.Linear(self.rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.v_dim, cfg.d_model, bias=cfg.bias("o"))
        self.resid_drop = nn.Dropout(cfg.dropout)

    @property
    def heads(self) -> int:
        return self.kv_b_proj.out_features // (self.nope + self.v_dim)

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_nope [B, T, H, n]`` and the not yet rotated ``q_rot [B, T, H, r]`` (rotate-half order) of ``x``."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(*x.shape[:2], -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], -1)
        return q_nope, deinterleave(q_rot) if self.interleave else q_rot

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed latent ``c [B, T, L]`` and the not yet rotated shared key ``k_rot [B, T, 1, r]`` of ``x``."""
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], -1)
        k_rot = k_rot[:, :, None]
        return self.kv_a_layernorm(c), deinterleave(k_rot) if self.interleave else k_rot

    def expand(self, c: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, H, S, n + r]`` and values ``[B, H, S, v]`` of the latent ``c [B, S, L]`` and the rotated shared
        key ``k_rot [B, S, 1, r]``: the uncompressed path."""
        b, s, _ = c.shape
        k_nope, v = self.kv_b_proj(c).view(b, s, -1, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, mask) -> torch.Tensor:
        """Attention in the latent space (module docstring): ``q_nope [B, T, H, n]``, rotated ``q_rot [B, T, H, r]``,
        cached ``rows [B, S, L + r]``, ``mask [B or 1, 1, T, S]`` (None: every row visible) -> ``[B, T, H v]``."""
        h = q_nope.shape[2]
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        query = torch.cat([torch.einsum("bthn,hnl->bhtl", q_nope, w_uk), q_rot.transpose(1, 2)], dim=-1)
        key = rows[:, None].expand(-1, h, -1, -1)
        out = self._sdpa(query, key, key[..., : self.rank], mask)  # [B, H, T, L]
        return torch.einsum("bhtl,hvl->bthv", out, w_uv).flatten(2)

    def core(self, q, k, v, pad_mask=None, documents=None) -> torch.Tensor:
        """The uncompressed attention of training and a prefill without a cache: ``q, k [B, H, T, n + r]``,
        ``v [B, H, T, v]`` -> ``[B, T, H v]``. Tensor parallelism runs it with its rank's random stream (the heads'
        dropout); context parallelism swaps :meth:`_attend`, the causal case, for its ring or all-to-all (and
        packed documents' mask for its own)."""
        if documents is not None:
            out = documents.attend(q, k, v, self.dropout if self.training else 0.0, scale=self.scale)
        elif pad_mask is not None:
            out = self._sdpa(q, k, v, padded_attention_mask(pad_mask, 0, q.shape[2], k.shape[2]))
        else:
            out = self._attend(q, k, v, None)
        return out.transpose(1, 2).flatten(2)

    def _attend(self, q, k, v, causal_offset: int | None) -> torch.Tensor:
        """Causal attention of queries and keys starting together (``causal_offset`` None, all that is asked)."""
        return self._sdpa(q, k, v, None, causal=True)

    def _sdpa(self, q, k, v, mask, causal: bool = False) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.scale)

    def forward(self, x, rope=None, cache: LatentCache | None = None, start: int = 0, pad_mask=None, documents=None):
        """As :meth:`~trickles.models.attention.Attention.forward`, with a
        :class:`~trickles.models.latent_cache.LatentCache` for a cache. A paged cache's 4-D mask is not built."""
        t = x.shape[1]
        q_nope, q_rot = self.queries(x)
        c, k_rot = self.latent(x)
        if rope is not None:
            cos, sin = rope
            q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        if cache is None:
            k, v = self.expand(c, k_rot)
            out = self.core(torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2), k, v, pad_mask, documents)
        elif pad_mask is not None and pad_mask.dim() == 4:  # a paged cache: its rows, and its mask for this layer
            rows = cache.update_latent(self.layer_id, start, torch.cat([c, k_rot[:, :, 0]], dim=-1))
            out = self._cached(q_nope, q_rot, rows, cache.mask(self.layer_id))
        else:
            rows = cache.update(self.layer_id, start, torch.cat([c, k_rot[:, :, 0]], dim=-1))
            s = rows.shape[1]
            if pad_mask is not None:
                mask = padded_attention_mask(pad_mask, start, t, s)
            else:
                mask = None if t == 1 else window_mask(start, t, s, None, x.device)[None, None]
            out = self._cached(q_nope, q_rot, rows, mask)
        return self.resid_drop(self.o_proj(out))

    def _cached(self, q_nope, q_rot, rows: torch.Tensor, mask) -> torch.Tensor:
        """Attention of new queries over cached ``rows [B, S, L + r]``: absorbed for a step of at most
        :attr:`absorb_queries` queries, else over the up-projected latent; ``[B, T, H v]``."""
        if q_nope.shape[1] <= self.absorb_queries:
            return self.absorbed(q_nope, q_rot, rows, mask)
        k, v = self.expand(rows[..., : self.rank], rows[:, :, None, self.rank :])
        q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)
        return self._sdpa(q, k, v, mask).transpose(1, 2).flatten(2)
