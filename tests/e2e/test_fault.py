"""Fault tolerance: a rank killed with SIGKILL mid-run brings the job down and back up (``--max-restarts``); it
continues from the newest complete checkpoint and ends with the weights of a run that was never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from trickles.train import checkpoint as ckpt
from trickles.train.pieces import PieceReader

STEPS = 16
# the demo model at 4 ranks takes a few tenths of a second a step here: the kill lands well before the end
SETTINGS = ["--set", "model.preset=demo", "--set", "model.n_layers=2", "--set", "data.seq_len=128",
            "--set", "data.max_bytes=200000", "--set", "train.global_batch=16", "--set", "train.warmup_steps=2",
            "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=4", "--set", "train.keep_checkpoints=5",
            "--set", "train.eval_every=0", "--set", "train.sample_tokens=0", "--set", "train.plot=false",
            "--set", "parallel.zero=1"]


def _command(tmp, out, launcher="trickles"):
    settings = [*SETTINGS, "--set", f"data.cache_dir={tmp}/cache", "--set", f"train.out_dir={out}"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "2",
                "-m", "trickles", "train", "--quiet", *settings]
    return [sys.executable, "-m", "trickles", "train", "--nproc", "4", "--max-restarts", "2", "--quiet", *settings]


def _children(pid: int, marker: bytes) -> list[int]:
    """Processes whose parent is ``pid`` and whose command line holds ``marker`` (the ranks), oldest first."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and marker in cmd:
            out.append(int(entry))
    return sorted(out)


def _weights(out) -> dict[str, torch.Tensor]:
    path = ckpt.find_latest(os.path.join(out, "checkpoints"))
    reader = PieceReader(path, "model")
    return {k: reader.read(k) for k in reader.keys()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fault")
    straight = subprocess.run(_command(tmp, tmp / "straight"), capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr
    return tmp, tmp / "straight"


@pytest.mark.parametrize("launcher", ["trickles", "torchrun"])
def test_killed_rank_restarts_and_finishes_like_an_uninterrupted_run(uninterrupted, tmp_path, launcher):
    tmp, straight = uninterrupted
    out = tmp_path / "killed"
    job = subprocess.Popen(_command(tmp, out, launcher), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = b"spawn_main" if launcher == "trickles" else b"trickles"
    killed = None
    deadline = time.monotonic() + 600
    while killed is None and job.poll() is None and time.monotonic() < deadline:
        done = [s for s, _ in ckpt.list_checkpoints(os.path.join(out, "checkpoints"))]
        ranks = _children(job.pid, marker)
        if done and len(ranks) == 4:
            killed = done[-1]
            os.kill(ranks[2], signal.SIGKILL)
        time.sleep(0.05)
    stdout, stderr = job.communicate(timeout=900)
    assert killed is not None and killed < STEPS, f"the run ended before a rank could be killed\n{stderr}"
    assert job.returncode == 0, stderr
    if launcher == "trickles":
        assert "was killed by SIGKILL" in stderr and "restarting all 4 ranks (attempt 2 of 3)" in stderr, stderr
    assert "restart 1: continuing from" in stdout, stdout + stderr
    resumed_from = int(stdout.split("restart 1: continuing from")[1].split("step_")[1][:6])
    assert killed <= resumed_from < STEPS  # the newest complete checkpoint when the rank died (or one written after)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # steps after the checkpoint logged once
    reference = {json.loads(line)["step"]: json.loads(line)["loss"] for line in (straight / "metrics.jsonl").read_text().splitlines()}
    assert [r["loss"] for r in records] == pytest.approx([reference[s] for s in range(1, STEPS + 1)], rel=1e-6)
    a, b = _weights(out), _weights(straight)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-5), k
