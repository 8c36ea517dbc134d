"""Where the memory goes: predicted bytes per device, and measured ones, side by side.

:func:`predict` works from the configuration alone (no process group, no device): model states from the ZeRO
formulas for the layout and precision (``accounting.py``), counted on the engine's padded flat layout
(:func:`engine_state_bytes`, exact to the byte), activations per layer from the formulas of this implementation
(``activations.py``), and an estimated peak. :func:`~trickles.memory.measure.measure` builds the real trainer, runs a
few steps and reads the same categories back. :func:`report_for` does both and the report puts them in a table, a
bar chart PNG and an answer to "does this fit in X GB".

``held`` = model states on the device + all saved activations of one micro-batch (what is
alive at the end of forward); predicted ``peak`` = the largest phase, each phase what is held then and its
temporaries: the loss (``held`` + the loss's transient below) or the last block's backward (``held`` less what the
head's backward released, the head's saved tensors but the embedding's, + the block's backward temporaries: 1-D
:func:`~trickles.memory.transients.block_backward_bytes`; a grid
:func:`~trickles.parallel.tensor.activation_costs.backward_transient_nd`; with recomputation plus the layer it brings
back), and to that phase the transients of any layer (ring blocks, expert rows) and of the engine (buckets, ZeRO-3
blocks).
The loss's transient: the fp32 gradients of the log-probabilities and of the logits (``8sV``, alive together in
the loss's backward; ``4sV/tp`` for the vocabulary-parallel loss, which reuses its saved probabilities; with
``model.fused_loss`` one chunk's logits instead, :func:`~trickles.memory.activations.loss_transient_bytes`); a
layer's, ring attention's key/value blocks and expert parallelism's rows in flight (:mod:`~trickles.memory.in_flight`);
the engine's, buffers (ZeRO-2, and ZeRO-1 without accumulation: two gradient buckets; ZeRO-3: the root and two
gathered blocks).

Tensor parallelism: the plan of ``parallel.tp_mode`` (1-D, or a 2-D/2.5-D/3-D grid) applied to the meta model gives
the parameters a rank holds; a grid's activations and loss transient come from
:mod:`trickles.parallel.tensor.costs`. At ``tp > 1`` the report ends with 1-D (with and without sequence
parallelism), 2-D, 2.5-D and 3-D side by side (:func:`~trickles.memory.tp_modes.compare_tp_modes`).

Mixture-of-experts models: each MoE block's activations have their own formula
(:mod:`~trickles.memory.moe_activations`); with expert parallelism (``parallel.ep``) a rank holds ``E / ep`` experts
of every block (the plan's :func:`~trickles.parallel.expert.apply_expert_parallel` applied to the meta model)
and ZeRO shards the experts over their ``edp`` group, the ``dp x cp / ep`` ranks holding the same experts
(:meth:`~trickles.topology.Topology.expert_group`), and every other weight over all ``dp x cp`` replicas.
What a rank's experts receive depends on the routing:
the prediction is for a balanced load.

Pipeline stages (``parallel.pp > 1``, :mod:`~trickles.memory.stages`): every pipeline rank is predicted -- its
parameters (:func:`~trickles.memory.meta.stage_parameters`), its chunks' activations times the chunk-micro-batches
in flight at its heaviest moment of the schedule's order, the runner's outputs, inputs and message buffers and a
backward's temporaries as transient -- in ``report.stages``; ``report.predicted`` is the stage with the highest
peak (``report.stage``); measuring meters each stage over a whole step. With ``memory.offload_optimizer`` the
optimizer state is host memory (``predicted["host"]``): held and peak count the device.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config
from ..kernels import runs_triton
from ..kernels.cross_entropy import fp32_accumulating_mm, fused_on
from ..models.config import ModelConfig, resolve_model
from ..parallel.pipeline.schedules import SPLIT, Shape, compute_order
from ..parallel.pipeline.stages import partition_layers
from ..parallel.tensor.activation_costs import backward_transient_nd, head_released_nd, loss_transient_nd
from ..parallel.tensor.layout import Layout
from ..topology import ParallelDims
from .activations import loss_transient_bytes
from .in_flight import expert_rows_in_flight, ring_blocks_in_flight
from .latent_activations import latent_notes
from .lora_activations import lora_note
from .measure import measure
from .meta import rank_model, stage_parameters
from .moe_activations import moe_assignments, received_bound
from .notes import describe
from .precision import policy
from .stages import (
    buffers_peak,
    chunk_bytes,
    input_saved,
    message_bytes,
    peak_in_flight,
    recorded_bytes,
    zero3_gathered,
)
from .states import _root_params, engine_state_bytes
from .table import GiB, MemoryReport, _fmt  # noqa: F401 (the report's public names)
from .tp_modes import activations, brought_back, compare_tp_modes, recomputed_in_backward, without_recompute
from .transients import block_backward_bytes, head_backward_bytes, split_end_bytes


def predict(
    cfg: Config,
    dims: ParallelDims,
    model_cfg: ModelConfig,
    device_type: str = "cpu",
    dp_rank: int = 0,
    both_loads: bool = True,
) -> MemoryReport:
    """The memory one device needs for ``cfg`` at ``dims`` (``model_cfg`` fully resolved): the device of
    data-parallel rank ``dp_rank`` (ranks differ by a few bytes under ZeRO >= 1: the segments each owns; with
    context parallelism the rank in the ``dp x cp`` group, :meth:`~trickles.topology.Topology.replicas`; with
    expert parallelism that rank's experts and its place, ``dp_rank // ep``, in its ``edp`` group).

    With pipeline stages (``parallel.pp > 1``) every pipeline rank is predicted (:mod:`~trickles.memory.stages`):
    ``report.stages[r]`` holds rank ``r``'s categories and ``report.predicted`` is the stage with the highest peak.
    With expert parallelism and ``both_loads`` the other expert load's figures too (``report.expert_bound``)."""
    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    rm = rank_model(model_cfg, dims, cfg.parallel.sequence_parallel, dp_rank, prec.param_dtype, cfg.train.lora())
    total_params, active_params, n_rank = rm.total_params, rm.active_params, rm.numel
    p = torch.finfo(prec.param_dtype).bits // 8
    g = torch.finfo(prec.grad_dtype).bits // 8
    offload = cfg.memory.offload_optimizer
    stage = cfg.parallel.zero
    # the weights are replicated over dp x cp ranks: ZeRO shards over all of them (dp_rank counts them); with expert
    # parallelism the experts over edp, the R / ep ranks holding the same experts (Topology.expert_group):
    # replica r is rank r // ep of its edp group
    edp = dims.dp * dims.cp // dims.ep
    accumulates = cfg.accumulates(dims)
    experts = (edp, dp_rank // dims.ep) if dims.ep > 1 else None
    micro, _ = cfg.batch_plan(dims.dp)
    triton = runs_triton(model_cfg.kernels, device_type, "cross_entropy")
    fused = fused_on(model_cfg.fused_loss, model_cfg.kernels, device_type)
    lay = Layout.of(dims.tp_mode, dims.tp, dims.tp_depth, cfg.parallel.sequence_parallel)
    act = activations(cfg, model_cfg, lay, dims, device_type)
    tokens = micro * cfg.data.seq_len // dims.cp  # this rank's tokens of a micro-batch
    # the loss: unfused, its backward's fp32 gradients (a grid: its forward's logits and their shifted copy); fused,
    # one chunk's logits
    loss = (
        loss_transient_nd(model_cfg, lay, micro, cfg.data.seq_len)
        if lay.grid
        else loss_transient_bytes(model_cfg, tokens, p, dims.tp, fused, triton, fp32_accumulating_mm(device_type))
    )
    modes = cfg.recompute_modes(dims)  # per layer, what its recomputation brings back in its backward
    brought = brought_back(modes, act, without_recompute(cfg, model_cfg, lay, dims, device_type, modes))
    recomputed = recomputed_in_backward(brought, act["per_layer"], list(range(model_cfg.n_layers)))
    # a block's backward (trickles.memory.transients), and what the layer recomputation brings back
    mlp_backward = block_backward_bytes(model_cfg, tokens, g, dims.tp) + recomputed
    # the peak is the larger phase: the loss, or the last block's backward, when the head's saved tensors are released
    # (the embedding's stay) and the last block's are all held
    if dims.pp == 1 and lay.grid:
        loss = max(
            loss,
            backward_transient_nd(model_cfg, lay, micro, cfg.data.seq_len, p, device_type)
            + recomputed
            - head_released_nd(model_cfg, lay, micro, cfg.data.seq_len, p),
        )
    elif dims.pp == 1:
        released = act["head"] - embedding_bytes(act, model_cfg, lay, micro, cfg.data.seq_len, device_type)
        loss = max(loss, mlp_backward - released)
    layer_transient = 0  # one layer's at a time
    if dims.cp > 1 and cfg.parallel.cp_mode == "ring":
        layer_transient += ring_blocks_in_flight(model_cfg, tokens, p, dims.tp)
    if dims.ep > 1 and model_cfg.moe_layers:
        routed = tokens // dims.tp if cfg.parallel.sequence_parallel and dims.tp > 1 else tokens
        bound = cfg.memory.expert_load == "bound"
        most = received_bound(model_cfg, micro, routed // micro, cfg.data.seq_len, dims.ep) if bound else 0
        layer_transient += expert_rows_in_flight(model_cfg, micro, routed // micro, cfg.data.seq_len, p, most)

    def states_of(named, key, keep: set[str] | None = None) -> dict:
        memo = (
            rm.key,
            key,
            dims.dp,
            dims.cp,
            dp_rank,
            experts,
            accumulates,
            repr(cfg.parallel),
            repr(cfg.memory),
            cfg.train.optimizer,
            cfg.train.weight_decay,
        )
        if memo not in _STATES:
            _STATES[memo] = engine_state_bytes(
                named, cfg, dims.dp * dims.cp, dp_rank, experts, accumulates, keep, pipelined=dims.pp > 1
            )
            if len(_STATES) > 4096:
                _STATES.pop(next(iter(_STATES)))
        return _STATES[memo]

    def categories(states: dict, activations: int, head: int, transient: int) -> dict:
        device_states = states["parameters"] + states["gradients"] + (0 if offload else states["optimizer"])
        out = {
            "parameters": states["parameters"],
            "gradients": states["gradients"],
            "optimizer": states["optimizer"],
            "activations": activations,
            "head": head,
            "transient": transient,
        }
        out["held"] = device_states + activations + head
        out["peak"] = out["held"] + transient
        out["host"] = states["optimizer"] if offload else 0
        out["checkpoint_host"] = states["checkpoint"] if cfg.train.async_checkpoint else 0
        return out

    notes = [lora_note(cfg, model_cfg, dims)] if cfg.train.lora_rank else []
    notes += latent_notes(model_cfg, device_type)
    if dims.pp == 1:
        states = states_of(rm.module if stage == 3 else rm.named, "all")
        transient = loss + layer_transient
        if stage == 2 or (stage == 1 and not accumulates):  # bucket buffers filling and in flight
            bucket = (cfg.parallel.bucket_mb * 2**20) if cfg.parallel.bucket_mb > 0 else n_rank * g
            transient += 2 * min(bucket, n_rank * g)
        if stage == 3:
            root = _root_params(rm.module)
            transient += p * (root + 2 * (n_rank - root) / model_cfg.n_layers)
        rows = [categories(states, sum(act["per_layer"]), act["head"], transient)]
        layer_ids = [list(range(model_cfg.n_layers))]
    else:
        _, m = cfg.batch_plan(dims.dp)
        shape = Shape.of(cfg.parallel.schedule, dims.pp, cfg.parallel.virtual_stages, m)
        parts = partition_layers(model_cfg.n_layers, shape.stages, cfg.parallel.pipeline_layers)
        msg = message_bytes(
            micro, cfg.data.seq_len, model_cfg.d_model, p, dims.tp, lay.sequence_parallel or lay.grid, dims.cp
        )
        rows, layer_ids, split = [], [], cfg.parallel.schedule in SPLIT  # (a B leaves the weights' gradients to W)
        head_bwd = 0 if split else head_backward_bytes(model_cfg, tokens, p, g, dims.tp, fused)
        norm_end = split_end_bytes(model_cfg, tokens, p, dims.tp, lay.sequence_parallel)
        batch = 16 * micro * m * cfg.data.seq_len  # the step's token ids and labels (int64), on every stage
        for r in range(dims.pp):
            chunks = shape.chunks(parts, r)
            ids = sorted(i for c in chunks for i in c)
            first, last = shape.ends(r)
            named = stage_parameters(rm, set(ids), first, last, model_cfg.tied)
            if stage == 3:  # the units of the stage's blocks and its root (the embedding or the head)
                states = states_of(rm.module, (tuple(ids), first, last), keep={n for n, _ in named})
            else:
                states = states_of(named, (tuple(ids), first, last))
            weights = chunk_bytes(
                act, embedding_bytes(act, model_cfg, lay, micro, cfg.data.seq_len, device_type), parts, shape, r
            )
            lay_b, head_b, _ = peak_in_flight(compute_order(cfg.parallel.schedule, shape, r), weights)
            gathered = (
                zero3_gathered(
                    named, parts, shape, r, act["per_layer"], p, g, dims.dp * dims.cp, clones=device_type != "cuda"
                )
                if stage == 3
                else None
            )
            recorded = (
                [
                    recorded_bytes(
                        model_cfg,
                        len(chunks[c]),
                        tokens,
                        p,
                        dims.tp,
                        lay.sequence_parallel,
                        shape.stage(r, c) == shape.stages - 1,
                        fused,
                    )  # what each chunk's B keeps for W
                    for c in range(shape.v)
                ]
                if split
                else None
            )
            saves = [bool(ch) and input_saved(model_cfg.flavor, p, device_type, modes[ch[0]]) for ch in chunks]
            during = [
                block_backward_bytes(model_cfg, tokens, g, dims.tp, whole=not split)
                + recomputed_in_backward(brought, act["per_layer"], ch)
                for ch in chunks
            ]
            buffers = buffers_peak(
                cfg.parallel.schedule,
                shape,
                r,
                weights,
                msg,
                saves,
                max(loss, head_bwd) if last else 0,
                early_receives=device_type != "cuda",
                backward_transient=during,
                gathered=gathered,
                recorded=recorded,
                split_end=norm_end,
                loss_saved=act["loss"],
            )
            transient = buffers - lay_b - head_b + layer_transient + states["step_gradients"] + batch
            rows.append(categories(states, lay_b, head_b, transient))
            layer_ids.append(ids)
        notes.append(
            f"pp={dims.pp} {cfg.parallel.schedule}"
            + (f" x {shape.v} chunks" if shape.v > 1 else "")
            + f", {m} micro-batches of {msg:,} B per message: each stage holds its layers' saved activations "
            "times the micro-batches in flight at its peak (the schedule's order), and the stage outputs, "
            "inputs and receive buffers the runner keeps (transient)"
        )
        if stage == 3:
            notes.append(
                "ZeRO-3 under pipeline stages: the units gathered and the reductions in flight while a stage runs "
                "are estimated (trickles.memory.stages.zero3_gathered), so the peak is an estimate: use --measure"
            )
        if split:
            notes.append(
                f"{cfg.parallel.schedule}: a chunk's activations are held from its F to its W, and so are the "
                "gradients B records for W (one per linear and norm, trickles.memory.stages.recorded_bytes)"
            )
    top = max(range(len(rows)), key=lambda r: rows[r]["peak"])
    per_layer = act["per_layer"]
    report = MemoryReport(
        dict(rows[top]),
        [per_layer[i] for i in layer_ids[top]],
        host_optimizer=offload,
        moe_layers=list(model_cfg.moe_layers),
        stages=rows,
        stage_layers=layer_ids,
        stage=top,
        stage_ends=[shape.ends(r) for r in range(dims.pp)] if dims.pp > 1 else [],
    )
    n = (
        n_rank
        if dims.pp == 1
        else sum(prm.numel() for _, prm in stage_parameters(rm, set(layer_ids[top]), *shape.ends(top), model_cfg.tied))
    )
    if dims.ep > 1 and model_cfg.moe_layers and both_loads:
        report.expert_bound = _both_loads(report, cfg, dims, model_cfg, device_type, dp_rank, micro, routed, notes)
    describe(report, cfg, dims, model_cfg, lay, n, total_params, active_params, fused, notes)
    return report


def _both_loads(report, cfg, dims, model_cfg, device_type, dp_rank, micro, routed, notes) -> dict:
    """Expert parallelism: the prediction at the other load of ``memory.expert_load`` (balanced, or as many rows as
    the router can send a rank's experts), so the report gives both: ``{"balanced", "received"}`` rows a block on a
    rank's experts and the ``activations`` and ``peak`` at the bound; a note says both."""
    seq, bound = cfg.data.seq_len, cfg.memory.expert_load == "bound"
    load = "balanced" if bound else "bound"
    other = predict(
        dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, expert_load=load)),
        dims,
        model_cfg,
        device_type,
        dp_rank,
        both_loads=False,
    ).predicted
    at_bound = report.predicted if bound else other
    out = {
        "balanced": moe_assignments(model_cfg, micro, routed // micro, seq),
        "received": received_bound(model_cfg, micro, routed // micro, seq, dims.ep),
        "activations": at_bound["activations"],
        "peak": at_bound["peak"],
    }
    most = f"{out['received']:,} rows a block (every token's experts on the rank as far as it holds them)"
    even = f"{out['balanced']:,} rows a block"
    notes.append(
        f"expert parallelism: the figures assume the most the router can send a rank's experts, {most}; at a balanced "
        f"load, {even}: activations {_fmt(other['activations'])}, peak {_fmt(other['peak'])} (memory.expert_load)"
        if bound
        else f"expert parallelism: the figures assume a balanced load on a rank's experts, {even}; the router can "
        f"send up to {most}: activations {_fmt(other['activations'])}, peak {_fmt(other['peak'])} "
        "(memory.expert_load=bound, what trickles plan assumes unless the config sets it)"
    )
    return out


_STATES: dict = {}


def embedding_bytes(act: dict, model_cfg: ModelConfig, lay: Layout, micro: int, seq: int, device_type: str) -> int:
    """The part of ``act["head"]`` the embedding keeps (a pipeline's first stage): the token ids (the
    vocabulary-parallel embedding's shifted ids and out-of-range mask), gpt2's position ids, the dropout mask."""
    return act.get("embedding", 8 * micro * seq + (0 if model_cfg.flavor == "llama" else 8 * seq))


def report_for(cfg: Config, world_size: int, measure_steps: int = 0, quiet: bool = False) -> MemoryReport:
    """Predicts (and, with ``measure_steps > 0``, measures) memory for ``cfg`` on ``world_size`` ranks.

    Measuring needs the processes of the layout (run it under ``trickles memory --nproc N`` or
    torchrun); predicting needs none.
    """
    from ..data import build_tokenizer
    from ..data.sources import iter_documents

    dims = cfg.validate(world_size)
    vocab = cfg.model.vocab_size or build_tokenizer(cfg.data, documents=lambda: iter_documents(cfg.data)).vocab_size
    model_cfg = resolve_model(cfg.model, vocab, cfg.data.seq_len)
    device_type = "cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu"
    report = predict(cfg, dims, model_cfg, device_type)
    if dims.tp > 1 and dims.cp == 1 and not model_cfg.moe_experts:  # (grids take neither)
        report.tp_modes = compare_tp_modes(cfg, dims, model_cfg, device_type).table()
    if measure_steps > 0:
        from ..topology import distributed_session
        from ..train.trainer import Trainer

        with distributed_session(dims, cfg.train.device, cfg.parallel.timeout_s) as topo:
            trainer = Trainer(cfg, topo, quiet=True)
            measure(trainer, report, measure_steps)
            del trainer
    return report


def run_report(cfg: Config, measure_steps: int, png: str | None, device_gb: float | None, world_size: int) -> None:
    """``trickles memory`` in one process (every rank of a measuring job runs it; rank 0 prints and draws)."""
    import os

    report = report_for(cfg, world_size, measure_steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if png and report.plot(png):
        report.notes.append(f"bar chart: {png}")
    print(report.table(device_gb))
