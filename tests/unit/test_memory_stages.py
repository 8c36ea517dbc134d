"""Pipeline stages in the memory prediction: the micro-batches in flight per schedule (walk of the library's own
order against the closed forms), each stage's parameters against the pruned model, the per-stage report, and the
cache of meta models."""

import dataclasses
import itertools

import pytest
import torch
from helpers import tiny_config

from trickles.memory import meta
from trickles.memory.report import predict
from trickles.memory.stages import buffers_peak, in_flight, in_flight_closed_form, message_bytes, peak_in_flight
from trickles.models.config import resolve_model
from trickles.parallel.pipeline.schedules import Shape, compute_order
from trickles.parallel.pipeline.stages import keep_stage, partition_layers


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_micro_batches_in_flight_follow_the_closed_forms(schedule):
    """GPipe m, 1F1B min(m, p - r), interleaved min(2 (p - r - 1) + (v - 1) p + 1, v m) chunks, on every rank."""
    checked = 0
    for p, v, m in itertools.product((2, 3, 4), (2, 3) if schedule == "interleaved" else (1,), (1, 2, 3, 4, 6, 8, 12)):
        if schedule == "interleaved" and m % p:
            continue
        shape = Shape(p, v, m)
        for r in range(p):
            assert in_flight(schedule, shape, r) == in_flight_closed_form(schedule, shape, r), (p, v, m, r)
            checked += 1
    assert checked > 20


def test_weighted_walk_picks_the_heaviest_moment():
    """Chunks of different weight: the peak is the heaviest set alive, not the most chunks."""
    shape = Shape(2, 2, 2)
    order = compute_order("interleaved", shape, 0)
    # by hand: rank 0 runs F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1 (warm-up 2 (p - 1) + (v - 1) p = 4 = v m)
    assert [str(a) for a in order] == ["F0.0", "F0.1", "F1.0", "F1.1", "B1.0", "B1.1", "B0.0", "B0.1"]
    assert peak_in_flight(order, [(100, 1), (1, 0)]) == (202, 2, 4)
    assert peak_in_flight(order, [(5, 0), (7, 3)]) == (24, 6, 4)


def _cfg(tmp, *overrides):
    cfg = tiny_config(tmp, "train.micro_batch=2", "train.global_batch=8", *overrides)
    return cfg, resolve_model(cfg.model, 257, cfg.data.seq_len)


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["parallel.pp=2"], 2),
        (["parallel.pp=3", "model.n_layers=5", "model.preset=gpt2-tiny"], 3),  # tied embedding: the last stage's copy
        (
            [
                "parallel.pp=2",
                "parallel.schedule=interleaved",
                "parallel.virtual_stages=2",
                "model.n_layers=6",
                "parallel.pipeline_layers=[1,2,2,1]",
            ],
            2,
        ),
        (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4),
    ],
)
def test_stage_parameters_are_the_pruned_models(tmp_path, overrides, world):
    """The name filter gives the parameters keep_stage leaves, in the same order (the flat layout depends on it)."""
    cfg, mc = _cfg(tmp_path, *overrides)
    dims = cfg.validate(world)
    shape = Shape(dims.pp, cfg.parallel.virtual_stages, cfg.batch_plan(dims.dp)[1])
    parts = partition_layers(mc.n_layers, shape.stages, cfg.parallel.pipeline_layers)
    rm = meta.rank_model(mc, dims, cfg.parallel.sequence_parallel, 0, torch.float32)
    for r in range(dims.pp):
        meta._CACHE.clear()  # a model of its own to prune
        pruned = meta.rank_model(mc, dims, cfg.parallel.sequence_parallel, 0, torch.float32).module
        meta._CACHE.clear()
        keep_stage(pruned, r, shape, parts)
        from trickles.parallel.engine import unique_named_parameters

        layers = {i for c in range(shape.v) for i in parts[shape.stage(r, c)]}
        got = meta.stage_parameters(rm, layers, r == 0, r == dims.pp - 1, mc.tied)
        want = unique_named_parameters(pruned)
        assert [n for n, _ in got] == [n for n, _ in want], r
        assert [tuple(p.shape) for _, p in got] == [tuple(p.shape) for _, p in want], r


def test_report_has_every_stage_and_the_most_loaded_on_top(tmp_path):
    for schedule, extra in (
        ("gpipe", []),
        ("1f1b", []),
        ("interleaved", ["parallel.virtual_stages=2", "model.n_layers=4"]),
    ):
        cfg, mc = _cfg(tmp_path, "parallel.pp=2", f"parallel.schedule={schedule}", *extra)
        rep = predict(cfg, cfg.validate(2), mc)
        assert len(rep.stages) == 2 and rep.stage_layers[0][0] == 0 and rep.stage_layers[1][-1] == mc.n_layers - 1
        assert set(rep.stages[0]) == set(rep.predicted)
        assert rep.predicted == rep.stages[max(range(2), key=lambda r: rep.stages[r]["peak"])]
        for row in rep.stages:
            assert row["peak"] == row["held"] + row["transient"]
        one = predict(*_one_stage(cfg), mc)
        layer = one.layers_predicted[0]
        # GPipe holds all 4 micro-batches' layers on both ranks; 1F1B 2 on rank 0 (p - r) and 1 on rank 1
        n_layers = [len(ids) for ids in rep.stage_layers]
        want = {"gpipe": [4, 4], "1f1b": [2, 1], "interleaved": [5, 3]}[schedule]
        chunk = [n // cfg.parallel.virtual_stages for n in n_layers]
        assert [row["activations"] for row in rep.stages] == [w * c * layer for w, c in zip(want, chunk)], schedule
        lines = rep.table().splitlines()
        assert lines[0].startswith(f"pipeline rank {rep.stage} of 2")
        assert sum(line.startswith("stage ") for line in lines) == 2


def _one_stage(cfg):
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, schedule="1f1b", virtual_stages=1))
    return one, one.validate(1)


def test_stage_states_add_up_to_the_whole_model_plus_the_tied_copy(tmp_path):
    """ZeRO-0 in fp32, no padding: the stages' parameters are the whole model's, the tied embedding twice."""
    for preset in ("tiny", "gpt2-tiny"):
        cfg, mc = _cfg(tmp_path, "parallel.pp=2", f"model.preset={preset}")
        rep = predict(cfg, cfg.validate(2), mc)
        whole = predict(*_one_stage(cfg), mc).predicted["parameters"]
        tied = 4 * mc.vocab_size * mc.d_model if mc.tied else 0
        assert sum(r["parameters"] for r in rep.stages) == whole + tied, preset


def test_prediction_is_cached_and_unchanged_by_the_cache(tmp_path):
    cfg, mc = _cfg(tmp_path, "parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "memory.precision=bf16")
    dims = cfg.validate(4)
    first = predict(cfg, dims, mc)
    meta._CACHE.clear()
    from trickles.memory import report

    report._STATES.clear()
    fresh = predict(cfg, dims, mc)
    assert fresh.stages == first.stages and fresh.predicted == first.predicted
    assert len(meta._CACHE) == 1
    predict(cfg, dims, mc)
    assert len(meta._CACHE) == 1  # the same shape: no second build


def test_action_lists_are_the_schedules_own():
    """The bisecting placement of messages gives exactly the lists schedules.build makes."""
    from trickles.memory.stages import action_lists
    from trickles.parallel.pipeline.schedules import build

    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
        for p, m in ((2, 4), (3, 6), (4, 8), (4, 12)):
            for early in (False, True):
                shape = Shape(p, v, m)
                assert [list(x) for x in action_lists(schedule, shape, early)] == build(
                    schedule, shape, early_receives=early
                )


def test_buffers_peak_walks_gpipe_by_hand():
    """GPipe, 2 stages, 2 micro-batches; each chunk's forward saves 100 B of layers and 10 B of head activations, a
    message is 4 B, the loss's backward needs 7 B more. Stage 0 peaks at its first backward: both micro-batches'
    activations (2 x 110; each output is gone by the next computation, its send seen through) and the received gradient
    (4) = 224 -- as at its second forward (2 x 110 and that forward's output). Stage 1 peaks at its first backward too:
    both micro-batches' activations with their received inputs (2 x (110 + 4)) and the loss's 7 B = 235 (the input
    gradient comes after, as the head's activations are freed)."""
    shape, weights = Shape(2, 1, 2), [(100, 10)]
    assert [buffers_peak("gpipe", shape, r, weights, 4, False, 7, False) for r in range(2)] == [224, 235]


def test_buffers_peak_walks_zb_h1_by_hand():
    """ZB-H1, 2 stages, 2 micro-batches, inputs saved by the first operation; per chunk-micro-batch 100 B of layers and
    10 B of head, a message 4 B, the loss's backward 7 B, a block's 5 B, ``B`` records 30 B for ``W`` (the received
    gradient among them), its first norm's backward 3 B more, the loss keeps 6 B of the head. Stage 1 (last): after
    ``F0.0`` and both receives it holds 110 + 4; ``B0.0`` ends at 114 + 30 + the input gradient 4 + 3 = 151, then keeps
    the 30 B and the input gradient (on the saved input, until ``W``) and frees the loss's 6 B (nothing holds its
    nodes): 142; ``F0.1`` adds 110 - 4 (its input is its first operation's): 248; ``B0.1`` ends at 248 + 30 + 4 + 3 =
    285. Stage 0 (first) has no ``B``: its ``W`` is the whole backward, 5 B over both forwards' 2 x 110 and the received
    gradient 4 (the second output's send seen through by then): 229."""
    shape, weights = Shape.of("zb-h1", 2, 1, 2), [(100, 10)]
    peaks = [
        buffers_peak(
            "zb-h1",
            shape,
            r,
            weights,
            4,
            True,
            7,
            False,
            backward_transient=5,
            recorded=[30],
            split_end=3,
            loss_saved=6,
        )
        for r in range(2)
    ]
    assert peaks == [229, 285]


def test_a_message_is_one_micro_batch_of_this_ranks_tokens():
    """``p B (T / cp) d`` bytes, divided over tensor-parallel ranks only where the activations are split along the
    sequence: 4 x 2 x (64 / 2) x 16 = 4,096 B at cp=2; 2,048 B split over tp=2; tp alone does not divide it."""
    assert message_bytes(2, 64, 16, 4, 2, True, cp=2) == 2048
    assert message_bytes(2, 64, 16, 4, 2, False, cp=2) == 4096
    assert message_bytes(2, 64, 16, 2, 1, False) == 4096
