"""What a pipeline schedule is made of: an :class:`Action` (``F``, ``B``, ``W`` of a chunk and micro-batch, or a
message) and the pipeline's :class:`Shape` (``p`` ranks, ``v`` chunks per rank, ``m`` micro-batches, the chunks'
placement); which stage a compute reads from and sends to; and the *uniform timeline* -- every compute starting as
soon as its rank is free and its input exists, forward 1, backward 2 (``B`` 1 and ``W`` 1 where the backward is
split) -- on which the schedules are compared and their messages placed (:mod:`~trickles.parallel.pipeline.schedules`).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``kind`` in F, B, W, SEND_F, RECV_F, SEND_B, RECV_B."""

    kind: str
    chunk: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.micro}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass(frozen=True)
class Shape:
    """The pipeline's size: ``p`` ranks, ``v`` chunks per rank, ``m`` micro-batches; ``vee``: odd chunks run
    back from the last rank to the first (ZB-V's placement) instead of again from the first."""

    p: int
    v: int
    m: int
    vee: bool = False

    @classmethod
    def of(cls, schedule: str, p: int, v: int, m: int) -> Shape:
        """The shape ``schedule`` runs: ZB-V places its chunks in a V."""
        return cls(p, v, m, vee=schedule == "zb-v")

    @property
    def stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return chunk * self.p + (self.p - 1 - rank if self.vee and chunk % 2 else rank)

    def chunks(self, parts: list[list[int]], rank: int) -> list[list[int]]:
        """The layers of each of ``rank``'s chunks, in the order it runs them (``parts``: each virtual stage's)."""
        return [parts[self.stage(rank, c)] for c in range(self.v)]

    def ends(self, rank: int) -> tuple[bool, bool]:
        """Whether ``rank`` holds the first virtual stage (the embedding) and the last (the head and the loss)."""
        return self.owner(0)[0] == rank, self.owner(self.stages - 1)[0] == rank

    def owner(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding virtual stage ``stage``."""
        chunk, k = divmod(stage, self.p)
        return (self.p - 1 - k if self.vee and chunk % 2 else k), chunk

    def bubble(self) -> float:
        """The idle fraction of each rank with uniform stages: ``(p - 1) / (v m + p - 1)``."""
        return (self.p - 1) / (self.v * self.m + self.p - 1)


def _neighbour(a: Action, shape: Shape, rank: int, step: int) -> tuple[int, int] | None:
    """``(rank, chunk)`` of the virtual stage ``step`` away from ``a``'s in its direction of flow (+1: downstream
    of a forward, upstream of a backward); None past the pipeline's ends."""
    s = shape.stage(rank, a.chunk) + (step if a.kind == "F" else -step)
    return shape.owner(s) if 0 <= s < shape.stages else None


def _messages(a: Action, shape: Shape, rank: int) -> tuple[Action | None, Action | None]:
    """``(receive before, send after)`` compute action ``a`` on ``rank``: none across the pipeline's ends, for a
    ``W``, or to a stage on the same rank (ZB-V's turn)."""
    if a.kind == "W":
        return None, None
    src, dst = _neighbour(a, shape, rank, -1), _neighbour(a, shape, rank, 1)
    return (
        Action(f"RECV_{a.kind}", a.chunk, a.micro) if src is not None and src[0] != rank else None,
        Action(f"SEND_{a.kind}", a.chunk, a.micro) if dst is not None and dst[0] != rank else None,
    )


def _producer(a: Action, shape: Shape, rank: int) -> tuple[int, Action] | None:
    """``(rank, compute action)`` whose output compute action ``a`` reads; None for the pipeline's ends and a ``W``."""
    src = None if a.kind == "W" else _neighbour(a, shape, rank, -1)
    return None if src is None else (src[0], Action(a.kind, src[1], a.micro))


def durations(actions, t_forward: float = 1.0, t_backward: float = 2.0, t_weight: float = 1.0) -> dict[str, float]:
    """Each compute kind's time: ``t_backward`` is a whole backward, of which ``W`` takes ``t_weight`` where the
    schedule splits it (``B`` the rest)."""
    split = any(a.kind == "W" for row in actions for a in row)
    return {"F": t_forward, "B": t_backward - t_weight if split else t_backward, "W": t_weight}


def uniform_times(
    orders: list[list[Action]], shape: Shape, t_forward: float = 1.0, t_backward: float = 2.0
) -> dict[tuple[int, Action], tuple[float, float]]:
    """``{(rank, compute action): (start, end)}`` when every compute starts as soon as its rank is free
    and its input exists; raises ValueError when the orders wait on each other in a cycle."""
    p = shape.p
    took = durations(orders, t_forward, t_backward)
    times: dict[tuple[int, Action], tuple[float, float]] = {}
    pos, clock = [0] * p, [0.0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                src = _producer(a, shape, r)
                if src is not None and src not in times:
                    break
                start = max(clock[r], times[src][1] if src is not None else 0.0)
                clock[r] = start + took[a.kind]
                times[(r, a)] = (start, clock[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {orders[r][pos[r]]}" for r in range(p) if pos[r] < len(orders[r]))
            raise ValueError(f"the schedule deadlocks: {stuck}")
    return times
