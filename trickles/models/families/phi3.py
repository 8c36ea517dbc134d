"""Phi-3 (``model_type: phi3``, ``Phi3ForCausalLM``): Llama with fused checkpoint tensors and an optional window.

Config, both ways: as :mod:`.llama` without biases (Phi-3 has none), with Phi-3's defaults (vocabulary 32064,
``rms_norm_eps`` 1e-5, ``max_position_embeddings`` 4096). ``head_dim`` is read where a config.json has one, as
transformers' ``Phi3Attention`` does (``hidden_size / num_attention_heads`` otherwise). ``resid_pdrop``,
``embd_pdrop`` and ``attention_dropout`` are dropout, off in a loaded model; ``original_max_position_embeddings``
is read by long-context rotary scaling only and written back as ``max_position_embeddings``.

``sliding_window`` is ``model.sliding_window`` on every layer, with Mistral's rule (the query at ``q`` sees keys
``q - sliding_window < k <= q``: transformers' ``create_sliding_window_causal_mask`` takes the config's number as
it is, so Phi-3-mini-4k's 2047 is 2047 keys); null is full causal attention. A per-layer window pattern has no
Phi-3 field and is refused on export.

Rotary: only the ``default`` type. ``longrope`` (and ``su`` / ``yarn``, which ``Phi3Config`` renames to it: the
128k models' per-dimension short/long factor lists) and every other type are refused in one line, as is a
``partial_rotary_factor`` other than 1.

Tensor names: :mod:`.llama`'s, except two fused tensors: ``self_attn.qkv_proj.weight`` is ``[q; k; v]`` stacked
along the output dimension (``n_heads * head_dim`` query rows, then the key rows, then the value rows: not the
kv-group interleaving of :mod:`trickles.models.fused`) and ``mlp.gate_up_proj.weight`` is ``[gate; up]``. Import
splits them into the parts (a model built with fused projections then fuses the parts its own way); export
concatenates them back.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from .base import llama_keys, llama_names, llama_shape, merged, refuse, require_biases, require_dense_llama

MODEL_TYPE = "phi3"
ARCHITECTURE = "Phi3ForCausalLM"
DEFAULTS = dict(
    vocab_size=32064,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    hidden_act="silu",
    max_position_embeddings=4096,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    sliding_window=None,
    head_dim=None,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(field) or {}
    kind = (params.get("rope_type", params.get("type")) if isinstance(params, dict) else None) or "default"
    if kind != "default":
        why = " (per-dimension short/long factor lists)" if kind in ("longrope", "su", "yarn") else ""
        raise refuse(source, f"{field}.rope_type={kind!r}{why}; Phi-3 is built with the default rotary only")
    return llama_shape(c, source, MODEL_TYPE, sliding_window=c["sliding_window"], **rope_fields_from_hf(raw, source))


def picks(cfg: ModelConfig) -> bool:
    """Phi-3 is written only when asked for by ``model.family`` (its layout is a Llama's or a Mistral's)."""
    return False


def to_hf(cfg: ModelConfig) -> dict:
    require_dense_llama(cfg, MODEL_TYPE)
    require_biases(cfg, "Phi-3", False, False, False, "unset model.family to export it as a Llama")
    if cfg.window_layers is not None and not all(cfg.window_layers):
        raise ConfigError(
            "Phi-3's sliding window applies to every layer; set model.window_layers=none or export as qwen2"
        )
    if cfg.rope_type != "default":
        raise ConfigError(
            f"Phi-3 is written with the default rotary only, but model.rope_type={cfg.rope_type}; unset model.family"
        )
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim),
        sliding_window=cfg.sliding_window,
        original_max_position_embeddings=cfg.max_seq_len,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
    )


#: the fused Hugging Face tensors: (their name in a layer, our module, our parts in their order)
FUSED = (("self_attn.qkv_proj", "attn", ("q", "k", "v")), ("mlp.gate_up_proj", "mlp", ("gate", "up")))
_PART = re.compile(r"\.(self_attn\.[qkv]|mlp\.(gate|up))_proj\.weight$")


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    """:func:`~.base.llama_names` with each layer's q/k/v and gate/up weights as one ``cat0`` entry each."""
    out = [e for e in llama_names(cfg) if not _PART.search(e.hf)]
    for i in range(cfg.n_layers):
        for theirs, ours, parts in FUSED:
            names = tuple(f"layers.{i}.{ours}.{p}_proj.weight" for p in parts)
            out.append(Entry(f"model.layers.{i}.{theirs}.weight", names, "cat0"))
    return out
