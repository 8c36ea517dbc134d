"""Precision policies: which types parameters, compute, gradients and master weights use.

=========  ===========  ==============  ===================  ==============  ===========
precision  parameters   matmuls         gradients            master weights  loss scale
=========  ===========  ==============  ===================  ==============  ===========
fp32       float32      float32         float32              the parameters  none
bf16       bfloat16     bfloat16        ``grad_dtype``       float32         none
fp16       float16      float16         ``grad_dtype``       float32         dynamic
=========  ===========  ==============  ===================  ==============  ===========

Low-precision runs keep an fp32 copy of the parameters in the optimizer (sharded under ZeRO,
with the Adam moments) and copy the updated values back after each step. The forward runs
under ``torch.autocast`` as well, so the operations autocast keeps in fp32 (norms, softmax,
losses) do; the loss is always computed from fp32 logits, norms from fp32 statistics, and the
gradient norm in fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    param_dtype: torch.dtype
    grad_dtype: torch.dtype

    @property
    def needs_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16

    @property
    def low(self) -> bool:
        return self.param_dtype != torch.float32


def policy(precision: str, grad_dtype: str = "fp32") -> PrecisionPolicy:
    dtype = DTYPES[precision]
    return PrecisionPolicy(precision, dtype, torch.float32 if grad_dtype == "fp32" else dtype)


def autocast(precision: str, device: torch.device):
    """The forward-pass context for ``precision`` on ``device``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])
