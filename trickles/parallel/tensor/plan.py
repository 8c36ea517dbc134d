"""Applies 1-D tensor (and sequence) parallelism to a :class:`~trickles.models.transformer.Transformer`.

The model is built on the meta device as single-device code; :func:`apply_tensor_parallel`
swaps its modules for the layers of :mod:`trickles.parallel.tensor.layers` in place, keeping every
parameter's name:

==================================  =========================================================
module                              becomes
==================================  =========================================================
``embed``                           :class:`VocabParallelEmbedding` (rows split by vocabulary; with
                                    sequence parallel its reduce-scatter leaves sequence shards)
``pos_embed``                       sequence parallel: looks up this rank's positions only
``embed_drop``                      sequence parallel: dropout with this rank's random stream
``layers.i.attn_norm``, ``mlp_norm``  the norm, then the region entry (copy / all-gather)
``attn.q_proj`` (``k_proj``, ``v_proj``)  column-parallel by heads (key/value: whole on every rank
                                    when ``n_kv_heads`` does not divide by ``tp``)
``attn.qkv_proj`` (fused)           column-parallel by key/value groups: a rank's contiguous rows are its
                                    query heads and the key/value heads they use (``tp`` divides ``n_kv_heads``)
``attn.o_proj``, ``mlp.down_proj``  row-parallel, leaving the region (all-reduce / reduce-scatter)
latent attention (``model.attention=mla``)  heads split, the compressions and their norms replicated
                                    (:mod:`~trickles.parallel.tensor.latent`)
``mlp.gate_proj``, ``up_proj``      column-parallel (fused ``gate_up_proj``: by channel pairs)
``attn.q_norm``, ``k_norm``          per head: replicated, gradient summed; full width: :class:`SplitWidthRMSNorm`
``attn_post_norm``, ``mlp_post_norm``  replicated (gradient summed under sequence parallel), outside the region
``attn.core``                       run with this rank's private random stream (its heads' dropout)
``mlp`` of a mixture-of-experts block  unchanged: router and experts whole on every tp rank, no region;
                                    its ``mlp_norm`` stays plain. Without sequence parallelism each rank
                                    routes and computes all the block's tokens, identical on every tp
                                    rank. With it each rank routes its sequence shard (per-sequence
                                    capacity and balancing completed over tp, the gradients summed over
                                    tp: :func:`~trickles.parallel.expert.split_sequence`). With expert
                                    parallelism each tp rank's ep group dispatches its tokens
``norm``                            the final norm, then the region entry
``output``                          column-parallel over the vocabulary (shares the embedding's
                                    shard when tied)
``loss``                            :class:`VocabParallelLoss`: the loss from the logit shards (or fused,
                                    chunk by chunk, over the weight's vocabulary slice)
``mtp.k`` (multi-token prediction)  ``block`` as the blocks above; ``enorm``, ``hnorm``, ``eh_proj``
                                    replicated (gradient summed under sequence parallel); ``norm`` as the
                                    final norm (:mod:`trickles.models.mtp`)
==================================  =========================================================
"""

from __future__ import annotations

import dataclasses

import torch

from ...comm import GroupComm, gather_from_region
from ...models import fused
from ...models.transformer import Transformer
from ..expert import split_sequence
from .latent import split_latent_attention
from .layers import (
    ColumnParallelLinear,
    ForkRNG,
    ReplicatedKV,
    RowParallelLinear,
    SplitWidthRMSNorm,
    TPContext,
    VocabParallelEmbedding,
    enter_after,
    replicated_spec,
    set_spec,
)
from .loss import VocabParallelLoss


def apply_tensor_parallel(
    model: Transformer,
    comm: GroupComm,
    sequence_parallel: bool,
    recomputed_blocks: frozenset[int] | set[int] = frozenset(),
) -> TPContext:
    """Swaps ``model``'s modules for tensor-parallel ones over ``comm`` (in place); returns the shared context.

    ``recomputed_blocks``: the layers whose blocks are recomputed whole in backward, so their column-parallel
    layers keep the gathered input rather than all-gathering it once more (see :class:`TPContext`).
    """
    cfg = model.cfg
    tp = comm.size
    ctx = TPContext(comm, sequence_parallel)
    dev = torch.device("meta")
    qkv_bias, o_bias, mlp_bias = cfg.bias("qkv"), cfg.bias("o"), cfg.bias("mlp")
    sp = sequence_parallel

    def norm(module):
        for p in module.parameters():
            set_spec(p, replicated_spec(p.shape, partial=sp))
        return enter_after(module, ctx)

    model.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, ctx, device=dev)
    if model.pos_embed is not None:  # learned positions: under sequence parallel, only this rank's
        set_spec(model.pos_embed.weight, replicated_spec(model.pos_embed.weight.shape, partial=sp))
        model.pos_embed.register_forward_pre_hook(_own_positions(ctx))
    if sp:
        model.embed_drop = ForkRNG(model.embed_drop, ctx, cfg.dropout)
    mtp = [] if model.mtp is None else list(model.mtp.values())  # multi-token prediction: blocks n_layers.. alike
    for name, block in [*model.layers.items(), *((str(cfg.n_layers + k), m.block) for k, m in enumerate(mtp))]:
        attn, mlp = block.attn, block.mlp
        rg = int(name) not in recomputed_blocks
        block.attn_norm = norm(block.attn_norm)
        if block.moe:  # experts whole on every tp rank, outside any region (see the table above)
            for p in [*block.mlp_norm.parameters(), *mlp.parameters()]:
                if hasattr(p, "tp_spec"):  # an expert-parallel block of experts: also partial under sp
                    p.tp_spec = dataclasses.replace(p.tp_spec, partial_grad=sp)
                else:
                    set_spec(p, replicated_spec(p.shape, partial=sp))
            if sp:
                split_sequence(mlp, comm, "contiguous", lambda: ctx.sp_active, 1.0 / tp)
                mlp.register_forward_pre_hook(_own_labels(ctx))
        else:
            block.mlp_norm = norm(block.mlp_norm)
        hd = cfg.head_dim
        if cfg.attention == "mla":  # heads split, the compressions replicated (:mod:`.latent`)
            split_latent_attention(attn, cfg, ctx, rg, dev)
        elif attn.fused:  # the config check made tp divide the key/value heads: whole groups per rank
            attn.qkv_proj = ColumnParallelLinear(
                cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * hd, qkv_bias, ctx, device=dev, regather=rg
            )
        else:
            attn.q_proj = ColumnParallelLinear(cfg.d_model, cfg.n_heads * hd, qkv_bias, ctx, device=dev, regather=rg)
            kv = ColumnParallelLinear if cfg.kv_heads % tp == 0 else ReplicatedKV
            args = (cfg.kv_heads * hd,) if kv is ColumnParallelLinear else (cfg.n_heads, cfg.kv_heads, hd)
            attn.k_proj = kv(cfg.d_model, *args, qkv_bias, ctx, device=dev, regather=rg)
            attn.v_proj = kv(cfg.d_model, *args, qkv_bias, ctx, device=dev, regather=rg)
        if cfg.attention != "mla":
            attn.o_proj = RowParallelLinear(cfg.n_heads * hd, cfg.d_model, o_bias, ctx, device=dev)
        if cfg.qk_norm == "full":  # the config check made tp divide the key/value heads
            off = cfg.norm_unit_offset
            attn.q_norm = SplitWidthRMSNorm(cfg.n_heads * hd, cfg.norm_eps, ctx, device=dev, offset=off)
            attn.k_norm = SplitWidthRMSNorm(cfg.kv_heads * hd, cfg.norm_eps, ctx, device=dev, offset=off)
        # per-head q/k norms (each rank's gradient from its own heads) and post norms (from its sequence shard)
        for p, partial in [
            *((p, True) for p in attn.parameters() if not hasattr(p, "tp_spec")),
            *((p, sp) for p in [*block.attn_post_norm.parameters(), *block.mlp_post_norm.parameters()]),
        ]:
            set_spec(p, replicated_spec(p.shape, partial=partial))
        # an instance attribute (not a submodule): it must shadow the class's ``core`` method
        object.__setattr__(attn, "core", ForkRNG(attn.core, ctx, cfg.dropout, owner=attn))
        if not block.moe and mlp.fused:
            mlp.gate_up_proj = ColumnParallelLinear(
                cfg.d_model, 2 * cfg.ffn_dim, mlp_bias, ctx, device=dev, regather=rg
            )
            mlp.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, mlp_bias, ctx, device=dev)
        elif not block.moe:
            if mlp.gated:
                mlp.gate_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, mlp_bias, ctx, device=dev, regather=rg)
            mlp.up_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, mlp_bias, ctx, device=dev, regather=rg)
            mlp.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, mlp_bias, ctx, device=dev)
        if sp:
            attn.resid_drop = ForkRNG(attn.resid_drop, ctx, cfg.dropout)
            mlp.resid_drop = ForkRNG(mlp.resid_drop, ctx, cfg.dropout)
    model.norm = norm(model.norm)
    for m in mtp:  # enorm, hnorm, eh_proj replicated outside the region; the head's norm enters it (models/mtp.py)
        for p in [*m.enorm.parameters(), *m.hnorm.parameters(), *m.eh_proj.parameters()]:
            set_spec(p, replicated_spec(p.shape, partial=sp))
        m.norm = norm(m.norm)
    model.output = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, False, ctx, device=dev)
    if cfg.tied:
        model.output.weight = model.embed.weight
    ctx.vocab_start = model.output.weight.tp_spec.offset[0]
    model.loss = VocabParallelLoss(ctx, model.loss.fused, model.loss.chunk, model.loss.kernels, model.loss.softcap)
    fused.tag(model, cfg)
    model.register_forward_pre_hook(_sequence_parallel_switch(ctx), with_kwargs=True)
    model.register_forward_hook(lambda module, args, out: ctx.end_forward())
    return ctx


def _sequence_parallel_switch(ctx: TPContext):
    """Decides per forward whether sequence parallelism is on (see :meth:`TPContext.begin_forward`)."""

    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        ctx.begin_forward(tokens.shape[1], decoding=cache is not None)
        return None

    return hook


def _own_positions(ctx: TPContext):
    """Sequence parallel: look up only the positions of this rank's sequence shard (of ``[T]``, or of each row's
    ``[B, T]``: packed documents' positions)."""

    def hook(module, args):
        if ctx.sp_active:
            return (args[0].chunk(ctx.comm.size, dim=-1)[ctx.comm.rank],)
        return None

    return hook


def _own_labels(ctx: TPContext):
    """Sequence parallel: a mixture-of-experts block's per-token labels ``[B, T]`` cut to this rank's shard."""

    def hook(module, args):
        if ctx.sp_active and len(args) > 1 and args[1] is not None and args[1].dim() == 2:
            return (args[0], args[1].chunk(ctx.comm.size, dim=1)[ctx.comm.rank])
        return None

    return hook


def tp_full_logits(ctx: TPContext):
    """Gathers vocabulary-sharded logits (for sampling)."""
    return lambda logits: gather_from_region(logits, ctx.comm, dim=-1)
