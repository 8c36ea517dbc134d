"""Pipeline schedules as action lists: complete, deadlock-free, matched in order, memory-bounded, and with
the bubble of the formula; partitioning and the configurations refused before any process group."""

from fractions import Fraction

import pytest
from helpers import tiny_config

from trickles.errors import ConfigError
from trickles.parallel.pipeline.schedules import (
    Action,
    Shape,
    batches,
    build,
    check_shape,
    compute_order,
    peak_alive,
    render,
)
from trickles.parallel.pipeline.stages import partition_layers
from trickles.parallel.pipeline.timeline import Timeline, simulate

SHAPES = (
    [("gpipe", Shape(p, 1, m)) for p in (2, 4) for m in (1, 3, 8)]
    + [("1f1b", Shape(p, 1, m)) for p in (2, 3, 4) for m in (1, 2, 4, 8)]
    + [("interleaved", Shape(p, v, m)) for p in (2, 4) for v in (2, 3) for m in (p, 2 * p, 4 * p)]
)


@pytest.mark.parametrize("early", [False, True], ids=["due", "early"])
@pytest.mark.parametrize("schedule,shape", SHAPES, ids=[f"{s}-p{sh.p}v{sh.v}m{sh.m}" for s, sh in SHAPES])
def test_every_schedule_is_complete_ordered_and_has_the_formula_bubble(schedule, shape, early):
    lists = build(schedule, shape, early_receives=early)
    for acts in lists:
        fwd = [(a.chunk, a.micro) for a in acts if a.kind == "F"]
        bwd = [(a.chunk, a.micro) for a in acts if a.kind == "B"]
        every = sorted((c, i) for c in range(shape.v) for i in range(shape.m))
        # each chunk's forward and backward of each micro-batch once
        assert sorted(fwd) == every and sorted(bwd) == every
        for a in acts:
            if a.kind == "B":
                assert acts.index(Action("F", a.chunk, a.micro)) < acts.index(a)
    p, vm = shape.p, shape.v * shape.m
    for tf, tb in ((1, 2), (1, 1), (1, 3)):
        # simulate() raises on a deadlock or on a send meeting the wrong receive; integer slot times are exact in
        # floating point, so the counts are compared exactly: every rank runs v m forwards and v m backwards and idles
        # (p - 1)(t_f + t_b) of a step of (v m + p - 1)(t_f + t_b) slots -- the bubble (p - 1) / (v m + p - 1)
        timeline = simulate(lists, shape, float(tf), float(tb))
        makespan = Fraction(timeline.makespan)
        assert makespan == (vm + p - 1) * (tf + tb)
        for row in timeline.spans:
            assert sum(a.kind == "F" for a, _, _ in row) == sum(a.kind == "B" for a, _, _ in row) == vm
            idle = makespan - sum(Fraction(e) - Fraction(s) for _, s, e in row)
            assert idle == (p - 1) * (tf + tb) and idle / makespan == Fraction(p - 1, vm + p - 1)
        assert timeline.bubble() == pytest.approx(shape.bubble(), abs=1e-12)


def test_activation_memory_bound_of_each_schedule():
    """GPipe keeps all m micro-batches alive; 1F1B at most p (rank r: p - r); interleaved as Megatron's warm-up says."""
    p, m = 4, 8
    assert [peak_alive(a) for a in build("gpipe", Shape(p, 1, m))] == [m] * p
    assert [peak_alive(a) for a in build("1f1b", Shape(p, 1, m))] == [p - r for r in range(p)]
    assert [peak_alive(a) for a in build("1f1b", Shape(p, 1, 2))] == [2, 2, 2, 1]  # fewer micro-batches than stages
    v = 2
    assert [peak_alive(a) for a in build("interleaved", Shape(p, v, m))] == [
        2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)
    ]


def test_the_lists_read_as_the_schedules_are_drawn():
    text = render(build("1f1b", Shape(2, 1, 3)))
    assert text.splitlines() == [
        "rank 0: F0.0 SEND_F0.0 F0.1 SEND_F0.1 RECV_B0.0 B0.0 F0.2 SEND_F0.2 RECV_B0.1 B0.1 RECV_B0.2 B0.2",
        "rank 1: RECV_F0.0 F0.0 RECV_F0.1 B0.0 SEND_B0.0 F0.1 B0.1 SEND_B0.1 RECV_F0.2 F0.2 B0.2 SEND_B0.2",
    ]
    # a compute's send and the receives due at that point go out together
    runs = [[str(a) for a in run] for run in batches(build("1f1b", Shape(2, 1, 3))[0])]
    assert ["SEND_F0.1", "RECV_B0.0"] in runs


@pytest.mark.parametrize(
    "schedule,shape", [("gpipe", Shape(4, 1, 8)), ("1f1b", Shape(4, 1, 8)), ("interleaved", Shape(4, 2, 8))]
)
def test_receives_are_posted_once_their_send_is_due_and_before_their_reader(schedule, shape):
    """In the uniform timeline each receive is posted after its send (a global order a real run can follow, so a
    posted receive never waits on its own rank), at the first point its rank reaches after that send, which is
    often several computes before the compute that reads it (Megatron's pairing posts it one compute ahead)."""
    from trickles.parallel.pipeline.actions import _producer, uniform_times

    lists = build(schedule, shape)
    times = uniform_times([[a for a in acts if a.is_compute] for acts in lists], shape)
    ahead = []
    for r, acts in enumerate(lists):
        for k, a in enumerate(acts):
            if not a.kind.startswith("RECV"):
                continue
            reader = acts.index(Action(a.kind[-1], a.chunk, a.micro))
            sent_at = times[_producer(acts[reader], shape, r)][1]
            before = [b for b in acts[:k] if b.is_compute]
            after = [b for b in acts[k:reader] if b.is_compute]
            assert all(times[(r, b)][0] < sent_at for b in before), (r, a)  # not earlier than the send allows ...
            assert not after or times[(r, after[0])][0] >= sent_at, (r, a)  # ... and not later
            ahead.append(len(after))
    assert max(ahead) == {"gpipe": 0, "1f1b": 1, "interleaved": 3}[schedule]  # gpipe's inputs arrive just in time


@pytest.mark.parametrize(
    "schedule,shape", [("gpipe", Shape(4, 1, 8)), ("1f1b", Shape(4, 1, 8)), ("interleaved", Shape(4, 2, 8))]
)
def test_early_receives_are_all_posted_where_the_rank_first_waits(schedule, shape):
    """With early receives (gloo) every receive of the step is posted before the rank's first compute that reads a
    message, and never later than without."""
    due, early = build(schedule, shape), build(schedule, shape, early_receives=True)
    for r in range(shape.p):
        first_read = next(
            k for k, a in enumerate(early[r]) if a.is_compute and Action(f"RECV_{a.kind}", a.chunk, a.micro) in early[r]
        )
        receives = [k for k, a in enumerate(early[r]) if a.kind.startswith("RECV")]
        assert len(receives) == sum(a.kind.startswith("RECV") for a in due[r]) and max(receives) < first_read
        computes_before = lambda acts, msg: sum(b.is_compute for b in acts[: acts.index(msg)])  # noqa: E731
        for msg in (a for a in due[r] if a.kind.startswith("RECV")):
            assert computes_before(early[r], msg) <= computes_before(due[r], msg)


def test_simulate_refuses_receives_out_of_order_and_reads_without_a_receive():
    shape = Shape(2, 1, 2)
    lists = build("gpipe", shape)
    swapped = [list(acts) for acts in lists]
    swapped[1] = [Action("RECV_F", 0, 1), Action("RECV_F", 0, 0)] + [a for a in swapped[1] if a.kind != "RECV_F"]
    with pytest.raises(ValueError, match="in the place of"):
        simulate(swapped, shape)
    missing = [list(acts) for acts in lists]
    missing[1].remove(Action("RECV_F", 0, 1))
    with pytest.raises(ValueError, match="without having posted the receive"):
        simulate(missing, shape)


def test_interleaving_cuts_the_bubble_by_the_chunk_count():
    one, two = Shape(4, 1, 8), Shape(4, 2, 8)
    assert one.bubble() == pytest.approx(3 / 11) and two.bubble() == pytest.approx(3 / 19)
    t1 = simulate(build("1f1b", one), one, 2.0, 4.0)  # a chunk of half the layers takes half the time
    t2 = simulate(build("interleaved", two), two, 1.0, 2.0)
    assert t2.makespan < t1.makespan
    assert (t1.makespan - 8 * 6.0) == pytest.approx(2 * (t2.makespan - 8 * 6.0))  # idle time halves


def test_shapes_a_schedule_cannot_run_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        check_shape("interleaved", Shape(4, 2, 6))
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        check_shape("interleaved", Shape(2, 1, 4))
    with pytest.raises(ValueError, match="needs parallel.schedule=interleaved"):
        check_shape("1f1b", Shape(2, 2, 4))
    with pytest.raises(ValueError, match="one of"):
        check_shape("zigzag", Shape(2, 1, 4))


def test_partition_even_uneven_and_given():
    assert partition_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition_layers(7, 2) == [[0, 1, 2, 3], [4, 5, 6]]  # the earlier stage takes the extra layer
    assert partition_layers(7, 2, [2, 5]) == [[0, 1], [2, 3, 4, 5, 6]]
    with pytest.raises(ConfigError, match="smaller than the number of pipeline stages"):
        partition_layers(3, 4)
    with pytest.raises(ConfigError, match="adding up to model.n_layers"):
        partition_layers(7, 2, [3, 3])
    with pytest.raises(ConfigError, match="one layer count per"):
        partition_layers(7, 2, [7])


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.pp=4"], 4, "model.n_layers \\(2\\) is smaller than the number of pipeline stages"),
        (
            [
                "parallel.pp=2",
                "model.n_layers=8",
                "parallel.schedule=interleaved",
                "parallel.virtual_stages=2",
                "train.micro_batch=8",
            ],
            2,
            "groups of parallel.pp \\(2\\), but there are 1 micro-batches",
        ),
        (
            [
                "parallel.pp=2",
                "model.n_layers=4",
                "parallel.schedule=interleaved",
                "parallel.virtual_stages=4",
                "train.micro_batch=2",
            ],
            2,
            "smaller than the number of pipeline stages",
        ),
        (
            ["parallel.pp=2", "parallel.zero=3", "parallel.schedule=zb-h1"],
            2,
            "use parallel.zero=2 \\(or 0, 1\\) with zb-h1",
        ),
        (
            ["parallel.pp=2", "parallel.zero=3", "model.preset=gpt2-tiny"],
            2,
            "embedding tied across pipeline stages.*model.tie_embeddings=false",
        ),
        (["parallel.pp=2", "parallel.pipeline_layers=[1, 2]"], 2, "adding up to model.n_layers"),
        (["parallel.virtual_stages=2"], 1, "need parallel.pp > 1"),
        (["parallel.pp=2", "parallel.virtual_stages=2"], 2, "needs parallel.schedule=interleaved"),
        (["parallel.pp=3"], 2, "cannot be split"),
        (["train.pipeline_trace=out.png"], 1, "needs parallel.pp > 1"),
        (
            ["parallel.pp=2", "model.n_layers=4", "parallel.schedule=zb-v", "parallel.virtual_stages=1"],
            2,
            "two model chunks .*virtual_stages=2 \\(got 1\\)",
        ),
        (
            ["parallel.pp=2", "model.n_layers=6", "parallel.schedule=zb-v", "parallel.virtual_stages=3"],
            2,
            "virtual_stages=2 \\(got 3\\)",
        ),
        (
            ["parallel.pp=2", "model.n_layers=4", "parallel.schedule=zb-h1", "parallel.virtual_stages=2"],
            2,
            "or zb-v with 2",
        ),
        (
            ["parallel.pp=2", "parallel.tp=4", "parallel.tp_mode=2d", "parallel.schedule=zb-h1"],
            8,
            "use parallel.tp_mode=1d",
        ),
        (["parallel.pp=2", "parallel.schedule=zb-h1", "train.compile=true"], 2, "use train.compile=false"),
        (["parallel.pp=2", "parallel.schedule=zb-h1", "memory.recompute=full"], 2, "use memory.recompute=selective"),
        (
            [
                "parallel.pp=2",
                "model.n_layers=4",
                "parallel.schedule=zb-v",
                "parallel.virtual_stages=2",
                "parallel.pipeline_layers=[1, 1, 1]",
            ],
            2,
            "lists 3 stages",
        ),
    ],
    ids=[
        "more-stages-than-layers",
        "interleaved-micro-batches",
        "too-many-chunks",
        "zero3-zb",
        "zero3-tied",
        "layer-list",
        "virtual-without-pp",
        "virtual-without-interleaved",
        "world",
        "trace-without-pp",
        "zb-v-one-chunk",
        "zb-v-odd-chunks",
        "zb-h1-two-chunks",
        "zb-grid-tp",
        "zb-compile",
        "zb-full-recompute",
        "zb-v-layer-list",
    ],
)
def test_bad_pipeline_configurations_are_refused_before_any_process_group(tmp_path, overrides, world, message):
    cfg = tiny_config(str(tmp_path), *overrides)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world)


def test_a_good_pipeline_configuration_passes(tmp_path):
    cfg = tiny_config(
        str(tmp_path),
        "parallel.pp=2",
        "model.n_layers=8",
        "parallel.schedule=interleaved",
        "parallel.virtual_stages=2",
        "train.micro_batch=2",
        "parallel.tp=2",
        "parallel.zero=1",
    )
    dims = cfg.validate(8)
    assert (dims.dp, dims.tp, dims.pp) == (2, 2, 2)


def test_an_empty_timeline_has_no_bubble():
    """Nothing ran (no step traced yet): the bubble is 0, a number the plot and the trainer's line can print."""
    assert Timeline([[], []]).bubble() == 0.0 and Timeline([[], []]).makespan == 0.0


def test_uniform_times_names_the_ranks_of_a_deadlocked_order():
    """Rank 0 starts with a backward that needs rank 1's, rank 1 with a forward that needs rank 0's: neither can go."""
    from trickles.parallel.pipeline.actions import uniform_times

    orders = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]]
    with pytest.raises(ValueError, match=r"^the schedule deadlocks: rank 0 at B0\.0, rank 1 at F0\.0$"):
        uniform_times(orders, Shape(2, 1, 1))
    fine = uniform_times(
        [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]], Shape(2, 1, 1)
    )
    assert fine[(1, Action("B", 0, 0))] == (2.0, 4.0) and fine[(0, Action("B", 0, 0))] == (4.0, 6.0)


# ---- zero-bubble schedules ------------------------------------------------------------------

ZB = [("zb-h1", Shape.of("zb-h1", p, 1, m)) for p in (2, 3, 4) for m in (1, 2, 3, 4, 8)] + [
    ("zb-v", Shape.of("zb-v", p, 2, m)) for p in (2, 3, 4) for m in (1, 2, 4, 7, 8)
]


@pytest.mark.parametrize("schedule,shape", ZB, ids=[f"{s}-p{sh.p}m{sh.m}" for s, sh in ZB])
def test_zero_bubble_schedules_are_complete_ordered_bounded_and_beat_1f1b(schedule, shape):
    """Each chunk's F, B and W of every micro-batch once, B after its F and W after its B; deadlock-free with
    messages posted early or when due; activations (F to W) never above 1F1B's peak, ``p`` micro-batches' worth;
    with F, B and W one slot each the bubble is the formula's where the construction applies (ZB-H1 ``m >= p``:
    ``(p - 1) / (3 m + p - 1)``; ZB-V ``m >= 2 p - 1``: ``(p - 1) / (6 m + p - 1)``) and below 1F1B's everywhere."""
    p, v, m = shape.p, shape.v, shape.m
    for early in (False, True):
        lists = build(schedule, shape, early_receives=early)
        timeline = simulate(lists, shape)  # raises on a deadlock, a mismatched message or a local read too soon
    every = sorted((c, i) for c in range(v) for i in range(m))
    for acts in lists:
        for kind in "FBW":
            assert sorted((a.chunk, a.micro) for a in acts if a.kind == kind) == every
        where = {(a.kind, a.chunk, a.micro): k for k, a in enumerate(acts)}
        assert all(where[("F", c, i)] < where[("B", c, i)] < where[("W", c, i)] for c, i in every)
        assert peak_alive(acts) <= v * p
    bubble = Fraction(timeline.bubble()).limit_denominator(10_000)
    if schedule == "zb-h1" and m >= p:
        assert bubble == Fraction(p - 1, 3 * m + p - 1)
    if schedule == "zb-v" and m >= 2 * p - 1:
        assert bubble == Fraction(p - 1, 6 * m + p - 1)
    assert bubble < Fraction(p - 1, m + p - 1)  # 1F1B's, the same micro-batches and layers per rank


@pytest.mark.parametrize("tf,tb,tw", [(1, 2, 1), (2, 3, 1), (1, 4, 1), (2, 5, 2)])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_less_2w(tf, tb, tw):
    """With a whole backward ``t_b`` of which ``W`` is ``t_w <= t_b / 2``: each rank idles
    ``(p - 1)(t_f + t_b - 2 t_w)`` (1F1B: ``(p - 1)(t_f + t_b)``)."""
    p, m = 4, 8
    shape = Shape.of("zb-h1", p, 1, m)
    timeline = simulate(build("zb-h1", shape), shape, float(tf), float(tb), float(tw))
    makespan = Fraction(timeline.makespan)
    assert makespan == m * (tf + tb) + (p - 1) * (tf + tb - 2 * tw)
    for row in timeline.spans:
        assert makespan - sum(Fraction(e) - Fraction(s) for _, s, e in row) == (p - 1) * (tf + tb - 2 * tw)


def test_zb_v_places_chunks_in_a_v_and_turns_without_a_message():
    """Rank r holds stages r and 2p - 1 - r: both ends on rank 0; the last rank hands its chunk 0's output to its
    chunk 1 (and the gradient back) without a message, every other hop is one message."""
    shape = Shape.of("zb-v", 4, 2, 8)
    assert [[shape.stage(r, c) for c in range(2)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [shape.owner(s) for s in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert shape.ends(0) == (True, True) and shape.ends(3) == (False, False)
    lists = build("zb-v", shape)
    sends = [sum(a.kind == "SEND_F" for a in acts) for acts in lists]
    assert sends == [8, 16, 16, 8]  # rank 0: its chunk 1 is the last stage; rank 3: its chunk 0 output stays
    assert not any(a.kind.startswith("RECV_F") and a.chunk == 1 for a in lists[3])


def test_a_zero_bubble_shape_must_carry_its_placement():
    with pytest.raises(ValueError, match="needs Shape.of"):
        check_shape("zb-v", Shape(2, 2, 4))
    with pytest.raises(ValueError, match="needs Shape.of"):
        compute_order("1f1b", Shape(2, 1, 4, vee=True), 0)
