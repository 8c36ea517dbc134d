"""What the planner knows about the machines: a :class:`Cluster`, named presets, TOML in and out.

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
TFLOP/s (10^12). Presets (:data:`PRESETS`) cite where each number comes from; :func:`load_cluster` takes a
preset name or a TOML file (a ``[cluster]`` table, which may start from ``preset = "dgx-a100"`` and override
keys), :func:`write_cluster` writes one back.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError
from ..options import field_docs, opt, section_from_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
    device: Literal["cuda", "cpu"] = opt("cuda", "cuda: one GPU per rank; cpu: ranks are processes sharing the node's cores (more ranks than devices_per_node divide them)")
    nodes: int = opt(1, "machines (the planner sizes it to the devices asked for: Cluster.sized)")
    devices_per_node: int = opt(8, "devices in each machine (cpu: cores)")
    device_memory_gib: float = opt(80.0, "memory of one device in GiB (cpu: the node's memory / devices_per_node)")
    peak_tflops_fp32: float = opt(19.5, "dense fp32 matmul peak of one device, TFLOP/s (GPUs: without TF32, PyTorch's default for matmuls)")
    peak_tflops_bf16: float = opt(312.0, "dense bf16 matmul peak of one device, TFLOP/s")
    peak_tflops_fp16: float = opt(312.0, "dense fp16 matmul peak of one device, TFLOP/s")
    gemm_efficiency: float = opt(0.75, "fraction of the peak a GEMM achieves where gemm_table has no shape near it")
    sm_count: int = opt(108, "streaming multiprocessors of one GPU: a GEMM's output tiles run in waves of this many (0: no wave quantization, e.g. CPUs)")
    gemm_tile_m: int = opt(256, "rows of the output tile one multiprocessor computes in a large GEMM (cuBLAS's largest half-precision tile)")
    gemm_tile_n: int = opt(128, "columns of that output tile")
    gemm_table: dict = opt({}, "achieved fraction of the peak by GEMM shape: 'precision:MxNxK' = fraction (calibrate fills it)")
    attention_table: dict = opt({}, "achieved fraction of the peak by the fused attention kernel, forward and backward: 'precision:QxKxD' (query rows, keys, head size) = fraction (calibrate fills it)")
    memory_bandwidth_gbps: float = opt(2039.0, "device memory bandwidth, GB/s (memory-bound work: optimizer step; element-wise kernels unless elementwise_gbps is set)")
    elementwise_gbps: float = opt(0.0, "bandwidth the model's element-wise work (norms, activations, rotary, softmax of the loss, autograd's copies) achieves, GB/s (calibrate fits it from the model's own block and head; 0: memory_bandwidth_gbps)")
    pass_overhead_us: float = opt(0.0, "fixed cost of one block's forward and backward for one micro-batch beyond its kernels (operator dispatch, autograd), microseconds (calibrate fits it; GPUs: 0, the host runs ahead of the kernels)")
    moe_pass_overhead_us: float = opt(0.0, "what a mixture-of-experts block's forward and backward costs beyond pass_overhead_us and its kernels (routing, sorting, gather and scatter as many small operations), microseconds (calibrate fits it on CPUs; 0: none)")
    intra_node_gbps: float = opt(300.0, "algorithm bandwidth per device per direction between devices of one node, GB/s")
    intra_node_latency_us: float = opt(2.0, "latency of one message between devices of one node, microseconds")
    collective_links: dict = opt({}, "intra-node line of each collective kind whose measured times differ from the shared one: op (all_reduce, all_gather, reduce_scatter, all_to_all, send) = [latency_us, GB/s] (calibrate fills it; a kind not listed uses intra_node_latency_us and intra_node_gbps)")
    inter_node_gbps: float = opt(25.0, "algorithm bandwidth per device per direction between nodes, GB/s")
    inter_node_latency_us: float = opt(5.0, "latency of one message between nodes, microseconds")
    overlap_comm: bool = opt(True, "collectives run beside compute (GPUs: NCCL on its own stream and SMs); never on CPUs (device = cpu), where gloo's copies and reductions need the cores the compute uses, so nothing hides")
    core_contention: float = opt(1.0, "CPU ranks with a core each: how much faster a core runs the model's block alone than while every core computes (they share memory bandwidth and caches), >= 1; a pipeline stage computing while its peers wait gains it (calibrate measures it; 1: none)")
    shared_core_sync_us: float = opt(0.0, "CPU ranks: extra wait of each blocking collective for peers arriving late (waiting their turn on a core where ranks outnumber the cores; the jitter of their compute), microseconds (calibrate measures it)")
    link_efficiency: float = opt(0.8, "fraction of the link bandwidths collectives achieve (nominal figures: ~0.8; measured ones: 1.0)")
    host_link_gbps: float = opt(32.0, "host<->device bandwidth per device per direction, GB/s (offloaded optimizer)")
    host_memory_gib: float = opt(2048.0, "host memory of one node, GiB")
    host_memory_bandwidth_gbps: float = opt(409.6, "host memory bandwidth of one node, GB/s (the offloaded optimizer step)")

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
        best, fraction = 3.0 + 1e-9, None
        for key, value in self.gemm_table.items():
            prec, m2, n2, k2 = parse_shape_key(key)
            if prec != precision:
                continue
            dist = sum(abs(math.log2(max(a, 1) / max(b, 1))) for a, b in ((m, m2), (n, n2), (k, k2)))
            if dist < best:
                best, fraction = dist, float(value)
        if fraction is not None:
            return fraction
        return self.gemm_efficiency * self.quantization(m, n, count)

    def attention_fraction(self, precision: str, q: int, k: int, d: int,
                           gemm: tuple[int, int, int, float] | None = None) -> float:
        """The fraction of the peak the attention core (``q`` query rows against ``k`` keys of head size ``d``, the
        FLOPs a causal kernel runs) achieves: ``attention_table``'s nearest entry within a factor of 8 overall (the
        fused kernel timed, forward and backward: its online softmax makes it no GEMM, on a CPU far from one), else
        the GEMM's own fraction (:meth:`gemm_fraction` of ``gemm``, ``(m, n, k, count)``; default the scores'
        ``[q, d] x [d, k]``)."""
        best, fraction = 3.0 + 1e-9, None
        for key, value in self.attention_table.items():
            prec, q2, k2, d2 = parse_shape_key(key)
            if prec != precision:
                continue
            dist = sum(abs(math.log2(max(a, 1) / max(b, 1))) for a, b in ((q, q2), (k, k2), (d, d2)))
            if dist < best:
                best, fraction = dist, float(value)
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
            return Link("inter-node", self.inter_node_latency_us * 1e-6, self.inter_node_gbps * 1e9 * self.link_efficiency)
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

    def sized(self, devices: int) -> "Cluster":
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
                raise ConfigError(f"cluster.collective_links: unknown collective {op!r}; one of {', '.join(COLLECTIVE_KINDS)}")
            ok = isinstance(line, (list, tuple)) and len(line) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in line)
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
        raise ConfigError(f"cluster.gemm_table key {key!r} must look like 'bf16:4096x1024x4096' (precision:MxNxK)") from None
    if prec not in PRECISIONS:
        raise ConfigError(f"cluster.gemm_table key {key!r}: precision must be one of {', '.join(PRECISIONS)}")
    return prec, m, n, k


# ---- presets --------------------------------------------------------------------------------

def _dgx_a100() -> Cluster:
    """NVIDIA DGX A100 (80 GB): 8 A100-SXM4-80GB per node.

    * 80 GB HBM2e, 2,039 GB/s; dense tensor-core peaks 312 TFLOP/s bf16 and fp16 (624 with 2:4 sparsity, not
      used), 19.5 TFLOP/s plain fp32 (TF32's 156 needs ``allow_tf32``, which PyTorch leaves off for matmuls) --
      NVIDIA A100 datasheet and Ampere architecture whitepaper.
    * NVLink 3 through NVSwitch: 600 GB/s per GPU in both directions together, i.e. 300 GB/s per direction
      (the whitepaper's "GPU to GPU communication peak at 600 GB/s"); nccl-tests reach about 230-240 GB/s bus
      bandwidth on 8 GPUs, hence ``link_efficiency`` 0.8.
    * 8 ConnectX-6 HDR InfiniBand adapters, 200 Gb/s each: one per GPU, 25 GB/s per direction.
    * PCIe Gen4 x16 to the host, 32 GB/s per direction (31.5 nominal); 2 AMD EPYC 7742 with 8 DDR4-3200
      channels each, 2 x 204.8 GB/s; 2 TB of host memory (the 640 GB system; the 320 GB one has 1 TB).
    * Latencies are estimates (NCCL's per-hop cost on NVLink is a few microseconds, over InfiniBand about 5);
      calibrate on the machine to replace them.
    * 108 streaming multiprocessors (whitepaper); 256 x 128 output tiles, cuBLAS's largest for half precision (the
      *Matrix Multiplication Background User's Guide*, "Typical Tile Dimensions In cuBLAS").
    """
    return Cluster(name="dgx-a100", device="cuda", nodes=1, devices_per_node=8, device_memory_gib=80.0, sm_count=108,
                   peak_tflops_fp32=19.5, peak_tflops_bf16=312.0, peak_tflops_fp16=312.0, gemm_efficiency=0.75,
                   memory_bandwidth_gbps=2039.0, intra_node_gbps=300.0, intra_node_latency_us=2.0, inter_node_gbps=25.0,
                   inter_node_latency_us=5.0, link_efficiency=0.8, host_link_gbps=32.0, host_memory_gib=2048.0,
                   host_memory_bandwidth_gbps=409.6)


def _dgx_h100() -> Cluster:
    """NVIDIA DGX H100: 8 H100-SXM5-80GB per node.

    * 80 GB HBM3, 3,350 GB/s; dense peaks 989.4 TFLOP/s bf16 and fp16 (1,979 with sparsity), 66.9 TFLOP/s fp32
      without TF32 -- NVIDIA H100 datasheet (SXM5), Hopper whitepaper.
    * NVLink 4 through NVSwitch: 900 GB/s per GPU both directions, 450 GB/s per direction.
    * 8 ConnectX-7 NDR InfiniBand adapters, 400 Gb/s each, one per GPU: 50 GB/s per direction.
    * PCIe Gen5 x16 to the host, 64 GB/s per direction (128 GB/s both ways); 2 Xeon Platinum 8480C with 8
      DDR5-4800 channels each, 2 x 307.2 GB/s; 2 TB of host memory.
    * Latencies: estimates, as for the A100 preset.
    * 132 streaming multiprocessors (SXM5, Hopper whitepaper); tiles as for the A100 preset.
    """
    return Cluster(name="dgx-h100", device="cuda", nodes=1, devices_per_node=8, device_memory_gib=80.0, sm_count=132,
                   peak_tflops_fp32=66.9, peak_tflops_bf16=989.4, peak_tflops_fp16=989.4, gemm_efficiency=0.7,
                   memory_bandwidth_gbps=3350.0, intra_node_gbps=450.0, intra_node_latency_us=2.0, inter_node_gbps=50.0,
                   inter_node_latency_us=5.0, link_efficiency=0.8, host_link_gbps=64.0, host_memory_gib=2048.0,
                   host_memory_bandwidth_gbps=614.4)


def _local() -> Cluster:
    """This machine as CPU ranks talking gloo over loopback: one "device" per core this process may use, the
    machine's memory shared among them. The compute and link figures are deliberately conservative guesses for a
    modern x86 core (0.1 TFLOP/s fp32 and bf16, half efficiency, no wave quantization; loopback 1 GB/s at 50
    microseconds per message); collectives do not overlap compute (gloo's threads copy and reduce on the same cores);
    :func:`~trickles.planner.calibrate.calibrate` measures the real ones."""
    from ..topology import cpu_cores

    cores = cpu_cores()
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        memory_gib = 8.0
    return Cluster(name="local", device="cpu", nodes=1, devices_per_node=cores, device_memory_gib=memory_gib / cores, sm_count=0,
                   overlap_comm=False,
                   peak_tflops_fp32=0.1, peak_tflops_bf16=0.1, peak_tflops_fp16=0.05, gemm_efficiency=0.5,
                   memory_bandwidth_gbps=10.0, intra_node_gbps=1.0, intra_node_latency_us=50.0, inter_node_gbps=0.1,
                   inter_node_latency_us=100.0, link_efficiency=1.0, host_link_gbps=10.0, host_memory_gib=memory_gib,
                   host_memory_bandwidth_gbps=10.0 * cores)


#: Named clusters: ``load_cluster("dgx-a100")``. Each function's docstring cites its numbers.
PRESETS = {"dgx-a100": _dgx_a100, "dgx-h100": _dgx_h100, "local": _local}


def preset(name: str) -> Cluster:
    """A fresh copy of preset ``name``; ConfigError suggesting the nearest name for an unknown one."""
    if name not in PRESETS:
        near = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.4)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"unknown cluster {name!r}; {hint}presets: {', '.join(PRESETS)} (or the path of a TOML cluster file)")
    return PRESETS[name]()


def cluster_from_dict(table: dict[str, Any], where: str = "") -> Cluster:
    """A cluster from a ``[cluster]`` table: ``preset`` (optional) first, then the other keys over it."""
    table = dict(table)
    base = preset(str(table.pop("preset"))) if table.get("preset") is not None else None
    cluster = section_from_dict(Cluster, table, "cluster", base, where)
    cluster.gemm_table = dict(cluster.gemm_table)
    cluster.attention_table = dict(cluster.attention_table)
    cluster.collective_links = {k: list(v) if isinstance(v, (list, tuple)) else v
                                for k, v in dict(cluster.collective_links).items()}
    cluster.validate()
    return cluster


def load_cluster(name_or_path: str | os.PathLike) -> Cluster:
    """A preset by name (:data:`PRESETS`), or a TOML file: a cluster file (:func:`write_cluster`) or a run's TOML,
    read from its ``[cluster]`` table (a file without one is read as the table itself). Unknown names raise
    ConfigError suggesting the nearest preset."""
    text = os.fspath(name_or_path)
    if text in PRESETS:
        return preset(text)
    if os.path.exists(text):
        try:
            with open(text, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"cluster file {text} is not valid TOML: {e}") from None
        table = data.get("cluster", data)
        if not isinstance(table, dict):
            raise ConfigError(f"cluster must be a table of keys ([cluster]) (in {text})")
        return cluster_from_dict(table, f" (in {text})")
    if text.endswith(".toml") or os.sep in text:
        raise ConfigError(f"cluster file {text} does not exist; give a preset ({', '.join(PRESETS)}) or a TOML file")
    return preset(text)


def cluster_toml(cluster: Cluster) -> str:
    """``cluster`` as a ``[cluster]`` table (each key after its description) that :func:`load_cluster` reads back."""
    docs = field_docs(Cluster)
    lines = ["[cluster]"]
    for f in dataclasses.fields(cluster):
        if f.name in ("gemm_table", "attention_table", "collective_links"):
            continue
        lines.append(f"# {docs[f.name]}")
        lines.append(f"{f.name} = {_toml(getattr(cluster, f.name))}")
    lines += ["", f"# {docs['gemm_table']}", "[cluster.gemm_table]"]
    lines += [f'"{k}" = {float(v)!r}' for k, v in sorted(cluster.gemm_table.items())]
    lines += ["", f"# {docs['attention_table']}", "[cluster.attention_table]"]
    lines += [f'"{k}" = {float(v)!r}' for k, v in sorted(cluster.attention_table.items())]
    lines += ["", f"# {docs['collective_links']}", "[cluster.collective_links]"]
    lines += [f"{k} = [{float(a)!r}, {float(b)!r}]" for k, (a, b) in sorted(cluster.collective_links.items())]
    return "\n".join(lines) + "\n"


def write_cluster(cluster: Cluster, path: str | os.PathLike) -> None:
    """Writes ``cluster`` to ``path`` as TOML (:func:`cluster_toml`)."""
    cluster.validate()
    with open(path, "w") as f:
        f.write(cluster_toml(cluster))


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
