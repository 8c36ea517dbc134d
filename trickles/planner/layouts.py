"""The layouts ``trickles plan`` searches: :class:`Layout`, the pinned keys, and the enumeration.

See :mod:`trickles.planner.search` for what is enumerated and how pins fix keys.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..config import SECTIONS, Config
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..parallel.pipeline.schedules import SPLIT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The keys the search varies (``section.key``), in the order a layout is written.
SEARCHED = (
    "parallel.dp",
    "parallel.tp",
    "parallel.tp_mode",
    "parallel.tp_depth",
    "parallel.pp",
    "parallel.cp",
    "parallel.cp_mode",
    "parallel.ep",
    "parallel.sequence_parallel",
    "parallel.zero",
    "parallel.schedule",
    "parallel.virtual_stages",
    "parallel.pipeline_layers",
    "train.micro_batch",
    "memory.recompute",
    "memory.recompute_num_layers",
    "memory.recompute_rest",
    "memory.offload_optimizer",
)
TP_MODES = ("1d", "2d", "2.5d", "3d")
#: in the order of the time they add (elementwise reruns no matmul; with fused attention it also keeps less than
#: selective, so a layout over the bound with it is over with selective too)
RECOMPUTE = ("none", "elementwise", "selective", "full")


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
    pipeline_layers: tuple[int, ...] = ()  # layers per (virtual) stage; empty: as even as possible
    recompute_num_layers: int = 0  # recompute=full: the first ones of each rank recomputed whole (0: all)
    recompute_rest: str = "none"  # ... and the others so

    def values(self) -> dict[str, Any]:
        """``{"section.key": value}`` for every searched key (the layer split as the config's list)."""
        return {key: list(v) if isinstance(v := getattr(self, key.partition(".")[2]), tuple) else v for key in SEARCHED}

    def apply(self, cfg: Config) -> Config:
        """A copy of ``cfg`` with this layout's keys."""
        par = dataclasses.replace(
            cfg.parallel, **{k.partition(".")[2]: v for k, v in self.values().items() if k.startswith("parallel.")}
        )
        return dataclasses.replace(
            cfg,
            parallel=par,
            train=dataclasses.replace(cfg.train, micro_batch=self.micro_batch),
            memory=dataclasses.replace(
                cfg.memory,
                recompute=self.recompute,
                recompute_num_layers=self.recompute_num_layers,
                recompute_rest=self.recompute_rest,
                offload_optimizer=self.offload_optimizer,
            ),
        )

    def label(self) -> str:
        """Compact, e.g. ``dp16 tp8 pp8/1f1b v1 mb1 zero1 rc=full`` (``sp``: sequence parallel; ``off``: offload)."""
        tp = f"tp{self.tp}" + (
            "" if self.tp_mode == "1d" else f"/{self.tp_mode}" + (f"d{self.tp_depth}" if self.tp_mode == "2.5d" else "")
        )
        parts = [f"dp{self.dp}", tp + ("+sp" if self.sequence_parallel else "")]
        if self.pp > 1:
            parts.append(
                f"pp{self.pp}/{self.schedule} v{self.virtual_stages}"
                + (f" [{_runs(self.pipeline_layers)}]" if self.pipeline_layers else "")
            )
        if self.cp > 1:
            parts.append(f"cp{self.cp}/{self.cp_mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        rc = self.recompute + (
            f":{self.recompute_num_layers}+{self.recompute_rest}" if self.recompute_num_layers else ""
        )
        parts += [f"mb{self.micro_batch}", f"zero{self.zero}", f"rc={rc}"]
        return " ".join(parts) + (" off" if self.offload_optimizer else "")


def _runs(sizes: tuple[int, ...]) -> str:
    """``7,8x14,7`` for ``(7, 8, ..., 8, 7)``."""
    out: list[str] = []
    for n in sizes:
        if out and out[-1].split("x")[0] == str(n):
            head, _, count = out[-1].partition("x")
            out[-1] = f"{head}x{int(count or 1) + 1}"
        else:
            out.append(str(n))
    return ",".join(out)


def _partial_full(
    cfg: Config, pins: set[str], model_cfg: ModelConfig, n_layers: int, pp: int, mode: str, rcs: list[str]
) -> list[tuple[str, int, str]]:
    """The partial full recomputations the chain tries between selective and full: a quarter, half and three
    quarters of each rank's layers recomputed whole, the others elementwise where it is valid (else not at all);
    pinned ``memory.recompute_num_layers``/``recompute_rest`` as given. None on grids (refused), without full, or with
    ``memory.recompute`` pinned and the count not (a pinned ``full`` means every layer)."""
    if "full" not in rcs or mode != "1d" or ("memory.recompute" in pins and "memory.recompute_num_layers" not in pins):
        return []
    if "memory.recompute_num_layers" in pins:
        counts = [cfg.memory.recompute_num_layers] if cfg.memory.recompute_num_layers else []
    else:
        per_rank = -(-n_layers // pp)
        counts = sorted({k for k in (per_rank // 4, per_rank // 2, 3 * per_rank // 4) if 0 < k < per_rank})
    if "memory.recompute_rest" in pins:
        rest = cfg.memory.recompute_rest
    else:
        rest = "none" if model_cfg.moe_experts or cfg.train.compile else "elementwise"
    return [("full", k, rest) for k in counts]


def lighter_ends(n_layers: int, parts: int) -> tuple[int, ...]:
    """Layers per stage with the embedding and the output layer (and loss) each counted as one layer of the first and
    last stage (Llama 3's "one layer less on the first and last stage"): ``n_layers + 2`` cut as evenly as possible,
    then one off each end; empty where that is the even split already or leaves an end without a layer."""
    if parts < 2:
        return ()
    base, extra = divmod(n_layers + 2, parts)
    sizes = [base + (1 if s < extra else 0) for s in range(parts)]
    sizes[0] -= 1
    sizes[-1] -= 1
    even_base, even_extra = divmod(n_layers, parts)
    even = [even_base + (1 if s < even_extra else 0) for s in range(parts)]
    return () if min(sizes) < 1 or sizes == even else tuple(sizes)


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
    for tp in [par.tp] if "parallel.tp" in pins else _divisors(devices):
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
                if mode != "1d" and (q < 2 or per * q**power != tp):
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
        raise ConfigError(
            f"{' x '.join(named)} = {product} is not --devices {devices}; change a degree or set parallel.dp=-1"
        )


def enumerate_layouts(
    cfg: Config, pins: set[str], devices: int, model_cfg: ModelConfig, offload: bool = True
) -> Iterator[Layout]:
    """Every layout of ``devices`` ranks the module docstring lists, pinned keys fixed (not yet validated);
    ``offload``: whether the optimizer may go to host memory (not on CPU ranks, whose device memory is the host's)."""
    for family in layout_families(cfg, pins, devices, model_cfg, offload):
        for chain in family:
            yield from chain


def layout_families(
    cfg: Config, pins: set[str], devices: int, model_cfg: ModelConfig, offload: bool = True
) -> Iterator[list[list[Layout]]]:
    """The layouts of :func:`enumerate_layouts` grouped for pruning: each family differs only in the micro-batch
    (ascending: memory grows with it) and, for each micro-batch, the recomputation chain
    ``none, elementwise, selective, full`` (time grows along it, memory shrinks; pinned: one entry). ``offload=False``
    leaves the optimizer on the device unless the key is pinned."""
    par, n_layers = cfg.parallel, model_cfg.n_layers

    def choices(key: str, values):
        return (
            [
                getattr(
                    cfg.parallel
                    if key.startswith("parallel.")
                    else cfg.memory
                    if key.startswith("memory.")
                    else cfg.train,
                    key.partition(".")[2],
                )
            ]
            if key in pins
            else list(values)
        )

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
                zeros = choices("parallel.zero", (0, 1, 2) if pp > 1 and model_cfg.tied else (0, 1, 2, 3))
                if pp > 1:  # GPipe: 1F1B's time in the model with more micro-batches held; searched when pinned
                    # interleaved: every v that leaves each chunk a layer (uneven counts split as partition_layers or
                    # lighter_ends does, below)
                    schedules = [("1f1b", 1), ("zb-h1", 1)] + [("interleaved", v) for v in range(2, n_layers // pp + 1)]
                    schedules += [("zb-v", 2)] if n_layers >= 2 * pp else []
                else:
                    schedules = [(par.schedule if par.schedule != "interleaved" else "1f1b", 1)]
                if "parallel.schedule" in pins:
                    schedules = [(s, v) for s, v in schedules if s == par.schedule] or [
                        (par.schedule, par.virtual_stages)
                    ]
                if "parallel.virtual_stages" in pins:
                    schedules = [(s, par.virtual_stages) for s in dict.fromkeys(s for s, _ in schedules)]
                micros = choices("train.micro_batch", _divisors(cfg.train.global_batch // dp))
                recomputes = choices("memory.recompute", RECOMPUTE)
                for cp_mode in cp_modes:
                    for ep in eps:
                        for sp in sps:
                            for zero in zeros:
                                for off in choices(
                                    "memory.offload_optimizer", (False, True) if zero and offload else (False,)
                                ):
                                    for schedule, v in schedules:
                                        if schedule in SPLIT and tp > 1 and mode != "1d":
                                            continue  # the grid's layers compute both gradients in one step (refused)
                                        if schedule in SPLIT and zero == 3:
                                            continue  # ZeRO-3 gathers a block around its whole backward (refused)
                                        # zero-bubble: W would recompute fully recomputed blocks (refused)
                                        rcs = [rc for rc in recomputes if schedule not in SPLIT or rc != "full"]
                                        if "memory.recompute" not in pins and (
                                            model_cfg.moe_experts or mode != "1d" or cfg.train.compile
                                        ):
                                            rcs = [rc for rc in rcs if rc != "elementwise"]  # refused (dense 1-D only)
                                        if "parallel.pipeline_layers" in pins:
                                            splits = [tuple(par.pipeline_layers)]
                                        else:  # even, and the ends lighter by the embedding's and the head's layer
                                            splits = [()] + (
                                                [lighter_ends(n_layers, pp * v)]
                                                if pp > 1 and lighter_ends(n_layers, pp * v)
                                                else []
                                            )
                                        chain = (
                                            [(rc, 0, "none") for rc in rcs if rc != "full"]
                                            + _partial_full(cfg, pins, model_cfg, n_layers, pp, mode, rcs)
                                            + [("full", 0, "none")] * ("full" in rcs)
                                        )
                                        if "memory.recompute_num_layers" in pins and cfg.memory.recompute_num_layers:
                                            chain = [c for c in chain if c[1]]  # (pinned partial: only it is valid)
                                        if not chain:
                                            continue
                                        for split in splits:
                                            yield [
                                                [
                                                    Layout(
                                                        dp,
                                                        tp,
                                                        mode,
                                                        depth,
                                                        pp,
                                                        cp,
                                                        cp_mode,
                                                        ep,
                                                        sp,
                                                        zero,
                                                        schedule,
                                                        v,
                                                        micro,
                                                        rc,
                                                        off,
                                                        split,
                                                        n,
                                                        rest,
                                                    )
                                                    for rc, n, rest in chain
                                                ]
                                                for micro in micros
                                            ]
