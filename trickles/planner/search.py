"""The layout search behind ``trickles plan``: every valid layout of ``N`` devices, the ones that fit, fastest first.

**What is enumerated** (:func:`enumerate_layouts`, a :class:`Layout` each): the degrees ``dp x tp x pp x cp = N``
-- ``tp`` in each mode (``1d`` any divisor; ``2d`` ``q^2``; ``2.5d`` ``q^2 d`` with ``d = tp_depth >= 2``;
``3d`` ``q^3``), ``pp <= n_layers``, ``cp`` with ``cp_mode`` ring or ulysses, ``ep`` dividing ``dp x cp``
(mixture-of-experts models only) -- and the options: ``sequence_parallel`` (1-D ``tp > 1``), ZeRO stage 0-3,
the pipeline schedule (``gpipe``, ``1f1b``, ``interleaved`` with ``virtual_stages`` ``v >= 2`` cutting the
layers evenly, ``n_layers % (pp v) == 0``), the micro-batch (every divisor of ``global_batch / dp``),
``memory.recompute`` (none, selective, full) and ``memory.offload_optimizer`` (ZeRO >= 1). The model, the
precision, the global batch and every other key stay as configured.

**Pinning** (:func:`pinned_keys`): a searched key given in the config file or with ``--set`` is fixed to its
value and the search varies only the others, so a config pinning every degree and option evaluates one layout.
``parallel.dp = -1`` (the default: "what the others leave") counts as not pinned.

**Validity** is what ``trickles train`` checks: each layout is applied to the config (:meth:`Layout.apply`) and
must pass :meth:`~trickles.config.Config.validate` at ``N`` ranks; the search never proposes what training refuses.

**Pruning by memory**, cheapest first. (1) :func:`memory_bound` -- for each pipeline rank its parameters
(:func:`~trickles.planner.compute.rank_params`) with the ZeRO formulas, ``p n / R^[z=3] + g n / R^[sharded
gradients] + k n / R^[z>=1]`` (``R = dp cp`` replicas, experts over ``edp = R / ep``; ``k`` the optimizer's
bytes per element as the memory report counts them; the optimizer on the host under offload), plus the saved
activations of its layers (:func:`trickles.memory.tp_modes.activations`) times the micro-batches in flight
(GPipe ``m``, 1F1B ``min(p - r, m)``, interleaved ``min(2 (p - r - 1) + (v - 1) p + 1, v m)`` chunks), the
head and the loss's transient on the last rank, and the report's other transients (two gradient buckets under
ZeRO-2, the root and two gathered blocks under ZeRO-3, ring attention's blocks, expert rows in flight) -- a lower
bound of the memory report's peak (it leaves out the flat buffers' padding and Adam's step counters), so a layout whose bound exceeds ``(1 - headroom)`` of device memory, or whose offloaded
optimizer exceeds the node's host memory, cannot fit. (2) The survivors are ranked by
:func:`~trickles.planner.cost.step_time`; only those a report needs -- the fastest ``K`` that fit and the best of
each alternative it explains -- get the full :func:`trickles.memory.report.predict` (cached per layout), walking
down the ranking until one fits. A layout the memory report does not model (it raises ConfigError), or a pipeline
of more than :data:`PIPELINE_REPORT_LIMIT` chunk micro-batches per rank, keeps the bound as its estimate, marked
``estimated`` (``~`` in the table).

**Ranking**: by predicted step time, ties by peak memory. Nothing here creates a process group.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..config import SECTIONS, Config
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..topology import ParallelDims
from .cluster import Cluster
from .cost import StepTime, element_bytes, step_time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The keys the search varies (``section.key``), in the order a layout is written.
SEARCHED = ("parallel.dp", "parallel.tp", "parallel.tp_mode", "parallel.tp_depth", "parallel.pp", "parallel.cp",
            "parallel.cp_mode", "parallel.ep", "parallel.sequence_parallel", "parallel.zero", "parallel.schedule",
            "parallel.virtual_stages", "train.micro_batch", "memory.recompute", "memory.offload_optimizer")
TP_MODES = ("1d", "2d", "2.5d", "3d")
RECOMPUTE = ("none", "selective", "full")
DEFAULT_HEADROOM = 0.1  # of device memory kept free, as trickles memory --device-gb does
#: Pipelines with more chunk micro-batches per rank (``v m``) keep the bound as their memory estimate: the memory
#: report walks the schedule with its messages, which takes time growing with the square of ``v m``.
PIPELINE_REPORT_LIMIT = 128


@dataclass(frozen=True)
class Layout:
    """One point of the search: the degrees and options it sets (:data:`SEARCHED`)."""

    dp: int
    tp: int
    tp_mode: str
    tp_depth: int
    pp: int
    cp: int
    cp_mode: str
    ep: int
    sequence_parallel: bool
    zero: int
    schedule: str
    virtual_stages: int
    micro_batch: int
    recompute: str
    offload_optimizer: bool

    def values(self) -> dict[str, Any]:
        """``{"section.key": value}`` for every searched key."""
        return {key: getattr(self, key.partition(".")[2]) for key in SEARCHED}

    def apply(self, cfg: Config) -> Config:
        """A copy of ``cfg`` with this layout's keys."""
        par = dataclasses.replace(cfg.parallel, **{k.partition(".")[2]: v for k, v in self.values().items()
                                                   if k.startswith("parallel.")})
        return dataclasses.replace(cfg, parallel=par, train=dataclasses.replace(cfg.train, micro_batch=self.micro_batch),
                                   memory=dataclasses.replace(cfg.memory, recompute=self.recompute,
                                                              offload_optimizer=self.offload_optimizer))

    def label(self) -> str:
        """Compact, e.g. ``dp16 tp8 pp8/1f1b v1 mb1 zero1 rc=full`` (``sp``: sequence parallel; ``off``: offload)."""
        tp = f"tp{self.tp}" + ("" if self.tp_mode == "1d" else f"/{self.tp_mode}" + (f"d{self.tp_depth}" if self.tp_mode == "2.5d" else ""))
        parts = [f"dp{self.dp}", tp + ("+sp" if self.sequence_parallel else "")]
        if self.pp > 1:
            parts.append(f"pp{self.pp}/{self.schedule} v{self.virtual_stages}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}/{self.cp_mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts += [f"mb{self.micro_batch}", f"zero{self.zero}", f"rc={self.recompute}"]
        return " ".join(parts) + (" off" if self.offload_optimizer else "")


def pinned_keys(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> set[str]:
    """The searched keys (:data:`SEARCHED`) the config file at ``path`` or an ``overrides`` item (``section.key=value``)
    gives; ``parallel.dp = -1`` does not pin. ``model.preset`` and other keys are read by
    :meth:`~trickles.config.Config.load`, not here."""
    given: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                tables = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError):
            tables = {}  # Config.load reports the file's problem
        for section, values in tables.items():
            if section in SECTIONS and isinstance(values, dict):
                given.update({f"{section}.{k}": v for k, v in values.items()})
    for item in overrides:
        key, _, value = item.partition("=")
        given[key.strip()] = value.strip()
    pins = {k for k in given if k in SEARCHED}
    if "parallel.dp" in pins and str(given["parallel.dp"]).strip() == "-1":
        pins.discard("parallel.dp")
    return pins


def plan_model(cfg: Config) -> ModelConfig:
    """The run's model with its sizes resolved (vocabulary: ``model.vocab_size``, else the tokenizer's -- a local BPE's
    configured size, without training it)."""
    from ..models.config import resolve_model

    vocab = cfg.model.vocab_size
    if vocab is None:
        if cfg.data.tokenizer == "bpe":
            vocab = cfg.data.bpe_vocab_size
        else:
            from ..data import build_tokenizer

            vocab = build_tokenizer(cfg.data).vocab_size
    return resolve_model(cfg.model, vocab, cfg.data.seq_len)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_layouts(cfg: Config, pins: set[str], devices: int) -> list[tuple[int, str, int]]:
    """``(tp, tp_mode, tp_depth)`` candidates (module docstring), pinned keys fixed."""
    par = cfg.parallel
    modes = [par.tp_mode] if "parallel.tp_mode" in pins else list(TP_MODES)
    out = []
    for tp in ([par.tp] if "parallel.tp" in pins else _divisors(devices)):
        for mode in modes:
            if mode == "1d":
                depths = [1]
            elif mode == "2.5d":
                depths = [par.tp_depth] if "parallel.tp_depth" in pins else [d for d in _divisors(tp) if d >= 2]
            else:
                depths = [1]
            for depth in depths:
                if mode != "1d" and "parallel.tp_depth" in pins and par.tp_depth != depth:
                    continue
                per, power = {"1d": (1, 1), "2d": (1, 2), "2.5d": (depth, 2), "3d": (1, 3)}[mode]
                q = round((tp / per) ** (1 / power))
                if mode != "1d" and (q < 2 or per * q ** power != tp):
                    continue
                out.append((tp, mode, depth))
    return out


def check_pins(cfg: Config, pins: set[str], devices: int) -> None:
    """ConfigError naming the first pinned degree that cannot divide ``devices`` (before anything is enumerated)."""
    if devices < 1:
        raise ConfigError(f"--devices must be a positive number of devices, got {devices}")
    product, named = 1, []
    for key in ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp"):
        if key in pins:
            value = getattr(cfg.parallel, key.partition(".")[2])
            if value < 1:
                raise ConfigError(f"{key}={value} must be at least 1 (or parallel.dp=-1: what the others leave)")
            product *= value
            named.append(f"{key}={value}")
            if devices % product:
                what = named[0] if len(named) == 1 else " x ".join(named) + f" = {product}"
                raise ConfigError(f"{what} does not divide --devices {devices}; change it or --devices")
    if "parallel.dp" in pins and {"parallel.tp", "parallel.pp", "parallel.cp"} <= pins and product != devices:
        raise ConfigError(f"{' x '.join(named)} = {product} is not --devices {devices}; change a degree or "
                          f"set parallel.dp=-1")


def enumerate_layouts(cfg: Config, pins: set[str], devices: int, model_cfg: ModelConfig) -> Iterator[Layout]:
    """Every layout of ``devices`` ranks the module docstring lists, pinned keys fixed (not yet validated)."""
    for family in layout_families(cfg, pins, devices, model_cfg):
        for chain in family:
            yield from chain


def layout_families(cfg: Config, pins: set[str], devices: int, model_cfg: ModelConfig) -> Iterator[list[list[Layout]]]:
    """The layouts of :func:`enumerate_layouts` grouped for pruning: each family differs only in the micro-batch
    (ascending: memory grows with it) and, for each micro-batch, the recomputation chain ``none, selective, full``
    (time grows along it, memory shrinks; pinned: one entry)."""
    par, n_layers = cfg.parallel, model_cfg.n_layers

    def choices(key: str, values):
        return [getattr(cfg.parallel if key.startswith("parallel.") else cfg.memory if key.startswith("memory.")
                        else cfg.train, key.partition(".")[2])] if key in pins else list(values)

    for tp, mode, depth in _tensor_layouts(cfg, pins, devices):
        rest = devices // tp if devices % tp == 0 else 0
        for pp in choices("parallel.pp", [d for d in _divisors(rest) if d <= n_layers] if rest else []):
            if not rest or rest % pp:
                continue
            for cp in choices("parallel.cp", _divisors(rest // pp)):
                if (rest // pp) % cp or (cp > 1 and mode != "1d"):
                    continue
                dp = rest // pp // cp
                if ("parallel.dp" in pins and par.dp != dp) or cfg.train.global_batch % dp:
                    continue
                cp_modes = choices("parallel.cp_mode", ("ring", "ulysses")) if cp > 1 else [par.cp_mode]
                eps = choices("parallel.ep", _divisors(dp * cp) if model_cfg.moe_experts else [1])
                sps = choices("parallel.sequence_parallel", (False, True) if tp > 1 and mode == "1d" else (False,))
                zeros = choices("parallel.zero", (0, 1) if pp > 1 else (0, 1, 2, 3))
                if pp > 1:  # GPipe: 1F1B's time in the model with more micro-batches held; searched when pinned
                    schedules = [("1f1b", 1)] + [("interleaved", v) for v in range(2, n_layers // pp + 1)
                                                 if n_layers % (pp * v) == 0]
                else:
                    schedules = [(par.schedule if par.schedule != "interleaved" else "1f1b", 1)]
                if "parallel.schedule" in pins:
                    schedules = [(s, v) for s, v in schedules if s == par.schedule] or [(par.schedule, par.virtual_stages)]
                if "parallel.virtual_stages" in pins:
                    schedules = [(s, par.virtual_stages) for s in dict.fromkeys(s for s, _ in schedules)]
                micros = choices("train.micro_batch", _divisors(cfg.train.global_batch // dp))
                recomputes = choices("memory.recompute", RECOMPUTE)
                for cp_mode in cp_modes:
                    for ep in eps:
                        for sp in sps:
                            for zero in zeros:
                                for off in choices("memory.offload_optimizer", (False, True) if zero else (False,)):
                                    for schedule, v in schedules:
                                        yield [[Layout(dp, tp, mode, depth, pp, cp, cp_mode, ep, sp, zero, schedule, v,
                                                       micro, rc, off) for rc in recomputes] for micro in micros]


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """Micro-batch chunks whose activations pipeline rank ``rank`` holds at once (module docstring); 1 without a
    pipeline."""
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)


@dataclass
class Bound:
    """:func:`memory_bound`'s result: bytes per device (the most-loaded pipeline rank) and host bytes per node."""

    device: float
    host: float
    stages: list[float]


def _activation_key(cfg: Config, dims: ParallelDims, device_type: str) -> tuple:
    """What one micro-batch's saved activations depend on, for a layout of the search (the model is the search's)."""
    micro, _ = cfg.batch_plan(dims.dp)
    return (micro, cfg.memory.recompute, cfg.memory.precision, cfg.memory.grad_dtype, dims.tp, dims.tp_mode,
            dims.tp_depth, cfg.parallel.sequence_parallel, dims.cp, cfg.parallel.cp_mode, dims.ep, device_type)


def memory_bound(cfg: Config, dims: ParallelDims, mc: ModelConfig, device_type: str, ranks_per_node: int,
                 cache: dict | None = None) -> Bound:
    """A lower bound of the memory report's peak per device, and the offloaded optimizer's host bytes per node
    (module docstring)."""
    from ..kernels import runs_triton
    from ..kernels.cross_entropy import fused_on
    from ..memory.activations import loss_transient_bytes
    from ..memory.report import expert_rows_in_flight, ring_blocks_in_flight
    from ..memory.tp_modes import activations
    from ..optim.settings import OptimizerSettings
    from ..parallel.pipeline import partition_layers
    from ..parallel.tensor_nd_costs import Layout as TPLayout, loss_transient_nd
    from .compute import rank_params

    par, mem = cfg.parallel, cfg.memory
    p, g = element_bytes(cfg)
    offload = mem.offload_optimizer
    settings = OptimizerSettings.from_train(cfg.train)
    k = 4 * len(settings.state_keys) + (4 if p != 4 or offload else 0) + (4 if g != 4 or offload else 0)
    micro, m = cfg.batch_plan(dims.dp)
    replicas, zero = dims.dp * dims.cp, par.zero
    edp = replicas // dims.ep
    sharded_grads = zero >= 2 or (zero == 1 and not cfg.accumulates(dims))
    sp = par.sequence_parallel and dims.tp > 1
    key = _activation_key(cfg, dims, device_type)
    act = cache.get(key) if cache is not None else None
    if act is None:
        act = activations(cfg, mc, TPLayout.of(dims.tp_mode, dims.tp, dims.tp_depth, par.sequence_parallel), dims, device_type)
        if cache is not None:
            cache[key] = act
    per_layer = act["per_layer"]
    v = par.virtual_stages if dims.pp > 1 else 1
    parts = partition_layers(mc.n_layers, dims.pp * v, par.pipeline_layers or None)
    lay = TPLayout.of(dims.tp_mode, dims.tp, dims.tp_depth, par.sequence_parallel)
    tokens = micro * cfg.data.seq_len // dims.cp
    loss = (loss_transient_nd(mc, lay, micro, cfg.data.seq_len) if lay.grid
            else loss_transient_bytes(mc, tokens, p, dims.tp, fused_on(mc.fused_loss, mc.kernels, device_type),
                                      runs_triton(mc.kernels, device_type)))
    in_layer = 0  # the memory report's transients of one layer at a time: ring blocks, expert rows
    if dims.cp > 1 and par.cp_mode == "ring":
        in_layer += ring_blocks_in_flight(mc, tokens, p, dims.tp)
    if dims.ep > 1 and mc.moe_layers:
        routed = tokens // dims.tp if sp else tokens
        in_layer += expert_rows_in_flight(mc, micro, routed // micro, cfg.data.seq_len, p)

    def buffers(n: int, first: bool, last: bool) -> float:
        """ZeRO's transients on ``n`` parameters: two gradient buckets (stage 2, and 1 without accumulation), or
        the root and two gathered blocks (stage 3)."""
        if sharded_grads and zero < 3:
            bucket = par.bucket_mb * 2**20 if par.bucket_mb > 0 else n * g
            return in_layer + 2 * min(bucket, n * g)
        if zero == 3:
            root = sum(rank_params(mc, dims, [], first, last))
            return in_layer + p * (root + 2 * (n - root) / mc.n_layers)
        return in_layer

    params_key = ("params", dims.tp, dims.tp_mode, dims.tp_depth, dims.ep, dims.pp, v, tuple(par.pipeline_layers))
    params = cache.get(params_key) if cache is not None else None
    if params is None:
        params = [rank_params(mc, dims, [i for c in range(v) for i in parts[c * dims.pp + r]], r == 0, r == dims.pp - 1)
                  for r in range(dims.pp)]
        if cache is not None:
            cache[params_key] = params
    stages, host = [], 0.0
    for r in range(dims.pp):
        chunks = [parts[c * dims.pp + r] for c in range(v)]
        first, last = r == 0, r == dims.pp - 1
        dense, experts = params[r]
        owned = dense / replicas + experts / edp
        whole = dense + experts
        states = p * (owned if zero == 3 else whole) + g * (owned if sharded_grads else whole)
        optimizer = k * (owned if zero >= 1 else whole)
        alive = in_flight(par.schedule, dims.pp, v, m, r)
        chunk_bytes = [sum(per_layer[i] for i in c) for c in chunks]
        held = alive * (chunk_bytes[0] if v == 1 else min(chunk_bytes))
        if last:  # (the first layer's entry includes what it keeps once for all, e.g. the rotary tables)
            held += act["head"] + loss
        stages.append(states + (0 if offload else optimizer) + held + buffers(whole, first, last))
        host = max(host, optimizer * ranks_per_node if offload else 0.0)
    return Bound(max(stages), host, stages)


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
    return (not layout.sequence_parallel, (1, 0, 2, 3).index(layout.zero), layout.offload_optimizer,
            layout.schedule != "1f1b", layout.virtual_stages)


def tp_spans_nodes(layout: Layout, search: "Search") -> bool:
    from .placement import spans_nodes

    return layout.tp > 1 and spans_nodes(ParallelDims(layout.dp, layout.tp, layout.pp, layout.cp, layout.ep,
                                                      layout.tp_mode, layout.tp_depth), "tp", search.per_node)


#: Kinds of layout the report compares with the winner (the hierarchical search refines the best seed of each).
KINDS: dict[str, Callable[[Layout, "Search"], bool]] = {
    "tensor parallelism spanning nodes": tp_spans_nodes,
    "no pipeline": lambda lay, s: lay.pp == 1,
    "a pipeline": lambda lay, s: lay.pp > 1,
    "data parallelism only": lambda lay, s: lay.tp == lay.pp == lay.cp == 1,
    "context parallelism": lambda lay, s: lay.cp > 1,
    "expert parallelism": lambda lay, s: lay.ep > 1,
    **{f"{m} tensor parallelism": (lambda m: lambda lay, s: lay.tp > 1 and lay.tp_mode == m)(m) for m in TP_MODES},
}


@dataclass
class Candidate:
    """A valid layout with its bound, its step time and, once :meth:`Search.confirm` ran, its memory report."""

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


class Search:
    """The search of the module docstring for ``cfg`` (model, precision, batch as configured) on ``devices`` devices
    of ``cluster``: :meth:`run` enumerates, prunes and ranks; :meth:`best` and :meth:`top` confirm lazily.

    A family's micro-batches are tried in ascending order and stop at the first whose most recomputing layout is over
    the bound (larger ones hold more); for each micro-batch only the first layout of the recomputation chain within
    the bound is ranked, the rest held back as its ``fallbacks`` (slower by construction) and ranked only if the
    memory report finds it does not fit."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, cluster: Cluster, devices: int, pins: set[str] = frozenset(),
                 headroom: float = DEFAULT_HEADROOM, max_confirm: int = 8, exhaustive_limit: int = 5000,
                 refine: int = 6):
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
        self.counts = {"examined": 0, "invalid": 0, "over_memory": 0, "over_host": 0, "ranked": 0, "held_back": 0,
                       "confirmed": 0}
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
            self.lightest = Candidate(layout, cfg, dims, bound, None, peak=bound.device, host=bound.host, estimated=True)
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
                return Candidate(layout, cfg, dims, bound, step_time(cfg, dims, self.model_cfg, self.cluster),
                                 fallbacks=chain[i + 1:]), False
        return None, over

    def _check_degrees(self, layout: Layout) -> str | None:
        """The ConfigError a degree layout gets with its most permissive options (no accumulation: every micro-batch
        divides it; no sequence parallelism, ZeRO, offload or interleaving), or None: when this fails, every option
        fails too."""
        loose = dataclasses.replace(layout, sequence_parallel=False, zero=0, offload_optimizer=False, schedule="1f1b",
                                    virtual_stages=1, micro_batch=self.cfg.train.global_batch // layout.dp)
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
                skipped = [c for c in family[n + 1:] if c[0] not in self._timed]
                for c in skipped:
                    self._timed[c[0]] = (None, True)
                self.counts["over_memory"] += sum(len(c) for c in skipped)
                break
        return best

    def run(self) -> "Search":
        """Enumerates and ranks: every family when the layouts number at most ``exhaustive_limit``, else the
        hierarchical search (:meth:`_hierarchical`)."""
        check_pins(self.cfg, self.pins, self.devices)
        families, refused = [], set()
        for family in layout_families(self.cfg, self.pins, self.devices, self.model_cfg):
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
            self._hierarchical(families)
        self.ranked.sort(key=Candidate.sort_key)
        self.counts["ranked"] = len(self.ranked)
        return self

    def _hierarchical(self, families: list[list[list[Layout]]]) -> None:
        """Large searches. Every degree layout (``dp, tp, mode, pp, cp, cp_mode, ep``) is seeded with its first family
        in :func:`seed_order` whose smallest micro-batch has a layout within the bound; the ``refine`` fastest seeds, and
        the fastest seed of each kind an explanation compares (:data:`KINDS`), are then improved one option at a time
        (ZeRO stage, sequence parallelism, offload, schedule, micro-batch; recomputation always the least that is within
        the bound) until no single change is faster."""
        by_degrees: dict[tuple, list[list[list[Layout]]]] = {}
        for family in families:
            by_degrees.setdefault(degrees_of(family[0][0]), []).append(family)
        seeds: dict[tuple, Candidate] = {}
        for key, fams in by_degrees.items():
            for family in sorted(fams, key=lambda f: seed_order(f[0][0])):
                cand = self._time_family(family, stop_at_first=True)
                if cand is not None:
                    seeds[key] = cand
                    break
        order = sorted(seeds, key=lambda k: seeds[k].sort_key())
        chosen = order[:self.refine]
        for kind in KINDS.values():
            first = next((k for k in order if kind(seeds[k].layout, self)), None)
            if first is not None and first not in chosen:
                chosen.append(first)
        for key in chosen:
            self._descend(by_degrees[key], seeds[key])

    def _descend(self, families: list[list[list[Layout]]], start: Candidate) -> None:
        """Coordinate descent over one degree layout's families and micro-batches from ``start``."""
        index = {options_of(f[0][0]): f for f in families}
        current = start
        for _ in range(6):
            opts, micro = options_of(current.layout), current.layout.micro_batch
            tried = []
            for name, pos in OPTION_AXES:
                for other, family in index.items():
                    if other[pos] != opts[pos] and all(other[i] == opts[i] for i in range(len(opts)) if i != pos):
                        chain = next((c for c in family if c[0].micro_batch == micro), None)
                        cand = self._time_chain(chain)[0] if chain else None
                        tried.append(cand or self._time_family(family, stop_at_first=True))
            tried.append(self._time_family(index[opts]))  # every micro-batch of the current family
            best = min((c for c in tried if c is not None), key=Candidate.sort_key, default=None)
            if best is None or best.sort_key() >= current.sort_key():
                return
            current = best

    # ---- confirming with the memory report ---------------------------------------------------------------------
    def confirm(self, c: Candidate, at: int | None = None) -> Candidate:
        """Fills ``c.peak``, ``c.host`` and ``c.fits`` from :func:`trickles.memory.report.predict` (once). When it
        does not fit, its next fallback within the bound joins the ranking (after position ``at``)."""
        if c.fits is not None:
            return c
        from ..memory.report import predict

        try:
            if c.dims.pp > 1 and c.layout.virtual_stages * c.cfg.batch_plan(c.dims.dp)[1] > PIPELINE_REPORT_LIMIT:
                raise ConfigError("the memory report's walk of this schedule would take minutes")
            c.report = predict(c.cfg, c.dims, self.model_cfg, self.device_type)
            c.peak = float(c.report.predicted["peak"])
            c.host = float(c.report.predicted["optimizer"]) * self.per_node if c.cfg.memory.offload_optimizer else 0.0
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
        """The fastest candidate satisfying ``predicate`` that fits, confirming down the ranking (None after
        ``max_confirm`` that do not fit)."""
        misses, i = 0, 0
        while i < len(self.ranked):
            c = self.ranked[i]
            if predicate(c):
                if self.confirm(c, i).fits:
                    return c
                misses += 1
                if misses >= self.max_confirm:
                    return None
            i += 1
        return None

    def top(self, k: int) -> list[Candidate]:
        """The ``k`` fastest candidates that fit."""
        out, misses, i = [], 0, 0
        while i < len(self.ranked) and len(out) < k and misses < self.max_confirm * k:
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
        for family in layout_families(self.cfg, self.pins, self.devices, self.model_cfg):
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
        for c in light[:self.max_confirm]:
            if self.confirm(c).fits:
                return c
        return None

    def confirmed(self) -> list[Candidate]:
        """Every candidate the memory report has seen, fastest first."""
        return [c for c in self.ranked if c.fits is not None]
