"""Pipeline parallelism: the model's blocks cut into consecutive stages, micro-batches flowing through them.

* :mod:`.stages` -- cutting a single-device model into (virtual) stages and pruning it, still on the meta device,
  to what one rank holds (:func:`~.stages.partition_layers`, :func:`~.stages.keep_stage`);
* :mod:`.schedules` -- the schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) as plain lists of actions per rank,
  built and checked before anything runs;
* :mod:`.timeline` -- replaying the lists on a timeline (:func:`~.timeline.simulate`) and the bubble, formula and
  predicted from a measured step's stage times;
* :mod:`.split` -- a backward cut into ``B`` (the input's gradient) and ``W`` (the weights') for the zero-bubble
  schedules;
* :mod:`.runner` -- executes one rank's list against its stage (:class:`~.runner.PipelineRunner`) and decodes
  through the stages (:class:`~.runner.PipelinedModel`);
* :mod:`.plot` -- the Gantt chart of one measured step.

Nothing is re-exported here: import from the modules.
"""
