"""The routing a mixture-of-experts run actually saw, and the activation prediction at that load.

The memory model predicts expert parallelism's activations for a balanced load: each rank's experts receive ``m``
rows, as many as its tokens send (:func:`~trickles.memory.moe_activations.moe_assignments`). A learned router is not
balanced, so the rows a rank's ``E / ep`` experts receive in block ``l``, ``m_in(l)``, differ from ``m``, and the
activations with them: :func:`~trickles.memory.moe_activations.moe_bytes` keeps ``p m_in d + c p m_in f`` for the rows
the experts run on and ``8 m_in + p m_in d`` for the dispatch, so block ``l`` holds

    predicted(l) + moe_bytes(m_in = m_in(l)) - moe_bytes(m_in = m)

at the load seen. :func:`routing_seen` counts ``m_in(l)`` over one forward from the blocks' own statistics
(:class:`~trickles.models.moe.MoEStats`: assignments kept per expert, this rank's tokens), summed over the
expert-parallel group, and :func:`at_load` gives each block's prediction at it: the formula's exactness apart from
the routing's imbalance. The planner keeps the balanced prediction (a layout search cannot know the routing).
"""

from __future__ import annotations

import torch

from .moe_activations import moe_assignments, moe_bytes


def routing_seen(stats, comm) -> dict[int, int]:
    """``{block: rows this rank's experts received}`` from ``stats.load`` (one forward's assignments kept per
    expert, of this rank's tokens) summed over the expert-parallel group ``comm`` (every rank of it must call);
    this rank holds experts ``[r E / ep, (r + 1) E / ep)``."""
    out = {}
    for layer in sorted(stats.load):
        counts = stats.load[layer].clone().to(torch.int64)
        if comm.size > 1:
            comm.all_reduce(counts)
        el = counts.numel() // comm.size
        out[layer] = int(counts[comm.rank * el : (comm.rank + 1) * el].sum())
    return out


def at_load(
    cfg,
    model_cfg,
    received: dict[int, int],
    predicted: list[int],
    micro: int,
    routed: int,
    p: int,
    ep: int,
    device_type: str,
) -> tuple[int, dict[int, int]]:
    """``(m, {block: its predicted activations at m_in = received[block]})`` for ``micro`` sequences of which each
    rank routes ``routed`` tokens each (module docstring); ``predicted``: the balanced prediction per block."""
    seq = cfg.data.seq_len
    m = moe_assignments(model_cfg, micro, routed, seq)
    full = cfg.memory.recompute == "full"  # a recomputed block keeps only its input: the load does not show
    base = moe_bytes(model_cfg, micro, routed, seq, p, ep, device_type=device_type)
    out = {}
    for layer, m_in in received.items():
        extra = (
            0
            if full
            else moe_bytes(model_cfg, micro, routed, seq, p, ep, received=m_in, device_type=device_type) - base
        )
        out[layer] = predicted[layer] + extra
    return m, out


__all__ = ["at_load", "routing_seen"]
