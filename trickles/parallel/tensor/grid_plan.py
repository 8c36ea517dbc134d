"""Applies 2-D, 2.5-D or 3-D tensor parallelism (``parallel.tp_mode``) to a
:class:`~trickles.models.transformer.Transformer`.

Like :mod:`trickles.parallel.tensor.plan` for 1-D, it swaps the modules of a meta-device model in place, keeping
every parameter's name; the split of the activations is :class:`~trickles.parallel.tensor.grid_model.GridContext`'s.

==========================================  ================================================================
module                                      becomes
==========================================  ================================================================
``embed``                                   :class:`GridEmbedding` (keeps this rank's samples of the ids)
``pos_embed`` (gpt2)                        :class:`GridPositions` (features split like the residual stream)
``attn_norm``, ``mlp_norm``, ``norm``       :class:`GridNorm`
``attn.q_proj``, ``k_proj``, ``v_proj``     the mode's linear (:meth:`GridContext.linear`): features, i.e. whole
(fused ``qkv_proj``)                        heads, split like the activations (fused: whole key/value groups)
``attn.o_proj``                             the mode's linear, reading the attention's output (3-D: roles swapped)
``mlp.gate_proj``, ``up_proj``              the mode's linear (fused ``gate_up_proj``: channel pairs)
``mlp.down_proj``                           the mode's linear, reading the MLP's hidden activation
``attn.core``, dropouts                     run with a random stream private to this tp rank
``output``                                  the mode's linear ``d -> V`` (tied: the embedding's weight, whose
                                            block is laid out as the output's)
``loss``                                    :class:`GridLoss` (vocabulary-parallel over ``tp_row``)
==========================================  ================================================================

Every weight is split over the whole grid (2.5-D: replicated over the depth); norms' and biases' blocks are held alike
by the ranks of the token groups. Each linear has a bias where its part's setting says (``model.qkv_bias``, ``o_bias``,
``mlp_bias``; :func:`~trickles.parallel.tensor.layout.block_linears`): every grid linear adds its output block's bias
the same way, ``o_proj`` and ``down_proj`` included. Mixture-of-experts blocks, context parallelism, sequence
parallelism, the fused loss, quantization-aware training and KV-cache decoding are not combined with a grid (the
configuration refuses them).
"""

from __future__ import annotations

import torch

from ...models import fused
from ...models.transformer import Transformer
from ...topology import Topology
from .grid_model import GridContext, GridEmbedding, GridLoss, GridNorm, GridPositions
from .layers import ForkRNG
from .layout import BIAS_PART, ROW_PARALLEL, block_linears


def grid_context(topo: Topology) -> GridContext:
    """The grid context of this rank's tensor-parallel group (``parallel.tp_mode`` 2d, 2.5d or 3d)."""
    grid = topo.dims.grid
    return GridContext(
        grid, topo.comm("tp"), topo.comm("tp_row"), topo.comm("tp_col"), topo.comm("tp_dep") if grid.depth > 1 else None
    )


def apply_tensor_nd(model: Transformer, ctx: GridContext) -> GridContext:
    """Swaps ``model``'s modules for the grid's (in place, see the module docstring); returns ``ctx``."""
    cfg = model.cfg
    dev = torch.device("meta")
    layer_norm = cfg.flavor == "gpt2"
    d = cfg.d_model
    lin = ctx.linear

    def norm():
        return GridNorm(d, cfg.norm_eps, layer_norm, ctx, device=dev)

    model.embed = GridEmbedding(cfg.vocab_size, d, ctx, cfg.tied, device=dev)
    if model.pos_embed is not None:
        model.pos_embed = GridPositions(cfg.max_seq_len, d, ctx, device=dev)
    for block in model.layers.values():
        attn, mlp = block.attn, block.mlp
        block.attn_norm, block.mlp_norm = norm(), norm()
        for name, h, h2, bias in block_linears(cfg):  # each with its own bias setting (model.qkv_bias, ...)
            owner = attn if BIAS_PART[name] in ("qkv", "o") else mlp
            setattr(owner, name, lin(h, h2, bias, second=name in ROW_PARALLEL, device=dev))
        object.__setattr__(attn, "core", ForkRNG(attn.core, ctx, cfg.dropout, owner=attn))
        attn.resid_drop = ForkRNG(attn.resid_drop, ctx, cfg.dropout)
        mlp.resid_drop = ForkRNG(mlp.resid_drop, ctx, cfg.dropout)
    model.embed_drop = ForkRNG(model.embed_drop, ctx, cfg.dropout)
    model.norm = norm()
    model.output = lin(d, cfg.vocab_size, False, device=dev)
    if cfg.tied:
        model.output.weight = model.embed.weight
    model.loss = GridLoss(ctx)
    fused.tag(model, cfg)
    return ctx
