"""The Gantt chart of one pipeline step: when each stage ran each forward and backward.

One row per pipeline rank; forwards are light, backwards dark and the zero-bubble schedules' weight gradients
(``W``) hatched, labelled ``c.i`` (chunk, micro-batch) when there is room; the title gives the measured bubble --
the mean over ranks of the fraction of the step a rank was not computing -- next to the schedule's prediction for
its stages at this step's mean times of each rank's forwards, backwards and ``W`` with messages that cost nothing
(:func:`~trickles.parallel.pipeline.schedules.predicted_bubble`): the gap is waiting on messages.
"""

from __future__ import annotations

from .schedules import Shape
from .timeline import Timeline, mean_times, predicted_bubble


def plot_pipeline(timeline: Timeline, shape: Shape, schedule: str, path: str) -> tuple[float, float]:
    """Writes the chart to ``path``; returns ``(measured bubble, predicted bubble)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured, predicted = timeline.bubble(), predicted_bubble(schedule, shape, mean_times(timeline))
    t0, span = timeline.start, max(timeline.makespan, 1e-9)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * shape.p))
    chunk_colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:cyan"]
    for rank, row in enumerate(timeline.spans):
        for a, s, e in row:
            color = chunk_colors[a.chunk % len(chunk_colors)]
            ax.barh(
                rank,
                (e - s) * 1e3,
                left=(s - t0) * 1e3,
                color=color,
                alpha=0.45 if a.kind == "F" else 0.95,
                hatch="//" if a.kind == "W" else None,
                edgecolor="black",
                linewidth=0.4,
            )
            if (e - s) / span > 0.02:
                ax.text(
                    (s - t0 + (e - s) / 2) * 1e3,
                    rank,
                    f"{a.kind}{a.chunk}.{a.micro}" if shape.v > 1 else f"{a.kind}{a.micro}",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.set_yticks(range(shape.p), [f"stage {r}" for r in range(shape.p)])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms); light: forward, dark: backward (B), hatched: weight gradients (W)")
    ax.set_title(
        f"{schedule}: p={shape.p}, v={shape.v}, m={shape.m}; bubble {100 * measured:.1f}% measured, "
        f"{100 * predicted:.1f}% predicted (these stage times, free messages)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return measured, predicted
