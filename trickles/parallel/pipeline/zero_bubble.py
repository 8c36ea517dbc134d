"""The zero-bubble pipeline schedules' compute orders, one list of actions per rank.

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
is used instead when its uniform timeline is shorter (:func:`zero_bubble_orders`).
"""

from __future__ import annotations

from functools import lru_cache

from .actions import COMPUTE, Action, Shape, uniform_times


@lru_cache(maxsize=64)
def zero_bubble_orders(schedule: str, shape: Shape) -> tuple[tuple[Action, ...], ...]:
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
