"""Fault tolerance: a rank that dies (SIGKILL) or hangs mid-run brings the job down and back up (``--max-restarts``);
it continues from the newest complete checkpoint and ends with the weights of a run that was never interrupted.

The faults are deterministic: a ``sitecustomize.py`` on the job's ``PYTHONPATH`` (imported by every process, ranks
spawned by the local launcher and by torchrun alike) wraps ``Trainer.train_step`` so that rank 1, about to start step
``AFTER + 1`` -- just after step ``AFTER``'s checkpoint was taken on every rank, its write perhaps still in the
background -- kills itself or stalls. A marker file makes that happen once: the restarted ranks find it and train on.
The subprocess timeouts are safety nets only.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from trickles.testing import run_command
from trickles.train import checkpoint as ckpt
from trickles.train.pieces import PieceReader

RANKS, STEPS, EVERY, AFTER = 2, 6, 2, 4  # checkpoints at 2, 4, 6; the fault strikes after step 4's
SETTINGS = [
    "--set",
    "model.preset=tiny",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.max_bytes=120000",
    "--set",
    "train.global_batch=8",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "train.lr=3e-3",
    "--set",
    f"train.steps={STEPS}",
    "--set",
    f"train.checkpoint_every={EVERY}",
    "--set",
    "train.keep_checkpoints=5",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "train.plot=false",
    "--set",
    "parallel.zero=1",
]
HANG_TIMEOUT_S = 10  # parallel.timeout_s of the hanging job: long enough for any honest wait on a loaded machine
SAFETY_S = 600

FAULT = '''\
"""Test fault for trickles (tests/e2e/test_fault.py): rank {rank} {action}s before step {after} + 1, once."""
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time


def _patch(trainer):
    train_step = trainer.train_step

    def train_step_with_fault(self):
        if self.step == {after} and self.topo.rank == {rank} and not os.path.exists({marker!r}):
            with open({marker!r}, "w") as f:
                f.write(str(os.getpid()))
            if {action!r} == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep({stall_s})  # "stall": stuck outside any communication call, until the watchdog ends the job
        return train_step(self)

    trainer.train_step = train_step_with_fault


class _Finder(importlib.abc.MetaPathFinder):
    """Patches trickles.train.trainer when some process imports it (only the ranks do)."""

    def find_spec(self, name, path=None, target=None):
        if name != "trickles.train.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module.Trainer)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def _command(tmp, out, launcher="trickles", restarts=2, extra=()):
    settings = [*SETTINGS, "--set", f"data.cache_dir={tmp}/cache", "--set", f"train.out_dir={out}", *extra]
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(RANKS),
            "--max-restarts",
            str(restarts),
            "-m",
            "trickles",
            "train",
            "--quiet",
            *settings,
        ]
    return [
        sys.executable,
        "-m",
        "trickles",
        "train",
        "--nproc",
        str(RANKS),
        "--max-restarts",
        str(restarts),
        "--quiet",
        *settings,
    ]


def _with_fault(tmp_path, action: str, after: int = AFTER) -> tuple[dict, str]:
    """The environment of a job whose rank 1 does ``action`` ("kill" or "stall") once, before step ``after`` + 1; and
    the marker's path."""
    folder, marker = tmp_path / "fault", str(tmp_path / "fault struck")
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        FAULT.format(rank=1, after=after, action=action, marker=marker, stall_s=SAFETY_S)
    )
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1"), marker


def _weights(out) -> dict[str, torch.Tensor]:
    path = ckpt.find_latest(os.path.join(out, "checkpoints"))
    assert path is not None and path.endswith(f"step_{STEPS:06d}"), path
    reader = PieceReader(path, "model")
    return {k: reader.read(k) for k in reader.keys()}


def _losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def _check_like_uninterrupted(out, straight, job) -> None:
    # resumed from the newest complete checkpoint: step 4's, written in the background (train.async_checkpoint), if
    # its write finished before the fault struck, else step 2's -- a rank killed during a save loses only that save
    resumed = [
        f"[trickles] restart 1: continuing from {out}/checkpoints/step_{s:06d}\n" in job.stdout
        for s in (AFTER - EVERY, AFTER)
    ]
    assert any(resumed), job.stdout + job.stderr
    assert job.stdout.count("continuing from") == 1
    # every step logged once, with the uninterrupted run's losses, and the same final weights: bit for bit, since
    # the layout, the data order and the random states are the same (a resume restores all of them)
    assert _losses(out) == _losses(straight)
    assert [s for s, _ in _losses(out)] == list(range(1, STEPS + 1))
    a, b = _weights(out), _weights(straight)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fault")
    straight = run_command(_command(tmp, tmp / "straight"), text=True, timeout=SAFETY_S)
    assert straight.returncode == 0, straight.stderr
    assert "restart" not in straight.stdout + straight.stderr
    return tmp, tmp / "straight"


@pytest.mark.parametrize("launcher", ["trickles", "torchrun"])
def test_killed_rank_restarts_and_finishes_like_an_uninterrupted_run(uninterrupted, tmp_path, launcher):
    """Under our launcher or torchrun (``--max-restarts``): every step's loss and the final weights those of the
    uninterrupted run, which our launcher ran -- so torchrun also runs the identical job."""
    tmp, straight = uninterrupted
    out = tmp_path / "killed"
    env, marker = _with_fault(tmp_path, "kill")
    job = subprocess.run(_command(tmp, out, launcher), capture_output=True, text=True, timeout=SAFETY_S, env=env)
    assert job.returncode == 0, job.stderr
    assert os.path.exists(marker), "the fault never struck"
    if launcher == "trickles":  # which rank the launcher names first depends on who noticed: rank 1 or its peer
        assert "[trickles] rank " in job.stderr and "restarting all 2 ranks (attempt 2 of 3)" in job.stderr, job.stderr
        assert "attempt 3" not in job.stderr
    _check_like_uninterrupted(out, straight, job)


def test_hang_ends_the_attempt_and_max_restarts_finishes_the_run(uninterrupted, tmp_path):
    """Rank 1 stalls outside any communication call; rank 0's next collective waits past parallel.timeout_s; the
    watchdog ends the attempt with the hang status, both ranks saying where they were; the launcher restarts the
    job (status 4 counts as a failure), and attempt 2 continues from the newest checkpoint to the end."""
    tmp, straight = uninterrupted
    out = tmp_path / "hung"
    env, marker = _with_fault(tmp_path, "stall")
    job = run_command(
        _command(tmp, out, restarts=1, extra=["--set", f"parallel.timeout_s={HANG_TIMEOUT_S}"]),
        text=True,
        timeout=SAFETY_S,
        env=env,
    )
    assert job.returncode == 0, job.stderr
    assert os.path.exists(marker), "the fault never struck"
    reports = [line for line in job.stderr.splitlines() if line.startswith("[trickles] hang: ")]
    assert len(reports) == 2, job.stderr
    rank0 = next(
        line for line in reports if line.startswith(f"[trickles] hang: rank 0 (dp 0/2) at step {AFTER + 1}: inside ")
    )
    assert f"more than the {HANG_TIMEOUT_S} s allowed (parallel.timeout_s)" in rank0 and "on group '" in rank0, rank0
    rank1 = next(line for line in reports if line.startswith("[trickles] hang: rank 1 (dp 1/2)"))
    assert "not inside a communication call; stopping because rank 0 (dp 0/2)" in rank1, rank1
    assert "[trickles] a communication call was stuck past parallel.timeout_s (rank " in job.stderr
    assert "restarting all 2 ranks (attempt 2 of 2)" in job.stderr
    _check_like_uninterrupted(out, straight, job)
