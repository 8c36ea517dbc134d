"""Parallelism, applied from outside to a single-device model: one subpackage or module per dimension.

* :mod:`.plan` -- :func:`~.plan.parallelize`, the one place that knows the order of the dimensions;
* :mod:`.engine` -- the contract between the trainer and a data-parallel strategy (:class:`~.engine.Engine`);
  :mod:`.reduction` -- the size of its gradient buckets and the bytes their reductions send;
* :mod:`.config` -- the ``[parallel]`` section; :mod:`.norms` -- per-weight norms from the pieces each rank holds;
* :mod:`.data` -- data parallelism and ZeRO 1-3;
* :mod:`.tensor` -- tensor parallelism, 1-D (with sequence parallelism) and grids (2-D, 2.5-D, 3-D);
* :mod:`.pipeline` -- pipeline stages, schedules and their runner;
* :mod:`.context` -- context parallelism (ring, all-to-all), with :mod:`.sequence` the sequence layouts;
* :mod:`.expert` -- expert parallelism for mixture-of-experts blocks.
"""
