"""transformers' Mixtral holding the weights of our MoE layer and block: the peer of ``moe.py``.

``MixtralSparseMoeBlock`` keeps the experts fused (``gate_up_proj [E, 2F, d]``: gate rows first, ``down_proj
[E, d, F]``) where ours keeps ``gate_proj``, ``up_proj`` and ``down_proj`` apart; ``MixtralDecoderLayer`` names its
norms and projections its own way, and ours may fuse ``q/k/v`` (``model.fused_proj``). These functions copy our weights
into transformers' modules and read their gradients back under our names, so that the two can be compared tensor by
tensor.
"""

from __future__ import annotations

import torch

from trickles.models import fused
from trickles.models.config import ModelConfig

ROPE_THETA = 10000.0
NORM_EPS = 1e-5


def hf_config(args, impl: str):
    """The Mixtral configuration of ``moe.py``'s shape (``args``) with the experts implementation ``impl``."""
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=args.d_model,
        intermediate_size=args.ffn,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        router_jitter_noise=0.0,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.d_model // args.heads,
        rms_norm_eps=NORM_EPS,
        sliding_window=None,
        attention_dropout=0.0,
        max_position_embeddings=args.seq,
        vocab_size=64,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        experts_implementation=impl,
        attn_implementation="sdpa",
    )


@torch.no_grad()
def load_hf_moe(hf, ours) -> None:
    """Our MoE's weights into a ``MixtralSparseMoeBlock`` (fused ``gate_up_proj [E, 2F, d]``: gate rows first)."""
    ex = ours.experts
    e, f, d = ex.gate_proj.weight.shape
    got = (tuple(hf.gate.weight.shape), tuple(hf.experts.gate_up_proj.shape), tuple(hf.experts.down_proj.shape))
    want = ((e, d), (e, 2 * f, d), (e, d, f))
    if got != want:
        raise SystemExit(
            f"moe.py: transformers' Mixtral expert layout is {got}, expected {want} "
            "(gate, gate_up_proj, down_proj); "
            "this script knows the fused layout of transformers 5"
        )
    hf.gate.weight.copy_(ours.router.weight)
    hf.experts.gate_up_proj.copy_(torch.cat([ex.gate_proj.weight, ex.up_proj.weight], 1))
    hf.experts.down_proj.copy_(ex.down_proj.weight)


def hf_moe_grads(hf, prefix: str = "") -> dict[str, torch.Tensor]:
    """A ``MixtralSparseMoeBlock``'s weight gradients under our parameter names."""
    f = hf.experts.down_proj.shape[-1]
    gu = hf.experts.gate_up_proj.grad
    return {
        f"{prefix}router.weight": hf.gate.weight.grad,
        f"{prefix}experts.gate_proj.weight": gu[:, :f],
        f"{prefix}experts.up_proj.weight": gu[:, f:],
        f"{prefix}experts.down_proj.weight": hf.experts.down_proj.grad,
    }


BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
}


def by_parts(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block's tensors (parameters or their gradients) by our unfused names: a fused ``attn.qkv_proj`` (CUDA's
    default, ``model.fused_proj``) cut into ``q_proj``, ``k_proj``, ``v_proj`` by ``trickles.models.fused.split_state``,
    the names transformers' layer has; an unfused block's tensors as they are."""
    prefix = "layers.0."  # split_state reads a model's names
    whole = fused.split_state(cfg, {prefix + n: t for n, t in tensors.items()})
    return {n[len(prefix) :]: t for n, t in whole.items()}


@torch.no_grad()
def load_hf_block(hf, ours, cfg: ModelConfig) -> None:
    """Our block's weights into a ``MixtralDecoderLayer``: norms and projections by name (from the parts where ours
    fuses them), the MoE by :func:`load_hf_moe`."""
    params = dict(hf.named_parameters())
    mine = by_parts(cfg, {n: p.detach() for n, p in ours.named_parameters()})
    for name, theirs in BLOCK_NAMES.items():
        params[theirs].copy_(mine[name])
    load_hf_moe(hf.mlp, ours.mlp)


def hf_block_grads(hf) -> dict[str, torch.Tensor]:
    """A ``MixtralDecoderLayer``'s weight gradients under our block's (unfused) parameter names."""
    params = dict(hf.named_parameters())
    return {**{n: params[t].grad for n, t in BLOCK_NAMES.items()}, **hf_moe_grads(hf.mlp, "mlp.")}
