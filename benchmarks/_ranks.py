"""What the multi-rank benchmarks share: per-rank set-up, the entry point, the timed rounds, the report's header,
agreement check, timing table and verdicts, and the JSON.

A benchmark runs as ``N`` ranks: under ``torchrun`` (one rank per process, its environment read),
or spawned on this machine by :func:`trickles.launch.launch` with ``--world N``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from _timing import device_name, paired, rotations, summarize, sync, table, timed

from trickles.process import cpu_cores, exit_process, init_distributed, select_device, shutdown_distributed


def add_run_args(p) -> None:
    """The options every multi-rank benchmark shares: rounds, device, threads, optimizer, tolerance, seed, JSON."""
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of every contestant per round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the two agreement-check steps")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads per rank on CPU (default: cores // world)"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant, every contestant)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping (every contestant)")
    p.add_argument(
        "--tol", type=float, default=1e-4, help="largest relative loss difference allowed in the agreement check"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH (rank 0)")


def add_model_args(p, dimension: str, batch: str, defaults: dict, world: int = 2) -> None:
    """The options of the benchmarks that train a model of ``trickles.models.PRESETS``: ranks, preset, vocabulary, batch
    (``batch`` says how it is split) and sequence length (the defaults per device type from ``defaults``)."""
    from trickles.models.presets import PRESETS

    p.add_argument(
        "--world", type=int, default=world, help=f"{dimension} degree (processes); under torchrun its WORLD_SIZE"
    )
    p.add_argument("--preset", default="demo", choices=list(PRESETS), help="model shape (trickles.models.PRESETS)")
    p.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="vocabulary size for presets that leave it to the tokenizer (demo, tiny)",
    )
    p.add_argument("--batch", type=int, default=None, help=batch)
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"tokens per sequence (default: cpu {defaults['cpu']['seq']}, cuda {defaults['cuda']['seq']})",
    )


def token_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of fp32 logits ``[B, T, V]``, the peers' loss."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class Contestant:
    """One implementation: its model, optimizer and training step on this rank."""

    peer: str | None = None  # the peer a row of ours is compared with

    def __init__(self, name: str):
        self.name = name
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Ours(Contestant):
    """trickles: ``parallelize`` with ``settings`` (``section.key=value``), stepped as ``Trainer.train_step`` does (one
    micro-batch). The engine's configuration describes the model it is given: its ``[model]`` section is
    ``model_cfg``, the shape the model is built with (per-layer settings such as recomputation come from it)."""

    def __init__(self, name: str, peer: str, settings: list[str], model_cfg, topo, args):
        from trickles.config import Config
        from trickles.models.transformer import Transformer
        from trickles.parallel.plan import parallelize

        super().__init__(name)
        self.peer, self.topo = peer, topo
        cfg = Config.load(
            None,
            [
                *settings,
                f"train.lr={args.lr}",
                "train.weight_decay=0.1",
                "train.beta1=0.9",
                "train.beta2=0.95",
                "train.eps=1e-8",
            ],
        )
        cfg.model = model_cfg  # not the defaults' shape: recompute_modes and the pipeline split count its layers
        with torch.device("meta"):
            model = Transformer(model_cfg)
        self.engine = parallelize(model, topo, cfg, args.seed)
        self.model = self.engine.model.train()
        self.lr, self.clip = args.lr, args.clip

    def step(self, x, y):
        e = self.engine
        e.zero_grad()
        with e.micro_step(last=True):
            loss = self.model(x, target=y)
            loss.backward()
        e.finish_backward()
        e.clip_grad_norm(self.clip)
        e.step(self.lr)
        wait = getattr(e, "wait_for_parameters", None)
        if wait is not None:  # ZeRO-1/2's parameter all-gathers: this step's work, not the next contestant's
            wait()
        return loss.detach()


def run_step(c: Contestant, x, y, device: torch.device, record: bool) -> None:
    """One step of ``c`` after a barrier; its loss kept, its time too when ``record``."""
    dist.barrier()
    seconds, loss = timed(lambda: c.step(x, y), device)
    c.losses.append(loss.item())
    if record:
        c.times.append(seconds)


def ledger_delta(before: dict, after: dict) -> dict:
    """What a :class:`~trickles.comm.CommLedger` snapshot gained between ``before`` and ``after``."""
    return {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in v} for k, v in after.items() if v != before.get(k)}


def time_rounds(contestants: list[Contestant], x, y, args, device: torch.device) -> None:
    """``args.warmup`` untimed then ``args.steps`` timed rounds, one step of every contestant each, order rotating."""
    by_name = {c.name: c for c in contestants}
    names = list(by_name)
    for _, name in rotations(names, args.warmup):
        run_step(by_name[name], x, y, device, record=False)
    for _, name in rotations(names, args.steps):
        run_step(by_name[name], x, y, device, record=True)
    sync(device)


def setup_rank(args) -> tuple[torch.device, int, int]:
    """Device, rank and world size of this process; CPU threads split among the local ranks; fp32 matmuls exact."""
    device = select_device(args.device)
    if device.type == "cpu":
        world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(args.threads or max(1, cpu_cores() // world))
    else:
        torch.set_float32_matmul_precision("highest")  # fp32 matmuls, so the agreement check means fp32
    if not init_distributed(device):  # a single process: the peers (DDP, FSDP2, DTensor) still want a group
        extra = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1, **extra
        )
    return device, dist.get_rank(), dist.get_world_size()


def print_verdicts(results: dict, names) -> None:
    """One line: each of ``names`` against its peer, ``<= 1.0x`` being the target."""
    verdicts = []
    for n in names:
        r, peer = results[n]["ratio"], results[n]["peer"]
        verdicts.append(
            f"{n}/{peer} {r:.3f}x (paired {results[n]['paired_ratio']:.3f}x): {'met' if r <= 1.0 else 'NOT met'}"
        )
    print("\ntarget ours/peer <= 1.0x:  " + ";  ".join(verdicts))


def run_info(args, world: int, batch: int, seq: int, device: torch.device, n_params: int, model_cfg) -> dict:
    """What every multi-rank benchmark's JSON starts with: the settings, the machine and the model."""
    return {
        "args": vars(args),
        "world": world,
        "batch": batch,
        "seq": seq,
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "params": n_params,
        "model": {
            k: getattr(model_cfg, k) for k in ("n_layers", "d_model", "n_heads", "kv_heads", "ffn_dim", "vocab_size")
        },
    }


def refuse(problem: str) -> int:
    """Stops a run that cannot go on before it starts: rank 0 says why, every rank leaves the process group; status
    2."""
    if dist.get_rank() == 0:
        print(problem, file=sys.stderr)
    shutdown_distributed()
    return 2


def entry(parse_args: Callable, rank_main: Callable) -> Callable[..., int]:
    """A benchmark's ``main(argv=None)``: its arguments parsed, then its ``rank_main`` run by :func:`main`."""

    def bench_main(argv: list[str] | None = None) -> int:
        return main(parse_args(argv), rank_main)

    return bench_main


def main(args, rank_main: Callable) -> int:
    """Runs ``rank_main(args)`` as this rank under a launcher, else on ``args.world`` spawned local ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any launcher setting its environment)
        exit_process(rank_main(args))
    if args.world < 1:
        raise SystemExit("--world must be at least 1")
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if want_cuda and torch.cuda.device_count() < args.world:
        raise SystemExit(
            f"--world {args.world} on CUDA needs one GPU per rank, this machine has {torch.cuda.device_count()}; "
            "lower --world or use --device cpu"
        )
    from trickles.launch import launch

    sys.stdout.flush()
    return launch(rank_main, (args,), nproc=args.world)


def compare_times(everyone: list[dict], contestants, steps: int, tokens: int) -> tuple[dict, dict]:
    """``(results, rows)`` per contestant: step times (each round's slowest rank), their summary and the ratio to the
    peer.

    ``vs peer`` is the ratio of medians; ``paired`` the median over rounds of (this / peer in the
    same round). ``rows[name]`` holds the table cells: name, median/mean/stdev ms, tokens/s, peer,
    vs peer, paired.
    """
    names = [c.name for c in contestants]
    step_times = {n: [max(r["times"][n][i] for r in everyone) for i in range(steps)] for n in names}
    stats = {n: summarize(step_times[n]) for n in names}
    results, rows = {}, {}
    for c in contestants:
        n, s, peer = c.name, stats[c.name], c.peer
        ratio = s["median"] / stats[peer]["median"] if peer else None
        pr = paired(step_times[n], step_times[peer]) if peer else None
        results[n] = {
            **s,
            "peer": peer,
            "ratio": ratio,
            "paired_ratio": pr,
            "tokens_per_s": tokens / s["median"],
            "times": step_times[n],
        }
        rows[n] = [
            n,
            f"{s['median'] * 1e3:.1f}",
            f"{s['mean'] * 1e3:.1f}",
            f"{s['stdev'] * 1e3:.1f}",
            f"{tokens / s['median']:,.0f}",
            peer or "-",
            f"{ratio:.3f}x" if peer else "-",
            f"{pr:.3f}x" if peer else "-",
        ]
    return results, rows


def finish(status: int, device: torch.device) -> int:
    """Rank 0's status on every rank; then leaves the process group."""
    sys.stdout.flush()
    gc.collect()
    status_t = torch.tensor([status], device=device)
    dist.broadcast(status_t, 0)
    shutdown_distributed()
    return int(status_t.item())


# ---- the report (rank 0) -------------------------------------------------------------------

TIME_COLUMNS = ["implementation", "median ms", "mean ms", "stdev ms", "tokens/s", "peer", "vs peer", "paired"]
PAIRED_NOTE = "vs peer: ratio of median step times; paired: median over rounds of (ours / peer in the same round)"


def gather(mine) -> list:
    """Every rank's ``mine`` (any picklable object), in rank order, on every rank."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def model_line(preset: str, cfg, n_params: int) -> str:
    """The report header's ``model`` line: the preset, its shape and its parameters."""
    return (
        f"  model   {preset}: {cfg.n_layers} layers, d={cfg.d_model}, heads={cfg.n_heads}/{cfg.kv_heads} kv, "
        f"ffn={cfg.ffn_dim}, vocab={cfg.vocab_size}, {n_params / 1e6:.2f}M params ({4 * n_params / 2**20:.1f} MiB fp32)"
    )


def device_line(device: torch.device) -> str:
    """The report header's ``device`` line: the machine, threads per rank, torch and the process group's backend."""
    return (
        f"  device  {device.type}: {device_name(device)}, {torch.get_num_threads()} threads per rank, "
        f"{os.cpu_count()} cores; torch {torch.__version__}, backend {dist.get_backend()}"
    )


def loss_agreement(
    everyone: list[dict],
    names,
    tol: float,
    ref: str,
    ref_losses: list[float] | None = None,
    column: str = "implementation",
    note: str | None = None,
    who: str = "the implementations disagree",
) -> bool:
    """Prints the agreement table -- every rank's step 1 and step 2 loss of each of ``names`` (``r["check"][name]``)
    against the reference's, the largest relative difference over the ranks -- then ``note``; True when every
    difference is within ``tol``, else it says so on stderr.

    The reference is the contestant ``ref`` on the same rank, or, given ``ref_losses``, the single-device model's two
    losses (a row of their own, named ``ref``)."""
    rows, ok = [], True
    if ref_losses is not None:
        rows.append([ref, f"{ref_losses[0]:.6f}", "-", f"{ref_losses[1]:.6f}", "-", ""])

    def reference(r: dict) -> list[float]:
        return ref_losses if ref_losses is not None else r["check"][ref]

    for n in names:
        diffs = [max(abs(r["check"][n][s] - reference(r)[s]) / abs(reference(r)[s]) for r in everyone) for s in (0, 1)]
        means = [statistics.fmean(r["check"][n][s] for r in everyone) for s in (0, 1)]
        good = all(d <= tol for d in diffs)
        ok &= good
        rows.append(
            [
                n,
                f"{means[0]:.6f}",
                f"{diffs[0]:.1e}",
                f"{means[1]:.6f}",
                f"{diffs[1]:.1e}",
                "ok" if good else "MISMATCH",
            ]
        )
    print(table([column, "step 1 loss", "max rel diff", "step 2 loss", "max rel diff", ""], rows))
    if note:
        print(note)
    if not ok:
        print(
            f"{who} by more than --tol {tol:g}: they do not train the same thing and the timings would be meaningless",
            file=sys.stderr,
        )
    return ok


def times_table(
    args,
    rows: list[list],
    columns: list[str] = TIME_COLUMNS,
    how: str = "",
    note: str = PAIRED_NOTE + ".",
    who: str = "contestants",
) -> None:
    """Prints the timing table (``rows``: :func:`compare_times`' cells, maybe more) under the line that says how the
    rounds ran (``how`` added to it), then ``note``, what the ratios mean."""
    print(
        f"\n{args.steps} timed rounds after {args.warmup} warm-up rounds, {who} interleaved; a step's time is its "
        f"slowest rank's{how}:"
    )
    print(table(columns, rows))
    print(note)
