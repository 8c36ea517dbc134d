"""What the multi-rank benchmarks share: per-rank set-up, the entry point, the verdict and the JSON.

A benchmark runs as ``N`` ranks: under ``torchrun`` (one rank per process, its environment read),
or spawned on this machine by :func:`trickles.launch.launch` with ``--world N``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
from typing import Callable

import torch
import torch.distributed as dist

from _timing import device_name, rotations, summarize, sync, timed
from trickles.process import cpu_cores, exit_process, init_distributed, select_device


def add_run_args(p) -> None:
    """The options every multi-rank benchmark shares: rounds, device, threads, optimizer, tolerance, seed, JSON."""
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of every contestant per round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the two agreement-check steps")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads per rank on CPU (default: cores // world)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant, every contestant)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping (every contestant)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference allowed in the agreement check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH (rank 0)")


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
    """trickles: ``parallelize`` with ``settings`` (``section.key=value``), stepped as ``Trainer.train_step`` does (one micro-batch)."""

    def __init__(self, name: str, peer: str, settings: list[str], model_cfg, topo, args):
        from trickles.config import Config
        from trickles.models.transformer import Transformer
        from trickles.parallel.plan import parallelize

        super().__init__(name)
        self.peer, self.topo = peer, topo
        cfg = Config.load(None, [*settings, f"train.lr={args.lr}", "train.weight_decay=0.1", "train.beta1=0.9",
                                 "train.beta2=0.95", "train.eps=1e-8"])
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
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1, **extra)
    return device, dist.get_rank(), dist.get_world_size()


def print_verdicts(results: dict, names) -> None:
    """One line: each of ``names`` against its peer, ``<= 1.0x`` being the target."""
    verdicts = []
    for n in names:
        r, peer = results[n]["ratio"], results[n]["peer"]
        verdicts.append(f"{n}/{peer} {r:.3f}x (paired {results[n]['paired_ratio']:.3f}x): {'met' if r <= 1.0 else 'NOT met'}")
    print("\ntarget ours/peer <= 1.0x:  " + ";  ".join(verdicts))


def run_info(args, world: int, batch: int, seq: int, device: torch.device, n_params: int, model_cfg) -> dict:
    """What every multi-rank benchmark's JSON starts with: the settings, the machine and the model."""
    return {"args": vars(args), "world": world, "batch": batch, "seq": seq, "device": str(device), "device_name": device_name(device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "params": n_params,
            "model": {k: getattr(model_cfg, k) for k in ("n_layers", "d_model", "n_heads", "kv_heads", "ffn_dim", "vocab_size")}}


def write_json(path: str | None, out: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {path}")


def main(args, rank_main: Callable) -> int:
    """Runs ``rank_main(args)`` as this rank under a launcher, else on ``args.world`` spawned local ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any launcher setting its environment)
        exit_process(rank_main(args))
    if args.world < 1:
        raise SystemExit("--world must be at least 1")
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if want_cuda and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} on CUDA needs one GPU per rank, this machine has {torch.cuda.device_count()}; "
                         "lower --world or use --device cpu")
    from trickles.launch import launch

    sys.stdout.flush()
    return launch(rank_main, (args,), nproc=args.world)


def compare_times(everyone: list[dict], contestants, steps: int, tokens: int) -> tuple[dict, dict]:
    """``(results, rows)`` per contestant: step times (each round's slowest rank), their summary and the ratio to the peer.

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
        paired = statistics.median(a / b for a, b in zip(step_times[n], step_times[peer])) if peer else None
        results[n] = {**s, "peer": peer, "ratio": ratio, "paired_ratio": paired, "tokens_per_s": tokens / s["median"],
                      "times": step_times[n]}
        rows[n] = [n, f"{s['median'] * 1e3:.1f}", f"{s['mean'] * 1e3:.1f}", f"{s['stdev'] * 1e3:.1f}", f"{tokens / s['median']:,.0f}",
                   peer or "-", f"{ratio:.3f}x" if peer else "-", f"{paired:.3f}x" if peer else "-"]
    return results, rows


def finish(status: int, device: torch.device) -> int:
    """Rank 0's status on every rank; then leaves the process group."""
    from trickles.process import shutdown_distributed

    gc.collect()
    status_t = torch.tensor([status], device=device)
    dist.broadcast(status_t, 0)
    shutdown_distributed()
    return int(status_t.item())
