"""``parallelize``: turn a single-device model into the configured parallel training setup.

The model arrives built on the meta device (no memory), as single-device code. In order:

1. activation recomputation wraps its blocks or attention cores (``memory.recompute``);
2. context parallelism makes attention span the ``cp`` ranks' parts of each sequence and looks
   positions up globally (``parallel.cp``, ``parallel.cp_mode``; :mod:`trickles.parallel.context`);
   tensor parallelism swaps its modules for column/row-parallel ones over the ``tp`` group
   (``parallel.tp``, ``parallel.sequence_parallel``; :mod:`trickles.parallel.tensor.plan`), or with
   ``parallel.tp_mode`` 2d, 2.5d or 3d for a grid's (:mod:`trickles.parallel.tensor.grid_plan`);
   expert parallelism keeps this rank's experts of every mixture-of-experts block and sends their tokens
   over the ``ep`` group (``parallel.ep``; :mod:`trickles.parallel.expert`);
   pipeline parallelism prunes it to this rank's stage (``parallel.pp``; :mod:`trickles.parallel.pipeline.stages`),
   and a :class:`~trickles.parallel.pipeline.runner.PipelineRunner` (``engine.pipeline``) drives its steps;
3. the data-parallel engine over the ``dp`` group (``dp x cp`` with context parallelism: the cp
   ranks hold the same weights, see :meth:`~trickles.topology.Topology.replicas`; with expert parallelism the
   experts over their ``edp`` group): for ZeRO stages 0-2 the rank allocates its
   (tensor-parallel) parameters, initializes them and casts them to the precision policy's type,
   then :class:`~trickles.parallel.data.ddp.DataParallel` (stage 0) or
   :class:`~trickles.parallel.data.zero.ZeroDataParallel` (stages 1, 2) wraps them; for stage 3 each
   block and the root become :class:`~trickles.parallel.data.zero3.Zero3DataParallel` units and the
   rank computes and keeps only its shard of every parameter.

Initialization is layout-independent: each parameter's full value comes from
:func:`~trickles.models.transformer.initial_value` (seed and name) and a rank keeps its block.
"""

from __future__ import annotations

import torch

from ..adapters.int8_base import Int8Values, is_int8_base
from ..adapters.lora import adapter_initial_value, freeze_base, is_adapter
from ..adapters.tensor import adapted_modules, apply_lora_tensor_parallel
from ..config import Config
from ..memory.precision import autocast, policy
from ..memory.recompute import apply_recompute
from ..models.transformer import Transformer, initial_value, param_seed
from ..optim.settings import OptimizerSettings
from ..topology import Topology
from ..train.pieces import global_shape
from .context import apply_context_parallel
from .data.ddp import DataParallel
from .data.zero import ZeroDataParallel
from .data.zero3 import Zero3DataParallel
from .engine import Engine
from .expert import apply_expert_parallel, expert_modules
from .pipeline.runner import PipelineRunner
from .pipeline.schedules import Shape
from .pipeline.stages import keep_stage, partition_layers, reused_parameters, tied_parameters
from .reduction import bucket_bytes
from .sequence import shard_sequence
from .tensor.grid_plan import apply_tensor_nd, grid_context
from .tensor.layers import init_tp_param
from .tensor.plan import apply_tensor_parallel, tp_full_logits


def parallelize(model: Transformer, topo: Topology, cfg: Config, seed: int, init=None) -> Engine:
    """The engine that trains ``model`` (built on the meta device) on ``topo`` as ``cfg`` says.

    ``init(name, param)``: the full starting value of a parameter (default: :func:`initial_value` from ``seed``;
    ``train.init_from`` reads it from a checkpoint); LoRA adapters (:mod:`trickles.adapters`) start at their own
    values."""
    comm, tp, cp, ep = topo.replicas(), topo.comm("tp"), topo.comm("cp"), topo.comm("ep")
    experts = {"ep": ep, "edp": topo.expert_group()} if ep.size > 1 else {}
    stage = cfg.parallel.zero
    optim = OptimizerSettings.from_train(cfg.train)
    offload = cfg.memory.offload_optimizer
    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    modes = cfg.recompute_modes(topo.dims)
    apply_recompute(model, modes)
    cp_ctx = apply_context_parallel(model, cp, cfg.parallel.cp_mode) if cp.size > 1 else None
    if ep.size > 1:
        apply_expert_parallel(model, ep)
    ctx = None
    if tp.size > 1 and topo.dims.grid.mode != "1d":
        ctx = apply_tensor_nd(model, grid_context(topo))
    elif tp.size > 1:
        adapted = adapted_modules(model)  # LoRA adapters, put back split on the parallel layers that replace them
        ctx = apply_tensor_parallel(
            model, tp, cfg.parallel.sequence_parallel, recomputed_blocks={i for i, m in modes.items() if m == "full"}
        )
        apply_lora_tensor_parallel(model, adapted, tp.size)
    if any(
        is_adapter(n) for n, _ in model.named_parameters()
    ):  # LoRA: the plans' new parameters (a split embedding, say) are base ones: frozen too
        freeze_base(model)
    pp = topo.comm("pp")
    chunks = None
    if pp.size > 1:
        _, micro_batches = cfg.batch_plan(topo.dims.dp)
        shape = Shape.of(cfg.parallel.schedule, pp.size, cfg.parallel.virtual_stages, micro_batches)
        parts = partition_layers(model.cfg.n_layers, shape.stages, cfg.parallel.pipeline_layers)
        chunks = keep_stage(model, pp.rank, shape, parts)

    def float_value(name: str, param: torch.nn.Parameter) -> torch.Tensor:
        return init(name, param) if init is not None else initial_value(model.cfg, name, global_shape(param), seed)

    int8_value = Int8Values(model, float_value)  # train.lora_base=int8: codes and scales of the float value

    def init_value(name: str, param: torch.nn.Parameter) -> torch.Tensor:
        if is_adapter(name):  # a LoRA adapter starts at its own value (A random, B zero), whatever init says
            full = adapter_initial_value(name, global_shape(param), seed, param_seed)
        elif is_int8_base(name, param):
            full = int8_value(name, param)
        else:
            full = float_value(name, param)
        return init_tp_param(full, param)

    if stage == 3:
        engine: Engine = Zero3DataParallel(
            model,
            comm,
            list(model.layers.values()),
            optim,
            init_value,
            topo.device,
            offload=offload,
            prefetch=cfg.parallel.prefetch,
            param_dtype=prec.param_dtype,
            grad_dtype=prec.grad_dtype,
            tp=tp,
            expert_units=expert_modules(model),
            **experts,
        )
    else:
        specs = {n: p.tp_spec for n, p in model.named_parameters() if hasattr(p, "tp_spec")}
        model.to_empty(device=topo.device)  # new Parameter objects: carry the tensor-parallel specs over
        for n, p in model.named_parameters():
            if n in specs:
                p.tp_spec = specs[n]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init_value(name, p))
                if prec.low and not is_int8_base(name, p):
                    p.data = p.data.to(prec.param_dtype)
        model.reset_buffers()
        buckets = bucket_bytes(cfg.parallel.bucket_mb)
        if stage == 0:
            engine = DataParallel(model, comm, optim, buckets, grad_dtype=prec.grad_dtype, tp=tp, **experts)
        else:
            engine = ZeroDataParallel(
                model,
                comm,
                stage,
                optim,
                buckets,
                offload,
                grad_dtype=prec.grad_dtype,
                tp=tp,
                overlap=cfg.memory.offload_overlap,
                accumulates=cfg.accumulates(topo.dims),
                pipelined=chunks is not None,
                **experts,
            )
    if ctx is not None and topo.dims.grid.mode == "1d":
        engine.full_logits = tp_full_logits(ctx)
    if cp_ctx is not None:
        engine.shard_sequence = lambda tokens: shard_sequence(tokens, cp.size, cp.rank, cfg.parallel.cp_mode)
    if chunks is not None:
        engine.stages = pp
        tied = tied_parameters(model, pp.rank, shape)
        if tied:
            engine.tie_across_stages(tied, topo.comm("pp_ends"), counted=pp.rank == 0)
        engine.reduce_after_backward(reused_parameters(model, pp.rank, shape))
        engine.pipeline = PipelineRunner(
            engine,
            chunks,
            pp,
            topo.comm("pp_grad"),
            cfg.parallel.schedule,
            shape.m,
            model.cfg.d_model,
            prec.param_dtype,
            topo.device,
            lambda: autocast(cfg.memory.precision, topo.device),
            ctx,
            cp_ctx,
        )
    return engine
