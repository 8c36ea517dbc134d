"""The scaling report's arithmetic, weak-scaling configurations and input checks (no processes started)."""

import re

import pytest
import torch
from helpers import tiny_config

from trickles.errors import ConfigError, UserError
from trickles.train import scaling
from trickles.train.scaling import (
    COLUMNS,
    RankSamples,
    ScalingRow,
    plan,
    scale_rows,
    scaling_json,
    scaling_table,
    summarize,
    weak_scaling_config,
)


def test_summarize_takes_the_slowest_rank_and_the_mean_blocked_time():
    samples = [
        RankSamples([1.0, 2.0, 4.0], [0.5, 0.5, 1.0], {"all_reduce/dp": 300}),
        RankSamples([2.0, 1.0, 3.0], [0.1, 0.3, 2.0], {"all_reduce/dp": 300, "send/pp": 60}),
    ]
    row = summarize(2, 16, 32, samples)
    assert row.step_times == [2.0, 2.0, 4.0]  # max over ranks, step by step
    assert row.step_time == 2.0  # their median
    assert row.tokens_per_s == 16 * 32 / 2.0
    # mean blocked per step: 0.3, 0.4, 1.5 -> shares 0.15, 0.2, 0.375 -> median 0.2
    assert row.comm_time == pytest.approx(0.4)
    assert row.comm_share == pytest.approx(0.2)
    assert row.sent_by_op == {"all_reduce/dp": 100.0, "send/pp": 10.0}  # mean over ranks, per step
    assert row.bytes_sent == 110.0


def test_summarize_refuses_uneven_samples():
    with pytest.raises(ValueError, match="samples of 2 ranks"):
        summarize(2, 8, 32, [RankSamples([1.0], [0.0])])
    with pytest.raises(ValueError, match="same number"):
        summarize(2, 8, 32, [RankSamples([1.0], [0.0]), RankSamples([1.0, 2.0], [0.0, 0.0])])


def _row(ranks, tokens_per_s):
    return ScalingRow(ranks, 8 * ranks, 1.0, tokens_per_s, 0.25, 0.25, 0.0, {}, [1.0])


def test_scale_factor_is_per_rank_throughput_against_the_first_row():
    rows = scale_rows([_row(1, 100.0), _row(2, 180.0), _row(4, 320.0)])
    assert [r.scale for r in rows] == [1.0, pytest.approx(0.9), pytest.approx(0.8)]  # X_n / (n X_1)
    assert rows[0].scale == 1.0  # exactly
    rows = scale_rows([_row(2, 100.0), _row(4, 150.0)])  # e.g. tp=2: the first row has 2 ranks
    assert [r.scale for r in rows] == [1.0, pytest.approx(0.75)]


def test_table_has_one_word_per_cell_and_the_json_every_field():
    rows = scale_rows([_row(1, 1000.0), _row(2, 1500.0)])
    rows[1].bytes_sent = 1_234_567.0
    text = scaling_table(rows).splitlines()
    assert re.split(r"\s{2,}", text[0].strip()) == list(COLUMNS)
    assert text[2].split() == ["1", "8", "1000.0", "1,000", "1.000", "25.0%", "0"]
    assert text[3].split() == ["2", "16", "1000.0", "1,500", "0.750", "25.0%", "1,234,567"]
    data = scaling_json(rows, steps=3, warmup=1)
    assert data["steps"] == 3 and data["rows"][1]["scale"] == 0.75 and data["rows"][1]["step_times"] == [1.0]


@pytest.mark.parametrize(
    "overrides,per_rank", [([], (8, 1)), (["train.micro_batch=2"], (2, 4)), (["parallel.dp=2"], (4, 1))]
)
def test_weak_scaling_keeps_the_work_per_rank(tmp_path, overrides, per_rank):
    cfg = tiny_config(tmp_path, *overrides)  # global batch 8
    for n in (1, 2, 4):
        scaled = weak_scaling_config(cfg, n, steps=7)
        dims = scaled.validate(n)
        assert dims.dp == n
        assert scaled.batch_plan(n) == per_rank
        assert scaled.train.global_batch == per_rank[0] * per_rank[1] * n
        assert scaled.train.steps == 7 and scaled.train.eval_every == 0 and scaled.train.sample_tokens == 0
    assert cfg.train.global_batch == 8 and cfg.parallel.dp == (2 if overrides == ["parallel.dp=2"] else -1)  # untouched


@pytest.mark.parametrize("degree", ["tp", "cp"])
def test_tensor_and_context_parallel_degrees_are_kept_and_must_divide(tmp_path, degree):
    cfg = tiny_config(tmp_path, f"parallel.{degree}=2")
    assert [
        (weak_scaling_config(cfg, n, 3).parallel.dp, weak_scaling_config(cfg, n, 3).train.global_batch) for n in (2, 4)
    ] == [(1, 8), (2, 16)]
    assert [getattr(plan(cfg, [2, 4], 2, 1)[i][1].validate(n), degree) for i, n in enumerate((2, 4))] == [2, 2]
    tp, cp = (2, 1) if degree == "tp" else (1, 2)
    with pytest.raises(
        ConfigError,
        match=rf"3 rank\(s\) cannot hold parallel.tp x pp x cp = {tp} x 1 x {cp} = 2 ranks per data-parallel "
        r"replica; give --ranks multiples of 2 \(e.g. --ranks 2 4\) or change parallel.tp/pp/cp",
    ):
        plan(cfg, [2, 3], 2, 1)
    with pytest.raises(ConfigError, match="1 rank"):
        plan(cfg, [1, 2], 2, 1)


@pytest.mark.parametrize(
    "ranks,steps,warmup,overrides,needle",
    [
        ([0, 2], 2, 1, [], "--ranks must be at least 1, got 0"),
        ([1, 2], 0, 1, [], "--steps must be at least 1, got 0"),
        ([1, 2], 2, -1, [], "--warmup must not be negative, got -1"),
        ([1, 2], 2, 1, ["train.global_batch=0"], "train.global_batch must be at least 1, got 0"),
        ([1, 2], 2, 1, ["parallel.tp=0"], "parallel.tp must be at least 1, got 0"),
        ([1, 2], 2, 1, ["parallel.dp=3"], r"train.global_batch \(8\) must be divisible by parallel.dp \(3\)"),
        ([1, 2], 2, 1, ["data.source=/no/such/corpus.txt"], "data.source '/no/such/corpus.txt' is not a file"),
    ],
)
def test_bad_input(tmp_path, ranks, steps, warmup, overrides, needle):
    with pytest.raises(UserError, match=needle):
        plan(tiny_config(tmp_path, *overrides), ranks, steps, warmup)


def test_default_ranks_and_gpu_limit(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(scaling, "cpu_cores", lambda: 1)
    assert [n for n, _ in plan(cfg, None, 2, 1)] == [1, 2]  # at least 1 and 2 on a CPU
    monkeypatch.setattr(scaling, "cpu_cores", lambda: 8)
    assert [n for n, _ in plan(cfg, None, 2, 1)] == [1, 2, 4, 8]
    assert [n for n, _ in plan(tiny_config(tmp_path, "parallel.tp=2"), None, 2, 1)] == [2, 4, 8]
    assert [n for n, _ in plan(cfg, [4, 1, 2, 2], 2, 1)] == [1, 2, 4]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [n for n, _ in plan(cfg, None, 2, 1)] == [1, 2]  # one GPU per rank
    with pytest.raises(UserError, match=r"4 ranks need one GPU each but 2 GPU\(s\) are visible; give --ranks up to 2"):
        plan(cfg, [1, 4], 2, 1)
    assert [n for n, _ in plan(tiny_config(tmp_path, "train.device=cpu"), [1, 4], 2, 1)] == [
        1,
        4,
    ]  # CPU ranks: no limit
