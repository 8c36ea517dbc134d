"""Checkpoint saves that do not stop training and that training survives (:mod:`trickles.train.saver`): a save in the
background resumes exactly; failed saves (injected with ``TRICKLES_FAIL_SAVES``) are logged, recorded and leave no
directory, the run going on -- or stopping with exit status 1 after ``train.max_failed_saves`` in a row; one rank's
failure fails the save on every rank; an unwritable ``train.out_dir`` is refused before the first step."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_config

from trickles.errors import CheckpointError
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train import checkpoint as ckpt
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


def _cli(tmp, faults, steps, *extra):
    """``trickles train`` with tiny_config's settings, checkpoints every 2 steps, saves failing as ``faults`` says."""
    env = {**os.environ, "TRICKLES_FAIL_SAVES": faults}
    out = str(tmp / "run")
    cmd = [
        sys.executable,
        "-m",
        "trickles",
        "train",
        "--set",
        "model.preset=tiny",
        "--set",
        "data.seq_len=32",
        "--set",
        "data.max_bytes=120000",
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.global_batch=8",
        "--set",
        "train.warmup_steps=2",
        "--set",
        "train.lr=3e-3",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.sample_tokens=0",
        "--set",
        "train.plot=false",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        f"train.out_dir={out}",
        *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300), out


def test_failed_saves_are_survived_and_leave_nothing_behind(tmp_path):
    """Failures at the first two checkpoint steps: every step runs, exit status 0, both failures logged and in the
    metrics, no partial directory, and the last checkpoint holds the run's final weights (it resumes exactly)."""
    proc, out = _cli(tmp_path, "2,4", 6)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = proc.stdout + proc.stderr
    for step in (2, 4):
        assert f"checkpoint step {step} failed: OSError" in log and "training goes on" in log
    assert "step 6/6" in log
    d = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(d)) == ["step_000006"]  # nothing half-written, nothing of the failed steps
    with open(os.path.join(out, "metrics.jsonl")) as f:
        failed = [r["step"] for r in map(json.loads, f) if "checkpoint_failed" in r]
    assert failed == [2, 4]
    clean = _trainer(tiny_config(tmp_path / "clean", steps=6))
    clean.fit()
    resumed = _trainer(tiny_config(tmp_path / "clean", steps=6))
    resumed.load_checkpoint(os.path.join(d, "step_000006"))
    assert resumed.step == 6
    for n, w in _weights(resumed).items():
        assert torch.equal(w, _weights(clean)[n]), n


def test_saves_failing_every_time_stop_the_run_with_one_line(tmp_path):
    proc, out = _cli(tmp_path, "*", 12, "--set", "train.max_failed_saves=2")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 checkpoint saves failed in a row" in errors[0] and "resume from" in errors[0]
    assert "step 12/12" not in proc.stdout + proc.stderr  # stopped early
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_")]


def _one_rank_fails(tmp):
    os.environ["TRICKLES_FAIL_SAVES"] = "2@1"  # rank 1's write at step 2 only
    try:
        tr = _trainer(tiny_config(tmp, "train.checkpoint_every=2", "parallel.dp=2", steps=4), world=2)
        tr.fit()
    finally:
        del os.environ["TRICKLES_FAIL_SAVES"]
    return tr.saver.failures, sorted(os.listdir(tr.ckpt_dir))


def test_one_ranks_failed_write_fails_the_save_on_every_rank(tmp_path):
    """Rank 0 commits only when every rank's part is written: rank 1 failing at step 2 removes that save, both ranks
    count it (rank 1 with its own reason), and step 4's save is whole."""
    (fail0, listing), (fail1, _) = run_ranks(2, _one_rank_fails, str(tmp_path))
    assert [s for s, _ in fail0] == [s for s, _ in fail1] == [2]
    assert "rank 1" in fail0[0][1] and "injected" in fail1[0][1]
    assert listing == ["step_000004"]


def test_an_unwritable_out_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = tiny_config(tmp_path, f"train.out_dir={blocker}/run")
    with pytest.raises(
        CheckpointError, match="cannot write checkpoints to .*set train.out_dir to a writable directory"
    ):
        _trainer(cfg)


def test_a_leftover_partial_save_is_removed_and_never_resumed(tmp_path):
    """A run killed during a save leaves ``step_N.tmp``: ``--resume auto`` ignores it, the next save removes it."""
    cfg = tiny_config(tmp_path, steps=2)
    d = os.path.join(cfg.train.out_dir, "checkpoints")
    os.makedirs(os.path.join(d, "step_000007.tmp"))
    tr = _trainer(cfg)
    assert ckpt.find_latest(d) is None
    tr.fit()
    assert sorted(os.listdir(d)) == ["step_000002"]


def test_sigterm_finishes_the_step_saves_and_stops(tmp_path):
    """SIGTERM to the launcher reaches both ranks; they agree on a step, save its checkpoint (waited for) and exit
    143; the checkpoint is the newest step logged, complete."""
    import signal
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "trickles",
        "train",
        "--nproc",
        "2",
        "--set",
        "model.preset=tiny",
        "--set",
        "data.seq_len=32",
        "--set",
        "data.max_bytes=120000",
        "--set",
        f"data.cache_dir={tmp_path}/cache",
        "--set",
        "train.steps=100000",
        "--set",
        "train.global_batch=8",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.sample_tokens=0",
        "--set",
        "train.plot=false",
        "--set",
        f"train.out_dir={out}",
    ]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=180)
    assert job.returncode == 143, (job.returncode, stderr[-2000:])
    assert "the ranks saved a checkpoint and stopped" in stderr, stderr[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    saved = ckpt.list_checkpoints(str(out / "checkpoints"))
    assert len(saved) == 1 and saved[0][0] == steps[-1] >= 3 and ckpt.is_complete(saved[0][1])
