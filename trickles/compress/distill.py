"""Knowledge distillation: train a student on a teacher's soft targets (and, optionally, its hidden states).

The training loss of a micro-batch, with student logits ``s``, teacher logits ``t`` and next tokens ``y``
(``-100``: ignored), averaged over the ``N`` counted tokens:

    L = alpha T^2 KL(p_t^T || p_s^T) + (1 - alpha) CE(s, y) + hidden_weight H

    KL(p_t^T || p_s^T) = 1/N sum_tokens sum_v p_t^T(v) (log p_t^T(v) - log p_s^T(v)),   p^T = softmax(logits / T)

(Hinton et al. 2015: the ``T^2`` keeps the soft term's gradients the size of the hard term's as ``T`` grows.)
With ``hidden_weight > 0``, PKD-style (Sun et al. 2019) ``H`` is the mean over the mapped block pairs
``(i, j)`` of ``MSE(P_i h_s^i, h_t^j)``: student block ``i``'s output against teacher block ``j``'s, over tokens
and features, ``P_i`` the identity when the widths agree and otherwise a learned ``d_student -> d_teacher``
projection (trained with AdamW at the run's learning rate; it is training machinery, not part of the
student, so checkpoints do not hold it and a resumed run starts it afresh). The default map sends student
block ``i`` of ``L_s`` to teacher block ``round((i + 1) L_t / L_s) - 1`` (the last blocks aligned).

The teacher runs without gradients on every data-parallel rank, on that rank's micro-batches, in the same
process group and precision as the student. Supported layouts: data parallelism with ZeRO 0, 1 or 2. Refused at
configuration time: tensor parallelism (vocabulary-parallel logits), pipeline, context and expert parallelism
(no rank holds a token's whole logits or the whole model) and ZeRO-3 (its gathers run around the model's own
forward, which the distillation forward walks block by block). The loss needs the student's logits, so a
fused loss (``model.fused_loss``) is not used while distilling. With ``alpha = 0`` and ``hidden_weight = 0`` the
run is plain training: the same losses and the same weights.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, ConfigError
from .config import DistillConfig
from .report import load_model


def default_map(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """Student block ``i`` to teacher block ``round((i + 1) L_t / L_s) - 1``."""
    return [(i, max(0, round((i + 1) * teacher_layers / student_layers) - 1)) for i in range(student_layers)]


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """``KL(softmax(t/T) || softmax(s/T))`` per token, averaged over the tokens whose target is not ``-100`` (fp32)."""
    s = student.float().flatten(0, -2) / temperature
    t = teacher.float().flatten(0, -2) / temperature
    keep = (target.flatten() != -100).to(s.dtype)
    log_pt = F.log_softmax(t, dim=-1)
    per_token = (log_pt.exp() * (log_pt - F.log_softmax(s, dim=-1))).sum(-1)
    return (per_token * keep).sum() / keep.sum().clamp(min=1)


def forward_states(model, tokens: torch.Tensor, keep: set[int], labels: torch.Tensor | None = None):
    """``(logits, {block: hidden state after it})`` of a whole (unsplit) :class:`Transformer`."""
    h = model.embed_tokens(tokens)
    rope = model.rope(0, tokens.shape[1])
    states = {}
    for key, block in model.layers.items():
        h = block(h, rope, None, 0, labels)
        if int(key) in keep:
            states[int(key)] = h
    return model.head(h), states


def load_teacher(path: str, device: torch.device | str = "cpu"):
    """The teacher model (eval mode, no gradients) from a trickles checkpoint or a Hugging Face directory."""
    if not os.path.exists(path):
        raise ConfigError(
            f"distill.teacher {path} does not exist; give a trickles checkpoint, a run's out_dir or a Hugging Face "
            "directory"
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        from ..models.hf import load_hf

        model = load_hf(path, device=device).eval()
    else:
        try:
            model = load_model(path, device)[0]
        except CheckpointError as e:
            raise ConfigError(f"distill.teacher: {e}") from None
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class Distiller:
    """The distillation loss of the student ``model`` against the teacher ``cfg.teacher``; the trainer calls
    :meth:`loss` per micro-batch and, with learned projections, :meth:`reduce` after backward and :meth:`step`."""

    def __init__(self, cfg: DistillConfig, student_cfg, device, seed: int, weight_decay: float = 0.0):
        self.cfg = cfg
        self.teacher = load_teacher(cfg.teacher, device)
        t_cfg = self.teacher.cfg
        if t_cfg.vocab_size != student_cfg.vocab_size:
            raise ConfigError(
                f"the teacher's vocabulary ({t_cfg.vocab_size} tokens) differs from the student's "
                f"({student_cfg.vocab_size}); distil from a teacher with the same tokenizer and model.vocab_size"
            )
        self.pairs: list[tuple[int, int]] = []
        self.proj: nn.ModuleList | None = None
        self.optimizer = None
        if cfg.hidden_weight > 0:
            self.pairs = cfg.pairs() or default_map(student_cfg.n_layers, t_cfg.n_layers)
            for s, t in self.pairs:
                if not (0 <= s < student_cfg.n_layers and 0 <= t < t_cfg.n_layers):
                    raise ConfigError(
                        f"distill.layer_map pair {s}:{t} names a block the student ({student_cfg.n_layers} "
                        f"blocks) or the teacher ({t_cfg.n_layers}) does not have"
                    )
            if student_cfg.d_model != t_cfg.d_model:
                g = torch.Generator().manual_seed(seed)
                self.proj = nn.ModuleList(nn.Linear(student_cfg.d_model, t_cfg.d_model, bias=False) for _ in self.pairs)
                with torch.no_grad():
                    for lin in self.proj:
                        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / student_cfg.d_model**0.5)
                self.proj.to(device)
                self.optimizer = torch.optim.AdamW(self.proj.parameters(), lr=1.0, weight_decay=weight_decay)

    def loss(self, model, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        from ..kernels.cross_entropy import cross_entropy

        c = self.cfg
        logits, hs = forward_states(model, x, {s for s, _ in self.pairs}, labels)
        with torch.no_grad():
            t_logits, ht = forward_states(self.teacher, x, {t for _, t in self.pairs}, labels)
        loss = (1.0 - c.alpha) * cross_entropy(logits, y) + c.alpha * c.temperature**2 * kd_loss(
            logits, t_logits, y, c.temperature
        )
        if self.pairs:
            terms = [
                F.mse_loss((self.proj[i](hs[s]) if self.proj is not None else hs[s]).float(), ht[t].float())
                for i, (s, t) in enumerate(self.pairs)
            ]
            loss = loss + c.hidden_weight * torch.stack(terms).mean()
        return loss

    def reduce(self, replicas) -> None:
        """Averages the projections' gradients over the data-parallel replicas."""
        if self.proj is None:
            return
        for p in self.proj.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(replicas.all_reduce(p.grad, op="mean"))

    def step(self, lr: float, grad_scale: float = 1.0, skip: bool = False) -> None:
        """Updates the projections at ``lr`` (their gradients divided by the loss scale); ``skip``: drops the step's
        gradients."""
        if self.optimizer is None:
            return
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if grad_scale != 1.0:
            for p in self.proj.parameters():
                p.grad.div_(grad_scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
