"""Attention masks of left-padded and paged batches (inference), and attention over keys stored head-major.

* :func:`padded_attention_mask`: a left-padded batch (:mod:`trickles.infer.decode`): causal over cache slots, and no
  real query sees a padding slot; a padding query sees itself, so its row stays finite.
* :func:`layer_window`: a layer's sliding window (``model.sliding_window`` where ``model.window_layers`` says so).
* :func:`window_mask`: a sliding window over positions: query ``q`` sees key ``k`` iff ``q - window < k <= q``.
* :func:`attend_head_major`: SDPA over keys and values that a paged cache (:mod:`trickles.infer.paged`) gathered into
  one ``[H_kv, B, S, D]`` buffer and hands over as its ``[B, H_kv, S, D]`` view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attend_head_major", "layer_window", "padded_attention_mask", "window_mask"]


def attend_head_major(q, k, v, mask, p: float) -> torch.Tensor:
    """SDPA over keys and values ``[B, H_kv, S, D]`` stored as ``[H_kv, B, S, D]``: heads lead, so no copy of them is
    made; a key/value head's ``rep`` query heads are ``rep * T`` query rows of it, ``mask [B, 1, T, S]``."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    rep = h // hk
    grouped = q.reshape(b, hk, rep * t, d).transpose(0, 1)
    m = (mask.repeat(1, 1, rep, 1) if rep > 1 else mask).transpose(0, 1)
    out = F.scaled_dot_product_attention(grouped, k.transpose(0, 1), v.transpose(0, 1), attn_mask=m, dropout_p=p)
    return out.transpose(0, 1).reshape(b, h, t, d)


def padded_attention_mask(pad_mask: torch.Tensor, start: int, t_q: int, t_k: int) -> torch.Tensor:
    """``[B, 1, t_q, t_k]`` boolean attention mask for queries at cache slots ``start..start+t_q`` of a left-padded
    batch: causal over slots, and no real query sees a padding slot (``pad_mask [B, >= t_k]``, True: real).
    A padding query sees itself only, so its (unused) row stays finite and never turns later layers' keys into NaN."""
    slots = torch.arange(t_k, device=pad_mask.device)
    qslots = torch.arange(start, start + t_q, device=pad_mask.device)[:, None]
    causal = slots[None, :] <= qslots
    return (causal & pad_mask[:, None, None, :t_k]) | (slots[None, :] == qslots)


def layer_window(cfg, layer: int) -> int | None:
    """The sliding window of layer ``layer`` of model config ``cfg`` (None: full causal attention)."""
    return None if cfg.window_layers is not None and not cfg.window_layers[layer] else cfg.sliding_window


def window_mask(start: int, t_q: int, t_k: int, window: int, device) -> torch.Tensor:
    """``[t_q, t_k]`` boolean: query at position ``start + i`` sees key at position ``j`` iff
    ``start + i - window < j <= start + i`` (causal, and the last ``window`` positions, itself included: the mask of
    transformers' ``sliding_window_overlay``). Over left-padded cache slots it is the same band, as slots and
    positions differ by one shift per row."""
    keys = torch.arange(t_k, device=device)[None, :]
    queries = torch.arange(start, start + t_q, device=device)[:, None]
    return (keys <= queries) & (keys > queries - window)
