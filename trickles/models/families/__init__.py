"""Model families as data: one module per Hugging Face ``model_type``, and the registry the shared machinery uses.

A family module holds, and nothing else does:

* ``MODEL_TYPE``, ``ARCHITECTURE``: its ``config.json`` names (``qwen2``, ``Qwen2ForCausalLM``);
* ``DEFAULTS``: transformers' defaults for the fields a ``config.json`` may leave out;
* ``from_hf(raw, source) -> ModelConfig``: the import mapping, refusing (CheckpointError, naming the field) what
  the model cannot reproduce exactly;
* ``to_hf(cfg) -> dict``: the export mapping, the family's own ``config.json`` keys (ConfigError where the family
  cannot express the model); the shared keys (vocabulary, tying, dtype, token ids) are
  :func:`~trickles.models.hf_config.config_to_hf`'s;
* ``picks(cfg) -> bool``: whether the family writes ``cfg`` when ``model.family`` is unset;
* ``weight_map(cfg, found) -> list[Entry]``: its tensor names (``found``: the checkpoint's names, for families
  that have variants; empty on export), without ``lm_head.weight``, which :func:`weight_map` adds;
* its quirks, in its docstring.

Adding a family is one new module here, listed in :data:`FAMILIES`, and its tests. The block itself does not know
families: a family picks model fields (biases, experts, the rotary base), the parts read those fields.
"""

from __future__ import annotations

from collections.abc import Collection
from types import ModuleType

from ...errors import CheckpointError, ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from . import (
    deepseek_v3,
    gemma2,
    gemma3,
    gpt2,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)

#: model_type -> family module; for a model with ``model.family`` unset, the first whose ``picks`` says yes
FAMILIES: dict[str, ModuleType] = {
    m.MODEL_TYPE: m
    for m in (
        deepseek_v3,
        qwen2_moe,
        qwen3_moe,
        mixtral,
        gpt2,
        gemma3,
        gemma2,
        qwen3,
        olmo2,
        qwen2,
        llama,
        mistral,
        phi3,
    )
}


def _supported() -> str:
    return ", ".join(f"{name!r} ({m.ARCHITECTURE})" for name, m in sorted(FAMILIES.items()))


def for_model_type(kind, source: str) -> ModuleType:
    """The family of a ``config.json``'s ``model_type`` (CheckpointError naming the supported ones)."""
    if kind not in FAMILIES:
        raise CheckpointError(f"{source}: model_type {kind!r} is not supported; load_hf reads {_supported()}")
    return FAMILIES[kind]


def for_config(cfg: ModelConfig) -> ModuleType:
    """The family a model of ``cfg`` is written as: ``model.family``, or the first that picks it."""
    if cfg.family is not None:
        if cfg.family not in FAMILIES:
            raise ConfigError(f"model.family={cfg.family!r} is not a known family; choose one of {', '.join(FAMILIES)}")
        return FAMILIES[cfg.family]
    for family in FAMILIES.values():
        if family.picks(cfg):
            return family
    raise ConfigError(
        f"no Hugging Face family writes this model (model.qkv_bias={cfg.bias('qkv')}, o_bias={cfg.bias('o')}, "
        f"mlp_bias={cfg.bias('mlp')}); set model.family to one of {', '.join(FAMILIES)}"
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    """Every tensor of a Hugging Face checkpoint of ``cfg``, in file order (``found``: the names a checkpoint being
    read holds, which pick a family's name variant)."""
    out = for_config(cfg).weight_map(cfg, found)
    if not cfg.tied:
        out.append(Entry("lm_head.weight", ("output.weight",)))
    return out
