"""The planner's foundation: the cluster it plans for and the time one step takes there.

* :mod:`~trickles.planner.cluster` -- :class:`Cluster`, presets (``dgx-a100``, ``dgx-h100``, ``local``),
  :func:`load_cluster`, :func:`write_cluster`;
* :mod:`~trickles.planner.calibrate` -- :func:`calibrate` measures this machine;
* :mod:`~trickles.planner.cost` -- :func:`step_time` -> :class:`StepTime`, built from
  :mod:`~trickles.planner.compute` (what a rank computes), :mod:`~trickles.planner.traffic` (each dimension's bytes,
  from the library's formulas) and :mod:`~trickles.planner.placement` (which link a group spans).

Memory prediction stays in :mod:`trickles.memory.report` (:func:`~trickles.memory.report.predict`).
"""

from .calibrate import calibrate, fit_link
from .cluster import PRESETS, Cluster, load_cluster, write_cluster
from .cost import StepTime, step_time

__all__ = ["PRESETS", "Cluster", "StepTime", "calibrate", "fit_link", "load_cluster", "step_time", "write_cluster"]
