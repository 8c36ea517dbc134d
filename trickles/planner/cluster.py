"""What the planner knows about the machines: a :class:`Cluster`, its fields and the fractions of peak it derives.

A cluster is ``nodes`` x ``devices_per_node`` devices. The time model (:mod:`trickles.planner.cost`) reads:

* **compute**: the dense peak per device for each precision, times the fraction of it a GEMM of a given shape
  achieves (``gemm_table``, filled by :func:`~trickles.planner.calibrate.calibrate`; where the table has no shape
  near, ``gemm_efficiency`` times the GEMM's tile and wave quantization on a GPU, :meth:`Cluster.gemm_fraction`),
  the device memory bandwidth for memory-bound work (the optimizer step; the element-wise kernels at
  ``elementwise_gbps`` where a calibration fitted it to the model's own block) and a fixed cost per block pass
  (``pass_overhead_us``: operator dispatch, which a CPU pays in line and a GPU's host hides; an MoE block's
  extra, ``moe_pass_overhead_us``);
* **links**: a collective among ranks of one node runs on the intra-node link, one whose ranks sit on several
  nodes on the inter-node link (its slowest hop). Each link is a *per-message latency* ``alpha`` and an
  *algorithm bandwidth per device per direction* ``B``: what one rank can send while it receives as much, which
  is what the ring formulas' wire bytes (:func:`trickles.comm.wire_bytes`) are divided by, so that a collective
  takes ``messages x alpha + wire_bytes / (B x link_efficiency)`` (:func:`trickles.comm.messages`). On a DGX
  node every GPU has its own NVLink ports and its own InfiniBand adapter (rail-optimized), so ``B`` across nodes
  is one adapter's rate. Where a calibration measured the collective kinds apart and their times do not lie on one
  line (gloo's reduce-scatter is no plain ring), ``collective_links`` holds each kind's own intra-node
  ``(alpha, B)``, and a collective of that kind inside a node uses it (:meth:`Cluster.link` with ``op``); presets
  and unmeasured kinds keep the one line per link;
* **host**: the host<->device link (offloaded optimizer: gradients down, parameters up) and host memory and
  its bandwidth (the host optimizer step), per node.

Units: memory in GiB (2^30 bytes), bandwidths in GB/s (10^9 bytes/s), latencies in microseconds, FLOP/s in
TFLOP/s (10^12). Presets (:data:`~trickles.planner.cluster_files.PRESETS`) cite where each number comes from;
:func:`~trickles.planner.cluster_files.load_cluster` takes a preset name or a TOML file (a ``[cluster]`` table,
which may start from ``preset = "dgx-a100"`` and override keys), ``write_cluster`` writes one back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..options import opt

PRECISIONS = ("fp32", "bf16", "fp16")
#: The collective kinds a cluster may give their own intra-node line (``Cluster.collective_links``).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
#: Numeric keys for which 0 is meaningful (see each field).
ZERO_ALLOWED = ("sm_count", "shared_core_sync_us", "elementwise_gbps", "pass_overhead_us", "moe_pass_overhead_us")


@dataclass(frozen=True)
class Link:
    """One link of the time model: per-message latency (s) and achieved bandwidth per device per direction (B/s)."""

    name: str
    latency_s: float
    bandwidth_Bps: float

    def time(self, n_messages: float, wire_bytes: float) -> float:
        """``n_messages x latency + wire_bytes / bandwidth`` seconds."""
        return n_messages * self.latency_s + wire_bytes / self.bandwidth_Bps


@dataclass
class Cluster:
    """The machines a plan is for (the ``[cluster]`` table of a cluster file); see the module docstring."""

    name: str = opt("custom", "a name for reports (presets: their own)")
    device: Literal["cuda", "cpu"] = opt(
        "cuda",
        "cuda: one GPU per rank; cpu: ranks are processes sharing the node's cores (more ranks than devices_per_node "
        "divide them)",
    )
    nodes: int = opt(1, "machines (the planner sizes it to the devices asked for: Cluster.sized)")
    devices_per_node: int = opt(8, "devices in each machine (cpu: cores)")
    device_memory_gib: float = opt(80.0, "memory of one device in GiB (cpu: the node's memory / devices_per_node)")
    peak_tflops_fp32: float = opt(
        19.5, "dense fp32 matmul peak of one device, TFLOP/s (GPUs: without TF32, PyTorch's default for matmuls)"
    )
    peak_tflops_bf16: float = opt(312.0, "dense bf16 matmul peak of one device, TFLOP/s")
    peak_tflops_fp16: float = opt(312.0, "dense fp16 matmul peak of one device, TFLOP/s")
    gemm_efficiency: float = opt(0.75, "fraction of the peak a GEMM achieves where gemm_table has no shape near it")
    sm_count: int = opt(
        108,
        "streaming multiprocessors of one GPU: a GEMM's output tiles run in waves of this many (0: no wave "
        "quantization, e.g. CPUs)",
    )
    gemm_tile_m: int = opt(
        256,
        "rows of the output tile one multiprocessor computes in a large GEMM (cuBLAS's largest half-precision tile)",
    )
    gemm_tile_n: int = opt(128, "columns of that output tile")
    gemm_table: dict = opt(
        {}, "achieved fraction of the peak by GEMM shape: 'precision:MxNxK' = fraction (calibrate fills it)"
    )
    attention_table: dict = opt(
        {},
        "achieved fraction of the peak by the fused attention kernel, forward and backward: 'precision:QxKxD' (query "
        "rows, keys, head size) = fraction (calibrate fills it)",
    )
    memory_bandwidth_gbps: float = opt(
        2039.0,
        "device memory bandwidth, GB/s (memory-bound work: optimizer step; element-wise kernels unless "
        "elementwise_gbps is set)",
    )
    elementwise_gbps: float = opt(
        0.0,
        "bandwidth the model's element-wise work (norms, activations, rotary, softmax of the loss, autograd's "
        "copies) achieves, GB/s (calibrate fits it from the model's own block and head; 0: memory_bandwidth_gbps)",
    )
    pass_overhead_us: float = opt(
        0.0,
        "fixed cost of one block's forward and backward for one micro-batch beyond its kernels (operator dispatch, "
        "autograd), microseconds (calibrate fits it; GPUs: 0, the host runs ahead of the kernels)",
    )
    moe_pass_overhead_us: float = opt(
        0.0,
        "what a mixture-of-experts block's forward and backward costs beyond pass_overhead_us and its kernels "
        "(routing, sorting, gather and scatter as many small operations), microseconds (calibrate fits it on CPUs; "
        "0: none)",
    )
    intra_node_gbps: float = opt(
        300.0, "algorithm bandwidth per device per direction between devices of one node, GB/s"
    )
    intra_node_latency_us: float = opt(2.0, "latency of one message between devices of one node, microseconds")
    collective_links: dict = opt(
        {},
        "intra-node line of each collective kind whose measured times differ from the shared one: op (all_reduce, "
        "all_gather, reduce_scatter, all_to_all, send) = [latency_us, GB/s] (calibrate fills it; a kind not listed "
        "uses intra_node_latency_us and intra_node_gbps)",
    )
    inter_node_gbps: float = opt(25.0, "algorithm bandwidth per device per direction between nodes, GB/s")
    inter_node_latency_us: float = opt(5.0, "latency of one message between nodes, microseconds")
    overlap_comm: bool = opt(
        True,
        "collectives run beside compute (GPUs: NCCL on its own stream and SMs); never on CPUs (device = cpu), where "
        "gloo's copies and reductions need the cores the compute uses, so nothing hides",
    )
    core_contention: float = opt(
        1.0,
        "CPU ranks with a core each: how much faster a core runs the model's block alone than while every core "
        "computes (they share memory bandwidth and caches), >= 1; a pipeline stage computing while its peers wait "
        "gains it (calibrate measures it; 1: none)",
    )
    shared_core_sync_us: float = opt(
        0.0,
        "CPU ranks: extra wait of each blocking collective for peers arriving late (waiting their turn on a core "
        "where ranks outnumber the cores; the jitter of their compute), microseconds (calibrate measures it)",
    )
    link_efficiency: float = opt(
        0.8, "fraction of the link bandwidths collectives achieve (nominal figures: ~0.8; measured ones: 1.0)"
    )
    host_link_gbps: float = opt(32.0, "host<->device bandwidth per device per direction, GB/s (offloaded optimizer)")
    host_memory_gib: float = opt(2048.0, "host memory of one node, GiB")
    host_memory_bandwidth_gbps: float = opt(
        409.6, "host memory bandwidth of one node, GB/s (the offloaded optimizer step)"
    )

    # ---- derived -------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_memory_bytes(self) -> int:
        return int(self.device_memory_gib * 2**30)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s of one device at ``precision`` (fp32, bf16, fp16)."""
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        return getattr(self, f"peak_tflops_{precision}") * 1e12

    def gemm_fraction(self, precision: str, m: int, n: int, k: int, count: float = 1.0) -> float:
        """The fraction of the peak ``count`` ``[m, k] x [k, n]`` GEMMs (a batch) achieve: ``gemm_table``'s entry for
        the nearest calibrated shape of this precision (distance: ``sum |log2|`` of the three size ratios) when it is
        within a factor of 8 overall (measured, so quantization included); else ``gemm_efficiency`` (what a GEMM
        filling every multiprocessor achieves) times the tile and wave quantization of a GPU (NVIDIA, *Matrix
        Multiplication Background User's Guide*, "Dimension Quantization Effects"): the output is cut into
        ``ceil(m / tile_m) ceil(n / tile_n)`` tiles per GEMM, one per multiprocessor at a time, so they run in
        ``w = ceil(tiles x ceil(count) / sm_count)`` waves each as long as a full one, and the useful fraction is
        ``m n ceil(count) / (w sm_count tile_m tile_n)``. The largest tile is assumed (the library picks smaller ones
        where they waste less), so this bounds the loss from above. ``sm_count = 0`` or a CPU: no quantization."""
        fraction = _nearest(self.gemm_table, precision, (m, n, k))
        if fraction is not None:
            return fraction
        return self.gemm_efficiency * self.quantization(m, n, count)

    def attention_fraction(
        self, precision: str, q: int, k: int, d: int, gemm: tuple[int, int, int, float] | None = None
    ) -> float:
        """The fraction of the peak the attention core (``q`` query rows against ``k`` keys of head size ``d``, the
        FLOPs a causal kernel runs) achieves: ``attention_table``'s nearest entry within a factor of 8 overall (the
        fused kernel timed, forward and backward: its online softmax makes it no GEMM, on a CPU far from one), else
        the GEMM's own fraction (:meth:`gemm_fraction` of ``gemm``, ``(m, n, k, count)``; default the scores'
        ``[q, d] x [d, k]``)."""
        fraction = _nearest(self.attention_table, precision, (q, k, d))
        return fraction if fraction is not None else self.gemm_fraction(precision, *(gemm or (q, k, d, 1.0)))

    def quantization(self, m: int, n: int, count: float = 1.0) -> float:
        """The useful fraction of the waves of ``count`` GEMMs with ``[m, n]`` outputs (:meth:`gemm_fraction`)."""
        if self.device == "cpu" or self.sm_count <= 0 or m <= 0 or n <= 0:
            return 1.0
        batch = max(1, math.ceil(count))
        tiles = math.ceil(m / self.gemm_tile_m) * math.ceil(n / self.gemm_tile_n) * batch
        waves = math.ceil(tiles / self.sm_count)
        return m * n * batch / (waves * self.sm_count * self.gemm_tile_m * self.gemm_tile_n)

    @property
    def overlaps(self) -> bool:
        """Whether communication can hide behind compute: ``overlap_comm`` on GPUs, never on CPU ranks."""
        return self.overlap_comm and self.device != "cpu"

    def link(self, spans_nodes: bool, op: str | None = None) -> Link:
        """The link a group uses: across nodes if any of its ranks sit on different nodes, else inside one -- there
        collective kind ``op``'s own line where ``collective_links`` has one."""
        if spans_nodes:
            return Link(
                "inter-node", self.inter_node_latency_us * 1e-6, self.inter_node_gbps * 1e9 * self.link_efficiency
            )
        if op in self.collective_links:
            latency_us, gbps = self.collective_links[op]
            return Link(f"intra-node {op}", latency_us * 1e-6, gbps * 1e9 * self.link_efficiency)
        return Link("intra-node", self.intra_node_latency_us * 1e-6, self.intra_node_gbps * 1e9 * self.link_efficiency)

    @property
    def elementwise_Bps(self) -> float:
        """Bytes/s of the element-wise work (``elementwise_gbps``, else the memory bandwidth)."""
        return (self.elementwise_gbps or self.memory_bandwidth_gbps) * 1e9

    def host_link(self) -> Link:
        return Link("host", 10e-6, self.host_link_gbps * 1e9)

    def ranks_per_node(self, world: int) -> int:
        """Ranks placed on each node for a layout of ``world`` ranks (consecutive ranks fill a node first): a GPU per
        rank, so ``devices_per_node``; on CPUs every rank of the layout shares the nodes' cores."""
        if self.device == "cpu":
            return max(1, math.ceil(world / self.nodes))
        return self.devices_per_node

    def compute_share(self, world: int) -> float:
        """The fraction of one device a rank gets: 1 on GPUs; on CPUs ``devices_per_node / ranks per node`` when more
        ranks than cores share a node (at most 1)."""
        if self.device != "cpu":
            return 1.0
        return min(1.0, self.devices_per_node / self.ranks_per_node(world))

    def sized(self, devices: int) -> Cluster:
        """This cluster with as many nodes as ``devices`` devices need (CPU clusters keep their nodes)."""
        if self.device == "cpu":
            return dataclasses.replace(self)
        return dataclasses.replace(self, nodes=max(1, math.ceil(devices / self.devices_per_node)))

    def validate(self) -> None:
        """Raises ConfigError naming the key and what to change."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ZERO_ALLOWED and isinstance(v, (int, float)) and v >= 0:
                continue  # 0: no wave quantization, no wait, the memory bandwidth, no overhead
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"cluster.{f.name} must be a positive number, got {v!r}")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"cluster.device must be cuda or cpu, got {self.device!r}")
        if not 0 < self.gemm_efficiency <= 1 or not 0 < self.link_efficiency <= 1:
            raise ConfigError("cluster.gemm_efficiency and cluster.link_efficiency are fractions in (0, 1]")
        if not isinstance(self.collective_links, dict):
            raise ConfigError("cluster.collective_links must be a table of op = [latency_us, GB/s]")
        for op, line in self.collective_links.items():
            if op not in COLLECTIVE_KINDS:
                raise ConfigError(
                    f"cluster.collective_links: unknown collective {op!r}; one of {', '.join(COLLECTIVE_KINDS)}"
                )
            ok = (
                isinstance(line, (list, tuple))
                and len(line) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in line)
            )
            if not ok or line[0] < 0 or line[1] <= 0:
                raise ConfigError(f"cluster.collective_links[{op!r}] must be [latency_us >= 0, GB/s > 0], got {line!r}")
        for name in ("gemm_table", "attention_table"):
            table = getattr(self, name)
            if not isinstance(table, dict):
                raise ConfigError(f"cluster.{name} must be a table of 'precision:MxNxK' = fraction")
            for key, value in table.items():
                parse_shape_key(key)
                if not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise ConfigError(f"cluster.{name}[{key!r}] must be a fraction in (0, 1], got {value!r}")


def shape_key(precision: str, m: int, n: int, k: int) -> str:
    """``'bf16:4096x1024x4096'``: a ``gemm_table`` key."""
    return f"{precision}:{m}x{n}x{k}"


def parse_shape_key(key: str) -> tuple[str, int, int, int]:
    prec, _, dims = str(key).partition(":")
    try:
        m, n, k = (int(x) for x in dims.split("x"))
    except ValueError:
        raise ConfigError(
            f"cluster.gemm_table key {key!r} must look like 'bf16:4096x1024x4096' (precision:MxNxK)"
        ) from None
    if prec not in PRECISIONS:
        raise ConfigError(f"cluster.gemm_table key {key!r}: precision must be one of {', '.join(PRECISIONS)}")
    return prec, m, n, k


def _nearest(table: dict[str, float], precision: str, shape: tuple[int, int, int]) -> float | None:
    """The value of ``table``'s entry of ``precision`` nearest ``shape`` (distance ``sum |log2|`` of the three size
    ratios) when within a factor of 8 overall, else None."""
    best, fraction = 3.0 + 1e-9, None
    for key, value in table.items():
        prec, *dims = parse_shape_key(key)
        if prec != precision:
            continue
        dist = sum(abs(math.log2(max(a, 1) / max(b, 1))) for a, b in zip(shape, dims))
        if dist < best:
            best, fraction = dist, float(value)
    return fraction
