"""AdamW with the usual exclusions from weight decay.

Matrices of linear layers decay; norm weights, biases and embedding tables do not (they are
one-dimensional or lookup tables, where decay only fights the signal). A tied output
projection is the embedding table and is therefore not decayed either.
"""

from __future__ import annotations

import torch
from torch import nn


def decay_flags(model: nn.Module) -> dict[str, bool]:
    """``{parameter name: decays?}`` for every trainable parameter (shared ones under their first name)."""
    # lookup tables: nn.Embedding, or a parallel layer that declares itself one (``is_embedding``)
    embeddings = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) or getattr(m, "is_embedding", False)
    }
    flags = {}
    for name, p in model.named_parameters():  # (a shared parameter comes once, under its first name)
        if p.requires_grad:
            flags[name] = p.dim() >= 2 and id(p) not in embeddings
    return flags


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ``decay`` (2-D linear weights) and ``no_decay`` (norms, biases, embeddings)."""
    flags = decay_flags(model)
    params = dict(model.named_parameters())
    return [
        {"params": [params[n] for n, d in flags.items() if d], "weight_decay": weight_decay, "name": "decay"},
        {"params": [params[n] for n, d in flags.items() if not d], "weight_decay": 0.0, "name": "no_decay"},
    ]


def adamw_kwargs(device: torch.device) -> dict:
    """The fastest torch AdamW implementation for ``device``: fused on CUDA, multi-tensor elsewhere."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def build_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """torch AdamW over :func:`param_groups`."""
    device = next(model.parameters()).device
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **adamw_kwargs(device))
