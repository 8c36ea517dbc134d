"""The Hugging Face ``config.json`` both ways: :func:`config_from_hf` (import) and :func:`config_to_hf` (export).

The shared part only: the family comes from ``model_type`` on import and from ``model.family`` (or the model's
parts) on export, and each family's module (:mod:`trickles.models.families`) maps its own fields, refusing with the
field's name what this model cannot reproduce exactly. Here: the checks every family shares (quantized weights are
refused; the result must be a shape trickles builds), and the keys every family writes alike (vocabulary size,
tying, initialization, dtype, token ids). A loaded model has dropout 0; its ``bos/eos/pad_token_id`` are kept in
``model.hf_token_ids`` and written back by :func:`~trickles.models.hf_export.save_hf`.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, ConfigError
from . import families
from .config import ModelConfig
from .hf_names import CONFIG

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_from_hf(raw: dict, source: str = CONFIG) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` dict (CheckpointError if impossible)."""
    family = families.for_model_type(raw.get("model_type"), source)
    if raw.get("quantization_config"):
        raise CheckpointError(
            f"{source}: the weights are quantized (quantization_config is set), which trickles' transformer cannot "
            "represent exactly; load the unquantized checkpoint"
        )
    cfg = family.from_hf(raw, source)
    try:
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{source} describes a shape trickles cannot build: {e}") from None
    return cfg


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype, token_ids: dict | None = None) -> dict:
    """The ``config.json`` dict of a trickles model (ConfigError if Hugging Face has no such model)."""
    ids = {
        k: v for k, v in (token_ids or {}).items() if k in TOKEN_IDS and isinstance(v, int) and 0 <= v < cfg.vocab_size
    }
    own = families.for_config(cfg).to_hf(cfg)
    return dict(
        **own,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tied,
        initializer_range=cfg.init_std,
        use_cache=True,
        torch_dtype=_dtype_name(dtype),
        dtype=_dtype_name(dtype),
        **{k: ids.get(k) for k in TOKEN_IDS},
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
