"""Tensor-parallel training step: trickles' 1-D tensor parallel (with and without sequence parallel)
vs PyTorch DTensor tensor parallel, same run.

What is compared
    One full training step -- forward, cross-entropy, backward, global-norm clipping (1.0),
    AdamW step -- with every matrix of the model split over ``N`` tensor-parallel ranks
    (``--world``; no data parallelism: every rank sees the whole batch), for

    * ours: ``trickles.parallel.plan.parallelize`` with ``parallel.tp = N`` (Megatron-style
      column/row-parallel linears, vocabulary-parallel embedding, output and cross-entropy),
      and the same with ``parallel.sequence_parallel = true`` (norms on sequence shards,
      all-gather / reduce-scatter instead of all-reduce); driven exactly as
      ``trickles.train.Trainer.train_step`` drives it;
    * peers: ``torch.distributed.tensor.parallel.parallelize_module`` over
      ``init_device_mesh(device, (N,))`` with torchtitan's llama plan: ``ColwiseParallel`` for
      ``q/k/v_proj``, ``gate_proj``, ``up_proj``, ``RowwiseParallel`` for ``o_proj``,
      ``down_proj`` and the embedding (vocabulary rows), ``ColwiseParallel`` for the output
      with vocabulary-sharded logits and ``loss_parallel()`` for the cross-entropy (unless
      ``--no-loss-parallel``: logits replicated, plain cross-entropy), and
      ``PrepareModuleInput`` on the attention and the MLP so each region's input becomes one
      DTensor that its column-parallel projections share (one gradient reduction per region
      in backward, not one per projection). The SP variant adds ``SequenceParallel`` on the
      norms, ``Shard(1) -> Replicate()`` in those ``PrepareModuleInput`` and
      ``output_layouts=Shard(1)`` on the row-parallel layers and the embedding; the norm
      weights' gradients, which DTensor leaves ``Partial``, are reduced once after backward
      (left partial, every foreach op of the clip and of AdamW would all-reduce them again).
      Without SP the norm weights stay plain tensors (every rank computes the same gradient
      for them). ``torch.optim.AdamW`` (foreach on CPU, fused on CUDA; the DTensor and plain
      parameters in separate groups, as foreach kernels need) over the same decay / no-decay
      groups as ours; clipping as torchtitan does it: ``get_total_norm`` (foreach) of the
      DTensor gradients made whole, then ``clip_grads_with_norm_``.
      The attention module reads its head counts from the projections' output shapes, so the
      peer's copy (``use_local_output=True`` on the column-parallel layers) sees its local
      heads without any attribute changes. gpt2 shapes: the output is tied to the embedding
      again after the split (both ``Shard(0)`` over the vocabulary), and with SP the learned
      positions are sliced to the rank's shard (``PrepareModuleOutput`` ``Replicate() ->
      Shard(0)``).

    Pairs: ours tp vs dtensor tp, ours tp+sp vs dtensor tp+sp.

    What each runs, pinned: the peers and the single-device reference are torchtitan's model, the plain
    PyTorch one its plan shards -- separate ``q/k/v`` and ``gate/up`` projections and eager PyTorch norms,
    rotary and SwiGLU (``model.fused_proj=false``, ``model.kernels=torch``; a fused ``qkv_proj`` has no
    entry in that plan, and DTensor-sharded norms cannot enter the Triton kernels). Ours runs as the
    library configures it on the device (``--kernels``, ``--fused-proj``; on CUDA: the Triton kernels
    and one q/k/v and one gate/up matmul, split by key/value groups and channel pairs); ``--kernels torch
    --fused-proj off`` makes ours the peers' model, for a comparison of the parallelism alone.

How
    * Every contestant lives in the same ``N`` processes at once, on the same model shape,
      batch and initial weights: peers get ``build_model(cfg, seed)`` on every rank (then
      ``parallelize_module`` keeps each rank's shard), ours a meta-device model that
      ``parallelize`` initializes from the same seed (initialization is a pure function of
      seed and parameter name, so it is identical).
    * Same data: one global batch of random tokens from a fixed generator, the whole batch on
      every rank (tensor parallelism splits the model, not the data).
    * Agreement check before timing: every rank also holds the single-device model (same
      seed, ``torch.optim.AdamW``, ``clip_grad_norm_``); two steps each on two batches; every
      contestant's loss at step 1 (same weights) and step 2 (after one update) must agree with
      the single-device loss within ``--tol`` (relative, default 1e-4 in fp32), else the run
      stops.
    * Communication: the bytes this rank sends per step in our engines, from the topology's
      ``CommLedger`` (``snapshot()`` around the second check step, wire bytes), next to the
      Megatron-LM volume and our own accounting of every collective (below). For the peers the
      number of collectives per step from ``CommDebugMode`` (counts only, no bytes).
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds in which every contestant
      runs one step, the order rotating each round so noise falls on all of them alike. Each
      step starts after a barrier; its time is the slowest rank's. The table gives median
      and mean step time, the ratio of medians against the peer (``vs peer``) and the paired
      ratio (median over rounds of ours/peer in the same round).
    * CPU: ``torch.set_num_threads(cores // N)`` in every rank (``--threads`` overrides).

Communication formulas (wire bytes one rank sends per step; ``S = B T d * 4`` bytes, the
activation of one block, ``f = (N-1)/N``, ``L`` blocks)
    * Megatron-LM, blocks: two all-reduces of ``S`` in forward, two in backward per block,
      ``4 L * 2 f S``; with sequence parallel each all-reduce becomes an all-gather plus a
      reduce-scatter of the same total (``8 L * f S``).
    * ours also counts: the embedding's all-reduce (SP: reduce-scatter, all-gather in backward)
      and the final norm's entry to the output region (all-reduce in backward; SP: all-gather,
      reduce-scatter in backward), ``2 * 2 f S`` either way; the vocabulary-parallel loss's three
      all-reduces of ``B T`` fp32 values; with SP the re-gather of each region's input in
      backward (``2 L + 1`` all-gathers of ``f S``: the column-parallel layers keep only their
      sequence shard for backward, as Megatron-LM does) and the all-reduce of the norm weights'
      partial gradients; the 4-byte all-reduce of the gradient norm.

Target
    ours/peer median step time <= 1.0x for both pairs.

Examples::

    python benchmarks/tensor_parallel.py                       # CPU, 2 ranks, demo shape (vocab 4096), batch 4 x 256
    python benchmarks/tensor_parallel.py --world 4 --steps 10
    python benchmarks/tensor_parallel.py --json out/tp.json
    torchrun --nproc-per-node 4 benchmarks/tensor_parallel.py --device cuda --preset llama-350m   # one GPU per rank
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import (
    Contestant,
    add_model_args,
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

from trickles.models.config import ModelConfig, resolve_model  # noqa: E402
from trickles.models.presets import apply_preset  # noqa: E402
from trickles.models.transformer import Transformer, build_model, count_params  # noqa: E402
from trickles.optim.adamw import adamw_kwargs, param_groups  # noqa: E402
from trickles.optim.settings import OptimizerSettings  # noqa: E402
from trickles.topology import ParallelDims  # noqa: E402

DEFAULTS = {"cpu": {"batch": 4, "seq": 256}, "cuda": {"batch": 8, "seq": 1024}}
REF = "single device"
FUSED_PROJ = {"auto": None, "on": True, "off": False}
OURS_TP, OURS_SP, PEER_TP, PEER_SP = "ours tp", "ours tp+sp", "dtensor tp", "dtensor tp+sp"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_model_args(
        p,
        "tensor-parallel",
        f"batch in sequences, the whole of it on every rank (default: cpu "
        f"{DEFAULTS['cpu']['batch']}, cuda {DEFAULTS['cuda']['batch']})",
        DEFAULTS,
    )
    p.add_argument(
        "--no-loss-parallel",
        action="store_true",
        help="peers: replicated logits and a plain cross-entropy instead of loss_parallel()",
    )
    p.add_argument(
        "--kernels",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="model.kernels of ours (the peers and the reference always run eager PyTorch, torchtitan's model)",
    )
    p.add_argument(
        "--fused-proj",
        choices=list(FUSED_PROJ),
        default="auto",
        help="ours: one q/k/v and one gate/up matmul (model.fused_proj; auto: the library's default, on with "
        "kernels=triton or where measured to win on CUDA); the peers always have separate projections, which "
        "torchtitan's plan names",
    )
    add_run_args(p)
    return p.parse_args(argv)


# ---- contestants ---------------------------------------------------------------------------


class Ours(EngineContestant):
    def __init__(self, name: str, sp: bool, model_cfg: ModelConfig, topo, args):
        super().__init__(
            name,
            PEER_SP if sp else PEER_TP,
            [f"parallel.tp={topo.dims.tp}", f"parallel.sequence_parallel={'true' if sp else 'false'}"],
            model_cfg,
            topo,
            args,
        )
        self.sp = sp


class Peer(Contestant):
    """The single-device reference (plain parameters) or a DTensor tensor-parallel model."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optim: OptimizerSettings,
        device: torch.device,
        args,
        sp: bool = False,
        loss_parallel: bool = False,
    ):
        super().__init__(name)
        from torch.distributed.tensor import DTensor

        self.model, self.clip, self.sp, self.loss_parallel = model, args.clip, sp, loss_parallel
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dparams = [p for p in self.params if isinstance(p, DTensor)]
        self.plain = [p for p in self.params if not isinstance(p, DTensor)]
        groups = []  # foreach / fused kernels take DTensors or plain tensors, not both in one list
        for g in param_groups(model, optim.weight_decay):
            for part in (
                [p for p in g["params"] if isinstance(p, DTensor)],
                [p for p in g["params"] if not isinstance(p, DTensor)],
            ):
                if part:
                    groups.append({**g, "params": part})
        self.optimizer = torch.optim.AdamW(
            groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, **adamw_kwargs(device)
        )

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            ctx = loss_parallel()
        else:
            ctx = contextlib.nullcontext()
        with ctx:  # loss_parallel() must cover the backward too
            loss = token_ce(self.model(x), y)
            loss.backward()
        self._complete_partial_grads()
        self._clip()
        self.optimizer.step()
        loss = loss.detach()
        return loss.to_local() if hasattr(loss, "to_local") else loss  # a replicated DTensor under loss_parallel

    def _complete_partial_grads(self) -> None:
        """Reduces gradients left ``Partial`` (replicated parameters used on sequence shards: the SP norms) once.

        Left partial, every foreach op of the clip and of AdamW that reads them would all-reduce them again.
        """
        for p in self.dparams:
            g = p.grad
            if g is not None and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(placements=p.placements)

    def _clip(self) -> None:
        if not self.dparams:  # the single-device reference
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            return
        # torchtitan's clip: the norm of the DTensor gradients is made whole, then applied
        norms = []
        groups = [[p for p in self.dparams if p.grad is not None], [p for p in self.plain if p.grad is not None]]
        for group in groups:
            if group:
                n = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
                norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
        norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        for group in groups:
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, self.clip, norm, foreach=True)


def make_reference(model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, args) -> Peer:
    return Peer(REF, build_model(model_cfg, seed=args.seed, device=device).train(), optim, device, args)


def make_dtensor(model_cfg: ModelConfig, device: torch.device, optim: OptimizerSettings, mesh, sp: bool, args) -> Peer:
    """torchtitan's llama tensor-parallel plan (``parallelize_llama``'s ``apply_tp``) on our module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    lp = not args.no_loss_parallel
    model = build_model(model_cfg, seed=args.seed, device=device).train()
    seq_layout = Shard(1) if sp else Replicate()  # the residual stream between the matmul regions
    root_plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_layout),
        "output": ColwiseParallel(
            input_layouts=seq_layout, output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
        if model.pos_embed is not None:  # gpt2: learned positions added to this rank's sequence shard
            root_plan["pos_embed"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=True
            )
    parallelize_module(model, mesh, root_plan)
    if model_cfg.tied:  # the embedding's rows and the output's are split alike (Shard(0)): tie them again
        model.output.weight = model.embed.weight
    for block in model.layers.values():
        plan = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=seq_layout),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq_layout),
        }
        # attn(x, rope, cache, start, pad_mask) and mlp(x): x enters the region as one DTensor, so the
        # column-parallel projections that read it share one backward reduction (wrapped by each
        # projection instead, q/k/v would all-reduce their input gradients separately)
        rest = (None,) * attention_arguments(block.attn)  # rope, cache, start, padding mask: not DTensors
        plan["attn"] = PrepareModuleInput(input_layouts=(seq_layout, *rest), desired_input_layouts=(Replicate(), *rest))
        plan["mlp"] = PrepareModuleInput(input_layouts=(seq_layout,), desired_input_layouts=(Replicate(),))
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        if not block.mlp.gated:
            del plan["mlp.gate_proj"]
        parallelize_module(block, mesh, plan)
    return Peer(PEER_SP if sp else PEER_TP, model, optim, device, args, sp=sp, loss_parallel=lp)


def attention_arguments(attn: torch.nn.Module) -> int:
    """How many arguments the block passes its attention after ``x`` (``PrepareModuleInput`` wants one layout for each
    positional input): those of ``forward`` after ``x`` but ``documents`` (packed documents' mask, passed by keyword
    and only with ``data.document_mask``)."""
    return len([p for p in inspect.signature(attn.forward).parameters if p != "documents"]) - 1


def _peer_comm_counts(c: Peer, x, y) -> dict[str, int] | None:
    """Collectives one step of a DTensor model issues (CommDebugMode; None where unavailable)."""
    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:
        return None
    import warnings

    mode = CommDebugMode()
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its module tracker's full backward hooks warn when the input needs no grad
        loss = c.step(x, y)
    counts = {str(getattr(k, "__name__", k)).split(".")[-1]: int(v) for k, v in mode.get_comm_counts().items() if v}
    return {"counts": counts, "loss": loss}


# ---- communication formulas ----------------------------------------------------------------


def expected_comm(model_cfg: ModelConfig, batch: int, seq: int, n: int, sp: bool) -> list[tuple[str, float]]:
    """``(component, wire bytes per rank and step)`` of our tensor-parallel step (see the module docstring)."""
    d, L = model_cfg.d_model, model_cfg.n_layers
    S, f = batch * seq * d * 4, (n - 1) / n
    rows = [("blocks (Megatron: 4L all-reduce = 8L f S)", 8 * L * f * S), ("embedding + final norm entry", 4 * f * S)]
    if sp:
        rows.append(("SP re-gather in backward ((2L+1) all-gather)", (2 * L + 1) * f * S))
    rows.append(("vocab-parallel loss (3 all-reduce of B T fp32)", 3 * 2 * f * batch * seq * 4))
    partial = 0
    if sp:
        partial += (2 * L + 1) * d  # norm weights (RMSNorm: no bias)
        if model_cfg.flavor == "gpt2":
            partial += (
                (2 * L + 1) * d + 2 * L * d + d * (model_cfg.max_seq_len or 0)
            )  # LayerNorm biases, row biases, positions
    if model_cfg.kv_heads % n:
        partial += 2 * L * model_cfg.kv_heads * model_cfg.head_dim * d  # ReplicatedKV weights
    if partial:
        rows.append(("partial gradients (1 all-reduce)", 2 * f * partial * 4))
    rows.append(("gradient norm (all-reduce of 4 bytes)", 2 * f * 4))
    return rows


# ---- one rank ------------------------------------------------------------------------------


def _check_shape(model_cfg: ModelConfig, world: int, seq: int) -> str | None:
    """Why this shape cannot be split ``world`` ways by both implementations (None: it can)."""
    for what, n in (
        ("model.n_heads", model_cfg.n_heads),
        ("model.n_kv_heads", model_cfg.kv_heads),
        ("model.ffn_hidden", model_cfg.ffn_dim),
        ("vocabulary size", model_cfg.vocab_size),
        ("--seq", seq),
    ):
        if n % world:
            return (
                f"{what} ({n}) is not divisible by --world {world} (DTensor's column-wise split needs it; so does "
                "sequence parallel for --seq)"
            )
    return None


def model_variants(model_cfg: ModelConfig, args) -> tuple[ModelConfig, ModelConfig]:
    """``(ours, plain)``: ours with ``--kernels`` and ``--fused-proj``; the peers' and the reference's model pinned to
    separate projections and eager PyTorch kernels (torchtitan's model, which its plan shards)."""
    ours = dataclasses.replace(model_cfg, kernels=args.kernels, fused_proj=FUSED_PROJ[args.fused_proj])
    return ours, dataclasses.replace(model_cfg, kernels="torch", fused_proj=False)


def rank_main(args) -> int:
    device, rank, world = setup_rank(args)
    batch = args.batch or DEFAULTS[device.type]["batch"]
    seq = args.seq or DEFAULTS[device.type]["seq"]
    model_cfg = resolve_model(apply_preset(ModelConfig(), args.preset), tokenizer_vocab=args.vocab, seq_len=seq)
    ours_cfg, plain_cfg = model_variants(model_cfg, args)
    problem = _check_shape(model_cfg, world, seq)
    if problem:
        return refuse(f"tensor_parallel.py: {problem}; change --world or the shape")
    from torch.distributed.device_mesh import init_device_mesh

    topo = ParallelDims(dp=1, tp=world).build(device)
    ledger = topo.ledger
    mesh = init_device_mesh(device.type, (world,))
    optim = OptimizerSettings(args.lr, (0.9, 0.95), 1e-8, 0.1)

    reference = make_reference(plain_cfg, device, optim, args)
    contestants: list[Contestant] = [
        Ours(OURS_TP, False, ours_cfg, topo, args),
        Ours(OURS_SP, True, ours_cfg, topo, args),
        make_dtensor(plain_cfg, device, optim, mesh, False, args),
        make_dtensor(plain_cfg, device, optim, mesh, True, args),
    ]
    with torch.device("meta"):
        n_params = count_params(Transformer(model_cfg))

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, batch, seq + 1), generator=g)
    data = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]

    # agreement check: step 1 on the initial weights, step 2 after one update (a second batch);
    # our ledger is read around step 2 (step 1 sets up buffers, the volume is the same), the
    # peers' collectives are counted in step 2
    comm: dict[str, dict] = {}
    peer_comm: dict[str, dict | None] = {}
    for i, (x, y) in enumerate(data):
        reference.losses.append(reference.step(x, y).item())
        for c in contestants:
            before = ledger.snapshot()
            if isinstance(c, Peer) and i == 1:
                dist.barrier()
                counted = _peer_comm_counts(c, x, y)
                if counted is None:
                    run_step(c, x, y, device, record=False)
                else:
                    c.losses.append(counted.pop("loss").item())
                peer_comm[c.name] = counted
                continue
            run_step(c, x, y, device, record=False)
            if isinstance(c, Ours) and i == 1:
                comm[c.name] = ledger_delta(before, ledger.snapshot())
    check = {c.name: list(c.losses) for c in [reference, *contestants]}
    del reference
    gc.collect()

    time_rounds(contestants, *data[0], args, device)
    everyone = gather(
        {"times": {c.name: c.times for c in contestants}, "check": check, "comm": comm, "peer_comm": peer_comm}
    )
    status = report(args, everyone, contestants, ours_cfg, n_params, batch, seq, device, world) if rank == 0 else 0
    del contestants, topo, mesh
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
) -> int:
    names = [c.name for c in contestants]
    lp = "loss_parallel" if not args.no_loss_parallel else "replicated logits"
    print(
        f"trickles 1-D tensor parallel (+ sequence parallel) vs torch DTensor tensor parallel, one training step each, "
        f"tp={world}, same weights and data"
    )
    print(model_line(args.preset, model_cfg, n_params))
    print(
        f"  step    batch {batch} x seq {seq} on every rank, fp32, clip {args.clip}, "
        f"AdamW {'fused' if device.type == 'cuda' else 'foreach'} lr {args.lr}; peers: {lp}"
    )
    print(device_line(device))
    print(
        f"  how     ours: model.kernels={model_cfg.kernels}, "
        f"{'fused q/k/v and gate/up projections' if model_cfg.fuses_projections else 'separate projections'}; "
        "peers and reference: separate projections, eager PyTorch kernels (torchtitan's model)"
    )
    if world == 1:
        print(
            "  note    tp=1: ours is the unsplit model (parallelize applies no tensor parallelism), the peers run on a "
            "1-rank mesh; this checks the code path, it is no tensor-parallel comparison"
        )

    # agreement
    print(f"\nagreement check: every rank's loss vs the single-device model's, relative tolerance {args.tol:g}")
    if not loss_agreement(
        everyone,
        [REF, *names],
        args.tol,
        REF,
        note="  (loss of the whole batch, on every rank; step 2 runs on a second batch after one AdamW update)",
    ):
        return 1

    # communication
    d, L, f = model_cfg.d_model, model_cfg.n_layers, (world - 1) / world
    S = batch * seq * d * 4
    megatron = 8 * L * f * S
    print(
        "\nbytes sent per rank and step (our CommLedger, wire bytes, tp group; "
        f"S = B T d x 4 bytes = {S / 2**20:.2f} MiB, f = (N-1)/N = {f:.3f}):"
    )
    rows, comm_results = [], {}
    for c in contestants:
        if isinstance(c, Ours):
            comm = everyone[0]["comm"][c.name]
            sent = max(
                sum(v["wire_bytes"] for k, v in r["comm"][c.name].items() if k.endswith("/tp")) for r in everyone
            )
            parts = expected_comm(model_cfg, batch, seq, world, c.sp)
            expect = sum(b for _, b in parts)
            ops = ", ".join(f"{k.split('/')[0]} x{v['calls']}" for k, v in sorted(comm.items()) if k.endswith("/tp"))
            rows.append(
                [
                    c.name,
                    f"{sent / 2**20:.2f}",
                    f"{megatron / 2**20:.2f}",
                    f"{expect / 2**20:.2f}",
                    f"{sent / expect:.4f}" if expect else "-",
                    ops,
                ]
            )
            comm_results[c.name] = {
                "sent": sent,
                "megatron_blocks": megatron,
                "expected": expect,
                "parts": parts,
                "ops": comm,
            }
        else:
            counted = everyone[0]["peer_comm"].get(c.name)
            ops = (
                ", ".join(f"{k} x{v}" for k, v in sorted(counted["counts"].items()))
                if counted
                else "(CommDebugMode unavailable)"
            )
            rows.append([c.name, "-", f"{megatron / 2**20:.2f}", "-", "-", ops])
            comm_results[c.name] = counted
    print(
        table(
            ["implementation", "sent MiB", "Megatron blocks MiB", "ours expected MiB", "sent/expected", "collectives"],
            rows,
        )
    )
    for c in contestants:
        if isinstance(c, Ours):
            print(f"  {c.name}: " + "; ".join(f"{what} {b / 2**20:.2f}" for what, b in comm_results[c.name]["parts"]))
    print(
        "  (Megatron blocks: 4 all-reduces of S per block, or with SP the all-gathers and reduce-scatters of the same "
        "total; peers: collectives one rank issues per step, counted by CommDebugMode, forward and backward)"
    )

    # timing
    results, cells = compare_times(everyone, contestants, args.steps, batch * seq)
    times_table(args, [cells[c.name] for c in contestants])
    print_verdicts(results, (OURS_TP, OURS_SP))
    write_json(
        args.json,
        {
            **run_info(args, world, batch, seq, device, n_params, model_cfg),
            "check": {n: [r["check"][n] for r in everyone] for n in [REF, *names]},
            "comm": comm_results,
            "results": results,
        },
    )
    return 0


# ---- entry ---------------------------------------------------------------------------------

main = entry(parse_args, rank_main)


if __name__ == "__main__":
    sys.exit(main())
