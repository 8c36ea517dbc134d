"""The Hugging Face format in names: file and tensor names and tensor layouts, both ways.

What :func:`~trickles.models.hf.load_hf` (import) and :func:`~trickles.models.hf_export.save_hf` (export) share,
with no file read or written here: the directory's file names and the engine of the tensor names, an
:class:`Entry` per Hugging Face tensor (the trickles parameter(s) it holds) with :func:`to_ours` / :func:`to_hf` (its
layout change both ways). Each family's tensor names and their quirks are its module's
(:mod:`trickles.models.families`, whose ``weight_map`` lists them). Buffers some versions stored (GPT-2's
``attn.bias``/``attn.masked_bias`` causal masks, Llama's ``rotary_emb.inv_freq``) are ignored; any other tensor a
family does not list is an error, as is a listed tensor that is missing.

The ``config.json`` machinery the families share is :mod:`trickles.models.hf_config`'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Non-parameter buffers that some versions of transformers saved, and DeepSeek-V3's copies of the output projection
# (trickles.models.mtp); safe to ignore.
IGNORED = re.compile(
    r"(^|\.)(h\.\d+\.attn\.(bias|masked_bias)|layers\.\d+\.self_attn\.rotary_emb\.inv_freq"
    r"|layers\.\d+\.shared_head\.head\.weight)$"  # DeepSeek-V3's copies of lm_head in its MTP layers
)


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor and the trickles parameter(s) it holds.

    ``kind``: ``copy`` (same layout), ``conv1d`` (HF stores the transpose), ``fused`` (HF
    concatenates ``ours`` along the output dimension; a 2-D one is also transposed), ``cat0`` (HF concatenates
    ``ours`` along dim 0, their output dimension, in ``nn.Linear``'s layout: Phi-3's ``qkv_proj``), ``expert`` (HF
    holds slice ``index`` of the stacked ``ours[0]``, one expert's weight) or ``cat1`` (HF concatenates
    the stacked ``ours`` along dim 1, their output dimension).
    """

    hf: str
    ours: tuple[str, ...]
    kind: str = "copy"
    index: int = 0


def to_ours(entry: Entry, t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The trickles tensors held in HF tensor ``t`` (``sizes``: output sizes of a fused entry); for an
    ``expert`` entry, the slice ``entry.index`` of ``ours[0]``."""
    if entry.kind in ("copy", "expert"):
        return [t]
    if entry.kind == "conv1d":
        return [t.t()]
    if entry.kind == "cat1":
        return list(t.split(sizes, dim=1))
    if entry.kind == "cat0":
        return list(t.split(sizes, dim=0))
    return list((t.t() if t.dim() == 2 else t).split(sizes, dim=0))


def to_hf(entry: Entry, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`to_ours`."""
    if entry.kind == "copy":
        return tensors[0]
    if entry.kind == "expert":
        return tensors[0][entry.index].clone()  # its own storage: safetensors refuses shared tensors
    if entry.kind == "conv1d":
        return tensors[0].t()
    if entry.kind == "cat1":
        return torch.cat(tensors, dim=1)
    if entry.kind == "cat0":
        return torch.cat(tensors, dim=0)
    fused = torch.cat(tensors, dim=0)
    return fused.t() if fused.dim() == 2 else fused


def _hf_shape(entry: Entry, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if entry.kind == "copy":
        return shapes[0]
    if entry.kind == "conv1d":
        return shapes[0][::-1]
    if entry.kind == "expert":
        return shapes[0][1:]
    if entry.kind == "cat1":
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])
    if entry.kind == "cat0":
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    out = sum(s[0] for s in shapes)
    return (shapes[0][1], out) if len(shapes[0]) == 2 else (out,)


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"dtype {dtype!r} is not a floating-point torch dtype; use e.g. 'float32' or 'bfloat16'")
    return value
