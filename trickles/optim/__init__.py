"""Optimizers and learning-rate schedules."""

from .adamw import build_adamw, param_groups
from .schedule import lr_at

__all__ = ["build_adamw", "param_groups", "lr_at"]
