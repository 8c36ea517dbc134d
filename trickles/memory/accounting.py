"""Counting memory: the ZeRO formulas, and the bytes actually held by live tensors.

Model-state bytes per device with ``P`` parameters over ``N`` data-parallel ranks (Rajbhandari
et al., ZeRO, section 5), with ``p``, ``g``, ``k`` bytes per parameter for parameters,
gradients and optimizer state:

    stage 0:  (p + g + k) P
    stage 1:  (p + g) P + k P / N
    stage 2:  p P + (g + k) P / N
    stage 3:  (p + g + k) P / N

Mixed-precision Adam (the paper's case) has ``p = g = 2`` (fp16/bf16) and ``k = 12`` (fp32
master weights, momentum, variance). trickles' fp32 training has ``p = g = 4`` and ``k = 8``:
fp32 parameters are their own master weights.
"""

from __future__ import annotations

import gc

import torch

FP32_ADAM = (4, 4, 8)
MIXED_ADAM = (2, 2, 12)


def zero_model_state_bytes(n_params: float, dp: int, stage: int, bytes_per_param: tuple[float, float, float] = MIXED_ADAM) -> dict[str, float]:
    """``{"parameters", "gradients", "optimizer", "total"}`` bytes per device under ZeRO ``stage``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    p, g, k = bytes_per_param
    out = {
        "parameters": p * n_params / (dp if stage >= 3 else 1),
        "gradients": g * n_params / (dp if stage >= 2 else 1),
        "optimizer": k * n_params / (dp if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


def live_tensor_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from Python objects (on ``device``, if given).

    Views share their base's storage and are counted once. Tensors that only C++ holds (e.g.
    activations saved by autograd) are not seen; call it between steps.
    """
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta:  # type(): no attribute lookups on foreign objects
                continue
            if device is not None and obj.device != torch.device(device):
                continue
            st = obj.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # objects that pretend to be tensors (e.g. fakes) are not memory
            continue
    return sum(seen.values())
