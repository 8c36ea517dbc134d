"""Precision policy: which dtype the forward runs in.

``fp32``: everything in float32. ``bf16``: matmuls and attention in bfloat16 under
``torch.autocast``; parameters, gradients and optimizer state stay float32 (they are the
master weights), and the loss is computed from float32 logits.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """The forward-pass context for ``precision`` on ``device``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])
