"""Measuring this machine: GEMM throughput at a model's shapes, memory bandwidth, collectives among local ranks.

:func:`calibrate` starts from a cluster (the ``local`` preset by default) and replaces what it measures:

* **Compute** (:mod:`trickles.planner.calibrate_compute`): the GEMM rates at the model's shapes
  (``gemm_table``), the fused attention kernel's (``attention_table``), the memory bandwidth of a large copy and the
  model's own block and head passes, fitted to ``elementwise_gbps``, ``pass_overhead_us`` and
  ``moe_pass_overhead_us``.
* **Contention**: the largest block pass on one rank while the others wait, against its time per core while every
  rank computes (:func:`measure_on_ranks`): how much faster a core runs alone (memory bandwidth and caches are
  shared), ``core_contention``.
* **Collectives** (:mod:`trickles.planner.calibrate_comm`): the extra wait of a blocking collective for late
  peers (``shared_core_sync_us``) and all-reduce, all-gather, reduce-scatter, all-to-all and send among local
  ranks, fitted to the intra-node latency and bandwidth and the per-kind ``collective_links``.

Here: :func:`measure_on_ranks` (every measurement on every local rank at once, as in a training step),
:func:`cluster_from_measurements` (the measurements into a cluster) and :func:`calibrate`; the two modules'
functions are importable from here too. The fits live in :mod:`trickles.planner.linefit`. :func:`calibrate`
returns the :class:`~trickles.planner.cluster.Cluster` and, given ``path``, writes it as TOML
(:func:`~trickles.planner.cluster_files.write_cluster`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .calibrate_comm import COLLECTIVES, _measure_collectives, measure_links, measure_sync  # noqa: F401
from .calibrate_compute import (
    attention_shapes,
    fit_moe_pass,  # noqa: F401
    fit_passes,
    measure_attention,
    measure_gemms,
    measure_memory_bandwidth,
    measure_passes,
    model_shapes,
    pass_gemm_shapes,
    pass_sizes,
)
from .cluster import Cluster, shape_key
from .cluster_files import load_cluster, write_cluster
from .linefit import fit_link, fit_links, link_samples  # noqa: F401  (fit_link, link_samples: re-exported)


def measure_on_ranks(
    shapes: Sequence[tuple[int, int, int]],
    precision: str = "fp32",
    sizes: Sequence[int] = (4096, 65536, 1 << 20),
    repeats: int = 3,
    bandwidth_mib: int = 64,
    min_s: float = 0.05,
    attention: Sequence[tuple[int, int, int, int, int]] = (),
    model_cfg=None,
    pass_sizes: Sequence[tuple[int, int]] = (),
) -> dict:
    """On every rank of a CPU (gloo) group, collectively: the GEMM and attention rates and the memory bandwidth timed on
    every rank at once, one thread each, as in a training step; with more ranks than cores each rank gets
    ``cores / world`` of one, so a core's rate is the rank's times ``world / cores`` -- what a core does while the ranks
    take turns on it, context switches included (the time model divides it by the ranks again,
    :meth:`~trickles.planner.cluster.Cluster.compute_share`); each sample ``min_s`` long, so that it averages over the
    scheduler's time slices as a step does on a machine shared with other processes; then the collectives
    (:func:`_measure_collectives`). Returns ``{"gemms": {(m, n, k): FLOP/s}, "attention": {(q, k, d): FLOP/s},
    "bandwidth": bytes/s, "links": [(op, ranks, bytes, s)], "sync": seconds, "passes": {(sequences, tokens): (block s,
    head s)}}``, the rates (and the passes' times, scaled alike) the median over the ranks; ``attention``: the shapes
    for :func:`measure_attention`; ``sync``: :func:`measure_sync`; ``passes``: :func:`measure_passes` of ``model_cfg``
    at ``pass_sizes``; ``contention``: the largest block pass's time per core with every rank computing over its time on
    rank 0 alone (None without passes)."""
    import torch.distributed as dist

    from ..process import cpu_cores

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
    rates = torch.tensor(
        [
            [gemms.get(k, 0.0) for k in keys]
            + [att.get(k, 0.0) for k in att_keys]
            + [1.0 / t for k in pass_keys for t in passes[k]]
            + [bandwidth]
        ],
        dtype=torch.float64,
    )
    every = [torch.zeros_like(rates) for _ in range(world)]
    dist.all_gather(every, rates)
    med = (torch.cat(every).median(dim=0).values * per_core).tolist()
    at = len(keys) + len(att_keys)
    return {
        "gemms": {k: med[i] for i, k in enumerate(keys)},
        "attention": {k: med[len(keys) + i] for i, k in enumerate(att_keys)},
        "bandwidth": med[-1],
        "passes": {k: tuple(1.0 / med[at + per * i + j] for j in range(per)) for i, k in enumerate(pass_keys)},
        "contention": (1.0 / med[at + per * pass_keys.index(max(passes))]) / float(alone[0]) if passes else None,
        "links": _measure_collectives(list(sizes), repeats),
        "sync": measure_sync(repeats),
    }


def cluster_from_measurements(
    base: str | Cluster,
    precision: str,
    gemms: dict,
    bandwidth: float,
    links: Sequence[tuple[str, int, int, float]] = (),
    reference: tuple[int, int, int] | None = None,
    device: str = "cpu",
    attention: dict | None = None,
    sync: float | None = None,
    passes: dict | None = None,
    model_cfg=None,
    contention: float | None = None,
) -> Cluster:
    """``base`` with what was measured: ``gemms`` ``{(m, n, k): FLOP/s}`` (``reference``: the shape whose rate is
    ``gemm_efficiency``), ``attention`` ``{(q, k, d): FLOP/s}`` of the fused kernel, the memory ``bandwidth`` in
    bytes/s, the collective timings ``links`` fitted by :func:`fit_link` and ``sync`` seconds a blocking collective
    waits for ranks sharing cores (:func:`measure_sync`; module docstring); ``collective_links`` from the links'
    per-kind fits (:func:`fit_links`); ``passes`` (:func:`measure_passes` of ``model_cfg``) fitted to
    ``elementwise_gbps`` and ``pass_overhead_us`` (:func:`fit_passes`; an MoE block's extra,
    ``moe_pass_overhead_us``: :func:`fit_moe_pass`); ``contention``: ``core_contention`` (at
    least 1)."""
    cluster = base if isinstance(base, Cluster) else load_cluster(base)
    cluster = dataclasses.replace(
        cluster,
        gemm_table=dict(cluster.gemm_table),
        attention_table=dict(cluster.attention_table),
        collective_links=dict(cluster.collective_links),
    )
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


def calibrate(
    cfg=None,
    model_cfg=None,
    *,
    dims=None,
    shapes: Sequence[tuple[int, int, int]] | None = None,
    precision: str | None = None,
    device: str = "cpu",
    ranks: int = 2,
    sizes: Sequence[int] = (4096, 65536, 1 << 20),
    repeats: int = 3,
    base: str | Cluster = "local",
    path: str | None = None,
    reference: int = 512,
    bandwidth_mib: int = 64,
) -> Cluster:
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

        got = run_ranks(
            ranks,
            measure_on_ranks,
            shapes,
            precision,
            list(sizes),
            repeats,
            bandwidth_mib,
            0.05,
            att_shapes,
            model_cfg,
            sizes_p,
        )[0]
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
    cluster = cluster_from_measurements(
        base, precision, gemms, bandwidth, links, square, device, att, sync, passes, model_cfg, contention
    )
    if path is not None:
        write_cluster(cluster, path)
    return cluster
