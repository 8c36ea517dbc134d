"""``trickles bench scaling`` end to end: one and two local ranks of a tiny model, the table, the files, bad input."""

import json
import os
import re
import sys

import pytest
import torch
from helpers import cli_here, tiny_config

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
    "train.warmup_steps=2",
    "--set",
    "train.lr=3e-3",
]
COLUMNS = ["ranks", "global batch", "step time (ms)", "tokens/s", "scale factor", "comm share", "bytes sent/rank/step"]


def trickles(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=timeout, env=env)


def bench_args(tmp, *extra):
    return [
        "bench",
        "scaling",
        *TINY,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={tmp}/run",
        *extra,
    ]


def _padded_gradient(tmp, dp):
    """``(P, padded P)``: parameters of the tiny model and the elements of its bucketed flat gradient at ``dp``
    ranks."""
    from trickles.data import build_tokenizer
    from trickles.models.config import resolve_model
    from trickles.models.transformer import Transformer
    from trickles.parallel.data.flat import FlatLayout
    from trickles.parallel.engine import unique_named_parameters
    from trickles.parallel.reduction import FIRST_BUCKET_BYTES, bucket_bytes

    cfg = tiny_config(tmp)
    model_cfg = resolve_model(cfg.model, build_tokenizer(cfg.data).vocab_size, cfg.data.seq_len)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    layout = FlatLayout(
        unique_named_parameters(model), dp, bucket_bytes(cfg.parallel.bucket_mb), first_bucket_bytes=FIRST_BUCKET_BYTES
    )
    return layout.numel, layout.total, len(layout.buckets)


def test_one_and_two_ranks_table_plot_and_json(tmp_path):
    png, out = tmp_path / "run" / "scaling.png", tmp_path / "scaling.json"  # the PNG by default in train.out_dir
    r = trickles(*bench_args(tmp_path, "--ranks", "1", "2", "--steps", "2", "--warmup", "1", "--json", str(out)))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "leaked" not in r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("ranks"))
    assert re.split(r"\s{2,}", lines[head].strip()) == COLUMNS
    table = [lines[head + 2].split(), lines[head + 3].split()]
    assert [row[:2] for row in table] == [["1", "8"], ["2", "16"]]  # weak scaling: the global batch doubles
    assert table[0][4] == "1.000" and table[0][6] == "0"

    data = json.loads(out.read_text())
    one, two = data["rows"]
    assert (one["ranks"], one["global_batch"], two["ranks"], two["global_batch"]) == (1, 8, 2, 16)
    assert one["scale"] == 1.0
    assert two["scale"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]))
    for row in (one, two):
        assert len(row["step_times"]) == 2 and row["step_time"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["global_batch"] * 32 / row["step_time"])
        assert 0.0 <= row["comm_share"] <= 1.0
    assert one["comm_share"] == 0.0 and one["bytes_sent"] == 0 and one["sent_by_op"] == {}

    # two data-parallel ranks: each sends 2 (n-1)/n of its padded flat fp32 gradient (all-reduce in buckets)
    # plus the 4-byte loss average, per step; the padding is at most one 2 x 16-element unit per bucket
    params, padded, buckets = _padded_gradient(tmp_path, 2)
    assert 0 <= padded - params < 2 * 16 * buckets
    assert two["sent_by_op"] == {"all_reduce/dp": 2 * (2 - 1) / 2 * 4 * (padded + 1)}
    assert two["bytes_sent"] == 4 * (padded + 1)
    assert table[1][6] == f"{4 * (padded + 1):,}"
    assert png.stat().st_size > 10_000 and f"scaling plot: {png}" in r.stdout
    assert os.listdir(tmp_path / "run") == ["scaling.png"]  # the training runs wrote nothing there


REFUSED = [
    (["--ranks", "0", "1"], "--ranks must be at least 1, got 0"),
    (
        ["--ranks", "2", "3", "--set", "parallel.tp=2"],
        "3 rank(s) cannot hold parallel.tp x pp x cp = 2 x 1 x 1 = 2 ranks per data-parallel replica",
    ),
    (["--ranks", "1", "2", "--set", "train.stpes=3"], "unknown key 'train.stpes'; did you mean 'train.steps'?"),
    (
        ["--ranks", "1", "2", "--set", "train.global_batch=7", "--set", "train.micro_batch=2"],
        "train.global_batch (7) must equal",
    ),
    (["--ranks", "1", "--steps", "0"], "--steps must be at least 1, got 0"),
    (
        ["--ranks", "1", "--png", "/no/such/dir/s.png"],
        "--png /no/such/dir/s.png: the directory /no/such/dir does not exist",
    ),
]


@pytest.mark.parametrize("extra,needle", REFUSED)
def test_bad_input_is_one_line_status_two(tmp_path, extra, needle):
    run = trickles if (extra, needle) == REFUSED[0] else cli_here  # one case through a real process
    r = run(*bench_args(tmp_path, *extra))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "[trickles]" not in r.stdout  # refused before any rank started
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
