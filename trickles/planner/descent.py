"""The layout search on large spaces: seed every degree layout once, then refine the best by coordinate descent.

Beyond :class:`~trickles.planner.search.Search`'s ``exhaustive_limit`` (GPT-3 on 1,024 devices has ~450,000
layouts and a step time costs milliseconds) not every family is timed. Layouts group in two levels:

* the **degree layout** (:func:`degrees_of`): ``(dp, tp, tp_mode, tp_depth, pp, cp, cp_mode, ep)``;
* the **family** within it (:func:`options_of`): sequence parallelism, ZeRO stage, optimizer offload and the
  pipeline schedule with its virtual stages; a family's layouts differ in micro-batch and recomputation.

:func:`hierarchical` seeds every degree layout with its first family in :func:`seed_order` whose smallest
micro-batch has a layout within the memory bound; the ``refine`` fastest seeds, plus the fastest seed of each kind
the report compares (:data:`~trickles.planner.candidate.KINDS`), are improved by :func:`descend`: one option
(:data:`OPTION_AXES`) changed at a time, at the same micro-batch (or the family's first within the bound), and every
micro-batch of the current family, until no single change is faster (at most 6 rounds). Recomputation is always the
least within the bound (the search's chains). The result is a local optimum: every degree layout is seeded, but a
faster family that no single change reaches from the seed may go unseen.

The search's timing is passed in: ``time_family(family, stop_at_first)`` (the fastest candidate of a family, or its
first within the bound) and ``time_chain(chain)`` (a chain's first candidate within the bound and whether its
lightest layout was over it), each remembering what it timed.
"""

from __future__ import annotations

from collections.abc import Callable

from .candidate import KINDS, Candidate
from .layouts import Layout

#: A family: its micro-batches' recomputation chains, micro-batches ascending.
Family = list[list[Layout]]
TimeFamily = Callable[..., Candidate | None]
TimeChain = Callable[[list[Layout]], tuple[Candidate | None, bool]]


def degrees_of(layout: Layout) -> tuple:
    """The degree layout: ``(dp, tp, tp_mode, tp_depth, pp, cp, cp_mode, ep)``."""
    return (layout.dp, layout.tp, layout.tp_mode, layout.tp_depth, layout.pp, layout.cp, layout.cp_mode, layout.ep)


#: The options a family fixes, in :func:`options_of`'s order, and their names.
OPTION_AXES = (("sequence_parallel", 0), ("zero", 1), ("offload_optimizer", 2), ("schedule", 3))


def options_of(layout: Layout) -> tuple:
    """``(sequence_parallel, zero, offload_optimizer, (schedule, virtual_stages))``: what a family fixes beyond the
    degrees."""
    return (layout.sequence_parallel, layout.zero, layout.offload_optimizer, (layout.schedule, layout.virtual_stages))


def seed_order(layout: Layout) -> tuple:
    """The order families of one degree layout are tried as its seed: sequence parallel first, then ZeRO 1, 0, 2, 3,
    no offload, 1F1B, fewer virtual stages."""
    return (
        not layout.sequence_parallel,
        (1, 0, 2, 3).index(layout.zero),
        layout.offload_optimizer,
        layout.schedule != "1f1b",
        layout.virtual_stages,
    )


def hierarchical(
    families: list[Family], time_family: TimeFamily, time_chain: TimeChain, refine: int, per_node: int
) -> None:
    """Seeds every degree layout of ``families`` and descends from the ``refine`` fastest seeds and the fastest of
    each kind (module docstring); ``per_node``: ranks per node, for the kinds."""
    by_degrees: dict[tuple, list[Family]] = {}
    for family in families:
        by_degrees.setdefault(degrees_of(family[0][0]), []).append(family)
    seeds: dict[tuple, Candidate] = {}
    for key, fams in by_degrees.items():
        for family in sorted(fams, key=lambda f: seed_order(f[0][0])):
            cand = time_family(family, stop_at_first=True)
            if cand is not None:
                seeds[key] = cand
                break
    order = sorted(seeds, key=lambda k: seeds[k].sort_key())
    chosen = order[:refine]
    for kind in KINDS.values():
        first = next((k for k in order if kind(seeds[k].layout, per_node)), None)
        if first is not None and first not in chosen:
            chosen.append(first)
    for key in chosen:
        descend(by_degrees[key], seeds[key], time_family, time_chain)


def descend(families: list[Family], start: Candidate, time_family: TimeFamily, time_chain: TimeChain) -> None:
    """Coordinate descent over one degree layout's families and micro-batches from ``start``."""
    index = {options_of(f[0][0]): f for f in families}
    current = start
    for _ in range(6):
        opts, micro = options_of(current.layout), current.layout.micro_batch
        tried = []
        for _name, pos in OPTION_AXES:
            for other, family in index.items():
                if other[pos] != opts[pos] and all(other[i] == opts[i] for i in range(len(opts)) if i != pos):
                    chain = next((c for c in family if c[0].micro_batch == micro), None)
                    cand = time_chain(chain)[0] if chain else None
                    tried.append(cand or time_family(family, stop_at_first=True))
        tried.append(time_family(index[opts]))  # every micro-batch of the current family
        best = min((c for c in tried if c is not None), key=Candidate.sort_key, default=None)
        if best is None or best.sort_key() >= current.sort_key():
            return
        current = best
