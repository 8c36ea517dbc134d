"""Bytes and messages of each collective, and the ledger that counts them per operation and group.

Every call of a :class:`~trickles.comm.group.GroupComm` records into a :class:`CommLedger`:

* ``bytes``: the size of the tensor this rank contributes (the input; for all-gather the shard),
* ``wire_bytes``: what this rank sends under the bandwidth-optimal ring / pairwise algorithms,
  with ``n`` ranks and ``S`` bytes of input:

  ===============  =====================  ==========================================
  all-reduce       ``2 (n-1)/n * S``      reduce-scatter then all-gather
  all-gather       ``(n-1) * S``          each shard travels to n-1 peers
  reduce-scatter   ``(n-1)/n * S``        one chunk of S/n sent per ring step
  all-to-all       ``(n-1)/n * S``        everything but the own chunk leaves
  broadcast        ``S`` (source only)
  send / recv      ``S`` / 0
  ===============  =====================  ==========================================

:func:`wire_bytes` states these formulas once (the ledger records them, the planner's time model reads them), and
:func:`messages` the number of sequential messages each algorithm sends (its latency terms).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

#: Ring / pairwise algorithms: bytes a rank sends per byte of its input ``S`` with ``n`` ranks (all-gather: per
#: byte of its shard), and the sequential messages (ring steps) each needs.
_WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: float(n - 1),
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "send": lambda n: 1,
    "recv": lambda n: 0,
}
OPS = tuple(_WIRE)


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for collective ``op`` over ``n`` ranks with ``nbytes`` of input (the module docstring's
    table; all-gather: ``nbytes`` is the rank's shard; broadcast: the source's). 0 for a group of one."""
    if op not in _WIRE:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    return _WIRE[op](n) * nbytes if n > 1 else 0.0


def messages(op: str, n: int) -> int:
    """Sequential messages (ring steps) ``op`` takes over ``n`` ranks: all-reduce ``2 (n-1)`` (reduce-scatter, then
    all-gather), all-gather, reduce-scatter and all-to-all ``n - 1``, a send 1; 0 for a group of one. With a
    per-message latency ``alpha`` and a bandwidth ``B`` a collective takes ``messages x alpha + wire_bytes / B``."""
    if op not in _STEPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    return _STEPS[op](n) if n > 1 else 0


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0


class CommLedger:
    """Calls and bytes per ``(op, group name)``; read by tests, benchmarks and reports."""

    def __init__(self):
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)
        self.enabled = True

    def record(self, op: str, group: str, nbytes: int, wire_bytes: float) -> None:
        if self.enabled:
            s = self.stats[(op, group)]
            s.calls += 1
            s.bytes += int(nbytes)
            s.wire_bytes += int(round(wire_bytes))

    def reset(self) -> None:
        self.stats.clear()

    def _select(self, op: str | None, group: str | None):
        return [s for (o, g), s in self.stats.items() if (op is None or o == op) and (group is None or g == group)]

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return sum(s.calls for s in self._select(op, group))

    def bytes(self, op: str | None = None, group: str | None = None, wire: bool = False) -> int:
        return sum(s.wire_bytes if wire else s.bytes for s in self._select(op, group))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce/dp": {"calls": .., "bytes": .., "wire_bytes": ..}, ...}``"""
        return {
            f"{o}/{g}": dict(calls=s.calls, bytes=s.bytes, wire_bytes=s.wire_bytes)
            for (o, g), s in sorted(self.stats.items())
        }

    def table(self) -> str:
        rows = [f"{'op/group':<28}{'calls':>8}{'bytes':>16}{'wire bytes':>16}"]
        for k, v in self.snapshot().items():
            rows.append(f"{k:<28}{v['calls']:>8}{v['bytes']:>16,}{v['wire_bytes']:>16,}")
        return "\n".join(rows)
