"""Pipeline schedules as plain lists of actions, one list per rank, generated before anything runs.

Notation: ``p`` pipeline ranks, ``v`` model chunks per rank (virtual stages), ``m`` micro-batches.
The model's layers are cut into ``S = p * v`` consecutive parts; part ``s`` is *virtual stage*
``s``, held as chunk ``c = s // p`` by rank ``r = s % p`` (Megatron's interleaving: rank 0 holds
parts 0, p, 2p, ...). Activations flow from virtual stage ``s`` to ``s + 1`` (from rank ``r`` to
``r + 1``, the last rank wrapping to rank 0 at a chunk boundary), gradients from ``s + 1`` to ``s``.

An action is ``F c.i`` / ``B c.i`` (forward / backward of micro-batch ``i`` through chunk ``c``), ``W c.i`` (its
weights' gradients, in the zero-bubble schedules) or a message: ``SEND_F``, ``RECV_F`` (the activation leaving /
entering ``F c.i``), ``SEND_B``, ``RECV_B`` (the gradient leaving / entering ``B c.i``). The compute orders:

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

The **zero-bubble schedules** ``zb-h1`` and ``zb-v`` (Qi et al., ICLR 2024) split each backward into ``B`` and
``W`` and fill the bubble with the ``W``: :mod:`~trickles.parallel.pipeline.zero_bubble` builds their orders.

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
:func:`~trickles.parallel.pipeline.timeline.simulate` replays the lists with given compute times -- posted receives do
not block, a compute waits for the message it reads -- checks that every receive meets the send it expects and that
nothing deadlocks, and returns the timeline whose bubble the formula predicts.
"""

from __future__ import annotations

from .actions import Action, Shape, _messages, _neighbour, _producer, uniform_times
from .zero_bubble import zero_bubble_orders

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
SPLIT = ("zb-h1", "zb-v")  # schedules whose backward is B then W


def check_shape(schedule: str, shape: Shape) -> None:
    """Raises ValueError (with what to change) when ``schedule`` cannot run ``shape``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if shape.p < 1 or shape.m < 1 or shape.v < 1:
        raise ValueError(f"pipeline degrees must be positive, got {shape}")
    if schedule == "interleaved":
        if shape.v < 2:
            raise ValueError(
                "parallel.schedule=interleaved needs parallel.virtual_stages >= 2 (model chunks per rank); "
                "with one chunk per rank use 1f1b"
            )
        if shape.m % shape.p:
            raise ValueError(
                f"the interleaved schedule runs micro-batches in groups of parallel.pp ({shape.p}), but there are "
                f"{shape.m} micro-batches per step; make train.global_batch / (parallel.dp x train.micro_batch) "
                f"a multiple of {shape.p}"
            )
    elif schedule == "zb-v":
        if shape.v != 2:
            raise ValueError(
                f"parallel.schedule=zb-v places two model chunks on each pipeline rank, in a V: set "
                f"parallel.virtual_stages=2 (got {shape.v})"
            )
    elif shape.v != 1:
        raise ValueError(f"parallel.virtual_stages={shape.v} needs parallel.schedule=interleaved (or zb-v with 2)")
    if shape.vee != (schedule == "zb-v"):
        raise ValueError(f"a {schedule} pipeline needs Shape.of({schedule!r}, ...): its chunk placement differs")


def compute_order(schedule: str, shape: Shape, rank: int) -> list[Action]:
    """The forwards and backwards of ``rank`` in the order ``schedule`` runs them."""
    check_shape(schedule, shape)
    p, v, m = shape.p, shape.v, shape.m
    if schedule in SPLIT:
        return list(zero_bubble_orders(schedule, shape)[rank])
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
    return order + bwd[len(fwd) - w :]


def forward_only_order(shape: Shape, rank: int) -> list[Action]:
    """Evaluation: every micro-batch forward through every chunk, no backward."""
    return [Action("F", c, i) for i in range(shape.m) for c in range(shape.v)]


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
    orders = [
        forward_only_order(shape, r) if forward_only else compute_order(schedule, shape, r) for r in range(shape.p)
    ]
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
