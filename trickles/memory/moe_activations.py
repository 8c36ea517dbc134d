"""Activation memory of a mixture-of-experts block: what autograd keeps in place of the dense MLP, by formula.

:func:`~trickles.memory.activations.activation_bytes` counts an MoE layer as its two norms and attention plus
:func:`moe_bytes`; the :class:`~trickles.memory.activations.ActivationMeter` measures it the same way (the tests
compare the two to the byte).

Mixture-of-experts blocks (:attr:`ModelConfig.moe_layers <trickles.models.config.ModelConfig.moe_layers>`,
:mod:`trickles.models.moe`) keep, in place of the MLP, with ``S`` sequences of the micro-batch, ``E``
experts, top-``k``, expert width ``F``, ``F_s = moe_shared_experts x F`` and ``m`` the assignments this
rank's tokens keep (dropless: ``m = k s``):

=================  ==========================================================  ===========================
piece              saved for backward                                          bytes
=================  ==========================================================  ===========================
router             low precision only: the fp32 copies of its input and        ``4sd + 4Ed`` (``p < 4``)
                   weight (in fp32 it keeps the norm's output, counted there)
routing            fp32 probabilities; top-k indices (int64); ``k > 1``: the   ``4sE + 8sk (+ 4sk + 4s)
                   top probabilities and their sum (renormalization); the      (+ sk) + 16m``
                   keep mask (bool; with capacity or expert parallelism, the
                   only ones that apply it); the sort order and the token of
                   each kept assignment (int64)
experts            the gathered input rows; each expert's MLP on its rows      ``pmd + 3pmF`` / ``+ 2pmF``
                   (llama / gpt2, like the dense MLP); llama in fp32 on CPU   (``+ 4E``)
                   with ``d``, ``F`` multiples of 4 (``grouped_mm``): the
                   int32 offsets of the ``E`` groups
combine            the expert outputs and the weights (compute type) of the    ``2pmd + pm``
                   weighting; the weighted rows ``index_add`` keeps
auxiliary losses   the load fractions; the fp32 logits and log-sum-exp of      ``4SE + 4sE + 4s``
                   the z-loss (none when both weights are 0: no graph)
shared experts     a dense MLP of ``F_s`` units on all ``s`` tokens (it keeps  ``3psF_s`` / ``2psF_s``
                   the norm's output; without it, in low precision nothing
                   does: ``- psd``)
shared gate        Qwen2-MoE's ``sigmoid(w x)`` times the shared experts:      ``psd + ps``
                   their output and the gate
hard routing       the mask of the label's experts (bool)                      ``sE``
sigmoid scores     the fp32 sum that normalizes them for the balancing loss    ``4s``
                   (DeepSeek's router; the bias and the group choice are
                   detached: nothing saved)
=================  ==========================================================  ===========================

Together, with ``c_f`` = 3 (llama) or 2 (gpt2) and ``[x]_{cond}`` a term present only when ``cond`` holds, an
MoE layer keeps ``2 norms + attention + moe`` with

``moe = [4sd + 4Ed]_{p<4} + 4sE + 8sk + [4sk + 4s]_{k>1} + [sk]_{c>0 or ep>1} + 16m + 3pmd + pm + c_f pmF
+ [4SE + 4sE + 4s]_{aux or z weighted}
+ (c_f psF_s + [psd + ps]_{gate} if shared experts else -[psd]_{p<4}) + [sE]_{hard} + [4s]_{sigmoid}
+ [4E]_{grouped_mm}``

(exact, byte for byte, for dropless routing on one process). ``s`` counts the tokens the block routes: this
rank's, ``s/tp`` under sequence parallelism (the router and experts are whole on every tensor-parallel rank).
With capacity (``moe_capacity_factor = c > 0``) ``m`` is data-dependent; the prediction is its upper
bound ``m = min(k s, S E C)``, ``C = ceil(c k T / E)`` (no more is kept; dropless predicts exactly).
With expert parallelism (``ep`` ranks) the rows a rank's experts receive, ``m_in``, replace ``m`` in the
experts' terms and the rank also keeps the index that groups them by expert and the expert outputs
before they return (``8 m_in + p m_in d``, :func:`~trickles.parallel.expert.expert_dispatch`); ``m_in`` is
data-dependent and predicted balanced (each rank receives on average what it sends: ``m_in = m``),
so with dropless routing the ``ep`` ranks' MoE layers sum to ``ep`` times the prediction.
"""

from __future__ import annotations

import math

from ..models.config import ModelConfig


def moe_assignments(cfg: ModelConfig, batch: int, tokens: int, seq: int) -> int:
    """``m``: the assignments kept for ``batch`` sequences of which this rank routes ``tokens`` each (``seq``: the
    whole sequence, which capacity is counted on). Dropless: exactly ``k x batch x tokens``; with capacity the
    upper bound ``min(k s, S E C)``, ``C = ceil(c k T / E)`` per expert and sequence (which are dropped depends on
    the data)."""
    k, e, c = cfg.moe_top_k, cfg.moe_experts, cfg.moe_capacity_factor
    m = k * batch * tokens
    if c > 0:
        m = min(m, batch * e * math.ceil(c * k * seq / e))
    return m


def per_token_bound(cfg: ModelConfig, ep: int) -> int:
    """The most of one token's ``k`` assignments an expert-parallel rank's experts (``E / ep`` consecutive ones) can
    receive: its ``k`` experts are distinct, so ``min(k, E / ep)``; with group-limited routing (``moe_groups = G``
    consecutive groups of ``E / G``, ``moe_topk_groups = g`` of them open to each token) at most the experts of the
    ``g`` groups that overlap the rank most (the largest over the ranks)."""
    e, k, g = cfg.moe_experts, cfg.moe_top_k, cfg.moe_topk_groups
    held = e // ep
    if cfg.moe_groups <= 1 or g is None or g >= cfg.moe_groups:
        return min(k, held)
    size = e // cfg.moe_groups

    def reachable(r: int) -> int:  # rank r's experts in the g groups overlapping it most
        lo, hi = r * held, (r + 1) * held
        overlaps = sorted(max(0, min(hi, (i + 1) * size) - max(lo, i * size)) for i in range(cfg.moe_groups))
        return sum(overlaps[-g:])

    return min(k, max(reachable(r) for r in range(ep)))


def received_bound(cfg: ModelConfig, batch: int, tokens: int, seq: int, ep: int) -> int:
    """``m_in`` at its most: the rows one expert-parallel rank's experts can receive in a block when the router sends
    it as much as it can, every one of the ``ep`` ranks' ``batch x tokens`` tokens sending it
    :func:`per_token_bound` of its assignments (dropless: nothing caps it; with capacity ``c > 0`` each of its
    ``E / ep`` experts keeps at most ``C = ceil(c k T / E)`` per sending rank's sequence, ``S E C`` in all).
    A balanced load is :func:`moe_assignments` (``k`` per token); this is what the router can do at most."""
    m_in = ep * batch * tokens * per_token_bound(cfg, ep)
    c = cfg.moe_capacity_factor
    if c > 0:
        m_in = min(m_in, batch * cfg.moe_experts * math.ceil(c * cfg.moe_top_k * seq / cfg.moe_experts))
    return m_in


def moe_bytes(
    cfg: ModelConfig,
    batch: int,
    tokens: int,
    seq: int,
    dtype_bytes: int = 4,
    ep: int = 1,
    assignments: int | None = None,
    received: int | None = None,
    device_type: str = "cpu",
    expert_load: str = "balanced",
) -> int:
    """What a mixture-of-experts block keeps in place of the MLP (module docstring)
    for ``batch`` sequences of which it routes ``tokens`` each (``seq``: the whole sequence); with ``ep > 1`` the
    expert-parallel dispatch's extra terms. ``assignments``: the kept count ``m`` when known (default
    :func:`moe_assignments`); ``received``: ``m_in``, the rows this rank's experts got (default ``m``, a
    balanced load; with ``expert_load="bound"`` and ``ep > 1``, :func:`received_bound`)."""
    s, d, p = batch * tokens, cfg.d_model, dtype_bytes
    e, k, f = cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_dim
    m = moe_assignments(cfg, batch, tokens, seq) if assignments is None else assignments
    if received is None and expert_load == "bound" and ep > 1:
        received = received_bound(cfg, batch, tokens, seq, ep)
    m_in = m if received is None else received
    router = 4 * s * d + 4 * e * d if p != 4 else 0
    masked = cfg.moe_capacity_factor > 0 or ep > 1  # (one process, dropless: every assignment kept, no mask applied)
    routing = 4 * s * e + 8 * s * k + (4 * s * k + 4 * s if k > 1 else 0) + (s * k if masked else 0) + 16 * m
    if cfg.moe_router == "hard":
        routing += s * e
    if cfg.moe_router_score == "sigmoid":  # the scores' sum, which normalizes them into the balancing loss's fractions
        routing += 4 * s
    mlp_factor = 3 if cfg.flavor == "llama" else 2
    experts = p * m_in * d + mlp_factor * p * m_in * f  # the rows the experts run on
    if cfg.flavor == "llama" and p == 4 and device_type == "cpu" and d % 4 == 0 and f % 4 == 0:  # grouped_mm's offsets
        experts += 4 * (e // ep)
    combine = 2 * p * m * d + p * m  # this rank's tokens' outputs back
    weighted = (cfg.moe_router != "hard" and cfg.moe_aux_loss != 0) or cfg.moe_z_loss != 0
    aux = 4 * batch * e + 4 * s * e + 4 * s if weighted else 0  # (weights 0: computed without a graph)
    if cfg.moe_shared_experts:
        shared = mlp_factor * p * s * cfg.moe_shared_experts * f
        if cfg.moe_shared_gate:  # the product with the gate keeps the shared experts' output and the gate
            shared += p * s * d + p * s
    else:
        shared = -p * s * d if p != 4 else 0  # nothing keeps the norm's low-precision output
    dispatch = 8 * m_in + p * m_in * d if ep > 1 else 0  # grouping by expert; outputs before their return
    return router + routing + experts + combine + aux + shared + dispatch
