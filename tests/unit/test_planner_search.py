"""The layout search: enumeration under pins, validity, memory pruning against the memory report, ranking, JSON."""

import dataclasses

import pytest
import torch

from trickles.config import Config
from trickles.errors import ConfigError
from trickles.memory.report import predict
from trickles.planner import load_cluster
from trickles.planner.report import explain, plan_json, plan_table, winner_toml
from trickles.planner.search import (
    SEARCHED,
    Search,
    check_pins,
    enumerate_layouts,
    memory_bound,
    pinned_keys,
    plan_model,
)

TINY = ["model.preset=tiny", "data.seq_len=32", "train.global_batch=8", "model.vocab_size=320"]
JSON_KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu", "peak_bytes", "fits"}


def setup(*sets, devices=4, cluster="dgx-a100", **kw):
    cfg = Config.load(None, [*TINY, *sets])
    pins = pinned_keys(None, [*TINY, *sets])
    mc = plan_model(cfg)
    c = cluster if not isinstance(cluster, str) else load_cluster(cluster)
    return cfg, mc, Search(cfg, mc, c, devices, pins, **kw)


def test_pins_come_from_the_file_and_the_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nzero = 1\ndp = -1\n[memory]\nrecompute = 'full'\n[train]\nsteps = 3\n")
    assert pinned_keys(path, ["parallel.tp=2", "train.lr=0.1"]) == {"parallel.zero", "memory.recompute", "parallel.tp"}
    assert pinned_keys(None, ["parallel.dp=2"]) == {"parallel.dp"}


def test_enumeration_keeps_pinned_keys_and_varies_the_rest():
    sets = ["parallel.tp=2", "memory.recompute=full", "parallel.zero=1"]
    cfg, mc, _ = setup(*sets)
    layouts = list(enumerate_layouts(cfg, pinned_keys(None, sets), 4, mc))
    assert layouts and all(lay.tp == 2 and lay.recompute == "full" and lay.zero == 1 for lay in layouts)
    assert {lay.pp for lay in layouts} == {1, 2} and {lay.dp for lay in layouts} == {1, 2}
    assert {lay.sequence_parallel for lay in layouts} == {False, True}
    assert {lay.micro_batch for lay in layouts} >= {1, 2, 4}
    free = list(enumerate_layouts(cfg, set(), 4, mc))
    assert {lay.tp_mode for lay in free} == {"1d", "2d"} and {lay.recompute for lay in free} == {
        "none",
        "elementwise",
        "selective",
        "full",
    }
    assert not any(lay.recompute == "elementwise" and lay.tp_mode != "1d" for lay in free)  # refused on grids
    assert {lay.offload_optimizer for lay in free} == {False, True} and {lay.cp_mode for lay in free if lay.cp > 1} == {
        "ring",
        "ulysses",
    }
    assert not any(lay.offload_optimizer and lay.zero == 0 for lay in free)


def test_a_config_pinning_everything_evaluates_one_layout():
    sets = [
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.tp_mode=1d",
        "parallel.tp_depth=1",
        "parallel.pp=1",
        "parallel.cp=1",
        "parallel.cp_mode=ring",
        "parallel.ep=1",
        "parallel.sequence_parallel=true",
        "parallel.zero=1",
        "parallel.schedule=1f1b",
        "parallel.virtual_stages=1",
        "parallel.pipeline_layers=[]",
        "train.micro_batch=2",
        "memory.recompute=selective",
        "memory.recompute_num_layers=0",
        "memory.recompute_rest=none",
        "memory.offload_optimizer=false",
    ]
    assert pinned_keys(None, sets) == set(SEARCHED)
    cfg, mc, s = setup(*sets)
    s.run()
    assert s.counts["layouts"] == 1 and len(s.ranked) == 1
    assert s.ranked[0].layout.label() == "dp2 tp2+sp mb2 zero1 rc=selective"


def test_impossible_pins_name_the_constraint():
    cfg, mc, _ = setup("parallel.tp=3")
    with pytest.raises(ConfigError, match=r"^parallel.tp=3 does not divide --devices 8"):
        check_pins(cfg, {"parallel.tp"}, 8)
    with pytest.raises(ConfigError, match="parallel.tp=2 x parallel.pp=4 = 8 does not divide --devices 4"):
        check_pins(Config.load(None, ["parallel.tp=2", "parallel.pp=4"]), {"parallel.tp", "parallel.pp"}, 4)
    with pytest.raises(ConfigError, match="--devices must be a positive"):
        check_pins(cfg, set(), 0)


def test_every_valid_layout_within_the_bound_is_ranked_and_the_ranking_is_by_time():
    cfg, mc, s = setup(devices=4)
    s.run()
    assert s.exhaustive
    times = [c.time.total_s for c in s.ranked]
    assert times == sorted(times)
    ranked = {c.layout for c in s.ranked}
    held = {lay for c in s.ranked for lay in c.fallbacks}
    valid = 0
    for lay in enumerate_layouts(cfg, set(), 4, mc):
        try:
            lay.apply(cfg).validate(4)
        except ConfigError:
            assert lay not in ranked
            continue
        valid += 1
        assert lay in ranked or lay in held  # an 80 GiB device holds every layout of the tiny model
    assert valid == len(ranked) + len(held) and s.counts["invalid"] + valid == s.counts["layouts"]
    # a layout held back needs more recomputation than the one ranked in its place: the same layout with less
    for c in s.ranked:
        keep = ("recompute", "recompute_num_layers", "recompute_rest")
        assert all(dataclasses.replace(f, **{k: getattr(c.layout, k) for k in keep}) == c.layout for f in c.fallbacks)


def _small_device(cfg, mc, devices, fraction):
    """A dgx-a100 whose device memory lies ``fraction`` of the way between the tiny model's lightest and heaviest
    one-stage layouts (as the memory report predicts them) after the 10% headroom."""
    peaks = sorted(
        predict(lay.apply(cfg), lay.apply(cfg).validate(devices), mc, "cuda").predicted["peak"]
        for lay in _valid(cfg, mc, devices)
        if lay.pp == 1 and lay.micro_batch in (1, 4)
    )
    limit = peaks[0] + fraction * (peaks[-1] - peaks[0])
    return dataclasses.replace(load_cluster("dgx-a100"), device_memory_gib=limit / 0.9 / 2**30)


def _valid(cfg, mc, devices):
    for lay in enumerate_layouts(cfg, set(), devices, mc):
        try:
            lay.apply(cfg).validate(devices)
        except ConfigError:
            continue
        yield lay


def test_the_bound_never_exceeds_the_memory_report():
    cfg, mc, _ = setup()
    for lay in _valid(cfg, mc, 2):
        if lay.micro_batch == 2 or (lay.pp > 1 and lay.recompute == "selective"):  # (fewer reports: a few seconds)
            continue
        c = lay.apply(cfg)
        dims = c.validate(2)
        bound = memory_bound(c, dims, mc, "cuda", 8)
        report = predict(c, dims, mc, "cuda")
        assert bound.device <= report.predicted["peak"], lay.label()
        if lay.pp == 1:  # and close, so that it prunes (pipelines: the report adds the runner's buffers)
            assert bound.device >= 0.8 * report.predicted["peak"], lay.label()


def test_the_bound_follows_an_uneven_layer_split():
    """Each stage's bound counts its own layers: moving layers from the first stage to the second moves bytes with
    them, and every stage stays under the report's."""
    cfg, mc, _ = setup("model.n_layers=4", "parallel.pp=2")
    stages = {}
    for split in ("[1, 3]", "[3, 1]"):
        c = Config.load(None, [*TINY, "model.n_layers=4", "parallel.pp=2", f"parallel.pipeline_layers={split}"])
        dims = c.validate(2)
        bound, report = memory_bound(c, dims, mc, "cuda", 8), predict(c, dims, mc, "cuda")
        assert all(b <= r["peak"] for b, r in zip(bound.stages, report.stages)), (split, bound.stages)
        stages[split] = bound.stages
    assert stages["[1, 3]"][0] < stages["[3, 1]"][0] and stages["[1, 3]"][1] > stages["[3, 1]"][1], stages


def test_the_lightest_fit_is_its_family_with_the_most_recomputation():
    """The layout named for "the smallest cluster that fits" is the one whose bound and report were computed: the
    end of its recomputation chain, full recomputation of every layer."""
    cfg, mc, s = setup(devices=2)
    c = s.lightest_fit()
    assert c is not None and c.fits
    assert (
        (c.layout.recompute, c.layout.recompute_num_layers)
        == (c.cfg.memory.recompute, c.cfg.memory.recompute_num_layers)
        == ("full", 0)
    )


def test_fits_agrees_with_the_memory_report():
    cfg, mc, _ = setup("parallel.pp=1", "parallel.cp=1")
    cluster = _small_device(cfg, mc, 2, 0.4)
    _, _, s = setup("parallel.pp=1", "parallel.cp=1", devices=2, cluster=cluster)
    s.run()
    assert s.counts["over_memory"] > 0 and s.ranked  # the bound pruned some, and kept some
    top = s.top(3)
    assert len(top) == 3 and all(c.fits for c in top)
    for c in s.ranked[:12]:
        s.confirm(c, s.ranked.index(c))
    for c in s.confirmed():
        peak = predict(c.cfg, c.dims, mc, "cuda").predicted["peak"]
        assert not c.estimated and c.peak == peak and c.fits == (peak <= s.capacity)


def test_a_layout_the_memory_report_refuses_gives_way_to_more_recomputation():
    cfg, mc, s = setup("parallel.pp=1", "parallel.cp=1", "parallel.tp=1", devices=2)
    s.run()
    c = next(c for c in s.ranked if c.layout.recompute == "none" and c.fallbacks)
    peak = predict(c.cfg, c.dims, mc, "cuda").predicted["peak"]
    assert c.bound.device < peak
    s.capacity = (c.bound.device + peak) / 2  # within the bound, over the report
    before = len(s.ranked)
    s.confirm(c, s.ranked.index(c))
    assert c.fits is False and len(s.ranked) == before + 1
    more = next(d for d in s.ranked if d.layout == dataclasses.replace(c.layout, recompute="elementwise"))
    assert s.ranked.index(more) > s.ranked.index(c) and more.time.total_s >= c.time.total_s
    assert more.fallbacks == c.fallbacks[1:]


def test_json_has_the_promised_keys_and_the_table_a_row_per_layout():
    cfg, mc, s = setup(devices=2)
    s.run()
    top = s.top(3)
    data = plan_json(s, top)
    assert data["top"] == [c.layout.label() for c in top] and len(data["layouts"]) == len(s.ranked) > 3
    times = [row["step_time_s"] for row in data["layouts"]]
    assert times == sorted(times), "fastest first"
    for row in data["layouts"]:
        assert JSON_KEYS <= set(row) and set(SEARCHED) <= set(row) and row["peak_bytes"] > 0
        # the memory report's verdict where it ran; a layout only the bound saw says so and claims nothing
        assert row["fits"] in (True, False) if not row["memory_estimated"] else row["fits"] is None
    assert [row["layout"] for row in data["layouts"] if row["fits"]][:3] == data["top"]
    table = plan_table(s, top)
    assert all(c.layout.label() in table for c in top)
    lines = explain(s, top[0])
    assert any(line.startswith("best with ZeRO-3") for line in lines)
    assert all("x the winner's step time" in line or "none fits" in line for line in lines)
    tp2 = next(
        c for c in s.ranked if c.layout.tp == 2 and c.layout.tp_mode == "1d"
    )  # the other sequence-parallel choice
    other = "without" if tp2.layout.sequence_parallel else "with"
    assert any(line.startswith(f"best {other} sequence parallelism") for line in explain(s, tp2))
    assert not any("sequence parallelism" in line for line in explain(s, next(c for c in s.ranked if c.layout.tp == 1)))


def test_the_winner_config_loads_back_and_validates(tmp_path):
    cfg, mc, s = setup("parallel.pp=1", devices=4)
    s.run()
    win = s.top(1)[0]
    path = tmp_path / "plan.toml"
    path.write_text(winner_toml(cfg, win))
    back = Config.load(path)
    dims = back.validate(4)
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (win.layout.dp, win.layout.tp, win.layout.pp, win.layout.cp)
    assert back.train.micro_batch == win.layout.micro_batch and back.parallel.zero == win.layout.zero


def test_the_hierarchical_search_finds_no_faster_layout_than_the_exhaustive_one():
    cfg, mc, full = setup(devices=4)
    _, _, quick = setup(devices=4, exhaustive_limit=0, refine=2)
    full.run()
    quick.run()
    assert not quick.exhaustive and quick.ranked
    assert quick.ranked[0].time.total_s >= full.ranked[0].time.total_s
    labels = {c.layout.label() for c in full.ranked}
    assert all(c.layout.label() in labels for c in quick.ranked)
    seeded = {
        (c.layout.dp, c.layout.tp, c.layout.tp_mode, c.layout.pp, c.layout.cp, c.layout.cp_mode) for c in quick.ranked
    }
    assert seeded == {
        (c.layout.dp, c.layout.tp, c.layout.tp_mode, c.layout.pp, c.layout.cp, c.layout.cp_mode) for c in full.ranked
    }  # every degree layout is seeded


def test_planning_creates_no_process_group():
    _, _, s = setup(devices=2)
    s.run()
    s.top(2)
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


def test_the_bound_counts_the_experts_over_their_data_parallel_group():
    """ZeRO-1 at dp=4, ep=2: each rank keeps the optimizer state of its experts' share over the expert data-parallel
    group (2 ranks), and of the dense weights' over all 4 replicas; the bound stays under the memory report and
    close to it."""
    cfg, mc, _ = setup(
        "model.moe_experts=4",
        "model.moe_top_k=2",
        "model.moe_ffn_hidden=64",
        "parallel.dp=4",
        "parallel.ep=2",
        "parallel.zero=1",
        "parallel.pp=1",
        "parallel.tp=1",
        "parallel.cp=1",
    )
    dims = cfg.validate(4)
    bound = memory_bound(cfg, dims, mc, "cuda", 8)
    peak = predict(cfg, dims, mc, "cuda").predicted["peak"]
    assert 0.8 * peak <= bound.device <= peak, (bound.device, peak)


def test_a_pinned_virtual_stage_count_holds_for_every_layout_and_a_free_one_varies():
    sets = ["model.n_layers=4", "parallel.virtual_stages=2"]
    cfg, mc, _ = setup(*sets)
    pinned = list(enumerate_layouts(cfg, pinned_keys(None, sets), 4, mc))
    assert pinned and {lay.virtual_stages for lay in pinned} == {2}
    free = list(enumerate_layouts(cfg, set(), 4, mc))
    assert {lay.virtual_stages for lay in free if lay.pp > 1} == {1, 2}  # 1F1B and interleaved over 2 chunks


def test_pipelines_are_searched_with_zero_2_and_3_and_uneven_interleaved_chunks():
    """Under pipeline stages the search tries ZeRO-2 and -3 (not ZeRO-3 with the zero-bubble schedules, which the
    configuration refuses) and interleaving with chunks the layers do not divide evenly (7 layers over 2 x 2 chunks)."""
    cfg, mc, _ = setup("model.n_layers=7", "parallel.pp=2", "parallel.tp=1", "parallel.cp=1")
    piped = [lay for lay in enumerate_layouts(cfg, {"parallel.pp", "parallel.tp", "parallel.cp"}, 4, mc)]
    assert {lay.zero for lay in piped} == {0, 1, 2, 3}
    assert not any(lay.zero == 3 and lay.schedule in ("zb-h1", "zb-v") for lay in piped)
    assert {lay.virtual_stages for lay in piped if lay.schedule == "interleaved"} == {2, 3}  # 7 % 4, 7 % 6 != 0
    valid = set()
    for lay in piped:
        try:
            lay.apply(cfg).validate(4)
        except ConfigError:  # (e.g. too few micro-batches for interleaving: the search counts these invalid)
            continue
        valid.add((lay.schedule, lay.virtual_stages, lay.zero))
    assert {("interleaved", 3, 3), ("1f1b", 1, 2), ("zb-v", 2, 2)} <= valid


def test_no_fit_is_claimed_while_a_ranked_layout_fits():
    """The bound leaves transients out, so the fastest layouts within it may all be over the report: the walk for the
    top layouts goes on past ``max_confirm`` misses until one fits (then stops after that many more)."""
    cfg, mc, s = setup("parallel.pp=1", "parallel.cp=1", "memory.recompute=none", devices=2, max_confirm=1)
    s.run()
    peaks = [predict(c.cfg, c.dims, mc, "cuda").predicted["peak"] for c in s.ranked]
    j = next(j for j in range(2, len(peaks)) if peaks[j] < min(peaks[:j]))  # lighter than every faster layout
    s.capacity = peaks[j]
    top = s.top(1)
    assert top and top[0] is s.ranked[j] and all(c.fits is False for c in s.ranked[:j])
    # and so for the "why not" lines' best of a kind: past max_confirm misses, the first that fits
    assert s.best() is s.ranked[j]
