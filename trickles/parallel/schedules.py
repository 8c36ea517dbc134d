"""Pipeline schedules as plain lists of actions, one list per rank, generated before anything runs.

Notation: ``p`` pipeline ranks, ``v`` model chunks per rank (virtual stages), ``m`` micro-batches.
The model's layers are cut into ``S = p * v`` consecutive parts; part ``s`` is *virtual stage*
``s``, held as chunk ``c = s // p`` by rank ``r = s % p`` (Megatron's interleaving: rank 0 holds
parts 0, p, 2p, ...). Activations flow from virtual stage ``s`` to ``s + 1`` (from rank ``r`` to
``r + 1``, the last rank wrapping to rank 0 at a chunk boundary), gradients from ``s + 1`` to ``s``.

An action is ``F c.i`` / ``B c.i`` (forward / backward of micro-batch ``i`` through chunk ``c``)
or a message: ``SEND_F``, ``RECV_F`` (the activation leaving / entering ``F c.i``), ``SEND_B``,
``RECV_B`` (the gradient leaving / entering ``B c.i``). The compute orders:

* **GPipe**: ``F 0..m-1`` then ``B 0..m-1``; a rank holds all ``m`` micro-batches' activations.
* **1F1B**: rank ``r`` runs ``w = min(p - r - 1, m)`` warm-up forwards, then alternates one
  forward and one backward, then the ``w`` left-over backwards. A forward's activations live until
  its backward, so at most ``w + 1 <= p`` micro-batches are alive on a rank.
* **Interleaved 1F1B** (Megatron-LM): the ``v * m`` chunk forwards of a rank run in groups of
  ``p`` micro-batches per chunk -- forward ``k`` is chunk ``(k // p) % v`` of micro-batch
  ``(k // (p v)) p + k % p``, backward ``k`` the same with chunk ``v - 1 - (k // p) % v`` --
  after ``min(2 (p - r - 1) + (v - 1) p, v m)`` warm-up forwards. Needs ``m % p == 0``.

With forward and backward times ``t_f, t_b`` per chunk the same on every stage, each rank idles
for ``(p - 1)(t_f + t_b)`` of a step that takes ``(v m + p - 1)(t_f + t_b)``: the *bubble*
fraction is ``(p - 1) / (v m + p - 1)`` for all three (interleaving cuts it by ``v``).

Messages follow Megatron's pairing: after a compute action, the rank sends what it produced and
posts the receive its next compute action needs, as one batch (``batch_isend_irecv``), so two
neighbours exchanging in both directions never wait on each other's order. :func:`simulate`
replays the lists with given compute times, checks that every send meets its receive in order
and that nothing deadlocks, and returns the timeline whose bubble the formula predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")
COMPUTE = ("F", "B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``kind`` in F, B, SEND_F, RECV_F, SEND_B, RECV_B."""

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
    """The pipeline's size: ``p`` ranks, ``v`` chunks per rank, ``m`` micro-batches."""

    p: int
    v: int
    m: int

    @property
    def stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return chunk * self.p + rank

    def bubble(self) -> float:
        """The idle fraction of each rank with uniform stages: ``(p - 1) / (v m + p - 1)``."""
        return (self.p - 1) / (self.v * self.m + self.p - 1)


def check_shape(schedule: str, shape: Shape) -> None:
    """Raises ValueError (with what to change) when ``schedule`` cannot run ``shape``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if shape.p < 1 or shape.m < 1 or shape.v < 1:
        raise ValueError(f"pipeline degrees must be positive, got {shape}")
    if schedule == "interleaved":
        if shape.v < 2:
            raise ValueError("parallel.schedule=interleaved needs parallel.virtual_stages >= 2 (model chunks per rank); "
                             "with one chunk per rank use 1f1b")
        if shape.m % shape.p:
            raise ValueError(f"the interleaved schedule runs micro-batches in groups of parallel.pp ({shape.p}), but there are "
                             f"{shape.m} micro-batches per step; make train.global_batch / (parallel.dp x train.micro_batch) "
                             f"a multiple of {shape.p}")
    elif shape.v != 1:
        raise ValueError(f"parallel.virtual_stages={shape.v} needs parallel.schedule=interleaved")


def compute_order(schedule: str, shape: Shape, rank: int) -> list[Action]:
    """The forwards and backwards of ``rank`` in the order ``schedule`` runs them."""
    check_shape(schedule, shape)
    p, v, m = shape.p, shape.v, shape.m
    if schedule == "gpipe":
        return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        w = min(p - rank - 1, m)
        fwd = [Action("F", 0, i) for i in range(m)]
        bwd = [Action("B", 0, i) for i in range(m)]
    else:
        w = min(2 * (p - rank - 1) + (v - 1) * p, v * m)
        micro = [(k // (p * v)) * p + k % p for k in range(v * m)]
        fwd = [Action("F", (k // p) % v, micro[k]) for k in range(v * m)]
        bwd = [Action("B", v - 1 - (k // p) % v, micro[k]) for k in range(v * m)]
    order = fwd[:w]
    for k in range(len(fwd) - w):
        order += [fwd[w + k], bwd[k]]
    return order + bwd[len(fwd) - w:]


def forward_only_order(shape: Shape, rank: int) -> list[Action]:
    """Evaluation: every micro-batch forward through every chunk, no backward."""
    return [Action("F", c, i) for i in range(shape.m) for c in range(shape.v)]


def _messages(a: Action, shape: Shape, rank: int) -> tuple[Action | None, Action | None]:
    """``(receive before, send after)`` compute action ``a`` on ``rank``."""
    s, last = shape.stage(rank, a.chunk), shape.stages - 1
    if a.kind == "F":
        return (Action("RECV_F", a.chunk, a.micro) if s > 0 else None,
                Action("SEND_F", a.chunk, a.micro) if s < last else None)
    return (Action("RECV_B", a.chunk, a.micro) if s < last else None,
            Action("SEND_B", a.chunk, a.micro) if s > 0 else None)


def with_messages(order: list[Action], shape: Shape, rank: int) -> list[Action]:
    """Inserts the messages: each compute action's send right after it, followed by the next one's receive."""
    out: list[Action] = []
    first_recv = _messages(order[0], shape, rank)[0] if order else None
    if first_recv:
        out.append(first_recv)
    for k, a in enumerate(order):
        out.append(a)
        send = _messages(a, shape, rank)[1]
        if send:
            out.append(send)
        if k + 1 < len(order):
            recv = _messages(order[k + 1], shape, rank)[0]
            if recv:
                out.append(recv)
    return out


def build(schedule: str, shape: Shape, forward_only: bool = False) -> list[list[Action]]:
    """Every rank's action list."""
    if forward_only:
        return [with_messages(forward_only_order(shape, r), shape, r) for r in range(shape.p)]
    return [with_messages(compute_order(schedule, shape, r), shape, r) for r in range(shape.p)]


def peer(a: Action, shape: Shape, rank: int) -> int:
    """The rank at the other end of message ``a``."""
    toward_next = a.kind in ("SEND_F", "RECV_B")
    return (rank + 1) % shape.p if toward_next else (rank - 1) % shape.p


def batches(actions: list[Action]) -> list[list[Action]]:
    """The list cut into runs: each compute action alone, consecutive messages together (one batch)."""
    out: list[list[Action]] = []
    for a in actions:
        if not a.is_compute and out and not out[-1][0].is_compute:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def render(schedules: list[list[Action]]) -> str:
    """One line per rank, e.g. ``rank 0: F0.0 SEND_F0.0 F0.1 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(schedules))


def peak_alive(actions: list[Action]) -> int:
    """The most micro-batch chunks whose forward ran and whose backward did not yet (activations held)."""
    alive = peak = 0
    for a in actions:
        if a.kind == "F":
            alive += 1
            peak = max(peak, alive)
        elif a.kind == "B":
            alive -= 1
    return peak


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


def simulate(schedules: list[list[Action]], shape: Shape, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Replays the action lists: compute takes the given times, messages arrive when sent.

    Raises ValueError when a send and a receive meet out of order (wrong data would arrive) or
    when no rank can go on (deadlock).
    """
    p = shape.p
    pos = [0] * p
    clock = [0.0] * p
    sent: dict[tuple[int, int, str], list[tuple[Action, float]]] = {}  # (src, dst, kind) -> queue
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    while any(pos[r] < len(schedules[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                a = schedules[r][pos[r]]
                if a.kind.startswith("SEND"):
                    sent.setdefault((r, peer(a, shape, r), a.kind[-1]), []).append((a, clock[r]))
                elif a.kind.startswith("RECV"):
                    queue = sent.get((peer(a, shape, r), r, a.kind[-1]))
                    if not queue:
                        break
                    msg, at = queue.pop(0)
                    want = (msg.micro, msg.chunk + (1 if a.kind == "RECV_F" and r == 0 else 0) -
                            (1 if a.kind == "RECV_B" and r == p - 1 else 0))
                    if (a.micro, a.chunk) != want:
                        raise ValueError(f"rank {r} receives {a} but its peer sent {msg} first")
                    clock[r] = max(clock[r], at)
                else:
                    t = t_forward if a.kind == "F" else t_backward
                    spans[r].append((a, clock[r], clock[r] + t))
                    clock[r] += t
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedules[r][pos[r]]}" for r in range(p) if pos[r] < len(schedules[r]))
            raise ValueError(f"the schedule deadlocks: {stuck}")
    return Timeline(spans)
