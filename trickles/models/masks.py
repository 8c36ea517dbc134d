"""Attention masks of left-padded and paged batches (inference), and attention over keys stored head-major.

* :func:`padded_attention_mask`: a left-padded batch (:mod:`trickles.infer.decode`): causal over cache slots, and no
  real query sees a padding slot; a padding query sees itself, so its row stays finite.
* :func:`layer_window`: a layer's sliding window (``model.sliding_window`` where ``model.window_layers`` says so).
* :func:`window_mask`: a sliding window over positions: query ``q`` sees key ``k`` iff ``q - window < k <= q``.
* :func:`attend_head_major`: SDPA over keys and values that a paged cache (:mod:`trickles.infer.paged`) gathered into
  one ``[H_kv, B, S, D]`` buffer and hands over as its ``[B, H_kv, S, D]`` view.
* :func:`capped_attention`: soft-capped scores (``model.attn_softcap``, Gemma 2), which SDPA cannot take: the
  explicit math path, operation for operation transformers' eager attention -- ``s = (q k^T) scale``,
  ``s = cap tanh(s / cap)``, masked, softmax in fp32 cast back to ``q``'s type, dropout, ``p v``. The ``rep`` query
  heads of a key/value head are ``rep T`` rows of it (no copy of the keys or values), keys stored head-major are
  attended in that order. Autograd keeps, per layer, the tanh output (``p`` bytes a score), the fp32 probabilities
  and, below fp32, their cast (``p``): ``8 B a T S`` bytes at any precision, ``a`` query heads, ``S`` keys; beside
  them the grouped copy of the queries, ``p s a h`` (``q`` itself where ``rep = 1``), and the inverted boolean mask
  (``T S`` bytes, ``B T S`` for a per-row one); no log-sum-exp. ``o_proj`` keeps its input as a copy, ``p s a h``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attend_head_major", "capped_attention", "layer_window", "padded_attention_mask", "window_mask"]


def attend_head_major(q, k, v, mask, p: float, scale: float | None = None) -> torch.Tensor:
    """SDPA over keys and values ``[B, H_kv, S, D]`` stored as ``[H_kv, B, S, D]``: heads lead, so no copy of them is
    made; a key/value head's ``rep`` query heads are ``rep * T`` query rows of it, ``mask [B, 1, T, S]``; ``scale``:
    of the scores (none: ``1/sqrt(D)``)."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    rep = h // hk
    grouped = q.reshape(b, hk, rep * t, d).transpose(0, 1)
    m = (mask.repeat(1, 1, rep, 1) if rep > 1 else mask).transpose(0, 1)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    out = F.scaled_dot_product_attention(grouped, kt, vt, attn_mask=m, dropout_p=p, scale=scale)
    return out.transpose(0, 1).reshape(b, h, t, d)


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    softcap: float,
    p: float = 0.0,
) -> torch.Tensor:
    """Attention with soft-capped scores (module docstring): ``q [B, H, T, D]``, ``k, v [B, H_kv, S, D]`` (stored
    head-major or not), boolean ``mask`` broadcastable to ``[B, 1, T, S]`` (True: may attend; every row sees a key)
    -> ``[B, H, T, D]``. ``scale`` none: ``1/sqrt(D)``."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    rep = h // hk
    hidden = (~mask).expand(b, 1, t, k.shape[2]).unsqueeze(2)  # [B, 1, 1, T, S]: shared by a group's rep heads
    grouped = q.reshape(b, hk, rep * t, d)
    head_major = k.stride(0) < k.stride(1)
    if head_major:  # heads lead in storage: attend as [H_kv, B, ...]
        grouped, k, v, hidden = (x.transpose(0, 1) for x in (grouped, k, v, hidden))
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.unflatten(-2, (rep, t)).masked_fill(hidden, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if p:
        probs = F.dropout(probs, p)
    out = torch.matmul(probs.flatten(-3, -2), v)
    return out.transpose(0, 1).reshape(b, h, t, d) if head_major else out.view(b, h, t, d)


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


def window_mask(start: int, t_q: int, t_k: int, window: int | None, device) -> torch.Tensor:
    """``[t_q, t_k]`` boolean: query at position ``start + i`` sees key at position ``j`` iff
    ``start + i - window < j <= start + i`` (causal, and the last ``window`` positions, itself included: the mask of
    transformers' ``sliding_window_overlay``; ``window`` none: causal only). Over left-padded cache slots it is the
    same band, as slots and positions differ by one shift per row."""
    keys = torch.arange(t_k, device=device)[None, :]
    queries = torch.arange(start, start + t_q, device=device)[:, None]
    causal = keys <= queries
    return causal if window is None else causal & (keys > queries - window)
