"""``parallel.elastic``: a run, or a restart, on a number of processes its degrees do not fit trains on the planner's
layout for that number instead of stopping.

When the configured ``parallel.dp x tp x pp x cp`` cannot be laid over the ``N`` processes at hand (a job restarted
on fewer nodes, torchrun's ``--nnodes MIN:MAX``, a plain restart with another ``--nproc``),
:func:`layout_for_world` searches every layout of ``N`` devices (:class:`~trickles.planner.search.Search`, the
``local`` cluster preset: this machine's kind) for the same model, precision and global batch -- every layout key
free, as ``trickles plan`` with nothing pinned -- and returns the configuration with the fastest one that fits. Every
rank computes the same answer (the search is deterministic) before any process group exists, and rank 0 prints the
old and the new layout in one line. The global batch is unchanged (the micro-batch and gradient accumulation absorb
the change), so the data order continues exactly from the checkpoint's consumed samples, and the checkpoint reshards
on load (:mod:`trickles.train.checkpoint`): what a restart at the old layout would have trained, to the precision of
the layouts' arithmetic.
"""

from __future__ import annotations

from ..config import Config
from ..errors import ConfigError
from ..topology import ParallelDims
from .cluster_files import load_cluster
from .search import Search, plan_model


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


def layout_for_world(cfg: Config, world: int) -> tuple[Config, str | None]:
    """``(cfg, None)`` when its degrees fit ``world`` processes or ``parallel.elastic`` is off (validation then says
    what to change); else ``(cfg on the planner's fastest layout of world devices, the line saying so)``."""
    if not cfg.parallel.elastic or fits(cfg, world):
        return cfg, None
    p = cfg.parallel
    old = f"dp{'?' if p.dp == -1 else p.dp} tp{p.tp} pp{p.pp} cp{p.cp}"
    search = Search(cfg, plan_model(cfg), load_cluster("local"), world, pins=set()).run()
    top = search.top(1)
    if not top:
        raise ConfigError(
            f"parallel.elastic: no layout of {world} processes fits this model and train.global_batch="
            f"{cfg.train.global_batch}; launch another number of processes"
        )
    new = top[0].layout
    return new.apply(cfg), (
        f"[trickles] parallel.elastic: the layout {old} does not fit {world} processes; training on "
        f"{new.label()} (the planner's fastest that fits), same global batch and data order"
    )
