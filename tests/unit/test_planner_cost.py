"""The step-time model: placement on links, bytes from the library's formulas, FLOPs, bubble, sanity of the parts."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from trickles.comm import messages, wire_bytes
from trickles.config import Config
from trickles.errors import ConfigError
from trickles.models.config import resolve_model
from trickles.parallel.pipeline.schedules import Shape, build
from trickles.parallel.pipeline.timeline import simulate
from trickles.parallel.reduction import reduction_wire_bytes
from trickles.parallel.tensor.region_bytes import partial_grad_elements
from trickles.planner import load_cluster, step_time
from trickles.planner.compute import causal_pairs, chunk_work, param_elements, rank_params
from trickles.planner.cost import IN_LAYER, rank_step
from trickles.planner.placement import group_members, group_size, spans_nodes
from trickles.planner.rank_plan import rank_plans
from trickles.topology import ParallelDims
from trickles.train.flops import flops_per_token

TINY = ["model.preset=tiny", "data.seq_len=32", "train.global_batch=8"]
GPT3 = [
    "model.flavor=gpt2",
    "model.n_layers=96",
    "model.d_model=12288",
    "model.n_heads=96",
    "model.n_kv_heads=96",
    "data.seq_len=2048",
    "model.vocab_size=51200",
    "train.global_batch=1536",
    "memory.precision=bf16",
    "train.micro_batch=1",
    "parallel.zero=1",
    "memory.recompute=selective",
    "parallel.sequence_parallel=true",
]


def plan(world, *sets, cluster="local", base=TINY):
    cfg = Config.load(None, [*base, *sets])
    dims = cfg.validate(world)
    mc = resolve_model(cfg.model, cfg.model.vocab_size or 320, cfg.data.seq_len)
    c = load_cluster(cluster)
    return cfg, dims, mc, step_time(cfg, dims, mc, c.sized(world) if c.device == "cuda" else c)


def traffic(st, group, dimension=None):
    return [tt for tt in st.traffic if tt.traffic.group == group and dimension in (None, tt.traffic.dimension)]


def test_the_ring_formulas():
    assert [wire_bytes(op, 100, 4) for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")] == [
        150,
        75,
        300,
        75,
        100,
    ]
    assert [messages(op, 4) for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")] == [
        6,
        3,
        3,
        3,
        1,
    ]
    assert wire_bytes("all_reduce", 100, 1) == 0 and messages("all_reduce", 1) == 0


def test_groups_are_the_topologys():
    dims = ParallelDims(dp=2, tp=4, pp=2, cp=2, ep=2, tp_mode="2d")
    for name in ("pp", "dp", "cp", "tp"):
        groups = group_members(dims, name)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))  # a partition
        for g in groups:
            assert len(g) == getattr(dims, name) == group_size(dims, name)
            coords = [dims.coords(r) for r in g]
            assert all(
                {k: v for k, v in c.items() if k not in (name, "ep")}
                == {k: v for k, v in coords[0].items() if k not in (name, "ep")}
                for c in coords
            )
            assert sorted(c[name] for c in coords) == list(range(len(g)))
    assert all(len({dims.coords(r)["ep"] for r in g}) == 2 for g in group_members(dims, "ep"))
    assert all(len({dims.coords(r)["ep"] for r in g}) == 1 for g in group_members(dims, "edp"))
    assert group_members(dims, "tp_row")[:2] == [[0, 1], [2, 3]] and group_members(dims, "tp_col")[:2] == [
        [0, 2],
        [1, 3],
    ]
    assert group_members(dims, "tp_dep") == [] and group_members(dims, "pp_ends")[0] == [0, 16]


def test_a_tensor_parallel_group_across_two_nodes_gets_the_inter_node_link():
    assert not spans_nodes(ParallelDims(dp=2, tp=8), "tp", 8) and spans_nodes(ParallelDims(dp=2, tp=8), "dp", 8)
    assert spans_nodes(ParallelDims(tp=16), "tp", 8) and not spans_nodes(ParallelDims(tp=4, dp=2), "dp", 8)
    assert spans_nodes(ParallelDims(tp=4, dp=2, tp_mode="2d"), "tp_col", 2)  # lines q apart cross 2-rank nodes
    assert not spans_nodes(ParallelDims(tp=4, dp=2, tp_mode="2d"), "tp_row", 2)
    inside = plan(1024, "parallel.tp=8", "parallel.pp=16", base=GPT3, cluster="dgx-a100")[3]
    across = plan(1024, "parallel.tp=16", "parallel.pp=8", base=GPT3, cluster="dgx-a100")[3]
    assert {tt.link for tt in traffic(inside, "tp")} == {"intra-node"}
    assert {tt.link for tt in traffic(across, "tp")} == {"inter-node"}
    assert {tt.link for tt in traffic(inside, "dp")} == {"inter-node"}
    assert across.exposed_by_group["tp"] > 5 * inside.exposed_by_group["tp"]
    assert across.total_s > inside.total_s
    assert any(n.startswith("tp=16 spans 2 nodes") for n in across.notes)
    assert not any(n.startswith("tp=") for n in inside.notes)
    assert 0.3 < inside.mfu < 0.7  # Megatron-LM reports 44-52% for this model and layout


def test_data_parallel_bytes_are_the_engines_formula():
    cfg, dims, mc, st = plan(4, "parallel.dp=4", "parallel.zero=1")
    (r,) = rank_plans(cfg, dims, mc)
    want = reduction_wire_bytes(r.buckets, 4, 1, r.micro_batches, r.g, r.p)
    got = {
        tt.traffic.op: (tt.traffic.calls, tt.traffic.wire_bytes)
        for tt in traffic(st, "dp")
        if tt.traffic.op != "all_reduce"
    }
    assert got == {op: v for op, v in want.items() if op != "all_reduce"}
    assert sum(r.buckets) == param_elements(mc)
    volume = sum(v[1] for op, v in want.items() if op != "all_reduce")  # ZeRO: 2 (n-1)/n 4P, the all-reduce's
    assert volume == pytest.approx(2 * 3 / 4 * 4 * param_elements(mc), rel=1e-6)


def test_zero3_units_hold_each_ranks_own_parameters_with_experts_apart():
    """ZeRO-3 under expert parallelism: a gather unit per block of its dense weights, the root's, and the experts'
    units of their own (gathered over the experts' data-parallel group) -- together exactly the rank's parameters."""
    cfg, dims, mc, _ = plan(
        4, "parallel.dp=4", "parallel.ep=2", "parallel.zero=3", "model.moe_experts=4", "model.moe_every=1"
    )
    (r,) = rank_plans(cfg, dims, mc)
    assert len(r.buckets) == mc.n_layers + 1 and len(r.expert_buckets) == mc.n_layers
    assert sum(r.buckets) == r.dense_params and sum(r.expert_buckets) == r.expert_params > 0


def test_tensor_parallel_bytes_are_megatrons():
    cfg, dims, mc, st = plan(2, "parallel.tp=2")
    L, tokens, act = mc.n_layers, 8 * 32, 8 * 32 * mc.d_model * 4
    calls = sum(tt.traffic.calls for tt in traffic(st, "tp"))
    assert calls == 4 * L + 2 + 3 + 1 + (1 if partial_grad_elements(mc, 2, False) else 0)
    wire = sum(tt.traffic.wire_bytes for tt in traffic(st, "tp"))
    partial = partial_grad_elements(mc, 2, False) * 4
    assert wire == (4 * L + 2) * act * 2 * (1 / 2) + 3 * tokens * 4 + 4 + partial
    assert {tt.traffic.overlap for tt in traffic(st, "tp")} == {"none"}  # on the critical path
    assert st.exposed_by_group["tp"] == pytest.approx(st.comm_by_group["tp"])


@pytest.mark.parametrize(
    "schedule,p,v,m",
    [("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 3), ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8)],
)
def test_the_bubble_is_the_schedules(schedule, p, v, m):
    sets = [
        f"parallel.pp={p}",
        f"parallel.schedule={schedule}",
        f"parallel.virtual_stages={v}",
        "model.n_layers=8",
        f"train.global_batch={m}",
        "train.micro_batch=1",
    ]
    cfg, dims, mc, st = plan(p, *sets, cluster="dgx-a100")  # a device per rank (CPU ranks beyond the cores share)
    shape = Shape(p, v, m)
    assert st.bubble_fraction == pytest.approx(simulate(build(schedule, shape), shape, 1.0, 2.0).bubble())
    in_layer = sum(tt.exposed_s for tt in st.traffic if tt.traffic.dimension in IN_LAYER)
    assert st.in_layer_s == pytest.approx(in_layer)
    stages = [rank_step(r, load_cluster("dgx-a100").sized(p)) for r in rank_plans(cfg, dims, mc)]
    per_micro = [(s.compute_s + s.in_layer_s) / m for s in stages]  # one micro-batch of each stage
    assert st.bubble_s == pytest.approx((sum(per_micro) - per_micro[st.stage]) / v)  # the other stages' fill and drain
    assert len(st.stage_s) == p and st.total_s == max(st.stage_s)


@pytest.mark.parametrize("schedule,v,peer", [("zb-h1", 1, "1f1b"), ("zb-v", 2, "interleaved")])
def test_zero_bubble_schedules_leave_z_of_the_fill_and_drain(schedule, v, peer):
    """The same stages: the zero-bubble schedule's bubble is ``z = (t_f + t_b - 2 t_w) / (t_f + t_b)`` of its peer's
    (1F1B, or interleaved with the same two chunks), ``t_w`` the forward time of the GEMMs with a weight. ``z`` is the
    model's input, bracketed: the weights' GEMMs are a third of a block's forward and backward GEMMs, and what ``W``
    does not take (the attention core, the element-wise work) is small at sequence 32, so ``1/3 < z < 1/2``. The
    bubble it gives is checked against the schedule itself: its action lists replayed with a forward of 1, a backward
    of 2 and a ``W`` of ``t_w = 3 (1 - z) / 2`` (so that those times' ``z`` is the planner's) -- ZB-H1's idle
    fraction exactly, ZB-V's at most (its V fills some of what ``z`` leaves), and the idle time over the peer's
    replayed the same way is the ratio of the planned bubbles."""
    sets = [
        "parallel.pp=4",
        "model.n_layers=8",
        "train.global_batch=8",
        "train.micro_batch=1",
        f"parallel.virtual_stages={v}",
    ]
    _, _, _, zb = plan(4, *sets, f"parallel.schedule={schedule}", cluster="dgx-a100")
    _, _, _, other = plan(4, *sets, f"parallel.schedule={peer}", cluster="dgx-a100")
    assert zb.compute_s == pytest.approx(other.compute_s)
    z = zb.bubble_scale
    assert 1 / 3 < z < 0.5 and other.bubble_scale == 1.0
    p, m = 4, 8
    shape, peer_shape = Shape.of(schedule, p, v, m), Shape.of(peer, p, v, m)
    ran = simulate(build(schedule, shape), shape, 1.0, 2.0, 1.5 * (1 - z))
    ran_peer = simulate(build(peer, peer_shape), peer_shape, 1.0, 2.0)
    idle, idle_peer = (sum(t.makespan - sum(e - s for _, s, e in row) for row in t.spans) for t in (ran, ran_peer))
    if schedule == "zb-h1":
        assert zb.bubble_fraction == pytest.approx(ran.bubble())
        assert zb.bubble_s / other.bubble_s == pytest.approx(idle / idle_peer)
    else:
        assert ran.bubble() <= zb.bubble_fraction < 1.1 * ran.bubble()
        assert idle / idle_peer <= zb.bubble_s / other.bubble_s < 1.1 * idle / idle_peer


@pytest.mark.parametrize("schedule,v,expected", [("zb-h1", 1, 3 / 27), ("zb-v", 2, 3 / 51), ("1f1b", 1, 9 / 33)])
def test_the_replayed_schedules_idle_as_the_papers_say(schedule, v, expected):
    """The oracle above against numbers worked by hand (p = 4, m = 8; forward, backward and ``W`` one slot each, so
    a whole backward is 2): 1F1B idles ``(p - 1) (t_f + t_b) = 9`` slots of ``m (t_f + t_b) + 9 = 33``; ZB-H1 (Qi et
    al., ICLR 2024, section 3) idles ``(p - 1) (t_f + t_b - 2 t_w) = 3`` of ``3 m + 3 = 27``; ZB-V (their section 4,
    two chunks of half the work, so every slot counts twice over ``2 m``) idles ``3`` of ``6 m + 3 = 51``."""
    p, m = 4, 8
    shape = Shape.of(schedule, p, v, m)
    assert simulate(build(schedule, shape), shape, 1.0, 2.0, 1.0).bubble() == pytest.approx(expected)


def test_the_layout_search_offers_the_zero_bubble_schedules_without_full_recomputation():
    from trickles.planner.layouts import RECOMPUTE, enumerate_layouts

    cfg = Config.load(None, [*TINY, "model.n_layers=8", "parallel.pp=2"])
    mc = resolve_model(cfg.model, 320, cfg.data.seq_len)
    seen = {(lay.schedule, lay.virtual_stages, lay.recompute) for lay in enumerate_layouts(cfg, {"parallel.pp"}, 4, mc)}
    assert ("zb-h1", 1, "selective") in seen and ("zb-v", 2, "none") in seen
    assert not any(s.startswith("zb") and rc == "full" for s, _, rc in seen) and ("1f1b", 1, "full") in seen
    assert set(RECOMPUTE) == {"none", "elementwise", "selective", "full"}


def test_the_layout_search_tries_end_stages_lighter_by_the_embedding_and_the_head():
    """Llama 3's split: the embedding and the output layer each counted as a layer of the end stages."""
    from trickles.planner.layouts import enumerate_layouts, lighter_ends

    assert lighter_ends(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B over 16 stages
    assert lighter_ends(126, 32) == (3,) + (4,) * 30 + (3,)  # two chunks a rank (zb-v: both ends on rank 0)
    assert lighter_ends(8, 2) == () and lighter_ends(2, 2) == ()  # the even split already; an end without a layer
    cfg = Config.load(None, [*TINY, "model.n_layers=8", "parallel.pp=4"])
    mc = resolve_model(cfg.model, 320, cfg.data.seq_len)
    splits = {(lay.schedule, lay.pipeline_layers) for lay in enumerate_layouts(cfg, {"parallel.pp"}, 4, mc)}
    assert ("1f1b", ()) in splits and ("1f1b", (2, 3, 2, 1)) in splits
    lay = next(lay for lay in enumerate_layouts(cfg, {"parallel.pp"}, 4, mc) if lay.pipeline_layers == (2, 3, 2, 1))
    assert "pp4/" in lay.label() and "[2,3,2,1]" in lay.label()
    applied = lay.apply(cfg)
    assert applied.parallel.pipeline_layers == [2, 3, 2, 1] and applied.validate(4).pp == 4


def test_the_slowest_stage_waits_for_the_lighter_ones_only():
    """The output layer and loss make the last stage the slowest; its bubble is the lighter stages' micro-batch, less
    than ``(p - 1) / (v m)`` of its own; with even stages (the head's work dwarfed) the two agree."""
    sets = ["parallel.pp=2", "model.n_layers=2", "train.micro_batch=1", "model.vocab_size=32000"]
    cfg, dims, mc, st = plan(2, *sets, cluster="dgx-a100")
    m = cfg.batch_plan(1)[1]
    assert st.stage == 1 and st.bubble_s < (st.compute_s + st.in_layer_s) / m
    even = plan(2, *sets[:3], "model.n_layers=32", "model.vocab_size=320", cluster="dgx-a100")[3]
    assert even.bubble_s == pytest.approx((even.compute_s + even.in_layer_s) / m, rel=0.05)


def test_a_cpu_stage_computing_while_its_peers_wait_runs_at_the_lone_rate():
    """CPU ranks with a core each: the slowest stage's compute gains ``kappa`` for the share of its time the lighter
    stage waits, and the fill and drain run at the lone rate; ranks sharing cores (no lone core) and GPUs gain none."""
    cfg, dims, mc, _ = plan(2, "parallel.pp=2", "model.n_layers=2", "train.micro_batch=1", "model.vocab_size=4096")
    local = dataclasses.replace(load_cluster("local"), devices_per_node=2)
    flat = step_time(cfg, dims, mc, local)
    fast = step_time(cfg, dims, mc, dataclasses.replace(local, core_contention=1.5))
    c = [rank_step(r, local).compute_s for r in rank_plans(cfg, dims, mc)]
    busy = c[0] / c[1]  # the last stage (the head's) is the slowest; the first is busy this share of its time
    assert fast.stage == flat.stage == 1 and busy < 1
    assert fast.compute_s == pytest.approx(c[1] * (1 + 0.5 * busy) / 1.5)
    assert fast.bubble_s == pytest.approx(flat.bubble_s / 1.5)
    one = dataclasses.replace(local, devices_per_node=1, core_contention=1.5)  # 2 ranks on 1 core
    assert (
        step_time(cfg, dims, mc, one).total_s
        == step_time(cfg, dims, mc, dataclasses.replace(one, core_contention=1.0)).total_s
    )


def test_cpu_pipeline_ranks_beyond_the_cores_lend_them_when_idle():
    cfg, dims, mc, _ = plan(4, "parallel.pp=4", "model.n_layers=8", "train.micro_batch=1")
    local = load_cluster("local")
    two = dataclasses.replace(local, devices_per_node=2)
    shared = step_time(cfg, dims, mc, two)  # 4 ranks on 2 cores
    own = step_time(cfg, dims, mc, dataclasses.replace(local, devices_per_node=4))  # a core each
    busy = [s.total_s - s.bubble_s for s in (rank_step(r, two) for r in rank_plans(cfg, dims, mc))]
    assert shared.total_s == pytest.approx(max(own.total_s, sum(busy) / 4))  # the node's arithmetic over its 2 cores
    assert shared.total_s < 2 * own.total_s  # not every stage slowed by half: the bubble's cores are lent


def test_element_wise_bandwidth_and_pass_overhead_enter_as_the_docstring_says():
    """``t_f`` gains ``E / BW_ew`` and a third of the pass overhead per block and head, backward twice that, full
    recomputation the blocks' forward share again."""
    base = dataclasses.replace(load_cluster("local"), devices_per_node=4)
    cfg, dims, mc, _ = plan(1, "train.micro_batch=2")
    m, layers = cfg.batch_plan(1)[1], mc.n_layers
    ref = step_time(cfg, dims, mc, base)
    slow = step_time(cfg, dims, mc, dataclasses.replace(base, elementwise_gbps=base.memory_bandwidth_gbps / 4))
    assert slow.elementwise_s == pytest.approx(4 * ref.elementwise_s)
    assert slow.compute_s - ref.compute_s == pytest.approx(3 * ref.elementwise_s)
    o = 1e-3
    over = step_time(cfg, dims, mc, dataclasses.replace(base, pass_overhead_us=o * 1e6))
    assert over.compute_s - ref.compute_s == pytest.approx(m * (layers + 1) * o)
    cfg_rc, *_ = plan(1, "train.micro_batch=2", "memory.recompute=full")
    rc = step_time(cfg_rc, dims, mc, base)
    rc_over = step_time(cfg_rc, dims, mc, dataclasses.replace(base, pass_overhead_us=o * 1e6))
    assert rc_over.compute_s - rc.compute_s == pytest.approx(m * ((layers + 1) * o + layers * o / 3))
    cfg_moe, _, mc_moe, _ = plan(1, "train.micro_batch=2", "model.moe_experts=4", "model.moe_every=2")
    moe = step_time(cfg_moe, dims, mc_moe, base)
    moe_over = step_time(cfg_moe, dims, mc_moe, dataclasses.replace(base, moe_pass_overhead_us=o * 1e6))
    assert moe_over.compute_s - moe.compute_s == pytest.approx(m * len(mc_moe.moe_layers) * o)  # its MoE blocks only


def test_interleaving_shrinks_the_bubble_and_more_micro_batches_too():
    one = plan(2, "parallel.pp=2", "model.n_layers=8", "train.micro_batch=2")[3]
    inter = plan(
        2,
        "parallel.pp=2",
        "model.n_layers=8",
        "train.micro_batch=2",
        "parallel.schedule=interleaved",
        "parallel.virtual_stages=2",
    )[3]
    more = plan(2, "parallel.pp=2", "model.n_layers=8", "train.micro_batch=1")[3]
    assert inter.bubble_s < one.bubble_s and more.bubble_s < one.bubble_s


@pytest.mark.parametrize(
    "world,sets",
    [
        (1, []),
        (2, ["parallel.tp=2"]),
        (4, ["parallel.tp=4", "parallel.tp_mode=2d", "model.n_kv_heads=4"]),
        (2, ["parallel.cp=2"]),
        (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
        (2, ["parallel.pp=2"]),
        (4, ["parallel.dp=2", "parallel.pp=2", "train.micro_batch=2"]),
        (2, ["model.preset=gpt2-tiny", "parallel.tp=2"]),
        (2, ["parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", "model.moe_shared_experts=1"]),
    ],
)
def test_the_ranks_gemms_add_up_to_the_models_flops(world, sets):
    cfg, dims, mc, _ = plan(world, *sets)
    total = 0.0
    for r in rank_plans(cfg, dims, mc):
        for c, layers in enumerate(r.chunks):
            work = chunk_work(
                mc,
                dims,
                r.micro,
                r.seq,
                layers,
                r.last and c == len(r.chunks) - 1,
                r.sp,
                r.p,
                cp_mode=cfg.parallel.cp_mode,
            )
            attention = sum(g.flops for g in work.gemms if g.name in ("scores", "weighted"))
            undone = attention * (r.seq**2 / causal_pairs(r.seq) - 1)  # every score, as PaLM's formula counts them
            total += 3 * (work.flops + undone) * r.micro_batches  # forward + backward
    ranks_per_stage = dims.dp * dims.cp * dims.tp
    assert total * ranks_per_stage == pytest.approx(
        flops_per_token(mc, cfg.data.seq_len) * cfg.train.global_batch * cfg.data.seq_len, rel=1e-9
    )


def test_an_expert_parallel_rank_runs_the_gemms_of_its_own_experts():
    """ep=2 over 4 experts: each rank's expert GEMMs are its 2 experts', each on its share of the assignments."""
    cfg, dims, mc, _ = plan(2, "parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", "model.moe_every=1")
    r = rank_plans(cfg, dims, mc)[0]
    work = chunk_work(mc, dims, r.micro, r.seq, [mc.moe_layers[0]], False, r.sp, r.p)
    gemm = {g.name: g for g in work.gemms}
    assert gemm["expert_out"].count == 2 and gemm["expert_in"].count == 2 * 2  # llama: gate and up, then down
    assert gemm["router"].n == 4 and gemm["expert_out"].m == gemm["expert_in"].m > 1


@pytest.mark.parametrize(
    "sets",
    [
        ["model.preset=tiny"],
        ["model.preset=gpt2-tiny"],
        ["model.preset=tiny", "model.moe_experts=4", "model.moe_every=2", "model.moe_shared_experts=1"],
        ["model.preset=gpt2-tiny", "model.moe_experts=2", "model.tie_embeddings=false"],
        ["model.preset=tiny", "model.qkv_bias=true", "model.o_bias=false", "model.mlp_bias=true"],
        ["model.preset=tiny", "model.qk_norm=head", "model.norm_placement=sandwich"],
        ["model.preset=tiny", "model.qk_norm=full", "model.norm_placement=post"],
    ],
)
def test_parameter_counts_are_the_models(sets):
    from trickles.models.transformer import Transformer, count_params

    cfg = Config.load(None, [*TINY, *sets])
    mc = resolve_model(cfg.model, 320, 32)
    with torch.device("meta"):
        assert param_elements(mc) == count_params(Transformer(mc))
    dims = ParallelDims(pp=2)
    stages = [rank_params(mc, dims, [i], i == 0, i == 1) for i in range(2)]
    copy = mc.vocab_size * mc.d_model if mc.tied else 0  # the last stage holds the tied embedding's copy
    assert sum(d + e for d, e in stages) == param_elements(mc) + copy


@pytest.mark.parametrize(
    "preset,tp,sp",
    [
        ("tiny", 4, False),
        ("tiny", 4, True),
        ("tiny", 2, True),
        ("gpt2-tiny", 2, True),
        ("tiny-biased", 4, True),
        ("tiny-head-sandwich", 2, False),
        ("tiny-head-sandwich", 2, True),
        ("tiny-full-post", 2, True),
    ],
)
def test_partial_gradients_are_the_plans(preset, tp, sp):
    """tiny-biased: replicated key/value heads with their biases, and the MLP's row-parallel bias (none on o);
    per-head q/k norms (partial at any tp), post norms (under sequence parallelism), full-width q/k norms (split)."""
    from trickles.models.transformer import Transformer
    from trickles.parallel.tensor.plan import apply_tensor_parallel

    extra = {
        "biased": ["model.qkv_bias=true", "model.o_bias=false", "model.mlp_bias=true"],
        "head-sandwich": ["model.qk_norm=head", "model.norm_placement=sandwich"],
        "full-post": ["model.qk_norm=full", "model.norm_placement=post"],
    }
    name, _, variant = preset.partition("-") if preset.startswith("tiny-") else (preset, "", "")
    cfg = Config.load(None, [*TINY, f"model.preset={name}", *extra.get(variant, [])])
    mc = resolve_model(cfg.model, 320, 32)
    with torch.device("meta"):
        model = Transformer(mc)
    apply_tensor_parallel(model, SimpleNamespace(size=tp, rank=0), sp)
    seen, partial = set(), 0
    for p in model.parameters():
        if id(p) not in seen and getattr(getattr(p, "tp_spec", None), "partial_grad", False):
            seen.add(id(p))
            partial += p.numel()
    assert partial_grad_elements(mc, tp, sp) == partial


def test_more_parallelism_computes_less_per_rank_and_recomputation_more():
    compute = [plan(dp, f"parallel.dp={dp}")[3].compute_s for dp in (1, 2, 4, 8)]
    assert compute == sorted(compute, reverse=True)  # (local: 8 ranks share the cores, so it stops halving)
    a100 = [
        plan(w, f"parallel.tp={w}", base=GPT3[:9] + ["train.micro_batch=1"], cluster="dgx-a100")[3].compute_s
        for w in (1, 2, 4, 8)
    ]
    assert a100 == sorted(a100, reverse=True) and a100[0] / a100[-1] > 5
    none, sel, full = (plan(1, f"memory.recompute={r}")[3] for r in ("none", "selective", "full"))
    assert none.recompute_s == 0 < sel.recompute_s < full.recompute_s
    assert none.compute_s < sel.compute_s < full.compute_s
    big = ["model.d_model=512", "model.n_layers=8", "data.seq_len=512"]  # compute long enough to hide gathers behind
    with_prefetch = plan(2, "parallel.dp=2", "parallel.zero=3", *big, cluster="dgx-a100")[3]
    without = plan(2, "parallel.dp=2", "parallel.zero=3", "parallel.prefetch=false", *big, cluster="dgx-a100")[3]
    assert with_prefetch.exposed_comm_s < without.exposed_comm_s and with_prefetch.comm_s == without.comm_s
    on_cpu = plan(2, "parallel.dp=2", "parallel.zero=3", *big)[3]  # gloo reduces on the cores: nothing hides
    assert on_cpu.exposed_comm_s == pytest.approx(on_cpu.comm_s)
    offload = plan(
        2, "parallel.dp=2", "parallel.zero=1", "memory.offload_optimizer=true", "memory.offload_overlap=false"
    )[3]
    assert offload.offload_s > 0 and offload.optimizer_s > 0


def test_the_parts_add_up_and_a_layout_too_big_for_the_cluster_is_refused():
    st = plan(
        2,
        "parallel.dp=2",
        "parallel.zero=2",
        "train.micro_batch=2",
        "parallel.bucket_mb=0.05",
        "model.d_model=512",
        "model.n_layers=8",
        "data.seq_len=512",
        cluster="dgx-a100",
    )[3]
    assert st.total_s == pytest.approx(st.compute_s + st.bubble_s + st.exposed_comm_s + st.optimizer_s + st.offload_s)
    assert 0 < st.exposed_comm_s < st.comm_s and st.comm_s == pytest.approx(sum(st.comm_by_group.values()))
    assert st.tokens == 8 * 512 and st.tokens_per_s == pytest.approx(st.tokens / st.total_s)
    cfg = Config.load(None, [*TINY, "parallel.dp=16", "train.global_batch=16"])
    dims = cfg.validate(16)
    mc = resolve_model(cfg.model, 320, 32)
    with pytest.raises(ConfigError, match="the layout needs 16 devices, the cluster 'dgx-a100' has 8"):
        step_time(cfg, dims, mc, load_cluster("dgx-a100"))


def test_a_materialized_attention_computes_every_score_and_moves_the_score_matrix():
    from trickles.planner.compute import block_work

    cfg = Config.load(None, [*TINY, "model.dropout=0.1"])
    mc = resolve_model(cfg.model, 320, 32)
    dims = ParallelDims(tp=2)
    flash = block_work(mc, dims, 4, 32, False, False, 4)
    full = block_work(mc, dims, 4, 32, False, False, 4, attention="materialized")
    att = lambda w: sum(g.flops for g in w.gemms if g.name in ("scores", "weighted"))  # noqa: E731
    assert att(full) * causal_pairs(32) == pytest.approx(att(flash) * 32 * 32, rel=1e-12)
    assert flash.attention_bytes == 0
    scores = 4 * (mc.n_heads // 2) * 32 * 32  # sequences x local heads x T x T
    assert full.attention_bytes == scores * (4 * 4 + 2 * 4 + 1)  # written, softmax, dropout and its mask, read
    assert full.elementwise_bytes == flash.elementwise_bytes + full.attention_bytes
    sets = ["parallel.tp=2", "model.dropout=0.1", "memory.recompute=selective"]
    cfg, dims, mc, _ = plan(2, *sets)
    a = step_time(cfg, dims, mc, load_cluster("local"))
    b = step_time(cfg, dims, mc, load_cluster("local"), attention="materialized")
    assert b.recompute_s > a.recompute_s and b.compute_s > a.compute_s
    with pytest.raises(ConfigError, match="attention must be one of flash, materialized"):
        step_time(cfg, dims, mc, load_cluster("local"), attention="sdpa")


def test_collectives_of_one_group_share_the_compute_they_hide_behind():
    # ZeRO-3 over 1536 A100s: the gathers and reduce-scatters of a 175B model take longer than the compute, and
    # together they cannot hide behind more than all of it
    cfg, dims, mc, st = plan(
        1536,
        "parallel.zero=3",
        "train.micro_batch=1",
        "memory.recompute=full",
        base=[*GPT3[:9], "parallel.zero=3"],
        cluster="dgx-a100",
    )
    assert st.comm_by_group["dp"] > st.compute_s
    assert st.exposed_by_group["dp"] >= (st.comm_by_group["dp"] - st.compute_s) * (1 - 1e-9)


@pytest.mark.parametrize("world,mode", [(4, "2d"), (8, "3d")])
def test_a_grid_reduce_scatters_in_backward_what_it_gathers_in_forward(world, mode):
    """The grid layers' backward reduce-scatters the gradients of the blocks its forward gathered (the ledger records
    them as reduce-scatters), so every line has as many of each; on a 2-D grid the same wire bytes."""
    from trickles.planner.traffic import grid_traffic

    cfg = Config.load(
        None, [*TINY, "model.n_heads=8", "model.n_kv_heads=8", f"parallel.tp={world}", f"parallel.tp_mode={mode}"]
    )
    dims = cfg.validate(world)
    mc = resolve_model(cfg.model, cfg.model.vocab_size or 320, cfg.data.seq_len)
    got = {(t.group, t.op): t for t in grid_traffic(rank_plans(cfg, dims, mc)[0])}
    lines = {g for g, op in got if g != "tp"}
    assert lines == ({"tp_row", "tp_col"} if mode == "2d" else {"tp_row", "tp_col", "tp_dep"})
    for line in lines:
        ag, rs = got[(line, "all_gather")], got[(line, "reduce_scatter")]
        assert ag.calls == rs.calls > 0
        if mode == "2d":
            assert ag.wire_bytes == pytest.approx(rs.wire_bytes, rel=1e-6)


def test_a_pipeline_message_is_the_stage_output_cut_by_sequence_parallelism():
    """[B, T/cp, d] in the compute type, split over tp under sequence parallelism (whole without it)."""
    for sp, split in (("true", 2), ("false", 1)):
        cfg, dims, mc, _ = plan(
            4, "parallel.pp=2", "parallel.tp=2", f"parallel.sequence_parallel={sp}", "train.micro_batch=2"
        )
        for r in rank_plans(cfg, dims, mc):
            assert r.message_bytes == 2 * cfg.data.seq_len * mc.d_model * r.p // split, (sp, r.message_bytes)


def test_the_memory_bound_estimate_counts_q_k_norms_and_the_norms_a_placement_adds():
    """A sandwich block's two extra norms read and write the residual stream (``2 r p`` each); q/k norms read and
    write q and k as rotary does; a post-norm block's linears read the residual stream, so elementwise recomputation
    reruns only the activation."""
    from trickles.planner.compute import block_work, rebuilt_bytes

    cfg = Config.load(None, TINY)
    base = resolve_model(cfg.model, 320, 32)
    dims, p, n = ParallelDims(tp=2), 4, 4 * 32
    work = lambda **kw: block_work(dataclasses.replace(base, **kw), dims, 4, 32, False, True, p)  # noqa: E731
    r, heads = n * base.d_model / 2, n * (base.n_heads + base.kv_heads) * base.head_dim / 2
    plain = work().elementwise_bytes
    assert work(norm_placement="sandwich").elementwise_bytes == plain + 2 * 2 * r * p
    assert work(norm_placement="post").elementwise_bytes == plain
    assert work(qk_norm="head").elementwise_bytes == work(qk_norm="full").elementwise_bytes == plain + 2 * heads * p
    rebuilt = lambda **kw: rebuilt_bytes(dataclasses.replace(base, **kw), dims, 4, 32, True, p)  # noqa: E731
    assert (
        rebuilt(norm_placement="post") == p * 3 * n * base.ffn_dim / 2 < rebuilt() == rebuilt(norm_placement="sandwich")
    )


def test_soft_capped_scores_are_all_computed_and_moved_through_memory():
    """Soft-capped attention runs the explicit path under any kernel: every score computed (as a materialized core)
    and its passes over the scores counted; capped logits add three passes over the rank's logits."""
    from trickles.planner.compute import attention_flops, block_work, head_work

    cfg = Config.load(None, TINY)
    base = resolve_model(cfg.model, 320, 32)
    capped = dataclasses.replace(base, attn_softcap=50.0, final_softcap=30.0)
    dims = ParallelDims(tp=2)
    plain, soft = (block_work(m, dims, 4, 32, False, False, 2) for m in (base, capped))
    scores = 4 * (base.n_heads // 2) * 32 * 32
    assert attention_flops(soft) == 4 * base.head_dim * scores
    assert soft.attention_bytes == scores * (13 * 2 + 5 + 2 + 4) and plain.attention_bytes == 0
    assert soft.elementwise_bytes == plain.elementwise_bytes + soft.attention_bytes
    heads = [head_work(m, dims, 4, 32, False, 2).elementwise_bytes for m in (base, capped)]
    assert heads[1] - heads[0] == pytest.approx(6 * 2 * 4 * 32 * 320 / 2, rel=1e-12)
