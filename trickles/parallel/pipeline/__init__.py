"""Pipeline parallelism: the model's blocks cut into consecutive stages, micro-batches flowing through them.

* :mod:`.stages` -- cutting a single-device model into (virtual) stages and pruning it, still on the meta device,
  to what one rank holds (:func:`~.stages.partition_layers`, :func:`~.stages.keep_stage`);
* :mod:`.schedules` -- the schedules (GPipe, 1F1B, interleaved 1F1B) as plain lists of actions per rank, built,
  checked and simulated before anything runs;
* :mod:`.runner` -- executes one rank's list against its stage (:class:`~.runner.PipelineRunner`) and decodes
  through the stages (:class:`~.runner.PipelinedModel`);
* :mod:`.plot` -- the Gantt chart of one measured step.

Nothing is re-exported here: import from the modules.
"""
