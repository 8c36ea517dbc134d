"""Fault tolerance, end to end through the CLI on 2 ranks of the tiny model, against one uninterrupted run.

* **The fault matrix** (:data:`MATRIX`; ``docs/checkpoints.md`` shows the same table, rendered from it): kill -9 of a
  rank at each phase of an asynchronous save, write failures on rank 1 first and on rank 0 first, a full disk during
  the final save, SIGTERM during a save and SIGTERM while saves fail -- each row's exit status, logged lines, disk and
  what ``--resume auto`` continues from asserted, and every chain of runs ending with the uninterrupted run's losses
  and weights, bit for bit. The faults are injected with ``TRICKLES_FAIL_SAVES`` (:mod:`trickles.train.faults`),
  at fixed phases of fixed saves: nothing waits on a clock.
* A rank killed (under torchrun) or hung mid-run brings the job down and back up (``--max-restarts``); it continues
  from the newest complete checkpoint like the uninterrupted run. These faults come from a ``sitecustomize.py`` on the
  job's ``PYTHONPATH`` (imported by every process, ranks spawned by torchrun included) that wraps
  ``Trainer.train_step`` so that rank 1, about to start step ``AFTER + 1``, kills itself or stalls, once (a marker
  file).

The subprocess timeouts are safety nets only.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from trickles.errors import EXIT_STATUSES
from trickles.testing import run_command
from trickles.train import checkpoint as ckpt
from trickles.train.pieces import PieceReader

RANKS, STEPS, EVERY, AFTER = 2, 8, 2, 4  # checkpoints at 2, 4, 6, 8; the sitecustomize faults strike after step 4's
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


def _command(tmp, out, launcher="trickles", restarts=2, extra=(), quiet=True):
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
        *(["--quiet"] if quiet else []),
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
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "loss" in r]  # (not the failed saves' records)


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


def test_killed_rank_under_torchrun_restarts_and_finishes_like_an_uninterrupted_run(uninterrupted, tmp_path):
    """Under ``torchrun --max-restarts``: every step's loss and the final weights those of the uninterrupted run,
    which our launcher ran -- so torchrun also runs the identical job. (Our launcher's restarts: the fault matrix.)"""
    tmp, straight = uninterrupted
    out = tmp_path / "killed"
    env, marker = _with_fault(tmp_path, "kill")
    job = subprocess.run(_command(tmp, out, "torchrun"), capture_output=True, text=True, timeout=SAFETY_S, env=env)
    assert job.returncode == 0, job.stderr
    assert os.path.exists(marker), "the fault never struck"
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


# ---- the fault matrix ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One case of the fault matrix, as docs/checkpoints.md shows it and the tests below assert it."""

    case: str
    status: int | None  # the exit status (of the attempt, for a kill under --max-restarts); None: training goes on
    logged: tuple[str, ...]  # lines of the output, each given by its parts in order (" … " between them)
    complete: int  # the newest complete checkpoint afterwards: the step --resume auto continues from
    leftover: str | None = None  # an incomplete directory left behind (the next run's first save removes it)


KILLS = "2@0:copy:kill#0,3@1:write:kill#1,4@1:marker:kill#2,5@0:manifest:kill#3,6@0:rename:kill#4"
KILLED = [
    ("kill -9 of rank 0 during the host copy of step 2's save", 0, 2),
    ("kill -9 of rank 1 while it writes its files (step 3)", 1, 3),
    ("kill -9 of rank 1 before its done marker, its files written (step 4)", 1, 4),
    ("kill -9 of rank 0 before the manifest, every marker seen (step 5)", 0, 5),
    ("kill -9 of rank 0 before the rename, the manifest written (step 6)", 0, 6),
]
ENOSPC = "OSError: [Errno 28] No space left on device"
MATRIX = [
    *(
        Row(
            case,
            1,
            (
                f"[trickles] rank {rank} was killed by SIGKILL; stopped the other ranks",
                f"[trickles] attempt {k + 1} ended with status 1; restarting all 2 ranks (attempt {k + 2} of 6)",
                f"[trickles] restart {k + 1}: continuing from … step_{step - 1:06d}",
            ),
            step - 1,
            f"step_{step:06d}.tmp",
        )
        for k, (case, rank, step) in enumerate(KILLED)
    ),
    Row(
        "write failure on rank 1 first (step 4)",
        None,
        (
            f"[trickles] checkpoint step 4 failed: {ENOSPC} … (rank 1); training goes on and the next checkpoint "
            "step tries again (1 of train.max_failed_saves=3 in a row)",
        ),
        2,
    ),
    Row(
        "write failure on rank 0 first (step 6)",
        None,
        (
            f"[trickles] checkpoint step 6 failed: {ENOSPC} … (rank 0); training goes on and the next checkpoint "
            "step tries again (2 of train.max_failed_saves=3 in a row)",
        ),
        2,
    ),
    Row(
        "full disk during the final save (step 8)",
        5,
        (
            f"[trickles] checkpoint step 8 failed: {ENOSPC} … (rank 0)",
            f"error: the final checkpoint, step 8, was not saved: {ENOSPC} … --resume auto (it continues from step 2)",
        ),
        2,
    ),
    Row(
        "SIGTERM while saves fail (every save fails; SIGTERM at step 6's)",
        6,
        (
            f"[trickles] checkpoint step 4 failed: {ENOSPC} … training goes on",
            f"[trickles] checkpoint step 6 failed: {ENOSPC}",
            f"error: SIGTERM: stopped after step 6, but its checkpoint was not saved ({ENOSPC} … --resume auto "
            "continues from step 2",
        ),
        2,
    ),
    Row(
        "SIGTERM during a save (step 4's)",
        143,
        ("[trickles] SIGTERM: stopped after step 4, its checkpoint saved and verified; continue with --resume auto",),
        4,
    ),
]


def matrix_table() -> str:
    """The fault matrix as the markdown table of docs/checkpoints.md."""
    lines = [
        "| case | exit status | lines logged | on disk afterwards | `--resume auto` continues from |",
        "|---|---|---|---|---|",
    ]
    for r in MATRIX:
        status = "training goes on" if r.status is None else str(r.status)
        logged = "<br>".join(f"`{line}`" for line in r.logged)
        disk = f"`step_{r.complete:06d}` the newest complete; " + (
            f"`{r.leftover}` (the next save removes it)" if r.leftover else "no `.tmp`"
        )
        lines.append(f"| {r.case} | {status} | {logged} | {disk} | `step_{r.complete:06d}` |")
    return "\n".join(lines)


def exit_status_table() -> str:
    """:data:`trickles.errors.EXIT_STATUSES` as the markdown table of docs/checkpoints.md."""
    lines = ["| status | `trickles.errors` | meaning | `--max-restarts` restarts it |", "|---|---|---|---|"]
    for code, (name, restarts, meaning) in EXIT_STATUSES.items():
        lines.append(f"| {code} | `{name}` | {meaning} | {'yes' if restarts else 'no'} |")
    return "\n".join(lines)


def test_the_docs_show_the_fault_matrix_and_the_exit_statuses():
    docs = (Path(__file__).parents[2] / "docs" / "checkpoints.md").read_text()
    assert exit_status_table() in docs, "docs/checkpoints.md's exit statuses differ from trickles.errors:\n" + (
        exit_status_table()
    )
    assert matrix_table() in docs, "docs/checkpoints.md's fault matrix differs from the tests':\n" + matrix_table()


def _logged(text: str, line: str) -> bool:
    parts = line.split(" … ")
    for candidate in text.splitlines():
        at = 0
        for part in parts:
            at = candidate.find(part, at)
            if at < 0:
                break
            at += len(part)
        else:
            return True
    return False


def _check_row(row: Row, job, ckpt_dir) -> None:
    text = job.stdout + job.stderr
    for line in row.logged:
        assert _logged(text, line), (row.case, line, text[-3000:])
    if row.leftover is not None:  # it was there: the next attempt's first save says it removed it
        assert f"[trickles] removed {ckpt_dir}/{row.leftover} (left by a save that did not finish)" in text, row.case
    else:
        assert not [n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")], (row.case, os.listdir(ckpt_dir))


def _matrix_run(tmp, out, faults: str, *extra: str):
    env = dict(os.environ, TRICKLES_FAIL_SAVES=faults)
    cmd = _command(tmp, out, restarts=len(KILLED) if faults == KILLS else 2, extra=extra, quiet=False)
    return run_command(cmd, text=True, timeout=SAFETY_S, env=env)


def _same_as_uninterrupted(out, straight) -> None:
    assert _losses(out) == _losses(straight)
    assert [s for s, _ in _losses(out)] == list(range(1, STEPS + 1))
    a, b = _weights(out), _weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_at_each_phase_of_an_asynchronous_save(uninterrupted, tmp_path):
    """One job under ``--max-restarts 5``, a checkpoint every step, killed once per phase (each attempt at the next
    save): each attempt ends with status 1 naming the killed rank, leaves that save's ``.tmp`` (even with its manifest
    written: never loaded), and the next continues from the previous step's complete checkpoint; the sixth attempt
    ends like the uninterrupted run."""
    tmp, straight = uninterrupted
    out = tmp_path / "killed"
    job = _matrix_run(tmp, out, KILLS, "--set", "train.checkpoint_every=1")
    assert job.returncode == 0, job.stderr[-3000:]
    for row in MATRIX[: len(KILLED)]:
        _check_row(row, job, out / "checkpoints")
    assert job.stdout.count("continuing from") == len(KILLED) and "attempt 6 ended" not in job.stderr
    _same_as_uninterrupted(out, straight)


def test_failed_writes_a_full_disk_and_sigterm_then_resume(uninterrupted, tmp_path):
    """Four runs into one out_dir, each but the first with ``--resume auto``: write failures on rank 1 then rank 0
    (survived), the final save failing (5); saves failing and SIGTERM (6); SIGTERM during a save (143); then the run
    to the end, like the uninterrupted one. No status here is restarted, whatever ``--max-restarts`` allows."""
    tmp, straight = uninterrupted
    out = tmp_path / "run"
    ckpt_dir = out / "checkpoints"
    rank1_first, rank0_first, final, term_failing, term = MATRIX[len(KILLED) :]

    job = _matrix_run(tmp, out, "4@1,6@0,8")
    assert job.returncode == final.status, job.stderr[-3000:]
    for row in (rank1_first, rank0_first, final):
        _check_row(row, job, ckpt_dir)
    assert "[trickles] step 8/8" in job.stdout + job.stderr  # every step ran
    assert job.stderr.splitlines()[-1].startswith("[trickles] not restarting: status 5")
    assert sorted(os.listdir(ckpt_dir)) == ["step_000002"]
    with open(out / "metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if "checkpoint_failed" in r] == [4, 6, 8]

    job = _matrix_run(tmp, out, "*,6@0:copy:term", "--resume", "auto")
    assert job.returncode == term_failing.status, job.stderr[-3000:]
    _check_row(term_failing, job, ckpt_dir)
    assert "restarting all" not in job.stderr and sorted(os.listdir(ckpt_dir)) == ["step_000002"]

    job = _matrix_run(tmp, out, "4@0:copy:term", "--resume", "auto")
    assert job.returncode == term.status, job.stderr[-3000:]
    _check_row(term, job, ckpt_dir)
    assert "restarting all" not in job.stderr and sorted(os.listdir(ckpt_dir)) == ["step_000002", "step_000004"]

    job = _matrix_run(tmp, out, "", "--resume", "auto")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "[trickles] step 5/8" in job.stderr and "step 4/8" not in job.stderr  # continued from step 4
    _same_as_uninterrupted(out, straight)


def test_a_sigterm_after_the_command_ended_leaves_its_status_alone(tmp_path):
    """A SIGTERM during the interpreter's teardown (here from an exit handler, after a run that ended with status 5)
    must not turn the status into the 143 of a process the signal ended, which reads as a verified checkpoint."""
    script = (
        "import atexit, os, signal, time\n"
        "import trickles.cli as cli\n"
        "cli.main = lambda argv=None: 5\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5)))\n"
        "cli.entry()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, timeout=120)
    assert done.returncode == 5
