"""Checkpoint saves that do not stop training and that training survives (:mod:`trickles.train.saver`): a save in the
background resumes exactly; saves failing (injected with ``TRICKLES_FAIL_SAVES``) stop the run with exit status 5
after ``train.max_failed_saves`` in a row, and a failed final save at once (never status 0), naming the int8 export
that quantization-aware training then could not write; a failed write of rank 0 leaves the directory to the other
ranks until the save is settled; an unwritable ``train.out_dir`` is refused before the first step. The fault matrix
(kills, failures on either rank first, SIGTERM) is tests/e2e/test_fault.py."""

import os
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config

from trickles.data import ByteTokenizer
from trickles.errors import EXIT_SAVES_FAILED, CheckpointError, SavesFailed
from trickles.topology import ParallelDims
from trickles.train import checkpoint as ckpt
from trickles.train.saver import Saver, Snapshot
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")


def _trainer(cfg, world=1):
    return Trainer(cfg, cfg.validate(world).build(CPU) if world > 1 else ParallelDims().build(CPU), quiet=True)


def _weights(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def test_a_background_save_lets_training_go_on_and_resumes_exactly(tmp_path):
    """A save with ``wait=False`` returns before its files exist (a writer thread holds a host copy) while the next
    steps run; once settled it is complete, and resuming from it reaches the uninterrupted run's weights."""
    cfg = tiny_config(tmp_path, "train.checkpoint_every=2", steps=6)
    straight = _trainer(cfg)
    straight.fit()
    final = _weights(straight)

    tr = _trainer(tiny_config(tmp_path / "b", steps=6))
    tr.train_step(), tr.train_step()
    assert tr.save_checkpoint(wait=False) is None and tr.saver.host_bytes > 0  # in flight, its host copy held
    tr.train_step()  # training goes on meanwhile
    path = tr.saver.settle()
    assert path.endswith("step_000002") and ckpt.is_complete(path) and tr.saver.host_bytes == 0
    for start in ("step_000002", "step_000004"):
        source = path if start == "step_000002" else os.path.join(cfg.train.out_dir, "checkpoints", start)
        resumed = _trainer(cfg)
        resumed.load_checkpoint(source)
        while resumed.step < 6:
            resumed.train_step()
        for n, w in _weights(resumed).items():
            assert torch.allclose(w, final[n], atol=1e-6, rtol=0), (start, n)


def test_saves_failing_every_time_stop_the_run(tmp_path, monkeypatch):
    """``train.max_failed_saves`` failures in a row stop the run (status 5) where the second is found: step 4's
    background save is settled at step 6's checkpoint step; nothing of either save is left."""
    monkeypatch.setenv("TRICKLES_FAIL_SAVES", "*")
    tr = _trainer(tiny_config(tmp_path, "train.checkpoint_every=2", "train.max_failed_saves=2", steps=8))
    with pytest.raises(SavesFailed, match="2 checkpoint saves failed in a row") as e:
        tr.fit()
    assert e.value.exit_code == EXIT_SAVES_FAILED and "--resume auto (it continues from step 0" in str(e.value)
    assert tr.step == 6 and os.listdir(tr.ckpt_dir) == []


def test_an_unwritable_out_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = tiny_config(tmp_path, f"train.out_dir={blocker}/run")
    with pytest.raises(
        CheckpointError, match="cannot write checkpoints to .*set train.out_dir to a writable directory"
    ):
        _trainer(cfg)


def test_a_failed_final_save_ends_the_run_with_its_status_not_success(tmp_path, monkeypatch):
    """The only save, the final one, fails: no later step can try again, so the run raises SavesFailed (status 5)
    saying so -- with quantization-aware training also that the int8 export was not written -- and leaves nothing."""
    monkeypatch.setenv("TRICKLES_FAIL_SAVES", "3")
    tr = _trainer(tiny_config(tmp_path, "train.checkpoint_every=0", "train.qat=true", steps=3))
    with pytest.raises(SavesFailed, match="final checkpoint, step 3, was not saved: OSError") as e:
        tr.fit()
    assert e.value.exit_code == EXIT_SAVES_FAILED and "the int8 export of train.qat" in str(e.value)
    assert os.listdir(tr.ckpt_dir) == [] and not [n for n in os.listdir(tr.cfg.train.out_dir) if "int8" in n]


def test_a_failed_rank0_write_leaves_the_directory_to_the_other_ranks_until_settled(tmp_path, monkeypatch):
    """Rank 0's write fails while rank 1 has not finished writing: rank 0's writer must not remove ``step_N.tmp``
    under rank 1; the directory goes once the save is settled (every rank's writer joined before the all-reduce)."""
    monkeypatch.setenv("TRICKLES_FAIL_SAVES", "4@0")
    world = SimpleNamespace(size=2, barrier=lambda: None, all_reduce=lambda t, op: t, broadcast=lambda t, src: t)
    topo = SimpleNamespace(rank=0, world_size=2, is_main=True, comm=lambda name: world)
    saver = Saver(topo, background=True, max_failed=3, timeout_s=300, say=print)
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    files = {"model-rank00000.safetensors": {"w": (torch.ones(3), {"global_shape": [3]})}}
    tmp = str(ckpt_dir / "step_000004.tmp")
    assert saver.save(lambda t: Snapshot(4, t, files, {"step": 4}, ByteTokenizer()), str(ckpt_dir), 4, False) is None
    saver._flight.thread.join()  # rank 0's part has failed
    assert os.path.isdir(tmp), "rank 0 removed the directory while rank 1 may still be writing into it"
    with open(os.path.join(tmp, "optimizer-rank00001.safetensors"), "wb") as f:  # rank 1 finishes its part
        f.write(b"rank 1's bytes")
    assert saver.settle() is None and saver.failures[0][0] == 4 and "(rank 0)" in saver.failures[0][1]
    assert os.listdir(ckpt_dir) == []  # removed once settled: nothing left behind
