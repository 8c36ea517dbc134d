"""The ``[parallel]`` section: how many ways each dimension of the work is split."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..options import opt


@dataclass
class ParallelConfig:
    """Degrees of parallelism (the ``[parallel]`` section); see :class:`trickles.topology.ParallelDims`."""

    dp: int = opt(-1, "data-parallel degree (-1: whatever the world size leaves after tp, pp and cp)")
    tp: int = opt(1, "tensor-parallel degree")
    tp_mode: str = opt(
        "1d",
        "how the tp ranks split each matrix: 1d (Megatron: columns, then rows), 2d (a q x q grid, tp = q^2), 2.5d "
        "(tp_depth stacked q x q grids, tp = q^2 d) or 3d (a q x q x q cube, tp = q^3); see docs/tensor-parallel-nd.md",
    )
    tp_depth: int = opt(1, "with tp_mode=2.5d: the number d of stacked q x q grids (tp = q^2 d)")
    pp: int = opt(1, "pipeline-parallel degree")
    cp: int = opt(
        1,
        "context-parallel degree: every sequence is split over this many ranks (weights replicated over them, like dp)",
    )
    cp_mode: str = opt(
        "ring",
        "with cp > 1: ring (keys and values passed around a ring, load-balanced causal chunks) or ulysses (all-to-all "
        "from sequence to head shards)",
    )
    ep: int = opt(1, "expert-parallel degree; experts are spread over the dp x cp ranks, so it must divide dp*cp")
    sequence_parallel: bool = opt(
        False,
        "with tp > 1: run norms and dropout on sequence shards (all-gather / reduce-scatter instead of all-reduce)",
    )
    zero: int = opt(
        0,
        "ZeRO stage over the data-parallel ranks: 0 replicate everything, 1 shard optimizer state, 2 also gradients, "
        "3 also parameters",
    )
    bucket_mb: float = opt(25.0, "size of a gradient-reduction bucket in MiB (0: one bucket for the whole model)")
    prefetch: bool = opt(True, "ZeRO-3: start gathering the next block's parameters while the current one computes")
    schedule: str = opt(
        "1f1b",
        "with pp > 1: the pipeline schedule, gpipe, 1f1b, interleaved, or the zero-bubble zb-h1 and zb-v (each "
        "backward split into the input's and the weights' gradients; docs/pipeline-parallel.md)",
    )
    virtual_stages: int | None = opt(
        None,
        "model chunks per pipeline rank: with the interleaved schedule (the bubble shrinks by this factor); unset: the "
        "schedule's own, 2 for zb-v (its V), else 1",
    )
    pipeline_layers: list[int] = opt(
        [],
        "layers of each (virtual) stage in order, e.g. [4, 3]; empty: as even as possible, earlier stages taking the "
        "extra ones",
    )
    elastic: bool = opt(
        False,
        "a run (or restart) on a number of processes the degrees do not fit trains on the planner's fastest layout "
        "for it instead of stopping: same model, global batch and data order; the checkpoint reshards on load "
        "(docs/checkpoints.md)",
    )
    timeout_s: float = opt(
        600.0,
        "seconds one collective or point-to-point wait may take; then every rank reports where it is and the job "
        "exits (status 4)",
    )

    def schedule_chunks(self) -> int:
        """The model chunks per rank ``schedule`` places by itself: 2 for zb-v (its V), else 1."""
        return 2 if self.schedule == "zb-v" else 1

    def resolve(self) -> ParallelConfig:
        """Fills in what the schedule implies (``virtual_stages`` unset: :meth:`schedule_chunks`); in place, returns
        self. Loading calls it, so a loaded section always has its ``virtual_stages``; :meth:`validate` refuses a
        value that contradicts the schedule."""
        if self.virtual_stages is None:
            self.virtual_stages = self.schedule_chunks()
        return self

    def validate(self) -> None:
        if self.cp_mode not in ("ring", "ulysses"):
            raise ConfigError(f"parallel.cp_mode must be ring or ulysses, got {self.cp_mode!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.bucket_mb < 0:
            raise ConfigError(f"parallel.bucket_mb must not be negative, got {self.bucket_mb}")
        from .pipeline.schedules import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be positive (seconds), got {self.timeout_s}")
        self.resolve()
        if self.virtual_stages < 1:
            raise ConfigError(f"parallel.virtual_stages must be at least 1, got {self.virtual_stages}")
        if self.schedule == "zb-v" and self.virtual_stages != 2:
            raise ConfigError(
                f"parallel.schedule=zb-v places two model chunks on each pipeline rank, in a V; leave "
                f"parallel.virtual_stages unset or set parallel.virtual_stages=2 (got {self.virtual_stages})"
            )
