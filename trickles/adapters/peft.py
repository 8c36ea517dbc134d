"""LoRA adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

PEFT names the adapter of a Hugging Face module ``M`` (``model.layers.0.self_attn.q_proj``) as
``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, computes
``s B A x`` with ``s = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), and reads per-module ranks and alphas
from ``rank_pattern`` / ``alpha_pattern`` (keys matched against the end of a module's name).

The Hugging Face module of each adapted trickles linear comes from the family's tensor names
(:func:`~trickles.models.families.weight_map`). Where a family stores one module for several of ours (Phi-3's
``qkv_proj`` = ``[q; k; v]``, GPT-2's ``c_attn``), the parts' adapters become one exact adapter of rank
``R = sum r_p``: ``A = [A_q; A_k; A_v]`` ``[R, in]`` and a block-diagonal ``B`` ``[out, R]`` whose rows of part
``p`` hold ``B_p`` in its columns, so ``B A x`` is every part's ``B_p A_p x`` side by side. Its rank and alpha go
into the patterns (alpha scaled so ``s`` is the parts'). GPT-2's ``Conv1D`` modules store ``[in, out]`` weights; PEFT
then wants ``fan_in_fan_out`` and the same ``A``/``B`` shapes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError, ConfigError
from ..models import fused as fusion
from ..models.families import weight_map
from ..models.transformer import Transformer
from .lora import FusedLoRALinear, LoRALinear, LoRASettings, is_adapter

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_tensors(model: Transformer, settings: LoRASettings) -> tuple[dict[str, torch.Tensor], dict, dict, bool]:
    """``(tensors, rank_pattern, alpha_pattern, fan_in_fan_out)`` of ``model``'s adapters under PEFT's names."""
    adapted = {}  # unfused module name -> (A, B): a fused projection's parts by their own names
    for n, m in model.named_modules():
        if isinstance(m, LoRALinear):
            adapted[n] = (m.lora_A.weight, m.lora_B.weight)
        elif isinstance(m, FusedLoRALinear):
            owner = n.rsplit(".", 1)[0]
            adapted.update({f"{owner}.{p}": ab for p, ab in m.part_adapters().items()})
    if not adapted:
        raise ConfigError("this model has no LoRA adapters to export (train.lora_rank=0); export it with --format hf")
    cfg = model.cfg
    base = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    shapes = {k: v.shape for k, v in fusion.split_state(cfg, base).items()}
    tensors, ranks, alphas, transposed, seen = {}, {}, {}, False, set()
    for entry in weight_map(cfg):
        if not entry.hf.endswith(".weight") or entry.kind == "expert":
            continue
        parts = [n[: -len(".weight")] for n in entry.ours]
        if not any(p in adapted for p in parts):
            continue
        if entry.kind not in ("copy", "cat0", "fused", "conv1d"):
            raise ConfigError(f"a LoRA adapter on {parts[0]} cannot be written in PEFT's format ({entry.kind} tensor)")
        hf = entry.hf[: -len(".weight")]
        sizes = [shapes[p + ".weight"][0] for p in parts]
        a_rows = [adapted[p][0].detach().float() for p in parts if p in adapted]
        rank = sum(a.shape[0] for a in a_rows)
        b = torch.zeros(sum(sizes), rank)
        row = col = 0
        for p, n in zip(parts, sizes):
            if p in adapted:
                r = adapted[p][0].shape[0]
                b[row : row + n, col : col + r] = adapted[p][1].detach().float()
                col += r
            row += n
        tensors[f"{PREFIX}{hf}.lora_A.weight"] = torch.cat(a_rows).contiguous()
        tensors[f"{PREFIX}{hf}.lora_B.weight"] = b.contiguous()
        transposed |= entry.kind in ("fused", "conv1d")
        seen.update(p for p in parts if p in adapted)
        if rank != settings.rank:
            leaf = hf.rsplit(".", 1)[-1]
            ranks[leaf] = rank
            # the parts' scale s = alpha / r kept at rank R: alpha_R = s R (or s sqrt(R) with rslora)
            alphas[leaf] = settings.scaling * (math.sqrt(rank) if settings.rslora else rank)
    missing = sorted(set(adapted) - seen)
    if missing:
        raise ConfigError(f"the adapter on {missing[0]} has no Hugging Face module to be written under")
    return tensors, ranks, alphas, transposed


def adapter_config(
    settings: LoRASettings, targets: list[str], ranks: dict, alphas: dict, fan_in_fan_out: bool, base: str | None
) -> dict:
    """PEFT's ``adapter_config.json`` for adapters on ``targets`` (Hugging Face module leaf names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "use_rslora": settings.rslora,
        "target_modules": sorted(targets),
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "use_dora": False,
        "revision": None,
    }


def save_peft(model: Transformer, path, settings: LoRASettings, base: str | None = None) -> Path:
    """Writes ``model``'s adapters as a PEFT adapter directory at ``path`` (a new directory, written beside it and
    renamed into place); ``base``: the base model's name or path recorded in the config."""
    target = Path(path)
    if target.exists():
        raise CheckpointError(f"{target} already exists; choose a new path for the adapter")
    tensors, ranks, alphas, transposed = peft_tensors(model, settings)
    targets = sorted({k[len(PREFIX) :].rsplit(".", 3)[-3] for k in tensors})
    config = adapter_config(settings, targets, ranks, alphas, transposed, base)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in (WEIGHTS, CONFIG):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
