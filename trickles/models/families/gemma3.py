"""Gemma 3, text only (``model_type: gemma3_text``, ``Gemma3ForCausalLM``): Gemma 2 with per-head q/k norms and a
rotary base of its own for the sliding-window layers.

Config, both ways: as :mod:`.gemma2` (embedding scale, ``(1 + w)`` RMSNorms, GeGLU, sandwich norms,
``query_pre_attn_scalar``, ``final_logit_softcapping``, ``layer_types`` with ``sliding_window``, ``attention_bias``
on q, k, v and o, tied embeddings), with Gemma 3's defaults (vocabulary 262208, ``max_position_embeddings`` 131072,
no soft-capping) and:

* ``self_attn.q_norm`` / ``k_norm``: an RMSNorm (``(1 + w)`` like the others) over each head's ``head_dim``,
  before rotary: ``model.qk_norm=head``;
* without ``layer_types``, every ``sliding_window_pattern``-th layer (6 by default) is a full one, the rest slide;
* the rotary embedding per layer type. transformers 5.x writes ``rope_parameters`` as
  ``{"sliding_attention": {...}, "full_attention": {...}}``; 4.x wrote ``rope_theta`` (the full layers' base, 1e6
  by default), ``rope_local_base_freq`` (the sliding layers', 1e4 by default) and ``rope_scaling`` (the full layers'
  scaling: Gemma 3 12b/27b have ``linear`` with factor 8). The full layers' rope is the model's rotary fields
  (:mod:`trickles.models.rope`: any type built there), the sliding layers' base ``model.rope_local_theta`` (their
  rope is always unscaled: another type there is refused). Export writes both forms.

Refused in one line, besides :mod:`.gemma2`'s refusals: a non-null ``attn_logit_softcapping`` (transformers'
``Gemma3Attention`` does not apply it, so the checkpoint's behaviour is ambiguous); ``rope_parameters`` that is
neither per layer type nor absent; on export a model with ``model.attn_softcap``, or whose sliding layers would need
a scaled rope (``model.rope_type`` other than default with ``model.rope_local_theta`` unset).
Tensor names: :mod:`.gemma2`'s plus ``self_attn.{q,k}_norm.weight``.
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from . import gemma2
from .base import layer_types, llama_names, merged, refuse

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
DEFAULTS = dict(
    gemma2.DEFAULTS,
    vocab_size=262208,
    max_position_embeddings=131072,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
)
#: transformers' rotary bases by layer type, where a config.json gives none
THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
TYPES = ("sliding_attention", "full_attention")


def _rope_by_type(raw: dict, source: str) -> dict[str, dict]:
    """Each layer type's rope parameters, as ``Gemma3TextConfig`` assembles them from 5.x's or 4.x's keys."""
    params = raw.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or set(params) - set(TYPES)):
        raise refuse(source, f"rope_parameters={params!r} (Gemma 3 gives one dict per layer type: {', '.join(TYPES)})")
    out = {t: dict((params or {}).get(t) or {"rope_type": "default"}) for t in TYPES}
    if raw.get("rope_scaling"):
        out["full_attention"].update(raw["rope_scaling"])
    out["full_attention"].setdefault("rope_theta", raw.get("rope_theta") or THETA["full_attention"])
    out["sliding_attention"].setdefault("rope_theta", raw.get("rope_local_base_freq") or THETA["sliding_attention"])
    return out


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    if c.get("attn_logit_softcapping") is not None:
        raise refuse(
            source,
            f"attn_logit_softcapping={c['attn_logit_softcapping']} (transformers' Gemma3Attention does not apply "
            "it; set it to null)",
        )
    types = c.get("layer_types")
    if types is None:
        every = c.get("sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(c["num_hidden_layers"])]
    rope = _rope_by_type(raw, source)
    fields = rope_fields_from_hf(
        {"rope_parameters": rope["full_attention"], "max_position_embeddings": c["max_position_embeddings"]},
        f"{source}: rope_parameters.full_attention",
    )
    local = rope["sliding_attention"]
    if "sliding_attention" in types:
        if (local.get("rope_type", local.get("type")) or "default") != "default" or local.get(
            "partial_rotary_factor", 1.0
        ) not in (1, 1.0):
            raise refuse(source, f"rope_parameters.sliding_attention={local} (the sliding layers' rope is unscaled)")
        fields["rope_local_theta"] = float(local["rope_theta"])
    return gemma2.gemma_shape(raw, c, source, MODEL_TYPE, types, qk_norm="head", **fields)


def picks(cfg: ModelConfig) -> bool:
    """Gemma 3 writes a Gemma-part model with per-head q/k norms."""
    return gemma2.is_gemma(cfg, "head")


def to_hf(cfg: ModelConfig) -> dict:
    if cfg.attn_softcap is not None:
        raise ConfigError(
            "Gemma 3 has no attention soft-capping, but model.attn_softcap is set; unset it or export as "
            "model.family=gemma2"
        )
    local = cfg.rope_local_theta
    sliding = "sliding_attention" in layer_types(cfg)
    if local is None and sliding and cfg.rope_type != "default":
        raise ConfigError(
            f"Gemma 3's sliding layers have an unscaled rope, but model.rope_type={cfg.rope_type} applies to every "
            "layer here; set model.rope_local_theta (their base) or model.rope_type=default"
        )
    keys = gemma2.gemma_keys(cfg, MODEL_TYPE, ARCHITECTURE, "head")
    local = local if local is not None else cfg.rope_theta
    keys["rope_parameters"] = {
        "full_attention": keys["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
    keys["rope_local_base_freq"] = local
    return keys


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg)
