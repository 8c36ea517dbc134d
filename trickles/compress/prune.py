"""Structured pruning: remove attention heads (whole key/value groups), MLP channels and whole blocks.

A block's attention with ``G`` key/value groups of ``r = n_heads / G`` query heads of size ``D`` is

    attn(x) = sum_g  o_proj[:, g] . softmax(q_g k_g^T) v_g          (q_g: the group's r query heads)

so removing group ``g`` removes rows ``[g r D, (g+1) r D)`` of ``q_proj``, rows ``[g D, (g+1) D)`` of
``k_proj`` and ``v_proj`` and the same columns of ``o_proj`` as ``q_proj``'s rows: the sum loses one term and
nothing else changes. An MLP ``down(act(gate x) * up x) = sum_c down[:, c] act(gate_c x) up_c x`` loses channel
``c`` with row ``c`` of ``gate_proj`` and ``up_proj`` (and element ``c`` of their biases) and column ``c`` of
``down_proj``.
A block ``h + attn(...) + mlp(...)`` removed leaves the residual stream ``h`` as it was. Where the removed
term is exactly zero (``o_proj``'s columns, ``down_proj``'s column zero) the pruned model computes the same
logits, bit for bit.

Head size is kept (``model.head_size`` is written into the pruned config, so ``d_model`` need not be
``n_heads x head_size`` any more); every layer keeps the same number of groups and channels (the model config
has one ``n_heads`` and ``ffn_hidden``), each layer its own best ones. Per-head q/k norms (``model.qk_norm=head``)
are kept whole; a full-width one keeps its weight's slice of the kept heads, and its mean square is then over those
heads only (removing heads changes what the others see, so removing a dead head is not exact there).

Importance, summed over calibration batches (the run's training data):

* ``taylor``: first-order Taylor, ``sum |w * dL/dw|`` over the unit's weights (Molchanov et al. 2019): what
  the loss would change by, to first order, if the unit's weights were zero;
* ``activation``: the size of what the unit adds to the residual stream: a head's ``||o_proj[:, h] z_h||``
  and a channel's ``|a_c| ||down[:, c]||`` (``a``: the input of ``down_proj``), a block's
  ``||block(h) - h||``, each averaged over tokens.

Either score is exactly zero for a unit whose output weights are zero. Mixture-of-experts blocks are not pruned.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import UserError
from ..models.config import ModelConfig
from ..models.transformer import Transformer

Score = Literal["taylor", "activation"]
SCORES = ("taylor", "activation")


@dataclass
class Importance:
    """Per-layer scores: ``groups[l][g]`` (key/value groups), ``channels[l][c]`` (MLP), ``blocks[l]``."""

    groups: dict[int, torch.Tensor]
    channels: dict[int, torch.Tensor]
    blocks: dict[int, float]


@dataclass
class Plan:
    """What survives: per original layer index, the kept groups and channels (ascending); the kept layers."""

    layers: list[int]
    groups: dict[int, list[int]]
    channels: dict[int, list[int]]


def check_prunable(cfg: ModelConfig) -> None:
    if cfg.moe_experts:
        raise UserError("pruning mixture-of-experts models is not supported; prune a dense model (model.moe_experts=0)")


# ---- scores ------------------------------------------------------------------------------------


def _rows(g: int, size: int) -> slice:
    return slice(g * size, (g + 1) * size)


def measure(
    model: Transformer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], score: Score = "taylor"
) -> Importance:
    """Importance of every group, channel and block of the unfused, dense ``model`` on ``batches`` of
    ``(inputs, targets)``."""
    cfg = model.cfg
    check_prunable(cfg)
    if score not in SCORES:
        raise UserError(f"unknown importance score {score!r}; choose taylor or activation")
    if any(getattr(b.attn, "fused", False) or getattr(b.mlp, "fused", False) for b in model.layers.values()):
        raise ValueError("measure() needs a model with separate q/k/v and gate/up projections (fused_proj=false)")
    return _taylor(model, batches) if score == "taylor" else _activation(model, batches)


def _taylor(model: Transformer, batches) -> Importance:
    cfg = model.cfg
    totals = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    was = model.training
    model.eval()
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        model(x, target=y).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.grad is not None:
                    totals[n] += (p * p.grad).abs()
    model.zero_grad(set_to_none=True)
    model.train(was)
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    groups, channels, blocks = {}, {}, {}
    for key in model.layers:
        layer, pre = int(key), f"layers.{key}."
        t = {n[len(pre) :]: v for n, v in totals.items() if n.startswith(pre)}
        blocks[layer] = float(sum(v.sum() for v in t.values()))
        g_score = torch.zeros(cfg.kv_heads, dtype=torch.float64)
        for g in range(cfg.kv_heads):
            s = t["attn.q_proj.weight"][_rows(g, rep * d)].sum() + t["attn.o_proj.weight"][:, _rows(g, rep * d)].sum()
            s = s + t["attn.k_proj.weight"][_rows(g, d)].sum() + t["attn.v_proj.weight"][_rows(g, d)].sum()
            for part, size in (("q", rep * d), ("k", d), ("v", d)):
                if f"attn.{part}_proj.bias" in t:
                    s = s + t[f"attn.{part}_proj.bias"][_rows(g, size)].sum()
            g_score[g] = float(s)
        c = t["mlp.down_proj.weight"].sum(0)
        for part in ("gate", "up"):  # their rows, and their biases' elements, where the model has them
            if f"mlp.{part}_proj.weight" in t:
                c = c + t[f"mlp.{part}_proj.weight"].sum(1)
            if f"mlp.{part}_proj.bias" in t:
                c = c + t[f"mlp.{part}_proj.bias"]
        groups[layer], channels[layer] = g_score, c.double()
    return Importance(groups, channels, blocks)


@torch.no_grad()
def _activation(model: Transformer, batches) -> Importance:
    cfg = model.cfg
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    groups = {int(k): torch.zeros(cfg.kv_heads, dtype=torch.float64) for k in model.layers}
    channels = {int(k): torch.zeros(cfg.ffn_dim, dtype=torch.float64) for k in model.layers}
    blocks = {int(k): 0.0 for k in model.layers}
    hooks = []

    def on_o_proj(layer):
        def hook(mod, args):
            z = args[0].float()  # [B, T, H*D]
            w = mod.weight.float()
            for h in range(cfg.n_heads):
                out = z[..., _rows(h, d)] @ w[:, _rows(h, d)].T  # head h's term of the residual update
                groups[layer][h // rep] += float(out.norm(dim=-1).mean())

        return hook

    def on_down(layer):
        def hook(mod, args):
            a = args[0].float()  # [B, T, f]
            channels[layer] += (a.abs().flatten(0, -2).mean(0) * mod.weight.float().norm(dim=0)).double()

        return hook

    def on_block(layer):
        def hook(mod, args, out):
            blocks[layer] += float((out - args[0]).float().norm(dim=-1).mean())

        return hook

    for key, block in model.layers.items():
        layer = int(key)
        hooks += [
            block.attn.o_proj.register_forward_pre_hook(on_o_proj(layer)),
            block.mlp.down_proj.register_forward_pre_hook(on_down(layer)),
            block.register_forward_hook(on_block(layer)),
        ]
    was = model.training
    model.eval()
    try:
        for x, _ in batches:
            model(x)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return Importance(groups, channels, blocks)


# ---- what to keep ----------------------------------------------------------------------------


def _kept(total: int, fraction: float, multiple_of: int) -> int:
    keep = total - round(fraction * total)
    if multiple_of > 1:
        keep = keep // multiple_of * multiple_of
    return max(keep, min(multiple_of, total), 1)


def plan(
    imp: Importance, cfg: ModelConfig, heads: float = 0.0, ffn: float = 0.0, layers: int = 0, multiple_of: int = 1
) -> Plan:
    """Keeps, in every layer, the ``1 - heads`` best key/value groups and ``1 - ffn`` best channels, and all but the
    ``layers`` lowest-scoring blocks. ``multiple_of``: kept groups and channels rounded down to a multiple of it
    (a tensor-parallel degree the pruned model should split over). Ties keep the earlier unit."""
    if not 0 <= heads < 1 or not 0 <= ffn < 1:
        raise UserError(f"--heads and --ffn are fractions to remove, in [0, 1); got {heads:g} and {ffn:g}")
    if not 0 <= layers < cfg.n_layers:
        raise UserError(
            f"--layers removes whole blocks: 0 to {cfg.n_layers - 1} of this model's {cfg.n_layers}; got {layers}"
        )
    if multiple_of < 1:
        raise UserError(f"--multiple-of must be at least 1, got {multiple_of}")
    n_groups = _kept(cfg.kv_heads, heads, multiple_of)
    n_channels = _kept(cfg.ffn_dim, ffn, multiple_of)

    def best(scores: torch.Tensor, n: int) -> list[int]:
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        return sorted(order[:n])

    by_block = sorted(
        imp.blocks, key=lambda layer: (imp.blocks[layer], -layer)
    )  # lowest first; ties drop the later block
    dropped = set(by_block[:layers])
    kept = [layer for layer in sorted(imp.blocks) if layer not in dropped]
    return Plan(
        kept,
        {layer: best(imp.groups[layer], n_groups) for layer in kept},
        {layer: best(imp.channels[layer], n_channels) for layer in kept},
    )


# ---- applying it -------------------------------------------------------------------------------


def pruned_config(cfg: ModelConfig, p: Plan) -> ModelConfig:
    """``cfg`` with the plan's layer, head and channel counts (head size kept as ``head_size``) and the kept layers'
    entries of ``model.window_layers``."""
    rep = cfg.n_heads // cfg.kv_heads
    groups = len(next(iter(p.groups.values())))
    out = dataclasses.replace(
        cfg,
        preset=None,
        n_layers=len(p.layers),
        n_heads=groups * rep,
        n_kv_heads=groups if cfg.n_kv_heads is not None else None,
        ffn_hidden=len(next(iter(p.channels.values()))),
        # a per-layer window pattern follows its layers (with it each layer's rotary base, model.rope_local_theta)
        window_layers=None if cfg.window_layers is None else [cfg.window_layers[i] for i in p.layers],
    )
    if out.n_heads != cfg.n_heads:
        out.head_size = cfg.head_dim
    out.validate()
    return out


def prune_state(state: dict[str, torch.Tensor], cfg: ModelConfig, p: Plan) -> dict[str, torch.Tensor]:
    """The unfused state dict (parts' names) of the pruned model; layers renumbered ``0..``."""
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    out = {}
    for name, t in state.items():
        if not name.startswith("layers."):
            out[name] = t.clone()
            continue
        _, layer, rest = name.split(".", 2)
        layer = int(layer)
        if layer not in p.layers:
            continue
        q_idx = torch.tensor([g * rep * d + i for g in p.groups[layer] for i in range(rep * d)], dtype=torch.long)
        kv_idx = torch.tensor([g * d + i for g in p.groups[layer] for i in range(d)], dtype=torch.long)
        ch = torch.tensor(p.channels[layer], dtype=torch.long)
        if rest.startswith("attn.q_proj.") or (rest == "attn.q_norm.weight" and cfg.qk_norm == "full"):
            t = t.index_select(0, q_idx)  # a full-width q/k norm's weight runs along the heads' features
        elif rest.startswith(("attn.k_proj.", "attn.v_proj.")) or (
            rest == "attn.k_norm.weight" and cfg.qk_norm == "full"
        ):
            t = t.index_select(0, kv_idx)
        elif rest == "attn.o_proj.weight":
            t = t.index_select(1, q_idx)
        elif rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            t = t.index_select(0, ch)
        elif rest == "mlp.down_proj.weight":
            t = t.index_select(1, ch)
        out[f"layers.{p.layers.index(layer)}.{rest}"] = t.clone()
    return out


def prune_model(model: Transformer, p: Plan) -> Transformer:
    """A new, smaller (unfused) model holding ``model``'s kept weights."""
    from ..models.fused import split_state
    from ..train.checkpoint import unique_state

    cfg = dataclasses.replace(model.cfg, fused_proj=False)
    new_cfg = pruned_config(cfg, p)
    state = prune_state(split_state(model.cfg, {k: v.detach() for k, v in unique_state(model).items()}), cfg, p)
    with torch.device("meta"):
        small = Transformer(new_cfg)
    small.to_empty(device=next(model.parameters()).device)
    small.reset_buffers()
    missing, unexpected = small.load_state_dict(state, strict=False)
    tied = {"output.weight"} if new_cfg.tied else set()  # the embedding's, under its other name
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"pruned state does not fit the pruned model: missing {missing}, unexpected {unexpected}")
    return small.train(model.training)


# ---- the command ---------------------------------------------------------------------------


def prune_checkpoint(
    src: str,
    out: str,
    heads: float = 0.0,
    ffn: float = 0.0,
    layers: int = 0,
    score: Score = "taylor",
    batches: int = 8,
    multiple_of: int = 1,
) -> tuple[str, ModelConfig, ModelConfig]:
    """Prunes the checkpoint at ``src`` (scored on ``batches`` batches of its run's training data) into a new
    checkpoint ``out``: model weights, tokenizer and a ``trainer.json`` at step 0 with the pruned model config and
    ``pruned_from``; no optimizer state (train it with ``train.init_from``). Written in ``out.tmp``, renamed when
    complete. Returns ``(out, old config, new config)``."""
    from ..train import checkpoint as ckpt
    from .report import calibration_batches, load_model

    if score not in SCORES:
        raise UserError(f"--score must be taylor or activation, got {score!r}")
    if batches < 1:
        raise UserError(f"--batches must be at least 1, got {batches}")
    out = os.path.normpath(out)
    if os.path.lexists(out):
        raise UserError(f"{out} already exists; choose another path or delete it")
    model, tokenizer, meta, path = load_model(src, fused_proj=False)
    check_prunable(model.cfg)
    p = plan(
        measure(model, calibration_batches(meta, tokenizer, "train", batches), score),
        model.cfg,
        heads,
        ffn,
        layers,
        multiple_of,
    )
    small = prune_model(model, p)
    new = dataclasses.asdict(small.cfg)
    new["fused_proj"] = meta["model"].get("fused_proj")  # how it computes stays the user's choice
    config = dict(meta.get("config", {}))
    config["model"] = dict(new)
    trainer = {
        "step": 0,
        "consumed_samples": 0,
        "world_size": 1,
        "model": new,
        "config": config,
        "rng": [],
        "pruned_from": {
            "checkpoint": os.path.abspath(path),
            "score": score,
            "heads": heads,
            "ffn": ffn,
            "layers": layers,
            "batches": batches,
            "kept_layers": p.layers,
            "kept_groups": {str(k): v for k, v in p.groups.items()},
        },
    }
    ckpt.write_model_dir(out, ckpt.model_pieces(small), os.path.join(path, "tokenizer"), trainer)
    return out, model.cfg, small.cfg
