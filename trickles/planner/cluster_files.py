"""Named clusters and cluster files: :data:`PRESETS`, :func:`load_cluster` (a name or a TOML file) and
:func:`write_cluster` (the TOML :func:`load_cluster` reads back). The :class:`~trickles.planner.cluster.Cluster`
itself, its fields and what they mean, is :mod:`trickles.planner.cluster`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from typing import Any

from ..errors import ConfigError
from ..options import field_docs, section_from_dict
from ..process import cpu_cores
from .cluster import Cluster

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
    return Cluster(
        name="dgx-a100",
        device="cuda",
        nodes=1,
        devices_per_node=8,
        device_memory_gib=80.0,
        sm_count=108,
        peak_tflops_fp32=19.5,
        peak_tflops_bf16=312.0,
        peak_tflops_fp16=312.0,
        gemm_efficiency=0.75,
        memory_bandwidth_gbps=2039.0,
        intra_node_gbps=300.0,
        intra_node_latency_us=2.0,
        inter_node_gbps=25.0,
        inter_node_latency_us=5.0,
        link_efficiency=0.8,
        host_link_gbps=32.0,
        host_memory_gib=2048.0,
        host_memory_bandwidth_gbps=409.6,
    )


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
    return Cluster(
        name="dgx-h100",
        device="cuda",
        nodes=1,
        devices_per_node=8,
        device_memory_gib=80.0,
        sm_count=132,
        peak_tflops_fp32=66.9,
        peak_tflops_bf16=989.4,
        peak_tflops_fp16=989.4,
        gemm_efficiency=0.7,
        memory_bandwidth_gbps=3350.0,
        intra_node_gbps=450.0,
        intra_node_latency_us=2.0,
        inter_node_gbps=50.0,
        inter_node_latency_us=5.0,
        link_efficiency=0.8,
        host_link_gbps=64.0,
        host_memory_gib=2048.0,
        host_memory_bandwidth_gbps=614.4,
    )


def _local() -> Cluster:
    """This machine as CPU ranks talking gloo over loopback: one "device" per core this process may use, the
    machine's memory shared among them. The compute and link figures are deliberately conservative guesses for a
    modern x86 core (0.1 TFLOP/s fp32 and bf16, half efficiency, no wave quantization; loopback 1 GB/s at 50
    microseconds per message; across nodes, for a CPU cluster of several, 0.1 GB/s at 100); collectives do not
    overlap compute (gloo's threads copy and reduce on the same cores); :func:`~trickles.planner.calibrate.calibrate`
    measures the real ones."""
    cores = cpu_cores()
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        memory_gib = 8.0
    return Cluster(
        name="local",
        device="cpu",
        nodes=1,
        devices_per_node=cores,
        device_memory_gib=memory_gib / cores,
        sm_count=0,
        overlap_comm=False,
        peak_tflops_fp32=0.1,
        peak_tflops_bf16=0.1,
        peak_tflops_fp16=0.05,
        gemm_efficiency=0.5,
        memory_bandwidth_gbps=10.0,
        intra_node_gbps=1.0,
        intra_node_latency_us=50.0,
        inter_node_gbps=0.1,
        inter_node_latency_us=100.0,
        link_efficiency=1.0,
        host_link_gbps=10.0,
        host_memory_gib=memory_gib,
        host_memory_bandwidth_gbps=10.0 * cores,
    )


#: Named clusters: ``load_cluster("dgx-a100")``. Each function's docstring cites its numbers.
PRESETS = {"dgx-a100": _dgx_a100, "dgx-h100": _dgx_h100, "local": _local}


def preset(name: str) -> Cluster:
    """A fresh copy of preset ``name``; ConfigError suggesting the nearest name for an unknown one."""
    if name not in PRESETS:
        near = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.4)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(
            f"unknown cluster {name!r}; {hint}presets: {', '.join(PRESETS)} (or the path of a TOML cluster file)"
        )
    return PRESETS[name]()


def cluster_from_dict(table: dict[str, Any], where: str = "") -> Cluster:
    """A cluster from a ``[cluster]`` table: ``preset`` (optional) first, then the other keys over it."""
    table = dict(table)
    base = preset(str(table.pop("preset"))) if table.get("preset") is not None else None
    cluster = section_from_dict(Cluster, table, "cluster", base, where)
    cluster.validate()  # before the copies below, which need the tables to be tables
    cluster.gemm_table = dict(cluster.gemm_table)
    cluster.attention_table = dict(cluster.attention_table)
    cluster.collective_links = {
        k: list(v) if isinstance(v, (list, tuple)) else v for k, v in dict(cluster.collective_links).items()
    }
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
