"""Checkpoint + resume continues exactly: N steps, save, load, N steps == 2N steps straight."""

import os

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
    import json

    from trickles.train.metrics import read_metrics

    cfg = tiny_config(tmp_path, "train.tensorboard=true", "train.plot=true", "train.eval_every=2", steps=4)
    trainer = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    trainer.fit()
    out = cfg.train.out_dir
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["val_loss"] is not None and "val_loss" not in records[0]
    assert json.loads(json.dumps(records[0]))["tokens_per_s"] > 0
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(out, "tb")))
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
