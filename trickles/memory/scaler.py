"""Dynamic loss scaling for fp16 training.

fp16 has a narrow range: small gradients underflow to zero. The loss is multiplied by a scale
``S`` before backward, so every gradient is ``S`` times larger, and divided by ``S`` again
before clipping and the update. If any gradient on any rank is inf or NaN (the global gradient
norm, one small all-reduce, is then non-finite), the step is skipped on every rank, leaving
weights and optimizer state untouched, and after ``hysteresis`` such steps the scale is halved
(never below ``min_scale``). After ``growth_interval`` consecutive good steps it is doubled.
"""

from __future__ import annotations


class DynamicLossScaler:
    def __init__(
        self,
        scale: float = 2.0**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.scale = float(scale)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        """Adjusts the scale after a step that did (``overflow``) or did not overflow."""
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    @property
    def at_minimum(self) -> bool:
        return self.scale <= self.min_scale

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
