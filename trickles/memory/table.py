"""The memory report's table: bytes per device by category, predicted and measured, per pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30


@dataclass
class MemoryReport:
    """Bytes per device by category; ``measured`` is empty until :func:`measure` fills it."""

    predicted: dict[str, float]
    layers_predicted: list[int]
    measured: dict[str, float] = field(default_factory=dict)
    layers_measured: list[int] = field(default_factory=list)
    host_optimizer: bool = False
    notes: list[str] = field(default_factory=list)
    moe_layers: list[int] = field(default_factory=list)  # which layers are mixture-of-experts blocks
    tp_modes: str = ""  # the tensor-parallel modes at this tp, side by side (tp_modes.compare_tp_modes)
    stages: list[dict] = field(default_factory=list)  # pipeline rank r's categories (predicted's keys); one without pp
    stage_layers: list[list[int]] = field(default_factory=list)  # the layers each pipeline rank holds
    stage_ends: list[tuple[bool, bool]] = field(default_factory=list)  # whether it holds the embedding, the head
    stage: int = 0  # the pipeline rank ``predicted`` (and ``measured``) describe: the highest predicted peak
    stages_measured: list[dict] = field(default_factory=list)  # measured, per pipeline rank (with pp, on rank 0)
    routing: dict = field(
        default_factory=dict
    )  # MoE with ep: block -> rows received, balanced, predicted at that load, measured
    # MoE with ep at a balanced load: the rows a rank's experts get a block, balanced and at the routing's most
    # ("received"), and the activations and peak at that most (report._at_the_bound)
    expert_bound: dict = field(default_factory=dict)

    CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "head", "held", "transient", "peak")

    def _ends(self, r: int) -> str:
        """`` + embedding`` / `` + head`` for pipeline rank ``r`` (ZB-V holds both on rank 0)."""
        first, last = self.stage_ends[r] if self.stage_ends else (r == 0, r == len(self.stages) - 1)
        return (" + embedding" if first else "") + (" + head" if last else "")

    def table(self, device_gb: float | None = None) -> str:
        """The categories, predicted (and measured) -- with the optimizer offloaded, device and host columns apart;
        the per-layer rows; with pipeline stages, the most-loaded stage's table and a line per stage."""
        has_m = bool(self.measured)
        host = self.host_optimizer
        cols = ("device", "host") if host else ("predicted",)
        width = 18 if host else 14
        head = f"{'category':<{width}}" + "".join(f"{c:>14}" for c in cols)
        if has_m:
            head += "".join(f"{'measured ' + c if host else 'measured':>{width}}" for c in cols) + f"{'meas/pred':>11}"
        lines = []
        if len(self.stages) > 1:
            lines.append(
                f"pipeline rank {self.stage} of {len(self.stages)} (the highest peak): layers "
                f"{_span(self.stage_layers[self.stage])}{self._ends(self.stage)}"
            )
        lines += [head, "-" * len(head)]
        for c in self.CATEGORIES:
            pred, meas = self.predicted.get(c), self.measured.get(c)
            row = f"{c + (' (host)' if host and c == 'optimizer' else ''):<{width}}"
            values = [(pred, meas)]
            if host:  # the optimizer lives on the host; held and peak count the device, the host total beside them
                on_host = c == "optimizer"
                total = c in ("held", "peak")
                values = [
                    (0 if on_host else pred, 0 if on_host and has_m else (None if on_host else meas)),
                    (
                        pred if on_host else self.predicted.get("host") if total else None,
                        meas if on_host else self.measured.get("host") if total else None,
                    ),
                ]
            row += "".join(f"{_fmt(v):>14}" for v, _ in values)
            if has_m:
                ratio = f"{meas / pred:.3f}" if meas is not None and pred else "-"
                row += "".join(f"{_fmt(m):>{width}}" for _, m in values) + f"{ratio:>11}"
            lines.append(row)
        ids = self.stage_layers[self.stage] if self.stage_layers else list(range(len(self.layers_predicted)))
        if self.layers_predicted and not self.layers_measured:
            lines.append("")
            lines.extend(self._layer_summary())
        elif self.layers_predicted:
            lines.append("")
            lines.append(f"{'per layer':<14}{'predicted':>14}" + (f"{'measured':>14}" if self.layers_measured else ""))
            for k, pl in enumerate(self.layers_predicted):
                ml = self.layers_measured[k] if k < len(self.layers_measured) else None
                i = ids[k]
                name = f"layer {i}" + (" (MoE)" if i in self.moe_layers else "")
                lines.append(f"{name:<14}{_fmt(pl):>14}" + (f"{_fmt(ml):>14}" if self.layers_measured else ""))
        if len(self.stages) > 1:
            lines.append("")
            lines.extend(self.stage_lines())
        if device_gb is not None:
            peak = max(self.measured.get("peak") or 0, self.predicted["peak"])
            cap = device_gb * 1e9
            verdict = "fits" if peak <= 0.9 * cap else ("tight" if peak <= cap else "does NOT fit")
            lines.append("")
            lines.append(
                f"device of {device_gb:g} GB: peak {_fmt(peak)} is {100 * peak / cap:.0f}% of it -> {verdict}"
                + (" (keep 10% for the allocator and the framework)" if verdict == "tight" else "")
            )
        lines.extend(f"note: {n}" for n in self.notes)
        if self.tp_modes:
            lines.extend(["", self.tp_modes])
        return "\n".join(lines)

    def stage_lines(self) -> list[str]:
        """One line per pipeline rank: its layers, model states, activations in flight, held and peak (measured
        beside them once known)."""
        out = []
        for r, row in enumerate(self.stages):
            meas = self.stages_measured[r] if r < len(self.stages_measured) else {}
            states = row["parameters"] + row["gradients"] + row["optimizer"]

            def both(key, row=row, meas=meas):
                return _fmt(row[key]) + (f" ({_fmt(meas[key])} measured)" if key in meas else "")

            out.append(
                f"stage {r}: layers {_span(self.stage_layers[r])}{self._ends(r)}: model states "
                f"{_fmt(states)}, activations {both('activations')} + head {both('head')}, "
                f"held {both('held')}, peak {both('peak')}"
            )
        return out

    def _layer_summary(self) -> list[str]:
        """One line per kind of layer (dense, mixture of experts): what each keeps; the first layer apart when it
        keeps more (context parallel llama in fp32: the gathered rotary tables)."""
        moe = set(self.moe_layers)
        lines = []
        for kind in ("dense", "mixture-of-experts"):
            idx = [i for i in range(len(self.layers_predicted)) if (i in moe) == (kind != "dense")]
            if not idx:
                continue
            label = f" {kind}" if moe else ""
            first, rest = self.layers_predicted[idx[0]], [self.layers_predicted[i] for i in idx[1:]]
            if all(x == first for x in rest):
                lines.append(f"each of the {len(idx)}{label} layers: {_fmt(first)} of saved activations")
            elif len(set(rest)) > 1:  # layers recomputed in different ways (memory.recompute_num_layers)
                sizes = [self.layers_predicted[i] for i in idx]
                counts = ", ".join(f"{sizes.count(b)} x {_fmt(b)}" for b in sorted(set(sizes)))
                lines.append(f"the {len(idx)}{label} layers' saved activations: {counts}")
            else:
                lines.append(
                    f"layer {idx[0]}: {_fmt(first)}, each of the other {len(rest)}{label}: {_fmt(rest[0])} "
                    "of saved activations"
                )
        return lines

    def plot(self, path: str) -> bool:
        """Bar chart of predicted (and measured) bytes per category; False without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        cats = [c for c in self.CATEGORIES if self.predicted.get(c)]
        top = max(max(self.predicted.values()), max(self.measured.values(), default=0))
        unit, size = ("GiB", GiB) if top >= GiB else ("MiB", 2**20)
        x = range(len(cats))
        fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
        w = 0.4 if self.measured else 0.8
        ax.bar(
            [i - (w / 2 if self.measured else 0) for i in x],
            [self.predicted[c] / size for c in cats],
            w,
            label="predicted",
        )
        if self.measured:
            ax.bar([i + w / 2 for i in x], [(self.measured.get(c) or 0) / size for c in cats], w, label="measured")
        ax.set_xticks(list(x))
        ax.set_xticklabels(cats)
        ax.set_ylabel(f"{unit} per device")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return True


def _fmt(v) -> str:
    if v is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            return f"{v / size:,.2f} {unit}"
    return f"{v:,.0f} B"


def _span(ids: list[int]) -> str:
    return (
        "-"
        if not ids
        else f"{ids[0]}-{ids[-1]}"
        if ids == list(range(ids[0], ids[-1] + 1))
        else ", ".join(map(str, ids))
    )
