"""``parallelize``: turn a single-device model into the configured parallel training setup.

The model arrives built on the meta device (no memory). For ZeRO stages 0-2 it is allocated on
the rank's device and initialized in full (every rank holds all parameters), then wrapped by
:class:`~trickles.parallel.data.DataParallel` (stage 0) or
:class:`~trickles.parallel.zero.ZeroDataParallel` (stages 1, 2). For stage 3 each transformer
block and the root become :class:`~trickles.parallel.zero3.Zero3DataParallel` units, and each
rank computes and keeps only its shard of every parameter.
"""

from __future__ import annotations

from ..config import Config
from ..models.transformer import Transformer, initial_value
from ..optim.adamw import AdamWSettings
from ..topology import Topology
from .data import DataParallel
from .engine import Engine, bucket_bytes
from .zero import ZeroDataParallel
from .zero3 import Zero3DataParallel


def parallelize(model: Transformer, topo: Topology, cfg: Config, seed: int) -> Engine:
    """The engine that trains ``model`` (built on the meta device) on ``topo`` as ``cfg`` says."""
    comm = topo.comm("dp")
    stage = cfg.parallel.zero
    optim = AdamWSettings.from_train(cfg.train)
    offload = cfg.memory.offload_optimizer
    if stage == 3:
        return Zero3DataParallel(model, comm, list(model.layers.values()), optim,
                                 lambda name, shape: initial_value(model.cfg, name, shape, seed), topo.device,
                                 offload=offload, prefetch=cfg.parallel.prefetch)
    model.to_empty(device=topo.device)
    model.init_weights(seed)
    if stage == 0:
        return DataParallel(model, comm, optim, bucket_bytes(cfg.parallel.bucket_mb))
    return ZeroDataParallel(model, comm, stage, optim, bucket_bytes(cfg.parallel.bucket_mb), offload)
