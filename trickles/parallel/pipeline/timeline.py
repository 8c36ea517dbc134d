"""Replaying pipeline schedules: the timeline of the action lists :mod:`~trickles.parallel.pipeline.schedules` builds,
with given compute times (:func:`simulate`), the bubble read off it (:class:`Timeline`), and the bubble predicted for
a measured step's stage times (:func:`mean_times`, :func:`predicted_bubble`).

The runner's trace (``--pipeline-trace``) is a :class:`Timeline` too; :mod:`~trickles.parallel.pipeline.plot` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, Shape, _messages, _producer, durations
from .schedules import build, peer


@dataclass
class Timeline:
    """When each rank ran each compute action: ``spans[rank] = [(action, start, end), ...]``."""

    spans: list[list[tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max((e for row in self.spans for _, _, e in row), default=0.0) - self.start

    @property
    def start(self) -> float:
        return min((s for row in self.spans for _, s, _ in row), default=0.0)

    def bubble(self) -> float:
        """Mean over ranks of the fraction of the step each rank was not computing."""
        span = self.makespan
        if span <= 0:
            return 0.0
        idle = [1.0 - sum(e - s for _, s, e in row) / span for row in self.spans]
        return sum(idle) / len(idle)


def mean_times(timeline: Timeline) -> dict[tuple[int, str, int], float]:
    """``{(rank, kind, chunk): mean seconds}`` of a measured step's compute actions: what :func:`simulate` replays
    when it is given ``took`` -- the stages as they were (the embedding and the head make the end stages longer; the
    first stage's ``B`` is empty, its ``W`` its whole backward), messages that cost nothing."""
    took: dict[tuple[int, str, int], list[float]] = {}
    for rank, row in enumerate(timeline.spans):
        for a, s, e in row:
            took.setdefault((rank, a.kind, a.chunk), []).append(e - s)
    return {k: sum(v) / len(v) for k, v in took.items()}


def predicted_bubble(schedule: str, shape: Shape, took: dict[tuple[int, str, int], float] | None = None) -> float:
    """The bubble of ``schedule`` with messages that cost nothing: with ``took`` (:func:`mean_times` of a measured
    step) for its stages as measured, else for equal stages, F, B and W one slot each -- ``(p - 1) / (v m + p - 1)``
    for GPipe, 1F1B and interleaved, the module docstring's formulas for the zero-bubble schedules."""
    return simulate(build(schedule, shape), shape, took=took).bubble()


def simulate(
    schedules: list[list[Action]],
    shape: Shape,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float = 1.0,
    took: dict[tuple[int, str, int], float] | None = None,
) -> Timeline:
    """Replays the action lists: compute takes the given times (:func:`durations`; ``took``: per rank, kind and
    chunk instead), a message arrives when it is sent.

    A receive is posted without waiting; the compute that reads it waits until the message is
    there. Messages between two ranks in one direction match in the order they are posted, as on
    a real transport. Raises ValueError when a receive would get another message than the one its
    compute expects (wrong data would arrive), when a compute reads a message that was never
    posted, or when no rank can go on (deadlock).
    """
    p = shape.p
    pos = [0] * p
    clock = [0.0] * p
    sent: dict[tuple[int, int, str], list[tuple[Action, float]]] = {}  # (src, dst, kind) -> messages in order
    posted: dict[tuple[int, int, str], int] = {}  # receives posted so far on a channel
    pending: list[dict[tuple[str, int, int], tuple[tuple[int, int, str], int]]] = [{} for _ in range(p)]
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    each = durations(schedules, t_forward, t_backward, t_weight)
    ran: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]
    while any(pos[r] < len(schedules[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                a = schedules[r][pos[r]]
                if a.kind.startswith("SEND"):
                    sent.setdefault((r, peer(a, shape, r), a.kind[-1]), []).append((a, clock[r]))
                elif a.kind.startswith("RECV"):
                    channel = (peer(a, shape, r), r, a.kind[-1])
                    pending[r][(a.kind[-1], a.chunk, a.micro)] = (channel, posted.get(channel, 0))
                    posted[channel] = posted.get(channel, 0) + 1
                else:
                    if _messages(a, shape, r)[0] is not None:
                        if (a.kind, a.chunk, a.micro) not in pending[r]:
                            raise ValueError(f"rank {r} runs {a} without having posted the receive of its input")
                        channel, n = pending[r][(a.kind, a.chunk, a.micro)]
                        queue = sent.get(channel, [])
                        if len(queue) <= n:
                            break
                        msg, at = queue[n]
                        want = _producer(a, shape, r)[1]
                        if (msg.chunk, msg.micro) != (want.chunk, want.micro):
                            raise ValueError(f"rank {r} posted the receive for {a} in the place of {msg}")
                        del pending[r][(a.kind, a.chunk, a.micro)]
                        clock[r] = max(clock[r], at)
                    else:
                        src = _producer(a, shape, r) if a.kind != "W" else (r, Action("B", a.chunk, a.micro))
                        if src is not None and src[0] == r and (src[1].kind, src[1].chunk, src[1].micro) not in ran[r]:
                            raise ValueError(f"rank {r} runs {a} before {src[1]}, whose output it reads")
                    t = each[a.kind] if took is None else took.get((r, a.kind, a.chunk), 0.0)
                    spans[r].append((a, clock[r], clock[r] + t))
                    ran[r].add((a.kind, a.chunk, a.micro))
                    clock[r] += t
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedules[r][pos[r]]}" for r in range(p) if pos[r] < len(schedules[r]))
            raise ValueError(f"the schedule deadlocks: {stuck}")
    return Timeline(spans)
