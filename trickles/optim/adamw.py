"""AdamW with the usual exclusions from weight decay.

Matrices of linear layers decay; norm weights, biases and embedding tables do not (they are
one-dimensional or lookup tables, where decay only fights the signal). A tied output
projection is the embedding table and is therefore not decayed either.
"""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ``decay`` (2-D linear weights) and ``no_decay`` (norms, biases, embeddings)."""
    decay, no_decay, seen = [], [], set()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() < 2 or id(p) in embeddings:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; the fused kernel on CUDA, the multi-tensor one elsewhere."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    kwargs = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **kwargs)
