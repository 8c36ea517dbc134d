"""The overlapped offload (``memory.offload_overlap``, :mod:`trickles.optim.offload`): the order of events, and the
same weights as the offloaded step that waits for every copy.

A CPU has no copy engine to overlap, so these tests prove the order the overlap relies on from the engine's event
trace: gradients leave for the host during backward (a bucket's copy right after its reduction, before backward
ends), the host steps the buckets in forward order on its thread after ``step()`` has returned, and each block's
forward starts once its own buckets are back and gathered -- while the host still updates later blocks. The host
step is slowed down (20 ms per bucket) so that this interleaving does not depend on the machine's speed.
"""

import time

import pytest
import torch
from helpers import tiny_config

from trickles.optim.offload import OverlappedHostStep
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('overlap-cache')}"


def _run(tmp, cache, stage, overlap, delay=0.0, steps=3):
    cfg = tiny_config(
        tmp,
        cache,
        f"parallel.zero={stage}",
        "parallel.bucket_mb=0.02",
        "memory.offload_optimizer=true",
        f"memory.offload_overlap={str(overlap).lower()}",
        "train.micro_batch=2",
        steps=steps,
    )
    tr = Trainer(cfg, ParallelDims(dp=2).build(torch.device("cpu")), quiet=True)
    engine, events = tr.engine, []
    host = engine.optimizer.overlapped
    if delay:  # this engine's host step only (the rank process runs other tests after this one)
        assert isinstance(host, OverlappedHostStep)
        slow = host._step_unit

        def step_unit(u):
            time.sleep(delay)
            slow(u)

        host._step_unit = step_unit
    if overlap:
        engine.set_trace(events)
        for name, block in tr.model.layers.items():
            block.register_forward_pre_hook(lambda m, a, name=name: events.append(("forward", int(name))))
    needs = {
        int(name): sorted({engine._unit_of[engine._slot_of[id(p)].bucket] for p in block.parameters()})
        for name, block in tr.model.layers.items()
    }
    losses, marks = [], []
    for _ in range(steps):
        marks.append(len(events))
        losses.append(tr.train_step()["loss"])
    return (
        losses,
        {k: v.clone() for k, v in engine.full_state().items()},
        events,
        marks,
        needs,
        len(engine.layout.buckets),
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_overlap_order_of_events(tmp_path, cache, stage):
    for _, _, events, marks, needs, buckets in run_ranks(2, _run, str(tmp_path), cache, stage, True, 0.02):
        assert buckets >= 6
        units = range(buckets)
        for s in range(1, len(marks)):  # step s's backward, then its host step under step s + 1's forward
            step = events[marks[s] : marks[s + 1] if s + 1 < len(marks) else len(events)]
            where = {e: i for i, e in reversed(list(enumerate(step)))}  # first occurrence of each event
            end = where[("backward_done", None)]  # autograd's backward of the last micro-batch returned
            assert end < where[("backward_end", None)]
            early = [u for u in units if where[("grads_to_host", u)] < end]
            assert early, f"no gradient left for the host before backward ended (step {s})"
            for u in early:  # ... each right after its bucket's reduction completed
                assert any(step[i][0] == "reduced" for i in range(where[("grads_to_host", u)])), u
            back = where[("step_returned", None)]
            after = events[marks[s] + back :]  # the host step of step s, and step s + 1 (or the end of the run)
            order = {e: i for i, e in reversed(list(enumerate(after)))}
            steps_at = [order[("host_step", u)] for u in units]
            assert steps_at == sorted(steps_at), "the host steps buckets in forward order"
            first_forward = (
                min(order[("forward", k)] for k in needs if ("forward", k) in order) if s + 1 < len(marks) else None
            )
            if first_forward is None:
                continue
            assert first_forward < max(steps_at), "the next forward started only after the whole host step"
            for k, mine in needs.items():
                f = order[("forward", k)]
                for u in mine:  # a block runs once its own buckets are updated, copied back and gathered (unit u is
                    # bucket buckets - 1 - u: the last bucket holds the first layers)
                    assert (
                        order[("host_step", u)]
                        < order[("params_to_device", u)]
                        < order[("gather", buckets - 1 - u)]
                        < f
                    )
                later = [u for u in units if u > max(mine)]
                if k == min(needs) and later:  # the first block ran while later buckets were still being updated
                    assert f < max(order[("host_step", u)] for u in later)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_overlap_gives_the_waiting_steps_weights(tmp_path, cache, stage):
    """The overlapped step is the same arithmetic as the one that waits: the same losses and weights, bit for bit."""
    plain = run_ranks(2, _run, str(tmp_path), cache, stage, False)
    overlapped = run_ranks(2, _run, str(tmp_path), cache, stage, True)
    for (l0, w0, *_), (l1, w1, *_) in zip(plain, overlapped):
        assert l0 == l1
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)


def _tp_run(tmp, cache, overlap):
    cfg = tiny_config(
        tmp,
        cache,
        "parallel.zero=1",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.bucket_mb=0.02",
        "memory.offload_optimizer=true",
        f"memory.offload_overlap={str(overlap).lower()}",
        steps=3,
    )
    tr = Trainer(cfg, cfg.validate(4).build(torch.device("cpu")), quiet=True)
    early = tr.engine._early_copies
    losses = [tr.train_step()["loss"] for _ in range(3)]
    return losses, {k: v.clone() for k, v in tr.engine.full_state().items()}, early


def test_offload_overlap_waits_for_partial_gradients_under_tensor_parallelism(tmp_path, cache):
    """dp2 x tp2 with sequence parallelism: the norm weights' gradients are partial until finish_backward sums them over
    tp, so none may leave for the host early; the overlapped step still equals the waiting one bit for bit."""
    plain = run_ranks(4, _tp_run, str(tmp_path), cache, False)
    overlapped = run_ranks(4, _tp_run, str(tmp_path), cache, True)
    for (l0, w0, _), (l1, w1, early) in zip(plain, overlapped):
        assert not early
        assert l0 == l1 and all(torch.equal(w0[k], w1[k]) for k in w0)


def test_an_error_in_the_host_step_surfaces_on_the_main_thread():
    """The host thread's failure is raised where the main thread next waits, not lost."""
    p = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    masters = [torch.ones(4), torch.ones(3)]
    host = [torch.zeros(4), torch.zeros(3)]
    for m, g in zip(masters, host):
        m.grad = g
    opt = torch.optim.AdamW([{"params": masters}], lr=0.1)
    step = OverlappedHostStep(
        opt,
        [[0], [1]],
        [x.data for x in p],
        [torch.full((4,), 0.5), torch.full((3,), 0.5)],
        masters,
        host,
        torch.device("cpu"),
    )
    step.launch(0.1)
    step.wait()
    assert torch.equal(p[0].data, masters[0]) and not torch.equal(masters[0], torch.ones(4))  # stepped and copied back
    broken = step._step_unit

    def fail(u):
        if u == 1:
            raise RuntimeError("host step failed")
        broken(u)

    step._step_unit = fail
    step.launch(0.1)
    with pytest.raises(RuntimeError, match="host step failed"):
        step.wait_unit(1)
    with pytest.raises(RuntimeError, match="host step failed"):
        step.wait()


def _one_device(tmp, cache, overlap, device):
    cfg = tiny_config(
        tmp,
        cache,
        "parallel.zero=1",
        "parallel.bucket_mb=0.02",
        "memory.offload_optimizer=true",
        f"memory.offload_overlap={str(overlap).lower()}",
        f"train.device={device}",
        steps=3,
    )
    tr = Trainer(cfg, ParallelDims(dp=1).build(torch.device(device)), quiet=True)
    losses = [tr.train_step()["loss"] for _ in range(3)]
    return losses, {k: v.detach().cpu().clone() for k, v in tr.engine.full_state().items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.needs_gpu)])
def test_offload_overlap_on_one_device(tmp_path, cache, device):
    """One rank (on CUDA: pinned host memory, side streams and events): the overlapped step equals the waiting one."""
    ((l0, w0),) = run_ranks(1, _one_device, str(tmp_path), cache, False, device)
    ((l1, w1),) = run_ranks(1, _one_device, str(tmp_path), cache, True, device)
    assert l0 == l1 and all(torch.equal(w0[k], w1[k]) for k in w0)
