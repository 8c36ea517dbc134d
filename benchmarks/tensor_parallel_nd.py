"""Multi-dimensional tensor parallelism: 1-D (Megatron) vs 2-D (Optimus), 2.5-D (Tesseract) and 3-D, same run; and
the projected communication of each at 64 devices for a GPT-3 layer.

What is compared
    One full training step -- forward, cross-entropy, backward, global-norm clipping (1.0), AdamW step -- with every
    matrix of the model split over ``N`` tensor-parallel ranks (``--world``; no data parallelism), through
    ``trickles.parallel.plan.parallelize`` and driven exactly as ``trickles.train.Trainer.train_step`` drives it, for
    each ``parallel.tp_mode`` the world size admits:

    * ``--world 4``: ``1d`` (column/row-parallel linears, vocabulary-parallel embedding, output and loss) and ``2d``
      (a 2 x 2 grid, SUMMA linears, :mod:`trickles.parallel.tensor.grid_linear`);
    * ``--world 8``: ``1d``, ``2.5d`` (two stacked 2 x 2 grids, ``parallel.tp_depth=2``) and ``3d`` (a 2 x 2 x 2 cube);
    * other world sizes: ``1d`` and each grid the size makes (``--modes`` picks a subset, ``--depth`` the 2.5-D ``d``).

    1-D is the reference every row is compared with (``vs 1d``).

How
    * Every contestant lives in the same ``N`` processes at once, each on its own topology (``ParallelDims(tp=N,
      tp_mode=...)``: its own grid groups and its own ``CommLedger``), on the same meta-device model that
      ``parallelize`` initializes from the same seed (initialization is a pure function of seed and parameter name,
      so the weights are identical), the same AdamW settings and the same clip.
    * Same data: one global batch of random tokens from a fixed generator, the whole micro-batch given to every rank
      (1-D uses all of it on every rank; a grid keeps its rank's sample block: 2-D ``B/q``, 2.5-D ``B/(q d)``, 3-D
      ``B/q^2``). ``--batch`` must be a multiple of those.
    * Agreement check before timing: rank 0 also trains the single-device model (same seed, ``torch.optim.AdamW``,
      ``clip_grad_norm_``) for two steps on two batches; every contestant's loss on every rank at step 1 (same
      weights) and step 2 (after one update) must agree with it within ``--tol`` (relative, 1e-4 in fp32), else the
      run stops.
    * Communication: the bytes each rank sends in step 2, from the contestant's ``CommLedger`` (wire bytes, every
      group: ``tp``, ``tp_row``, ``tp_col``, ``tp_dep``), the largest over the ranks, with the ratio to 1-D. Next
      to it what the formulas say: for 1-D ``tensor_parallel.expected_comm`` (Megatron's block all-reduces, the
      embedding's, the loss's, ...), for a grid the sum of every grid linear's ``wire_bytes`` (``summa_bytes`` /
      ``cube_bytes``, the output layer included); what the grid sends beyond its linears (norm statistics, the
      embedding's gathers, the loss, the shared weights' gradient reductions, the gradient norm) is the difference.
    * Memory per rank: parameter bytes, and the bytes autograd saves in forward (``ActivationMeter``, read in step
      2; the grids' gathered weight blocks count, they are kept for backward).
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds in which every contestant runs one step, the
      order rotating each round. Each step starts after a barrier; its time is the slowest rank's; the collectives
      are blocking, so a step's clock stops when everything it started has finished. The table gives median and
      mean step time, the ratio of medians against 1-D (``vs 1d``) and the paired ratio (median over rounds of
      this / 1-D in the same round).
    * CPU: ``torch.set_num_threads(cores // N)`` in every rank (at least 1: ``--world 8`` on two cores runs four
      ranks per core, and the timing is mostly that oversubscription).

Projection (``--project``, also printed after every measured run; no ranks needed)
    Per-rank wire bytes of one transformer layer's four linears (fused ``qkv`` ``h -> 3h``, ``o`` ``h -> h``,
    ``up`` ``h -> 4h``, ``down`` ``4h -> h``, with biases), forward + backward, from the same formulas the ledger is
    tested against (``summa_bytes``, ``cube_bytes``), at 64 devices for a GPT-3 175B layer (``h = 12288``, seq 2048,
    fp16) and ``--proj-batch`` sequences per tensor-parallel group; 1-D (``tp = 64``) is Megatron's two all-reduces
    of the block activation forward and two backward, ``2 (t-1)/t N h p`` each. With the per-rank weights and the
    linears' saved inputs, the crossover (the tokens per group below which 1-D sends fewer bytes), and the speedups
    the Colossal-AI papers report (see benchmarks/README.md for the sources).

Examples::

    python benchmarks/tensor_parallel_nd.py --world 4                 # 1d vs 2d, demo shape (vocab 4096), batch 8 x 128
    python benchmarks/tensor_parallel_nd.py --world 8                  # 1d vs 2.5d (d=2) vs 3d
    python benchmarks/tensor_parallel_nd.py --project                  # the 64-device projection only
    python benchmarks/tensor_parallel_nd.py --world 8 --json out/tp_nd.json
    torchrun --nproc-per-node 8 benchmarks/tensor_parallel_nd.py --device cuda --preset llama-350m   # one GPU per rank
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import (
    Ours,
    add_model_args,
    add_run_args,
    compare_times,
    device_line,
    finish,
    gather,
    ledger_delta,
    loss_agreement,  # noqa: E402
    model_line,
    refuse,
    run_info,
    run_step,
    setup_rank,
    time_rounds,
    times_table,
)
from _ranks import main as run_main
from _timing import table, write_json  # noqa: E402
from tensor_parallel import expected_comm  # noqa: E402

from trickles.errors import ConfigError  # noqa: E402
from trickles.models.config import ModelConfig, resolve_model  # noqa: E402
from trickles.models.presets import apply_preset  # noqa: E402
from trickles.models.transformer import Transformer, build_model, count_params  # noqa: E402
from trickles.optim.adamw import adamw_kwargs, param_groups  # noqa: E402
from trickles.optim.settings import OptimizerSettings  # noqa: E402
from trickles.parallel.tensor.grid_linear import Linear2D, Linear3D, cube_bytes, summa_bytes  # noqa: E402
from trickles.topology import ParallelDims, TPGrid  # noqa: E402

DEFAULTS = {"cpu": {"batch": 8, "seq": 128}, "cuda": {"batch": 16, "seq": 1024}}
REF = "single device"
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_model_args(
        p,
        "tensor-parallel",
        f"micro-batch in sequences (default: cpu {DEFAULTS['cpu']['batch']}, cuda "
        f"{DEFAULTS['cuda']['batch']}); a multiple of q (2-D), q d (2.5-D), q^2 (3-D)",
        DEFAULTS,
        world=4,
    )
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated tp modes besides 1d (default: every grid --world makes: 4 -> 2d, 8 -> 2.5d,3d)",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="2.5-D: the number d of stacked q x q grids (default: the smallest >= 2 that fits)",
    )
    p.add_argument(
        "--kv-heads",
        type=int,
        default=0,
        help="key/value heads (0: as many as query heads, so 1-D splits them at tp=8 instead of replicating; "
        "-1: the preset's)",
    )
    p.add_argument(
        "--fused-proj",
        action="store_true",
        help="one q/k/v and one gate/up projection (model.fused_proj; by default only where measured to win, "
        "docs/kernels.md): a grid then gathers each region's input once, not once per projection",
    )
    p.add_argument("--project", action="store_true", help="print the 64-device projection only (no ranks started)")
    p.add_argument(
        "--proj-batch", type=int, default=64, help="projection: sequences of 2048 tokens per tensor-parallel group"
    )
    add_run_args(p)
    p.set_defaults(steps=10)
    return p.parse_args(argv)


# ---- the modes a world size makes ----------------------------------------------------------


def grid_modes(world: int, depth: int | None = None) -> list[tuple[str, int]]:
    """``(mode, tp_depth)`` of every grid ``world`` ranks make (2.5-D: ``depth``, else the smallest ``d >= 2``)."""
    out = []
    for mode in ("2d", "2.5d", "3d"):
        depths = [depth] if (mode == "2.5d" and depth) else (range(2, world // 4 + 1) if mode == "2.5d" else [1])
        for d in depths:
            try:
                TPGrid.of(mode, world, d)
            except ConfigError:
                continue
            out.append((mode, d))
            break
    return out


def label(mode: str, depth: int, world: int) -> str:
    if mode == "1d":
        return "1d"
    g = TPGrid.of(mode, world, depth)
    return {"2d": f"2d (q={g.q})", "2.5d": f"2.5d (q={g.q}, d={g.depth})", "3d": f"3d (q={g.q})"}[mode]


def sample_blocks(mode: str, world: int, depth: int) -> int:
    """How many sample blocks the mode splits a micro-batch into (1-D: none)."""
    if mode == "1d":
        return 1
    g = TPGrid.of(mode, world, depth)
    return g.q * g.q if mode == "3d" else g.q * g.depth


# ---- contestants ---------------------------------------------------------------------------


class Mode(Ours):
    """``parallelize`` with ``parallel.tp_mode``, on its own topology; step 2 optionally measured (saved
    activations)."""

    def __init__(self, name: str, mode: str, depth: int, model_cfg: ModelConfig, topo, args, peer: str | None):
        super().__init__(
            name,
            peer,
            [f"parallel.tp={topo.dims.tp}", f"parallel.tp_mode={mode}", f"parallel.tp_depth={depth}"],
            model_cfg,
            topo,
            args,
        )
        self.peer = peer  # None for the 1-D reference row
        self.mode, self.depth = mode, depth
        self.measure = False  # count the saved activations in the next step
        self.saved_bytes = 0

    def step(self, x, y):
        if not self.measure:
            return super().step(x, y)
        from trickles.memory.activations import ActivationMeter

        e = self.engine
        e.zero_grad()
        with e.micro_step(last=True):
            with ActivationMeter(self.model) as meter:
                loss = self.model(x, target=y)
            self.saved_bytes = meter.total
            loss.backward()
        e.finish_backward()
        e.clip_grad_norm(self.clip)
        e.step(self.lr)
        return loss.detach()

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def linear_formula(self, tokens: int) -> float:
        """Wire bytes per step of this rank's grid linears by ``summa_bytes`` / ``cube_bytes`` (forward + backward)
        for a micro-batch of ``tokens`` tokens."""
        total = 0.0
        for m in self.model.modules():
            if isinstance(m, Linear3D):
                b = m.wire_bytes(tokens, 4)
            elif isinstance(m, Linear2D):
                d = m.dep.size if m.dep is not None else 1
                b = m.wire_bytes(tokens // (m.q * d), 4)
            else:
                continue
            total += b["forward"] + b["backward"]
        return total


class Reference:
    """The single-device model (rank 0 only): ``build_model``, ``torch.optim.AdamW``, ``clip_grad_norm_``."""

    def __init__(self, model_cfg: ModelConfig, device: torch.device, args):
        optim = OptimizerSettings(args.lr, (0.9, 0.95), 1e-8, 0.1)
        self.model = build_model(model_cfg, seed=args.seed, device=device).train()
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, optim.weight_decay),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            **adamw_kwargs(device),
        )
        self.clip = args.clip

    def step(self, x, y) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(x, target=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), self.clip, foreach=True)
        self.optimizer.step()
        return loss.item()


# ---- one rank ------------------------------------------------------------------------------


def model_config(args, seq: int) -> ModelConfig:
    cfg = apply_preset(ModelConfig(), args.preset)
    if args.kv_heads >= 0:
        cfg = dataclasses.replace(cfg, n_kv_heads=args.kv_heads or cfg.n_heads)
    if args.fused_proj:
        cfg = dataclasses.replace(cfg, fused_proj=True)
    return resolve_model(cfg, tokenizer_vocab=args.vocab, seq_len=seq)


def chosen_modes(args, world: int) -> list[tuple[str, int]]:
    modes = grid_modes(world, args.depth)
    if args.modes:
        want = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "1d"]
        missing = [m for m in want if m not in {m for m, _ in modes}]
        if missing:
            raise SystemExit(
                f"tensor_parallel_nd.py: --world {world} makes no {', '.join(missing)} grid "
                f"(it makes: {', '.join(m for m, _ in modes) or 'none'})"
            )
        modes = [(m, d) for m, d in modes if m in want]
    return [("1d", 1), *modes]


def rank_main(args) -> int:
    device, rank, world = setup_rank(args)
    batch = args.batch or DEFAULTS[device.type]["batch"]
    seq = args.seq or DEFAULTS[device.type]["seq"]
    model_cfg = model_config(args, seq)
    modes = chosen_modes(args, world)
    problems = [
        f"--batch {batch} is not a multiple of {sample_blocks(m, world, d)} ({label(m, world=world, depth=d)})"
        for m, d in modes
        if batch % sample_blocks(m, world, d)
    ]
    if problems:
        return refuse("tensor_parallel_nd.py: " + "; ".join(problems))

    contestants: list[Mode] = []
    for mode, depth in modes:
        topo = ParallelDims(dp=1, tp=world, tp_mode=mode, tp_depth=depth).build(device)
        name = label(mode, depth, world)
        contestants.append(Mode(name, mode, depth, model_cfg, topo, args, peer=None if mode == "1d" else "1d"))
    with torch.device("meta"):
        n_params = count_params(Transformer(model_cfg))

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, batch, seq + 1), generator=g)
    data = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]

    # agreement check: step 1 on the initial weights, step 2 after one update (a second batch); the ledgers and the
    # saved activations are read in step 2 (step 1 sets up buffers; the volume is the same)
    ref_losses = []
    if rank == 0:
        reference = Reference(model_cfg, device, args)
        ref_losses = [reference.step(x, y) for x, y in data]
        del reference
        gc.collect()
    comm, saved = {}, {}
    for i, (x, y) in enumerate(data):
        for c in contestants:
            before = c.topo.ledger.snapshot()
            c.measure = i == 1
            run_step(c, x, y, device, record=False)
            c.measure = False
            if i == 1:
                comm[c.name] = ledger_delta(before, c.topo.ledger.snapshot())
                saved[c.name] = c.saved_bytes
    check = {c.name: list(c.losses) for c in contestants}

    time_rounds(contestants, *data[0], args, device)
    everyone = gather(
        {
            "times": {c.name: c.times for c in contestants},
            "check": check,
            "comm": comm,
            "saved": saved,
            "params": {c.name: c.param_bytes() for c in contestants},
            "linears": {c.name: c.linear_formula(batch * seq) for c in contestants},
            "linears_2x": {c.name: c.linear_formula(2 * batch * seq) for c in contestants},
            "calls": {c.name: sum(v["calls"] for v in comm[c.name].values()) for c in contestants},
        }
    )
    status = (
        report(args, everyone, contestants, ref_losses, model_cfg, n_params, batch, seq, device, world)
        if rank == 0
        else 0
    )
    del contestants
    return finish(status, device)


# ---- report (rank 0) -----------------------------------------------------------------------


def report(
    args,
    everyone: list[dict],
    contestants: list[Mode],
    ref_losses: list[float],
    model_cfg,
    n_params: int,
    batch: int,
    seq: int,
    device: torch.device,
    world: int,
) -> int:
    names = [c.name for c in contestants]
    print(
        f"trickles tensor parallelism by mode, one training step each, tp={world}, same weights and data: "
        + " vs ".join(names)
    )
    print(model_line(args.preset, model_cfg, n_params))
    print(
        f"  step    micro-batch {batch} x seq {seq} ({batch * seq} tokens) given to every rank, fp32, "
        f"clip {args.clip}, AdamW lr {args.lr}"
    )
    print(device_line(device))

    print(f"\nagreement check: every rank's loss vs the single-device model's, relative tolerance {args.tol:g}")
    if not loss_agreement(
        everyone, names, args.tol, REF, ref_losses=ref_losses, column="mode", who="the modes disagree with one process"
    ):
        return 1

    # communication and memory
    sent = {n: max(sum(v["wire_bytes"] for v in r["comm"][n].values()) for r in everyone) for n in names}
    low = {n: min(sum(v["wire_bytes"] for v in r["comm"][n].values()) for r in everyone) for n in names}
    one_d = expected_comm(model_cfg, batch, seq, world, False)
    print(
        "\nbytes sent per rank in one step (the mode's CommLedger, wire bytes, every group; the largest over the "
        "ranks) and memory per rank:"
    )
    rows, comm_results = [], {}
    for c in contestants:
        n = c.name
        if c.mode == "1d":
            formula, what = sum(b for _, b in one_d), "1-D total (expected_comm)"
        else:
            formula, what = max(r["linears"][n] for r in everyone), "grid linears (summa/cube_bytes)"
        params = max(r["params"][n] for r in everyone)
        act = max(r["saved"][n] for r in everyone)
        rows.append(
            [
                n,
                f"{sent[n] / MIB:.2f}",
                f"{sent[n] / sent[names[0]]:.3f}x",
                f"{formula / MIB:.2f}",
                what,
                f"{(sent[n] - formula) / MIB:.2f}",
                f"{params / MIB:.2f}",
                f"{act / MIB:.2f}",
            ]
        )
        comm_results[n] = {
            "sent": sent[n],
            "sent_min": low[n],
            "formula": formula,
            "formula_is": what,
            "ops": everyone[0]["comm"][n],
            "param_bytes": params,
            "saved_bytes": act,
        }
    print(
        table(
            ["mode", "sent MiB", "vs 1d", "formula MiB", "formula covers", "rest MiB", "params MiB", "saved MiB"], rows
        )
    )
    print(
        "  rest: sent minus the formula (1-D: ~0, all accounted for; grids: norm statistics, embedding gathers, the "
        "loss's all-reduces, shared weights' gradient sums, gradient norm);"
    )
    print(
        "  params: this rank's parameters; saved: what autograd keeps for backward in forward (ActivationMeter), "
        "gathered weight blocks included"
    )
    if any(sent[n] != low[n] for n in names):
        print(
            "  ranks differ: "
            + ", ".join(f"{n} {low[n] / MIB:.2f}-{sent[n] / MIB:.2f} MiB" for n in names if sent[n] != low[n])
        )
    for c in contestants:
        calls = ", ".join(f"{k} x{v['calls']}" for k, v in sorted(everyone[0]["comm"][c.name].items()))
        print(f"  {c.name}: {calls}")
    # when the bytes favour a grid: its linears cost a + b N (weight blocks + activation blocks), 1-D's c N
    tokens = batch * seq
    c1 = sum(b for _, b in one_d) / tokens
    for c in contestants[1:]:
        n = c.name
        per = max((r["linears_2x"][n] - r["linears"][n]) for r in everyone) / tokens
        fixed = max(r["linears"][n] for r in everyone) - per * tokens
        where = (
            f"its linears send fewer bytes than all of 1-D above N = {fixed / (c1 - per):,.0f} tokens per micro-batch"
            if c1 > per
            else "its linears' bytes grow faster with the tokens than 1-D's: no crossover"
        )
        comm_results[n].update(per_token=per, fixed=fixed, crossover_tokens=fixed / (c1 - per) if c1 > per else None)
        print(
            f"  formulas, {n}: {fixed / MIB:.2f} MiB of weight blocks + {per * 1024 / MIB:.3f} MiB per 1k tokens "
            f"(1-D: {c1 * 1024 / MIB:.3f} MiB per 1k tokens); {where} (here {tokens:,})"
        )

    # timing
    results, cells = compare_times(everyone, contestants, args.steps, batch * seq)
    rows = []
    for c in contestants:
        r = cells[c.name]
        calls = max(x["calls"][c.name] for x in everyone)
        rows.append(
            [
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                r[6],
                r[7],
                f"{sent[c.name] / MIB:.2f}",
                f"{sent[c.name] / sent[names[0]]:.3f}x",
                str(calls),
            ]
        )
    times_table(
        args,
        rows,
        [
            "mode",
            "median ms",
            "mean ms",
            "stdev ms",
            "tokens/s",
            "vs 1d",
            "paired",
            "sent MiB",
            "bytes vs 1d",
            "collectives",
        ],
        who="modes",
        note="vs 1d: ratio of median step times; paired: median over rounds of (mode / 1d in the same round); "
        "bytes vs 1d: the ledger's bytes per rank and step; collectives: calls per rank and step.",
    )
    if device.type == "cpu" and world > (os.cpu_count() or 1):
        print(
            f"note: {world} ranks on {os.cpu_count()} cores -- every collective waits for ranks the OS has "
            "descheduled; step times here measure oversubscription and the number of collectives as much as bytes."
        )

    print()
    print_projection(args.proj_batch)
    write_json(
        args.json,
        {
            **run_info(args, world, batch, seq, device, n_params, model_cfg),
            "check": {"reference": ref_losses, **{n: [r["check"][n] for r in everyone] for n in names}},
            "comm": comm_results,
            "results": results,
            "projection": projection(args.proj_batch),
        },
    )
    return 0


# ---- projection: 64 devices, one GPT-3 layer -----------------------------------------------

GPT3 = {"h": 12288, "seq": 2048, "p": 2, "devices": 64}
#: (the four linears of a block: in, out) -- fused qkv, attention output, MLP up, MLP down
LINEARS = lambda h: ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h))  # noqa: E731

#: What the papers report (abstracts; see benchmarks/README.md for the sources and what could not be confirmed)
PAPERS = {
    "1d": "Megatron-LM: the baseline of all three papers",
    "2d": "Optimus (Xu et al. 2021): 1.48x training, 1.78x inference, 8x max batch over Megatron, 64 GPUs (Frontera)",
    "2.5d": "Tesseract (Wang et al. 2021/22): strong scaling 1.38x over 1-D, 1.53x over 2-D; weak scaling up to "
    "3.4x throughput (4.0x inference) over 1-D, 1.7x over 2-D",
    "3d": "3-D (Bian et al. 2021): 2.32x over 1-D, 1.57x over 2-D, 64 V100 GPUs (TACC)",
}


def layer_bytes(mode: str, tokens: int, h: int, p: int, devices: int = 64, q: int = 1, depth: int = 1) -> float:
    """Wire bytes one rank sends for one layer's four linears, forward + backward, ``tokens`` = the group's ``N``."""
    if mode == "1d":
        return 4 * 2 * (devices - 1) / devices * tokens * h * p  # 2 all-reduces forward, 2 backward, of N h
    total = 0.0
    for hin, hout in LINEARS(h):
        if mode == "3d":
            b = cube_bytes(q, tokens, hin, hout, True, p)
        else:
            b = summa_bytes(q, depth, tokens // (q * depth), hin, hout, True, p)
        total += b["forward"] + b["backward"]
    return total


def projection(batch: int) -> dict:
    h, seq, p, n_dev = GPT3["h"], GPT3["seq"], GPT3["p"], GPT3["devices"]
    tokens = batch * seq
    modes = [
        ("1d", 1, 1, "1-D, tp=64"),
        ("2d", 8, 1, "2-D, q=8"),
        ("2.5d", 4, 4, "2.5-D, q=4, d=4"),
        ("3d", 4, 1, "3-D, q=4"),
    ]
    weights = 12 * h * h + 13 * h  # the four linears' weights and biases
    out = {"h": h, "seq": seq, "batch": batch, "tokens": tokens, "bytes_per_element": p, "devices": n_dev, "modes": {}}
    base = layer_bytes("1d", tokens, h, p, n_dev)
    for mode, q, d, name in modes:
        sent = layer_bytes(mode, tokens, h, p, n_dev, q, d)
        # bytes = a + b N: the crossover with 1-D's c N is a / (c - b)
        big = 2**30
        b = (layer_bytes(mode, 2 * big, h, p, n_dev, q, d) - layer_bytes(mode, big, h, p, n_dev, q, d)) / big
        a = layer_bytes(mode, big, h, p, n_dev, q, d) - b * big
        c = layer_bytes("1d", big, h, p, n_dev) / big
        cross = a / (c - b) if mode != "1d" and c > b else None
        if mode == "1d":
            w, x_saved, w_saved, act = weights / n_dev, tokens * h * (2 + 5 / n_dev), 0, tokens * h
        elif mode == "3d":
            w, x_saved, w_saved, act = weights / q**3, 7 * tokens * h / q**2, 12 * h * h / q**2, tokens * h / q**3
        else:
            w, x_saved, w_saved, act = (
                weights / q**2,
                7 * tokens * h / (q * d),
                12 * h * h / q,
                tokens * h / (q * q * d),
            )
        out["modes"][mode] = {
            "name": name,
            "q": q,
            "depth": d,
            "sent": sent,
            "vs_1d": sent / base,
            "per_token": b,
            "fixed": a,
            "crossover_tokens": cross,
            "weight_bytes": w * p,
            "saved_inputs_bytes": x_saved * p,
            "saved_weight_bytes": w_saved * p,
            "block_input_bytes": act * p,
            "paper": PAPERS[mode],
        }
    return out


def print_projection(batch: int) -> None:
    pr = projection(batch)
    h, n = pr["h"], pr["tokens"]
    gib = 2**30
    print(
        f"projection: one GPT-3 175B layer (h={h}, seq {pr['seq']}, fp16) at {pr['devices']} devices, "
        f"{batch} sequences = {n:,} tokens per tensor-parallel group; wire bytes per rank, forward + backward, the "
        "four linears (qkv h->3h, o h->h, up h->4h, down 4h->h, biases); 1-D: 4 all-reduces of N h"
    )
    rows = []
    for m in pr["modes"].values():
        cross = (
            "-"
            if m["crossover_tokens"] is None
            else (
                f"{m['crossover_tokens']:,.0f} ({m['crossover_tokens'] / pr['seq']:.1f} seq, "
                f"{m['crossover_tokens'] / pr['devices']:.0f}/rank)"
            )
        )
        hp = h * pr["bytes_per_element"]
        rows.append(
            [
                m["name"],
                f"{m['sent'] / gib:.2f}",
                f"{m['vs_1d']:.3f}x",
                f"{m['per_token'] / hp:.3f} N h p",
                f"{m['fixed'] / (h * hp):.3f} h^2 p",
                cross,
                f"{m['weight_bytes'] / 2**20:.0f}",
                f"{m['block_input_bytes'] / 2**20:.0f}",
                f"{(m['saved_inputs_bytes'] + m['saved_weight_bytes']) / 2**20:.0f}",
            ]
        )
    print(
        table(
            [
                "mode",
                "GiB/layer",
                "vs 1-D",
                "per token",
                "fixed (weights)",
                "1-D cheaper below N =",
                "weights MiB",
                "block input MiB",
                "linears' saved MiB",
            ],
            rows,
        )
    )
    print(
        "  weights: this rank's share of the four linears (2.5-D keeps d = 4 copies); block input: its share of the "
        "N x h residual stream (1-D: all of it);"
    )
    print(
        "  linears' saved: what our implementation keeps for backward per layer (gathered inputs, and for the grids "
        "the gathered weight blocks, q times the rank's own)"
    )
    for m in pr["modes"].values():
        print(f"  {m['name']:<16} paper: {m['paper']}")


# ---- entry ---------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.project:
        print_projection(args.proj_batch)
        return 0
    chosen_modes(
        args, int(os.environ.get("WORLD_SIZE", args.world))
    )  # an unknown --modes stops here, before any rank starts
    return run_main(args, rank_main)


if __name__ == "__main__":
    sys.exit(main())
