"""Weak scaling: the same work per rank on 1, 2, 4, ... ranks, and what communication costs.

:func:`measure_scaling` (``trickles bench scaling``) runs the real :class:`~trickles.train.trainer.Trainer`
at each world size ``n`` with the same work per rank. The configuration's micro-batch ``b`` and
accumulation ``a`` per data-parallel rank (at its own ``parallel.dp``; at dp = 1 when that is -1)
stay fixed, and so do its tensor-, pipeline- and context-parallel degrees; the data-parallel degree
and the global batch grow with ``n``:

    dp_n = n / (tp * pp * cp),   global_batch_n = b * a * dp_n

Each world size is a fresh set of ``n`` local ranks (:func:`trickles.launch.launch`: one GPU per
rank on CUDA, gloo on CPU) that run ``W`` warm-up steps and ``N`` timed steps, with no evaluation,
sampling or checkpoints (nothing is written to ``train.out_dir``). On timed step ``s`` rank ``r``
measures its step time ``t[s][r]`` (``Trainer.train_step``'s ``step_time``), the seconds ``c[s][r]``
it spent blocked in communication (the increase of :data:`trickles.comm.flight`'s ``blocked_s``
over the step: every blocking collective, receive and ``Handle.wait``, i.e. the communication
that computation did not hide), and the bytes it sent (wire bytes in its topology's
:class:`~trickles.comm.CommLedger`). One row of the report is

    step time     T_n = median_s max_r t[s][r]                 a step ends when its slowest rank does
    throughput    X_n = global_batch_n * seq_len / T_n         tokens/s
    scale factor      = (X_n / n) / (X_n0 / n0)                = X_n / (n * X_1) when the first row is n0 = 1
    comm share        = median_s ( mean_r c[s][r] / max_r t[s][r] )
    bytes sent        = mean_r (bytes rank r sent in the N steps) / N

The scale factor is 1 for perfect weak scaling (n ranks do n times the work in the time one rank
takes for its share) and falls as communication, waiting for stragglers and shared hardware eat
into it.

Communication time is the **mean** over ranks, not the max. A rank's blocked seconds include
the time it waited for slower ranks to reach the collective, so the max is usually the fastest
rank's wait for the slowest -- load imbalance, counted as if every rank lost it. The mean over
ranks divided by the step time is the fraction of all rank-seconds spent blocked, which is the
share of the machine's throughput that communication (and waiting at it) costs. Since each
rank's blocked time lies inside its own step, the share is in [0, 1]. On NCCL a wait makes the
compute stream wait rather than the host, so host-side blocked time is a lower bound there; the
rest shows up in the step time.

Threads: every rank, at every ``n``, runs ``max(1, cores // max(ranks))`` intra-op threads, so
a rank has the same CPU resources whatever the world size (the weak-scaling premise, as one
GPU per rank is on CUDA).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError, UserError
from ..process import cpu_cores
from ..topology import ParallelDims


@dataclass
class RankSamples:
    """What one rank measured over the timed steps."""

    step_time: list[float]  # seconds per step
    blocked: list[float]  # seconds blocked in communication calls per step
    sent: dict[str, int] = field(default_factory=dict)  # wire bytes sent over all timed steps, by "op/group"


@dataclass
class ScalingRow:
    """One world size of the report (see the module doc for the formulas)."""

    ranks: int
    global_batch: int
    step_time: float  # seconds: median over steps of the slowest rank's step time
    tokens_per_s: float  # global_batch * seq_len / step_time
    comm_share: float  # median over steps of (mean over ranks of blocked seconds) / slowest step time
    comm_time: float  # seconds: median over steps of the mean over ranks of blocked seconds
    bytes_sent: float  # wire bytes per rank per step, mean over ranks
    sent_by_op: dict[str, float]  # the same by "op/group"
    step_times: list[float]  # the slowest rank's time of each timed step
    scale: float = 1.0  # (X_n / n) / (X_n0 / n0), the first row being n0
    device: str = ""
    threads: int = 0  # intra-op threads per rank


class RanksFailed(RuntimeError):
    """The ranks of one world size did not all succeed; the launcher has already said why."""

    def __init__(self, ranks: int, exit_code: int):
        super().__init__(f"the run on {ranks} rank(s) stopped with exit status {exit_code}")
        self.ranks, self.exit_code = ranks, exit_code


# ---- the arithmetic ------------------------------------------------------------------------


def summarize(ranks: int, global_batch: int, seq_len: int, samples: list[RankSamples]) -> ScalingRow:
    """The row of one world size from every rank's measurements (``scale`` is set by :func:`scale_rows`)."""
    if len(samples) != ranks:
        raise ValueError(f"expected the samples of {ranks} ranks, got {len(samples)}")
    steps = len(samples[0].step_time)
    if steps < 1 or any(len(s.step_time) != steps or len(s.blocked) != steps for s in samples):
        raise ValueError("every rank must report the same number (at least 1) of step times and blocked times")
    slowest = [max(s.step_time[i] for s in samples) for i in range(steps)]
    blocked = [statistics.fmean(s.blocked[i] for s in samples) for i in range(steps)]
    step_time = statistics.median(slowest)
    ops = sorted({op for s in samples for op in s.sent})
    sent_by_op = {op: statistics.fmean(s.sent.get(op, 0) for s in samples) / steps for op in ops}
    return ScalingRow(
        ranks=ranks,
        global_batch=global_batch,
        step_time=step_time,
        tokens_per_s=global_batch * seq_len / step_time,
        comm_share=statistics.median(c / t for c, t in zip(blocked, slowest)),
        comm_time=statistics.median(blocked),
        bytes_sent=float(sum(sent_by_op.values())),
        sent_by_op=sent_by_op,
        step_times=slowest,
    )


def scale_rows(rows: list[ScalingRow]) -> list[ScalingRow]:
    """Sets each row's scale factor ``(X_n / n) / (X_n0 / n0)`` against the first row; returns ``rows``."""
    if rows:
        per_rank = rows[0].tokens_per_s / rows[0].ranks
        for r in rows:
            r.scale = (r.tokens_per_s / r.ranks) / per_rank
    return rows


# ---- what runs where -----------------------------------------------------------------------


def host(cfg: Config) -> tuple[str, int]:
    """``("cuda", GPUs)`` when the ranks will run on GPUs, else ``("cpu", cores)``."""
    device = cfg.train.device
    if device != "cpu" and torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    if device.startswith("cuda"):
        raise ConfigError(
            "train.device asks for CUDA, but torch.cuda.is_available() is false; use train.device=auto or cpu"
        )
    return "cpu", cpu_cores()


def _replica(cfg: Config) -> int:
    """Ranks of one data-parallel replica: ``tp * pp * cp`` (each checked to be at least 1)."""
    p = cfg.parallel
    dims = ParallelDims.infer(1, dp=1, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)
    return dims.tp * dims.pp * dims.cp


def default_ranks(cfg: Config) -> list[int]:
    """``u, 2u, 4u, ...`` (``u = tp * pp * cp``) up to the GPUs, or on CPU up to the cores but at least ``2u``."""
    kind, capacity = host(cfg)
    unit = _replica(cfg)
    top = capacity if kind == "cuda" else max(capacity, 2 * unit)
    out, n = [], unit
    while n <= top:
        out.append(n)
        n *= 2
    return out or [unit]  # more ranks than GPUs: plan() says what to change


def weak_scaling_config(cfg: Config, n: int, steps: int) -> Config:
    """``cfg`` on ``n`` ranks with the same work per rank (see the module doc); nothing evaluated, sampled or saved."""
    if n < 1:
        raise UserError(f"--ranks must be at least 1, got {n}")
    unit = _replica(cfg)
    p = cfg.parallel
    if n % unit:
        raise ConfigError(
            f"{n} rank(s) cannot hold parallel.tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {unit} ranks per "
            f"data-parallel replica; give --ranks multiples of {unit} (e.g. --ranks {unit} {2 * unit}) or change "
            "parallel.tp/pp/cp"
        )
    micro, accumulation = cfg.batch_plan(p.dp if p.dp >= 1 else 1)
    dp = n // unit
    train = dataclasses.replace(
        cfg.train,
        global_batch=micro * accumulation * dp,
        micro_batch=micro,
        steps=steps,
        eval_every=0,
        sample_tokens=0,
        checkpoint_every=0,
        plot=False,
        tensorboard=False,
        pipeline_trace="",
    )
    return dataclasses.replace(cfg, train=train, parallel=dataclasses.replace(p, dp=dp))


def plan(cfg: Config, ranks: list[int] | None, steps: int, warmup: int) -> list[tuple[int, Config]]:
    """``[(n, config at n), ...]`` in increasing ``n``, every one validated; raises a one-line error otherwise.

    Runs before any process exists, so bad input never starts a rank.
    """
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise UserError(f"--warmup must not be negative, got {warmup}")
    p = cfg.parallel
    # the layout as written, whose per-rank work is scaled (dp unset: the fewest ranks that hold the experts' split)
    cfg.validate(_replica(cfg) * (p.dp if p.dp >= 1 else p.ep))
    kind, capacity = host(cfg)
    ranks = sorted(set(ranks)) if ranks else default_ranks(cfg)
    if kind == "cuda":
        if ranks[-1] > capacity:
            raise UserError(
                f"{ranks[-1]} ranks need one GPU each but {capacity} GPU(s) are visible; "
                f"give --ranks up to {capacity}, or --set train.device=cpu to run the ranks on the CPU"
            )
        if cfg.train.device.startswith("cuda:") and ranks[-1] > 1:
            raise ConfigError(
                f"train.device={cfg.train.device} puts every rank on one GPU; use train.device=cuda or auto"
            )
    out = []
    for n in ranks:
        scaled = weak_scaling_config(cfg, n, warmup + steps)
        scaled.validate(n)
        out.append((n, scaled))
    from ..data.sources import check_source

    check_source(cfg.data)
    return out


# ---- measuring -----------------------------------------------------------------------------


def _wire_bytes(ledger) -> dict[str, int]:
    return {k: v["wire_bytes"] for k, v in ledger.snapshot().items()}


def measure_rank(cfg: Config, steps: int, warmup: int, threads: int, result_path: str) -> None:
    """One rank of one world size: ``warmup`` then ``steps`` timed training steps; rank 0 writes every
    rank's :class:`RankSamples` (and the device and threads) to ``result_path`` as JSON."""
    import torch.distributed as dist

    from ..comm import flight
    from ..process import env_world_size
    from ..topology import distributed_session
    from .trainer import Trainer

    torch.set_num_threads(threads)
    dims = cfg.validate(env_world_size())
    with distributed_session(dims, cfg.train.device, cfg.parallel.timeout_s) as topo:
        trainer = Trainer(cfg, topo, quiet=True)
        for _ in range(warmup):
            trainer.train_step()
        before = _wire_bytes(topo.ledger)
        times, blocked = [], []
        for _ in range(steps):
            start = flight.blocked_s
            times.append(trainer.train_step()["step_time"])
            blocked.append(flight.blocked_s - start)
        after = _wire_bytes(topo.ledger)
        sent = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        mine = dataclasses.asdict(RankSamples(times, blocked, sent))
        samples: list[Any] = [mine]
        if topo.world_size > 1:
            samples = [None] * topo.world_size
            dist.all_gather_object(samples, mine)
        if topo.is_main:
            with open(result_path + ".tmp", "w") as f:
                json.dump({"device": str(topo.device), "threads": torch.get_num_threads(), "samples": samples}, f)
            os.replace(result_path + ".tmp", result_path)
        del trainer


def measure_scaling(
    cfg: Config, ranks: list[int] | None = None, steps: int = 5, warmup: int = 2, quiet: bool = True
) -> list[ScalingRow]:
    """Runs ``cfg`` with the same work per rank on each world size in ``ranks`` (default:
    :func:`default_ranks`) and returns one :class:`ScalingRow` per world size, smallest first.

    Call it from a single process (not under torchrun): it starts the ranks itself. Raises
    :class:`~trickles.errors.UserError` for bad input before any rank starts, and
    :class:`RanksFailed` when a world size's ranks did not all succeed.
    """
    from ..launch import launch

    runs = plan(cfg, ranks, steps, warmup)
    threads = max(1, cpu_cores() // runs[-1][0])
    rows = []
    with tempfile.TemporaryDirectory(prefix="trickles-scaling-") as tmp:
        for n, scaled in runs:
            if not quiet:
                print(
                    f"[trickles] {n} rank(s): global batch {scaled.train.global_batch}, {warmup} warm-up + {steps} "
                    "timed steps",
                    flush=True,
                )
            path = os.path.join(tmp, f"ranks{n}.json")
            status = launch(measure_rank, (scaled, steps, warmup, threads, path), n)
            if status != 0:
                raise RanksFailed(n, status)
            with open(path) as f:
                result = json.load(f)
            row = summarize(
                n, scaled.train.global_batch, scaled.data.seq_len, [RankSamples(**s) for s in result["samples"]]
            )
            row.device, row.threads = result["device"], result["threads"]
            rows.append(row)
    return scale_rows(rows)


# ---- reporting -----------------------------------------------------------------------------

COLUMNS = ("ranks", "global batch", "step time (ms)", "tokens/s", "scale factor", "comm share", "bytes sent/rank/step")


def _human_bytes(v: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def scaling_table(rows: list[ScalingRow]) -> str:
    """The rows as a text table, one world size per line (each cell one word), and how to read it."""
    cells = [list(COLUMNS)] + [
        [
            str(r.ranks),
            str(r.global_batch),
            f"{1e3 * r.step_time:.1f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.scale:.3f}",
            f"{100 * r.comm_share:.1f}%",
            f"{r.bytes_sent:,.0f}",
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        r = rows[-1]
        lines.append("")
        lines.append(
            f"scale factor = (tokens/s / ranks) relative to {rows[0].ranks} rank(s) (1.000: perfect weak scaling); "
            f"comm share = time ranks spent blocked in communication / step time"
        )
        lines.append(
            f"{r.ranks} ranks send {_human_bytes(r.bytes_sent)} each per step; device {r.device}, "
            f"{r.threads} thread(s) per rank"
        )
    return "\n".join(lines)


def scaling_json(rows: list[ScalingRow], steps: int, warmup: int) -> dict[str, Any]:
    """The report as a JSON-ready dict: the settings and every row with all its fields."""
    return {"steps": steps, "warmup": warmup, "columns": list(COLUMNS), "rows": [dataclasses.asdict(r) for r in rows]}


def plot_scaling(rows: list[ScalingRow], path: str) -> bool:
    """Throughput against ranks with ideal linear scaling from the first row, and the comm share;
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n = [r.ranks for r in rows]
    ideal = [rows[0].tokens_per_s * k / rows[0].ranks for k in n]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    left.plot(n, ideal, "--", color="gray", label="ideal (linear)")
    left.plot(n, [r.tokens_per_s for r in rows], "o-", label="measured")
    for r in rows:
        left.annotate(
            f"{r.scale:.2f}", (r.ranks, r.tokens_per_s), textcoords="offset points", xytext=(4, -12), fontsize=8
        )
    left.set_xlabel("ranks")
    left.set_ylabel("tokens/s")
    left.set_title("weak scaling: throughput (labels: scale factor)")
    right.bar([str(k) for k in n], [100 * r.comm_share for r in rows], color="tab:orange")
    right.set_xlabel("ranks")
    right.set_ylabel("% of step time blocked in communication")
    right.set_ylim(0, 100)
    right.set_title("communication share")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend()
    if len(n) > 1:
        left.set_xticks(n)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
