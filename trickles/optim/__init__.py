"""Optimizers and learning-rate schedules."""

from .adamw import AdamWSettings, build_adamw, decay_flags, param_groups
from .schedule import lr_at

__all__ = ["AdamWSettings", "build_adamw", "decay_flags", "param_groups", "lr_at"]
