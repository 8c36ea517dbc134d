"""Qwen2 and Qwen2.5 (``model_type: qwen2``, ``Qwen2ForCausalLM``): Llama with a bias on q, k and v only.

Config, both ways: as :mod:`.llama` (``qkv_bias=true``, ``o_bias=false``, ``mlp_bias=false``: Qwen2's attention
output and MLP projections have no bias, and its config has no field to change that), with Qwen2's defaults.

Sliding windows, as transformers' ``Qwen2Config`` reads them: with ``use_sliding_window: true`` and a
``sliding_window``, layer ``i`` slides where ``layer_types[i]`` is ``sliding_attention``, or, without
``layer_types``, where ``i >= max_window_layers`` (the first ``max_window_layers`` keep full attention):
``model.sliding_window`` and ``model.window_layers``. With ``use_sliding_window: false``, ``sliding_window`` may
hold any value (the published Qwen2.5 configs carry 32768 or 131072): transformers ignores it, and so does this
import; ``layer_types`` naming ``sliding_attention`` layers then has no window to apply and is refused. Exports write
``use_sliding_window`` with the window and ``layer_types`` (all ``full_attention`` without a window).
Tensor names: :mod:`.llama`'s, with ``self_attn.{q,k,v}_proj.bias``.
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import (
    dense_llama,
    llama_keys,
    llama_names,
    llama_shape,
    merged,
    qwen_window_keys,
    qwen_windows,
    require_biases,
    require_dense_llama,
)

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"
DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_sliding_window=False,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    return llama_shape(
        c,
        source,
        MODEL_TYPE,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        **qwen_windows(c, source),
        **rope_fields_from_hf(raw, source),
    )


def picks(cfg: ModelConfig) -> bool:
    """Qwen2 writes a dense llama-flavour model with biases on q, k and v only."""
    return dense_llama(cfg) and cfg.bias("qkv") and not cfg.bias("o") and not cfg.bias("mlp")


def to_hf(cfg: ModelConfig) -> dict:
    require_dense_llama(cfg, MODEL_TYPE)
    require_biases(cfg, "Qwen2", True, False, False, "set it so, or unset model.family to export it as a Llama")
    return dict(**llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim), **qwen_window_keys(cfg))


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
