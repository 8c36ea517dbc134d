"""Data-parallel training step: trickles' ZeRO engines vs PyTorch DDP and FSDP2, same run.

What is compared
    One full training step -- forward, cross-entropy, backward, gradient reduction over the
    data-parallel group, global-norm clipping (1.0), AdamW step -- at data-parallel degree
    ``N`` (``--world``), for

    * ours: ``trickles.parallel.plan.parallelize`` with ``parallel.zero`` = 0 (bucketed,
      overlapped all-reduce), 1, 2 and 3; ``--offload`` adds stages 1-3 with
      ``memory.offload_optimizer`` (optimizer state and step in host memory);
    * peers: ``torch.nn.parallel.DistributedDataParallel`` (same bucket size,
      ``gradient_as_bucket_view=True``) and FSDP2 (``torch.distributed.fsdp.fully_shard`` on
      every transformer block and then on the root, ``reshard_after_forward=True``, over
      ``init_device_mesh(device, (N,))``), both with ``torch.optim.AdamW`` (foreach on CPU,
      fused on CUDA) over the same decay / no-decay groups as ours, and
      ``torch.nn.utils.clip_grad_norm_`` (for FSDP2 the norm of the sharded gradients is
      reduced over the mesh, as torchtitan does).

    * DeepSpeed ZeRO stages 1, 2 and 3 (``deepspeed.initialize`` with the same ``torch.optim.AdamW``
      as its client optimizer, ``gradient_clipping`` = ours, ``overlap_comm``, buckets of
      ``--bucket-mb``; on CPU ``DS_ACCELERATOR=cpu`` over gloo), where ``deepspeed`` imports
      (an optional dependency; ``--no-deepspeed`` leaves it out).

    Pairs: stage 0 vs DDP, stages 1 and 2 vs DDP (same communication volume, less memory),
    stage 3 vs FSDP2; offload rows against the same peers; and each of our stages 1-3 against
    DeepSpeed's same stage (a table of its own).

How
    * Every contestant lives in the same ``N`` processes at once, on the same model shape,
      batch and initial weights: peers get ``build_model(cfg, seed)`` on every rank, ours a
      meta-device model that ``parallelize`` initializes from the same seed (the
      initialization is a pure function of seed and parameter name, so it is identical).
    * Same data: a global batch of random tokens from a fixed generator; rank ``r`` trains on
      rows ``[r B/N, (r+1) B/N)``; the loss is the mean over the rank's rows, so the averaged
      gradient is that of the global batch.
    * Agreement check before timing: two steps each; every rank's loss at step 1 (same
      weights) and step 2 (after one update) must agree with DDP's within ``--tol`` (relative,
      default 1e-4 in fp32), else the run stops.
    * Communication: the bytes this rank sends per step in our engines, from the topology's
      ``CommLedger`` (``snapshot()`` around one step), next to the textbook volume
      ``k (N-1)/N * 4P`` with ``k = 2`` for stages 0-2 (all-reduce, or reduce-scatter plus
      all-gather) and ``k = 3`` for stage 3 (two all-gathers and one reduce-scatter).
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds in which every contestant
      runs one step, the order rotating each round so noise falls on all of them alike. Each
      step starts after a barrier; its time is the slowest rank's. The table gives median
      and mean step time, the ratio of medians against the peer (``vs peer``) and the paired
      ratio (median over rounds of ours/peer in the same round).
    * Memory: bytes per rank of parameters, gradients and optimizer state after a step, from
      ``engine.memory()`` for ours and measured from the peers' live tensors (local shards
      for FSDP2; DDP's gradients are views into its buckets). For the DeepSpeed table, every
      contestant's *resident* bytes: the growth of the live tensors (distinct storages reachable
      from Python) while it is built and runs its two agreement steps, so each keeps what it
      keeps between steps, whatever it calls it.
    * A step of ours ends when everything it started has finished: ZeRO-1/2 wait for their
      parameter all-gathers (which the next forward would otherwise wait for).
    * CPU: ``torch.set_num_threads(cores // N)`` in every rank (``--threads`` overrides).

Target
    ours/peer median step time <= 1.0x: stage 0 vs DDP, stage 3 vs FSDP2 (stages 1-2 vs DDP
    are reported; they trade a little time for memory).

Examples::

    python benchmarks/data_parallel.py                        # CPU, 2 ranks, demo shape (vocab 4096), batch 8 x 256
    python benchmarks/data_parallel.py --world 4 --offload
    python benchmarks/data_parallel.py --json out/dp.json
    torchrun --nproc-per-node 8 benchmarks/data_parallel.py --device cuda --preset llama-125m   # one GPU per rank
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _deepspeed import load as load_deepspeed  # noqa: E402
from _ranks import (
    PAIRED_NOTE,
    TIME_COLUMNS,
    Contestant,
    add_model_args,
    add_run_args,
    compare_times,
    device_line,
    entry,
    finish,  # noqa: E402
    gather,
    ledger_delta,
    loss_agreement,
    model_line,
    print_verdicts,
    run_info,
    run_step,
    setup_rank,
    time_rounds,
    times_table,
)
from _ranks import Ours as EngineContestant
from _timing import paired, table, write_json  # noqa: E402

from trickles.memory.accounting import live_tensor_bytes  # noqa: E402
from trickles.models.config import ModelConfig, resolve_model  # noqa: E402
from trickles.models.presets import apply_preset  # noqa: E402
from trickles.models.transformer import Transformer, build_model, count_params  # noqa: E402
from trickles.optim.adamw import adamw_kwargs, param_groups  # noqa: E402
from trickles.optim.settings import OptimizerSettings  # noqa: E402
from trickles.topology import ParallelDims  # noqa: E402

DEFAULTS = {"cpu": {"batch": 8, "seq": 256}, "cuda": {"batch_per_rank": 8, "seq": 1024}}
DDP, FSDP = "ddp", "fsdp2"
COMM_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}  # x (N-1)/N x parameter bytes sent per rank and step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_model_args(
        p,
        "data-parallel",
        f"global batch in sequences, split over the ranks (default: cpu {DEFAULTS['cpu']['batch']}, "
        f"cuda {DEFAULTS['cuda']['batch_per_rank']} per rank)",
        DEFAULTS,
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="gradient bucket size for ours (parallel.bucket_mb) and DDP (bucket_cap_mb)",
    )
    p.add_argument(
        "--offload", action="store_true", help="also time stages 1-3 with the optimizer offloaded to host memory"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's ZeRO 1-3 out")
    add_run_args(p)
    return p.parse_args(argv)


# ---- contestants ---------------------------------------------------------------------------


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard
    return t.numel() * t.element_size()


class Ours(EngineContestant):
    def __init__(self, name: str, stage: int, offload: bool, model_cfg: ModelConfig, topo, args):
        super().__init__(
            name,
            FSDP if stage == 3 else DDP,
            [
                f"parallel.zero={stage}",
                f"parallel.bucket_mb={args.bucket_mb}",
                f"memory.offload_optimizer={'true' if offload else 'false'}",
            ],
            model_cfg,
            topo,
            args,
        )
        self.stage = stage

    def memory(self):
        return dict(self.engine.memory())


class Peer(Contestant):
    def __init__(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, args, sharded: bool):
        super().__init__(name)
        self.model, self.optimizer, self.clip, self.sharded = model, optimizer, args.clip, sharded
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if self.sharded:  # torchtitan's clip for FSDP2: the norm of DTensor gradients is made whole, then applied
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(self.params, self.clip, norm, foreach=True)
        else:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        return loss.detach()

    def memory(self):
        return {
            "parameters": sum(_nbytes(p) for p in self.params),
            "gradients": sum(_nbytes(p.grad) for p in self.params),
            "optimizer": sum(
                _nbytes(t) for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)
            ),
        }


class DeepSpeedPeer(Contestant):
    """DeepSpeed's ZeRO at ``stage`` over every rank, with torch's AdamW as its client optimizer."""

    def __init__(
        self, stage: int, model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, rows: int, args
    ):
        import deepspeed

        super().__init__(f"deepspeed zero-{stage}")
        model = build_model(model_cfg, seed=args.seed, device=device).train()
        bucket = int(args.bucket_mb * 2**20 / 4)  # elements
        config = {
            "train_micro_batch_size_per_gpu": rows,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": args.clip,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            "zero_optimization": {
                "stage": stage,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": bucket,
                "allgather_bucket_size": bucket,
                **(
                    {"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0}
                    if stage == 3
                    else {}
                ),
            },
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=_adamw(model, optim, device), config=config, dist_init_required=False
        )

    def step(self, x, y):
        loss = F.cross_entropy(self.engine(x).float().flatten(0, 1), y.flatten())
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


def _deepspeed(device: torch.device, args) -> str | None:
    """Why DeepSpeed is left out, or None when it imports (and has adopted the process group)."""
    if args.no_deepspeed:
        return "left out (--no-deepspeed)"
    deepspeed, why = load_deepspeed(device)
    return None if deepspeed is not None else f"unavailable ({why}); pip install deepspeed"


def _adamw(model: torch.nn.Module, optim: OptimizerSettings, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas, eps=optim.eps, **adamw_kwargs(device)
    )


def make_ddp(model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, args) -> Peer:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(model_cfg, seed=args.seed, device=device).train()
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_mb,
        gradient_as_bucket_view=True,
    )
    return Peer(DDP, ddp, _adamw(model, optim, device), args, sharded=False)


def make_fsdp(model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, world: int, args) -> Peer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    model = build_model(model_cfg, seed=args.seed, device=device).train()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return Peer(FSDP, model, _adamw(model, optim, device), args, sharded=True)


# ---- one rank ------------------------------------------------------------------------------


def rank_main(args) -> int:
    device, rank, world = setup_rank(args)
    batch = args.batch or (
        DEFAULTS["cpu"]["batch"] if device.type == "cpu" else DEFAULTS["cuda"]["batch_per_rank"] * world
    )
    seq = args.seq or DEFAULTS[device.type]["seq"]
    if batch % world:
        raise SystemExit(f"--batch {batch} must be divisible by the world size {world}")
    model_cfg = resolve_model(apply_preset(ModelConfig(), args.preset), tokenizer_vocab=args.vocab, seq_len=seq)
    topo = ParallelDims(dp=world).build(device)
    ledger = topo.ledger
    optim = OptimizerSettings(args.lr, (0.9, 0.95), 1e-8, 0.1)

    with torch.device("meta"):
        n_params = count_params(Transformer(model_cfg))
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, batch, seq + 1), generator=g)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    data = [(t[rows, :-1].contiguous().to(device), t[rows, 1:].contiguous().to(device)) for t in tokens]

    makers = [
        lambda: make_ddp(model_cfg, device, optim, args),
        lambda: make_fsdp(model_cfg, device, optim, world, args),
    ]
    makers += [functools.partial(Ours, f"ours zero-{s}", s, False, model_cfg, topo, args) for s in (0, 1, 2, 3)]
    if args.offload:
        makers += [functools.partial(Ours, f"ours zero-{s}+offload", s, True, model_cfg, topo, args) for s in (1, 2, 3)]
    no_ds = _deepspeed(device, args)
    if no_ds is None:
        makers += [lambda s=s: DeepSpeedPeer(s, model_cfg, device, optim, batch // world, args) for s in (1, 2, 3)]

    # each contestant is built and runs the agreement check at once -- step 1 on the initial weights, step 2 after one
    # update (a second batch) -- so that the live tensors it adds are its resident bytes; our ledger is read around
    # step 2 (step 1 sets up buffers, the volume is the same)
    contestants: list[Contestant] = []
    comm: dict[str, dict] = {}
    resident: dict[str, int] = {}
    for make in makers:
        gc.collect()
        base = live_tensor_bytes(device)
        c = make()
        for i, (x, y) in enumerate(data):
            before = ledger.snapshot()
            run_step(c, x, y, device, record=False)
            if isinstance(c, Ours) and i == 1:
                comm[c.name] = ledger_delta(before, ledger.snapshot())
        gc.collect()
        resident[c.name] = live_tensor_bytes(device) - base
        contestants.append(c)
    check = {c.name: list(c.losses) for c in contestants}

    time_rounds(contestants, *data[0], args, device)
    memory = {c.name: c.memory() for c in contestants if not isinstance(c, DeepSpeedPeer)}
    everyone = gather(
        {
            "times": {c.name: c.times for c in contestants},
            "check": check,
            "memory": memory,
            "comm": comm,
            "last_loss": {c.name: c.losses[-1] for c in contestants},
            "resident": resident,
        }
    )
    status = (
        report(args, everyone, contestants, model_cfg, n_params, batch, seq, device, world, no_ds) if rank == 0 else 0
    )
    del contestants, makers, topo  # the makers hold the topology too
    return finish(status, device)


# ---- report (rank 0) -----------------------------------------------------------------------


def report(
    args,
    everyone: list[dict],
    contestants: list[Contestant],
    model_cfg,
    n_params: int,
    batch: int,
    seq: int,
    device: torch.device,
    world: int,
    no_ds: str | None,
) -> int:
    names = [c.name for c in contestants]
    print(
        f"trickles data parallel (ZeRO 0-3) vs torch DDP and FSDP2, one training step each, {world} ranks, "
        "same weights and data"
    )
    print(model_line(args.preset, model_cfg, n_params))
    print(
        f"  step    global batch {batch} x seq {seq} ({batch // world} sequences per rank), fp32, clip {args.clip}, "
        f"AdamW {'fused' if device.type == 'cuda' else 'foreach'} lr {args.lr}, bucket {args.bucket_mb:g} MiB"
    )
    print(device_line(device))

    print(f"\nagreement check: every rank's loss vs {DDP}'s on the same rank, relative tolerance {args.tol:g}")
    if not loss_agreement(
        everyone,
        names,
        args.tol,
        DDP,
        note="  (loss: mean over ranks of the rank-local loss = global-batch loss; step 2 runs after one AdamW update)",
    ):
        return 1

    # communication (ours)
    param_bytes = 4 * n_params
    print(
        "\nbytes sent per rank and step (our CommLedger, wire bytes), vs k x (N-1)/N x parameter bytes "
        f"({param_bytes / 2**20:.2f} MiB):"
    )
    rows = []
    for c in contestants:
        if not isinstance(c, Ours):
            continue
        comm = everyone[0]["comm"][c.name]
        sent = max(sum(v["wire_bytes"] for k, v in r["comm"][c.name].items() if k.endswith("/dp")) for r in everyone)
        expect = COMM_FACTOR[c.stage] * (world - 1) / world * param_bytes
        ops = ", ".join(f"{k.split('/')[0]} x{v['calls']}" for k, v in sorted(comm.items()) if k.endswith("/dp"))
        rows.append(
            [
                c.name,
                f"{sent / 2**20:.2f}",
                f"{COMM_FACTOR[c.stage]}x",
                f"{expect / 2**20:.2f}",
                f"{sent / expect:.4f}" if expect else "-",
                ops,
            ]
        )
    print(table(["implementation", "sent MiB", "k", "formula MiB", "ratio", "collectives"], rows))
    print("  (ratio above 1: padding of buckets/units to multiples of N x 16 elements, and the 4-byte norm all-reduce)")

    # timing
    results, cells = compare_times(everyone, contestants, args.steps, batch * seq)
    rows = []
    for c in contestants:
        n, peer = c.name, c.peer
        if isinstance(c, DeepSpeedPeer):  # its own table below
            continue
        mem = everyone[0]["memory"][n]
        total = sum(mem.values())
        peer_total = sum(everyone[0]["memory"][peer].values()) if peer else None
        results[n].update(memory=mem, memory_ratio=total / peer_total if peer else None)
        rows.append(
            [
                *cells[n],
                f"{mem['parameters'] / 2**20:.1f}",
                f"{mem['gradients'] / 2**20:.1f}",
                f"{mem['optimizer'] / 2**20:.1f}",
                f"{total / 2**20:.1f}",
                f"{total / peer_total:.2f}x" if peer else "-",
            ]
        )
    times_table(
        args,
        rows,
        [*TIME_COLUMNS, "param MiB", "grad MiB", "optim MiB", "total MiB", "mem vs peer"],
        note=PAIRED_NOTE + ". Memory: bytes per rank after a step (engine.memory() for ours; live parameter, gradient "
        "and optimizer-state tensors for the peers, FSDP2's local shards).",
    )
    if args.offload:
        print(
            "+offload rows: the optimizer column is host memory (fp32 masters, moments and a gradient copy); on CUDA "
            "only the parameter and gradient columns are on the device."
        )

    print_verdicts(results, ("ours zero-0", "ours zero-3"))
    deepspeed_table(everyone, results, names, no_ds)

    write_json(
        args.json,
        {
            **run_info(args, world, batch, seq, device, n_params, model_cfg),
            "check": {n: [r["check"][n] for r in everyone] for n in names},
            "resident": {n: [r["resident"][n] for r in everyone] for n in names},
            "comm": {n: [r["comm"].get(n) for r in everyone] for n in names if n.startswith("ours")},
            "results": results,
        },
    )
    return 0


def deepspeed_table(everyone: list[dict], results: dict, names: list[str], no_ds: str | None) -> None:
    """Our stages 1-3 against DeepSpeed's: step time (medians of each round's slowest rank, and paired) and resident
    bytes per rank (the largest over the ranks)."""
    if no_ds is not None:
        print(f"\nDeepSpeed ZeRO: {no_ds}")
        return
    rows, verdicts = [], []
    for stage in (1, 2, 3):
        ours, ds = f"ours zero-{stage}", f"deepspeed zero-{stage}"
        a, b = results[ours], results[ds]
        ratio = a["median"] / b["median"]
        pr = paired(a["times"], b["times"])
        mem_a, mem_b = (max(r["resident"][n] for r in everyone) for n in (ours, ds))
        results[ours].update(deepspeed_ratio=ratio, deepspeed_paired=pr, resident=mem_a, deepspeed_resident=mem_b)
        rows.append(
            [
                f"zero-{stage}",
                f"{a['median'] * 1e3:.1f}",
                f"{b['median'] * 1e3:.1f}",
                f"{ratio:.3f}x",
                f"{pr:.3f}x",
                f"{mem_a / 2**20:.1f}",
                f"{mem_b / 2**20:.1f}",
                f"{mem_a / mem_b:.2f}x",
            ]
        )
        verdicts.append(
            f"zero-{stage} {ratio:.3f}x time, {mem_a / mem_b:.3f}x memory: "
            f"{'met' if ratio <= 1.0 and round(mem_a / 2**20, 1) <= round(mem_b / 2**20, 1) else 'NOT met'}"
        )
    print(
        "\nours vs DeepSpeed, stage by stage (resident MiB: live tensors each keeps per rank between steps, the "
        "largest rank):"
    )
    print(table(["stage", "ours ms", "deepspeed ms", "ratio", "paired", "ours MiB", "deepspeed MiB", "memory"], rows))
    print(
        "target ours/deepspeed <= 1.0x at no more memory (to 0.1 MiB: ours keeps a 4-byte step counter per segment, "
        "torch's AdamW under DeepSpeed one per flat group):  " + ";  ".join(verdicts)
    )


# ---- entry ---------------------------------------------------------------------------------

main = entry(parse_args, rank_main)


if __name__ == "__main__":
    sys.exit(main())
