"""Qwen3-MoE (``model_type: qwen3_moe``, ``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm,
``attention_bias`` on q, k, v and o) with mixture-of-experts blocks and no shared expert.

Config, both ways: as :mod:`.qwen3` for attention, and the routing as :mod:`.qwen2_moe` reads and writes it
(``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
``router_aux_loss_coef``; softmax top-k, dropless, learned; no z-loss), without the shared expert; transformers 5
writes the expert count as ``num_local_experts``, read as ``num_experts``. The same refusals
(``mlp_only_layers``, sliding windows; on export, shared experts and what Qwen MoE routing cannot express).

Tensor names: :mod:`.qwen3`'s, and each MoE block's router and experts as :mod:`.qwen2_moe`'s
(``mlp.gate.weight``, ``mlp.experts.{j}.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import attention_bias_key, attention_biases, llama_keys, llama_names, llama_shape, merged
from .qwen2_moe import check_moe, experts, moe_fields, moe_keys

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    num_experts=128,
    norm_topk_prob=False,
    router_aux_loss_coef=0.001,
    mlp_only_layers=None,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    return llama_shape(
        c,
        source,
        MODEL_TYPE,
        **attention_biases(c, source),
        qk_norm="head",
        moe_shared_experts=0,
        **moe_fields(c, source),
        **rope_fields_from_hf(raw, source),
    )


def picks(cfg: ModelConfig) -> bool:
    """Qwen3-MoE writes a mixture of experts with per-head q/k norms and no shared expert."""
    return bool(cfg.moe_experts) and cfg.qk_norm == "head" and not cfg.moe_shared_experts


def to_hf(cfg: ModelConfig) -> dict:
    check_moe(cfg, MODEL_TYPE)
    if cfg.moe_shared_experts:
        raise ConfigError(
            f"Qwen3-MoE has no shared experts, but model.moe_shared_experts={cfg.moe_shared_experts}; set it to 0 "
            "(or export a gated one as qwen2_moe)"
        )
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim, qk_norm="head"),
        **moe_keys(cfg),
        **attention_bias_key(cfg, "Qwen3-MoE"),
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg, experts(cfg, found))
