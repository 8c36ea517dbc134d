"""A cheap lower bound of the memory report's peak per device, for pruning layouts before the full report.

The formula is in :mod:`trickles.planner.search`'s docstring ("Pruning by memory").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import Config
from ..memory.transients import block_backward_bytes
from ..models.config import ModelConfig
from ..parallel.pipeline.schedules import SPLIT, Shape, compute_order, peak_alive
from ..topology import ParallelDims
from .rank_plan import element_bytes


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """Micro-batch chunks whose activations pipeline rank ``rank`` holds at once (module docstring); 1 without a
    pipeline. The zero-bubble schedules hold a chunk from its F to its W, read off the schedule's order (at most
    ``p v``)."""
    if p == 1:
        return 1
    if schedule in SPLIT:
        return peak_alive(compute_order(schedule, Shape.of(schedule, p, v, m), rank))
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)


@dataclass
class Bound:
    """:func:`memory_bound`'s result: bytes per device (the most-loaded pipeline rank) and host bytes per node."""

    device: float
    host: float
    stages: list[float]


def _activation_key(cfg: Config, dims: ParallelDims, device_type: str) -> tuple:
    """What one micro-batch's saved activations depend on, for a layout of the search (the model is the search's)."""
    micro, _ = cfg.batch_plan(dims.dp)
    mem, par = cfg.memory, cfg.parallel
    partial = (
        (
            mem.recompute_num_layers,
            mem.recompute_rest,
            dims.pp,
            par.schedule,
            par.virtual_stages,
            tuple(par.pipeline_layers),
        )
        if mem.recompute_num_layers
        else ()
    )  # which layers are recomputed whole
    return (
        micro,
        mem.recompute,
        mem.precision,
        mem.grad_dtype,
        dims.tp,
        dims.tp_mode,
        dims.tp_depth,
        par.sequence_parallel,
        dims.cp,
        par.cp_mode,
        dims.ep,
        device_type,
        partial,
    )


def memory_bound(
    cfg: Config, dims: ParallelDims, mc: ModelConfig, device_type: str, ranks_per_node: int, cache: dict | None = None
) -> Bound:
    """A lower bound of the memory report's peak per device, and the host bytes per node (the offloaded optimizer, an
    asynchronous save's copies)
    (module docstring)."""
    from ..kernels import runs_triton
    from ..kernels.cross_entropy import fp32_accumulating_mm, fused_on
    from ..memory.activations import loss_transient_bytes
    from ..memory.in_flight import expert_rows_in_flight, ring_blocks_in_flight
    from ..memory.lora_activations import lora_states
    from ..memory.report import embedding_bytes
    from ..memory.tp_modes import activations, brought_back, recomputed_in_backward
    from ..optim.settings import OptimizerSettings
    from ..parallel.pipeline.stages import partition_layers
    from ..parallel.tensor.activation_costs import backward_transient_nd, head_released_nd, loss_transient_nd
    from ..parallel.tensor.layout import Layout as TPLayout
    from .compute import rank_params

    par, mem = cfg.parallel, cfg.memory
    p, g = element_bytes(cfg)
    lora = cfg.train.lora()  # LoRA: the adapters' gradients and optimizer state only (memory.lora_activations)
    offload = mem.offload_optimizer
    settings = OptimizerSettings.from_train(cfg.train)
    k = 4 * len(settings.state_keys) + (4 if p != 4 or offload else 0) + (4 if g != 4 or offload else 0)
    micro, m = cfg.batch_plan(dims.dp)
    replicas, zero = dims.dp * dims.cp, par.zero
    edp = replicas // dims.ep
    sharded_grads = zero >= 2 or (zero == 1 and not cfg.accumulates(dims))
    sp = par.sequence_parallel and dims.tp > 1
    key = _activation_key(cfg, dims, device_type)
    act = cache.get(key) if cache is not None else None
    if act is None:
        act = activations(
            cfg, mc, TPLayout.of(dims.tp_mode, dims.tp, dims.tp_depth, par.sequence_parallel), dims, device_type
        )
        if cache is not None:
            cache[key] = act
    per_layer = act["per_layer"]
    v = par.virtual_stages if dims.pp > 1 else 1
    parts = partition_layers(mc.n_layers, dims.pp * v, par.pipeline_layers or None)
    lay = TPLayout.of(dims.tp_mode, dims.tp, dims.tp_depth, par.sequence_parallel)
    tokens = micro * cfg.data.seq_len // dims.cp
    loss = (
        loss_transient_nd(mc, lay, micro, cfg.data.seq_len)
        if lay.grid
        else loss_transient_bytes(
            mc,
            tokens,
            p,
            dims.tp,
            fused_on(mc.fused_loss, mc.kernels, device_type),
            runs_triton(mc.kernels, device_type, "cross_entropy"),
            fp32_accumulating_mm(device_type),
        )
    )
    if dims.pp == 1:  # the report's other phase: the last block's backward, the head's saved tensors released
        modes, plain = cfg.recompute_modes(dims), None  # what each layer's recomputation brings back, as the report
        if any(m in ("full", "selective") for m in modes.values()):
            plain_cfg = dataclasses.replace(cfg, memory=mem.uniform("none"))
            plain_key = _activation_key(plain_cfg, dims, device_type)
            plain = cache.get(plain_key) if cache is not None else None
            if plain is None:
                plain = activations(plain_cfg, mc, lay, dims, device_type)
                if cache is not None:
                    cache[plain_key] = plain
            plain = plain["per_layer"]
        recomputed = recomputed_in_backward(brought_back(modes, act, plain), per_layer, list(range(mc.n_layers)))
        if lay.grid:
            backward = (
                backward_transient_nd(mc, lay, micro, cfg.data.seq_len, p, device_type)
                + recomputed
                - head_released_nd(mc, lay, micro, cfg.data.seq_len, p)
            )
        else:
            backward = (
                block_backward_bytes(mc, tokens, g, dims.tp)
                + recomputed
                - (act["head"] - embedding_bytes(act, mc, lay, micro, cfg.data.seq_len, device_type))
            )
        loss = max(loss, backward)
    in_layer = 0  # the memory report's transients of one layer at a time: ring blocks, expert rows
    if dims.cp > 1 and par.cp_mode == "ring":
        in_layer += ring_blocks_in_flight(mc, tokens, p, dims.tp)
    if dims.ep > 1 and mc.moe_layers:
        routed = tokens // dims.tp if sp else tokens
        in_layer += expert_rows_in_flight(mc, micro, routed // micro, cfg.data.seq_len, p)

    def buffers(n: int, first: bool, last: bool) -> float:
        """ZeRO's transients on ``n`` parameters: two gradient buckets (stage 2, and 1 without accumulation), or
        the root and two gathered blocks (stage 3; on a pipeline stage the root); stage 2 on a pipeline stage: the
        step's whole gradient buffer."""
        if zero == 2 and dims.pp > 1:
            return in_layer + n * g
        if sharded_grads and zero < 3:
            bucket = par.bucket_mb * 2**20 if par.bucket_mb > 0 else n * g
            return in_layer + 2 * min(bucket, n * g)
        if zero == 3:  # (a pipeline stage's loss phase holds the root alone: memory.stages.zero3_gathered)
            root = sum(rank_params(mc, dims, [], first, last))
            return in_layer + p * (root + (2 * (n - root) / mc.n_layers if dims.pp == 1 else 0))
        return in_layer

    shape = Shape.of(par.schedule if dims.pp > 1 else "1f1b", dims.pp, v, m)
    params_key = (
        "params",
        dims.tp,
        dims.tp_mode,
        dims.tp_depth,
        dims.ep,
        dims.pp,
        v,
        shape.vee,
        tuple(par.pipeline_layers),
    )
    params = cache.get(params_key) if cache is not None else None
    if params is None:
        params = [
            rank_params(mc, dims, [i for c in shape.chunks(parts, r) for i in c], *shape.ends(r))
            for r in range(dims.pp)
        ]
        if cache is not None:
            cache[params_key] = params
    stages, host = [], 0.0
    for r in range(dims.pp):
        chunks = shape.chunks(parts, r)
        first, last = shape.ends(r)
        dense, experts = params[r]
        owned = dense / replicas + experts / edp
        whole = dense + experts
        states = p * (owned if zero == 3 else whole) + g * (owned if sharded_grads else whole)
        optimizer = k * (owned if zero >= 1 else whole)
        trained = owned if zero >= 1 else whole  # what the rank keeps optimizer state for
        if lora is not None:  # the base frozen (an int8 base in its codes and scales), only the adapters train
            a, codes, scales = lora_states(mc, lora, [i for c in chunks for i in c], last, dims.tp)
            frozen = p * owned if zero == 3 else p * (whole - codes) + codes + 4 * scales
            states = frozen + p * (a / replicas if zero == 3 else a) + g * (a / replicas if sharded_grads else a)
            trained = a / replicas if zero >= 1 else a
            optimizer = k * trained
        alive = in_flight(par.schedule, dims.pp, v, m, r)
        chunk_bytes = [sum(per_layer[i] for i in c) for c in chunks]
        held = alive * (chunk_bytes[0] if v == 1 else min(chunk_bytes))
        if last:  # (the first layer's entry includes what it keeps once for all, e.g. the rotary tables; the
            # embedding's part of the head is the first stage's)
            held += (
                act["head"]
                - (0 if first else embedding_bytes(act, mc, lay, micro, cfg.data.seq_len, device_type))
                + loss
            )
        stages.append(states + (0 if offload else optimizer) + held + buffers(whole, first, last))
        # the host copies of an asynchronous save: at least the optimizer state each rank writes (its moments)
        save = 4 * len(settings.state_keys) * trained if cfg.train.async_checkpoint else 0.0
        host = max(host, (optimizer if offload else 0.0) * ranks_per_node + save * ranks_per_node)
    return Bound(max(stages), host, stages)
