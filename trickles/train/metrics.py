"""Where training numbers go: ``metrics.jsonl``, optional TensorBoard, the loss-curve PNG, and the step's
mixture-of-experts figures gathered over the ranks."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from typing import Any

import numpy as np
import torch

from ..topology import Topology


def moe_metrics(moe, model_cfg, topo: Topology, sequence_parallel: bool, device) -> dict[str, Any]:
    """A step's mixture-of-experts figures over every rank (``moe``: the step's :class:`~trickles.models.moe.MoEStats`):
    the mean load-balancing and z-losses (unweighted), the fraction of assignments dropped over capacity, and per
    MoE layer the assignments each expert took (summed over the step's micro-batches and the replicas)."""
    layers, e = model_cfg.moe_layers, model_cfg.moe_experts
    load = torch.zeros(len(layers), e, dtype=torch.float64)
    for i, layer in enumerate(layers):
        if layer in moe.load:
            load[i] = moe.load[layer].double()
    flat = torch.cat(
        [torch.tensor([moe.aux, moe.z, moe.forwards, moe.assigned, moe.dropped], dtype=torch.float64), load.flatten()]
    ).to(device)
    # tensor-parallel ranks see the same tokens, unless sequence parallelism gave each its shard
    flat = topo.comm("world").all_reduce(flat) / (1 if sequence_parallel else topo.dims.tp)
    aux, z, forwards, assigned, dropped = flat[:5].tolist()
    load = flat[5:].view(len(layers), e).round().long().tolist()
    return {
        "moe_aux_loss": aux / max(forwards, 1),
        "moe_z_loss": z / max(forwards, 1),
        "moe_dropped": dropped / max(assigned, 1),
        "moe_load": {str(layer): row for layer, row in zip(layers, load)},
    }


class MetricsLog:
    """Appends one JSON object per line to ``<out_dir>/metrics.jsonl`` (and TensorBoard if asked)."""

    def __init__(self, out_dir: str, resume_step: int | None = None, tensorboard: bool = False):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is None:
            open(self.path, "w").close()
        else:
            self._truncate_after(resume_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "train.tensorboard=true needs the tensorboard package: pip install 'trickles[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(os.path.join(out_dir, "tb"))

    def _truncate_after(self, step: int) -> None:
        """Drops records of steps after ``step`` (written after the checkpoint we resume from), and a last line
        cut short by a process that was killed while writing it."""
        if not os.path.exists(self.path):
            return
        keep = []
        for line in open(self.path):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("step", 0) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
        with open(self.path, "w") as f:
            f.writelines(keep)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in scalars(record):
                self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """A record's finite numbers as ``(tag, value)``, a mixture's per-source tables (``source_tokens``,
    ``source_val_loss``: ``{source: number}``) as ``key/source`` (what TensorBoard shows)."""
    out = []
    for k, v in record.items():
        items = v.items() if isinstance(v, dict) else [(None, v)]
        for name, x in items:
            if k != "step" and isinstance(x, (int, float)) and math.isfinite(x):
                out.append((k if name is None else f"{k}/{name}", x))
    return out


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend, for the run's plots (``train.plot``); None when matplotlib is
    missing, which the first call of the process says on stderr in one ``warning:`` line (the plots were asked for:
    ``train.plot`` is true by default) with what to do about it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say_no_matplotlib()
        return None
    return plt


@functools.cache  # once per process, whichever plot asks first
def _say_no_matplotlib() -> None:
    print(
        "[trickles] warning: train.plot=true, but matplotlib is not installed, so the run's plots (loss.png) are not "
        "drawn; pip install 'trickles[plots]', or set train.plot=false",
        file=sys.stderr,
        flush=True,
    )


def plot_loss(metrics_path: str, png_path: str) -> bool:
    """Draws training (and validation) loss against step; False (and a warning, :func:`pyplot`) when matplotlib is
    missing."""
    plt = pyplot()
    if plt is None:
        return False
    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records if "loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [r["loss"] for r in records if "loss" in r], label="train", linewidth=1)
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, png_path)
    return True


def _save(fig, png_path: str) -> None:
    """Writes ``fig`` under a temporary name, then renames it into place (a reader never sees half a PNG)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png_path)


def expert_load(records: list[dict[str, Any]]) -> tuple[list[int], dict[str, np.ndarray]]:
    """``(steps, {MoE layer: [steps, experts] share of the step's assignments each expert kept})`` from the
    metrics records' ``moe_load``."""
    rows = [r for r in records if r.get("moe_load")]
    steps = [r["step"] for r in rows]
    layers = list(rows[0]["moe_load"]) if rows else []
    out = {}
    for layer in layers:
        counts = np.array([r["moe_load"][layer] for r in rows], dtype=np.float64)
        out[layer] = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    return steps, out


def plot_expert_load(metrics_path: str, png_path: str) -> bool:
    """A heat map per mixture-of-experts block: each expert's share of the assignments (colour) over the steps;
    False when the run has no experts or matplotlib is missing (a warning, :func:`pyplot`). A balanced router is an
    even colour (1/E)."""
    steps, shares = expert_load(read_metrics(metrics_path))
    if not shares:
        return False
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(shares), 1, figsize=(8, 1.2 + 1.4 * len(shares)), dpi=120, squeeze=False, sharex=True)
    for ax, (layer, share) in zip(axes[:, 0], shares.items()):
        im = ax.imshow(
            share.T,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            origin="lower",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, share.shape[1] - 0.5),
        )
        ax.set_ylabel(f"block {layer}\nexpert")
        fig.colorbar(im, ax=ax, label="share")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("expert load (share of each step's routed assignments kept)")
    _save(fig, png_path)
    return True
