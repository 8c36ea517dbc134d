"""Inference beyond one resident model: layer streaming (``streaming``, ``placement``)."""

from .placement import Placement, plan_placement
from .streaming import load_streaming

__all__ = ["Placement", "plan_placement", "load_streaming"]
