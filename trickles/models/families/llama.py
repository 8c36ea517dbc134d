"""Llama (``model_type: llama``, ``LlamaForCausalLM``): Llama 1/2/3 and the many models that share its layout.

Config, both ways: ``hidden_size`` d_model, ``num_hidden_layers`` n_layers, ``num_attention_heads`` n_heads,
``num_key_value_heads`` n_kv_heads (null: n_heads), ``head_dim`` head_size (only where it differs from
``hidden_size / num_attention_heads``: a pruned model), ``intermediate_size`` ffn_hidden, ``vocab_size``,
``max_position_embeddings`` max_seq_len, ``rms_norm_eps`` norm_eps, ``tie_word_embeddings``,
``initializer_range`` init_std, the rotary fields (:mod:`trickles.models.rope`); ``attention_bias`` is ``qkv_bias``
and ``o_bias`` together (Llama puts the bias on q, k, v **and** o), ``mlp_bias`` is ``mlp_bias`` (gate, up, down).

Refused: ``hidden_act`` other than silu; on export, a model whose q/k/v and o biases differ (that is Qwen2's
layout: export it as ``model.family=qwen2``). Fields left out take transformers' defaults.

Tensor names (:func:`~.base.llama_names`): ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``self_attn.{q,k,v,o}_proj.{weight,bias}``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj.{weight,bias}``,
``model.norm``, ``lm_head``; every tensor as is (HF Llama uses the rotate-half rotary convention this model uses,
so q/k need no permutation).
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import dense_llama, llama_keys, llama_names, llama_shape, merged, refuse, require_biases, require_dense_llama

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
DEFAULTS = dict(
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


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    for key in ("attention_bias", "mlp_bias"):
        if not isinstance(c[key], bool):
            raise refuse(source, f"{key}={c[key]!r} is not true or false")
    attn = c["attention_bias"]
    return llama_shape(
        c, source, MODEL_TYPE, qkv_bias=attn, o_bias=attn, mlp_bias=c["mlp_bias"], **rope_fields_from_hf(raw, source)
    )


def picks(cfg: ModelConfig) -> bool:
    """Llama writes every dense llama-flavour model whose q/k/v and o biases agree."""
    return dense_llama(cfg) and cfg.bias("qkv") == cfg.bias("o")


def to_hf(cfg: ModelConfig) -> dict:
    require_dense_llama(cfg, MODEL_TYPE)
    if cfg.bias("qkv") != cfg.bias("o"):
        require_biases(
            cfg,
            "Llama (attention_bias)",
            cfg.bias("qkv"),
            cfg.bias("qkv"),
            cfg.bias("mlp"),
            "Llama's attention_bias puts a bias on q, k, v and o alike: set model.o_bias like model.qkv_bias, or "
            "export q/k/v biases alone as model.family=qwen2",
        )
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim),
        attention_bias=cfg.bias("qkv"),
        mlp_bias=cfg.bias("mlp"),
        pretraining_tp=1,
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
