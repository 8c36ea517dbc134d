"""The ``[memory]`` section: precision, loss scaling, recomputation and offload."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from ..errors import ConfigError
from ..options import opt


@dataclass
class MemoryConfig:
    """Numerics and memory savings (the ``[memory]`` section)."""

    precision: Literal["fp32", "bf16", "fp16"] = opt(
        "fp32",
        "parameters and compute in this type; bf16/fp16 keep fp32 master weights in the optimizer (sharded under ZeRO)",
    )
    grad_dtype: Literal["fp32", "param"] = opt(
        "fp32",
        "type of the gradient buffers that accumulate and are reduced: fp32, or the parameters' type (half the bytes)",
    )
    recompute: Literal["none", "elementwise", "selective", "full"] = opt(
        "none",
        "activation recomputation: full recomputes each block in backward from its input; selective only the attention "
        "core; elementwise only the norms' outputs and the MLP activation's, from what their own backward keeps (no "
        "matmul runs again; dense blocks, 1-D tensor parallelism, no train.compile)",
    )
    recompute_num_layers: int = opt(
        0,
        "with memory.recompute=full: recompute whole only the first N layers each pipeline rank holds (0: every "
        "layer); the others as memory.recompute_rest says (Megatron-Core's recompute_method=block, counted per rank "
        "rather than per chunk)",
    )
    recompute_rest: Literal["none", "elementwise", "selective"] = opt(
        "none", "with memory.recompute_num_layers > 0: the recomputation of the layers not recomputed whole"
    )
    expert_load: Literal["balanced", "bound"] = opt(
        "balanced",
        "expert parallelism: the load the report's figures assume on a rank's experts -- balanced (each receives as "
        "many rows as its tokens send) or bound (as many as the router can send it: every token's experts on it as "
        "far as it holds them); the other is given in a note, and trickles plan assumes the bound",
    )
    offload_optimizer: bool = opt(False, "keep the optimizer state and step in host memory (needs parallel.zero >= 1)")
    offload_overlap: bool = opt(
        True,
        "ZeRO-1/2 with offload and AdamW or SGD: gradients leave for the host during backward, and the host step runs "
        "bucket by bucket on a thread while the next forward starts (false: the step waits for every copy)",
    )
    loss_scale: float = opt(65536.0, "fp16: initial dynamic loss scale")
    loss_scale_growth_interval: int = opt(1000, "fp16: double the scale after this many steps without overflow")
    loss_scale_hysteresis: int = opt(2, "fp16: overflowing steps tolerated before the scale is halved")
    loss_scale_min: float = opt(1.0, "fp16: the scale never goes below this")

    def check_layout(self, dims, moe: bool, compile: bool) -> None:
        """What ``elementwise`` recomputation's recipes cover (:mod:`trickles.memory.recompute`: dense blocks, 1-D
        layouts, eager mode), also as the rest of a partial full recomputation, which needs a 1-D layout too."""
        grid = dims.tp > 1 and dims.tp_mode != "1d"
        if self.recompute_num_layers and grid:
            raise ConfigError(
                f"memory.recompute_num_layers does not combine with parallel.tp_mode={dims.tp_mode}; use "
                f"parallel.tp_mode=1d or memory.recompute_num_layers=0"
            )
        if "elementwise" not in (self.recompute, self.recompute_rest):
            return
        key = "memory.recompute" if self.recompute == "elementwise" else "memory.recompute_rest"
        for bad, what, fix in (
            (moe, "mixture-of-experts blocks (model.moe_experts)", "set model.moe_experts=0"),
            (grid, f"parallel.tp_mode={dims.tp_mode}", "use parallel.tp_mode=1d"),
            (compile, "train.compile (its partitioner chooses what to recompute)", "set train.compile=false"),
        ):
            if bad:
                raise ConfigError(
                    f"{key}=elementwise does not combine with {what}; {fix} or use "
                    f"{key}=selective (or none{'' if key == 'memory.recompute_rest' else ', full'})"
                )

    def layer_modes(self, rank_layers: list[list[int]]) -> dict[int, str]:
        """Each layer's recomputation (``none``, ``elementwise``, ``selective`` or ``full``), given the layers each
        pipeline rank holds in the order it runs them (one list without a pipeline)."""
        n = self.recompute_num_layers
        if not n:
            return {i: self.recompute for layers in rank_layers for i in layers}
        return {i: ("full" if k < n else self.recompute_rest) for layers in rank_layers for k, i in enumerate(layers)}

    def describe(self) -> str:
        """The recomputation in words, e.g. ``full`` or ``full for the first 2 layers of each rank, elementwise for
        the rest``."""
        if not self.recompute_num_layers:
            return self.recompute
        n = self.recompute_num_layers
        first = "the first layer" if n == 1 else f"the first {n} layers"
        return f"full for {first} of each rank, {self.recompute_rest} for the rest"

    def uniform(self, mode: str) -> MemoryConfig:
        """This section with every layer recomputed as ``mode``."""
        return replace(self, recompute=mode, recompute_num_layers=0, recompute_rest="none")

    def validate(self) -> None:
        if self.recompute_num_layers < 0:
            raise ConfigError(f"memory.recompute_num_layers must not be negative, got {self.recompute_num_layers}")
        if self.recompute_num_layers and self.recompute != "full":
            raise ConfigError(
                f"memory.recompute_num_layers counts the layers memory.recompute=full recomputes whole, but "
                f"memory.recompute is {self.recompute}; set memory.recompute=full or memory.recompute_num_layers=0"
            )
        if self.recompute_rest != "none" and not self.recompute_num_layers:
            raise ConfigError(
                "memory.recompute_rest applies to the layers memory.recompute_num_layers leaves out; set "
                "memory.recompute_num_layers > 0 (with memory.recompute=full) or memory.recompute_rest=none"
            )
        if self.loss_scale_min <= 0 or self.loss_scale < self.loss_scale_min:  # (so loss_scale > 0 too)
            raise ConfigError(
                "memory.loss_scale and memory.loss_scale_min must be positive, with loss_scale >= loss_scale_min"
            )
        if self.loss_scale_growth_interval < 1 or self.loss_scale_hysteresis < 1:
            raise ConfigError("memory.loss_scale_growth_interval and memory.loss_scale_hysteresis must be at least 1")
