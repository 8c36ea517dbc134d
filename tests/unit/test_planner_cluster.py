"""The cluster description: presets, loading, TOML round trip, bad input, the link fit, a real (tiny) calibration."""

import dataclasses
import math
import random

import pytest
import torch

from trickles.comm import messages, wire_bytes
from trickles.config import Config
from trickles.errors import ConfigError
from trickles.planner import PRESETS, Cluster, calibrate, fit_link, load_cluster, write_cluster
from trickles.planner.calibrate_compute import _Loopback
from trickles.planner.cluster_files import cluster_from_dict
from trickles.process import cpu_cores


def test_presets_carry_the_cited_hardware_numbers():
    a100, h100, local = (load_cluster(n) for n in ("dgx-a100", "dgx-h100", "local"))
    assert (a100.devices_per_node, a100.device_memory_gib, a100.peak_tflops_bf16) == (8, 80.0, 312.0)
    assert (a100.intra_node_gbps, a100.inter_node_gbps) == (300.0, 25.0)  # NVLink 3 per direction; 200 Gb/s per GPU
    assert (h100.peak_tflops_bf16, h100.intra_node_gbps, h100.inter_node_gbps) == (989.4, 450.0, 50.0)
    assert local.device == "cpu" and local.devices_per_node == cpu_cores()
    # the local preset's guesses, as its docstring states them (loopback inside a node, a slower network across)
    assert (local.peak_tflops_fp32, local.peak_tflops_bf16, local.gemm_efficiency, local.sm_count) == (0.1, 0.1, 0.5, 0)
    assert (local.intra_node_gbps, local.intra_node_latency_us, local.inter_node_gbps, local.inter_node_latency_us) == (
        1.0,
        50.0,
        0.1,
        100.0,
    )
    for c in (a100, h100, local):
        c.validate()
        assert c.peak_flops("bf16") == c.peak_tflops_bf16 * 1e12
    assert set(PRESETS) == {"dgx-a100", "dgx-h100", "local"}
    assert load_cluster("dgx-a100") is not load_cluster("dgx-a100")  # fresh copies: changing one changes no other


@pytest.mark.parametrize("name,hint", [("dgx-a10", "dgx-a100"), ("dgx_h100", "dgx-h100"), ("locl", "local")])
def test_an_unknown_preset_suggests_the_nearest(name, hint):
    with pytest.raises(ConfigError, match=f"unknown cluster '{name}'; did you mean '{hint}'"):
        load_cluster(name)


def test_a_missing_file_and_bad_values_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cluster.intra_node_gbps must be a positive number"):
        cluster_from_dict({"preset": "dgx-a100", "intra_node_gbps": -1})
    with pytest.raises(ConfigError, match="did you mean 'cluster.inter_node_gbps'"):
        cluster_from_dict({"inter_node_gbs": 10})
    with pytest.raises(ConfigError, match="precision:MxNxK"):
        cluster_from_dict({"gemm_table": {"bf16:12x12": 0.5}})
    with pytest.raises(ConfigError, match="fraction in"):
        cluster_from_dict({"gemm_table": {"bf16:12x12x12": 1.5}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_cluster(bad)


def test_toml_round_trip(tmp_path):
    c = dataclasses.replace(
        load_cluster("dgx-h100"),
        nodes=4,
        name="my h100s",
        gemm_table={"bf16:4096x1024x4096": 0.81, "fp32:64x64x64": 0.25},
    )
    path = tmp_path / "cluster.toml"
    write_cluster(c, path)
    assert load_cluster(path) == c
    assert "# algorithm bandwidth per device per direction" in path.read_text()  # every key documented


def test_a_run_toml_may_carry_a_cluster_table_on_a_preset(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('[train]\nsteps = 3\n\n[cluster]\npreset = "dgx-a100"\nnodes = 16\ninter_node_gbps = 50.0\n')
    c = load_cluster(run)
    assert (c.name, c.nodes, c.devices, c.inter_node_gbps, c.intra_node_gbps) == ("dgx-a100", 16, 128, 50.0, 300.0)
    assert Config.load(run).train.steps == 3  # the run itself ignores the table


def test_links_gemm_table_and_sizing():
    c = dataclasses.replace(load_cluster("dgx-a100"), gemm_table={"bf16:4096x4096x4096": 0.9, "bf16:128x128x128": 0.2})
    assert c.link(False).bandwidth_Bps == 300e9 * 0.8 and c.link(True).bandwidth_Bps == 25e9 * 0.8
    assert c.link(True).time(2, 20e9) == pytest.approx(2 * 5e-6 + 1.0)
    assert c.gemm_fraction("bf16", 4096, 4096, 4096) == 0.9
    assert c.gemm_fraction("bf16", 4096, 2048, 4096) == 0.9  # nearest calibrated shape
    assert c.gemm_fraction("bf16", 160, 128, 100) == 0.2
    # nothing within a factor of 8, or another precision: the efficiency times the tile and wave quantization
    assert c.gemm_fraction("fp16", 4096, 4096, 4096) == c.gemm_efficiency * (4096 * 4096) / (
        5 * 108 * 256 * 128
    )  # 512 tiles: 5 waves
    assert c.gemm_fraction("bf16", 8, 8, 8) == c.gemm_efficiency * 64 / (108 * 256 * 128)  # one tile of 108 busy
    assert c.quantization(108 * 256, 128) == 1.0 and c.quantization(108 * 256 + 1, 128) < 0.51  # a second wave
    assert c.quantization(256, 128, 107.5) == 1.0  # a batch of 108 tiles fills one wave
    assert load_cluster("local").quantization(7, 9) == 1.0 and load_cluster("local").sm_count == 0
    assert c.sized(1024).nodes == 128 and c.sized(12).nodes == 2
    local = load_cluster("local")
    assert local.compute_share(local.devices_per_node) == 1.0
    assert local.compute_share(4 * local.devices_per_node) == 0.25  # more ranks than cores share them


@pytest.mark.parametrize("alpha,bandwidth", [(20e-6, 2e9), (2e-6, 300e9), (0.0, 1e9)])
def test_the_link_fit_recovers_latency_and_bandwidth(alpha, bandwidth):
    samples = [
        (messages(op, n), wire_bytes(op, size, n), 0.0)
        for op in ("all_reduce", "all_gather", "send")
        for n in (2, 4)
        for size in (1e3, 1e5, 1e7)
    ]
    exact = [(m, w, m * alpha + w / bandwidth) for m, w, _ in samples]
    got_alpha, got_bw = fit_link(exact)
    assert got_alpha == pytest.approx(alpha, abs=1e-12) and got_bw == pytest.approx(bandwidth, rel=1e-9)
    rng = random.Random(0)
    noisy = [(m, w, t * (1 + rng.uniform(-0.03, 0.03))) for m, w, t in exact]
    got_alpha, got_bw = fit_link(noisy)
    assert got_bw == pytest.approx(bandwidth, rel=0.05)
    assert got_alpha == pytest.approx(alpha, rel=0.2, abs=2e-7)


def test_the_link_fit_never_goes_negative():
    alpha, bw = fit_link([(1, 1e6, 1e-3), (1, 2e6, 2.2e-3)])  # a negative intercept: refit through zero
    assert alpha == 0.0 and bw == pytest.approx(5e12 / 5.4e3)  # sum w^2 / sum w t
    assert fit_link([(2, 0, 1e-4)]) == (5e-5, float("inf"))  # latency only


def test_a_real_calibration_of_this_machine_gives_positive_finite_numbers(tmp_path):
    path = tmp_path / "local.toml"
    from trickles.models.config import resolve_model
    from trickles.planner.calibrate import attention_shapes, pass_gemm_shapes, pass_sizes

    cfg = Config.load(None, ["model.preset=tiny", "data.seq_len=32", "train.global_batch=2", "model.moe_experts=2"])
    mc = resolve_model(cfg.model, 320, 32)
    c = calibrate(
        cfg,
        mc,
        shapes=[(32, 48, 16)],
        ranks=2,
        sizes=(1024, 16384),
        repeats=2,
        reference=64,
        bandwidth_mib=4,
        path=str(path),
    )
    assert isinstance(c, Cluster) and c.name == "local-calibrated"
    for value in (
        c.peak_tflops_fp32,
        c.memory_bandwidth_gbps,
        c.intra_node_gbps,
        c.intra_node_latency_us,
        *c.gemm_table.values(),
        *c.attention_table.values(),
    ):
        assert value > 0 and math.isfinite(value)
    passes = pass_gemm_shapes(mc, pass_sizes(cfg))  # the block's and head's, at the sizes their passes are timed
    assert pass_sizes(cfg) == [(1, 16), (1, 32), (2, 32)]
    assert set(c.gemm_table) == {"fp32:32x48x16", "fp32:64x64x64", *(f"fp32:{m}x{n}x{k}" for m, n, k in passes)}
    assert max(c.gemm_table.values()) == 1.0
    assert attention_shapes(cfg, mc) == [(2, mc.n_heads, 32, 32, mc.head_dim)]
    assert set(c.attention_table) == {f"fp32:32x32x{mc.head_dim}"}  # the fused kernel, timed at the run's shape
    assert c.attention_fraction("fp32", 32, 32, mc.head_dim) == c.attention_table[f"fp32:32x32x{mc.head_dim}"]
    assert c.elementwise_gbps > 0 and c.pass_overhead_us >= 0  # the model's own block and head, timed and fitted
    assert c.moe_pass_overhead_us >= 0 and math.isfinite(c.moe_pass_overhead_us)  # and its MoE block
    base = load_cluster("local")  # one node measured: the link to another node is kept no faster than this one's
    assert c.inter_node_gbps == min(base.inter_node_gbps, c.intra_node_gbps)
    assert c.inter_node_latency_us == max(base.inter_node_latency_us, c.intra_node_latency_us)
    assert load_cluster(path) == c


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_parallel_attention_is_calibrated_as_it_runs(mode):
    """Ring: the rank's T/cp queries against all T keys (its blocks and merges timed through the ring itself);
    all-to-all: whole sequences on 1/cp of the heads. The time model looks up exactly the shape calibrated."""
    from trickles.models.config import resolve_model
    from trickles.planner.calibrate import attention_shapes, measure_attention
    from trickles.planner.compute import block_work, causal_pairs
    from trickles.topology import ParallelDims

    cfg = Config.load(
        None,
        ["model.preset=tiny", "data.seq_len=32", "train.global_batch=2", "parallel.cp=2", f"parallel.cp_mode={mode}"],
    )
    mc = resolve_model(cfg.model, 320, 32)
    dims = ParallelDims(cp=2)
    [(b, h, q, k, d)] = attention_shapes(cfg, mc, dims)
    assert (b, h, q, k, d) == (
        (2, mc.n_heads, 16, 32, mc.head_dim) if mode == "ring" else (2, mc.n_heads // 2, 32, 32, mc.head_dim)
    )
    scores = next(g for g in block_work(mc, dims, 2, 32, False, False, 4, cp_mode=mode).gemms if g.name == "scores")
    assert (scores.m, scores.n, scores.k) == (q, k, d)
    assert scores.count == pytest.approx(b * h * causal_pairs(32) / 32**2, rel=1e-12)  # the entries the mask leaves
    rate = measure_attention([(b, h, q, k, d)], repeats=1)
    assert list(rate) == [(q, k, d)] and 0 < rate[(q, k, d)] < math.inf


def test_the_pass_fit_recovers_element_wise_bandwidth_and_overhead():
    """Block and head times made of their GEMMs on the cluster, a fixed cost and element-wise bytes at a bandwidth:
    :func:`fit_passes` gives both back; with no fixed cost in the times, the bandwidth alone."""
    from trickles.models.config import resolve_model
    from trickles.planner.calibrate import fit_passes
    from trickles.planner.compute import block_work, head_work
    from trickles.planner.cost import work_seconds
    from trickles.topology import ParallelDims

    cfg = Config.load(None, ["model.preset=tiny", "data.seq_len=64"])
    mc = resolve_model(cfg.model, 320, 64)
    c = load_cluster("local")
    for overhead in (2e-4, 0.0):
        passes = {}
        for b, t in ((1, 16), (1, 64), (2, 64), (4, 64)):  # a tiny pass (the fixed cost) and three of the run's
            works = block_work(mc, ParallelDims(), b, t, False, False, 4), head_work(mc, ParallelDims(), b, t, False, 4)
            passes[(b, t)] = tuple(
                3 * work_seconds(w, c, "fp32", 1.0)[0] + overhead + 3 * w.elementwise_bytes / 3e9 for w in works
            )
        bw, o = fit_passes(c, mc, passes, "fp32")
        assert bw == pytest.approx(3e9, rel=1e-6) and o == pytest.approx(overhead, abs=1e-9)
    passes[(1, 16)] = (1.0, 1.0)  # a GPU's tiny pass is launch-bound: not fitted, no fixed cost
    assert fit_passes(c, mc, passes, "fp32", overhead=False) == (pytest.approx(3e9, rel=1e-6), 0.0)
    del passes[(1, 16)]  # no tiny pass: no fixed cost to pin, the bandwidth alone
    assert fit_passes(c, mc, passes, "fp32") == (pytest.approx(3e9, rel=1e-6), 0.0)


def test_an_moe_blocks_extra_fixed_cost_is_fitted_from_its_tiny_pass():
    """An MoE block's times: its GEMMs, its element-wise bytes at the fitted bandwidth, a dense pass's fixed cost and
    an extra one; :func:`fit_moe_pass` gives the extra back (and the dense fit is untouched by the third timing)."""
    from trickles.models.config import resolve_model
    from trickles.planner.calibrate import fit_moe_pass, fit_passes
    from trickles.planner.calibrate_compute import _pass_work
    from trickles.planner.cost import work_seconds

    cfg = Config.load(None, ["model.preset=tiny", "data.seq_len=64", "model.moe_experts=4", "model.moe_top_k=2"])
    mc = resolve_model(cfg.model, 320, 64)
    c = dataclasses.replace(load_cluster("local"), elementwise_gbps=3.0, pass_overhead_us=200.0)
    passes = {}
    for b, t in ((1, 16), (1, 64), (2, 64)):
        works = _pass_work(mc, b, t, 4)
        assert len(works) == 3  # block, head, MoE block
        passes[(b, t)] = tuple(
            3 * sum(work_seconds(w, c, "fp32", 1.0)) + 2e-4 + (5e-4 if i == 2 else 0.0) for i, w in enumerate(works)
        )
    assert fit_moe_pass(c, mc, passes, "fp32") == pytest.approx(5e-4, rel=1e-6)
    assert fit_passes(c, mc, passes, "fp32") == (pytest.approx(3e9, rel=1e-6), pytest.approx(2e-4, rel=1e-6))
    assert fit_moe_pass(c, mc, {k: v for k, v in passes.items() if k != (1, 16)}, "fp32") == 0.0  # nothing tiny


def test_a_collective_kind_the_shared_line_misses_gets_its_own_line(tmp_path):
    from trickles.planner.calibrate import cluster_from_measurements, fit_links

    line = {"all_reduce": (50e-6, 1e9), "all_gather": (50e-6, 1e9), "reduce_scatter": (200e-6, 0.4e9)}
    timings = [
        (op, 4, size, messages(op, 4) * a + wire_bytes(op, size, 4) / b)
        for op, (a, b) in line.items()
        for size in (4096, 65536, 1 << 20, 4 << 20)
    ]
    (alpha, bw), own = fit_links(timings)
    assert set(own) == {"reduce_scatter"}  # the ring-like kinds share one line, the slow one does not
    assert own["reduce_scatter"][0] == pytest.approx(200e-6, rel=1e-6)
    assert own["reduce_scatter"][1] == pytest.approx(0.4e9, rel=1e-6)
    c = cluster_from_measurements("local", "fp32", {(64, 64, 64): 1e10}, 1e10, timings, (64, 64, 64))
    assert set(c.collective_links) == {"reduce_scatter"}
    rs, ar = c.link(False, "reduce_scatter"), c.link(False, "all_reduce")
    assert rs.time(3, 3 << 20) == pytest.approx(3 * 200e-6 + (3 << 20) / 0.4e9, rel=1e-3)
    assert (ar.latency_s, ar.bandwidth_Bps) == (c.link(False).latency_s, c.link(False).bandwidth_Bps)
    assert c.link(True, "reduce_scatter").name == "inter-node"  # measured on one node: the inter-node line stays one
    path = tmp_path / "c.toml"
    write_cluster(c, path)
    assert "[cluster.collective_links]" in path.read_text() and load_cluster(path) == c
    assert load_cluster("dgx-a100").collective_links == {}  # presets: one line per link


def test_a_bad_collective_line_is_refused():
    with pytest.raises(ConfigError, match="unknown collective 'all_reduse'"):
        cluster_from_dict({"collective_links": {"all_reduse": [10.0, 1.0]}})
    with pytest.raises(ConfigError, match=r"must be \[latency_us >= 0, GB/s > 0\]"):
        cluster_from_dict({"collective_links": {"send": [10.0, 0.0]}})


def _measured_with_fixed_timings():
    """``calibrate.measure_on_ranks`` on this rank with every timing replaced by a fixed one that grows with the rank
    (rank r: GEMMs (r+1) GFLOP/s, bandwidth 10 (r+1) GB/s, a block pass 0.1 (r+1) s and the head's 0.01 (r+1) s) and
    2 cores under the 3 ranks."""
    import importlib

    import torch.distributed as dist

    import trickles.process

    module = importlib.import_module("trickles.planner.calibrate")  # the package exports a function of that name
    r = dist.get_rank()
    fakes = {
        "measure_gemms": lambda shapes, *a: {tuple(s): 1e9 * (r + 1) for s in shapes},
        "measure_passes": lambda cfg, sizes, *a: {tuple(s): (0.1 * (r + 1), 0.01 * (r + 1)) for s in sizes},
        "measure_memory_bandwidth": lambda *a: 1e10 * (r + 1),
        "_measure_collectives": lambda *a: [],
        "measure_sync": lambda *a: 0.0,
    }
    saved = {name: getattr(module, name) for name in fakes}
    cores = trickles.process.cpu_cores
    try:
        for name, fake in fakes.items():
            setattr(module, name, fake)
        trickles.process.cpu_cores = lambda: 2
        return module.measure_on_ranks([(8, 8, 8)], model_cfg="a model", pass_sizes=[(1, 32)])
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        trickles.process.cpu_cores = cores


def test_measurements_on_ranks_are_the_median_rate_per_core():
    """Every rank gets the same result: the median over the ranks of each rate (a pass's time as its rate, 1 / s),
    times the ranks per core (3 on 2 cores: 1.5) -- GEMMs 2 x 1.5 GFLOP/s, bandwidth 20 x 1.5 GB/s, the block pass
    0.2 s / 1.5 and the head's 0.02 s / 1.5 -- and the contention, the block pass per core over rank 0's alone
    (0.1 s): (0.2 / 1.5) / 0.1."""
    from trickles.testing import run_ranks

    results = run_ranks(3, _measured_with_fixed_timings)
    assert results[0] == results[1] == results[2]
    got = results[0]
    assert got["gemms"] == {(8, 8, 8): pytest.approx(3e9)} and got["bandwidth"] == pytest.approx(3e10)
    assert got["passes"] == {(1, 32): pytest.approx((0.2 / 1.5, 0.02 / 1.5))}
    assert got["contention"] == pytest.approx(0.2 / 1.5 / 0.1) and got["attention"] == {} and got["links"] == []


def test_the_attention_calibrations_loopback_ring_receives_what_it_sends():
    """The ring attention timed for calibration exchanges through a loopback: each receive gets the block sent in the
    same batch (so the timed blocks hold real values, not whatever the receive buffers held)."""
    sent, got, other = torch.randn(4, 3), torch.full((4, 3), float("nan")), torch.full((4, 3), float("nan"))
    assert _Loopback(4).batch_p2p([("recv", got, 3), ("send", sent, 1), ("recv", other, 3)]) == []
    assert torch.equal(got, sent) and torch.equal(other, sent)
