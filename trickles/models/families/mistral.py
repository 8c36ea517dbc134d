"""Mistral (``model_type: mistral``, ``MistralForCausalLM``): Llama without biases, plus a sliding window.

Config, both ways: as :mod:`.llama` (no ``attention_bias`` / ``mlp_bias``: Mistral has no biases), with Mistral's
defaults (8 key/value heads, ``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 131072).

``sliding_window`` is ``model.sliding_window``, on every layer: each token attends to the last ``sliding_window``
positions, itself included (transformers' ``kv_idx > q_idx - sliding_window``). A null window is full causal
attention; one at least ``max_position_embeddings`` long never cuts and imports as it is. Note a config.json that
leaves the field out gets transformers' default window of 4096. A per-layer pattern (``model.window_layers``) has
no Mistral field: such a model exports as another family. Exports write ``sliding_window`` back.
Tensor names: :mod:`.llama`'s, without biases.
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import llama_keys, llama_names, llama_shape, merged, require_biases, require_dense_llama

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"
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
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    sliding_window=4096,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    if "sliding_window" in raw and raw["sliding_window"] is None:
        c["sliding_window"] = None
    # (a layer_types list is ignored, as transformers' MistralForCausalLM ignores it)
    return llama_shape(c, source, MODEL_TYPE, sliding_window=c["sliding_window"], **rope_fields_from_hf(raw, source))


def picks(cfg: ModelConfig) -> bool:
    """Mistral is written only when asked for by ``model.family`` (without a window it is a Llama)."""
    return False


def to_hf(cfg: ModelConfig) -> dict:
    require_dense_llama(cfg, MODEL_TYPE)
    require_biases(cfg, "Mistral", False, False, False, "unset model.family to export it as a Llama")
    if cfg.window_layers is not None and not all(cfg.window_layers):
        raise ConfigError(
            "Mistral's sliding window applies to every layer; set model.window_layers=none or export as qwen2"
        )
    return dict(**llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim), sliding_window=cfg.sliding_window)


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
