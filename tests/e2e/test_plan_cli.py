"""``trickles plan`` end to end: the table, the JSON, the winner's config (loaded back and trained), no fit, bad
input."""

import json
import os
import sys

import pytest
import torch
from helpers import cli_here

from trickles.config import Config
from trickles.planner import load_cluster
from trickles.testing import run_command

TINY = [
    "--set",
    "model.preset=tiny",
    "--set",
    "data.seq_len=32",
    "--set",
    "train.global_batch=8",
    "--set",
    "model.vocab_size=320",
]
RUN = [
    "--set",
    "data.max_bytes=120000",
    "--set",
    "train.steps=2",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "train.plot=false",
]


def trickles(*args, cwd=None, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_command([sys.executable, "-m", "trickles", *args], text=True, cwd=cwd, timeout=timeout, env=env)


def test_plan_prints_the_table_writes_json_and_a_config_that_trains(tmp_path):
    out, toml = tmp_path / "plan.json", tmp_path / "plan.toml"
    r = trickles(
        "plan",
        *TINY,
        *RUN,
        "--set",
        f"data.cache_dir={tmp_path}/cache",
        "--set",
        f"train.out_dir={tmp_path}/run",
        "--cluster",
        "dgx-a100",
        "--devices",
        "2",
        "--top",
        "3",
        "--json",
        str(out),
        "--write-config",
        str(toml),
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  layout"))
    for word in ("memory/device", "free", "step s", "tokens/s", "TFLOP/s", "MFU", "bubble", "comm"):
        assert word in lines[head]
    rows = lines[head + 2 : head + 5]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"]
    assert "why not ..." in r.stdout and "x the winner's step time" in r.stdout
    data = json.loads(out.read_text())
    assert data["devices"] == 2 and len(data["top"]) == 3
    by_label = {row["layout"]: row for row in data["layouts"]}
    for label, row in zip(data["top"], rows):
        assert label in row
        entry = by_label[label]
        assert {"step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu", "peak_bytes", "fits"} <= set(entry)
        assert entry["fits"] is True
    times = [by_label[label]["step_time_s"] for label in data["top"]]
    assert times == sorted(times)
    cfg = Config.load(toml)
    dims = cfg.validate(2)
    best = by_label[data["top"][0]]
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (
        best["parallel.dp"],
        best["parallel.tp"],
        best["parallel.pp"],
        best["parallel.cp"],
    )
    assert cfg.train.micro_batch == best["train.micro_batch"] and cfg.memory.recompute == best["memory.recompute"]
    t = trickles("train", "-c", str(toml), "--nproc", "2", "--quiet")
    assert t.returncode == 0, t.stderr
    assert os.path.isdir(tmp_path / "run")


def test_a_model_that_fits_nowhere_names_the_smallest_cluster(tmp_path):
    # the tiny model's lightest layout needs 548 KB per device on 2 devices and 329 KB on 4 (the memory report)
    cluster = tmp_path / "small.toml"
    cluster.write_text(
        f'[cluster]\npreset = "dgx-a100"\nname = "small"\ndevice_memory_gib = {400_000 / 0.9 / 2**30!r}\n'
    )
    json_out = tmp_path / "plan.json"
    r = trickles("plan", *TINY, "--cluster", str(cluster), "--devices", "2", "--json", str(json_out))
    assert r.returncode == 2 and r.stdout == ""
    first, *rest = r.stderr.splitlines()
    assert first.startswith("error: the model fits no layout of 2 devices of small")
    assert any("the smallest small cluster that fits: 4 devices (1 node of 8)" in line for line in rest), r.stderr
    assert not json_out.exists()
    ok = trickles("plan", *TINY, "--cluster", str(cluster), "--devices", "4", "--top", "1")
    assert ok.returncode == 0, ok.stderr


REFUSED = [
    (["--cluster", "dgx-a10", "--devices", "8"], "unknown cluster 'dgx-a10'; did you mean 'dgx-a100'?"),
    (["--cluster", "dgx-a100", "--devices", "0"], "--devices must be at least 1, got 0"),
    (
        ["--cluster", "dgx-a100", "--devices", "8", "--set", "parallel.tp=3"],
        "parallel.tp=3 does not divide --devices 8",
    ),
    (["--cluster", "nowhere/c.toml", "--devices", "8"], "cluster file nowhere/c.toml does not exist"),
    (["--devices", "8"], "give --cluster NAME|FILE"),
]


@pytest.mark.parametrize("args, message", REFUSED)
def test_bad_input_is_one_line_with_status_2(tmp_path, args, message):
    out = tmp_path / "plan.json"
    run = trickles if (args, message) == REFUSED[0] else cli_here  # one case through a real process
    r = run("plan", *TINY, *args, "--json", str(out))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert not out.exists()


def test_plan_in_process_creates_no_process_group(capsys):
    from trickles.cli import main

    assert main(["plan", *TINY, "--cluster", "dgx-a100", "--devices", "2", "--top", "1"]) == 0
    assert "dp" in capsys.readouterr().out
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


def test_calibrate_writes_the_cluster_and_plans_with_it(tmp_path):
    path = tmp_path / "here.toml"
    r = trickles(
        "plan",
        *TINY,
        "--set",
        "parallel.tp=1",
        "--set",
        "parallel.pp=1",
        "--calibrate",
        str(path),
        "--devices",
        "2",
        "--top",
        "1",
    )
    assert r.returncode == 0, r.stderr
    cluster = load_cluster(path)
    assert cluster.name == "local-calibrated" and cluster.gemm_table and cluster.link_efficiency == 1.0
    assert "local-calibrated" in r.stdout
