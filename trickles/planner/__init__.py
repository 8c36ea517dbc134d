"""The planner's foundation: the cluster it plans for and the time one step takes there.

* :mod:`~trickles.planner.cluster` -- :class:`Cluster`, presets (``dgx-a100``, ``dgx-h100``, ``local``),
  :func:`load_cluster`, :func:`write_cluster`;
* :mod:`~trickles.planner.calibrate` -- :func:`calibrate` measures this machine (timing compute in
  :mod:`~trickles.planner.calibrate_compute`, collectives in :mod:`~trickles.planner.calibrate_comm`);
* :mod:`~trickles.planner.cost` -- :func:`step_time` -> :class:`StepTime`, built from
  :mod:`~trickles.planner.compute` (what a rank computes), :mod:`~trickles.planner.traffic` (each dimension's bytes,
  from the library's formulas) and :mod:`~trickles.planner.placement` (which link a group spans);
* :mod:`~trickles.planner.search` -- :class:`Search`: the layouts ``trickles plan`` enumerates, prunes by memory and
  ranks by step time; :mod:`~trickles.planner.report` -- its table, explanations, JSON and winner config.

Memory prediction stays in :mod:`trickles.memory.report` (:func:`~trickles.memory.report.predict`).
"""

from .calibrate import calibrate, fit_link
from .cluster import Cluster
from .cluster_files import PRESETS, load_cluster, write_cluster
from .cost import StepTime, step_time
from .search import Candidate, Layout, Search, enumerate_layouts, memory_bound, pinned_keys, plan_model

__all__ = [
    "PRESETS",
    "Candidate",
    "Cluster",
    "Layout",
    "Search",
    "StepTime",
    "calibrate",
    "enumerate_layouts",
    "fit_link",
    "load_cluster",
    "memory_bound",
    "pinned_keys",
    "plan_model",
    "step_time",
    "write_cluster",
]
