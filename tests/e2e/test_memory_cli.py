"""``trickles memory`` with pipeline stages: no longer refused; measured on the stages' ranks, rank 0 prints the
most-loaded stage's table and every stage predicted beside measured."""

import os
import re
import sys

from trickles.testing import run_command

TINY = [
    "--set",
    "model.preset=tiny",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.max_bytes=120000",
    "--set",
    "train.global_batch=8",
    "--set",
    "train.micro_batch=2",
]


def _trickles(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=300, env=env)


def test_memory_command_measures_every_pipeline_stage(tmp_path):
    r = _trickles(
        "memory",
        *TINY,
        "--set",
        f"data.cache_dir={tmp_path}/cache",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.schedule=gpipe",
        "--nproc",
        "2",
        "--measure",
        "2",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.match(r"pipeline rank [01] of 2 \(the highest peak\)", out), out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for key in ("parameters", "gradients", "optimizer", "activations", "head", "held"):
        assert rows[key][-1] == "1.000", out  # measured / predicted
    stages = [line for line in out.splitlines() if line.startswith("stage ")]
    assert len(stages) == 2 and all(line.count("measured") == 4 for line in stages), stages
    assert "pp=2 gpipe, 4 micro-batches" in out
