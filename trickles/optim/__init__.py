"""Optimizers and learning-rate schedules."""

from .adamw import build_adamw, decay_flags, param_groups
from .lamb import Lamb
from .lars import Lars
from .schedule import lr_at
from .settings import OPTIMIZERS, OptimizerSettings

__all__ = ["OPTIMIZERS", "Lamb", "Lars", "OptimizerSettings", "build_adamw", "decay_flags", "param_groups", "lr_at"]
