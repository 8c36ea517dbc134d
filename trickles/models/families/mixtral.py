"""Mixtral (``model_type: mixtral``, ``MixtralForCausalLM``): a Llama whose every block is a mixture of experts.

Config, both ways: as :mod:`.llama` (no biases), plus ``moe_every=1``, learned top-k routing, dropless, no shared
experts: ``num_local_experts`` moe_experts, ``num_experts_per_tok`` moe_top_k, ``intermediate_size`` the experts'
hidden size, ``router_aux_loss_coef`` moe_aux_loss. Mixtral's router (softmax in fp32, top-k, the k weights
renormalized to sum 1) is trickles' for ``k > 1``; ``k = 1`` is refused both ways, since Mixtral then gives the
expert weight 1 and trickles the router probability. Mixtral has no z-loss (an imported model has
``moe_z_loss=0``; export drops it) and its ``router_jitter_noise``, like dropout, only acts in training and is not
imported. ``sliding_window`` is ``model.sliding_window`` on every layer, exactly as :mod:`.mistral`'s (transformers
masks Mixtral as Mistral; here a missing or null window is full causal attention); exports write it back. Refused:
a ``head_dim`` other than ``hidden_size / num_attention_heads``; on export, what Mixtral cannot express (shared
experts, a capacity factor, dense blocks between MoE ones, hard routing, a per-layer window pattern).

Tensor names: :mod:`.llama`'s for attention, norms, embeddings and head; each block's MLP per expert, the layout
of the published checkpoints (transformers 4.x reads it as is, 5.x converts it on load and writes it too)::

    model.layers.{i}.block_sparse_moe.gate.weight           layers.{i}.mlp.router.weight
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight layers.{i}.mlp.experts.gate_proj.weight[j]
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight layers.{i}.mlp.experts.up_proj.weight[j]
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight layers.{i}.mlp.experts.down_proj.weight[j]

Import also reads the fused layout of transformers 5.x's modules (``save_pretrained(...,
save_original_format=False)``), recognized by its names: ``model.layers.{i}.mlp.gate.weight`` (the router),
``mlp.experts.gate_up_proj [E, 2F, d]`` (gate and up concatenated along dim 1), ``mlp.experts.down_proj [E, d, F]``.
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import llama_keys, llama_names, llama_shape, merged, refuse

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=4096 * 32,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    sliding_window=None,
    num_experts_per_tok=2,
    num_local_experts=8,
    router_aux_loss_coef=0.001,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    if c["num_experts_per_tok"] == 1:
        raise refuse(
            source, "num_experts_per_tok=1 (Mixtral gives the one expert weight 1, trickles its router probability)"
        )
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if c["head_dim"] is not None and c["head_dim"] * heads != hidden:
        raise refuse(source, f"head_dim={c['head_dim']} differs from hidden_size/num_attention_heads={hidden}/{heads}")
    c["num_key_value_heads"] = raw.get("num_key_value_heads", DEFAULTS["num_key_value_heads"])
    return llama_shape(
        c,
        source,
        MODEL_TYPE,
        moe_experts=c["num_local_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_every=1,
        moe_ffn_hidden=c["intermediate_size"],
        moe_capacity_factor=0.0,
        moe_shared_experts=0,
        moe_aux_loss=float(c["router_aux_loss_coef"]),
        moe_z_loss=0.0,
        sliding_window=c["sliding_window"],
        **rope_fields_from_hf(raw, source, 1e6),
    )


def picks(cfg: ModelConfig) -> bool:
    """Mixtral writes every mixture-of-experts model (and refuses those it cannot express)."""
    return bool(cfg.moe_experts)


def to_hf(cfg: ModelConfig) -> dict:
    _check(cfg)
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.moe_ffn_dim),
        sliding_window=cfg.sliding_window,
        num_local_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    """The names above; the fused 5.x layout where ``found`` (the checkpoint's names) holds it."""
    fused = bool(cfg.moe_layers) and f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj" in found

    def experts(i: int, hf: str, us: str) -> list[Entry]:
        if fused:
            ex = f"{us}mlp.experts."
            return [
                Entry(hf + "mlp.gate.weight", (us + "mlp.router.weight",)),
                Entry(hf + "mlp.experts.gate_up_proj", (ex + "gate_proj.weight", ex + "up_proj.weight"), "cat1"),
                Entry(hf + "mlp.experts.down_proj", (ex + "down_proj.weight",)),
            ]
        return [Entry(hf + "block_sparse_moe.gate.weight", (us + "mlp.router.weight",))] + [
            Entry(f"{hf}block_sparse_moe.experts.{j}.{w}.weight", (f"{us}mlp.experts.{p}_proj.weight",), "expert", j)
            for j in range(cfg.moe_experts)
            for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up"))
        ]

    return llama_names(cfg, experts)


def _check(cfg: ModelConfig) -> None:
    """ConfigError unless the model ``cfg`` is exactly a Mixtral."""
    if cfg.flavor != "llama":
        raise ConfigError(
            "Hugging Face has no GPT-2 mixture of experts (Mixtral is llama-flavoured); "
            "export a model with model.flavor=llama or model.moe_experts=0"
        )
    if not cfg.moe_experts:
        raise ConfigError("model.family=mixtral needs model.moe_experts > 0; unset model.family to export this one")
    if cfg.moe_every != 1:
        raise ConfigError(
            f"Mixtral makes every block a mixture of experts, but model.moe_every={cfg.moe_every}; "
            "set model.moe_every=1 to export to Hugging Face"
        )
    if cfg.moe_shared_experts:
        raise ConfigError(
            f"Mixtral has no shared experts, but model.moe_shared_experts={cfg.moe_shared_experts}; "
            "set model.moe_shared_experts=0 to export to Hugging Face"
        )
    if cfg.moe_capacity_factor > 0:
        raise ConfigError(
            f"Mixtral is dropless, but model.moe_capacity_factor={cfg.moe_capacity_factor} drops "
            "assignments over capacity; set model.moe_capacity_factor=0 to export to Hugging Face"
        )
    if cfg.moe_router != "learned":
        raise ConfigError(
            f"Mixtral routes with its learned router only, but model.moe_router={cfg.moe_router}; "
            "set model.moe_router=learned to export to Hugging Face"
        )
    routing = dict(moe_router_score="softmax", moe_groups=1, moe_routed_scale=1.0, moe_bias_rate=0.0)
    routing.update(moe_shared_gate=False, moe_norm_topk=True if cfg.moe_norm_topk is False else cfg.moe_norm_topk)
    for key, want in routing.items():
        if getattr(cfg, key) != want:
            raise ConfigError(
                f"Mixtral routes by renormalized softmax top-k, but model.{key}={getattr(cfg, key)}; "
                f"set model.{key}={want} to export to Hugging Face"
            )
    if cfg.moe_top_k == 1:
        raise ConfigError(
            "Mixtral renormalizes the top-k weights, so with model.moe_top_k=1 its expert weight is 1 "
            "where trickles uses the router probability; use model.moe_top_k >= 2 to export to Hugging Face"
        )
    if cfg.window_layers is not None and not all(cfg.window_layers):
        raise ConfigError(
            "Mixtral's sliding window applies to every layer; set model.window_layers=none to export to Hugging Face"
        )
    for part in ("qkv", "o"):
        if cfg.bias(part):
            raise ConfigError(
                f"Mixtral has no bias on its {part} projections, but model.{part}_bias=true; "
                f"set model.{part}_bias=false to export to Hugging Face"
            )
