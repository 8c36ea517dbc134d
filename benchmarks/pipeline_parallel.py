"""Pipeline-parallel training step: trickles' GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1, ZB-V)
schedules vs PyTorch's ``torch.distributed.pipelining``, same run.

What is compared
    One full training step -- every micro-batch's forward, cross-entropy and backward through
    ``N`` pipeline stages (``--world``; no data or tensor parallelism), global-norm clipping
    (1.0) over all stages, AdamW step -- for five schedules, each against its PyTorch twin:

    * ours: ``trickles.parallel.plan.parallelize`` with ``parallel.pp = N``,
      ``parallel.schedule`` = ``gpipe``, ``1f1b``, ``interleaved`` (``parallel.virtual_stages
      = --virtual``), ``zb-h1`` or ``zb-v`` (two chunks per rank in a V), ``train.global_batch`` /
      ``train.micro_batch`` giving ``m`` micro-batches;
      driven exactly as ``trickles.train.Trainer.train_step`` drives it: ``engine.zero_grad()``,
      ``engine.pipeline.forward_backward(micro_batches, async_loss=True)``, ``finish_backward()``,
      ``clip_grad_norm(1.0)`` (squared norms summed over the pipeline group), ``step(lr)``, then
      the loss's sum over the stages, which ran in the background meanwhile, is waited for;
    * peers: ``torch.distributed.pipelining`` ``ScheduleGPipe``, ``Schedule1F1B``,
      ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (one stage per rank: its ZB1P, the
      paper's ZB-H1) and ``ScheduleZBVZeroBubble`` over ``PipelineStage`` modules cut from ``build_model``
      with the same seed: one stage per rank, ``--virtual`` per rank for the interleaved schedule
      (stage ``s = c N + rank``, Megatron's looping placement, as ours), or stages ``rank`` and
      ``2N - 1 - rank`` for ZB-V (the V, as ours). A stage module runs the
      embedding (stage 0), its blocks (with the rotary tables) and the final norm + output
      (last stage); ``loss_fn`` is the token cross-entropy of the fp32 logits divided by ``m``
      with ``scale_grads=False``, so the accumulated gradient is that of the mean loss over
      micro-batches, as ours (no extra pass over the gradients); ``return_outputs=False``.
      Then torchtitan's pipeline clip -- ``get_total_norm`` (foreach) of the stage's
      gradients, its square all-reduced over the stages (one all-reduce that also carries the
      step's loss from the last stage, where ours sums it in a second, background all-reduce), ``clip_grads_with_norm_``
      -- and ``torch.optim.AdamW`` (foreach on CPU, fused on CUDA) over the same decay /
      no-decay groups as ours.

    Pairs: ours gpipe vs torch gpipe, ours 1f1b vs torch 1f1b, ours interleaved vs torch
    interleaved, ours zb-h1 vs torch zb-h1, ours zb-v vs torch zb-v. Untied llama shapes only: with tied
    embeddings (the gpt2 presets, llama-1b, llama-3b) the first and last stage would need their embedding
    gradients summed, which the peer does not do, so such presets are refused.

How
    * Every contestant lives in the same ``N`` processes at once, on the same model shape,
      layer split (``trickles.parallel.pipeline.stages.partition_layers`` over ``N`` or ``N v``
      stages, for both), micro-batches and initial weights: ours is built on the meta device
      and ``parallelize`` initializes this rank's stage from the seed, the peers keep their
      stages' modules of ``build_model(cfg, seed)`` (initialization is a pure function of seed
      and parameter name, so it is identical).
    * Same data: one global batch of random tokens from a fixed generator on every rank (the
      first stage reads the tokens, the last the targets), cut into ``m`` micro-batches of
      ``--micro-batch`` rows in order by both.
    * Agreement check before timing: two steps each on two batches; every contestant's loss at
      step 1 (same weights) and step 2 (after one update) must agree within ``--tol``
      (relative, default 1e-4 in fp32) with a single-device model that rank 0 trains on the
      same micro-batches (``build_model``, mean loss over micro-batches, ``clip_grad_norm_``,
      ``torch.optim.AdamW``), else the run stops.
    * Communication: the bytes this rank sends and receives per step in our schedules, from
      the topology's ``CommLedger`` (``send`` / ``recv`` on the ``pp`` group, activations, and
      ``pp_grad``, gradients; ``snapshot()`` around the second check step), against the formula
      below; the small all-reduces (loss, gradient norm) are listed apart.
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds in which every contestant
      runs one step, the order rotating each round so noise falls on all of them alike. Each
      step starts after a barrier; its time is the slowest rank's. The table gives median
      and mean step time, the ratio of medians against the peer (``vs peer``) and the paired
      ratio (median over rounds of ours/peer in the same round).
    * Bubble, timed: after the timed rounds each of our schedules runs ``--trace-steps`` more steps with
      its trace on (``train.pipeline_trace``: the stages start their clocks after a barrier and record
      when each forward and backward ran); the measured bubble is the mean over ranks of the share of
      the step a rank was not computing, the best of those steps (a scheduler hiccup only ever adds
      idle time), printed next to the schedule's formula for equal stages (F, B and W one slot each:
      ``(N-1)/(v m + N-1)`` for the first three, the zero-bubble formulas of
      ``trickles.parallel.pipeline.schedules`` for the others) and its prediction at that step's mean
      times of each rank's F, B and W with messages that cost nothing (``predicted_bubble``): what is
      left between prediction and measurement is waiting on messages. The formula holds only as far as the stages are
      equal: the embedding and the output layer make the first and last stage longer (on CPU only;
      on CUDA the trace would time kernel launches, so it is left out). This comparison used to be a
      test (within +-0.1); timing belongs here, and ``tests/`` checks the schedule by order and counts.
    * CPU: ``torch.set_num_threads(cores // N)`` in every rank (``--threads`` overrides).

Communication formula (bytes one rank sends per step, fp32)
    Each of the rank's chunks ``c`` (virtual stage ``s``) sends, per micro-batch, its output
    activation ``[b, T, d]`` forward unless ``s`` is the last virtual stage or ``s + 1`` is on the same
    rank (ZB-V's turn), and its input gradient ``[b, T, d]`` backward unless ``s = 0`` or ``s - 1`` is on
    the same rank: ``m b T d x 4 x (#chunks sending forward + #chunks sending backward)``; it receives
    as many bytes. Without interleaving that is ``2 m b T d x 4`` on middle ranks and half of it on the
    two end ranks. The bubble with equal stages is ``(N-1) / (v m + N-1)`` for GPipe, 1F1B and
    interleaved, ``(N-1) / (3m + N-1)`` for ZB-H1 and ``(N-1) / (6m + N-1)`` for ZB-V with F, B and W
    equally long (``m >= N``, ``m >= 2N - 1``).

Target
    ours/peer median step time <= 1.0x for every schedule; ours zb-h1 and zb-v faster than ours 1f1b when the
    bubble matters (e.g. m = N).

Examples::

    python benchmarks/pipeline_parallel.py     # CPU: 2 stages, demo with 8 layers of d=128, batch 8 x 128, m = 8
    python benchmarks/pipeline_parallel.py --world 4 --steps 5
    python benchmarks/pipeline_parallel.py --schedules 1f1b interleaved --virtual 4 --layers 16 --json out/pp.json
    torchrun --nproc-per-node 4 benchmarks/pipeline_parallel.py --device cuda --preset llama-350m   # one GPU per rank
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import (
    Contestant,
    add_run_args,
    compare_times,
    device_line,
    entry,
    finish,
    gather,  # noqa: E402
    ledger_delta,
    loss_agreement,
    model_line,
    print_verdicts,
    refuse,
    run_info,
    run_step,
    setup_rank,
    time_rounds,
    times_table,
    token_ce,
)
from _ranks import Ours as EngineContestant
from _timing import table, write_json  # noqa: E402

from trickles.errors import ConfigError  # noqa: E402
from trickles.models.config import ModelConfig, resolve_model  # noqa: E402
from trickles.models.presets import PRESETS, apply_preset  # noqa: E402
from trickles.models.transformer import Transformer, build_model, count_params  # noqa: E402
from trickles.optim.adamw import adamw_kwargs, param_groups  # noqa: E402
from trickles.optim.settings import OptimizerSettings  # noqa: E402
from trickles.parallel.pipeline.schedules import SCHEDULES, Shape, check_shape  # noqa: E402
from trickles.parallel.pipeline.stages import partition_layers  # noqa: E402
from trickles.parallel.pipeline.timeline import mean_times, predicted_bubble  # noqa: E402
from trickles.topology import ParallelDims  # noqa: E402

DEFAULTS = {
    "cpu": {"batch": 8, "micro_batch": 1, "seq": 128, "layers": 8, "d_model": 128},
    "cuda": {"batch": 32, "micro_batch": 4, "seq": 1024, "layers": None, "d_model": None},
}  # None: the preset's
REF = "single device"
PEER_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}
MULTI = ("interleaved", "zb-h1", "zb-v")  # the peer classes that take a list of stages


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--world", type=int, default=2, help="pipeline-parallel degree (processes); under torchrun its WORLD_SIZE"
    )
    p.add_argument(
        "--preset", default="demo", choices=list(PRESETS), help="model shape (trickles.models.PRESETS; llama flavour)"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"model.n_layers instead of the preset's (default: cpu {DEFAULTS['cpu']['layers']}, cuda the preset's)",
    )
    p.add_argument(
        "--d-model",
        type=int,
        default=None,
        help=f"model.d_model instead of the preset's, heads kept (default: cpu {DEFAULTS['cpu']['d_model']}, cuda the "
        "preset's)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="vocabulary size for presets that leave it to the tokenizer (demo, tiny)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"global batch in sequences (default: cpu {DEFAULTS['cpu']['batch']}, cuda {DEFAULTS['cuda']['batch']})",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help=f"sequences per micro-batch, m = batch / micro-batch (default: cpu {DEFAULTS['cpu']['micro_batch']}, "
        f"cuda {DEFAULTS['cuda']['micro_batch']})",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"tokens per sequence (default: cpu {DEFAULTS['cpu']['seq']}, cuda {DEFAULTS['cuda']['seq']})",
    )
    p.add_argument(
        "--virtual",
        type=int,
        default=2,
        help="model chunks per rank of the interleaved schedules (parallel.virtual_stages)",
    )
    p.add_argument(
        "--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES), help="which schedules to time"
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=3,
        help="traced steps per schedule after the timed rounds; the measured bubble is the best of them (0: none)",
    )
    add_run_args(p)
    return p.parse_args(argv)


# ---- contestants ---------------------------------------------------------------------------


def _chunks(schedule: str, args) -> int:
    """Model chunks per rank: ``--virtual`` interleaved, two for ZB-V, else one."""
    return args.virtual if schedule == "interleaved" else 2 if schedule == "zb-v" else 1


def _shape(schedule: str, pp: int, args, m: int) -> Shape:
    return Shape.of(schedule, pp, _chunks(schedule, args), m)


def _parts(schedule: str, model_cfg: ModelConfig, pp: int, v: int) -> list[list[int]]:
    """The layers of every (virtual) stage, as ours cuts them."""
    return partition_layers(model_cfg.n_layers, pp * v)


class Ours(EngineContestant):
    """Our pipeline engine, stepped as ``Trainer.train_step`` steps it."""

    def __init__(self, schedule: str, model_cfg: ModelConfig, topo, m: int, args):
        v = _chunks(schedule, args)
        super().__init__(
            f"ours {schedule}",
            f"torch {schedule}",
            [
                f"parallel.pp={topo.dims.pp}",
                f"parallel.schedule={schedule}",
                f"parallel.virtual_stages={v}",
                f"train.global_batch={m * args.micro_batch}",
                f"train.micro_batch={args.micro_batch}",
            ],
            model_cfg,
            topo,
            args,
        )
        self.schedule, self.m = schedule, m
        self.pipeline = self.engine.pipeline
        shape = self.pipeline.shape
        self.chunks = [
            (shape.stage(self.pipeline.rank, c), list(ch.layers), ch.first, ch.last)
            for c, ch in enumerate(self.pipeline.chunks)
        ]

    def step(self, x, y):
        e = self.engine
        e.zero_grad()
        loss = self.pipeline.forward_backward(list(zip(x.chunk(self.m), y.chunk(self.m))), 1.0, async_loss=True)
        e.finish_backward()
        e.clip_grad_norm(self.clip)
        e.step(self.lr)
        return loss.wait().detach()


class StageModule(nn.Module):
    """One (virtual) stage of the single-device model as an ``nn.Module`` for ``PipelineStage``:
    token ids or hidden states in; embedding (first stage) -> its blocks -> final norm and output
    (last stage); hidden states or logits out."""

    def __init__(self, model: Transformer, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.embed = model.embed if first else None
        self.embed_drop = model.embed_drop if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        model.ensure_rope(model.cfg.max_seq_len)  # (the model fills its tables lazily; this stage reads them whole)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_drop(self.embed(x)) if self.first else x
        t = h.shape[1]
        rope = (self.rope_cos[:t], self.rope_sin[:t])
        for block in self.layers.values():
            h = block(h, rope)
        return self.output(self.norm(h)) if self.last else h


class Peer(Contestant):
    """``torch.distributed.pipelining``: this rank's stage(s), the schedule, the pipeline clip and AdamW."""

    def __init__(
        self, schedule: str, model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, m: int, args
    ):
        from torch.distributed import pipelining

        super().__init__(f"torch {schedule}")
        pp, rank = dist.get_world_size(), dist.get_rank()
        shape = _shape(schedule, pp, args, m)
        v = shape.v
        parts = _parts(schedule, model_cfg, pp, v)
        n = len(parts)
        ids = [shape.stage(rank, c) for c in range(v)]
        model = build_model(model_cfg, seed=args.seed, device=device).train()
        mods = [StageModule(model, parts[s], s == 0, s == n - 1) for s in ids]
        del model  # what no stage of this rank holds is freed
        self.modules = nn.ModuleList(mods)
        self.stages = [pipelining.PipelineStage(mod, s, n, device) for s, mod in zip(ids, mods)]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        cls = getattr(pipelining, PEER_CLASSES[schedule])

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return token_ce(logits, y) / m  # the schedule sums the micro-batches' gradients: this makes them the mean's

        target = self.stages if schedule in MULTI else self.stages[0]
        self.schedule = cls(target, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        self.params = [p for p in self.modules.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            param_groups(self.modules, optim.weight_decay),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            **adamw_kwargs(device),
        )
        self.clip, self.device = args.clip, device
        self.chunks = [(s, parts[s], mod.first, mod.last) for s, mod in zip(ids, mods)]

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *((x,) if self.first else ()), target=y if self.last else None, losses=losses, return_outputs=False
        )
        # torchtitan's pipeline clip: the squared norm of this rank's gradients summed over the stages;
        # the same all-reduce carries the step's loss (the last stage's sum of loss / m) to every rank
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
        both = torch.stack([norm.float() ** 2, loss.float()])
        dist.all_reduce(both)
        torch.nn.utils.clip_grads_with_norm_(self.params, self.clip, both[0].sqrt(), foreach=True)
        self.optimizer.step()
        return both[1]


class Reference:
    """The single-device model on rank 0: the same micro-batches accumulated (loss / m), clipped, AdamW."""

    def __init__(self, model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, m: int, args):
        self.model = build_model(model_cfg, seed=args.seed, device=device).train()
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, optim.weight_decay),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            **adamw_kwargs(device),
        )
        self.m, self.clip = m, args.clip

    def step(self, x, y) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for xi, yi in zip(x.chunk(self.m), y.chunk(self.m)):
            loss = token_ce(self.model(xi), yi) / self.m
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.optimizer.step()
        return total


# ---- communication formula -----------------------------------------------------------------


def expected_p2p(shape: Shape, rank: int, b: int, seq: int, d: int) -> int:
    """Bytes ``rank`` sends per step (as many as it receives): see the module docstring."""
    stages = [shape.stage(rank, c) for c in range(shape.v)]
    last = shape.stages - 1
    messages = sum(s < last and shape.owner(s + 1)[0] != rank for s in stages) + sum(
        s > 0 and shape.owner(s - 1)[0] != rank for s in stages
    )
    return shape.m * messages * b * seq * d * 4


# ---- the bubble, timed ---------------------------------------------------------------------


def traced_bubbles(contestants: list[Contestant], x, y, steps: int) -> dict[str, tuple[float, float] | None]:
    """``{our schedule's name: (measured, predicted)}`` of the traced step with the smallest idle share over ``steps``
    steps, on pipeline rank 0 (None elsewhere, or when ``steps`` is 0): the stages' trace, as ``train.pipeline_trace``
    draws it, and the schedule's bubble at that step's mean times of each rank's F, B and W, messages free."""
    out: dict[str, tuple[float, float] | None] = {}
    for c in contestants:
        if not isinstance(c, Ours):
            continue
        measured = []
        c.pipeline.trace_enabled = True
        for _ in range(steps):
            c.step(x, y)
            timeline = c.pipeline.gather_trace()
            if timeline is not None:
                shape = c.pipeline.shape
                measured.append((timeline.bubble(), predicted_bubble(c.schedule, shape, mean_times(timeline))))
        c.pipeline.trace_enabled = False
        out[c.name] = min(measured) if measured else None
    return out


# ---- one rank ------------------------------------------------------------------------------


def _check_shape(model_cfg: ModelConfig, world: int, batch: int, micro: int, args) -> str | None:
    """Why these settings cannot run (None: they can)."""
    if world < 2:
        return "--world must be at least 2 (pipeline stages)"
    try:
        model_cfg.validate()
    except ConfigError as e:
        return f"{e} (here: --d-model, --layers or --preset)"
    if model_cfg.flavor != "llama" or model_cfg.tied:
        return (
            f"preset {args.preset} is not an untied llama shape; with tied input and output embeddings the "
            "torch.distributed.pipelining peer would need their gradients summed over the first and last stage, so "
            "this benchmark takes untied llama shapes only (e.g. demo, tiny, llama-125m, llama-350m, llama-7b)"
        )
    if batch % micro:
        return f"--batch {batch} is not a multiple of --micro-batch {micro}"
    m = batch // micro
    for s in args.schedules:
        v = _chunks(s, args)
        try:
            check_shape(s, _shape(s, world, args, m))
        except ValueError as e:
            return f"{s}: {e} (here: change --batch, --micro-batch or --virtual)"
        if model_cfg.n_layers < world * v:
            return (
                f"{s}: {model_cfg.n_layers} layers cannot fill {world * v} stages; raise --layers or lower --world / "
                "--virtual"
            )
    return None


def rank_main(args) -> int:
    device, rank, world = setup_rank(args)
    batch = args.batch or DEFAULTS[device.type]["batch"]
    args.micro_batch = args.micro_batch or DEFAULTS[device.type]["micro_batch"]
    seq = args.seq or DEFAULTS[device.type]["seq"]
    model_cfg = apply_preset(ModelConfig(), args.preset)
    layers, d_model = args.layers or DEFAULTS[device.type]["layers"], args.d_model or DEFAULTS[device.type]["d_model"]
    if layers:
        model_cfg = dataclasses.replace(model_cfg, n_layers=layers)
    if d_model:
        model_cfg = dataclasses.replace(model_cfg, d_model=d_model)
    model_cfg = resolve_model(model_cfg, tokenizer_vocab=args.vocab, seq_len=seq)
    problem = _check_shape(model_cfg, world, batch, args.micro_batch, args)
    if problem:
        return refuse(f"pipeline_parallel.py: {problem}")
    m = batch // args.micro_batch
    topo = ParallelDims(dp=1, pp=world).build(device)
    ledger = topo.ledger
    optim = OptimizerSettings(args.lr, (0.9, 0.95), 1e-8, 0.1)

    reference = Reference(model_cfg, device, optim, m, args) if rank == 0 else None
    contestants: list[Contestant] = []
    for s in args.schedules:
        contestants += [Ours(s, model_cfg, topo, m, args), Peer(s, model_cfg, device, optim, m, args)]
    with torch.device("meta"):
        n_params = count_params(Transformer(model_cfg))

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, batch, seq + 1), generator=g)
    data = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]

    # agreement check: step 1 on the initial weights, step 2 after one update (a second batch);
    # our ledger is read around step 2 (step 1 is the same traffic; the peers infer shapes in it)
    ref_losses: list[float] = []
    comm: dict[str, dict] = {}
    for i, (x, y) in enumerate(data):
        if reference is not None:
            ref_losses.append(reference.step(x, y))
        for c in contestants:
            before = ledger.snapshot()
            run_step(c, x, y, device, record=False)
            if isinstance(c, Ours) and i == 1:
                comm[c.name] = ledger_delta(before, ledger.snapshot())
    check = {c.name: list(c.losses) for c in contestants}
    del reference
    gc.collect()

    time_rounds(contestants, *data[0], args, device)
    bubbles = traced_bubbles(contestants, *data[0], args.trace_steps if device.type == "cpu" else 0)
    everyone = gather(
        {
            "bubbles": bubbles,
            "times": {c.name: c.times for c in contestants},
            "check": check,
            "ref": ref_losses,
            "comm": comm,
            "chunks": {c.name: c.chunks for c in contestants},
            "alive": {c.name: c.pipeline.peak_alive for c in contestants if isinstance(c, Ours)},
        }
    )
    status = report(args, everyone, contestants, model_cfg, n_params, batch, seq, m, device, world) if rank == 0 else 0
    del contestants, topo
    return finish(status, device)


# ---- report (rank 0) -----------------------------------------------------------------------


def _describe(chunk) -> str:
    """``stage 2 = embedding + layers 0-3 + head`` from ``(stage, layers, first, last)``."""
    stage, layers, first, last = chunk
    span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
    return f"stage {stage} = " + ("embedding + " if first else "") + span + (" + head" if last else "")


def report(
    args,
    everyone: list[dict],
    contestants: list[Contestant],
    model_cfg,
    n_params: int,
    batch: int,
    seq: int,
    m: int,
    device: torch.device,
    world: int,
) -> int:
    names = [c.name for c in contestants]
    b, d = args.micro_batch, model_cfg.d_model
    print(
        f"trickles pipeline schedules vs torch.distributed.pipelining, one training step each, pp={world}, "
        "same stages, micro-batches, weights and data"
    )
    print(model_line(args.preset, model_cfg, n_params))
    print(
        f"  step    global batch {batch} x seq {seq} in m={m} micro-batches of {b}, fp32, clip {args.clip}, "
        f"AdamW {'fused' if device.type == 'cuda' else 'foreach'} lr {args.lr}; interleaved: {args.virtual} chunks "
        "per rank"
    )
    print(device_line(device))
    for s in args.schedules:
        same = all(e["chunks"][f"ours {s}"] == e["chunks"][f"torch {s}"] for e in everyone)
        print(
            f"  {s:<11} "
            + ";  ".join(
                f"rank {r}: " + ", ".join(_describe(c) for c in e["chunks"][f"torch {s}"])
                for r, e in enumerate(everyone)
            )
            + ("" if same else "  (ours DIFFERS)")
        )
        if not same:
            print(
                f"the stages of ours {s} and torch {s} differ: " + str([e["chunks"] for e in everyone]), file=sys.stderr
            )
            return 1

    # agreement
    ref = everyone[0]["ref"]
    print(
        f"\nagreement check: every rank's loss vs the single-device model's (rank 0), relative tolerance {args.tol:g}"
    )
    if not loss_agreement(
        everyone,
        names,
        args.tol,
        REF,
        ref_losses=ref,
        note="  (mean loss over the micro-batches of the "
        "whole batch, on every rank; step 2 runs on a second batch after one AdamW update)",
    ):
        return 1

    # communication (ours)
    act = b * seq * d * 4
    print(
        f"\npoint-to-point bytes per step (our CommLedger; activation or gradient of one micro-batch b T d x 4 = "
        f"{act / 2**20:.3f} MiB), busiest rank, vs m b T d x 4 x (chunks not last + chunks not first):"
    )
    rows, comm_results = [], {}
    for s in args.schedules:
        n = f"ours {s}"
        per_rank = []
        for r, e in enumerate(everyone):
            c = e["comm"][n]
            sent = sum(c.get(f"send/{g}", {}).get("bytes", 0) for g in ("pp", "pp_grad"))
            recv = sum(c.get(f"recv/{g}", {}).get("bytes", 0) for g in ("pp", "pp_grad"))
            per_rank.append(
                {
                    "sent": sent,
                    "received": recv,
                    "expected": expected_p2p(_shape(s, world, args, m), r, b, seq, d),
                    "ops": c,
                }
            )
        busiest = max(range(world), key=lambda r: per_rank[r]["sent"])
        pr = per_rank[busiest]
        exact = all(x["sent"] == x["expected"] == x["received"] for x in per_rank)
        other = everyone[busiest]["comm"][n]
        small = ", ".join(
            f"{k} x{v['calls']}" for k, v in sorted(other.items()) if not k.startswith(("send/", "recv/"))
        )
        msgs = sum(v["calls"] for k, v in other.items() if k.startswith("send/"))
        rows.append(
            [
                s,
                f"{busiest}",
                f"{pr['sent'] / 2**20:.2f}",
                f"{pr['received'] / 2**20:.2f}",
                f"{pr['expected'] / 2**20:.2f}",
                f"{pr['sent'] / pr['expected']:.4f}",
                "yes" if exact else "NO",
                f"{msgs}",
                small,
            ]
        )
        comm_results[s] = per_rank
    print(
        table(
            [
                "schedule",
                "rank",
                "sent MiB",
                "received MiB",
                "formula MiB",
                "sent/formula",
                "all ranks exact",
                "sends",
                "other collectives",
            ],
            rows,
        )
    )
    print(
        "  (sends: tensors sent, each posted in a batch_isend_irecv with the run of messages around it; other: the "
        "step's loss and the squared gradient norm, summed over the pipeline group)"
    )

    # timing
    results, cells = compare_times(everyone, contestants, args.steps, batch * seq)
    times_table(args, [cells[n] for n in names])

    rows = []
    for s in args.schedules:
        o, p = results[f"ours {s}"], results[f"torch {s}"]
        v = _chunks(s, args)
        pr = comm_results[s]
        sent = max(x["sent"] for x in pr)
        expect = max(x["expected"] for x in pr)
        alive = max(e["alive"][f"ours {s}"] for e in everyone)
        traced = everyone[0]["bubbles"].get(f"ours {s}")
        measured, predicted = traced if traced else (None, None)
        unit = predicted_bubble(s, _shape(s, world, args, m))
        o.update(
            p2p_sent=sent,
            p2p_expected=expect,
            bubble=unit,
            bubble_predicted=predicted,
            bubble_measured=measured,
            peak_alive=alive,
        )
        rows.append(
            [
                s,
                f"{v}",
                f"{unit:.3f}",
                "-" if predicted is None else f"{predicted:.3f}",
                "-" if measured is None else f"{measured:.3f}",
                f"{o['median'] * 1e3:.1f}",
                f"{p['median'] * 1e3:.1f}",
                f"{o['ratio']:.3f}x",
                f"{o['paired_ratio']:.3f}x",
                f"{sent / 2**20:.2f}",
                f"{expect / 2**20:.2f}",
                f"{alive}",
            ]
        )
    print("\nsummary per schedule:")
    print(
        table(
            [
                "schedule",
                "v",
                "bubble",
                "predicted",
                "measured",
                "ours ms",
                "torch ms",
                "ours/torch",
                "paired",
                "p2p sent MiB",
                "formula MiB",
                "ours live mb",
            ],
            rows,
        )
    )
    print(
        "  (bubble: the schedule's with equal stages and F = B = W (GPipe, 1F1B, interleaved: (N-1)/(v m + N-1)); "
        "predicted: at the traced step's mean times of each rank's F, B and W, messages free; measured: our trace's "
        "idle share per rank, mean over ranks, best "
        f"of {args.trace_steps} traced steps (CPU only); p2p: busiest rank, per step; live mb: the most micro-batch "
        "chunks whose activations one of our ranks held at once)"
    )

    print_verdicts(results, [f"ours {s}" for s in args.schedules])

    write_json(
        args.json,
        {
            **run_info(args, world, batch, seq, device, n_params, model_cfg),
            "micro_batches": m,
            "check": {REF: ref, **{n: [r["check"][n] for r in everyone] for n in names}},
            "comm": comm_results,
            "results": results,
        },
    )
    return 0


# ---- entry ---------------------------------------------------------------------------------

main = entry(parse_args, rank_main)


if __name__ == "__main__":
    sys.exit(main())
