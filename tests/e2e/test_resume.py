"""Checkpoint + resume continues exactly: N steps, save, load, N steps == 2N steps straight."""

import os

import pytest
import torch
from helpers import tiny_config

from trickles.topology import ParallelDims
from trickles.train import checkpoint as ckpt
from trickles.train.trainer import Trainer


def _run(cfg, steps, resume=None):
    trainer = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    if resume:
        trainer.load_checkpoint(resume)
    losses = []
    while trainer.step < steps:
        losses.append(trainer.train_step()["loss"])
    return trainer, losses


def test_resume_is_exact(tmp_path):
    # dropout on, so the RNG state has to come back too
    cfg = tiny_config(tmp_path, "model.dropout=0.1", "train.micro_batch=4", steps=8)
    _, straight = _run(cfg, 8)
    first, head = _run(cfg, 4)
    path = first.save_checkpoint()
    assert os.path.basename(path) == "step_000004" and ckpt.is_complete(path)
    resumed, tail = _run(cfg, 8, resume=path)
    assert head + tail == straight  # bitwise: same data, same RNG, same optimizer state
    again, _ = _run(cfg, 8)
    for (n, a), b in zip(resumed.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), n


def test_keeps_last_k_and_ignores_incomplete(tmp_path):
    cfg = tiny_config(tmp_path, "train.keep_checkpoints=2", steps=3)
    trainer = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    for _ in range(3):
        trainer.train_step()
        trainer.save_checkpoint()
    d = os.path.join(cfg.train.out_dir, "checkpoints")
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [2, 3]
    os.makedirs(os.path.join(d, "step_000009.tmp"))  # a write that never finished
    os.makedirs(os.path.join(d, "step_000010"))  # no manifest
    assert ckpt.find_latest(d).endswith("step_000003")
    with open(os.path.join(d, "step_000003", "model-rank00000.safetensors"), "r+b") as f:
        f.truncate(100)
    assert ckpt.find_latest(d).endswith("step_000002")  # damaged newest is skipped


def test_metrics_file_tensorboard_and_plot(tmp_path):
    """Each record holds what its step did: the loss a separate identical run computes, the samples consumed so far,
    throughput equal to the step's tokens over its own recorded time; TensorBoard holds the same numbers."""
    import json
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trickles.train.metrics import read_metrics

    cfg = tiny_config(tmp_path, "train.tensorboard=true", "train.plot=true", "train.eval_every=2", steps=4)
    trainer = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    began = time.perf_counter()
    trainer.fit()
    took = time.perf_counter() - began
    _, by_hand = _run(cfg, 4)  # the same steps, taken one by one
    out = cfg.train.out_dir
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert records == json.loads(json.dumps(trainer.history))  # the file holds what fit() returned
    tokens = cfg.train.global_batch * cfg.data.seq_len
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == by_hand
    assert [r["consumed_samples"] for r in records] == [cfg.train.global_batch * s for s in (1, 2, 3, 4)]
    for r in records:
        assert r["step_time"] > 0 and r["tokens_per_s"] == pytest.approx(tokens / r["step_time"], rel=1e-12)
        assert r["flops_per_s"] == pytest.approx(trainer.flops_per_token * tokens / r["step_time"], rel=1e-12)
        assert r["mfu"] is None  # no known peak for a CPU
    # the steps' own times lie inside fit()'s (an order of events, not a speed: seconds, not milliseconds)
    assert sum(r["step_time"] for r in records) <= took
    assert [r.get("val_loss") is not None for r in records] == [False, True, False, True]

    events = EventAccumulator(os.path.join(out, "tb"))
    events.Reload()
    for key in ("loss", "tokens_per_s", "val_loss", "grad_norm"):
        logged = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        scalars = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in scalars] == [s for s, _ in logged], key
        assert [v for _, v in scalars] == pytest.approx([v for _, v in logged], rel=1e-6), key  # stored as float32
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
