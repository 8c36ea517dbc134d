"""Qwen3 (``model_type: qwen3``, ``Qwen3ForCausalLM``): Llama with a per-head RMSNorm of queries and keys.

Config, both ways: as :mod:`.llama`, with ``model.qk_norm=head`` (``self_attn.q_norm`` and ``k_norm``: an RMSNorm
over each head's ``head_dim``, one weight ``[head_dim]`` shared by the heads, after the projections and before
rotary) and Qwen3's defaults (``head_dim`` 128, written explicitly, so it is usually not ``hidden_size /
num_attention_heads``). ``attention_bias`` (false by default) puts a bias on q, k, v **and** o, as Llama's does; the
MLP has no bias and no field to add one.

Sliding windows: as :mod:`.qwen2` reads and writes them (``use_sliding_window``, ``sliding_window``,
``max_window_layers``, ``layer_types``; the same rules in transformers' ``Qwen3Config``).
Tensor names: :mod:`.llama`'s plus ``self_attn.{q,k}_norm.weight``.
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import (
    attention_bias_key,
    attention_biases,
    dense_llama,
    llama_keys,
    llama_names,
    llama_shape,
    merged,
    qwen_window_keys,
    qwen_windows,
    require_dense_llama,
)

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    return llama_shape(
        c,
        source,
        MODEL_TYPE,
        **attention_biases(c, source),
        qk_norm="head",
        **qwen_windows(c, source),
        **rope_fields_from_hf(raw, source),
    )


def picks(cfg: ModelConfig) -> bool:
    """Qwen3 writes a dense llama-flavour pre-norm model with per-head q/k norms."""
    return (
        dense_llama(cfg)
        and cfg.qk_norm == "head"
        and cfg.norm_placement == "pre"
        and cfg.bias("qkv") == cfg.bias("o")
        and not cfg.bias("mlp")
    )


def to_hf(cfg: ModelConfig) -> dict:
    require_dense_llama(cfg, MODEL_TYPE)
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim, qk_norm="head"),
        **attention_bias_key(cfg, "Qwen3"),
        **qwen_window_keys(cfg),
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
