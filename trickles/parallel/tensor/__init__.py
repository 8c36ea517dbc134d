"""Tensor parallelism: every matrix of a block split over the ``tp`` ranks.

1-D (Megatron-LM, with sequence parallelism), ``parallel.tp_mode = "1d"``:

* :mod:`.layers` -- the layers: column- and row-parallel linears, the region entries and exits, the
  vocabulary-parallel embedding and loss, the per-rank random stream;
* :mod:`.region_bytes` -- the bytes their collectives send and the partial gradients they leave;
* :mod:`.plan` -- applies them to a :class:`~trickles.models.transformer.Transformer` built on the meta device
  (:func:`~.plan.apply_tensor_parallel`).

Grids (2-D, 2.5-D, 3-D: Colossal-AI's, Optimus), ``parallel.tp_mode`` ``"2d"``, ``"2.5d"``, ``"3d"``:

* :mod:`.grid_linear` -- the linears (SUMMA on a ``q x q`` grid, its 2.5-D stack, the 3-D cube) and their bytes
  sent;
* :mod:`.grid_model` -- everything else of the model: how the residual stream is split
  (:class:`~.grid_model.GridContext`), norms, embedding, positions, loss;
* :mod:`.grid_plan` -- applies them to a meta-device model (:func:`~.grid_plan.apply_tensor_nd`).

Both:

* :mod:`.costs` -- what each mode costs a rank (bytes sent, parameters held), and :mod:`.activation_costs` what
  it saves for backward: the formulas the memory report reads and the tests hold the measured counts to, written
  in the terms of :mod:`.layout` (a group's shape, a block's linears).

Nothing is re-exported here: import from the modules.
"""
