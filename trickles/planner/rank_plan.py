"""What one pipeline rank of a layout holds and does in a step: :class:`RankPlan`, one per pipeline rank from
:func:`rank_plans` -- its layers, micro-batches, parameters and data-parallel buckets. The traffic terms
(:mod:`trickles.planner.traffic`) and the step-time model (:mod:`trickles.planner.cost`) both read it.

A LoRA run (``train.lora_rank > 0``) trains its adapters only (:func:`~trickles.planner.compute_lora.adapter_elements`):
the data-parallel buckets hold them alone (DDP and ZeRO-1/2 reduce, and ZeRO-1/2 gather after the step, only trainable
parameters), and ZeRO-3's units are each a trainable part (the block's adapters; reduce-scattered and gathered) and a
frozen part (its base; gathered for forward and again for backward, never reduced): ``frozen_buckets``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from ..models.config import ModelConfig
from ..parallel.pipeline.schedules import Shape
from ..topology import ParallelDims
from .compute import block_params, rank_params
from .compute_lora import adapter_elements


@dataclass
class RankPlan:
    """What one pipeline rank of a layout holds and does in a step (inputs to the traffic terms and the model)."""

    cfg: Config
    dims: ParallelDims
    model_cfg: ModelConfig
    rank: int  # pipeline rank
    shape: Shape
    micro: int  # sequences per micro-batch
    micro_batches: int  # m
    seq: int
    tokens: int  # B T / cp: tokens of a micro-batch on this rank
    p: int
    g: int
    sp: bool
    chunks: list[list[int]]  # the layers of each of the rank's chunks
    first: bool  # holds the embedding
    last: bool  # holds the final norm, output layer and loss
    dense_params: int
    expert_params: int
    moe_elements: int  # expert (and router) elements of its MoE blocks
    buckets: list[int] = field(default_factory=list)  # data-parallel bucket elements (ZeRO-3: units)
    expert_buckets: list[int] = field(default_factory=list)
    trained_params: int | None = None  # LoRA: the adapter elements the rank holds (None: every parameter trains)
    frozen_buckets: list[int] = field(default_factory=list)  # LoRA under ZeRO-3: the units' frozen parts
    frozen_expert_buckets: list[int] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return [i for c in self.chunks for i in c]

    @property
    def recompute(self) -> dict[int, str]:
        """Each of its layers' recomputation (``memory.recompute_num_layers`` counts this rank's layers)."""
        return self.cfg.memory.layer_modes([self.layers])

    @property
    def message_bytes(self) -> int:
        """One pipeline message: the stage output ``[B, T/cp, d]``, split by ``tp`` under sequence parallelism or
        on a grid."""
        split = self.dims.tp if self.sp or self.dims.grid.mode != "1d" else 1
        return self.tokens * self.model_cfg.d_model * self.p // split


def element_bytes(cfg: Config) -> tuple[int, int]:
    """``(p, g)``: bytes of a parameter (the compute type) and of a gradient element."""
    p = 4 if cfg.memory.precision == "fp32" else 2
    return p, (4 if cfg.memory.grad_dtype == "fp32" else p)


def _buckets(elements: int, element_bytes: int, bucket_mb: float) -> list[int]:
    """The data-parallel engine's buckets over ``elements`` parameters of ``element_bytes`` each
    (:class:`~trickles.parallel.data.flat.FlatLayout`): the first at most 1 MiB (DDP's), then ``bucket_mb`` each (0: one
    bucket); the layout's padding and its cutting at whole parameters are left out."""
    from ..parallel.reduction import FIRST_BUCKET_BYTES

    if elements <= 0:
        return []
    if bucket_mb <= 0:
        return [elements]
    cap = int(bucket_mb * 2**20)
    first = min(elements, max(1, min(cap, FIRST_BUCKET_BYTES) // element_bytes))
    size = max(1, cap // element_bytes)
    rest = elements - first
    return [first] + [size] * (rest // size) + ([rest % size] if rest % size else [])


def rank_plans(cfg: Config, dims: ParallelDims, model_cfg: ModelConfig) -> list[RankPlan]:
    """One :class:`RankPlan` per pipeline rank (ranks of other dimensions do the same work)."""
    from ..parallel.pipeline.stages import partition_layers

    par = cfg.parallel
    micro, m = cfg.batch_plan(dims.dp)
    seq = cfg.data.seq_len
    p, g = element_bytes(cfg)
    sp = par.sequence_parallel and dims.tp > 1 and dims.grid.mode == "1d"
    v = par.virtual_stages if dims.pp > 1 else 1
    shape = Shape.of(par.schedule if dims.pp > 1 else "1f1b", dims.pp, v, m)
    parts = partition_layers(model_cfg.n_layers, dims.pp * v, par.pipeline_layers or None)
    moe = set(model_cfg.moe_layers)
    plans = []
    for r in range(dims.pp):
        chunks = shape.chunks(parts, r)
        first, last = shape.ends(r)
        layers = [i for c in chunks for i in c]
        dense, experts = rank_params(model_cfg, dims, layers, first, last)
        moe_elements = sum(
            block_params(model_cfg, True)[2] // dims.ep + model_cfg.d_model * model_cfg.moe_experts
            for i in layers
            if i in moe
        )
        plan = RankPlan(
            cfg,
            dims,
            model_cfg,
            r,
            shape,
            micro,
            m,
            seq,
            micro * seq // dims.cp,
            p,
            g,
            sp,
            chunks,
            first,
            last,
            dense,
            experts,
            moe_elements,
        )
        own_experts = dims.ep > 1
        lora = cfg.train.lora()
        if lora is not None:
            plan.trained_params = adapter_elements(model_cfg, lora, layers, last, dims.tp)
        if par.zero == 3:  # a unit per block (experts their own under expert parallelism) and the root
            units = [(rank_params(model_cfg, dims, [i], False, False), [i], False) for i in layers]
            units.append(((rank_params(model_cfg, dims, [], first, last)[0], 0), [], last))
            for (d_i, e_i), unit_layers, head in units:
                dense_i = d_i + (0 if own_experts else e_i)
                if lora is None:
                    plan.buckets += [dense_i] if dense_i or unit_layers else []
                    plan.expert_buckets += [e_i] if own_experts and e_i else []
                    continue
                trained = adapter_elements(model_cfg, lora, unit_layers, head, dims.tp)
                plan.buckets += [trained] if trained else []
                plan.frozen_buckets += [dense_i] if dense_i else []
                plan.frozen_expert_buckets += [e_i] if own_experts and e_i else []
        elif lora is not None:
            plan.buckets = _buckets(plan.trained_params, p, par.bucket_mb)
        else:
            plan.buckets = _buckets(dense + (0 if own_experts else experts), p, par.bucket_mb)
            plan.expert_buckets = _buckets(experts, p, par.bucket_mb) if own_experts else []
        plans.append(plan)
    return plans
