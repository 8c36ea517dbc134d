"""Communication in the step-time model: each collective's time on its link, and what of it compute hides.

:func:`timed_traffic` times every :class:`~trickles.planner.traffic.Traffic` of one pipeline rank (a
:class:`~trickles.planner.rank_plan.RankPlan`) for :func:`~trickles.planner.cost.rank_step`, given the rank's
compute per micro-batch: ``t_f`` forward, ``t_b`` backward, ``t_rc`` recomputation and the attention cores' share.

**Each collective** (:mod:`trickles.planner.traffic`: the bytes each dimension's module states, for this rank):
``t = calls x messages(op, n) x alpha + wire_bytes / B`` on the link its group spans (inside a node the op's
own ``alpha`` and ``B`` where the calibration measured that kind apart, ``Cluster.collective_links``) -- inside a
node if every group of that kind lies in one node (ranks ``(pp, dp, cp, tp)`` outermost first,
:mod:`trickles.planner.placement`), else across nodes (:meth:`~trickles.planner.cluster.Cluster.link`).

**What is hidden.** A collective of ``k`` calls over ``P`` separate windows of compute ``w`` each (its
:attr:`~trickles.planner.traffic.Traffic.overlap`) is exposed for ``P (c + max(0, t/P - c - w))`` with
``c = t / max(P, k)``: one call's time per window is never hidden (the last bucket after backward, the first gather
before forward), the rest only beyond the window. A group's collectives run one after another on its link, so those
hidden behind the same compute share that window: they are pooled per group and window, ``t`` and ``c`` summed over the
pool (``P`` its largest), and the pool's exposure is split among them by time. Windows: data-parallel bucket reductions
-- one micro-batch's backward with its recomputation ``t_b + t_rc`` (ZeRO-3, and ZeRO-2 without pipeline stages, reduce
on every micro-step: ``P = m``); ZeRO-1/2 parameter gathers -- the next forward ``t_f``; ZeRO-3's prefetched gathers --
half before each forward (window ``t_f``), half before each backward (sharing ``t_b + t_rc`` with the reductions),
``P = m`` each (``prefetch=false``: nothing hidden); ring attention -- the layer's attention core, forward and backward
(``P`` = layers x micro-batches). On a cluster without ``overlap_comm`` (CPU ranks: gloo copies and reduces on the cores
the compute uses) every window is 0, and every collective call also waits ``shared_core_sync_us`` for peers arriving
late (their turn on a shared core, the jitter of their compute). Tensor-parallel, all-to-all and expert collectives are
on the critical path (exposed whole). Pipeline messages (``t_msg`` each) are exposed on the fill and drain,
``2 (p - 1)`` hops (interleaved ``2 (p v - 1)``), plus ``m v max(0, 2 t_msg - (t_f + t_b) / v)`` when a message takes
longer than a chunk's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import messages
from ..topology import ParallelDims
from .cluster import Cluster, Link
from .placement import group_size, pipeline_hop_spans_nodes, spans_nodes
from .rank_plan import RankPlan
from .traffic import TERMS, Traffic


@dataclass
class TimedTraffic:
    """One :class:`~trickles.planner.traffic.Traffic` with its link and times."""

    traffic: Traffic
    link: str
    time_s: float
    exposed_s: float


def _exposed(t: float, calls: int, window: float, passes: int) -> float:
    """``P (t/(P k) + max(0, t/P - t/(P k) - w))``: the module docstring's overlap rule."""
    if t <= 0:
        return 0.0
    passes = max(1, passes)
    per = t / passes
    one = per / max(1.0, calls / passes)
    return passes * (one + max(0.0, per - one - window))


def _link(cluster: Cluster, dims: ParallelDims, group: str, per_node: int, op: str | None = None) -> Link:
    spans = pipeline_hop_spans_nodes(dims, per_node) if group == "pp" else spans_nodes(dims, group, per_node)
    return cluster.link(spans, op)


def timed_traffic(
    plan: RankPlan, cluster: Cluster, t_f: float, t_b: float, t_rc: float, attention_s: float
) -> list[TimedTraffic]:
    """Every collective of ``plan``'s rank with its link, its time and its exposed time (module docstring), for a
    micro-batch's forward ``t_f``, backward ``t_b`` and recomputation ``t_rc`` seconds, ``attention_s`` the attention
    cores' forward and backward (ring attention's window)."""
    cfg, dims, m = plan.cfg, plan.dims, plan.micro_batches
    per_node = cluster.ranks_per_node(dims.world_size)
    windows = {"backward": t_b + t_rc, "forward": t_f}
    sync = cluster.shared_core_sync_us * 1e-6 if cluster.device == "cpu" else 0.0
    if not cluster.overlaps:  # CPU ranks: communication takes the cores the compute needs
        windows = {k: 0.0 for k in windows}
        attention_s = 0.0
    timed: list[TimedTraffic] = []
    pools: dict[tuple[str, str], list[tuple[int, float, int, float]]] = {}  # (group, window) -> (index, t, passes, c)
    for term in TERMS:
        for tr in term(plan):
            link = _link(cluster, dims, tr.group, per_node, tr.op)
            n = group_size(dims, tr.group)
            msgs = tr.calls if tr.op == "send" else tr.calls * messages(tr.op, n)
            t = link.time(msgs, tr.wire_bytes)
            if tr.op != "send" and n > 1:  # ranks outnumbering the cores wait for each other's turn
                t += tr.calls * sync
            exposed = t
            if tr.overlap == "attention":
                exposed = min(t, _exposed(t, tr.calls, attention_s / max(1, len(plan.layers)), tr.passes))
            elif tr.overlap == "pipeline":
                s = plan.shape
                hops = 2 * (s.p * s.v - 1) if cfg.parallel.schedule == "interleaved" else 2 * (s.p - 1)
                if s.vee:  # ZB-V: both chunks' hops, less the turn on the last rank
                    hops = 2 * (s.p * s.v - 2)
                t_msg = t / max(1, tr.calls)
                exposed = hops * t_msg + m * s.v * max(0.0, 2 * t_msg - (t_f + t_b) / s.v)
                exposed = exposed if cluster.overlaps else t
            elif tr.overlap == "prefetch":  # half before each forward, half before each backward
                for window in ("forward", "backward"):
                    pools.setdefault((tr.group, window), []).append(
                        (len(timed), t / 2, m, t / 2 / max(m, tr.calls / 2))
                    )
            elif tr.overlap in windows:
                pools.setdefault((tr.group, tr.overlap), []).append(
                    (len(timed), t, tr.passes, t / max(tr.passes, tr.calls))
                )
            timed.append(TimedTraffic(tr, link.name, t, exposed))
    pooled = [0.0] * len(timed)
    for (_, window), members in pools.items():
        total_t = sum(t for _, t, _, _ in members)
        passes = max(pp for _, _, pp, _ in members)
        c = min(total_t / passes, sum(c for _, _, _, c in members))
        exposed = passes * (c + max(0.0, total_t / passes - c - windows[window]))
        for i, t, _, _ in members:
            pooled[i] += exposed * t / total_t if total_t > 0 else 0.0
    for i, tt in enumerate(timed):
        if tt.traffic.overlap in ("prefetch", *windows):
            tt.exposed_s = min(tt.time_s, pooled[i])
    return timed
