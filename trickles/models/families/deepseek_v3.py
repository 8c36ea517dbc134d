"""DeepSeek-V3 (``model_type: deepseek_v3``, ``DeepseekV3ForCausalLM``): multi-head latent attention
(:mod:`trickles.models.mla`) in Llama's pre-norm block, the first ``first_k_dense_replace`` blocks with a dense MLP and
the others DeepSeekMoE blocks (fine-grained routed experts, shared experts, group-limited sigmoid routing with the
routing bias ``e_score_correction_bias``, :mod:`trickles.models.routers`).

Config, both ways: as :mod:`.llama` (``intermediate_size`` the dense MLP's width) with ``model.attention=mla`` and
``q_lora_rank`` (null: one ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``rope_interleave`` under the same names; ``attention_bias`` is ``qkv_bias`` and ``o_bias`` together (a bias on
``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``; ``q_proj``, ``q_b_proj`` and ``kv_b_proj`` never have one). The
rotary tables are ``qk_rope_head_dim`` wide (transformers' ``head_dim`` is that size: it is written so and not read),
and yarn's ``mscale_all_dim`` also scales the attention scores (:func:`~trickles.models.mla.mla_scale`).
``num_key_value_heads`` must equal ``num_attention_heads`` (transformers' latent attention has no other layout).
Multi-token prediction (:mod:`trickles.models.mtp`): the layers after the last block that hold an ``eh_proj`` are
imported into ``mtp.{k}`` (model.mtp_depth = their count; ``shared_head.head``, a copy of ``lm_head``, is not read),
and an export writes the model's as layers ``n_layers + k`` with ``num_nextn_predict_layers = model.mtp_depth``.

The experts (when ``first_k_dense_replace < num_hidden_layers``): ``first_k_dense_replace`` model.moe_first_dense
(every later block is MoE: ``moe_every=1``), ``n_routed_experts`` moe_experts, ``num_experts_per_tok`` moe_top_k,
``moe_intermediate_size`` moe_ffn_hidden, ``n_shared_experts`` moe_shared_experts (one MLP of ``n_shared_experts x
moe_intermediate_size`` units), ``n_group`` moe_groups, ``topk_group`` moe_topk_groups, ``routed_scaling_factor``
moe_routed_scale, ``norm_topk_prob`` moe_norm_topk, sigmoid scores (moe_router_score), dropless; the sequence-wise
balance loss's ``aux_loss_alpha`` (when ``seq_aux``) is moe_aux_loss (transformers trains none: absent, 0), no
z-loss. The bias balancing's rate is a training setting, not in the file (model.moe_bias_rate; 0 on import: the
checkpoint's bias is kept fixed). Refused: ``scoring_func`` other than sigmoid, ``topk_method`` other than
``noaux_tc`` (the original release's names; transformers reads neither and always routes so), ``moe_layer_freq``
other than 1, no shared expert; on export, what the routing cannot express (softmax scores, capacity, hard routing,
a sparse layer pattern, a gated or resized shared expert).

Tensor names: :mod:`.llama`'s embeddings, norms, MLP and head; per layer ``self_attn.{q_a_proj, q_a_layernorm,
q_b_proj}`` (or ``q_proj``), ``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, every tensor as
is under ``attn.`` with the same name (interleaved rotary dimensions are reordered at run time, not in the weights);
an MoE block's as :mod:`.qwen2_moe`'s (per expert, or transformers 5's fused in-memory names), the router's bias and
the shared experts under their own names (the bias is stored in fp32 whatever the export's type)::

    model.layers.{i}.mlp.gate.weight                        layers.{i}.mlp.router.weight
    model.layers.{i}.mlp.gate.e_score_correction_bias       layers.{i}.mlp.router.e_score_correction_bias
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight  layers.{i}.mlp.experts.{gate,up,down}_proj.weight[j]
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight  layers.{i}.mlp.shared.{gate,up,down}_proj.weight
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..mtp import hf_entries
from ..rope import rope_fields_from_hf
from .base import NORM_NAMES, llama_keys, llama_shape, merged, refuse
from .qwen2_moe import experts

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
DEFAULTS = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    hidden_act="silu",
    max_position_embeddings=4096,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleave=True,
    first_k_dense_replace=3,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    norm_topk_prob=True,
)
#: the latent attention fields, the same names on both sides
LATENT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    for key in ("attention_bias", "rope_interleave"):
        if not isinstance(c[key], bool):
            raise refuse(source, f"{key}={c[key]!r} is not true or false")
    if (c["num_key_value_heads"] or c["num_attention_heads"]) != c["num_attention_heads"]:
        raise refuse(source, f"num_key_value_heads={c['num_key_value_heads']} other than num_attention_heads")
    attn = c["attention_bias"]
    return llama_shape(
        {**c, "head_dim": None, "num_key_value_heads": None},  # head sizes are the latent fields'
        source,
        MODEL_TYPE,
        attention="mla",
        qkv_bias=attn,
        o_bias=attn,
        mlp_bias=False,
        **{key: c[key] for key in LATENT},
        **moe_fields(c, source),
        **rope_fields_from_hf(raw, source),
    )


def moe_fields(c: dict, source: str) -> dict:
    """The DeepSeekMoE fields of a ``config.json`` (``c``: merged with its defaults); none when every layer is
    dense."""
    dense, experts = c["first_k_dense_replace"] or 0, c["n_routed_experts"]
    if not experts or dense >= c["num_hidden_layers"]:
        return {}
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if c.get(key, want) != want:
            raise refuse(source, f"{key}={c[key]!r} (only {key}={want!r}, DeepSeek-V3's routing, is built)")
    if not c["n_shared_experts"]:
        raise refuse(source, "n_shared_experts=0 (transformers builds a shared expert of no width; give at least 1)")
    groups = c["n_group"] or 1
    return dict(
        moe_experts=experts,
        moe_top_k=c["num_experts_per_tok"],
        moe_every=1,
        moe_first_dense=dense,
        moe_ffn_hidden=c["moe_intermediate_size"],
        moe_shared_experts=c["n_shared_experts"],
        moe_router_score="sigmoid",
        moe_groups=groups,
        moe_topk_groups=c["topk_group"] or groups,
        moe_routed_scale=float(c["routed_scaling_factor"]),
        moe_norm_topk=bool(c["norm_topk_prob"]),
        moe_capacity_factor=0.0,
        moe_aux_loss=float(c.get("aux_loss_alpha") or 0.0) if c.get("seq_aux", True) else 0.0,
        moe_z_loss=0.0,
    )


def picks(cfg: ModelConfig) -> bool:
    """DeepSeek-V3 writes every model with latent attention."""
    return cfg.attention == "mla"


def to_hf(cfg: ModelConfig) -> dict:
    if cfg.attention != "mla" or cfg.flavor != "llama":
        raise ConfigError(
            f"model.family={MODEL_TYPE} writes llama-flavour models with model.attention=mla; unset model.family to "
            "export this one"
        )
    if cfg.bias("mlp") or cfg.bias("qkv") != cfg.bias("o"):
        raise ConfigError(
            "DeepSeek-V3's attention_bias is on q_a, kv_a and o alike and its MLP has none: set model.qkv_bias like "
            "model.o_bias and model.mlp_bias=false, or unset model.family"
        )
    keys = llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim)
    keys.update(head_dim=cfg.qk_rope_head_dim, num_key_value_heads=cfg.n_heads)
    return dict(
        **keys,
        **{key: getattr(cfg, key) for key in LATENT},
        **moe_keys(cfg),
        attention_bias=cfg.bias("qkv"),
        num_nextn_predict_layers=cfg.mtp_depth,
    )


def moe_keys(cfg: ModelConfig) -> dict:
    """The DeepSeekMoE keys of ``cfg`` (a dense model: ``first_k_dense_replace = num_hidden_layers``); ConfigError
    for routing DeepSeek-V3 does not have."""
    if not cfg.moe_experts:
        return dict(first_k_dense_replace=cfg.n_layers)
    off = [
        ("moe_router", "learned", cfg.moe_router),
        ("moe_router_score", "sigmoid", cfg.moe_router_score),
        ("moe_every", 1, cfg.moe_every),
        ("moe_capacity_factor", 0.0, cfg.moe_capacity_factor),
        ("moe_shared_gate", False, cfg.moe_shared_gate),
        ("moe_shared_ffn_hidden", None, cfg.moe_shared_ffn_hidden),
    ]
    for key, want, got in off:
        if got != want:
            raise ConfigError(f"DeepSeek-V3 has no model.{key}={got}; set model.{key}={want} to export it")
    if cfg.moe_shared_experts < 1:
        raise ConfigError("DeepSeek-V3's MoE blocks have shared experts; set model.moe_shared_experts >= 1 to export")
    return dict(
        first_k_dense_replace=cfg.moe_first_dense,
        n_routed_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_ffn_dim,
        n_shared_experts=cfg.moe_shared_experts,
        n_group=cfg.moe_groups,
        topk_group=cfg.moe_groups if cfg.moe_topk_groups is None else cfg.moe_topk_groups,
        routed_scaling_factor=cfg.moe_routed_scale,
        norm_topk_prob=cfg.moe_top_k > 1 if cfg.moe_norm_topk is None else cfg.moe_norm_topk,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
        aux_loss_alpha=cfg.moe_aux_loss,
        seq_aux=True,
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    bias = cfg.bias("qkv")
    query = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    parts = (*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    biased = {"q_a_proj", "kv_a_proj_with_mqa"} if bias else set()
    biased |= {"o_proj"} if cfg.bias("o") else set()
    moe = experts(cfg, found, shared="shared_experts")
    out = [Entry("model.embed_tokens.weight", ("embed.weight",))]
    for i in range(cfg.n_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        out += [Entry(f"{hf}{theirs}.weight", (f"{us}{ours}.weight",)) for theirs, ours in NORM_NAMES["pre"]]
        for part in parts:
            for leaf in ("weight", "bias") if part in biased else ("weight",):
                out.append(Entry(f"{hf}self_attn.{part}.{leaf}", (f"{us}attn.{part}.{leaf}",)))
        if i in cfg.moe_layers:
            out += moe(i, hf, us)
        else:
            out += [Entry(f"{hf}mlp.{p}_proj.weight", (f"{us}mlp.{p}_proj.weight",)) for p in ("gate", "up", "down")]
    out.append(Entry("model.norm.weight", ("norm.weight",)))
    return out + hf_entries(cfg, weight_map, found)  # the multi-token prediction layers after the last block
