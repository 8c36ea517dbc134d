"""Collectives with byte accounting, and the autograd-aware versions parallel layers use.

One module per idea; every name is importable from ``trickles.comm``:

* :mod:`~trickles.comm.ledger` -- the bytes and sequential messages of each collective under the ring / pairwise
  algorithms (:func:`wire_bytes`, :func:`messages`), and the :class:`CommLedger` that counts calls and bytes per
  operation and group;
* :mod:`~trickles.comm.recorder` -- ``flight``, the :class:`FlightRecorder` of the communication call this process
  is blocked in (read by the hang watchdog, the test harness and the scaling report);
* :mod:`~trickles.comm.group` -- :class:`GroupComm`, the counted collectives and point-to-point operations of one
  process group, and :class:`Handle` for the asynchronous ones;
* :mod:`~trickles.comm.autograd` -- the autograd-aware conjugate pairs (``copy_to_region``, ``reduce_from_region``,
  ``scatter_to_region``, ``gather_from_region``, ``gather_sequence``, ``reduce_scatter_sequence``, ``all_to_all``).
"""

from .autograd import (
    all_to_all,
    copy_to_region,
    gather_from_region,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_to_region,
)
from .group import GroupComm, Handle, _all_gather_single, _reduce_scatter_single  # noqa: F401 (the private two: planner/calibrate.py)
from .ledger import OPS, CommLedger, OpStats, messages, wire_bytes
from .recorder import FlightRecorder, flight

__all__ = [
    "OPS",
    "CommLedger",
    "FlightRecorder",
    "GroupComm",
    "Handle",
    "OpStats",
    "all_to_all",
    "copy_to_region",
    "flight",
    "gather_from_region",
    "gather_sequence",
    "messages",
    "reduce_from_region",
    "reduce_scatter_sequence",
    "scatter_to_region",
    "wire_bytes",
]
