"""The layout search behind ``trickles plan``: every valid layout of ``N`` devices, the ones that fit, fastest first.

**What is enumerated** (:func:`enumerate_layouts`, a :class:`Layout` each): the degrees ``dp x tp x pp x cp = N``
-- ``tp`` in each mode (``1d`` any divisor; ``2d`` ``q^2``; ``2.5d`` ``q^2 d`` with ``d = tp_depth >= 2``;
``3d`` ``q^3``), ``pp <= n_layers``, ``cp`` with ``cp_mode`` ring or ulysses, ``ep`` dividing ``dp x cp``
(mixture-of-experts models only) -- and the options: ``sequence_parallel`` (1-D ``tp > 1``), ZeRO stage 0-3,
the pipeline schedule (``gpipe``, ``1f1b``, ``interleaved`` with ``virtual_stages`` ``v >= 2`` and at least one
layer a chunk, the chunks as even as the layers allow or with lighter ends), the micro-batch (every divisor of
``global_batch / dp``), ``memory.recompute`` (none, elementwise, selective, full; elementwise not for
mixture-of-experts models, grids or ``train.compile``, which refuse it) and ``memory.offload_optimizer``
(ZeRO >= 1; not on a CPU cluster, whose device memory is the host's, unless pinned). The model, the precision, the
global batch and every other key stay as configured.

**Pinning** (:func:`pinned_keys`): a searched key given in the config file or with ``--set`` is fixed to its
value and the search varies only the others, so a config pinning every degree and option evaluates one layout.
``parallel.dp = -1`` (the default: "what the others leave") counts as not pinned.

**Validity** is what ``trickles train`` checks: each layout is applied to the config (:meth:`Layout.apply`) and
must pass :meth:`~trickles.config.Config.validate` at ``N`` ranks; the search never proposes what training refuses.

**Pruning by memory**, cheapest first. (1) :func:`memory_bound` -- for each pipeline rank its parameters
(:func:`~trickles.planner.compute.rank_params`) with the ZeRO formulas, ``p n / R^[z=3] + g n / R^[sharded
gradients] + k n / R^[z>=1]`` (``R = dp cp`` replicas, experts over ``edp = R / ep``; ``k`` the optimizer's
bytes per element as the memory report counts them; the optimizer on the host under offload; with LoRA,
``train.lora_rank``, ``n`` in the gradient and optimizer terms is the adapters' values and the frozen base is counted
at its own bytes, :func:`~trickles.memory.lora_activations.lora_states`), plus the saved
activations of its layers (:func:`trickles.memory.tp_modes.activations`) times the micro-batches in flight
(GPipe ``m``, 1F1B ``min(p - r, m)``, interleaved ``min(2 (p - r - 1) + (v - 1) p + 1, v m)`` chunks), the
head and the larger of the loss's transient and (without a pipeline) the last block's backward on the last rank,
and the report's other transients (two gradient buckets under ZeRO-2 -- on a pipeline stage its whole gradient
buffer during the step --, the root and two gathered blocks under ZeRO-3, ring attention's blocks, expert rows in
flight) -- a lower bound of the memory report's peak (it leaves out the flat buffers' padding and Adam's step
counters), so a layout whose bound exceeds ``(1 - headroom)`` of device memory, or whose offloaded optimizer
exceeds the node's host memory, cannot fit. (2) The survivors are ranked by
:func:`~trickles.planner.cost.step_time`; only those a report needs -- the fastest ``K`` that fit and the best of
each alternative it explains -- get the full :func:`trickles.memory.report.predict` (cached per layout), walking
down the ranking until one fits. A layout the memory report does not model (it raises ConfigError) keeps the bound
as its estimate, marked ``estimated`` (``~`` in the table).

**What is timed.** Two reductions hold in the time model: recomputation only adds time (``none``,
``elementwise``, ``selective``, ``full`` in that order), so of each chain only the first layout within the bound is
timed, the others held back and timed if the memory report refuses it; and a larger micro-batch only holds more, so
a family's micro-batches stop at the first over the bound. GPipe has 1F1B's step time in the model and holds more
micro-batches: it is searched only when pinned. Up to ``exhaustive_limit`` layouts every family is timed; beyond,
the hierarchical search of :mod:`trickles.planner.descent` runs (every degree layout timed once with its first
family, the fastest few and the fastest of each kind the report compares refined by coordinate descent): the
summary line says which search ran.

**Ranking**: by predicted step time, ties by peak memory. Nothing here creates a process group.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

from ..config import Config
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..topology import ParallelDims
from .bound import Bound, in_flight, memory_bound
from .candidate import KINDS, Candidate
from .cluster import Cluster
from .cost import step_time
from .descent import degrees_of, hierarchical
from .layouts import (
    RECOMPUTE,
    SEARCHED,
    TP_MODES,
    Layout,
    check_pins,
    enumerate_layouts,
    layout_families,
    pinned_keys,
    plan_model,
)

__all__ = [
    "Bound",
    "Candidate",
    "KINDS",
    "Layout",
    "RECOMPUTE",
    "SEARCHED",
    "Search",
    "TP_MODES",
    "check_pins",
    "enumerate_layouts",
    "in_flight",
    "layout_families",
    "memory_bound",
    "pinned_keys",
    "plan_model",
]

DEFAULT_HEADROOM = 0.1  # of device memory kept free, as trickles memory --device-gb does


class Search:
    """The search of the module docstring for ``cfg`` (model, precision, batch as configured) on ``devices`` devices
    of ``cluster``: :meth:`run` enumerates, prunes and ranks; :meth:`best` and :meth:`top` confirm lazily.

    A family's micro-batches are tried in ascending order and stop at the first whose most recomputing layout is over
    the bound (larger ones hold more); for each micro-batch only the first layout of the recomputation chain within
    the bound is ranked, the rest held back as its ``fallbacks`` (slower by construction) and ranked only if the
    memory report finds it does not fit."""

    def __init__(
        self,
        cfg: Config,
        model_cfg: ModelConfig,
        cluster: Cluster,
        devices: int,
        pins: set[str] = frozenset(),
        headroom: float = DEFAULT_HEADROOM,
        max_confirm: int = 8,
        exhaustive_limit: int = 5000,
        refine: int = 6,
    ):
        self.cfg, self.model_cfg, self.devices, self.pins = cfg, model_cfg, devices, set(pins)
        self.cluster = cluster.sized(devices)
        self.headroom = headroom
        self.capacity = (1 - headroom) * self.cluster.device_memory_bytes
        self.host_capacity = self.cluster.host_memory_gib * 2**30
        self.device_type = "cuda" if self.cluster.device == "cuda" else "cpu"
        self.max_confirm = max_confirm
        self.per_node = self.cluster.ranks_per_node(devices)
        self.ranked: list[Candidate] = []
        self.lightest: Candidate | None = None  # the valid layout with the smallest bound (for "does not fit")
        self.counts = {
            "examined": 0,
            "invalid": 0,
            "over_memory": 0,
            "over_host": 0,
            "ranked": 0,
            "held_back": 0,
            "confirmed": 0,
        }
        self.errors: dict[str, int] = {}
        self.exhaustive_limit, self.refine, self.exhaustive = exhaustive_limit, refine, True
        self._acts: dict = {}
        self._timed: dict = {}
        self._degrees_ok: set = set()

    def _evaluate(self, layout: Layout) -> tuple[Config, ParallelDims, Bound] | None | bool:
        """``(cfg, dims, bound)`` within the bound; False over it; None when invalid."""
        self.counts["examined"] += 1
        cfg = layout.apply(self.cfg)
        try:
            dims = cfg.validate(self.devices)
        except ConfigError as e:
            self.counts["invalid"] += 1
            self.errors[str(e)] = self.errors.get(str(e), 0) + 1
            return None
        bound = memory_bound(cfg, dims, self.model_cfg, self.device_type, self.per_node, self._acts)
        if self.lightest is None or bound.device < self.lightest.bound.device:
            self.lightest = Candidate(
                layout, cfg, dims, bound, None, peak=bound.device, host=bound.host, estimated=True
            )
        if bound.device > self.capacity:
            self.counts["over_memory"] += 1
            return False
        if bound.host > self.host_capacity:
            self.counts["over_host"] += 1
            return False
        return cfg, dims, bound

    def _first_within(self, chain: list[Layout]) -> tuple[Candidate | None, bool]:
        """The candidate of the chain's first layout within the bound (the rest its fallbacks), and whether the
        chain's last layout (the least memory) was valid and over the bound."""
        over = False
        for i, layout in enumerate(chain):
            got = self._evaluate(layout)
            if got is None:  # (recomputation does not change what validate checks: the rest are invalid too)
                self.counts["invalid"] += len(chain) - i - 1
                return None, False
            over = got is False
            if got:
                cfg, dims, bound = got
                self.counts["held_back"] += len(chain) - i - 1
                return Candidate(
                    layout,
                    cfg,
                    dims,
                    bound,
                    step_time(cfg, dims, self.model_cfg, self.cluster),
                    fallbacks=chain[i + 1 :],
                ), False
        return None, over

    def _check_degrees(self, layout: Layout) -> str | None:
        """The ConfigError a degree layout gets with its most permissive options (no accumulation: every micro-batch
        divides it; no sequence parallelism, ZeRO, offload or interleaving), or None: when this fails, every option
        fails too."""
        loose = dataclasses.replace(
            layout,
            sequence_parallel=False,
            zero=0,
            offload_optimizer=False,
            schedule="1f1b",
            virtual_stages=1,
            micro_batch=self.cfg.train.global_batch // layout.dp,
        )
        try:
            loose.apply(self.cfg).validate(self.devices)
        except ConfigError as e:
            return str(e)
        return None

    def _time_chain(self, chain: list[Layout]) -> tuple[Candidate | None, bool]:
        """:meth:`_first_within`, remembered per chain (the hierarchical search revisits them)."""
        key = chain[0]
        if key not in self._timed:
            cand, over = self._first_within(chain)
            if cand is not None:
                self.ranked.append(cand)
            self._timed[key] = (cand, over)
        return self._timed[key]

    def _time_family(self, family: list[list[Layout]], stop_at_first: bool = False) -> Candidate | None:
        """Times ``family``'s micro-batches in ascending order until one is over the bound; returns the fastest (the
        first within the bound with ``stop_at_first``)."""
        best = None
        for n, chain in enumerate(family):
            cand, over = self._time_chain(chain)
            if cand is not None:
                if stop_at_first:
                    return cand
                best = cand if best is None or cand.sort_key() < best.sort_key() else best
            elif over:  # larger micro-batches hold more
                skipped = [c for c in family[n + 1 :] if c[0] not in self._timed]
                for c in skipped:
                    self._timed[c[0]] = (None, True)
                self.counts["over_memory"] += sum(len(c) for c in skipped)
                break
        return best

    def run(self) -> Search:
        """Enumerates and ranks: every family when the layouts number at most ``exhaustive_limit``, else the
        hierarchical search (:func:`~trickles.planner.descent.hierarchical`)."""
        check_pins(self.cfg, self.pins, self.devices)
        families, refused = [], set()
        for family in layout_families(self.cfg, self.pins, self.devices, self.model_cfg, self.cluster.device != "cpu"):
            key = degrees_of(family[0][0])
            if key not in refused and key not in self._degrees_ok:
                error = self._check_degrees(family[0][0])
                if error:
                    refused.add(key)
                    self.errors[error] = self.errors.get(error, 0) + 1
                else:
                    self._degrees_ok.add(key)
            if key in refused:
                self.counts["invalid"] += sum(len(chain) for chain in family)
            else:
                families.append(family)
        self.counts["layouts"] = sum(len(chain) for f in families for chain in f)
        if self.counts["layouts"] <= self.exhaustive_limit:
            for family in families:
                self._time_family(family)
        else:
            self.exhaustive = False
            hierarchical(families, self._time_family, self._time_chain, self.refine, self.per_node)
        self.ranked.sort(key=Candidate.sort_key)
        self.counts["ranked"] = len(self.ranked)
        return self

    # ---- confirming with the memory report ---------------------------------------------------------------------
    def confirm(self, c: Candidate, at: int | None = None) -> Candidate:
        """Fills ``c.peak``, ``c.host`` and ``c.fits`` from :func:`trickles.memory.report.predict` (once). When it
        does not fit, its next fallback within the bound joins the ranking (after position ``at``)."""
        if c.fits is not None:
            return c
        from ..memory.report import predict

        try:
            c.report = predict(c.cfg, c.dims, self.model_cfg, self.device_type, both_loads=False)
            c.peak = float(c.report.predicted["peak"])
            c.host = (
                float(c.report.predicted["optimizer"]) * self.per_node if c.cfg.memory.offload_optimizer else 0.0
            ) + float(c.report.predicted.get("checkpoint_host", 0)) * self.per_node  # an asynchronous save's copies
        except ConfigError:  # a layout the memory report does not model yet: the bound is the estimate
            c.peak, c.host, c.estimated = c.bound.device, c.bound.host, True
        self.counts["confirmed"] += 1
        c.fits = c.peak <= self.capacity and c.host <= self.host_capacity
        if not c.fits and c.fallbacks:
            nxt, _ = self._first_within(c.fallbacks)
            if nxt is not None:
                lo = 0 if at is None else at + 1
                self.ranked.insert(bisect.bisect_right(self.ranked, nxt.sort_key(), lo=lo, key=Candidate.sort_key), nxt)
                self.counts["ranked"] += 1
        return c

    def best(self, predicate: Callable[[Candidate], bool] = lambda c: True) -> Candidate | None:
        """The fastest candidate satisfying ``predicate`` that fits, confirming down the ranking (None when none
        does: as in :meth:`top`, "none fits" must mean none does)."""
        for i, c in enumerate(self.ranked):
            if predicate(c) and self.confirm(c, i).fits:
                return c
        return None

    def top(self, k: int) -> list[Candidate]:
        """The ``k`` fastest candidates that fit: after the first, at most ``max_confirm x k`` that do not are
        confirmed; before it the walk goes on down the ranking (the bound leaves out transients -- a zero-bubble
        stage's gradients recorded for ``W`` -- so many layouts within it may be over the report, and "fits no
        layout" must mean none does)."""
        out, misses, i = [], 0, 0
        while i < len(self.ranked) and len(out) < k and (not out or misses < self.max_confirm * k):
            c = self.ranked[i]
            if self.confirm(c, i).fits:
                out.append(c)
            else:
                misses += 1
            i += 1
        return out

    def lightest_fit(self) -> Candidate | None:
        """The layout with the smallest bound that the memory report confirms fits, without step times: each family's
        smallest valid micro-batch with the most recomputation the chain allows (None when none fits)."""
        check_pins(self.cfg, self.pins, self.devices)
        light = []
        for family in layout_families(self.cfg, self.pins, self.devices, self.model_cfg, self.cluster.device != "cpu"):
            if self._check_degrees(family[0][0]):
                continue
            for chain in family:
                got = self._evaluate(chain[-1])
                if got is None:
                    continue
                if got:
                    cfg, dims, bound = got
                    light.append(Candidate(chain[-1], cfg, dims, bound, None))
                break
        light.sort(key=lambda c: c.bound.device)
        for c in light[: self.max_confirm]:
            if self.confirm(c).fits:
                return c
        return None

    def confirmed(self) -> list[Candidate]:
        """Every candidate the memory report has seen, fastest first."""
        return [c for c in self.ranked if c.fits is not None]
