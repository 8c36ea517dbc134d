"""Mixture of experts: a router and ``E`` expert MLPs in place of a block's MLP (single-device code).

A token ``x`` (``[d]``) is scored by the router, ``logits = W_r x`` (``W_r: [E, d]``, computed in fp32
whatever the precision policy), ``p = softmax(logits)`` (fp32). It goes to its ``k`` most probable
experts ``e_1 .. e_k`` with weights ``w_j = p_{e_j}`` (renormalized to sum to 1 when ``k > 1``, as
Mixtral does; ``k = 1`` keeps the raw probability, as Switch does, so the router still gets a
gradient), and the layer's output is ``sum_j w_j MLP_{e_j}(x)`` plus, with shared experts, an always-on
MLP ``MLP_s(x)`` of ``n_shared x moe_ffn_hidden`` hidden units (or ``moe_shared_ffn_hidden``), with
``moe_shared_gate`` scaled by ``sigmoid(w_s . x)`` (Qwen2-MoE). The router's scores, groups, weights and
bias balancing are :mod:`trickles.models.routers`'. Each expert is an MLP of the model's
flavour (llama: ``down(silu(gate x) * up x)``; gpt2: ``down(gelu(up x))`` with biases) of
``moe_ffn_hidden`` hidden units. The experts' weights are stacked on a leading expert axis
(``experts.gate_proj.weight [E, F, d]``, ``up_proj [E, F, d]``, ``down_proj [E, d, F]``): the checkpoint
keeps them by global expert index, and expert parallelism splits that axis.

**Capacity** (``moe_capacity_factor = c > 0``). The unit is one sequence: each expert takes at most
``C = ceil(c k T / E)`` of a sequence's ``k T`` assignments (``T`` its tokens). Within a sequence the
assignments queue in the order (choice ``j``, position ``t``): every token's first choice, by position,
then every second choice, and so on (GShard's priority to first choices); an expert keeps the first
``C`` in its queue and drops the rest, whose contribution is then zero (the residual stream carries
the token on; the kept weights are not renormalized). Since the unit is a sequence, which tokens are
dropped does not depend on how a batch is split over data-parallel ranks, micro-batches or pipeline
stages. ``c = 0`` is dropless: every assignment is computed.

**Auxiliary losses**, each also per sequence and averaged over the micro-batch's sequences like the
cross-entropy is averaged over its tokens:

* load balancing (Switch / GShard), weight ``moe_aux_loss``: ``E sum_e f_e P_e`` with ``f_e`` the
  fraction of the sequence's ``k T`` assignments routed to ``e`` (before dropping; no gradient) and
  ``P_e`` the mean router probability of ``e`` over its tokens; 1 when the load is uniform;
* router z-loss (ST-MoE), weight ``moe_z_loss``: the mean over tokens of ``logsumexp(logits)^2``.

Under hard routing the load is fixed by the labels, so the load-balancing loss is not applied (its value
is still reported); the z-loss is.

**Hard routing** (``moe_router = "hard"``): each token carries its sample's label (an id: the position of the
label in ``moe_label_experts``), and its router logits outside that label's experts are set to ``-inf`` before
routing; every label names ``moe_top_k`` experts, so each token goes to exactly its label's experts, weighted
by the router's softmax over them (one expert: weight 1).

The auxiliary losses are not added to the model's output: the layer passes its output through :class:`AuxLossGrad`,
which is the identity forward and in backward also starts the auxiliary losses' gradients, scaled by
:attr:`MoEStats.grad_scale` -- the factor the trainer applies to the cross-entropy before backward
(``1 / micro-batches`` times the fp16 loss scale). So every micro-batch, every pipeline stage and a
recomputed block backpropagates its own auxiliary losses with its own backward, and no loss function
changes. Their values, the fraction of dropped assignments and each layer's load (assignments kept
per expert) are collected in :class:`MoEStats` for the metrics (not in a recomputed forward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.activations import gelu_tanh, swiglu
from .config import ModelConfig
from .mlp import MLP
from .routers import Router, graph_task

GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.9


class MoEStats:
    """What the MoE layers of one model report, summed over the forwards since :meth:`reset`, and the
    gradient scale their auxiliary losses use (set by the trainer)."""

    def __init__(self):
        self.grad_scale = 1.0
        self.reset()

    def reset(self) -> None:
        self.forwards = 0  # forwards of MoE layers recorded
        self.aux = 0.0  # sum over those forwards of the load-balancing loss (unweighted)
        self.z = 0.0  # ... of the z-loss (unweighted)
        self.assigned = 0  # assignments routed
        self.dropped = 0  # assignments dropped over capacity
        self.load: dict[int, torch.Tensor] = {}  # layer -> assignments kept per expert (int64, [E])

    def record(self, layer: int, aux: torch.Tensor, z: torch.Tensor, assigned: int, kept: torch.Tensor) -> None:
        if graph_task() != -1:  # the forward recomputed in backward: already counted
            return
        self.forwards += 1
        self.aux += float(aux)
        self.z += float(z)
        self.assigned += assigned
        self.dropped += assigned - int(kept.sum())
        prev = self.load.get(layer)
        self.load[layer] = kept.detach().cpu() if prev is None else prev + kept.detach().cpu()


class AuxLossGrad(torch.autograd.Function):
    """``y`` forward; backward passes ``y``'s gradient on and gives ``loss`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, y, loss, scale: float):
        ctx.scale = scale
        ctx.meta = (loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.meta
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


class StackedLinear(nn.Module):
    """``E`` linears ``in -> out`` stacked: ``weight [E, out, in]`` (and ``bias [E, out]``)."""

    stacked = True  # E weights in one tensor: per-weight rules (LAMB's and LARS's norms) take each expert apart

    def __init__(self, n: int, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in))
        self.bias = nn.Parameter(torch.empty(n, d_out)) if bias else None


class Experts(nn.Module):
    """The ``E`` expert MLPs (llama: gated SiLU; gpt2: GELU with biases) on stacked weights. ``first``: the
    global index of the first expert held (expert parallelism holds a slice)."""

    def __init__(self, cfg: ModelConfig, n: int):
        super().__init__()
        bias = cfg.flavor == "gpt2"
        self.gated = cfg.flavor == "llama"
        self.kernels = cfg.kernels
        f = cfg.moe_ffn_dim
        if self.gated:
            self.gate_proj = StackedLinear(n, cfg.d_model, f, False)
        self.up_proj = StackedLinear(n, cfg.d_model, f, bias)
        self.down_proj = StackedLinear(n, f, cfg.d_model, bias)
        self.first = 0

    @property
    def count(self) -> int:
        return self.up_proj.weight.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Local expert ``e`` on its ``counts[e]`` rows of ``x`` (rows sorted by expert); the outputs in the same order.
        (A module call, so that hooks on the experts run: ZeRO-3 gathers them as a unit of their own under expert
        parallelism.)

        Gated experts in fp32, bf16 or fp16 without autocast on CPU, whose rows (``d`` and ``F`` elements) are multiples
        of 16 bytes, run one ``torch.nn.functional.grouped_mm`` per projection over all the
        rows (what the loop gives, to rounding); otherwise a loop over the experts hit, with the stacked weights
        split once (``unbind``: one gradient buffer per weight in backward, not one per expert). Under autocast the
        loop's ``F.linear`` calls autocast as a dense MLP's do (``grouped_mm`` is not on autocast's lists)."""
        if not x.shape[0]:
            # no rows at all: an empty [0, d] (experts map d -> d) still tied to the inputs and to the weights (zero
            # gradients), so that backward runs the same collectives on every rank, the experts' own included
            return x + 0 * self.down_proj.weight.sum()
        if self._grouped_mm(x):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)

            def mm(inp, lin):
                return F.grouped_mm(inp, lin.weight.transpose(-2, -1), offs=offs)

            return mm(swiglu(mm(x, self.gate_proj), mm(x, self.up_proj), self.kernels), self.down_proj)

        def parts(lin):
            return lin.weight.unbind(0), (lin.bias.unbind(0) if lin.bias is not None else [None] * self.count)

        up, down = parts(self.up_proj), parts(self.down_proj)
        gate = parts(self.gate_proj) if self.gated else None
        outs = []
        for e, rows in enumerate(x.split(counts)):
            if not rows.shape[0]:
                continue
            if self.gated:
                h = swiglu(F.linear(rows, gate[0][e]), F.linear(rows, up[0][e]), self.kernels)
            else:
                h = gelu_tanh(F.linear(rows, up[0][e], up[1][e]), self.kernels)
            outs.append(F.linear(h, down[0][e], down[1][e]))
        return torch.cat(outs)

    def _grouped_mm(self, x: torch.Tensor) -> bool:
        aligned = all(
            n * x.element_size() % 16 == 0 for n in self.down_proj.weight.shape[1:]
        )  # the kernel's row strides
        return (
            GROUPED_MM is not None
            and self.gated
            and x.device.type == "cpu"
            and x.dtype == self.up_proj.weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and aligned
            and not torch.is_autocast_enabled("cpu")
        )


def top_k(logits: torch.Tensor, k: int):
    """``logits [B, T, E]`` (fp32) -> ``probs [B, T, E]``, ``experts [B, T, k]`` (int64), ``weights [B, T, k]``
    (fp32, differentiable): each token's ``k`` most probable experts and their weights."""
    probs = logits.softmax(-1)
    top, experts = probs.topk(k, dim=-1)
    weights = top / top.sum(-1, keepdim=True) if k > 1 else top
    return probs, experts, weights


def capacity_keep(experts: torch.Tensor, n_experts: int, capacity_factor: float) -> torch.Tensor:
    """``keep [B, T, k]`` (bool) for the choices ``experts [B, T, k]`` of whole sequences (see the module
    docstring: ``C = ceil(c k T / E)`` per expert and sequence, queued by (choice, position))."""
    b, t, k = experts.shape
    if capacity_factor <= 0:
        return torch.ones_like(experts, dtype=torch.bool)
    cap = math.ceil(capacity_factor * k * t / n_experts)
    order = experts.transpose(1, 2).reshape(b, k * t)  # (choice, position) order within each sequence
    onehot = F.one_hot(order, n_experts)
    place = (onehot.cumsum(1) * onehot).sum(-1) - 1  # 0-based place in its expert's queue
    return (place < cap).view(b, k, t).transpose(1, 2)


def route(logits: torch.Tensor, k: int, capacity_factor: float):
    """Top-``k`` routing with per-sequence capacity: :func:`top_k`'s ``probs, experts, weights`` and
    :func:`capacity_keep`'s ``keep``."""
    probs, experts, weights = top_k(logits, k)
    return probs, experts, weights, capacity_keep(experts, logits.shape[-1], capacity_factor)


def load_fraction(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``f [B, E]``: the fraction of each sequence's ``k T`` assignments routed to each expert (no gradient)."""
    b, t, k = experts.shape
    return F.one_hot(experts, n_experts).sum(2).sum(1).float() / (t * k)


def aux_losses(logits: torch.Tensor, probs: torch.Tensor, fraction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(load-balancing loss, z-loss)``, each per sequence then averaged over the sequences; ``fraction``
    is :func:`load_fraction` of the sequences' routes."""
    e = probs.shape[-1]
    balance = (e * (fraction * probs.mean(1)).sum(-1)).mean()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return balance, z


class MoE(nn.Module):
    """Router, ``E`` routed experts and the optional shared experts; replaces a block's ``mlp``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, stats: MoEStats):
        super().__init__()
        self.layer_id = layer_id
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_weight, self.z_weight = cfg.moe_aux_loss, cfg.moe_z_loss
        self.n_experts = cfg.moe_experts
        self.hard = cfg.moe_router == "hard"
        if self.hard:
            self.label_names = list(cfg.label_experts)
            self._label_experts = list(cfg.label_experts.values())
            self._allowed: dict[torch.device, torch.Tensor] = {}
        self.router = Router(cfg)
        self.experts = Experts(cfg, cfg.moe_experts)
        shared = cfg.moe_shared_ffn_hidden or cfg.moe_shared_experts * cfg.moe_ffn_dim
        self.shared = MLP(cfg, shared) if cfg.moe_shared_experts else None
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.moe_shared_gate else None
        self.resid_drop = nn.Dropout(cfg.dropout)
        # the auxiliary losses' share of the gradient this rank starts (sequence parallelism: 1 / tp, each tp
        # rank's losses being one of tp equal parts of the whole sequences' and its gradients summed over tp)
        self.aux_grad_factor = 1.0
        object.__setattr__(self, "stats", stats)  # shared with the model, not a submodule

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, d]``; ``labels``: hard routing's label ids, per sample ``[B]`` or per token ``[B, T]``."""
        b, t, d = x.shape
        logits = self.router(x)
        route_logits = logits
        if self.hard:
            if labels is None:
                raise ValueError(
                    "hard routing needs each sample's label (model.moe_router=hard): give labels "
                    f"({', '.join(self.label_names)})"
                )
            labels = labels.to(x.device)
            labels = labels[:, None].expand(b, t) if labels.dim() == 1 else labels
            route_logits = logits.masked_fill(~self.allowed(x.device)[labels], float("-inf"))
        probs, experts, weights = self.router.choose(route_logits)
        keep = self.keep(experts)
        out = self.dispatch(
            x.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1), keep.reshape(b * t, -1)
        ).view(b, t, d)
        weighted = (not self.hard and self.aux_weight != 0) or self.z_weight != 0
        with torch.set_grad_enabled(torch.is_grad_enabled() and weighted):  # weights 0: no graph, the values only
            balance, z = aux_losses(logits, probs, self.load_fraction(experts))  # z-loss on the router's own logits
        kept = torch.bincount(
            (experts if self.capacity_factor <= 0 else experts[keep]).flatten(), minlength=self.n_experts
        )
        self.stats.record(self.layer_id, balance.detach(), z.detach(), experts.numel(), kept)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        out = self.resid_drop(out)
        aux = (0.0 if self.hard else self.aux_weight) * balance + self.z_weight * z  # a fixed route needs no balancing
        if aux.requires_grad:
            out = AuxLossGrad.apply(out, aux, self.stats.grad_scale * self.aux_grad_factor)
        return out

    def keep(self, experts: torch.Tensor) -> torch.Tensor:
        """:func:`capacity_keep` of this layer's routes (a split sequence replaces it, see
        :func:`trickles.parallel.expert.split_sequence`)."""
        return capacity_keep(experts, self.n_experts, self.capacity_factor)

    def load_fraction(self, experts: torch.Tensor) -> torch.Tensor:
        """:func:`load_fraction` of this layer's routes (a split sequence replaces it)."""
        return load_fraction(experts, self.n_experts)

    def allowed(self, device) -> torch.Tensor:
        """Hard routing: ``[labels, E]``, which experts each label uses (made per device, not a buffer: the model
        is built on the meta device)."""
        if device not in self._allowed:
            table = torch.zeros(len(self._label_experts), self.n_experts, dtype=torch.bool)
            for i, experts in enumerate(self._label_experts):
                table[i, experts] = True
            self._allowed[device] = table.to(device)
        return self._allowed[device]

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j w_j MLP_{e_j}(x)`` over the kept assignments of the rows ``x [N, d]`` (one device: the rows
        grouped by expert, one matmul per expert; expert parallelism replaces this method)."""
        n, k = experts.shape
        token, expert, weight = (
            torch.arange(n, device=x.device).repeat_interleave(k),
            experts.flatten(),
            weights.flatten(),
        )
        if self.capacity_factor > 0:  # dropless keeps every assignment: no mask to apply
            mask = keep.flatten()
            token, expert, weight = token[mask], expert[mask], weight[mask]
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.experts.count).tolist()
        y = self.experts(x[token], counts)  # one gather, then the experts on their rows
        out = torch.zeros_like(x)
        out.index_add_(0, token, y * weight[:, None].to(x.dtype))
        return out


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Whether block ``layer_id`` is a mixture of experts (:attr:`ModelConfig.moe_layers`: every ``moe_every``-th
    block from ``moe_first_dense`` on)."""
    return layer_id in cfg.moe_layers
