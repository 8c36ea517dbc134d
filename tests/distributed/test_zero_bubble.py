"""Zero-bubble pipeline schedules through ``trickles train``'s trainer: ZB-H1 and ZB-V (each backward split into
``B``, the input's gradient, and ``W``, the weights') train like one process -- alone, with tensor and sequence
parallelism, with context parallelism, with recomputation, in bf16 -- and every rank runs exactly its list.

The schedules' own properties (complete, deadlock-free, memory bound, bubble formula) are pinned without ranks in
``tests/unit/test_schedules.py``; the split itself in ``tests/unit/test_split_backward.py``."""

from fractions import Fraction

import pytest
from test_pipeline import INVARIANCE_STEPS, _assemble, _executed, _train, reference

from trickles.parallel.pipeline.schedules import Shape, build, compute_order
from trickles.parallel.pipeline.timeline import simulate
from trickles.testing import run_ranks


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This run's tokenized-data cache, shared by the module's tests (spawned ranks get it in their overrides)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('pipeline-cache')}"


# (preset, layers, tp, pp, schedule, extra); micro-batches of 2: four per step. With parallel.cp=2 the ``tp`` slot
# counts the context-parallel ranks instead (the world is tp x pp either way; the ranks' copies must agree).
CASES = [
    ("tiny", 8, 1, 2, "zb-h1", ()),
    ("tiny", 8, 1, 4, "zb-v", ("parallel.virtual_stages=2",)),
    # the tied embedding: ZB-V holds the first and the last stage on rank 0, one copy of the weight
    ("gpt2-tiny", 8, 1, 2, "zb-v", ("parallel.virtual_stages=2", "memory.recompute=selective")),
    # sequence parallelism's linears compute only the input's gradient in B and regather their input in W; the
    # recipes of elementwise recomputation stand in for the norms' and activation's outputs in B and in W
    ("tiny", 4, 2, 2, "zb-h1", ("parallel.sequence_parallel=true", "memory.recompute=elementwise")),
    # ring attention's exchanges belong to B (the input's path); its W has none
    ("tiny", 4, 2, 2, "zb-v", ("parallel.virtual_stages=2", "parallel.cp=2")),
]


def _case_id(c):
    preset, layers, tp, pp, schedule, extra = c
    return f"{preset}-L{layers}-tp{tp}-pp{pp}-{schedule}" + "".join(f"-{e.split('.')[-1].split('=')[0]}" for e in extra)


@pytest.mark.parametrize("preset,layers,tp,pp,schedule,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_zero_bubble_layout_invariance(tmp_path, cache, preset, layers, tp, pp, schedule, extra):
    """Every rank's losses within 1e-4 relative of one process's, gathered weights within 1e-5, over 6 steps;
    activations held from a chunk's F to its W, at most 1F1B's first-stage peak."""
    ref_losses, ref_weights = reference(str(tmp_path), cache, preset, layers)
    overrides = [cache, f"model.preset={preset}", f"model.n_layers={layers}", f"parallel.schedule={schedule}", *extra]
    cp = "parallel.cp=2" in extra
    # _train's world is dp x tp x pp: with cp the context-parallel pair takes the dp slot (no parallel.dp is set)
    results = run_ranks(
        tp * pp, _train, str(tmp_path), 2 if cp else 1, 1 if cp else tp, pp, overrides, INVARIANCE_STEPS, timeout=600
    )
    for losses, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    weights = _assemble([r[1] for r in results])
    assert weights.keys() == ref_weights.keys()
    for n, w in weights.items():
        assert (w - ref_weights[n]).abs().max() <= 1e-5, (n, (w - ref_weights[n]).abs().max())
    v = 2 if schedule == "zb-v" else 1
    for rank, r in enumerate(results):
        assert r[2] <= v * pp  # chunk-micro-batches alive at once: p micro-batches' worth of the rank's layers
        assert r[2] == max(_alive(compute_order(schedule, Shape.of(schedule, pp, v, 4), rank // tp)))  # pp outermost


def _alive(order):
    n = 0
    for a in order:
        n += {"F": 1, "B": 0, "W": -1}[a.kind]
        yield n


@pytest.mark.parametrize("schedule,pp,v", [("zb-h1", 2, 1), ("zb-v", 2, 2)])
def test_each_rank_runs_its_zero_bubble_list_and_the_trace_shows_b_and_w_apart(tmp_path, cache, schedule, pp, v):
    """Every rank's executor posts and runs exactly its list (W included, no message at ZB-V's turn); its trace
    records each F, B and W once in that order; replayed on unit slots the executed lists have the formula's bubble:
    ``(p - 1) / (3 m + p - 1)`` for ZB-H1 and ``(p - 1) / (6 m + p - 1)`` for ZB-V (here below 1F1B's
    ``(p - 1) / (m + p - 1)``)."""
    results = run_ranks(pp, _executed, str(tmp_path), [cache], schedule, v)
    shape = results[0][2]
    assert shape == Shape.of(schedule, pp, v, 8)
    lists = build(schedule, shape, early_receives=results[0][3])
    for rank, (ran, traced, *_) in enumerate(results):
        assert ran == lists[rank], rank
        assert traced == [a for a in ran if a.is_compute] == compute_order(schedule, shape, rank), rank
        assert {a.kind for a in traced} == {"F", "B", "W"}
    timeline = simulate([r[0] for r in results], shape)
    p, m = shape.p, shape.m
    expected = Fraction(p - 1, 3 * m + p - 1) if schedule == "zb-h1" else Fraction(p - 1, 6 * m + p - 1)
    assert Fraction(timeline.bubble()).limit_denominator(1000) == expected < Fraction(p - 1, m + p - 1)
