"""What the layout search ranks, and the kinds of layout its report compares with the winner.

A :class:`Candidate` is one valid layout with what the search learned of it: the config it applies, its degrees
(``cfg.validate``'s :class:`~trickles.topology.ParallelDims`), its memory :class:`~trickles.planner.bound.Bound`,
its :class:`~trickles.planner.cost.StepTime` and, once confirmed, the memory report's peak. Candidates rank by step
time, ties by the bound (:meth:`Candidate.sort_key`).

:data:`KINDS` names the alternatives ``trickles plan`` explains ("the best with a pipeline", "with 2-D tensor
parallelism", ...): a predicate of a layout and the ranks per node (tensor parallelism spans nodes when its group's
ranks do not share one, :func:`~trickles.planner.placement.spans_nodes`). The hierarchical search refines the best
seed of each kind, so every alternative the report names has been searched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from ..topology import ParallelDims
from .bound import Bound
from .cost import StepTime
from .layouts import TP_MODES, Layout
from .placement import spans_nodes


def tp_spans_nodes(layout: Layout, per_node: int) -> bool:
    """Whether ``layout``'s tensor-parallel groups span nodes of ``per_node`` ranks."""
    return layout.tp > 1 and spans_nodes(
        ParallelDims(layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.tp_mode, layout.tp_depth),
        "tp",
        per_node,
    )


def _tp_mode(mode: str) -> Callable[[Layout, int], bool]:
    return lambda lay, per_node: lay.tp > 1 and lay.tp_mode == mode


#: Kinds of layout the report compares with the winner: name -> predicate of (layout, ranks per node).
KINDS: dict[str, Callable[[Layout, int], bool]] = {
    "tensor parallelism spanning nodes": tp_spans_nodes,
    "no pipeline": lambda lay, per_node: lay.pp == 1,
    "a pipeline": lambda lay, per_node: lay.pp > 1,
    "data parallelism only": lambda lay, per_node: lay.tp == lay.pp == lay.cp == 1,
    "context parallelism": lambda lay, per_node: lay.cp > 1,
    "expert parallelism": lambda lay, per_node: lay.ep > 1,
    **{f"{m} tensor parallelism": _tp_mode(m) for m in TP_MODES},
}


@dataclass
class Candidate:
    """A valid layout with its bound, its step time and, once :meth:`Search.confirm
    <trickles.planner.search.Search.confirm>` ran, its memory report."""

    layout: Layout
    cfg: Config
    dims: ParallelDims
    bound: Bound
    time: StepTime | None
    peak: float = 0.0  # bytes per device: the memory report's peak (the bound where it has none)
    host: float = 0.0  # offloaded optimizer bytes per node
    estimated: bool = False  # peak is the bound (the memory report does not model this layout)
    fits: bool | None = None  # None until confirmed
    report: Any = None
    fallbacks: list[Layout] = field(default_factory=list)  # more recomputation: tried when this one does not fit

    def sort_key(self) -> tuple[float, float]:
        return (self.time.total_s, self.bound.device)
