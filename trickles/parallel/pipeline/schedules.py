"""Pipeline schedules as plain lists of actions, one list per rank, generated before anything runs.

Notation: ``p`` pipeline ranks, ``v`` model chunks per rank (virtual stages), ``m`` micro-batches.
The model's layers are cut into ``S = p * v`` consecutive parts; part ``s`` is *virtual stage*
``s``, held as chunk ``c = s // p`` by rank ``r = s % p`` (Megatron's interleaving: rank 0 holds
parts 0, p, 2p, ...). Activations flow from virtual stage ``s`` to ``s + 1`` (from rank ``r`` to
``r + 1``, the last rank wrapping to rank 0 at a chunk boundary), gradients from ``s + 1`` to ``s``.

An action is ``F c.i`` / ``B c.i`` (forward / backward of micro-batch ``i`` through chunk ``c``),
``W c.i`` (its weights' gradients, in the zero-bubble schedules) or a message: ``SEND_F``, ``RECV_F`` (the activation leaving / entering ``F c.i``), ``SEND_B``,
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

**Zero-bubble schedules** (Qi et al., ICLR 2024) split each backward into ``B c.i`` (the input's gradient,
sent upstream at once) and ``W c.i`` (the weights' gradients, :mod:`~trickles.parallel.pipeline.split`), and move
the ``W`` into the time a rank would otherwise wait. A chunk's activations live from its ``F`` to its ``W``.
With ``t_w`` the ``W`` part of ``t_b`` (``B`` takes ``t_b - t_w``):

* **ZB-H1** (one chunk per rank): 1F1B's forwards and ``B`` in 1F1B's order, each ``B`` followed by a ``W`` once
  rank ``r`` holds ``r`` of them pending -- the later stages postpone their first ``W``, so the ``B`` reach the
  first stage sooner, and the postponed ``W`` fill the drain. Every rank holds at most ``p`` micro-batches,
  1F1B's peak (its first rank's). Idle per rank ``(p - 1)(t_f + t_b - 2 t_w)`` (for ``t_w <= t_b / 2``, ``m >= p``)
  instead of ``(p - 1)(t_f + t_b)``: with ``B`` and ``W`` equal, a third of 1F1B's bubble,
  ``(p - 1) / (3 m + p - 1)`` in units of ``t_f = t_b / 2``.
* **ZB-V** (two chunks per rank in a V, :attr:`Shape.vee`): rank ``r`` holds virtual stages ``r`` and ``2p - 1 - r``,
  so the first and the last stage are both on rank 0, and the activation turns back at rank ``p - 1`` without a
  message. Warm-up ``2 (p - r) - 1`` forwards of chunk 0, then ``r`` pairs ``F1, F0``, then ``p - r`` triples
  ``F1 B1 W1``; steady ``F0 B0 W0 F1 B1 W1``; drain ``r`` pairs ``B0 B1``, ``p - r`` pairs ``B0 W0``, the ``W`` left.
  At most ``2 p`` chunk-micro-batches alive: ``p`` micro-batches' worth of a rank's layers, 1F1B's peak. With the
  three actions equal in time the whole pipeline idles ``p - 1`` of them per rank: bubble
  ``(p - 1) / (6 m + p - 1)`` (``m >= 2p - 1``).

Where fewer micro-batches leave those constructions gaps (``m < p``, ``m < 2p - 1``) a greedy list schedule --
``B`` first, then a forward while the rank holds fewer than the peak above, else the oldest pending ``W`` --
is used instead when its uniform timeline is shorter (:func:`compute_order`).

Messages: a compute action's send goes right after it. A receive is *posted* (non-blocking) as
early as its send allows and *waited for* only just before the compute that reads it. "As early
as its send allows" is read off the timeline of uniform stages (forward 1, backward 2, every
compute starting as soon as its rank is free and its input has been sent): the receive goes
right after the last compute its rank started before the matching send was issued -- the
placement of ``torch.distributed.pipelining``. In that timeline every receive is posted after
its send, so a real run can follow the same global order and no receive waits on work its own
rank has still to do (safe also where a posted receive occupies the communication stream, as
with NCCL). Posting early matters on gloo, where a message moves only once its receive is
posted: the transfer then runs during the computes in between instead of on the critical path
(pairing each send with the *next* compute's receive, Megatron's order, posts it only one compute
ahead). On a transport where a posted receive holds up nothing else (gloo), ``early_receives``
posts all of a step's receives where the rank first waits for a message anyway: one call per
receive costs 0.1-0.2 ms on a busy CPU, which then no longer falls between computes on the
critical path (usually the last stage's, slowed by the output layer and the loss), at the price
of one buffer per message of the step held from the start.
Consecutive messages go out together as one batch (``batch_isend_irecv``).
:func:`~trickles.parallel.pipeline.timeline.simulate` replays the lists with given compute times -- posted receives do not block, a
compute waits for the message it reads -- checks that every receive meets the send it expects
and that nothing deadlocks, and returns the timeline whose bubble the formula predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
SPLIT = ("zb-h1", "zb-v")  # schedules whose backward is B then W
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
    def of(cls, schedule: str, p: int, v: int, m: int) -> "Shape":
        """The shape ``schedule`` runs: ZB-V places its chunks in a V."""
        return cls(p, v, m, vee=schedule == "zb-v")

    @property
    def stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return chunk * self.p + (self.p - 1 - rank if self.vee and chunk % 2 else rank)

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
    elif schedule == "zb-v":
        if shape.v != 2:
            raise ValueError(f"parallel.schedule=zb-v places two model chunks on each pipeline rank, in a V: set "
                             f"parallel.virtual_stages=2 (got {shape.v})")
    elif shape.v != 1:
        raise ValueError(f"parallel.virtual_stages={shape.v} needs parallel.schedule=interleaved (or zb-v with 2)")
    if shape.vee != (schedule == "zb-v"):
        raise ValueError(f"a {schedule} pipeline needs Shape.of({schedule!r}, ...): its chunk placement differs")


def compute_order(schedule: str, shape: Shape, rank: int) -> list[Action]:
    """The forwards and backwards of ``rank`` in the order ``schedule`` runs them."""
    check_shape(schedule, shape)
    p, v, m = shape.p, shape.v, shape.m
    if schedule in SPLIT:
        return list(_zero_bubble(schedule, shape)[rank])
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


@lru_cache(maxsize=64)
def _zero_bubble(schedule: str, shape: Shape) -> tuple[tuple[Action, ...], ...]:
    """Every rank's order: the construction of the module docstring, or the greedy list schedule where that finishes
    sooner on the uniform timeline (``t_f = t_B = t_W``)."""
    build_rank = _zb_h1 if schedule == "zb-h1" else _zb_v
    made = [build_rank(shape, r) for r in range(shape.p)]
    greedy = _greedy(shape, shape.p * shape.v)

    def makespan(orders):
        return max(end for _, end in uniform_times(orders, shape).values())

    best = greedy if makespan(greedy) < makespan(made) else made
    return tuple(tuple(o) for o in best)


def _zb_h1(shape: Shape, rank: int) -> list[Action]:
    p, m = shape.p, shape.m
    w = min(p - rank - 1, m)
    order = [Action("F", 0, i) for i in range(w)]
    weights = 0
    for k in range(m - w):
        order += [Action("F", 0, w + k), Action("B", 0, k)]
        if k >= rank:  # rank r keeps r W pending through the steady state
            order.append(Action("W", 0, weights))
            weights += 1
    for k in range(m - w, m):
        order += [Action("B", 0, k), Action("W", 0, weights)]
        weights += 1
    return order + [Action("W", 0, i) for i in range(weights, m)]


def _zb_v(shape: Shape, rank: int) -> list[Action]:
    p, m = shape.p, shape.m
    n = max(m, 2 * p - 1)  # the pattern needs 2p - 1 micro-batches; the missing ones are dropped after
    order: list[Action] = []
    count = {k: [0, 0] for k in COMPUTE}

    def run(kind: str, chunk: int) -> None:
        order.append(Action(kind, chunk, count[kind][chunk]))
        count[kind][chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1), run("F", 0)
    for _ in range(p - rank):
        run("F", 1), run("B", 1), run("W", 1)
    while count["F"][1] < count["F"][0] or count["F"][0] < n:
        if count["F"][0] < n:
            run("F", 0)
        run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)
    for _ in range(rank):
        run("B", 0), run("B", 1)
    for _ in range(p - rank):
        run("B", 0), run("W", 0)
    while count["W"][1] < count["B"][1]:
        run("W", 1)
    while count["W"][0] < count["B"][0]:
        run("W", 0)
    return [a for a in order if a.micro < m]


def _greedy(shape: Shape, limit: int) -> list[list[Action]]:
    """Every rank's order from a uniform timeline (each action 1): a free rank runs a ready ``B`` (of its latest
    stage), else a ready forward (latest stage first) while it holds fewer than ``limit`` chunk-micro-batches
    (forward run, ``W`` not), else its oldest pending ``W``; it waits when none is ready."""
    p, v, m, last = shape.p, shape.v, shape.m, shape.stages - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> end
    clock, held = [0] * p, [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    nxt = {k: [[0] * v for _ in range(p)] for k in ("F", "B")}
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]

    def ready(kind: str, r: int, c: int, now: int) -> bool:
        i, s = nxt[kind][r][c], shape.stage(r, c)
        if kind == "F":
            dep = None if s == 0 else ("F", s - 1, i)
            return i < m and held[r] < limit and (dep is None or done.get(dep, now + 1) <= now)
        dep = ("F", s, i) if s == last else ("B", s + 1, i)
        return i < nxt["F"][r][c] and done.get(dep, now + 1) <= now

    while any(len(o) < 3 * v * m for o in orders):
        active = [r for r in range(p) if len(orders[r]) < 3 * v * m]
        now = min(clock[r] for r in active)
        for r in (r for r in active if clock[r] == now):
            chunks = sorted(range(v), key=lambda c: -shape.stage(r, c))
            pick = next(((k, c) for k in ("B", "F") for c in chunks if ready(k, r, c, now)), None)
            if pick is None and pending[r]:
                pick = ("W", pending[r][0][0])
            if pick is None:
                continue
            kind, c = pick
            i = pending[r].pop(0)[1] if kind == "W" else nxt[kind][r][c]
            if kind != "W":
                nxt[kind][r][c] += 1
            held[r] += {"F": 1, "B": 0, "W": -1}[kind]
            if kind == "B":
                pending[r].append((c, i))
            done[(kind, shape.stage(r, c), i)] = clock[r] = now + 1
            orders[r].append(Action(kind, c, i))
            break
        else:  # nobody free could start: wait for the next end
            later = [t for t in list(done.values()) + [clock[r] for r in active] if t > now]
            if not later:
                raise ValueError(f"the greedy zero-bubble schedule is stuck for {shape}")
            for r in active:
                if clock[r] == now:
                    clock[r] = min(later)
    return orders


def forward_only_order(shape: Shape, rank: int) -> list[Action]:
    """Evaluation: every micro-batch forward through every chunk, no backward."""
    return [Action("F", c, i) for i in range(shape.m) for c in range(shape.v)]


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
    return (Action(f"RECV_{a.kind}", a.chunk, a.micro) if src is not None and src[0] != rank else None,
            Action(f"SEND_{a.kind}", a.chunk, a.micro) if dst is not None and dst[0] != rank else None)


def _producer(a: Action, shape: Shape, rank: int) -> tuple[int, Action] | None:
    """``(rank, compute action)`` whose output compute action ``a`` reads; None for the pipeline's ends and a ``W``."""
    src = None if a.kind == "W" else _neighbour(a, shape, rank, -1)
    return None if src is None else (src[0], Action(a.kind, src[1], a.micro))


def durations(actions, t_forward: float = 1.0, t_backward: float = 2.0, t_weight: float = 1.0) -> dict[str, float]:
    """Each compute kind's time: ``t_backward`` is a whole backward, of which ``W`` takes ``t_weight`` where the
    schedule splits it (``B`` the rest)."""
    split = any(a.kind == "W" for row in actions for a in row)
    return {"F": t_forward, "B": t_backward - t_weight if split else t_backward, "W": t_weight}


def uniform_times(orders: list[list[Action]], shape: Shape, t_forward: float = 1.0,
                  t_backward: float = 2.0) -> dict[tuple[int, Action], tuple[float, float]]:
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


def with_messages(orders: list[list[Action]], shape: Shape, early_receives: bool = False) -> list[list[Action]]:
    """Every rank's compute order with its messages: each send right after the compute that produces it,
    each receive right after the last compute its rank starts before the send (uniform timeline).

    ``early_receives``: every receive is posted where the rank's first reading compute waits
    (see the module docstring); only for transports where a posted receive holds up nothing
    else (gloo). Where receives queue on a stream with the sends (NCCL) it could wait on work its
    own rank has yet to do.
    """
    times = uniform_times(orders, shape)
    out = []
    for r, order in enumerate(orders):
        slots: list[list[tuple[int, int, Action]]] = [[] for _ in range(len(order) + 1)]
        starts = [times[(r, a)][0] for a in order]
        first_read = next((k for k, a in enumerate(order) if _messages(a, shape, r)[0] is not None), 0)
        for k, a in enumerate(order):
            recv, send = _messages(a, shape, r)
            if send:
                slots[k + 1].append((0, k, send))  # before the receives posted at the same point
            if recv:
                sent_at = times[_producer(a, shape, r)][1]
                slot = sum(st < sent_at for st in starts)
                if early_receives:
                    slot = min(slot, first_read)
                slots[slot].append((1, k, recv))
        acts: list[Action] = []
        for k, slot in enumerate(slots):
            if k:
                acts.append(order[k - 1])
            acts += [m for *_, m in sorted(slot, key=lambda x: x[:2])]
        out.append(acts)
    return out


def build(schedule: str, shape: Shape, forward_only: bool = False, early_receives: bool = False) -> list[list[Action]]:
    """Every rank's action list (``early_receives``: see :func:`with_messages`)."""
    orders = [forward_only_order(shape, r) if forward_only else compute_order(schedule, shape, r) for r in range(shape.p)]
    return with_messages(orders, shape, early_receives)


def handoff(a: Action, shape: Shape, rank: int) -> Action | None:
    """The compute action of the same rank that reads compute action ``a``'s output (ZB-V's turn), else None."""
    dst = None if a.kind == "W" else _neighbour(a, shape, rank, 1)
    return Action(a.kind, dst[1], a.micro) if dst is not None and dst[0] == rank else None


def peer(a: Action, shape: Shape, rank: int) -> int:
    """The rank at the other end of message ``a``."""
    step = 1 if a.kind.startswith("SEND") else -1
    return _neighbour(Action(a.kind[-1], a.chunk, a.micro), shape, rank, step)[0]


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
    """The most micro-batch chunks whose forward ran and whose backward (its ``W`` where split) did not yet
    (activations held)."""
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    alive = peak = 0
    for a in actions:
        if a.kind == "F":
            alive += 1
            peak = max(peak, alive)
        elif a.kind == release:
            alive -= 1
    return peak
