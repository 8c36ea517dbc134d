"""Memory measured: the real trainer's bytes per device, in the categories :func:`~trickles.memory.report.predict`
predicts.

:func:`measure` runs a few training steps of a built trainer and reads back: parameters, gradients and optimizer
state from the tensors the data-parallel engine holds (which are all the live tensors); activations with
saved-tensor hooks (:class:`~trickles.memory.activations.ActivationMeter`) over one micro-batch; an asynchronous
save's host copies; and the peak: on CUDA the allocator's ``max_memory_allocated``, on a CPU the model states held
when the last step began plus the most that step allocates above them
(:func:`~trickles.memory.accounting.peak_allocated`, from the profiler's record of allocations).

A pipeline stage is metered over a whole step instead (:mod:`~trickles.memory.pipeline_meter`: what it holds over
the micro-batches in flight), each rank its own stage, and rank 0 gathers every stage's. Under expert parallelism the
rows each MoE block's experts received in the metered forward are noted beside the activations predicted at that
load (:mod:`~trickles.memory.routing`): the prediction assumes a balanced load, the measurement sees the routing.
"""

from __future__ import annotations

import torch

from .accounting import peak_allocated
from .activations import ActivationMeter
from .pipeline_meter import gather_stages, meter_pipeline_step
from .precision import policy
from .routing import at_load, routing_seen
from .table import MemoryReport, _fmt


def measure(trainer, report: MemoryReport, steps: int = 2) -> MemoryReport:
    """Runs ``steps`` training steps on ``trainer`` and fills ``report.measured`` (every rank must call it).

    A pipeline stage (``trainer.pipeline``) runs at least two: one metered over the whole step
    (:func:`~trickles.memory.pipeline_meter.meter_pipeline_step`: the activations it holds over the micro-batches in
    flight), the last profiled for the peak; each rank measures its own stage, and rank 0 gathers every stage's
    (``report.stages_measured``; ``report.measured``: the stage ``report.stage``)."""
    device = trainer.device
    pipelined = trainer.pipeline is not None
    metered = None
    if pipelined:
        metered = meter_pipeline_step(trainer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(max(1, steps) - 1 - pipelined):
        trainer.train_step()
    before = trainer.engine.memory()
    _, rise = peak_allocated(trainer.train_step, device)  # CPU: every allocation of the step, from the profiler
    states = trainer.engine.memory()
    if metered is None:
        x, y, *rest = trainer._shard(
            trainer.train_data.micro_batches(trainer.consumed, trainer.cfg.train.global_batch, trainer.micro_batch)
        )[0]
        documents = rest[1] if len(rest) > 1 else None  # packed documents' ids
        exclude = getattr(trainer.engine, "gathered_storages", None)
        trainer.engine.zero_grad()
        moe = getattr(trainer, "moe_stats", None)
        if moe is not None:
            moe.reset()  # this forward's routing only
        with ActivationMeter(trainer.model, exclude=exclude) as meter:
            loss = trainer._loss(x, y, documents=documents)
        if moe is not None and trainer.topo.dims.ep > 1:
            _routing_note(trainer, report, moe, meter.per_layer)
        loss.backward()  # release the graph the way training would
        trainer.engine.finish_backward()
        trainer.engine.zero_grad()
        per_layer = meter.per_layer
        metered = {"activations": sum(meter.layers.values()), "head": per_layer.get("head", 0)}
    else:
        per_layer = metered["per_layer"]
    m = dict(states)
    m["activations"], m["head"] = metered["activations"], metered["head"]
    on_device = 0 if report.host_optimizer else m["optimizer"]
    m["held"] = m["parameters"] + m["gradients"] + on_device + m["activations"] + m["head"]
    m["host"] = m["optimizer"] if report.host_optimizer else 0
    m["checkpoint_host"] = (
        sum(
            t.numel() * t.element_size()
            for f in trainer.engine.checkpoint_files(trainer.topo.rank).values()
            for t, _ in f.values()
        )
        if trainer.cfg.train.async_checkpoint
        else 0
    )  # a save's host copy
    if device.type == "cuda":
        m["peak"] = torch.cuda.max_memory_allocated(device)
    else:  # the model states held when the last step began, and the most the step allocated above them
        m["peak"] = (
            before["parameters"] + before["gradients"] + (0 if report.host_optimizer else before["optimizer"]) + rise
        )
        report.notes.append(
            "CPU: the measured peak is the model states plus the most the last step allocated above them "
            "(the profiler's record of allocations)"
        )
    ids = range(trainer.model_cfg.n_layers)
    layers = [per_layer.get(f"layers.{i}", 0) for i in ids if not pipelined or f"layers.{i}" in per_layer]
    report.measured, report.layers_measured = m, layers
    if pipelined:
        got = gather_stages(trainer, m, layers)
        if got is not None:
            report.stages_measured = got[0]
            report.measured, report.layers_measured = got[0][report.stage], got[1][report.stage]
    return report


def _routing_note(trainer, report: MemoryReport, stats, per_layer: dict) -> None:
    """Notes the rows each MoE block's experts received on this rank in the metered forward and the activations
    predicted at that load beside the measured ones (:mod:`~trickles.memory.routing`); ``report.routing``."""
    cfg, dims, mc = trainer.cfg, trainer.topo.dims, trainer.model_cfg
    received = routing_seen(stats, trainer.topo.comm("ep"))
    micro, _ = cfg.batch_plan(dims.dp)
    tokens = micro * cfg.data.seq_len // dims.cp
    routed = (tokens // dims.tp if cfg.parallel.sequence_parallel and dims.tp > 1 else tokens) // micro
    p = torch.finfo(policy(cfg.memory.precision, cfg.memory.grad_dtype).param_dtype).bits // 8
    m, seen = at_load(cfg, mc, received, report.layers_predicted, micro, routed, p, dims.ep, trainer.device.type)
    report.routing = {
        layer: {
            "received": received[layer],
            "balanced": m,
            "predicted_at_load": seen[layer],
            "measured": per_layer.get(f"layers.{layer}", 0),
        }
        for layer in received
    }
    parts = [
        f"block {layer} {r['received'] / m:.2f}x ({_fmt(r['predicted_at_load'])} predicted at it, "
        f"{_fmt(r['measured'])} measured)"
        for layer, r in report.routing.items()
    ]
    delta = sum(r["predicted_at_load"] - report.layers_predicted[layer] for layer, r in report.routing.items())
    report.notes.append(
        f"routing seen (expert-parallel rank {trainer.topo.comm('ep').rank}): rows its experts received "
        f"over the balanced {m:,}: "
        + "; ".join(parts)
        + f"; held at the routing seen: {_fmt(report.predicted['held'] + delta)}, peak at the routing "
        f"seen: {_fmt(report.predicted['peak'] + delta)}"
    )
