"""Measuring this machine: GEMM throughput at a model's shapes, memory bandwidth, collectives among local ranks.

:func:`calibrate` starts from a cluster (the ``local`` preset by default) and replaces what it measures:

* **GEMMs**: each distinct ``[M, K] x [K, N]`` of the model's forward on one rank
  (:mod:`trickles.planner.compute`, for the run's micro-batch and layout) and a square reference, timed on the
  run's device and precision (CPU: one thread, one core being one "device" of the ``local`` cluster, on every
  local rank at once -- what a core does while all the ranks compute and take turns on it --
  :func:`measure_on_ranks`). Each time is the median of its samples (:func:`_timeit`). On a CPU the fastest
  measured rate becomes the peak (nobody publishes one) and every shape's rate a fraction of it; on a GPU the peak
  is the datasheet's (:data:`trickles.train.flops.PEAKS`) where the device is known. The fractions fill
  ``gemm_table``.
* **Attention**: the fused kernel itself (``scaled_dot_product_attention``, forward and backward) at the run's
  per-rank shape (:func:`measure_attention`): it is no GEMM (its online softmax runs beside the products), and on a
  CPU it reaches a fraction of the matmul rate; the fractions fill ``attention_table``.
* **Memory bandwidth**: a large copy, ``2 x bytes / time`` (read and write).
* **Block passes**: the model's own block (a dense one) and its head (final norm, output layer, loss), forward and
  backward, at one sequence and at the run's micro-batch (:func:`measure_passes`): what they take beyond their
  GEMMs and attention (as the tables just measured predict them) is the element-wise work and a fixed cost per pass
  (operator dispatch, autograd). :func:`fit_passes` fits ``rest = passes x overhead + bytes / B`` over them, with
  ``bytes`` the element-wise bytes the time model counts (:mod:`trickles.planner.compute`): ``B`` fills
  ``elementwise_gbps`` and the overhead ``pass_overhead_us`` -- on a CPU the kernels run several times slower than
  a plain copy (small tensors, strided reads, fresh allocations), and a copy's bandwidth would miss that. A
  mixture-of-experts model's MoE block is timed too: what its tiny pass takes beyond a dense pass with its work
  (routing, sorting, gather and scatter: many small operations) fills ``moe_pass_overhead_us``
  (:func:`fit_moe_pass`).
* **Contention**: the largest block pass on one rank while the others wait, against its time per core while every
  rank computes (:func:`measure_on_ranks`): how much faster a core runs alone (memory bandwidth and caches are
  shared), ``core_contention``.
* **Late peers**: the extra wait a blocking collective costs between compute bursts (:func:`measure_sync`: with
  more ranks than cores a rank reaches it only on its turn on a core; with a core each, the bursts' jitter) fills
  ``shared_core_sync_us``.
* **Links**: ``ranks`` processes (:func:`trickles.testing.run_ranks`, gloo over loopback) time all-reduce,
  all-gather, reduce-scatter, all-to-all and a send of a few sizes; :func:`fit_link` fits
  ``time = messages x alpha + wire_bytes / B`` (:func:`trickles.comm.messages`, :func:`trickles.comm.wire_bytes`)
  by least squares over all of them, giving the intra-node latency and bandwidth (measured, so ``link_efficiency``
  1). A kind whose own timings that shared line misses (:func:`fit_links`: the median of ``|predicted / measured -
  1|`` over its sizes above ``tolerance``, 15%; gloo's reduce-scatter, for one, is no plain ring) gets its own
  line fitted to its timings alone, in ``collective_links``. One machine cannot measure an inter-node link: that
  stays the base cluster's.

The fits live in :mod:`trickles.planner.linefit`. :func:`calibrate` returns the
:class:`~trickles.planner.cluster.Cluster` and, given ``path``, writes it as TOML
(:func:`~trickles.planner.cluster.write_cluster`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Sequence

import torch

from .cluster import Cluster, load_cluster, shape_key, write_cluster
from .linefit import fit_link, fit_links, link_samples  # noqa: F401  (fit_link, link_samples: re-exported)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
TINY_PASS = 16  # tokens of the pass that measures the fixed cost


def _timeit(fn, repeats: int, min_s: float = 0.005) -> float:
    """Seconds one call of ``fn`` takes: the median of ``repeats`` samples, each a loop of as many calls as last at
    least ``min_s`` (so a short kernel's time is not the clock's resolution); the median rather than the fastest
    sample, so a machine that other processes share is measured as the steps that run on it see it."""
    t = time.perf_counter()
    fn()  # warm up, and how many calls make a sample
    calls = max(1, math.ceil(min_s / max(time.perf_counter() - t, 1e-9)))
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)



@contextlib.contextmanager
def _one_thread(dev: torch.device):
    """On a CPU, run the body on one thread (one core is one "device" of a CPU cluster), then restore the count."""
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

def measure_gemms(shapes: Sequence[tuple[int, int, int]], precision: str = "fp32", device: str = "cpu",
                  repeats: int = 3, min_s: float = 0.005) -> dict[tuple[int, int, int], float]:
    """``{(m, n, k): FLOP/s}`` of ``[m, k] x [k, n]`` matmuls on ``device`` in ``precision`` (CPU: one thread), each
    sample at least ``min_s`` seconds (:func:`_timeit`)."""
    dev = torch.device(device)
    dtype = DTYPES[precision]
    out = {}
    with _one_thread(dev):
        for m, n, k in shapes:
            a = torch.randn(m, k, device=dev).to(dtype)
            b = torch.randn(k, n, device=dev).to(dtype)

            def run():
                a @ b
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            out[(m, n, k)] = 2.0 * m * n * k / max(_timeit(run, repeats, min_s), 1e-9)
    return out


class _Loopback:
    """Rank 0 of a ring of ``size`` ranks whose exchanges are local copies (what :func:`measure_attention` times: the
    ring's compute, not its links): each receive gets what was sent."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def batch_p2p(self, ops):
        send = next(t for kind, t, _ in ops if kind == "send")
        for kind, t, _ in ops:
            if kind == "recv":
                t.copy_(send)
        return []


def measure_attention(shapes: Sequence[tuple[int, int, int, int, int]], precision: str = "fp32", device: str = "cpu",
                      repeats: int = 3, min_s: float = 0.005) -> dict[tuple[int, int, int], float]:
    """``{(q, k, d): FLOP/s}`` of the attention the model runs, forward and backward, for each
    ``(sequences, heads, q, k, d)``: ``q`` query rows against ``k`` keys of head size ``d``, causal. ``q == k``: the
    fused kernel (``scaled_dot_product_attention``); ``q < k``: rank 0's share of ring attention over
    ``cp = k / q`` ranks (:mod:`trickles.parallel.context`: its ``2 cp + 1`` blocks and their merges, forward and
    backward), the ring's exchanges a local copy (:class:`_Loopback`; the links are timed apart). The rate is
    counted as the time model counts it: ``3 x 2 x 2 q k d`` per sequence and head, halved for the causal mask."""
    import torch.nn.functional as F

    from ..parallel.context import ring_attention

    dev = torch.device(device)
    dtype = DTYPES[precision]
    out = {}
    with _one_thread(dev):
        for b, h, q, k, d in shapes:
            ring = q < k
            xq = torch.randn(b, h, q, d, device=dev, dtype=dtype, requires_grad=True)
            xk, xv = (torch.randn(b, h, q if ring else k, d, device=dev, dtype=dtype, requires_grad=True)
                      for _ in range(2))

            def run():
                if ring:
                    ring_attention(xq, xk, xv, _Loopback(k // q)).sum().backward()
                else:
                    F.scaled_dot_product_attention(xq, xk, xv, is_causal=True).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            flops = 3 * 4.0 * b * h * q * k * d * 0.5
            out[(q, k, d)] = flops / max(_timeit(run, repeats, min_s), 1e-9)
    return out


def measure_memory_bandwidth(device: str = "cpu", mib: int = 64, repeats: int = 3) -> float:
    """Bytes/s of a ``mib`` MiB copy (read + write) on one thread (CPU) or the device."""
    dev = torch.device(device)
    n = mib * 2**20 // 4
    a, b = torch.ones(n, device=dev), torch.empty(n, device=dev)
    with _one_thread(dev):
        def run():
            b.copy_(a)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        return 2 * n * 4 / max(_timeit(run, repeats), 1e-9)


def _block_model(model_cfg, moe: bool = False):
    """A one-block model of ``model_cfg``'s shape: a dense MLP (the block whose passes calibrate the element-wise
    work), or with ``moe`` a mixture of experts (learned routing: a hard route needs labels)."""
    from ..models.transformer import Transformer

    one = (dataclasses.replace(model_cfg, n_layers=1, moe_every=1, moe_router="learned") if moe else
           dataclasses.replace(model_cfg, n_layers=1, moe_experts=0))
    model = Transformer(one)
    model.init_weights(0)
    return model


def measure_passes(model_cfg, sizes: Sequence[tuple[int, int]], precision: str = "fp32", device: str = "cpu",
                   repeats: int = 3, min_s: float = 0.05) -> dict[tuple[int, int], tuple[float, float]]:
    """``{(sequences, tokens): (block seconds, head seconds[, MoE block seconds])}``: one dense block of
    ``model_cfg`` and its head (final norm, output layer and loss) -- and, for a mixture-of-experts model, one of its
    MoE blocks, every expert local -- each forward and backward on ``sequences x tokens`` inputs, on ``device`` in
    ``precision`` (CPU: one thread; :func:`_timeit`)."""
    dev = torch.device(device)
    dtype = DTYPES[precision]
    model = _block_model(model_cfg).to(dev, dtype)
    block, d = model.layers["0"], model_cfg.d_model
    moe = _block_model(model_cfg, True).to(dev, dtype).layers["0"] if model_cfg.moe_experts else None
    out = {}
    with _one_thread(dev):
        for b, t in sizes:
            x = torch.randn(b, t, d, device=dev, dtype=dtype, requires_grad=True)
            target = torch.randint(0, model_cfg.vocab_size, (b, t), device=dev)
            rope = model.rope(0, t)
            rope = tuple(r.to(dtype) for r in rope) if rope is not None else None

            def run_block():
                block(x, rope).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            def run_head():
                model.head(x, target).backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            def run_moe():
                moe(x, rope).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            runs = (run_block, run_head, run_moe) if moe is not None else (run_block, run_head)
            out[(b, t)] = tuple(_timeit(run, repeats, min_s) for run in runs)
    return out


def _pass_work(model_cfg, sequences: int, tokens: int, p: int):
    """``(block, head[, MoE block])`` :class:`~trickles.planner.compute.Work` of the passes :func:`measure_passes`
    times (:func:`_block_model`), on one rank, ``p`` bytes an element."""
    from ..topology import ParallelDims
    from .compute import block_work, head_work

    dense = dataclasses.replace(model_cfg, moe_experts=0)
    work = (block_work(dense, ParallelDims(), sequences, tokens, False, False, p),
            head_work(dense, ParallelDims(), sequences, tokens, False, p))
    if model_cfg.moe_experts:
        work += (block_work(model_cfg, ParallelDims(), sequences, tokens, True, False, p),)
    return work


def fit_passes(cluster: Cluster, model_cfg, passes: dict, precision: str, overhead: bool = True) -> tuple[float, float]:
    """``(bytes/s, seconds per pass)`` of the element-wise work and a pass's fixed cost (module docstring): for each
    measured block and head, ``rest`` = its time less its GEMMs and attention on ``cluster`` (whose tables are
    already filled), against the element-wise bytes ``x`` :mod:`trickles.planner.compute` counts for it (forward and
    backward: 3x the forward's), ``rest = o + s x``. The passes of at most :data:`TINY_PASS` tokens, whose kernels
    take next to nothing, pin the fixed cost (their mean: ``r_t = o + s x_t``) and the others the bandwidth ``1/s``
    (their sums: ``R = n o + s X``, which the largest passes dominate, as they do a step):
    ``s = (R - n r_t) / (X - n x_t)``. Without tiny passes, or where that gives a negative cost, or with
    ``overhead=False`` (a GPU, whose host queues the kernels ahead of them): ``o = 0``, ``s = R / X`` over the
    others. ``(0, 0)`` where nothing is left to fit."""
    from .cost import work_seconds

    p = 4 if precision == "fp32" else 2
    tiny, big = [], []  # (element-wise bytes of forward + backward, rest seconds)
    for (b, t), times in passes.items():
        for work, took in zip(_pass_work(model_cfg, b, t, p)[:2], times[:2]):
            gemm, _ = work_seconds(work, cluster, precision, 1.0)
            (tiny if b * t <= TINY_PASS else big).append((3 * work.elementwise_bytes, took - 3 * gemm))
    n, big_x, big_y = len(big), sum(x for x, _ in big), sum(y for _, y in big)
    if not big or big_x <= 0 or big_y <= 0:
        return 0.0, 0.0
    if overhead and tiny:
        x_t, r_t = (sum(v) / len(tiny) for v in zip(*tiny))
        if big_x > n * x_t:
            slope = (big_y - n * r_t) / (big_x - n * x_t)
            fixed = r_t - slope * x_t
            if slope > 0 and fixed >= 0:
                return 1.0 / slope, fixed
    return big_x / big_y, 0.0


def fit_moe_pass(cluster: Cluster, model_cfg, passes: dict, precision: str) -> float:
    """Seconds an MoE block's forward and backward takes beyond what a dense block's pass would cost with its work
    (module docstring): on the passes of at most :data:`TINY_PASS` tokens, the MoE block's time less its GEMMs and
    attention, its element-wise bytes at ``cluster``'s fitted bandwidth and one pass's fixed cost -- the routing,
    sorting, gather and scatter run as many small operations -- their mean, at least 0 (0 without tiny MoE passes)."""
    from .cost import work_seconds

    p = 4 if precision == "fp32" else 2
    extra = []
    for (b, t), times in passes.items():
        if b * t <= TINY_PASS and len(times) > 2:
            work = _pass_work(model_cfg, b, t, p)[2]
            gemm, elem = work_seconds(work, cluster, precision, 1.0)
            extra.append(times[2] - 3 * (gemm + elem) - cluster.pass_overhead_us * 1e-6)
    return max(0.0, sum(extra) / len(extra)) if extra else 0.0


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

            def run():
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


def measure_links(ranks: int = 2, sizes: Sequence[int] = (4096, 65536, 1 << 20), repeats: int = 5
                  ) -> list[tuple[str, int, int, float]]:
    """Collective timings among ``ranks`` local CPU ranks over gloo (:func:`_measure_collectives`)."""
    from ..testing import run_ranks

    if ranks < 2:
        raise ValueError("measuring links needs at least 2 ranks")
    return run_ranks(ranks, _measure_collectives, list(sizes), repeats)[0]


def model_shapes(cfg, model_cfg, dims=None) -> list[tuple[int, int, int]]:
    """The distinct GEMM shapes of one rank's forward for ``cfg``'s micro-batch (one block of each kind and the
    head), ``dims`` the layout (default one rank)."""
    from ..topology import ParallelDims
    from .compute import chunk_work

    dims = dims or ParallelDims()
    micro, _ = cfg.batch_plan(dims.dp)
    sp = cfg.parallel.sequence_parallel and dims.tp > 1
    p = 4 if cfg.memory.precision == "fp32" else 2
    layers = sorted({0, *model_cfg.moe_layers[:1]})
    work = chunk_work(model_cfg, dims, micro, cfg.data.seq_len, layers, True, sp, p, cp_mode=cfg.parallel.cp_mode)
    return sorted({(g.m, g.n, g.k) for g in work.gemms if min(g.m, g.n, g.k) > 0})


def measure_on_ranks(shapes: Sequence[tuple[int, int, int]], precision: str = "fp32",
                     sizes: Sequence[int] = (4096, 65536, 1 << 20), repeats: int = 3, bandwidth_mib: int = 64,
                     min_s: float = 0.05, attention: Sequence[tuple[int, int, int, int, int]] = (),
                     model_cfg=None, pass_sizes: Sequence[tuple[int, int]] = ()) -> dict:
    """On every rank of a CPU (gloo) group, collectively: the GEMM and attention rates and the memory bandwidth timed
    on every rank at once, one thread each, as in a training step; with more ranks than cores each rank gets
    ``cores / world`` of one, so a core's rate is the rank's times ``world / cores`` -- what a core does while the
    ranks take turns on it, context switches included (the time model divides it by the ranks again,
    :meth:`~trickles.planner.cluster.Cluster.compute_share`); each sample ``min_s`` long, so that it averages over the scheduler's
    time slices as a step does on a machine shared with other processes; then the collectives
    (:func:`_measure_collectives`). Returns
    ``{"gemms": {(m, n, k): FLOP/s}, "attention": {(q, k, d): FLOP/s}, "bandwidth": bytes/s, "links": [(op, ranks,
    bytes, s)], "sync": seconds, "passes": {(sequences, tokens): (block s, head s)}}``, the rates (and the passes'
    times, scaled alike) the median over the ranks; ``attention``: the shapes for :func:`measure_attention`;
    ``sync``: :func:`measure_sync`; ``passes``: :func:`measure_passes` of ``model_cfg`` at ``pass_sizes``;
    ``contention``: the largest block pass's time per core with every rank computing over its time on rank 0 alone
    (None without passes)."""
    import torch.distributed as dist

    from ..topology import cpu_cores

    world = dist.get_world_size()
    per_core = max(1.0, world / cpu_cores())
    gemms, bandwidth = {}, 0.0
    for shape in shapes:
        dist.barrier()
        gemms.update(measure_gemms([shape], precision, "cpu", repeats, min_s))
    att = {}
    for shape in attention:
        dist.barrier()
        att.update(measure_attention([shape], precision, "cpu", repeats, min_s))
    passes = {}
    for size in pass_sizes if model_cfg is not None else ():
        dist.barrier()
        passes.update(measure_passes(model_cfg, [tuple(size)], precision, "cpu", repeats, min_s))
    alone = torch.zeros(1, dtype=torch.float64)  # the largest block pass on rank 0 while the others wait
    if passes:
        dist.barrier()
        if dist.get_rank() == 0:
            alone[0] = measure_passes(model_cfg, [max(passes)], precision, "cpu", repeats, min_s)[max(passes)][0]
        dist.barrier()
        dist.broadcast(alone, 0)
    dist.barrier()
    bandwidth = measure_memory_bandwidth("cpu", bandwidth_mib, repeats)
    keys = [tuple(sh) for sh in shapes]
    att_keys = list(dict.fromkeys(tuple(sh[2:]) for sh in attention))
    pass_keys = list(passes)
    per = len(passes[pass_keys[0]]) if passes else 0  # timings per size: block, head[, MoE block]
    rates = torch.tensor([[gemms.get(k, 0.0) for k in keys] + [att.get(k, 0.0) for k in att_keys]
                          + [1.0 / t for k in pass_keys for t in passes[k]] + [bandwidth]], dtype=torch.float64)
    every = [torch.zeros_like(rates) for _ in range(world)]
    dist.all_gather(every, rates)
    med = (torch.cat(every).median(dim=0).values * per_core).tolist()
    at = len(keys) + len(att_keys)
    return {"gemms": {k: med[i] for i, k in enumerate(keys)},
            "attention": {k: med[len(keys) + i] for i, k in enumerate(att_keys)}, "bandwidth": med[-1],
            "passes": {k: tuple(1.0 / med[at + per * i + j] for j in range(per)) for i, k in enumerate(pass_keys)},
            "contention": (1.0 / med[at + per * pass_keys.index(max(passes))]) / float(alone[0]) if passes else None,
            "links": _measure_collectives(list(sizes), repeats), "sync": measure_sync(repeats)}


def cluster_from_measurements(base: str | Cluster, precision: str, gemms: dict, bandwidth: float,
                              links: Sequence[tuple[str, int, int, float]] = (),
                              reference: tuple[int, int, int] | None = None, device: str = "cpu",
                              attention: dict | None = None, sync: float | None = None,
                              passes: dict | None = None, model_cfg=None, contention: float | None = None) -> Cluster:
    """``base`` with what was measured: ``gemms`` ``{(m, n, k): FLOP/s}`` (``reference``: the shape whose rate is
    ``gemm_efficiency``), ``attention`` ``{(q, k, d): FLOP/s}`` of the fused kernel, the memory ``bandwidth`` in
    bytes/s, the collective timings ``links`` fitted by :func:`fit_link` and ``sync`` seconds a blocking collective
    waits for ranks sharing cores (:func:`measure_sync`; module docstring); ``collective_links`` from the links'
    per-kind fits (:func:`fit_links`); ``passes`` (:func:`measure_passes` of ``model_cfg``) fitted to
    ``elementwise_gbps`` and ``pass_overhead_us`` (:func:`fit_passes`; an MoE block's extra,
    ``moe_pass_overhead_us``: :func:`fit_moe_pass`); ``contention``: ``core_contention`` (at
    least 1)."""
    cluster = base if isinstance(base, Cluster) else load_cluster(base)
    cluster = dataclasses.replace(cluster, gemm_table=dict(cluster.gemm_table),
                                  attention_table=dict(cluster.attention_table),
                                  collective_links=dict(cluster.collective_links))
    if torch.device(device).type == "cuda":
        from ..train.flops import peak_flops

        peak = peak_flops(torch.device(device), precision) or max(gemms.values())
    else:
        peak = max(gemms.values())
    setattr(cluster, f"peak_tflops_{precision}", peak / 1e12)
    for (m, n, k), rate in gemms.items():
        cluster.gemm_table[shape_key(precision, m, n, k)] = round(min(1.0, rate / peak), 4)
    for (q, k, d), rate in (attention or {}).items():
        if rate > 0:
            cluster.attention_table[shape_key(precision, q, k, d)] = round(min(1.0, rate / peak), 4)
    ref = gemms.get(tuple(reference)) if reference is not None else None
    cluster.gemm_efficiency = round(min(1.0, (ref or max(gemms.values())) / peak), 4)
    cluster.memory_bandwidth_gbps = round(bandwidth / 1e9, 3)
    if torch.device(device).type == "cpu":
        cluster.host_link_gbps = round(bandwidth / 1e9, 3)
        cluster.host_memory_bandwidth_gbps = round(bandwidth / 1e9 * cluster.devices_per_node, 3)
    if links:
        (alpha, bw), own = fit_links(links)
        cluster.intra_node_latency_us = max(round(alpha * 1e6, 3), 1e-3)
        cluster.intra_node_gbps = round(bw / 1e9, 4) if bw != float("inf") else cluster.intra_node_gbps
        cluster.collective_links = {op: [round(a * 1e6, 3), round(b / 1e9, 4)] for op, (a, b) in sorted(own.items())}
        cluster.link_efficiency = 1.0
        if cluster.device == "cpu" and cluster.nodes == 1:  # no second node to measure: keep it no faster than this
            cluster.inter_node_gbps = min(cluster.inter_node_gbps, cluster.intra_node_gbps)
            cluster.inter_node_latency_us = max(cluster.inter_node_latency_us, cluster.intra_node_latency_us)
    if sync is not None:
        cluster.shared_core_sync_us = round(sync * 1e6, 3)
    if passes and model_cfg is not None:
        bandwidth, overhead = fit_passes(cluster, model_cfg, passes, precision, torch.device(device).type == "cpu")
        if bandwidth > 0:
            cluster.elementwise_gbps = round(bandwidth / 1e9, 4)
            cluster.pass_overhead_us = round(overhead * 1e6, 3)
            if torch.device(device).type == "cpu":
                cluster.moe_pass_overhead_us = round(fit_moe_pass(cluster, model_cfg, passes, precision) * 1e6, 3)
    if contention is not None and torch.device(device).type == "cpu":
        cluster.core_contention = round(max(1.0, contention), 3)
    cluster.name = f"{cluster.name}-calibrated" if not cluster.name.endswith("-calibrated") else cluster.name
    cluster.validate()
    return cluster


def attention_shapes(cfg, model_cfg, dims=None) -> list[tuple[int, int, int, int, int]]:
    """``(sequences, heads, q, k, d)`` of one rank's attention core for ``cfg``'s micro-batch on layout ``dims``,
    as :mod:`trickles.planner.compute` shapes it: local heads (``/ tp``) on ``q = k = T`` (causal); under ring
    context parallelism ``q = T / cp`` queries against all ``k = T`` keys (the ring, :func:`measure_attention`);
    under all-to-all (``ulysses``) whole sequences on ``1/cp`` of the heads."""
    from ..topology import ParallelDims

    dims = dims or ParallelDims()
    micro, _ = cfg.batch_plan(dims.dp)
    seq = cfg.data.seq_len
    heads = max(1, model_cfg.n_heads // dims.tp)
    if dims.cp > 1 and cfg.parallel.cp_mode == "ring":
        return [(micro, heads, seq // dims.cp, seq, model_cfg.head_dim)]
    if dims.cp > 1:
        heads = max(1, heads // dims.cp)
    return [(micro, heads, seq, seq, model_cfg.head_dim)]


def pass_sizes(cfg, dims=None) -> list[tuple[int, int]]:
    """``(sequences, tokens)`` at which :func:`measure_passes` times the block and head: one sequence and the run's
    micro-batch on layout ``dims``, of the run's sequence length, and one sequence of :data:`TINY_PASS` tokens (its
    kernels take next to nothing: the fixed cost)."""
    from ..topology import ParallelDims

    micro, _ = cfg.batch_plan((dims or ParallelDims()).dp)
    seq = cfg.data.seq_len
    return sorted({(1, min(TINY_PASS, seq)), (1, seq), (micro, seq)})


def pass_gemm_shapes(model_cfg, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The GEMM shapes of the dense block and head :func:`measure_passes` times (so :func:`fit_passes` finds them in
    the table)."""
    out = set()
    for b, t in sizes:
        for work in _pass_work(model_cfg, b, t, 4):
            out.update((g.m, g.n, g.k) for g in work.gemms if g.name not in ("scores", "weighted"))
    return sorted(out)


def calibrate(cfg=None, model_cfg=None, *, dims=None, shapes: Sequence[tuple[int, int, int]] | None = None,
              precision: str | None = None, device: str = "cpu", ranks: int = 2,
              sizes: Sequence[int] = (4096, 65536, 1 << 20), repeats: int = 3, base: str | Cluster = "local",
              path: str | None = None, reference: int = 512, bandwidth_mib: int = 64) -> Cluster:
    """Measures this machine (module docstring) and returns ``base`` with the measured numbers (written to ``path``
    as TOML when given).

    ``cfg``/``model_cfg`` (a :class:`~trickles.config.Config` and its resolved model): the GEMM shapes and the
    precision to time (or ``shapes`` and ``precision`` directly); ``dims``: the layout whose per-rank shapes to
    time; ``ranks``: local processes for the links (``0``: do not measure them; on a CPU they also time the GEMMs,
    :func:`measure_on_ranks`); ``sizes``: collective input bytes; ``reference``: the square GEMM that anchors a
    CPU's peak."""

    precision = precision or (cfg.memory.precision if cfg is not None else "fp32")
    if shapes is None:
        shapes = model_shapes(cfg, model_cfg, dims) if cfg is not None and model_cfg is not None else []
    square = (reference, reference, reference)
    with_model = cfg is not None and model_cfg is not None
    sizes_p = pass_sizes(cfg, dims) if with_model else []
    shapes = list(dict.fromkeys([*[tuple(s) for s in shapes], *pass_gemm_shapes(model_cfg, sizes_p), square]))
    att_shapes = attention_shapes(cfg, model_cfg, dims) if with_model else []
    links: list = []
    if ranks >= 2 and torch.device(device).type == "cpu":
        from ..testing import run_ranks

        got = run_ranks(ranks, measure_on_ranks, shapes, precision, list(sizes), repeats, bandwidth_mib, 0.05,
                        att_shapes, model_cfg, sizes_p)[0]
        gemms, att, bandwidth, links = got["gemms"], got["attention"], got["bandwidth"], got["links"]
        sync = got["sync"]
        passes, contention = got["passes"], got["contention"]
    else:
        gemms = measure_gemms(shapes, precision, device, repeats)
        att = measure_attention(att_shapes, precision, device, repeats)
        passes = measure_passes(model_cfg, sizes_p, precision, device, repeats) if with_model else {}
        sync = contention = None
        bandwidth = measure_memory_bandwidth(device, bandwidth_mib, repeats)
        if ranks >= 2:
            links = measure_links(ranks, sizes, repeats)
    cluster = cluster_from_measurements(base, precision, gemms, bandwidth, links, square, device, att, sync, passes,
                                        model_cfg, contention)
    if path is not None:
        write_cluster(cluster, path)
    return cluster
