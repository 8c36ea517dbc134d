"""Data parallelism and ZeRO: every rank runs the whole (stage of the) model on its own slice of the batch.

* :mod:`.ddp` -- ZeRO stage 0: :class:`~.ddp.DataParallel`, gradients all-reduced in buckets while backward runs,
  and :func:`~.ddp.average_gradients`, the naive one-all-reduce-per-parameter oracle it is tested against;
* :mod:`.zero` -- ZeRO stages 1 and 2: optimizer state (1) and gradients (2) sharded over the ``dp`` ranks
  (:class:`~.zero.ZeroDataParallel`), with :mod:`.zero_gather` the all-gather of the updated parameters;
* :mod:`.zero3` -- ZeRO stage 3: parameters sharded too, gathered unit by unit around its forward and backward
  (:class:`~.zero3.Zero3DataParallel`);
* :mod:`.flat` -- the flat, bucketed, rank-sharded layout of a set of parameters the three share
  (:class:`~.flat.FlatLayout`, :class:`~.flat.Segment`).

All three are :class:`~trickles.parallel.engine.Engine` s; :func:`trickles.parallel.plan.parallelize` picks one
from ``parallel.zero``. Nothing is re-exported here: import from the modules.
"""
