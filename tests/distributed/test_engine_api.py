"""The Engine API as a user calls it: a freshly built engine takes a plain ``backward()`` (no ``zero_grad``, no
``micro_step``) and reduces the gradients over the data-parallel group, as its constructor promises."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import tiny_config

from trickles.models import build_model
from trickles.parallel.data.ddp import average_gradients
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer


def _plain_backward_on_a_fresh_engine(tmp, stage):
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", f"parallel.zero={stage}")
    tr = Trainer(cfg, ParallelDims(dp=dist.get_world_size()).build(torch.device("cpu")), quiet=True)
    x, y = tr.train_data.micro_batches(0, 8, 4)[0]
    tr._loss(x, y).backward()  # straight after construction
    tr.engine.finish_backward()
    diff = _diff_from_averaged(tr, build_model(tr.model_cfg, cfg.train.seed), x, y, stage)
    before = [g.clone() for g in tr.engine.owned_grads()]
    tr.engine.scale_grads(0.25)  # how the fp16 loss scale is taken off the reduced gradients
    scaled = max((g - 0.25 * b).abs().max().item() for g, b in zip(tr.engine.owned_grads(), before))
    return diff, scaled, max(b.abs().max().item() for b in before)


def _diff_from_averaged(tr, plain, x, y, stage) -> float:
    """Largest difference between the engine's reduced gradients and ``plain``'s gradients averaged over dp."""
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    average_gradients(plain.parameters(), tr.dp)
    if stage == 0:
        got = {n: tr.engine.accumulated_grad(p).clone() for n, p in tr.engine.named}
        return max((got[n] - p.grad).abs().max().item() for n, p in plain.named_parameters())
    # ZeRO: each rank holds the reduced gradient of its segments
    ref = dict(plain.named_parameters())
    return max(
        (g - ref[s.slot.name].grad.flatten()[s.param_range[0] : s.param_range[1]]).abs().max().item()
        for s, g in zip(tr.engine.segments, tr.engine.optimizer.grads)
    )


def _backward_after_the_model_dropped_its_grads(tmp, stage):
    """A step, then ``model.zero_grad()`` (PyTorch's default sets every ``.grad`` to None), then the engine's
    ``zero_grad`` and a plain backward: the engine puts its gradient views back and reduces them. (Micro-batches of
    2: ZeRO-1 keeps a whole gradient buffer only when it accumulates.)"""
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", f"parallel.zero={stage}", "train.micro_batch=2")
    tr = Trainer(cfg, ParallelDims(dp=dist.get_world_size()).build(torch.device("cpu")), quiet=True)
    tr.train_step()
    plain = build_model(tr.model_cfg, cfg.train.seed)
    plain.load_state_dict({n: t.float() for n, t in tr.engine.full_state().items()}, strict=False)
    tr.model.zero_grad()
    tr.engine.zero_grad()
    buffer = tr.engine.grad_buffer.untyped_storage().data_ptr()
    views = sum(p.grad is not None and p.grad.untyped_storage().data_ptr() == buffer for p in tr.engine.params)
    x, y = tr.train_data.micro_batches(8, 8, 4)[0]
    tr._loss(x, y).backward()
    tr.engine.finish_backward()
    return _diff_from_averaged(tr, plain, x, y, stage), views, len(tr.engine.params)


@pytest.mark.parametrize("stage", [0, 1])
def test_engine_zero_grad_rebinds_after_the_model_dropped_its_grads(tmp_path, stage):
    """Every ``.grad`` is again a view of the flat gradient buffer (no second copy of the gradients, which the memory
    report would not count), and the backward is reduced."""
    for diff, views, params in run_ranks(2, _backward_after_the_model_dropped_its_grads, str(tmp_path), stage):
        assert views == params
        assert diff < 1e-6


@pytest.mark.parametrize("stage", [0, 1])
def test_a_fresh_engine_reduces_a_plain_backward(tmp_path, stage):
    for diff, scaled, largest in run_ranks(2, _plain_backward_on_a_fresh_engine, str(tmp_path), stage):
        assert diff < 1e-7  # the same averaged gradients as per-parameter all-reduce (fp32, summation order aside)
        assert largest > 0 and scaled == 0  # scale_grads multiplies every reduced gradient (exact: a power of two)


def _plain_backward_after_a_training_step(tmp, stage):
    """A training step (its backwards inside ``micro_step``), then a plain backward: reduced as well."""
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", f"parallel.zero={stage}", "train.micro_batch=2")
    tr = Trainer(cfg, ParallelDims(dp=dist.get_world_size()).build(torch.device("cpu")), quiet=True)
    tr.train_step()
    plain = build_model(tr.model_cfg, cfg.train.seed)
    plain.load_state_dict({n: t.float() for n, t in tr.engine.full_state().items()}, strict=False)
    x, y = tr.train_data.micro_batches(8, 8, 4)[0]
    tr.engine.zero_grad()
    tr.topo.ledger.reset()
    tr._loss(x, y).backward()
    during = tr.topo.ledger.snapshot().get("all_reduce/dp", {}).get("calls", 0)  # started while backward ran
    tr.engine.finish_backward()
    got = {n: tr.engine.accumulated_grad(p).clone() for n, p in tr.engine.named}
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    average_gradients(plain.parameters(), tr.dp)
    return (
        max((got[n] - p.grad).abs().max().item() for n, p in plain.named_parameters()),
        during,
        len(tr.engine.layout.buckets),
    )


def test_a_plain_backward_after_a_training_step_is_reduced_during_backward(tmp_path):
    """The step's micro-batches leave the engine ready for a plain backward again: its buckets are reduced while
    backward runs (every bucket, not deferred to ``finish_backward``), to the averaged gradients."""
    for diff, during, buckets in run_ranks(2, _plain_backward_after_a_training_step, str(tmp_path), 0):
        assert diff < 1e-6
        assert during == buckets > 1


def _first_parameter_waits(tmp):
    """After a ZeRO-1 step the parameters' all-gathers are in flight; the next forward waits for each piece's buckets
    as that piece starts (the embedding's first), not for everything at once."""
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", "parallel.zero=1")
    tr = Trainer(cfg, ParallelDims(dp=dist.get_world_size()).build(torch.device("cpu")), quiet=True)
    tr.train_step()
    engine = tr.engine
    waits = []
    real = engine.wait_for_parameters

    def record(buckets):
        waits.append(sorted(buckets))
        return real(buckets)

    engine.wait_for_parameters = record
    x, _ = tr.train_data.micro_batches(8, 8, 4)[0]
    with torch.no_grad():
        tr.model(x)
    bucket_of = {id(s.param): s.bucket for s in engine.layout.slots}
    embed = sorted({bucket_of[id(p)] for p in tr.model.embed.parameters()})
    return waits, embed, len(engine.layout.buckets)


def test_zero1_forward_waits_for_each_pieces_parameters_as_it_starts(tmp_path):
    for waits, embed, buckets in run_ranks(2, _first_parameter_waits, str(tmp_path)):
        assert buckets > 2 and waits[0] == embed  # the embedding's buckets only, then block by block
        assert {b for w in waits for b in w} == set(
            range(buckets)
        )  # every bucket waited for (shared ones by both pieces)


def _reductions_before_the_embedding_gradient(tmp):
    """Buckets are filled from the output backwards (DDP's reverse order), so some are already being reduced
    when backward reaches the embedding, the first layer."""
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05")
    tr = Trainer(cfg, ParallelDims(dp=dist.get_world_size()).build(torch.device("cpu")), quiet=True)
    started = []
    tr.model.embed.weight.register_hook(lambda g: started.append(tr.topo.ledger.calls("all_reduce", "dp")))
    x, y = tr.train_data.micro_batches(0, 8, 4)[0]
    tr.topo.ledger.reset()
    tr._loss(x, y).backward()
    tr.engine.finish_backward()
    return started[0], len(tr.engine.layout.buckets)


def test_gradient_reduction_overlaps_backward(tmp_path):
    for started, buckets in run_ranks(2, _reductions_before_the_embedding_gradient, str(tmp_path)):
        assert buckets > 2 and 0 < started < buckets
