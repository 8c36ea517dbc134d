"""A checkpoint's whole float model in this one process, for inference: :func:`load_for_inference` (whatever layout
wrote it; the export, the quantizer and the compression report read checkpoints through it)."""

from __future__ import annotations

import os

import torch

from ..data import load_tokenizer
from ..models.config import ModelConfig
from ..models.transformer import Transformer
from . import checkpoint as ckpt


def load_for_inference(
    path: str, device: torch.device | str = "cpu", verify: bool = True, fused_proj: bool | None = None
):
    """``(model, tokenizer, trainer_meta)`` from a checkpoint directory, run's out_dir or checkpoints folder.

    ``verify=False`` skips checking the manifest (the caller just did); ``fused_proj`` overrides ``model.fused_proj``
    (how the model computes its projections; the checkpoint holds the same tensors either way).
    """
    path = ckpt.resolve(path)
    if verify:
        ckpt.verify(path)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    model_cfg = ModelConfig(**{**meta["model"], **({} if fused_proj is None else {"fused_proj": fused_proj})})
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.to_empty(device=device)
    model.reset_buffers()
    ckpt.load_model_state(model, ckpt.PieceReader(path, "model"), path)
    model.eval()
    return model, load_tokenizer(os.path.join(path, "tokenizer")), meta
