"""Elastic relayout (``parallel.elastic``): a run stopped on 4 ranks (dp2 x tp2) continues on 2 at the layout the
planner chose for them -- from the checkpoint, resharded, the data order unchanged -- with the losses of one process;
on 3 ranks the planner finds a valid layout too; without the flag a world the degrees do not fit is refused, naming it,
before any process group exists."""

import json
import sys

import pytest
import torch
from helpers import tiny_config
from test_fault import _with_fault

from trickles.commands import run_command
from trickles.errors import ConfigError
from trickles.planner.elastic import fits, layout_for_world
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

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
    "train.eval_every=0",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "train.plot=false",
    "--set",
    "train.checkpoint_every=3",
    "--set",
    "train.eps=1e-6",
    "--set",
    "parallel.dp=2",
    "--set",
    "parallel.tp=2",
]


def _train(tmp, nproc, *extra, env=None):
    cmd = [
        sys.executable,
        "-m",
        "trickles",
        "train",
        "--nproc",
        str(nproc),
        *SETTINGS,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={tmp}/run",
        "--set",
        "train.steps=12",
        *extra,
    ]
    return run_command(cmd, text=True, timeout=300, env=env)


def test_a_run_stopped_on_four_ranks_continues_on_two_at_the_planners_layout(tmp_path):
    """The 12-step run loses a rank after step 6 (its checkpoint written: synchronous saves), is restarted on 2 ranks."""
    env, _ = _with_fault(tmp_path, "kill", after=6)
    first = _train(tmp_path, 4, "--set", "train.async_checkpoint=false", env=env)
    assert first.returncode != 0 and "was killed by SIGKILL" in first.stderr, first.stderr[-2000:]
    refused = _train(tmp_path, 2, "--resume", "auto")
    assert refused.returncode == 2 and "set parallel.elastic=true" in refused.stderr, refused.stderr[-2000:]
    second = _train(tmp_path, 2, "--resume", "auto", "--set", "parallel.elastic=true")
    assert second.returncode == 0, second.stderr[-2000:]
    line = [x for x in second.stdout.splitlines() if "parallel.elastic" in x]
    assert len(line) == 1 and "does not fit 2 processes; training on" in line[0], second.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    assert sorted(losses) == list(range(1, 13))  # steps 7-12 continued from step 6's checkpoint
    one = Trainer(
        tiny_config(tmp_path / "one", "train.eps=1e-6", steps=12), ParallelDims().build(torch.device("cpu")), quiet=True
    )
    straight = [one.train_step()["loss"] for _ in range(12)]
    assert [losses[s] for s in range(1, 13)] == pytest.approx(straight, rel=1e-4)


def test_three_ranks_get_a_valid_layout_and_without_the_flag_the_world_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, "parallel.dp=2", "parallel.tp=2", "train.global_batch=12", "parallel.elastic=true")
    assert fits(cfg, 4) and not fits(cfg, 3)
    chosen, line = layout_for_world(cfg, 3)
    dims = chosen.validate(3)  # a layout of 3 that validates, the global batch kept
    assert dims.world_size == 3 and chosen.train.global_batch == 12 and "does not fit 3 processes" in line
    fixed = tiny_config(tmp_path, "parallel.dp=2", "parallel.tp=2")
    assert layout_for_world(fixed, 3) == (fixed, None)
    with pytest.raises(ConfigError, match="set parallel.elastic=true"):
        fixed.validate(3)
