"""Measuring a pipeline stage: the activations it holds over the micro-batches in flight, over a whole step.

A pipeline rank keeps each chunk-micro-batch's saved tensors from its forward to its backward, so one
micro-batch's forward (what :func:`~trickles.memory.measure.measure` meters without pipeline stages) is not what
it holds. :func:`meter_pipeline_step` runs one training step with every forward of the rank's
:class:`~trickles.parallel.pipeline.runner.PipelineRunner` under its own
:class:`~trickles.memory.activations.ActivationMeter` (the bytes autograd saves, per layer; ``"head"``: the
embedding or the head), and walks the action list the runner ran: the most ``layers + head`` bytes of the
chunk-micro-batches whose forward ran and whose backward did not is what the stage held -- the measured
counterpart of :func:`~trickles.memory.stages.peak_in_flight` (same walk, measured bytes).

:func:`gather_stages` collects every rank's measurement on rank 0, one per pipeline rank (the first replica's,
tensor-parallel rank 0's), so the report shows every stage predicted against measured.
"""

from __future__ import annotations

from .activations import ActivationMeter
from .stages import peak_in_flight


def meter_pipeline_step(trainer) -> dict:
    """Runs one training step of ``trainer`` (a pipeline stage), metering each forward; returns
    ``{"activations", "head", "in_flight", "per_layer": {name: bytes of the first micro-batch}}``."""
    runner = trainer.pipeline
    saved: dict[tuple[int, int], dict[str, int]] = {}
    forward = runner._forward
    exclude = getattr(trainer.engine, "gathered_storages", None)  # ZeRO-3's gathered weights are model state

    def metered(a, *args, **kwargs):
        with ActivationMeter(trainer.model, exclude=exclude) as meter:
            forward(a, *args, **kwargs)
        saved[(a.chunk, a.micro)] = dict(meter.per_layer)

    runner._forward = metered  # an instance attribute, shadowing the method for this step only
    try:
        trainer.train_step()
    finally:
        del runner._forward
    weights = {key: (sum(v for k, v in per.items() if k != "head"), per.get("head", 0)) for key, per in saved.items()}
    lay, head, alive = peak_in_flight(runner.actions, weights)  # the order the runner ran, with what each saved
    first = {}
    for (_, m), per in saved.items():
        if m == 0:
            first.update({k: v for k, v in per.items() if k != "head"})
    return {"activations": lay, "head": head, "in_flight": alive, "per_layer": first}


def gather_stages(trainer, measured: dict, layers: list[int]) -> tuple[list[dict], list[list[int]]] | None:
    """On global rank 0: ``(measured categories, per-layer bytes)`` of every pipeline rank, from the first rank of
    each (lowest data-, context- and tensor-parallel ranks); None on the other ranks. Every rank must call it."""
    import torch.distributed as dist

    topo = trainer.topo
    mine = (topo.comm("pp").rank, topo.replicas().rank, topo.comm("tp").rank, measured, layers)
    rows = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        if dist.get_rank() != 0:
            return None
    best: dict[int, tuple] = {}
    for pp_rank, rep, tp, m, lay in rows:
        if pp_rank not in best or (rep, tp) < best[pp_rank][:2]:
            best[pp_rank] = (rep, tp, m, lay)
    stages = sorted(best)
    return [best[r][2] for r in stages], [best[r][3] for r in stages]
