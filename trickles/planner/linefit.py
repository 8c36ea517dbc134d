"""Fitting the link model to collective timings: ``time = messages x alpha + wire_bytes / B``.

:func:`fit_link` fits one line (least squares) to ``(messages, wire bytes, seconds)`` samples; :func:`fit_links`
gives the kinds of collective one line describes that shared line and each kind it misses its own
(:attr:`~trickles.planner.cluster.Cluster.collective_links`); :func:`link_samples` turns timings
``(op, ranks, input bytes, seconds)`` into samples with :func:`trickles.comm.messages` and
:func:`trickles.comm.wire_bytes`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..comm import messages, wire_bytes


def fit_link(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(alpha seconds, B bytes/s)`` fitting ``time = messages x alpha + wire_bytes / B`` to ``samples`` of
    ``(messages, wire_bytes, seconds)``: least squares on the two coefficients (the normal equations), each kept
    non-negative (a negative latency is refitted as zero); ``B`` is infinite if the bytes explain nothing."""
    if not samples:
        raise ValueError("fit_link needs at least one (messages, wire_bytes, seconds) sample")
    sxx = sum(m * m for m, _, _ in samples)
    syy = sum(w * w for _, w, _ in samples)
    sxy = sum(m * w for m, w, _ in samples)
    sxt = sum(m * t for m, _, t in samples)
    syt = sum(w * t for _, w, t in samples)
    det = sxx * syy - sxy * sxy
    alpha, inv = ((sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or inv <= 0:
        # refit with one coefficient: bytes alone (alpha = 0), else messages alone
        inv = syt / syy if syy > 0 else 0.0
        alpha = 0.0
        if inv <= 0:
            alpha, inv = (sxt / sxx if sxx > 0 else 0.0), 0.0
    return max(alpha, 0.0), (1.0 / inv if inv > 0 else float("inf"))


def fit_links(
    timings: Sequence[tuple[str, int, int, float]], tolerance: float = 0.15
) -> tuple[tuple[float, float], dict[str, tuple[float, float]]]:
    """``((alpha, B), {op: (alpha_op, B_op)})``: one line (:func:`fit_link`) for the kinds of collective that share
    it, and each other kind's own line fitted to its timings alone. A kind's miss is the median over its timings
    ``(op, ranks, input bytes, seconds)`` of ``|(messages alpha + wire / B) / seconds - 1|``; while the worst miss
    of the sharing kinds is above ``tolerance``, the kind whose leaving makes the others' refitted line miss least
    gets its own line (greedily, so one slow kind does not pull the shared line off the others)."""
    ops = list(dict.fromkeys(t[0] for t in timings))
    by_op = {op: link_samples([t for t in timings if t[0] == op]) for op in ops}

    def fit(kinds):
        return fit_link([x for op in kinds for x in by_op[op]])

    def worst(kinds, line):
        alpha, bw = line
        return max(
            statistics.median([abs((m * alpha + w / bw) / t - 1) for m, w, t in by_op[op] if t > 0] or [0.0])
            for op in kinds
        )

    own: dict[str, tuple[float, float]] = {}
    sharing = list(ops)
    line = fit(sharing)
    while len(sharing) > 1 and worst(sharing, line) > tolerance:
        best = None
        for op in sharing:
            rest = [o for o in sharing if o != op]
            alone, rest_line = fit([op]), fit(rest)
            if alone[1] == float("inf") or rest_line[1] == float("inf"):
                continue
            score = worst(rest, rest_line)
            if best is None or score < best[0]:
                best = (score, op, alone, rest, rest_line)
        if best is None:
            break
        _, op, own[op], sharing, line = best
    return line, own


def link_samples(timings: Sequence[tuple[str, int, int, float]]) -> list[tuple[float, float, float]]:
    """``(messages, wire bytes, seconds)`` of each timing, for :func:`fit_link`."""
    return [(messages(op, n), wire_bytes(op, nbytes, n), t) for op, n, nbytes, t in timings]
