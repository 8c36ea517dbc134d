"""The Hugging Face ``config.json`` both ways: :func:`config_from_hf` (import) and :func:`config_to_hf` (export).

Configs are mapped field by field. Anything this model cannot reproduce exactly is refused with the field's name: biases
or a head size other than ``hidden/heads`` in Llama, rope scaling, activations other than SiLU (Llama, Mixtral) or tanh
GELU (GPT-2), GPT-2's per-layer attention scaling, Mixtral's sliding window or top-1 routing; on export, MoE models
Mixtral cannot express (shared experts, a capacity factor, dense blocks between MoE ones, hard routing, gpt2-flavour
experts). Missing fields take ``transformers``' own defaults for that model type. A loaded model has dropout 0. Its
``bos/eos/pad_token_id`` are kept in ``model.hf_token_ids`` and written back by
:func:`~trickles.models.hf_export.save_hf`.

Mixtral (``model_type: mixtral``) is a llama-flavour model whose every block is a mixture of experts (``moe_every=1``,
learned top-k routing, dropless, no shared experts). Mixtral's router (softmax in fp32, top-k, the k weights
renormalized to sum 1) is trickles' for ``k > 1``; ``k = 1`` is refused both ways, since Mixtral then gives the expert
weight 1 and trickles the router probability. ``router_aux_loss_coef`` is ``moe_aux_loss``; Mixtral has no z-loss (an
imported model has ``moe_z_loss=0``; export drops it) and its ``router_jitter_noise``, like dropout, only acts in
training and is not imported.

The tensor names and layouts of the same directories are :mod:`trickles.models.hf_names`'.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, ConfigError
from .config import ModelConfig
from .hf_names import CONFIG

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# transformers' own defaults, used for fields a config.json leaves out.
LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
    head_dim=None,
)
GPT2_DEFAULTS = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    layer_norm_epsilon=1e-5,
    initializer_range=0.02,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)
MIXTRAL_DEFAULTS = dict(
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


def _refuse(source: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: {what}, which trickles' transformer cannot represent exactly; "
        "only plain Llama, Mixtral and GPT-2 architectures can be imported"
    )


def _rope_theta(raw: dict, source: str, default: float = 10000.0) -> float:
    """The rotary base, from 4.x (``rope_theta``, ``rope_scaling``) or 5.x (``rope_parameters``) fields."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise _refuse(source, f"rope parameters {params!r} are not one flat dict")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise _refuse(source, f"rope scaling {kind!r} is set ({params})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _refuse(source, f"partial_rotary_factor={partial} is set")
    top, inner = raw.get("rope_theta"), params.get("rope_theta")
    if top is not None and inner is not None and float(top) != float(inner):
        raise CheckpointError(
            f"{source}: rope_theta={top} disagrees with rope_parameters.rope_theta={inner}; "
            "transformers 4.x and 5.x would read different models, fix one of them"
        )
    return float(inner if inner is not None else top if top is not None else default)


def config_from_hf(raw: dict, source: str = CONFIG) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` dict (CheckpointError if impossible)."""
    kind = raw.get("model_type")
    if raw.get("quantization_config"):
        raise _refuse(source, "the weights are quantized (quantization_config is set)")
    if kind == "llama":
        c = {**LLAMA_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in LLAMA_DEFAULTS}}
        for key in ("attention_bias", "mlp_bias"):
            if c[key]:
                raise _refuse(source, f"{key}=true")
        if c["hidden_act"] not in ("silu", "swish"):
            raise _refuse(source, f"hidden_act={c['hidden_act']!r} (only silu)")
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        # an explicit head_dim other than hidden/heads (a pruned model) is model.head_size
        head_size = c["head_dim"] if c["head_dim"] is not None and c["head_dim"] * heads != hidden else None
        cfg = ModelConfig(
            flavor="llama",
            n_layers=c["num_hidden_layers"],
            d_model=hidden,
            n_heads=heads,
            n_kv_heads=c["num_key_value_heads"] or heads,
            head_size=head_size,
            ffn_hidden=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            max_seq_len=c["max_position_embeddings"],
            rope_theta=_rope_theta(raw, source),
            norm_eps=float(c["rms_norm_eps"]),
            dropout=0.0,
            tie_embeddings=bool(c["tie_word_embeddings"]),
            init_std=float(c["initializer_range"]),
        )
    elif kind == "mixtral":
        c = {**MIXTRAL_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in MIXTRAL_DEFAULTS}}
        if c["sliding_window"] is not None:
            raise _refuse(source, f"sliding_window={c['sliding_window']} is set (only full causal attention)")
        if c["hidden_act"] not in ("silu", "swish"):
            raise _refuse(source, f"hidden_act={c['hidden_act']!r} (only silu)")
        if c["num_experts_per_tok"] == 1:
            raise _refuse(
                source, "num_experts_per_tok=1 (Mixtral gives the one expert weight 1, trickles its router probability)"
            )
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        if c["head_dim"] is not None and c["head_dim"] * heads != hidden:
            raise _refuse(
                source, f"head_dim={c['head_dim']} differs from hidden_size/num_attention_heads={hidden}/{heads}"
            )
        ffn = c["intermediate_size"]
        cfg = ModelConfig(
            flavor="llama",
            n_layers=c["num_hidden_layers"],
            d_model=hidden,
            n_heads=heads,
            n_kv_heads=raw.get("num_key_value_heads", MIXTRAL_DEFAULTS["num_key_value_heads"]) or heads,
            ffn_hidden=ffn,
            vocab_size=c["vocab_size"],
            max_seq_len=c["max_position_embeddings"],
            rope_theta=_rope_theta(raw, source, 1e6),
            norm_eps=float(c["rms_norm_eps"]),
            dropout=0.0,
            tie_embeddings=bool(c["tie_word_embeddings"]),
            init_std=float(c["initializer_range"]),
            moe_experts=c["num_local_experts"],
            moe_top_k=c["num_experts_per_tok"],
            moe_every=1,
            moe_ffn_hidden=ffn,
            moe_capacity_factor=0.0,
            moe_shared_experts=0,
            moe_aux_loss=float(c["router_aux_loss_coef"]),
            moe_z_loss=0.0,
        )
    elif kind == "gpt2":
        c = {**GPT2_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in GPT2_DEFAULTS}}
        if c["activation_function"] not in ("gelu_new", "gelu_pytorch_tanh"):
            raise _refuse(
                source, f"activation_function={c['activation_function']!r} (only gelu_new / gelu_pytorch_tanh)"
            )
        for key, ok in (
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("reorder_and_upcast_attn", False),
            ("add_cross_attention", False),
        ):
            if bool(c[key]) != ok:
                raise _refuse(source, f"{key}={str(c[key]).lower()}")
        cfg = ModelConfig(
            flavor="gpt2",
            n_layers=c["n_layer"],
            d_model=c["n_embd"],
            n_heads=c["n_head"],
            n_kv_heads=None,
            ffn_hidden=c["n_inner"] or 4 * c["n_embd"],
            vocab_size=c["vocab_size"],
            max_seq_len=c["n_positions"],
            norm_eps=float(c["layer_norm_epsilon"]),
            dropout=0.0,
            tie_embeddings=bool(c["tie_word_embeddings"]),
            init_std=float(c["initializer_range"]),
        )
    else:
        raise CheckpointError(
            f"{source}: model_type {kind!r} is not supported; load_hf reads 'llama' "
            "(LlamaForCausalLM), 'mixtral' (MixtralForCausalLM) and 'gpt2' (GPT2LMHeadModel) checkpoints"
        )
    try:
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{source} describes a shape trickles cannot build: {e}") from None
    return cfg


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype, token_ids: dict | None = None) -> dict:
    """The ``config.json`` dict of a trickles model (ConfigError if Hugging Face has no such model)."""
    ids = {
        k: v for k, v in (token_ids or {}).items() if k in TOKEN_IDS and isinstance(v, int) and 0 <= v < cfg.vocab_size
    }
    if cfg.moe_experts:
        _check_mixtral(cfg)
    common = dict(
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tied,
        initializer_range=cfg.init_std,
        use_cache=True,
        torch_dtype=_dtype_name(dtype),
        dtype=_dtype_name(dtype),
        **{k: ids.get(k) for k in TOKEN_IDS},
    )
    if cfg.moe_experts:
        return dict(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            hidden_size=cfg.d_model,
            intermediate_size=cfg.moe_ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            hidden_act="silu",
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            sliding_window=None,
            attention_dropout=cfg.dropout,
            num_local_experts=cfg.moe_experts,
            num_experts_per_tok=cfg.moe_top_k,
            router_aux_loss_coef=cfg.moe_aux_loss,
            router_jitter_noise=0.0,
            output_router_logits=False,
            **common,
        )
    if cfg.flavor == "llama":
        return dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=cfg.d_model,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            hidden_act="silu",
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=None,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=cfg.dropout,
            pretraining_tp=1,
            **common,
        )
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise ConfigError(
            f"GPT-2's heads are d_model / n_heads wide, but model.head_size={cfg.head_dim} with "
            f"{cfg.n_heads} heads and d_model={cfg.d_model}; prune a gpt2 model's MLP and blocks only to export it"
        )
    if cfg.kv_heads != cfg.n_heads:
        raise ConfigError(
            f"GPT-2 has no grouped-query attention, but model.n_kv_heads={cfg.kv_heads} != "
            f"model.n_heads={cfg.n_heads}; set model.n_kv_heads to none for a gpt2 model"
        )
    return dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.ffn_dim,
        n_positions=cfg.max_seq_len,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        **common,
    )


def _check_mixtral(cfg: ModelConfig) -> None:
    """ConfigError unless the MoE model ``cfg`` is exactly a Mixtral."""
    if cfg.flavor != "llama":
        raise ConfigError(
            "Hugging Face has no GPT-2 mixture of experts (Mixtral is llama-flavoured); "
            "export a model with model.flavor=llama or model.moe_experts=0"
        )
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
    if cfg.moe_top_k == 1:
        raise ConfigError(
            "Mixtral renormalizes the top-k weights, so with model.moe_top_k=1 its expert weight is 1 "
            "where trickles uses the router probability; use model.moe_top_k >= 2 to export to Hugging Face"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
