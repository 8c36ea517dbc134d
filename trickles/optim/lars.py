"""LARS: SGD with momentum and a per-weight local learning rate (You, Gitman and Ginsburg, "Large Batch
Training of Convolutional Networks", 2017, Algorithm 1; the form MLPerf's LARS keeps).

For each weight ``w`` (one norm unit, :mod:`~trickles.optim.norms`) with gradient ``g``, at learning rate
``lr_t`` (the schedule's, warm-up and polynomial decay in the paper)::

    d      = g + wd w                                  (wd: the group's weight decay, an L2 term)
    lambda = eta ||w|| / (||g|| + wd ||w||), lambda <- min(lambda, trust_clip) if trust_clip > 0;
             lambda = 1 where ||w|| or ||g|| is zero
    v     <- mu v + lr_t lambda d                      (the learning rate inside the momentum, as the paper)
    w     <- w - v

``eta`` is the trust coefficient (``0.001`` in the paper), ``mu`` the momentum. ``lambda`` is applied to
groups with ``adapt=True``; elsewhere ``lambda = 1`` (plain momentum SGD). trickles adapts and decays the
same weights (:func:`~trickles.optim.adamw.decay_flags`: linear matrices, not norms, biases or embeddings),
as LARS's users do (the paper and SimCLR's LARS exclude biases and normalization weights from both).
State per element: ``momentum_buffer`` (4 bytes in fp32).
"""

from __future__ import annotations

import torch

from .norms import LayerwiseOptimizer, NormProvider, group_norms, pieces, trust_ratio


class Lars(LayerwiseOptimizer):
    """LARS (module docstring); ``norms`` provides whole-weight norms when the tensors are shards."""

    def __init__(
        self,
        params,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        trust_clip: float = 0.0,
        norms: NormProvider | None = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                trust_coefficient=trust_coefficient,
                trust_clip=trust_clip,
            ),
            norms,
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # as torch's optimizers do: the closure's forward and backward need autograd
            with torch.enable_grad():
                loss = closure()
        work = [(group, ps, [p.grad for p in ps]) for group, ps in self._with_grads()]
        adapted = [w for w in work if w[0]["adapt"]]
        norms = dict(zip((id(w) for w in adapted), group_norms(self.provider, [(ps, gs) for _, ps, gs in adapted])))
        for item in work:
            group, ps, gs = item
            wd, lr = group["weight_decay"], group["lr"]
            d = torch._foreach_add(gs, ps, alpha=wd) if wd else [g.clone() for g in gs]
            parts = pieces(d, ps, self.provider)
            if id(item) in norms:
                wn, gn = norms[id(item)]
                # 1 where ||w|| or ||g|| is zero (a weight at zero, or one no gradient reached), as LARS's users do
                scale = (
                    trust_ratio(group["trust_coefficient"] * wn, gn + wd * wn, group["trust_clip"], (wn > 0) & (gn > 0))
                    * lr
                )
                if parts:
                    torch._foreach_mul_(parts, list(scale.to(parts[0].dtype).unbind()))
            else:
                torch._foreach_mul_(d, lr)
            for p in ps:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, d)
            torch._foreach_sub_(ps, bufs)
        return loss
