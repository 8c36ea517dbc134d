"""A LoRA run's frozen base held in int8 (``train.lora_base = "int8"``): QLoRA's idea (Dettmers et al., 2023) with the
library's symmetric per-row quantizer (:func:`~trickles.compress.quantize.quantize_weight`).

**What is held.** The weight ``W [out, in]`` of every adapted linear (the modules of ``train.lora_targets``; a fused
projection's whole weight) becomes its codes ``W_q = round(W / s)`` in ``[-127, 127]`` (int8, still named
``weight``) and one fp32 scale per output row, ``s = max_j |W_ij| / 127`` (``weight_scale [out]``; a fused weight's
rows interleaved as its rows are). Both are frozen parameters (``requires_grad=False``: no gradient, no gradient
buffer, no optimizer state) that checkpoints write once, like any frozen base weight: ``out * in + 4 out`` bytes
instead of ``p out in`` (``p``: 2 in bf16, 4 in fp32). Rounding to nearest keeps every element within half a step of
the float weight it came from, ``|W_ij - s_i W_q,ij| <= s_i / 2``. The bias (if any), the adapters ``A`` and ``B``, and
every other weight (embeddings, norms, the output head, projections that are not targets) stay in the run's parameter
type; with the default targets (every attention and MLP projection) that is the whole of each block's matrices.

**Forward**: ``y = (x W_q^T) * s + b`` -- the codes widened to ``x``'s type inside the product, the scale applied to
the output columns once (the same as ``x (s W_q)^T``), then the adapter's ``s_lora B A dropout(x)`` added
(:class:`~trickles.adapters.lora.LoRALinear`). **Backward**: the input's gradient ``dx = (dy * s) W_q``, the codes
widened again; nothing for ``W_q``, ``s`` or ``b``. Saved for backward: the codes and scales (the module's own
parameters, no copy); not ``x``, which only a weight gradient would need. The widened codes (``p out in`` bytes) live
for one product at a time.

**Where the codes come from.** The model is built on the meta device with the codes' and scales' shapes
(:func:`hold_int8`, called by :func:`~trickles.adapters.lora.apply_lora`); the parallel plan computes each one's value
from the float weight's full value (:func:`int8_value`: the seed's, ``train.init_from``'s, or a float checkpoint's)
before keeping a rank's part, so every layout holds the same codes; a checkpoint of an int8 run (resume, ``trickles
eval``, export) holds them as they are. ``--format hf`` merges the adapters into the dequantized weight
(``s W_q + s_lora B A``, :func:`dense_weight`); ``--format peft`` writes the adapters alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compress.quantize import dequantize, quantize_weight

#: ``train.lora_base``: the frozen base in the run's parameter type, or in per-row int8
BASES = ("same", "int8")
SCALE = "weight_scale"


class Int8BaseMatmul(torch.autograd.Function):
    """``x W^T`` with ``W = s * W_q`` frozen (module doc): the input's gradient only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(codes, scale)
        ctx.x_dtype = x.dtype
        y = F.linear(x, codes.to(x.dtype))
        return y * scale.to(y.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        codes, scale = ctx.saved_tensors
        dx = (dy * scale.to(dy.dtype)) @ codes.to(dy.dtype)
        return dx.to(ctx.x_dtype), None, None


def holds_int8(module: nn.Module) -> bool:
    """Whether ``module``'s base weight is held in int8 (:func:`hold_int8`)."""
    return getattr(module, SCALE, None) is not None


def base_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The frozen base's ``x W^T + b`` of ``module`` (a LoRA linear), from int8 codes where it holds them."""
    if not holds_int8(module):
        return F.linear(x, module.weight, module.bias)
    y = Int8BaseMatmul.apply(x, module.weight, module.weight_scale)
    return y if module.bias is None else y + module.bias.to(y.dtype)


@torch.no_grad()
def dense_weight(module: nn.Module) -> torch.Tensor:
    """``module``'s base weight in fp32: ``s * W_q`` where it holds int8, else the weight itself."""
    if holds_int8(module):
        return dequantize(module.weight, module.weight_scale)
    return module.weight.float()


def hold_int8(module: nn.Module) -> None:
    """Replaces ``module.weight`` (``[out, in]``, float) by its int8 codes and adds ``weight_scale [out]`` (fp32),
    both frozen parameters, in place. On the meta device only the shapes (values come later, :func:`int8_value`);
    elsewhere the weight's values are quantized."""
    w = module.weight
    if w.device.type == "meta":
        codes = torch.empty(w.shape, dtype=torch.int8, device="meta")
        scale = torch.empty(w.shape[0], dtype=torch.float32, device="meta")
    else:
        codes, scale = quantize_weight(w)
    module.weight = nn.Parameter(codes, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)
    layout = getattr(w, "fused_layout", None)
    if layout is not None:  # checkpoints split a fused weight's codes and its scales' rows by part alike
        module.weight.fused_layout = module.weight_scale.fused_layout = layout


def is_int8_base(name: str, param: torch.Tensor) -> bool:
    """Whether parameter ``name`` is an int8 base's codes or scales (whose values :func:`int8_value` gives, and
    which keep their own types whatever the run's parameter type)."""
    return param.dtype == torch.int8 or name.endswith("." + SCALE)


class Int8Values:
    """``(name, param) -> full value`` of int8 bases' codes and scales from ``source(name, param)``, the full value of
    a parameter as the float model has it (module doc): the float weight quantized per row, or -- where the source
    already holds codes (an int8 run's checkpoint) -- its codes and scales as they are. Each weight is quantized once
    for its codes and scales (the last one is kept)."""

    def __init__(self, model: nn.Module, source):
        self.model, self.source = model, source
        self._last: tuple[str, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, name: str, param: torch.Tensor) -> torch.Tensor:
        is_scale = name.endswith("." + SCALE)
        weight = name[: -len(SCALE)] + "weight" if is_scale else name
        if self._last is None or self._last[0] != weight:
            full = self.source(weight, self.model.get_parameter(weight))
            if full.dtype == torch.int8:  # codes already: the scales are the source's too
                return self.source(name, param) if is_scale else full
            codes, scale = quantize_weight(full)
            self._last = (weight, codes, scale)
        return self._last[2] if is_scale else self._last[1]
