"""A checkpoint's whole float model in this one process, for inference: :func:`load_for_inference` (whatever layout
wrote it; the export, the quantizer and the compression report read checkpoints through it).

A Hugging Face model directory (``config.json`` naming a ``model_type``, safetensors weights, usually its tokenizer)
is read through :func:`trickles.load_hf`: :func:`is_hf_dir` tells one from a trickles checkpoint (which has a
manifest), :func:`hf_model_config` gives its shape (``model.from_hf``, ``train.init_from``), :func:`hf_tokenizer_dir`
whether it holds a tokenizer, :func:`load_hf_for_inference` the model and tokenizer for ``generate`` and ``serve``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..adapters.lora import LoRASettings, apply_lora, merge_lora
from ..data import load_tokenizer
from ..data.tokenizers import load_hf_tokenizer
from ..errors import CheckpointError
from ..models.config import ModelConfig
from ..models.hf import config_from_hf, load_hf
from ..models.transformer import Transformer
from . import checkpoint as ckpt
from .config import TrainConfig


def load_for_inference(
    path: str,
    device: torch.device | str = "cpu",
    verify: bool = True,
    fused_proj: bool | None = None,
    merge_adapters: bool = True,
):
    """``(model, tokenizer, trainer_meta)`` from a checkpoint directory, run's out_dir or checkpoints folder.

    ``verify=False`` skips checking the manifest (the caller just did); ``fused_proj`` overrides ``model.fused_proj``
    (how the model computes its projections; the checkpoint holds the same tensors either way). A LoRA run's
    adapters (``train.lora_rank``) are folded into their base weights (:func:`~trickles.adapters.merge_lora`) unless
    ``merge_adapters=False`` keeps them apart (a PEFT export).
    """
    path = ckpt.resolve(path)
    if verify:
        ckpt.verify(path)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    model_cfg = ModelConfig(**{**meta["model"], **({} if fused_proj is None else {"fused_proj": fused_proj})})
    lora = run_lora(meta)
    with torch.device("meta"):
        model = Transformer(model_cfg)
        if lora is not None:
            apply_lora(model, lora)
    model.to_empty(device=device)
    model.reset_buffers()
    ckpt.load_model_state(model, ckpt.PieceReader(path, "model"), path)
    if lora is not None and merge_adapters:
        merge_lora(model)
    model.eval()
    return model, load_tokenizer(os.path.join(path, "tokenizer")), meta


def run_lora(meta: dict) -> LoRASettings | None:
    """The LoRA adapters the run of ``trainer.json``'s ``meta`` trained (None: none)."""
    train = (meta.get("config") or {}).get("train") or {}
    if not train.get("lora_rank"):
        return None
    fields = {f.name: train[f.name] for f in dataclasses.fields(TrainConfig) if f.name in train}
    return TrainConfig(**fields).lora()


HF_CONFIG = "config.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model directory: it holds ``config.json`` and no trickles manifest."""
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and not os.path.exists(os.path.join(path, ckpt.MANIFEST))


def hf_model_config(path: str, key: str) -> ModelConfig:
    """The model shape of the Hugging Face directory ``path`` (its ``config.json`` only); ``key`` names the setting
    that gave it, for the one-line CheckpointError when there is no such directory or its model is not supported."""
    file = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"{key} {path}: {file} does not exist; give a Hugging Face model directory")
    try:
        raw = json.loads(open(file, encoding="utf-8").read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{key} {path}: {file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise CheckpointError(f"{key} {path}: {file} names no model_type; give a transformers model's config.json")
    return config_from_hf(raw, file)


def hf_tokenizer_dir(path: str) -> bool:
    """Whether the Hugging Face directory ``path`` holds a tokenizer (``tokenizer.json`` or
    ``tokenizer_config.json``)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in HF_TOKENIZER_FILES)


def load_hf_for_inference(path: str, device: torch.device | str = "cpu"):
    """``(model, tokenizer, meta)`` from a Hugging Face directory: the model as :func:`trickles.load_hf` reads it and
    the directory's own tokenizer, which encodes prompts with its special-token rules (a BOS when it adds one) and
    renders chats with its chat template, as transformers does. ``meta`` is empty (no run wrote it)."""
    hf_model_config(path, "the model")  # one line for a directory without config.json or of an unknown model_type
    if not hf_tokenizer_dir(path):
        raise CheckpointError(
            f"{path} holds no tokenizer ({' or '.join(HF_TOKENIZER_FILES)}); save the model's tokenizer there with "
            "tokenizer.save_pretrained"
        )
    tokenizer = load_hf_tokenizer(path, key="the model's tokenizer", model_dir=True)
    model = load_hf(path, device=device).eval()
    return model, tokenizer, {}
