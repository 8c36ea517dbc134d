"""Model states one data-parallel rank holds between steps, counted on the engine's own flat layout."""

from __future__ import annotations

import torch

from ..config import Config
from .precision import policy


def engine_state_bytes(
    meta,
    cfg: Config,
    dp: int,
    dp_rank: int = 0,
    experts: tuple[int, int] | None = None,
    accumulates: bool = True,
    keep: set[str] | None = None,
    pipelined: bool = False,
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that data-parallel rank ``dp_rank`` holds between steps.

    ``meta`` is the (tensor-parallel) model on the meta device, in the parameters' type, or (ZeRO 0-2) its unique
    ``(name, parameter)`` pairs in the model's order (a pipeline stage's,
    :func:`~trickles.memory.meta.stage_parameters`); under ZeRO-3 a pipeline stage's are the model's parameters named in
    ``keep``. These are the ZeRO formulas (:func:`~trickles.memory.accounting.zero_model_state_bytes`) with ``p``, ``g``
    bytes per parameter and gradient and ``k`` of optimizer state (Adam's or LAMB's moments 8, LARS's or SGD's momentum
    4, plain SGD 0; fp32 master weights apart from low-precision or offloaded parameters 4; an fp32 copy of
    low-precision or offloaded gradients 4), counted on the engine's real layout: flat buffers padded per bucket to a
    multiple of ``16 dp`` elements (:class:`~trickles.parallel.data.flat.FlatLayout`; under ZeRO-3 one bucket per block
    and one for the root), and (AdamW, LAMB) a 4-byte step counter per owned parameter segment. ``experts``: with expert
    parallelism, the size of the experts' ``edp`` group and the rank's place in it (the experts then form buckets of
    their own, under ZeRO-3 a unit per block, sharded over it). ``accumulates``: a step adds up several micro-batches'
    gradients (stage 1 then keeps the full gradient buffer; otherwise it holds its shard, as stage 2 does).
    ``pipelined``: the model is a pipeline stage, where stage 2 accumulates the step's gradients in a full buffer that
    exists during the step only (:mod:`~trickles.parallel.data.zero`): its bytes are ``"step_gradients"`` (0 otherwise).
    ``"checkpoint"``: the bytes the rank writes into a checkpoint, which an asynchronous save holds on the host while it
    writes (:mod:`~trickles.train.saver`).
    """
    from ..optim.settings import OptimizerSettings
    from ..parallel.data.flat import FlatLayout
    from ..parallel.engine import _spec, unique_named_parameters
    from ..parallel.reduction import FIRST_BUCKET_BYTES, bucket_bytes

    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    p = torch.finfo(prec.param_dtype).bits // 8
    g = torch.finfo(prec.grad_dtype).bits // 8
    offload = cfg.memory.offload_optimizer
    settings = OptimizerSettings.from_train(cfg.train)
    k = 4 * len(settings.state_keys) + (4 if prec.low or offload else 0) + (4 if g != 4 or offload else 0)
    stage = cfg.parallel.zero
    worlds, ranks = ([dp], [dp_rank]) if experts is None else ([dp, experts[0]], [dp_rank, experts[1]])
    if stage == 3:
        from ..parallel.data.zero3_units import owned_parameters as _owned
        from ..parallel.data.zero3_units import split_parts
        from ..parallel.expert import expert_modules

        names = {id(m): name for name, m in meta.named_modules()}
        expert_units = expert_modules(meta) if experts is not None else []
        units = [*meta.layers.values(), *expert_units, meta]
        unit_ids = {id(m) for m in units}
        # each unit's trainable part and (a LoRA run's base) frozen part, both sharded: the frozen one has no gradient
        # shard and no optimizer state (trickles.parallel.data.zero3_units)
        layouts, frozen_layouts = [], []
        for m in units:
            named = _owned(m, names[id(m)], unit_ids - {id(m)})[0]
            if keep is not None:  # a pipeline stage: its blocks' units, and the root with what the stage holds of it
                named = [(n, prm) for n, prm in named if n in keep]
                if not named and m is not meta:
                    continue
            gi = 1 if any(m is e for e in expert_units) else 0
            trainable, frozen = split_parts(named)
            if trainable is not None:
                layouts.append((FlatLayout(trainable, worlds[gi], None), gi))
            if frozen is not None:
                frozen_layouts.append((FlatLayout(frozen, worlds[gi], None), gi))
        shard = sum(lay.shard_numel for lay, _ in layouts)
        params, grads = p * (shard + sum(lay.shard_numel for lay, _ in frozen_layouts)), g * shard
        segments = [seg for lay, gi in layouts for seg in lay.segments(ranks[gi])]
        frozen_owned = sum(seg.numel for lay, gi in frozen_layouts for seg in lay.segments(ranks[gi]))
    else:
        named = meta if isinstance(meta, list) else unique_named_parameters(meta)
        # frozen parameters (a LoRA run's base) stay whole on each rank, outside the flat buffers: no gradient, no
        # optimizer state; the first rank of the replicas writes them into checkpoints
        # (in their own types: an int8 base's codes and fp32 scales, train.lora_base=int8)
        frozen = sum(prm.numel() * prm.element_size() for _, prm in named if not prm.requires_grad)
        named = [(n, prm) for n, prm in named if prm.requires_grad]
        layout = FlatLayout(
            named,
            worlds,
            bucket_bytes(cfg.parallel.bucket_mb),
            first_bucket_bytes=FIRST_BUCKET_BYTES,
            group_of=lambda t: int(experts is not None and _spec(t, "ep_sharded")),
        )
        # ZeRO-1/2: parameters are views of a padded flat buffer
        params = p * (layout.numel if stage == 0 else layout.total) + frozen
        sharded = stage == 2 or (stage == 1 and not accumulates)  # stage 1 reduces like stage 2 unless it accumulates
        grads = g * (layout.shard_numel if sharded else layout.total)
        segments = layout.whole_segments() if stage == 0 else layout.segments(ranks)
    optimizer = k * sum(s.numel for s in segments) + (4 * len(segments) if settings.counts_steps else 0)
    step = g * layout.total if stage == 2 and pipelined else 0
    # what the rank writes into a checkpoint (an asynchronous save's host copy, Engine.checkpoint_files): its shards
    # under ZeRO-3, else the parameters if it is the first rank of their group; the optimizer state of what it owns
    # (all of it on the first rank without ZeRO) -- moments, a 4-byte step per segment, fp32 masters in low precision
    owned = sum(s.numel for s in segments)
    if stage == 3:
        written = p * (owned + frozen_owned)
    else:
        written = p * sum(s.numel for s in layout.slots if ranks[layout.buckets[s.bucket].group] == 0)
        written += frozen if ranks[0] == 0 else 0
        if stage == 0 and dp_rank != 0:
            owned, segments = 0, []
    state = (
        4 * len(settings.state_keys) * owned
        + (4 * len(segments) if settings.counts_steps else 0)
        + (4 * owned if prec.low else 0)
    )
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optimizer,
        "step_gradients": step,
        "checkpoint": written + state,
    }


def _root_params(model) -> int:
    layer_ids = {id(p) for blk in model.layers.values() for p in blk.parameters()}
    seen, total = set(), 0
    for prm in model.parameters():
        if id(prm) not in layer_ids and id(prm) not in seen:
            seen.add(id(prm))
            total += prm.numel()
    return total
