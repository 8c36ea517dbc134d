"""The ``[memory]`` section: precision, loss scaling, recomputation and offload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..options import opt


@dataclass
class MemoryConfig:
    """Numerics and memory savings (the ``[memory]`` section)."""

    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "parameters and compute in this type; bf16/fp16 keep fp32 master weights in the optimizer (sharded under ZeRO)")
    grad_dtype: Literal["fp32", "param"] = opt("fp32", "type of the gradient buffers that accumulate and are reduced: fp32, or the parameters' type (half the bytes)")
    recompute: Literal["none", "elementwise", "selective", "full"] = opt("none", "activation recomputation: full recomputes each block in backward from its input; selective only the attention core; elementwise only the norms' outputs and the MLP activation's, from what their own backward keeps (no matmul runs again; dense blocks, 1-D tensor parallelism, no train.compile)")
    offload_optimizer: bool = opt(False, "keep the optimizer state and step in host memory (needs parallel.zero >= 1)")
    offload_overlap: bool = opt(True, "ZeRO-1/2 with offload and AdamW or SGD: gradients leave for the host during backward, and the host step runs bucket by bucket on a thread while the next forward starts (false: the step waits for every copy)")
    loss_scale: float = opt(65536.0, "fp16: initial dynamic loss scale")
    loss_scale_growth_interval: int = opt(1000, "fp16: double the scale after this many steps without overflow")
    loss_scale_hysteresis: int = opt(2, "fp16: overflowing steps tolerated before the scale is halved")
    loss_scale_min: float = opt(1.0, "fp16: the scale never goes below this")

    def validate(self) -> None:
        if self.loss_scale <= 0 or self.loss_scale_min <= 0 or self.loss_scale < self.loss_scale_min:
            raise ConfigError("memory.loss_scale and memory.loss_scale_min must be positive, with loss_scale >= loss_scale_min")
        if self.loss_scale_growth_interval < 1 or self.loss_scale_hysteresis < 1:
            raise ConfigError("memory.loss_scale_growth_interval and memory.loss_scale_hysteresis must be at least 1")
