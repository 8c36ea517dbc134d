"""DeepSeek-V3 (``model_type: deepseek_v3``, ``DeepseekV3ForCausalLM``): multi-head latent attention
(:mod:`trickles.models.mla`) in Llama's pre-norm block. Only its dense form is built so far: every layer's MLP dense,
``first_k_dense_replace`` equal to ``num_hidden_layers`` (DeepSeekMoE's layers are refused on import and export).

Config, both ways: as :mod:`.llama` (``intermediate_size`` the dense MLP's width) with ``model.attention=mla`` and
``q_lora_rank`` (null: one ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``rope_interleave`` under the same names; ``attention_bias`` is ``qkv_bias`` and ``o_bias`` together (a bias on
``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``; ``q_proj``, ``q_b_proj`` and ``kv_b_proj`` never have one). The
rotary tables are ``qk_rope_head_dim`` wide (transformers' ``head_dim`` is that size: it is written so and not read),
and yarn's ``mscale_all_dim`` also scales the attention scores (:func:`~trickles.models.mla.mla_scale`).
``num_key_value_heads`` must equal ``num_attention_heads`` (transformers' latent attention has no other layout).
``num_nextn_predict_layers`` (multi-token prediction) is not imported; a checkpoint's extra layers holding it are not
read.

Tensor names: :mod:`.llama`'s embeddings, norms, MLP and head; per layer ``self_attn.{q_a_proj, q_a_layernorm,
q_b_proj}`` (or ``q_proj``), ``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, every tensor as
is under ``attn.`` with the same name (interleaved rotary dimensions are reordered at run time, not in the weights).
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import NORM_NAMES, llama_keys, llama_shape, merged, refuse

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
)
#: the latent attention fields, the same names on both sides
LATENT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    for key in ("attention_bias", "rope_interleave"):
        if not isinstance(c[key], bool):
            raise refuse(source, f"{key}={c[key]!r} is not true or false")
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    if dense is None or dense < layers:
        raise refuse(
            source, f"first_k_dense_replace={dense} below num_hidden_layers={layers} (DeepSeekMoE layers are not built)"
        )
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
        **rope_fields_from_hf(raw, source),
    )


def picks(cfg: ModelConfig) -> bool:
    """DeepSeek-V3 writes every model with latent attention."""
    return cfg.attention == "mla"


def to_hf(cfg: ModelConfig) -> dict:
    if cfg.attention != "mla" or cfg.flavor != "llama" or cfg.moe_experts:
        raise ConfigError(
            f"model.family={MODEL_TYPE} writes dense models with model.attention=mla (its experts are not built yet); "
            "unset model.family to export this one"
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
        attention_bias=cfg.bias("qkv"),
        first_k_dense_replace=cfg.n_layers,
        num_nextn_predict_layers=0,
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    bias = cfg.bias("qkv")
    query = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    parts = (*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    biased = {"q_a_proj", "kv_a_proj_with_mqa"} if bias else set()
    biased |= {"o_proj"} if cfg.bias("o") else set()
    out = [Entry("model.embed_tokens.weight", ("embed.weight",))]
    for i in range(cfg.n_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        out += [Entry(f"{hf}{theirs}.weight", (f"{us}{ours}.weight",)) for theirs, ours in NORM_NAMES["pre"]]
        for part in parts:
            for leaf in ("weight", "bias") if part in biased else ("weight",):
                out.append(Entry(f"{hf}self_attn.{part}.{leaf}", (f"{us}attn.{part}.{leaf}",)))
        out += [Entry(f"{hf}mlp.{p}_proj.weight", (f"{us}mlp.{p}_proj.weight",)) for p in ("gate", "up", "down")]
    out.append(Entry("model.norm.weight", ("norm.weight",)))
    return out
