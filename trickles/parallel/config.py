"""The ``[parallel]`` section: how many ways each dimension of the work is split."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import opt


@dataclass
class ParallelConfig:
    """Degrees of parallelism (the ``[parallel]`` section); see :class:`trickles.topology.ParallelDims`."""

    dp: int = opt(-1, "data-parallel degree (-1: whatever the world size leaves after tp, pp and cp)")
    tp: int = opt(1, "tensor-parallel degree")
    pp: int = opt(1, "pipeline-parallel degree")
    cp: int = opt(1, "context (sequence) parallel degree")
    ep: int = opt(1, "expert-parallel degree; experts are spread over the dp x cp ranks, so it must divide dp*cp")
