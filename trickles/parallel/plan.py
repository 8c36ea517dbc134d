"""``parallelize``: turn a single-device model into the configured parallel training setup.

The model arrives built on the meta device (no memory). Recomputation (``memory.recompute``)
wraps its blocks first; parameters take the precision policy's type (``memory.precision``). For ZeRO stages 0-2 it is allocated on
the rank's device and initialized in full (every rank holds all parameters), then wrapped by
:class:`~trickles.parallel.data.DataParallel` (stage 0) or
:class:`~trickles.parallel.zero.ZeroDataParallel` (stages 1, 2). For stage 3 each transformer
block and the root become :class:`~trickles.parallel.zero3.Zero3DataParallel` units, and each
rank computes and keeps only its shard of every parameter.
"""

from __future__ import annotations

import torch

from ..config import Config
from ..memory.precision import policy
from ..memory.recompute import apply_recompute
from ..models.transformer import Transformer, initial_value
from ..optim.adamw import AdamWSettings
from ..topology import Topology
from .data import DataParallel
from .engine import Engine, bucket_bytes
from .zero import ZeroDataParallel
from .zero3 import Zero3DataParallel


def parallelize(model: Transformer, topo: Topology, cfg: Config, seed: int) -> Engine:
    """The engine that trains ``model`` (built on the meta device) on ``topo`` as ``cfg`` says.

    Order: recomputation wrappers, then parameters in the precision policy's type (initialized
    in fp32 and rounded), then the data-parallel engine (fp32 master weights inside its optimizer).
    """
    comm = topo.comm("dp")
    stage = cfg.parallel.zero
    optim = AdamWSettings.from_train(cfg.train)
    offload = cfg.memory.offload_optimizer
    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    apply_recompute(model, cfg.memory.recompute)
    if stage == 3:
        return Zero3DataParallel(model, comm, list(model.layers.values()), optim,
                                 lambda name, shape: initial_value(model.cfg, name, shape, seed), topo.device,
                                 offload=offload, prefetch=cfg.parallel.prefetch, param_dtype=prec.param_dtype,
                                 grad_dtype=prec.grad_dtype)
    model.to_empty(device=topo.device)
    model.init_weights(seed)
    if prec.low:
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(prec.param_dtype)
    buckets = bucket_bytes(cfg.parallel.bucket_mb)
    if stage == 0:
        return DataParallel(model, comm, optim, buckets, grad_dtype=prec.grad_dtype)
    return ZeroDataParallel(model, comm, stage, optim, buckets, offload, grad_dtype=prec.grad_dtype)
