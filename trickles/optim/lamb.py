"""LAMB: Adam's update rescaled per weight by a trust ratio (You et al., "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", ICLR 2020, Algorithm 2).

For each weight ``w`` (one norm unit, :mod:`~trickles.optim.norms`) with gradient ``g`` at step ``t``::

    m <- b1 m + (1 - b1) g                    v <- b2 v + (1 - b2) g^2
    m^ = m / (1 - b1^t)                       v^ = v / (1 - b2^t)        (bias_correction; else m^ = m, v^ = v)
    u  = m^ / (sqrt(v^) + eps) + wd w         (wd: the group's weight decay, decoupled as in AdamW)
    r  = ||w|| / ||u||, r <- min(r, trust_clip) if trust_clip > 0;  r = 1 where ||w|| or ||u|| is zero
    w <- w - lr r u

``r`` is applied to groups with ``adapt=True`` only; elsewhere ``r = 1`` (Adam with decoupled decay).
trickles adapts exactly the weights that decay (:func:`~trickles.optim.adamw.decay_flags`): the
matrices of linear layers, not norms, biases or embedding tables -- Google's BERT LAMB excludes norms
and biases from both (``exclude_from_layer_adaptation`` defaults to ``exclude_from_weight_decay``), and
trickles excludes embeddings from both as its AdamW does. ``bias_correction=False`` is the paper's v3
and ``torch-optimizer``'s ``Lamb`` (``debias=False``). State per element: ``exp_avg``, ``exp_avg_sq``
(``8`` bytes in fp32), plus a ``step`` counter per tensor, as AdamW's.
"""

from __future__ import annotations

import math

import torch

from .norms import LayerwiseOptimizer, NormProvider, group_norms, pieces, trust_ratio


class Lamb(LayerwiseOptimizer):
    """LAMB (module docstring); ``norms`` provides whole-weight norms when the tensors are shards."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        trust_clip: float = 0.0,
        bias_correction: bool = True,
        norms: NormProvider | None = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                trust_clip=trust_clip,
                bias_correction=bias_correction,
            ),
            norms,
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # as torch's optimizers do: the closure's forward and backward need autograd
            with torch.enable_grad():
                loss = closure()
        adapted = []  # (group, params, updates)
        for group, ps in self._with_grads():
            grads = [p.grad for p in ps]
            for p in ps:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            steps = [self.state[p]["step"] for p in ps]
            torch._foreach_add_(steps, 1.0)
            t = float(steps[0])
            b1, b2 = group["betas"]
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, group["eps"])
            upd = torch._foreach_div(ms, denom)
            torch._foreach_div_(upd, bc1)
            if group["weight_decay"]:
                torch._foreach_add_(upd, ps, alpha=group["weight_decay"])
            if group["adapt"]:
                adapted.append((group, ps, upd))
            else:
                torch._foreach_add_(ps, upd, alpha=-group["lr"])
        norms = group_norms(self.provider, [(ps, upd) for _, ps, upd in adapted])
        for (group, ps, upd), (wn, un) in zip(adapted, norms):
            r = trust_ratio(wn, un, group["trust_clip"])
            parts = pieces(upd, ps, self.provider)
            if parts:
                torch._foreach_mul_(parts, list(r.to(parts[0].dtype).unbind()))
            torch._foreach_add_(ps, upd, alpha=-group["lr"])
        return loss
