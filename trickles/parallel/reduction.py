"""The data-parallel gradient reductions' buckets, and the bytes they send: stated once.

A data-parallel engine (:mod:`trickles.parallel.data`) reduces gradients bucket by bucket
(:class:`~trickles.parallel.data.flat.FlatLayout`): buckets of about ``parallel.bucket_mb`` MiB
(:func:`bucket_bytes`), the first at most :data:`FIRST_BUCKET_BYTES` so that communication starts early in
backward. :func:`reduction_wire_bytes` is what those reductions send in one optimizer step, per ZeRO stage; the
ledger is tested equal to it (``tests/distributed/test_zero.py``) and the planner's time model reads it
(:mod:`trickles.planner.traffic`).
"""

from __future__ import annotations

import math

from ..comm import wire_bytes

FIRST_BUCKET_BYTES = 1 << 20  # PyTorch DDP's first bucket: the output layer's gradients leave early


def bucket_bytes(mb: float) -> int | None:
    """``parallel.bucket_mb`` in bytes; None (no limit: one bucket per group) for 0 or infinity."""
    return None if mb <= 0 or math.isinf(mb) else int(mb * 2**20)


def reduction_wire_bytes(
    buckets: list[int],
    n: int,
    stage: int,
    micro_steps: int = 1,
    grad_bytes: int = 4,
    param_bytes: int = 4,
    pipelined: bool = False,
) -> dict[str, tuple[int, int]]:
    """``{op: (calls, bytes sent)}`` of one rank's data-parallel reductions in one optimizer step: the engine's
    collectives over the ``n`` ranks averaging these gradients, for ``buckets`` (each bucket's elements; the flat
    layout pads each to a multiple of ``16 n``), ``micro_steps`` backward passes per step, gradients of
    ``grad_bytes`` and parameters of ``param_bytes`` per element. Per bucket of ``S = grad_bytes x elements``
    (parameters ``S'``; wire bytes as :func:`trickles.comm.wire_bytes`, rounded per call as the ledger does):

    * stage 0 (:class:`~trickles.parallel.data.ddp.DataParallel`): one all-reduce, ``2 (n-1)/n S``, on the last
      micro-step;
    * stage 1: one reduce-scatter ``(n-1)/n S`` on the last micro-step, and after the optimizer step one
      all-gather of the new parameters, ``(n-1) S'/n`` -- in fp32 ZeRO's volume, the same as the all-reduce;
    * stage 2: the reduce-scatter on *every* micro-step, the all-gather once -- but once a step, as stage 1, on a
      pipeline stage (``pipelined``: its full gradient buffer during the step, :mod:`~trickles.parallel.data.zero`);
    * stage 3 (:class:`~trickles.parallel.data.zero3.Zero3DataParallel`, a unit per bucket): on every micro-step an
      all-gather for forward, another for backward and the gradient's reduce-scatter;
    * stages 1-3 also all-reduce the squared gradient norm over the owned elements (one fp32, once a step).

    (The trainer's mean-loss all-reduce, 4 bytes a step, is not the engine's.)"""
    if n <= 1 or not buckets:
        return {}
    k = len(buckets)

    def sent(op: str, element_bytes: int) -> int:
        return sum(
            int(round(wire_bytes(op, element_bytes * (e // n if op == "all_gather" else e), n))) for e in buckets
        )

    if stage == 0:
        return {"all_reduce": (k, sent("all_reduce", grad_bytes))}
    scatters = micro_steps if stage == 3 or (stage == 2 and not pipelined) else 1
    gathers = 2 * micro_steps if stage == 3 else 1
    return {
        "reduce_scatter": (scatters * k, scatters * sent("reduce_scatter", grad_bytes)),
        "all_gather": (gathers * k, gathers * sent("all_gather", param_bytes)),
        "all_reduce": (1, int(round(wire_bytes("all_reduce", 4, n)))),
    }
