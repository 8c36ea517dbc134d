"""The ``[memory]`` section: precision and, in later versions, recomputation and offload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..options import opt


@dataclass
class MemoryConfig:
    """Numerics and memory savings (the ``[memory]`` section)."""

    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "compute precision; bf16 runs matmuls in bfloat16 under autocast with fp32 weights and optimizer state")
    offload_optimizer: bool = opt(False, "keep the optimizer state and step in host memory (needs parallel.zero >= 1)")
