"""``parallel.elastic``: a run, or a restart, on a number of processes its degrees do not fit trains on the planner's
layout for that number instead of stopping.

When the configured ``parallel.dp x tp x pp x cp`` cannot be laid over the ``N`` processes at hand (a job restarted
on fewer nodes, torchrun's ``--nnodes MIN:MAX``, a plain restart with another ``--nproc``),
:func:`layout_for_world` searches every layout of ``N`` devices (:class:`~trickles.planner.search.Search`) for the
same model, precision and global batch -- every layout key free, as ``trickles plan`` with nothing pinned -- and
returns the configuration with the fastest one that fits, on the machines the run is on (:func:`run_cluster`): the
run's ``[cluster]`` table when it has one, else the kind of device its ranks train on (:class:`DeviceKind`): a GPU
as the preset of its name (:data:`GPU_PRESETS`) with its own memory and multiprocessors, this machine's ranks to a
node; CPU ranks as the ``local`` preset (this machine's cores and memory).

The layout is planned once: by the one process that launches the ranks (``trickles train --nproc``), or, when every
rank starts on its own (torchrun), by rank 0 of the job, which sends it to the others over the default process group
before any of the layout's groups exist (:func:`agreed_layout`) -- every rank takes the same layout, whatever it
sees of its own machine (CPU affinity, memory, a different GPU). Rank 0 prints the old and the new layout in one
line. The global batch is unchanged (the micro-batch and gradient accumulation absorb the change), so the data order
continues exactly from the checkpoint's consumed samples, and the checkpoint reshards on load
(:mod:`trickles.train.checkpoint`): what a restart at the old layout would have trained, to the precision of the
layouts' arithmetic.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config
from ..errors import ConfigError
from ..process import init_distributed, select_device
from ..topology import ParallelDims
from ..watchdog import backstop_timeout
from .cluster import Cluster
from .cluster_files import cluster_from_dict, preset
from .search import Search, plan_model

#: GPUs by a word of their name (``torch.cuda.get_device_name``, e.g. ``NVIDIA H100 80GB HBM3``): the preset of their
#: kind and what differs from it. The H200 is the H100's chip (the same peaks and links) with 141 GB of HBM3e at
#: 4.8 TB/s (NVIDIA H200 datasheet); the A800 and H800 are the A100 and H100 with slower NVLink (400 GB/s both
#: directions); every GPU's own memory and multiprocessor count replace the preset's (:func:`cluster_for_device`).
GPU_PRESETS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H200", "dgx-h100", {"memory_bandwidth_gbps": 4800.0}),
    ("H800", "dgx-h100", {"intra_node_gbps": 200.0}),
    ("H100", "dgx-h100", {}),
    ("A800", "dgx-a100", {"intra_node_gbps": 200.0}),
    ("A100", "dgx-a100", {}),
)
#: The preset a GPU of no known name plans with (its memory and multiprocessors its own).
OTHER_GPU = "dgx-a100"


@dataclass(frozen=True)
class DeviceKind:
    """What the planner takes from the device a rank trains on: ``cuda`` or ``cpu``, and a GPU's name, memory and
    streaming multiprocessors."""

    type: str
    name: str = ""
    memory_gib: float = 0.0
    sm_count: int = 0

    @classmethod
    def from_properties(cls, props) -> DeviceKind:
        """A GPU from ``torch.cuda.get_device_properties`` (or anything with its ``name``, ``total_memory`` in
        bytes and ``multi_processor_count``)."""
        return cls("cuda", str(props.name), props.total_memory / 2**30, int(props.multi_processor_count))

    @classmethod
    def of(cls, device: torch.device) -> DeviceKind:
        return cls.from_properties(torch.cuda.get_device_properties(device)) if device.type == "cuda" else cls("cpu")


def detect_device(preference: str = "auto", local_ranks: int | None = None) -> DeviceKind:
    """The kind of device this machine's ranks train on (``train.device``, as
    :func:`~trickles.process.select_device` chooses it for ``local_ranks`` ranks here; default: the launcher's
    ``LOCAL_WORLD_SIZE``)."""
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = select_device(preference)
    if device.type == "cuda" and preference == "auto" and local_ranks > torch.cuda.device_count():
        device = torch.device("cpu")  # select_device's rule for more ranks than GPUs, seen before the ranks start
    return DeviceKind.of(device)


def cluster_for_device(kind: DeviceKind, local_ranks: int = 1) -> Cluster:
    """The cluster of ``kind``'s machines with ``local_ranks`` ranks on each: a GPU's preset (:data:`GPU_PRESETS`,
    else :data:`OTHER_GPU`) with its own memory and multiprocessors and a GPU per local rank; CPUs: ``local``."""
    if kind.type != "cuda":
        return preset("local")
    found = next(((p, c) for word, p, c in GPU_PRESETS if word in kind.name.upper()), None)
    base, changes = found or (OTHER_GPU, {})
    figures = preset(base)
    return dataclasses.replace(
        figures,
        name=f"{kind.name or 'a GPU'} ({base}{'' if found else ' figures: an unknown GPU'})",
        devices_per_node=max(1, local_ranks),
        device_memory_gib=kind.memory_gib or figures.device_memory_gib,
        sm_count=kind.sm_count or figures.sm_count,
        **changes,
    )


def run_cluster(cfg: Config, world: int, kind: DeviceKind | None = None) -> Cluster:
    """The machines a run of ``world`` ranks is on: its ``[cluster]`` table when it has one, else
    :func:`cluster_for_device` of ``kind`` (default: :func:`detect_device` for ``train.device``) with the launcher's
    ``LOCAL_WORLD_SIZE`` ranks to a machine (not launched yet: all ``world`` on this one)."""
    if cfg.cluster:
        return cluster_from_dict(cfg.cluster, " (the run's [cluster])")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return cluster_for_device(kind or detect_device(cfg.train.device, local_ranks), local_ranks)


def fits(cfg: Config, world: int) -> bool:
    """Whether the configured degrees lay over ``world`` processes."""
    p = cfg.parallel
    try:
        dims = ParallelDims.infer(
            world, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, tp_mode=p.tp_mode, tp_depth=p.tp_depth
        )
    except ConfigError:
        return False
    return dims.world_size == world


def layout_for_world(cfg: Config, world: int, cluster: Cluster | None = None) -> tuple[Config, str | None]:
    """``(cfg, None)`` when its degrees fit ``world`` processes or ``parallel.elastic`` is off (validation then says
    what to change); else ``(cfg on the planner's fastest layout of world devices of cluster, the line saying so)``.
    ``cluster``: default :func:`run_cluster`, as this process sees it (ranks of a job: :func:`agreed_layout`)."""
    if not cfg.parallel.elastic or fits(cfg, world):
        return cfg, None
    cluster = cluster or run_cluster(cfg, world)
    p = cfg.parallel
    old = f"dp{'?' if p.dp == -1 else p.dp} tp{p.tp} pp{p.pp} cp{p.cp}"
    top = Search(cfg, plan_model(cfg), cluster, world, pins=set()).run().top(1)
    if not top:
        raise ConfigError(
            f"parallel.elastic: no layout of {world} processes on {cluster.name} fits this model and "
            f"train.global_batch={cfg.train.global_batch}; launch another number of processes"
        )
    new = top[0].layout
    return new.apply(cfg), (
        f"[trickles] parallel.elastic: the layout {old} does not fit {world} processes; training on "
        f"{new.label()} (the planner's fastest that fits on {cluster.name}), same global batch and data order"
    )


def agreed_layout(cfg: Config, world: int, cluster: Cluster | None = None) -> tuple[Config, str | None]:
    """:func:`layout_for_world` for one rank of a job of ``world`` ranks, planned by rank 0 alone: the ranks join
    the default process group (they would next; none of the layout's groups exists yet) and rank 0's answer -- the
    layout, or the error that none fits -- is broadcast to all, so every rank takes the same layout whatever its own
    view of the machines (``cluster``: this rank's, default :func:`run_cluster`); when rank 0 fails to plan, every
    rank raises (a ConfigError as rank 0's own). One process plans alone."""
    if not cfg.parallel.elastic or fits(cfg, world):
        return cfg, None
    if world == 1:
        return layout_for_world(cfg, world, cluster)
    init_distributed(select_device(cfg.train.device), backstop_timeout(cfg.parallel.timeout_s).total_seconds())
    answer: list[tuple] = [()]
    failure = None
    if dist.get_rank() == 0:
        try:
            answer[0] = ("layout", layout_for_world(cfg, world, cluster))
        except Exception as e:  # sent too: no rank waits for a layout that is not coming
            user = isinstance(e, ConfigError)
            failure, answer[0] = e, ("error", user, str(e) if user else f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(answer, src=0)
    if failure is not None:
        raise failure
    if answer[0][0] == "error":
        _, user, message = answer[0]
        raise (ConfigError if user else RuntimeError)(
            message if user else f"parallel.elastic: rank 0 could not plan the layout ({message})"
        )
    return answer[0][1]
