"""Quantized checkpoints: writing one from any checkpoint, and loading any checkpoint for inference.

:func:`quantize_checkpoint` reads a checkpoint written at any layout (its manifest checked first), builds the whole
float model in this process, replaces its projections by :class:`~trickles.compress.quantize.Int8Linear` and writes
an ordinary trickles checkpoint directory::

    model-rank00000.safetensors   every tensor whole: a quantized projection's ``weight`` as int8 codes and its
                                  ``weight_scale`` (fp32, one per output row), everything else as it was
    trainer.json                  the source's, plus ``"quantization": {"bits": 8, "granularity": "row", ...}``
    tokenizer/                    copied
    manifest.json                 size and sha256 of every file, written last

It is written in ``<out>.tmp`` and renamed once complete (a failure removes the ``.tmp``); an existing ``out`` is
refused. A fused model's projections are stored under their parts' names (``q_proj``, ``k_proj``, ``v_proj``),
as every checkpoint names them, and load as an unfused model: per-row scales are the parts' own rows either way.

:func:`load_checkpoint` loads a float or a quantized checkpoint for inference (``int8="weight"`` or ``"full"``
choosing the quantized model's matmul), after checking the manifest: a damaged file is refused with
:class:`~trickles.errors.CheckpointError` (exit status 2 in the command).
"""

from __future__ import annotations

import os

import torch

from ..data import load_tokenizer
from ..errors import CheckpointError, UserError
from ..models.config import ModelConfig
from ..models.transformer import Transformer
from ..train import checkpoint as ckpt
from ..train.load import load_for_inference
from ..train.pieces import PieceReader
from .quantize import GRANULARITIES, MODES, empty_quantized, quantize_model

BITS = (8,)


def _float_model(path: str, device="cpu") -> Transformer:
    """The whole float model of the (verified) checkpoint at ``path``, projections unfused."""
    return load_for_inference(path, device, verify=False, fused_proj=False)[0]


def quantize_checkpoint(src: str, out: str, bits: int = 8, granularity: str = "row", qat: bool = False) -> str:
    """Writes the int8 checkpoint of the checkpoint at ``src`` to ``out`` (see the module docstring); returns ``out``.

    ``qat``: the source was trained with fake quantization (recorded in the metadata).
    """
    if bits not in BITS:
        raise UserError(f"--bits {bits} is not supported; use --bits 8")
    if granularity not in GRANULARITIES:
        raise UserError(f"--granularity must be row or tensor, got {granularity!r}")
    path, out = ckpt.source_and_target(src, out)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    if meta.get("quantization"):
        raise CheckpointError(f"{path} is already quantized; give the float checkpoint it came from")
    model = _float_model(path)
    names = quantize_model(model, granularity)
    meta = {
        **meta,
        "quantization": {
            "bits": bits,
            "granularity": granularity,
            "scheme": "symmetric",
            "qat": qat,
            "modules": names,
            "source": os.path.abspath(path),
        },
    }
    return ckpt.write_model_dir(out, ckpt.model_pieces(model), os.path.join(path, "tokenizer"), meta)


def load_checkpoint(path: str, device: torch.device | str = "cpu", int8: str | None = None, verify: bool = True):
    """``(model, tokenizer, trainer_meta)`` for inference from any checkpoint, float or quantized.

    ``int8``: for a quantized checkpoint, ``"weight"`` (weight-only, the default) or ``"full"`` (activations quantized
    per token, integer matmul). A float checkpoint loads as :func:`~trickles.train.load.load_for_inference` does.
    """
    if int8 is not None and int8 not in MODES:
        raise UserError(f"int8 must be weight or full, got {int8!r}")
    path = ckpt.resolve(path)
    if verify:
        ckpt.verify(path)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    if not meta.get("quantization"):
        if int8 is not None:
            raise UserError(
                f"{path} is not quantized, so --int8 does not apply; quantize it with trickles compress quantize"
            )
        return load_for_inference(path, device, verify=False)
    cfg = ModelConfig(**{**meta["model"], "fused_proj": False})
    with torch.device("meta"):
        model = Transformer(cfg)
        empty_quantized(model, int8 or "weight")
    model.to_empty(device=device)
    model.reset_buffers()
    ckpt.load_model_state(model, PieceReader(path, "model"), path)
    model.eval()
    return model, load_tokenizer(os.path.join(path, "tokenizer")), meta


def float_model(path: str, device="cpu") -> Transformer:
    """The float model of a (non-quantized) checkpoint, projections unfused, for quantizing in memory."""
    path = ckpt.resolve(path)
    ckpt.verify(path)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    if meta.get("quantization"):
        raise CheckpointError(f"{path} is quantized; give a float checkpoint")
    return _float_model(path, device)


__all__ = ["quantize_checkpoint", "load_checkpoint", "float_model"]
