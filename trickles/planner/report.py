"""What ``trickles plan`` prints and writes from a :class:`~trickles.planner.search.Search`.

* :func:`plan_table` -- one row per layout: memory per device and the headroom left, step time, tokens/s, model
  TFLOP/s per device, MFU, bubble fraction, communication share (exposed communication over the step);
* :func:`explain` -- why the obvious alternatives lost: the fastest fitting layout of each kind the winner is not
  (tensor parallelism across nodes, no pipeline or a pipeline, each other ZeRO stage, no recomputation, ...), its
  step time over the winner's and the part of the step that grew most (:func:`largest_difference`);
* :func:`plan_json` -- per layout its degrees and options, ``step_time_s``, ``tokens_per_s``,
  ``model_tflops_per_device``, ``mfu``, ``peak_bytes`` and ``fits``;
* :func:`winner_toml` -- the winner as a config ``trickles train -c F`` runs;
* :func:`no_fit_message` -- when nothing fits: the smallest cluster of the same machines that would, and the
  pinned keys whose release would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import Config
from ..models.config import ModelConfig
from .candidate import KINDS, Candidate
from .search import Search

GiB = 2**30


def _gib(v: float) -> str:
    return f"{v / GiB:,.1f}"


def _bytes(v: float) -> str:
    """``12.3 GiB``, ``45.6 MiB`` or ``789 KiB``."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if v >= size:
            return f"{v / size:,.1f} {unit}"
    return f"{v / 1024:,.0f} KiB"


def plan_table(search: Search, rows: list[Candidate]) -> str:
    """The ranked layouts as a text table (module docstring); ``~`` marks memory the bound estimates."""
    cap = search.cluster.device_memory_bytes
    w = max([len("layout"), *(len(c.layout.label()) for c in rows)]) + 2
    head = (
        f"{'#':>3}  {'layout':<{w}}{'memory/device':>15}{'free':>6}{'step s':>9}{'tokens/s':>11}{'TFLOP/s':>9}"
        f"{'MFU':>6}{'bubble':>8}{'comm':>6}"
    )
    lines = [head, "-" * len(head)]
    for i, c in enumerate(rows, 1):
        st = c.time
        mem = ("~" if c.estimated else "") + _bytes(c.peak)
        lines.append(
            f"{i:>3}  {c.layout.label():<{w}}{mem:>15}{1 - c.peak / cap:>6.0%}{st.total_s:>9.3g}"
            f"{st.tokens_per_s:>11,.0f}{st.model_flops_per_device / 1e12:>9.3g}{st.mfu:>6.1%}"
            f"{st.bubble_fraction:>8.1%}{st.comm_share:>6.1%}"
        )
    return "\n".join(lines)


def summary(search: Search) -> str:
    """One line: the cluster, the memory limit, what the search looked at."""
    c, n = search.counts, search.cluster
    how = (
        "every layout timed"
        if search.exhaustive
        else (f"the fastest degree layouts refined option by option ({c['ranked']} timed)")
    )
    pinned = f"; pinned: {', '.join(sorted(search.pins))}" if search.pins else ""
    return (
        f"[trickles] plan for {search.devices} devices of {n.name} ({n.nodes} x {n.devices_per_node}, "
        f"{n.device_memory_gib:g} GiB each, {search.headroom:.0%} kept free: limit {_gib(search.capacity)} GiB): "
        f"{c['layouts']:,} layouts, {c['invalid']:,} invalid, {c['over_memory'] + c['over_host']:,} over memory by the "
        f"bound, {how}; memory report run on {c['confirmed']}{pinned}"
    )


def largest_difference(alt: Candidate, win: Candidate) -> str:
    """The part of ``alt``'s step that exceeds the winner's the most, e.g. ``+1.2 s exposed tp communication``."""

    def parts(st) -> dict[str, float]:
        out = {
            "compute": st.compute_s - st.recompute_s,
            "recomputation": st.recompute_s,
            "pipeline bubble": st.bubble_s,
            "optimizer step": st.optimizer_s,
            "offload": st.offload_s,
        }
        out.update({f"exposed {g} communication": v for g, v in st.exposed_by_group.items()})
        return out

    a, w = parts(alt.time), parts(win.time)
    name, delta = max(((k, a.get(k, 0.0) - w.get(k, 0.0)) for k in set(a) | set(w)), key=lambda kv: kv[1])
    if delta <= 0:
        return "no part slower; ties broken by memory"
    return f"+{delta:.3g} s {name}"


def _line(what: str, alt: Candidate | None, win: Candidate, search: Search) -> str:
    if alt is None:
        return f"{what}: none fits within {_gib(search.capacity)} GiB per device"
    why = largest_difference(alt, win)
    notes = [n for n in alt.time.notes if n.split(" ")[0] not in " ".join(win.time.notes)]
    extra = f"; {notes[0]}" if notes else ""
    return (
        f"{what}: {alt.layout.label()} takes {alt.time.total_s / win.time.total_s:.2f}x the winner's step time "
        f"({why}{extra})"
    )


def explain(search: Search, win: Candidate) -> list[str]:
    """One line per alternative the winner is not (module docstring), from the numbers."""
    lay = win.layout
    checks: list[tuple[str, Any]] = []
    for kind, pred in KINDS.items():
        if not pred(lay, search.per_node):
            checks.append((f"best with {kind}", lambda c, p=pred: p(c.layout, search.per_node)))
    for z in range(4):
        if z != lay.zero:
            checks.append((f"best with ZeRO-{z}", lambda c, z=z: c.layout.zero == z))
    if lay.recompute != "none":
        checks.append(("best without recomputation", lambda c: c.layout.recompute == "none"))
    if lay.recompute != "full":
        checks.append(("best with more recomputation", lambda c: _RC[c.layout.recompute] > _RC[lay.recompute]))
    if lay.tp > 1 and lay.tp_mode == "1d":
        checks.append(
            (
                f"best {'without' if lay.sequence_parallel else 'with'} sequence parallelism",
                lambda c: c.layout.tp > 1 and c.layout.sequence_parallel != lay.sequence_parallel,
            )
        )
    checks.append(
        (
            f"best {'without' if lay.offload_optimizer else 'with'} the optimizer offloaded",
            lambda c: c.layout.offload_optimizer != lay.offload_optimizer,
        )
    )
    checks.append(("best with a larger micro-batch", lambda c: c.layout.micro_batch > lay.micro_batch))
    if lay.pp > 1:
        checks.append(
            (
                f"best with another pipeline schedule than {lay.schedule}",
                lambda c: c.layout.pp > 1 and c.layout.schedule != lay.schedule,
            )
        )
        checks.append(
            (
                f"best with {'an even' if lay.pipeline_layers else 'an uneven'} layer split",
                lambda c: c.layout.pp > 1 and bool(c.layout.pipeline_layers) != bool(lay.pipeline_layers),
            )
        )
    found: dict[Any, list[str]] = {}  # alternative layout (or None) -> what it is the best of
    for what, pred in checks:
        if not any(pred(c) for c in search.ranked):
            continue  # a kind the search has no layout of (e.g. expert parallelism for a dense model)
        alt = search.best(pred)
        found.setdefault(alt.layout if alt else what, []).append(what)
    lines = []
    for key, whats in found.items():
        alt = next((c for c in search.ranked if c.layout == key), None)
        lines.append(_line(", ".join(whats), alt, win, search))
    return lines


_RC = {"none": 0, "elementwise": 1, "selective": 2, "full": 3}


def layout_json(c: Candidate) -> dict[str, Any]:
    """One layout for ``--json``: ``peak_bytes`` and ``fits`` from the memory report where it ran; for a layout it
    did not run on, the bound's peak, ``memory_estimated`` true and ``fits`` null."""
    st = c.time
    peak, host = (c.peak, c.host) if c.fits is not None else (c.bound.device, c.bound.host)
    return {
        "layout": c.layout.label(),
        **{k: v for k, v in c.layout.values().items()},
        "step_time_s": st.total_s,
        "tokens_per_s": st.tokens_per_s,
        "model_tflops_per_device": st.model_flops_per_device / 1e12,
        "mfu": st.mfu,
        "bubble_fraction": st.bubble_fraction,
        "comm_share": st.comm_share,
        "peak_bytes": int(peak),
        "host_bytes_per_node": int(host),
        "memory_estimated": c.estimated or c.fits is None,
        "fits": None if c.fits is None else bool(c.fits),
    }


def plan_json(search: Search, top: list[Candidate]) -> dict[str, Any]:
    """The plan for ``--json``: the cluster and limits, the winners, and every layout timed, fastest first (those the
    memory report saw with its peak, the others with the bound's)."""
    n = search.cluster
    return {
        "devices": search.devices,
        "cluster": dataclasses.asdict(n),
        "headroom": search.headroom,
        "memory_limit_bytes": int(search.capacity),
        "pinned": sorted(search.pins),
        "counts": dict(search.counts),
        "exhaustive": search.exhaustive,
        "top": [c.layout.label() for c in top],
        "layouts": [layout_json(c) for c in search.ranked],
    }


def winner_toml(cfg: Config, win: Candidate) -> str:
    """The input config with the winner's keys, as TOML (:meth:`~trickles.config.Config.to_toml`)."""
    chosen = win.layout.apply(cfg)
    keys = ", ".join(f"{k}={v}" for k, v in win.layout.values().items())
    return f"# trickles plan: {win.layout.label()}\n# {keys}\n" + chosen.to_toml()


def no_fit_message(search: Search, cfg: Config, model_cfg: ModelConfig, max_devices: int = 1 << 16) -> str:
    """Nothing fits: the first line says so; then the smallest cluster of the same machines that fits (doubling the
    devices), and each pinned key whose release makes one fit at these devices."""
    from .search import Search as _Search

    n = search.cluster
    if not search.ranked and not search.lightest:
        common = max(search.errors, key=search.errors.get) if search.errors else "no layout to try"
        return f"no layout of {search.devices} devices is valid for this config: {common}"
    light = search.lightest
    first = (
        f"the model fits no layout of {search.devices} devices of {n.name} ({_gib(search.capacity)} GiB per device "
        f"after {search.headroom:.0%} headroom)"
    )
    detail = []
    if light is not None:
        detail.append(
            f"the lightest valid layout, {light.layout.label()}, needs at least {_gib(light.bound.device)} GiB "
            f"per device"
            + (
                f" and {_gib(light.bound.host)} GiB of host memory per node"
                if light.bound.host > search.host_capacity
                else ""
            )
        )
    fixes = []
    for key in sorted(search.pins):
        released = _Search(cfg, model_cfg, n, search.devices, search.pins - {key}, search.headroom)
        fit = _fitting(released)
        if fit is not None:
            fixes.append(f"{key}={_toml(fit.layout.values()[key])} ({fit.layout.label()})")
    if fixes:
        detail.append("it fits with " + " or ".join(fixes))
    devices = search.devices * 2
    while devices <= max_devices:
        bigger = _Search(cfg, model_cfg, n, devices, search.pins, search.headroom)
        fit = _fitting(bigger)
        if fit is not None:
            nodes = bigger.cluster.nodes
            where = (
                f"{devices} devices ({nodes} node{'s' if nodes > 1 else ''} of {n.devices_per_node})"
                if n.device == "cuda"
                else f"{devices} ranks"
            )
            detail.append(
                f"the smallest {n.name} cluster that fits: {where}, e.g. {fit.layout.label()} "
                f"({'~' if fit.estimated else ''}{_gib(fit.peak)} GiB per device)"
            )
            break
        devices *= 2
    else:
        detail.append(f"no {n.name} cluster of up to {max_devices} devices fits it")
    return first + "\n" + "\n".join(f"  {d}" for d in detail)


def _fitting(search: Search) -> Candidate | None:
    """The lightest layout of ``search`` that the memory report confirms fits (no step times)."""
    from ..errors import ConfigError

    try:
        return search.lightest_fit()
    except ConfigError:
        return None


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
