"""Which optimizer the engines run, and its hyper-parameters (``train.optimizer`` and friends).

Every optimizer sees the same two parameter groups (:func:`~trickles.optim.adamw.decay_flags`):
``decay`` (linear matrices: weight decay, and for LAMB and LARS the trust ratio) and ``no_decay``
(norms, biases, embedding tables: neither). The data-parallel engines build it over the parameter
segments each rank owns (:class:`~trickles.optim.sharded.ShardedOptimizer`); LAMB and LARS take
their per-weight norms from the engine's norm provider (:mod:`~trickles.optim.norms`).

========  ==========================================================  ========================
name      update                                                      state per element (fp32)
========  ==========================================================  ========================
adamw     torch's AdamW (decoupled decay)                             ``exp_avg``, ``exp_avg_sq``
lamb      :class:`~trickles.optim.lamb.Lamb`                           ``exp_avg``, ``exp_avg_sq``
lars      :class:`~trickles.optim.lars.Lars`                           ``momentum_buffer``
sgd       torch's SGD with momentum (decay as an L2 term)             ``momentum_buffer``
========  ==========================================================  ========================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adamw import adamw_kwargs
from .lamb import Lamb
from .lars import Lars
from .norms import NormProvider

OPTIMIZERS = ("adamw", "lamb", "lars", "sgd")
LAYERWISE = ("lamb", "lars")  # the ones that need per-weight norms


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer hyper-parameters (the learning rate is set per step by the schedule)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    name: str = "adamw"
    momentum: float = 0.9  # sgd, lars
    trust_coefficient: float = 0.001  # lars's eta
    trust_clip: float = 0.0  # lamb, lars: upper bound on the trust ratio (0: none)

    @classmethod
    def from_train(cls, t) -> OptimizerSettings:
        return cls(
            t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay, t.optimizer, t.momentum, t.trust_coefficient, t.trust_clip
        )

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The per-element state this optimizer keeps (checkpointed per segment; 4 bytes each in fp32)."""
        if self.name == "sgd" and self.momentum == 0:
            return ()  # plain SGD keeps nothing
        return ("momentum_buffer",) if self.name in ("lars", "sgd") else ("exp_avg", "exp_avg_sq")

    @property
    def counts_steps(self) -> bool:
        """Whether it keeps a step counter per tensor (Adam's bias correction: 4 bytes each)."""
        return self.name in ("adamw", "lamb")

    def build(
        self, groups: list[dict], device: torch.device, norms: NormProvider | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer over ``groups`` (dicts with ``params``, ``weight_decay`` and ``adapt``) on ``device``."""
        if self.name == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps, **adamw_kwargs(device))
        if self.name == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, foreach=True)
        if self.name == "lamb":
            return Lamb(groups, lr=self.lr, betas=self.betas, eps=self.eps, trust_clip=self.trust_clip, norms=norms)
        if self.name == "lars":
            return Lars(
                groups,
                lr=self.lr,
                momentum=self.momentum,
                trust_coefficient=self.trust_coefficient,
                trust_clip=self.trust_clip,
                norms=norms,
            )
        raise ValueError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
