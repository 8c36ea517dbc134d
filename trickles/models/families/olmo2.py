"""OLMo 2 (``model_type: olmo2``, ``Olmo2ForCausalLM``): Llama with its norms after attention and the MLP, and a
full-width RMSNorm of queries and keys.

Config, both ways: as :mod:`.llama`, with ``model.norm_placement=post`` (``h = x + norm(attn(x))``, ``y = h +
norm(mlp(h))``, no norm before either branch: ``post_attention_layernorm`` and ``post_feedforward_layernorm``) and
``model.qk_norm=full`` (``self_attn.q_norm`` over the whole projected query, weight ``[n_heads * head_dim]``,
``k_norm`` over the keys, ``[n_kv_heads * head_dim]``, after the projections and before rotary), with OLMo 2's
defaults (vocabulary 50304, ``rms_norm_eps`` 1e-5). ``attention_bias`` (false by default) puts a bias on q, k, v
and o; the MLP has none. The head size is ``hidden_size / num_attention_heads`` (transformers reads a ``head_dim``
field where a config has one, and so does this import). Tensor names: :mod:`.llama`'s, with the two post norms in
place of ``input_layernorm`` / ``post_attention_layernorm`` and ``self_attn.{q,k}_norm.weight``.
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
    require_dense_llama,
)

MODEL_TYPE = "olmo2"
ARCHITECTURE = "Olmo2ForCausalLM"
DEFAULTS = dict(
    vocab_size=50304,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    return llama_shape(
        c,
        source,
        MODEL_TYPE,
        **attention_biases(c, source),
        qk_norm="full",
        norm_placement="post",
        **rope_fields_from_hf(raw, source),
    )


def picks(cfg: ModelConfig) -> bool:
    """OLMo 2 writes a dense llama-flavour post-norm model with full-width q/k norms."""
    return (
        dense_llama(cfg)
        and cfg.qk_norm == "full"
        and cfg.norm_placement == "post"
        and cfg.bias("qkv") == cfg.bias("o")
        and not cfg.bias("mlp")
    )


def to_hf(cfg: ModelConfig) -> dict:
    require_dense_llama(cfg, MODEL_TYPE)
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim, qk_norm="full", placement="post"),
        **attention_bias_key(cfg, "OLMo 2"),
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
