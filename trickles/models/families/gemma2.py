"""Gemma 2 (``model_type: gemma2``, ``Gemma2ForCausalLM``): Llama's layout with Gemma's parts.

Config, both ways: the shape as :mod:`.llama` (``head_dim`` always explicit, 256 by default, and usually not
``hidden_size / num_attention_heads``), with Gemma's parts as model fields:

* token embeddings times ``sqrt(hidden_size)``, the factor rounded to the embedding's dtype: ``model.embed_scale``;
* every RMSNorm scales by ``(1 + weight)`` in fp32: ``model.norm_unit_offset``;
* ``hidden_activation`` ``gelu_pytorch_tanh`` (GeGLU): ``model.mlp_activation=gelu_tanh`` (no other activation);
* norms before **and** after attention and the MLP: ``model.norm_placement=sandwich`` (``input_layernorm``,
  ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``);
* ``attn_logit_softcapping`` and ``final_logit_softcapping`` (null: off): ``model.attn_softcap``,
  ``model.final_softcap``;
* ``query_pre_attn_scalar``: scores scaled by its ``** -0.5``: ``model.query_pre_attn_scalar``;
* ``layer_types`` (``sliding_attention`` / ``full_attention``; absent: transformers' default, layers 0, 2, 4, ...
  slide) with ``sliding_window``: ``model.window_layers`` and ``model.sliding_window`` (Mistral's rule: the query at
  ``q`` sees keys ``q - sliding_window < k <= q``);
* ``attention_bias`` (false by default): a bias on q, k, v **and** o; the MLP has none;
* embeddings tied by default (``tie_word_embeddings`` true); one rotary table for every layer (the rotary fields
  of :mod:`trickles.models.rope`).

Refused in one line: another activation, ``use_bidirectional_attention``, sliding layers without a window, layer
types other than the two; on export a model without every Gemma part above, or with a rotary base of its own for
the sliding layers (that is Gemma 3). Tensor names: :mod:`.llama`'s with the four sandwich norms.
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import (
    attention_bias_key,
    attention_biases,
    dense_llama,
    layer_types,
    llama_keys,
    llama_names,
    llama_shape,
    merged,
    refuse,
    require_dense_llama,
    typed_windows,
)

MODEL_TYPE = "gemma2"
ARCHITECTURE = "Gemma2ForCausalLM"
DEFAULTS = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=8192,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
)
#: the activation Gemma's MLP is built with (``hidden_activation``)
ACTIVATION = "gelu_pytorch_tanh"


def gemma_shape(raw: dict, c: dict, source: str, family: str, types: list, **fields) -> ModelConfig:
    """The :class:`ModelConfig` of a Gemma ``config.json`` ``raw`` (``c``: merged with its defaults; ``types``: its
    layer types, defaults applied); ``fields``: the family's own (q/k norm, rotary fields). A null soft-cap or
    window in ``raw`` is off, as in transformers (not the default)."""
    if c["hidden_activation"] != ACTIVATION:
        raise refuse(source, f"hidden_activation={c['hidden_activation']!r} (only {ACTIVATION})")
    if c.get("use_bidirectional_attention"):
        raise refuse(source, "use_bidirectional_attention=true (trickles' attention is causal)")
    caps = {}
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        value = raw[key] if key in raw else c.get(key)
        caps[field] = None if value is None else float(value)
    window = raw["sliding_window"] if "sliding_window" in raw else c["sliding_window"]
    return llama_shape(
        c,
        source,
        family,
        **attention_biases(c, source),
        mlp_activation="gelu_tanh",
        embed_scale=True,
        norm_unit_offset=True,
        norm_placement="sandwich",
        query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
        **caps,
        **typed_windows(types, window, source, c["num_hidden_layers"]),
        **fields,
    )


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(c["num_hidden_layers"])
    ]
    return gemma_shape(raw, c, source, MODEL_TYPE, types, **rope_fields_from_hf(raw, source))


def is_gemma(cfg: ModelConfig, qk_norm: str) -> bool:
    """Whether ``cfg`` is a dense llama-flavour model with every Gemma part and q/k norm ``qk_norm``."""
    return (
        dense_llama(cfg)
        and cfg.qk_norm == qk_norm
        and cfg.norm_placement == "sandwich"
        and cfg.norm_unit_offset
        and cfg.embed_scale
        and cfg.mlp_activation == "gelu_tanh"
        and cfg.bias("qkv") == cfg.bias("o")
        and not cfg.bias("mlp")
    )


def picks(cfg: ModelConfig) -> bool:
    """Gemma 2 writes a Gemma-part model without q/k norms (refusing, on export, a rotary base of the sliding
    layers' own)."""
    return is_gemma(cfg, "none")


def gemma_keys(cfg: ModelConfig, model_type: str, architecture: str, qk_norm: str) -> dict:
    """The ``config.json`` keys both Gemma families write (ConfigError naming the field the family lacks)."""
    require_dense_llama(cfg, model_type)
    name = "Gemma 2" if model_type == MODEL_TYPE else "Gemma 3"
    for key, want in (("norm_unit_offset", True), ("embed_scale", True), ("mlp_activation", "gelu_tanh")):
        if getattr(cfg, key) != want:
            raise ConfigError(
                f"{name} has model.{key}={str(want).lower()}, but this model has {str(getattr(cfg, key)).lower()}; "
                "unset model.family to export it as another family"
            )
    bias = attention_bias_key(cfg, name)
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    if scalar != int(scalar):
        raise ConfigError(f"{name}'s query_pre_attn_scalar is an integer, but model.query_pre_attn_scalar={scalar}")
    keys = llama_keys(cfg, model_type, architecture, cfg.ffn_dim, qk_norm=qk_norm, placement="sandwich", gemma=True)
    windowed = any(t == "sliding_attention" for t in layer_types(cfg))
    keys.update(
        hidden_act=ACTIVATION,
        hidden_activation=ACTIVATION,
        **bias,
        query_pre_attn_scalar=int(scalar),
        attn_logit_softcapping=cfg.attn_softcap,
        final_logit_softcapping=cfg.final_softcap,
        # a model without sliding layers writes transformers' default window, which no layer reads
        sliding_window=cfg.sliding_window if windowed else DEFAULTS["sliding_window"],
        layer_types=layer_types(cfg),
        use_bidirectional_attention=False,
    )
    return keys


def to_hf(cfg: ModelConfig) -> dict:
    if cfg.rope_local_theta is not None:
        raise ConfigError(
            "Gemma 2 has one rotary base for every layer, but model.rope_local_theta is set; unset it or export as "
            "model.family=gemma3_text"
        )
    return gemma_keys(cfg, MODEL_TYPE, ARCHITECTURE, "none")


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
