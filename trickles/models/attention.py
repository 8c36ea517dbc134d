"""Multi-head causal self-attention with grouped-query key/value heads: the attention part of a block.

With ``H`` query heads and ``H_kv`` key/value heads of size ``D`` (``rep = H / H_kv`` query heads share each
key/value head), on ``x [B, T, d]``:

* projections: ``q = x Wq [B, T, H D]``, ``k = x Wk``, ``v = x Wv [B, T, H_kv D]`` (or one fused ``qkv_proj``,
  :mod:`trickles.models.fused`), split into heads; with ``model.qk_norm`` an RMSNorm of ``q`` and of ``k`` (``head``:
  over each head's ``D``, one weight ``[D]`` shared by the heads; ``full``: over the whole projected width ``H D`` /
  ``H_kv D``, weight of that width); then rotary tables, when given, rotate ``q`` and ``k``;
* a KV cache, when given, stores ``k, v`` at positions ``start..start+T`` and returns every cached position;
* rotary tables stacked ``[T, 2 D]`` (``model.rope_local_theta``: global tables, then the sliding-window layers'
  ones) are read at this layer's part, :attr:`Attention.rope_part`;
* the core: ``softmax(q k^T scale + mask) v`` per head (``scale``: :attr:`Attention.scale`, none ``1/sqrt(D)``), through
  ``torch.nn.functional.scaled_dot_product_attention`` (the fused flash / memory-efficient kernels where the device
  has them), causal, or with the left-padding, paged-cache or packed-document mask
  (:mod:`trickles.models.masks`, :mod:`trickles.models.documents`); the heads side by side go through ``o_proj``.
  Soft-capped scores (:attr:`Attention.softcap`) take the explicit math path instead,
  :func:`~trickles.models.masks.capped_attention`, under the same masks.

Key/value heads are shared, not copied ``rep`` times: by SDPA's ``enable_gqa`` for the plain causal mask and for a
single query, and under a padding mask by attending with the ``rep`` query heads of a key/value head as ``rep T``
query rows of it. Only a causal offset over several queries (or torch < 2.5) repeats them.

Head counts are read from the projections' shapes at run time, so a tensor-parallel plan can hand this module a
slice of the heads; context parallelism replaces an instance's ``_attend`` (:mod:`trickles.parallel.context`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.norms import RMSNorm
from ..kernels.rotary import rotary
from . import fused
from .config import ModelConfig
from .documents import DocumentMask
from .kv_cache import KVCache
from .masks import attend_head_major, capped_attention, layer_window, padded_attention_mask, window_mask

# ``enable_gqa`` arrived in torch 2.5; older versions repeat the key/value heads instead.
_SDPA_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


class WidthRMSNorm(RMSNorm):
    """RMSNorm of heads side by side: ``[B, T, h, D]`` normalized over ``h D`` at once, weight ``[h D]`` (OLMo 2's
    q/k norm). Tensor parallelism swaps in :class:`~trickles.parallel.tensor.layers.SplitWidthRMSNorm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped-query key/value heads.

    ``q_proj: d -> H*D``, ``k_proj, v_proj: d -> H_kv*D``, ``o_proj: H*D -> d`` (biases where ``cfg.bias("qkv")``,
    ``cfg.bias("o")``); with ``model.fused_proj`` one
    ``qkv_proj: d -> (H + 2 H_kv) D`` in its place, rows interleaved by key/value group
    (:mod:`trickles.models.fused`). Head counts are read from the projection shapes at run time, so a
    tensor-parallel plan can hand this module a slice of the heads.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        bias = cfg.bias("qkv")
        self.layer_id = layer_id
        self.window = layer_window(cfg, layer_id)  # sliding window of this layer (None: full causal)
        #: the scores' scale (None: 1/sqrt(head_dim)) and soft cap (None: none)
        s = cfg.query_pre_attn_scalar
        self.scale: float | None = None if s is None else s**-0.5
        self.softcap: float | None = cfg.attn_softcap
        #: which rotary tables of stacked ``[T, 2 D]`` ones this layer reads: 0 global, 1 local (sliding window)
        self.rope_part = 1 if cfg.rope_local_theta is not None and self.window is not None else 0
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.kernels = cfg.kernels
        self.rep = cfg.n_heads // cfg.kv_heads  # query heads per key/value head
        self.fused = cfg.fuses_projections
        if self.fused:
            self.qkv_proj = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=bias)
        else:
            self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=bias)
            self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=bias)
            self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias("o"))
        # q/k norms of [B, T, heads, D]: over each head's D (head) or over all heads side by side (full)
        self.q_norm = self.k_norm = None
        norm = {"head": RMSNorm, "full": WidthRMSNorm}.get(cfg.qk_norm)
        if norm is not None:
            width = (cfg.n_heads, cfg.kv_heads) if cfg.qk_norm == "full" else (1, 1)
            self.q_norm, self.k_norm = (
                norm(n * cfg.head_dim, cfg.norm_eps, cfg.kernels, cfg.norm_unit_offset) for n in width
            )
        self.resid_drop = nn.Dropout(cfg.dropout)

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal_offset: int | None,
        pad_mask: torch.Tensor | None = None,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        """Scores, softmax, dropout and the weighted sum: ``q [B, H, T, D]``, ``k, v [B, H_kv, T', D]``
        in, the heads side by side ``[B, T, H*D]`` out (ready for ``o_proj``).

        ``causal_offset`` is the position of the first query (None: queries and keys start
        together, plain causal mask). ``pad_mask [B, >= T']`` (True: a real token) hides left padding
        from every query (see :func:`padded_attention_mask`); a 4-D ``pad_mask [B, 1, T, T']`` is the whole mask
        (True: may attend), as a paged KV cache builds it (:mod:`trickles.infer.paged`), whose keys come stored
        head-major (``k.stride(0) < k.stride(1)``) and are attended in that order. ``documents``: packed
        documents' mask (training only, :mod:`trickles.models.documents`).
        """
        b, _, t_q, _ = q.shape
        if documents is not None:
            # (context parallelism's document masks take the window, scale and cap too: ContextDocumentMask)
            window = {} if self.window is None else {"window": self.window}
            p = self.dropout if self.training else 0.0
            out = documents.attend(q, k, v, p, scale=self.scale, softcap=self.softcap, **window)
            return out.transpose(1, 2).reshape(b, t_q, -1)
        # (context parallelism swaps in a 4-argument _attend)
        extra = {} if pad_mask is None else {"pad_mask": pad_mask}
        return self._attend(q, k, v, causal_offset, **extra).transpose(1, 2).reshape(b, t_q, -1)

    def _attend(self, q, k, v, causal_offset, pad_mask=None):
        p = self.dropout if self.training else 0.0
        rep = q.shape[1] // k.shape[1]
        t_q, start = q.shape[2], causal_offset or 0
        # a window cuts only where some query is at least ``window`` positions past the first key
        window = self.window if self.window is not None and start + t_q > self.window else None
        if self.softcap is not None:  # no SDPA: the math path under the mask
            if pad_mask is not None and pad_mask.dim() == 4:
                mask = pad_mask
            else:
                first = start if causal_offset is not None else k.shape[2] - t_q
                mask = window_mask(first, t_q, k.shape[2], window, q.device)
                if pad_mask is not None:
                    mask = mask & padded_attention_mask(pad_mask, start, t_q, k.shape[2])
            return capped_attention(q, k, v, mask, self.scale, self.softcap, p)
        scale = self.scale
        if pad_mask is not None or window is not None:
            if pad_mask is None:
                mask = window_mask(start, t_q, k.shape[2], window, q.device)[None, None]
            elif pad_mask.dim() == 4:
                mask = pad_mask
            else:
                mask = padded_attention_mask(pad_mask, start, t_q, k.shape[2])
                if window is not None:
                    mask = mask & window_mask(start, t_q, k.shape[2], window, q.device)
            if k.stride(0) < k.stride(1):  # keys stored head-major (a paged cache's gather): attend in that order
                return attend_head_major(q, k, v, mask, p, scale)
            if rep == 1:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
            # The ``rep`` query heads of a key/value head become ``rep * T`` query rows of it (each row attends on its
            # own, so this is exact): no ``rep``-fold copy of the keys and values.
            b, h = q.shape[:2]
            grouped = q.reshape(b, h // rep, rep * t_q, q.shape[-1])
            m = mask.repeat(1, 1, rep, 1)
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=m, dropout_p=p, scale=scale)
            return out.view(b, h, t_q, -1)
        if _SDPA_GQA and (causal_offset is None or t_q == 1):
            # No mask: SDPA shares each key/value head among its ``rep`` query heads itself, so
            # neither k/v copies nor their reduction in backward are materialized.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=causal_offset is None, enable_gqa=rep > 1, scale=scale
            )
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if causal_offset is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scale)
        t_k = k.shape[2]
        if t_q == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scale)
        qpos = torch.arange(causal_offset, causal_offset + t_q, device=q.device)[:, None]
        mask = torch.arange(t_k, device=q.device)[None, :] <= qpos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)

    def forward(
        self,
        x,
        rope=None,
        cache: KVCache | None = None,
        start: int = 0,
        pad_mask: torch.Tensor | None = None,
        documents: DocumentMask | None = None,
    ):
        b, t, _ = x.shape
        if self.fused:
            q, k, v = fused.split_heads(self.qkv_proj(x), self.rep, self.head_dim)
        else:
            q = self.q_proj(x).view(b, t, -1, self.head_dim)
            k = self.k_proj(x).view(b, t, -1, self.head_dim)
            v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope
            if cos.shape[-1] != self.head_dim:  # stacked tables: this layer's part
                part = slice(self.rope_part * self.head_dim, (self.rope_part + 1) * self.head_dim)
                cos, sin = cos[..., part], sin[..., part]
            q, k = rotary(q, k, cos, sin, self.kernels)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        offset = None
        if cache is not None:
            k, v = cache.update(self.layer_id, start, k, v)
            offset = start
            if pad_mask is not None and pad_mask.dim() == 4:  # a paged cache's: this layer's own (its window)
                pad_mask = cache.mask(self.layer_id)
        extra = {} if documents is None else {"documents": documents}
        return self.resid_drop(self.o_proj(self.core(q, k, v, offset, pad_mask, **extra)))
