"""Soft-capping of logits (Gemma 2's final and attention logits): ``cap * tanh(z / cap)``, and its gradient.

With ``t = tanh(z / cap)`` the capped logit is ``c = cap t`` and ``dz = dc (1 - t^2)``: backward needs ``t`` only (what
autograd's ``tanh`` keeps). :func:`softcap` is the differentiable form (the unfused output head, the tensor-parallel
logit shards); the fused loss (:mod:`trickles.kernels.cross_entropy`) caps a chunk's logits with :func:`cap_chunk`,
works out the gradient of the capped ones, and turns it into the raw logits' with :func:`uncap_grad`, all in place but
for one chunk of ``t`` in the compute type.
"""

from __future__ import annotations

import torch


def softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(z / cap)`` in ``z``'s type, operation for operation transformers' (``z`` itself where ``cap`` is
    None)."""
    return z if cap is None else torch.tanh(z / cap) * cap


def cap_chunk(z: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, cap t)`` with ``t = tanh(z / cap)`` computed in ``z``'s storage (``z`` is consumed) and the capped logits
    a new tensor: what :func:`softcap` computes, with ``t`` kept for :func:`uncap_grad`."""
    t = z.div_(cap).tanh_()
    return t, t * cap


def uncap_grad(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``g (1 - t^2)`` into ``g``: a capped logit's gradient made the raw logit's; ``t`` is consumed (its storage
    reused where it has ``g``'s type)."""
    t = t if t.dtype == g.dtype else t.to(g.dtype)
    return g.mul_(t.square_().neg_().add_(1.0))
