"""Timing collectives among local ranks for the calibration: links' latency and bandwidth, the wait for late peers.

:func:`~trickles.planner.calibrate.calibrate` times these on this machine (gloo over loopback) and fills the
cluster's intra-node link numbers with them:

* **Late peers**: the extra wait a blocking collective costs between compute bursts (:func:`measure_sync`: with
  more ranks than cores a rank reaches it only on its turn on a core; with a core each, the bursts' jitter) fills
  ``shared_core_sync_us``.
* **Links**: ``ranks`` processes (:func:`trickles.testing.run_ranks`, gloo over loopback) time all-reduce,
  all-gather, reduce-scatter, all-to-all and a send of a few sizes; :func:`~trickles.planner.linefit.fit_link` fits
  ``time = messages x alpha + wire_bytes / B`` (:func:`trickles.comm.messages`, :func:`trickles.comm.wire_bytes`)
  by least squares over all of them, giving the intra-node latency and bandwidth (measured, so ``link_efficiency``
  1). A kind whose own timings that shared line misses (:func:`~trickles.planner.linefit.fit_links`: the median
  of ``|predicted / measured - 1|`` over its sizes above ``tolerance``, 15%; gloo's reduce-scatter, for one, is no
  plain ring) gets its own line fitted to its timings alone, in ``collective_links``. One machine cannot measure an
  inter-node link: that stays the base cluster's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def measure_sync(repeats: int = 3, bursts: int = 12, burst_s: float = 0.01) -> float:
    """On every rank of a CPU group, collectively: the extra wait one blocking collective costs when the ranks
    compute between collectives, as a training step does, beyond the compute and the collective's own time -- with
    more ranks than cores, a rank reaches the collective only when the scheduler gives it its turn, and its peers wait
    for that. Each rank runs ``bursts`` compute bursts (GEMMs lasting ``burst_s`` alone on a core) once with a
    4-byte all-reduce after each and once without (a barrier only at the end), the extra per collective
    ``(t_with - t_without) / bursts - t_allreduce`` (its time on idle ranks), the slowest rank's, the median of
    ``repeats`` tries, at least 0."""
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        calls = max(1, round(burst_s / max((time.perf_counter() - t) / 10, 1e-9)))
        flag = torch.zeros(1)

        def run(sync: bool) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(bursts):
                for _ in range(calls):
                    a @ b
                if sync:
                    dist.all_reduce(flag)
            dist.barrier()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took)

        def idle_allreduce() -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(bursts):
                dist.all_reduce(flag)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took) / bursts

        run(True)
        extra = [(run(True) - run(False)) / bursts - idle_allreduce() for _ in range(max(1, repeats))]
        return max(0.0, statistics.median(extra))
    finally:
        torch.set_num_threads(threads)


def _measure_collectives(sizes: Sequence[int], repeats: int) -> list[tuple[str, int, int, float]]:
    """On every rank of a run_ranks pool: ``(op, ranks, input bytes, seconds)`` for each collective and size (the
    slowest rank's time: the collective is over when every rank is done)."""
    import torch.distributed as dist

    from ..comm import _all_gather_single, _reduce_scatter_single

    world = dist.get_world_size()
    rank = dist.get_rank()
    out = []
    for op in COLLECTIVES:
        for size in sizes:
            elements = max(world, size // 4 // world * world)
            x = torch.ones(elements)
            shard = torch.ones(elements // world)
            y = torch.empty_like(x)

            def run(op=op, x=x, shard=shard, y=y):
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "all_gather":
                    _all_gather_single(x, shard)
                elif op == "reduce_scatter":
                    _reduce_scatter_single(shard, x)
                elif op == "all_to_all":
                    dist.all_to_all_single(y, x)
                elif rank == 0:
                    dist.send(x, 1)
                elif rank == 1:
                    dist.recv(x, 0)

            times = []
            run()
            for _ in range(max(1, repeats)):
                dist.barrier()
                t = time.perf_counter()
                run()
                took = torch.tensor([time.perf_counter() - t])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times.append(float(took))
            nbytes = (elements // world if op == "all_gather" else elements) * 4
            out.append((op, world, nbytes, statistics.median(times)))
    return out


def measure_links(
    ranks: int = 2, sizes: Sequence[int] = (4096, 65536, 1 << 20), repeats: int = 5
) -> list[tuple[str, int, int, float]]:
    """Collective timings among ``ranks`` local CPU ranks over gloo (:func:`_measure_collectives`)."""
    from ..testing import run_ranks

    if ranks < 2:
        raise ValueError("measuring links needs at least 2 ranks")
    return run_ranks(ranks, _measure_collectives, list(sizes), repeats)[0]
