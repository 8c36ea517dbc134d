"""Activation recomputation, applied to a built model from the outside.

* ``full``: each transformer block's forward runs under non-reentrant
  ``torch.utils.checkpoint``; only the block's input is kept for backward, and the whole block
  is recomputed from it when its gradients are needed (about one extra forward per step).
* ``selective``: only the attention core (scores, softmax, dropout, weighted sum and the
  re-layout of heads, ``Attention.core``) is recomputed. Its inputs ``q, k, v`` are kept
  anyway by the projections' backward, so what is saved is the core's own output and softmax
  statistics (with a non-fused attention: the ``T x T`` probabilities); redoing it is cheap
  next to the matmuls (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models").

Both give bit-identical losses and gradients: the recomputation repeats the same operations,
with the random state of dropout restored. Recomputation only happens when autograd records a
graph; evaluation and generation run the plain forward.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def _recomputed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


def apply_recompute(model, mode: str) -> None:
    """Wraps ``model``'s blocks (full) or attention cores (selective) for recomputation, in place."""
    if mode not in MODES:
        raise ValueError(f"recompute mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return
    for block in model.layers.values():
        if mode == "full":
            block.forward = _recomputed(block.forward)
        else:
            block.attn.core = _recomputed(block.attn.core)
