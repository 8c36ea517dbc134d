"""The parameters one rank holds, from the model built on the meta device -- built once per shape, then reused.

:func:`~trickles.memory.report.predict` counts model states on the engine's own flat layout, so it needs the
parameters a rank holds, with their tensor- and expert-parallel specs. Building a
:class:`~trickles.models.transformer.Transformer` on the meta device costs about 27 ms a layer even there (the
default initializers run through their decompositions: 2.6 s for GPT-3's 96 layers of width 12288), and a layout
search asks for thousands of layouts of one model. What the parameters depend on is few things: the model
configuration, the tensor-parallel layout (``tp``, mode, depth, sequence parallelism), the expert-parallel degree
and this rank's place in it, and the parameters' type; :func:`rank_model` builds one per such key and keeps it.

A pipeline stage's parameters (:func:`stage_parameters`) are a filter of these by name, in the model's order --
the layers of its chunks, the embedding (and gpt2's positions) on the first rank, the final norm, output
projection and multi-token prediction modules on the last, where a tied embedding (or the embedding multi-token
prediction reads) is the last rank's copy (``embed.weight``, the holder
:func:`~trickles.parallel.pipeline.stages.keep_stage` keeps) -- exactly the parameters, in the order, of the model
:func:`~trickles.parallel.pipeline.stages.keep_stage` prunes (the tests compare the two).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..adapters.int8_base import is_int8_base
from ..adapters.lora import LoRASettings, apply_lora, freeze_base
from ..adapters.tensor import adapted_modules, apply_lora_tensor_parallel
from ..models.config import ModelConfig
from ..topology import ParallelDims
from .tp_modes import shard_meta

_CACHE: OrderedDict = OrderedDict()
_KEEP = 16  # rank models kept (meta tensors: no memory but their Python objects)


@dataclass
class RankModel:
    """One rank's (tensor- and expert-parallel) model on the meta device, in the parameters' type."""

    module: torch.nn.Module
    named: list  # unique (name, parameter) pairs in the model's order
    total_params: int  # the whole model's, before any split
    active_params: int  # what a token passes through (mixture of experts: the router and top-k experts)
    key: tuple  # what it was built for (a cache key for what is computed from it)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)


def rank_model(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool,
    ep_rank: int,
    dtype: torch.dtype,
    lora: LoRASettings | None = None,
) -> RankModel:
    """The parameters tensor-parallel rank 0, expert-parallel rank ``ep_rank`` holds (cached, module docstring);
    with ``lora`` (``train.lora_rank``) its adapters too, split as the parallel plan splits them, and every base
    parameter frozen (``requires_grad=False``: no gradient, no optimizer state)."""
    from ..parallel.engine import unique_named_parameters

    key = (
        repr(lora),
        repr(model_cfg),
        dims.tp,
        dims.tp_mode,
        dims.tp_depth,
        bool(sequence_parallel and dims.tp > 1),
        dims.ep,
        ep_rank % dims.ep,
        str(dtype),
    )
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    from ..models.transformer import Transformer, count_params

    with torch.device("meta"):
        meta = Transformer(model_cfg)
    total = count_params(meta)
    active = total - _idle_expert_params(meta)
    if dims.ep > 1:  # this rank's E / ep experts of every MoE block, in the order the plan applies them
        from ..parallel.expert import apply_expert_parallel

        # (the dispatch it installs would talk over the ep group; the meta model never runs it)
        apply_expert_parallel(meta, SimpleNamespace(size=dims.ep, rank=ep_rank % dims.ep))
    adapted = {}
    if lora is not None:
        apply_lora(meta, lora)
        adapted = adapted_modules(meta)
    shard_meta(meta, dims, sequence_parallel)  # what one tensor-parallel rank holds (1-D or a grid)
    if adapted and dims.tp > 1:  # the adapters back on the parallel layers, as parallelize puts them
        apply_lora_tensor_parallel(meta, adapted, dims.tp)
    if adapted:
        freeze_base(meta)
    meta = meta.to(dtype)
    for name, prm in meta.named_parameters():  # an int8 base's scales stay fp32 (train.lora_base=int8)
        if is_int8_base(name, prm) and prm.is_floating_point():
            prm.data = prm.data.float()
    out = RankModel(meta, unique_named_parameters(meta), total, active, key)
    _CACHE[key] = out
    while len(_CACHE) > _KEEP:
        _CACHE.popitem(last=False)
    return out


def stage_parameters(rm: RankModel, layers: set[int], first: bool, last: bool, tied: bool) -> list:
    """The (name, parameter) pairs of the pipeline rank holding ``layers`` (``first``, ``last``: the pipeline's
    first or last rank; ``tied``: input and output embeddings share a weight), in the model's order."""

    embeds = last and rm.module.mtp is not None  # multi-token prediction embeds tokens on the last rank

    def kept(name: str) -> bool:
        top, _, rest = name.partition(".")
        if top == "layers":
            return int(rest.partition(".")[0]) in layers
        if top == "pos_embed":
            return first or embeds
        if top == "embed":
            return first or (last and tied) or embeds
        if top in ("norm", "output", "mtp"):
            return last
        return True  # (nothing else holds parameters at the top of the model)

    return [(n, p) for n, p in rm.named if kept(n)]


def _idle_expert_params(model) -> int:
    """Parameters a token does not pass through: the ``E - k`` routed experts it is not sent to, in every MoE block."""
    from ..models.moe import MoE

    idle = 0
    for block in model.layers.values():
        if isinstance(block.mlp, MoE):
            ex = block.mlp.experts
            per_expert = sum(prm.numel() for prm in ex.parameters()) // ex.count
            idle += (ex.count - block.mlp.top_k) * per_expert
    return idle
