"""Loss scaler rules, activation formulas against the saved-tensor meter, recomputation exactness."""

import dataclasses

import pytest
import torch
from helpers import tiny_config

from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.memory.scaler import DynamicLossScaler
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer


def test_scaler_backs_off_with_hysteresis_grows_and_has_a_floor():
    s = DynamicLossScaler(scale=1024, growth_interval=3, hysteresis=2, min_scale=256)
    s.update(overflow=True)
    assert s.scale == 1024  # the first overflow is tolerated
    s.update(overflow=True)
    assert s.scale == 512
    s.update(overflow=True)
    assert s.scale == 256
    s.update(overflow=True)
    assert s.scale == 256 and s.at_minimum  # never below the minimum
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 256
    s.update(overflow=False)
    assert s.scale == 512  # three good steps in a row
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state


def _trainer(tmp, *overrides, steps=3):
    return Trainer(tiny_config(tmp, *overrides, steps=steps), ParallelDims().build(torch.device("cpu")), quiet=True)


@pytest.mark.parametrize("flavor", ["tiny", "gpt2-tiny"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_gives_identical_losses_and_weights(tmp_path, flavor, precision):
    results = {}
    for mode in ("none", "elementwise", "selective", "full"):
        tr = _trainer(
            tmp_path,
            f"model.preset={flavor}",
            "model.dropout=0.1",
            f"memory.precision={precision}",
            f"memory.recompute={mode}",
        )
        losses = [tr.train_step()["loss"] for _ in range(3)]
        results[mode] = losses, tr.engine.full_state(), tr.evaluate()  # evaluation: no graph, nothing recomputed
    for mode in ("elementwise", "selective", "full"):
        assert results[mode][0] == results["none"][0], mode  # bit for bit, dropout included
        assert results[mode][2] == results["none"][2] is not None, mode
        for name, w in results[mode][1].items():
            assert torch.equal(w, results["none"][1][name]), (mode, name)


# One case per idea: each flavor in each precision (their norms and rotary tables keep different
# tensors), two shapes that tell tokens per sequence (seq) from tokens per micro-batch (batch x seq).
_ACTIVATION_CASES = [
    ("tiny", "fp32", 32, 2),
    ("tiny", "bf16", 64, 4),
    ("gpt2-tiny", "fp32", 64, 4),
    ("gpt2-tiny", "bf16", 32, 2),
]


@pytest.mark.parametrize(
    "flavor,precision,seq,batch", _ACTIVATION_CASES, ids=[f"{f}-{p}-{s}x{b}" for f, p, s, b in _ACTIVATION_CASES]
)
def test_activation_prediction_matches_measurement(tmp_path, flavor, precision, seq, batch):
    """The formula counts every byte autograd saves: equal per layer and for the head, in each recompute mode."""
    measured = {}
    for mode in ("none", "elementwise", "selective", "full"):
        tr = _trainer(
            tmp_path,
            f"model.preset={flavor}",
            f"memory.precision={precision}",
            f"memory.recompute={mode}",
            f"data.seq_len={seq}",
            f"train.micro_batch={batch}",
            f"train.global_batch={batch}",
        )
        x, y = tr.train_data.micro_batches(0, batch, batch)[0]
        with ActivationMeter(tr.model) as meter:
            loss = tr._loss(x, y)
        loss.backward()
        predicted = activation_bytes(tr.model_cfg, batch, seq, mode, 2 if precision == "bf16" else 4)
        layers = [f"layers.{i}" for i in range(tr.model_cfg.n_layers)]
        assert sorted(meter.per_layer) == sorted(["head", *layers]), meter.per_layer
        assert not any(b._forward_pre_hooks or b._forward_hooks for b in tr.model.layers.values()), (
            "the meter left its hooks"
        )
        for name in layers:
            assert meter.per_layer[name] == predicted["layer"], (mode, name, meter.per_layer[name] - predicted["layer"])
        assert meter.per_layer["head"] == predicted["head"], (mode, meter.per_layer["head"] - predicted["head"])
        measured[mode] = meter.per_layer["layers.0"]
    assert measured["full"] < measured["elementwise"] < measured["none"]
    assert measured["full"] < measured["selective"] < measured["none"]


@pytest.mark.parametrize("qk,placement,precision", [("head", "sandwich", "fp32"), ("full", "post", "bf16")])
def test_q_k_norms_and_norm_placements_are_counted_in_every_recompute_mode(tmp_path, qk, placement, precision):
    """Each q/k norm keeps its input and fp32 ``1/rms``, each post norm its input and ``1/rms``; without pre norms the
    linears keep the residual stream itself, which elementwise recomputation leaves kept (no recipe for it)."""
    for mode in ("none", "elementwise", "selective", "full"):
        tr = _trainer(
            tmp_path,
            f"model.qk_norm={qk}",
            f"model.norm_placement={placement}",
            f"memory.precision={precision}",
            f"memory.recompute={mode}",
            "train.micro_batch=2",
            "train.global_batch=2",
        )
        x, y = tr.train_data.micro_batches(0, 2, 2)[0]
        with ActivationMeter(tr.model) as meter:
            tr._loss(x, y).backward()
        predicted = activation_bytes(tr.model_cfg, 2, 32, mode, 2 if precision == "bf16" else 4)
        for i in range(tr.model_cfg.n_layers):
            assert meter.per_layer[f"layers.{i}"] == predicted["layer"], (mode, meter.per_layer, predicted["layer"])
        assert sum(predicted["terms"].values()) == predicted["layer"]


# Mixture-of-experts blocks (layer 1 of 2; layer 0 stays dense): llama in fp32 with top-2 and a shared expert, in every
# recompute mode; gpt2 in bf16 with top-1 (no renormalization, the norm's output kept by nobody but the router's copy).
MOE = [
    "model.n_layers=2",
    "model.moe_every=2",
    "model.moe_experts=4",
    "data.seq_len=32",
    "train.micro_batch=2",
    "train.global_batch=2",
]
_MOE_CASES = [("tiny", "fp32", 2, 1, ("none", "selective", "full")), ("gpt2-tiny", "bf16", 1, 0, ("none",))]


def _moe_forward(tmp, *overrides):
    """A fresh MoE trainer's saved activations over one micro-batch: (trainer, meter)."""
    tr = _trainer(tmp, *MOE, *overrides)
    x, y = tr.train_data.micro_batches(0, 2, 2)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    return tr, meter


@pytest.mark.parametrize(
    "flavor,precision,k,shared,modes", _MOE_CASES, ids=[f"{c[0]}-{c[1]}-top{c[2]}-shared{c[3]}" for c in _MOE_CASES]
)
def test_moe_activation_prediction_matches_measurement(tmp_path, flavor, precision, k, shared, modes):
    """Dropless routing: the router's fp32 tensors, the routing indices and masks, the gathered rows, each expert's
    MLP on its rows, the weighting, the shared expert and the auxiliary losses, counted to the byte, per layer --
    dense and MoE layers each by their own formula."""
    for mode in modes:
        tr, meter = _moe_forward(
            tmp_path,
            f"model.preset={flavor}",
            f"memory.precision={precision}",
            f"memory.recompute={mode}",
            f"model.moe_top_k={k}",
            f"model.moe_shared_experts={shared}",
        )
        predicted = activation_bytes(tr.model_cfg, 2, 32, mode, 2 if precision == "bf16" else 4)
        measured = [meter.per_layer[f"layers.{i}"] for i in range(2)]
        assert measured == predicted["per_layer"] == [predicted["layer"], predicted["moe_layer"]], (
            mode,
            measured,
            predicted,
        )
        assert meter.per_layer["head"] == predicted["head"], mode
        assert mode == "full" or predicted["moe_layer"] > predicted["layer"], mode  # the formulas do differ


def test_deepseek_and_qwen2_routing_parts_are_counted(tmp_path):
    """DeepSeek's router (sigmoid scores normalized for the balancing loss, a routing bias, group-limited choice, a
    routed scale) and Qwen2-MoE's gated shared expert, to the byte: the sum the scores are divided by, and the
    product with the gate (the shared experts' output and the gate)."""
    for extra in (
        [
            "model.moe_router_score=sigmoid",
            "model.moe_groups=2",
            "model.moe_topk_groups=1",
            "model.moe_routed_scale=2.5",
            "model.moe_bias_rate=0.001",
        ],
        ["model.moe_shared_experts=1", "model.moe_shared_gate=true"],
    ):
        tr, meter = _moe_forward(tmp_path, "model.moe_top_k=2", *extra)
        predicted = activation_bytes(tr.model_cfg, 2, 32, "none", 4)
        assert [meter.per_layer[f"layers.{i}"] for i in range(2)] == predicted["per_layer"], extra


def test_moe_capacity_prediction_bounds_the_kept_rows(tmp_path):
    """With capacity the kept assignments depend on the routes: the prediction assumes every expert full
    (``m = min(k s, S E C)``), no less than measured; given the kept count the formula is exact."""
    from trickles.memory.moe_activations import moe_bytes

    tr, meter = _moe_forward(tmp_path, "model.moe_top_k=2", "model.moe_capacity_factor=0.5")  # C = 8 of a sequence's 64
    cfg = tr.model_cfg
    predicted = activation_bytes(cfg, 2, 32)
    kept = int(tr.moe_stats.load[1].sum())
    assert kept <= 2 * 4 * 8 < 2 * 2 * 32  # capacity binds: at most E C per sequence
    assert meter.per_layer["layers.1"] <= predicted["moe_layer"]
    mlp = 3 * 4 * 2 * 32 * cfg.ffn_dim  # the dense MLP the block replaces (gate, up, product)
    exact = predicted["layer"] - mlp + moe_bytes(cfg, 2, 32, 32, assignments=kept)
    assert meter.per_layer["layers.1"] == exact
    assert predicted["moe_layer"] == predicted["layer"] - mlp + moe_bytes(cfg, 2, 32, 32, assignments=2 * 4 * 8)


def test_activation_formula_scales_with_tokens_and_mode():
    from trickles.models import ModelConfig, apply_preset

    cfg = dataclasses.replace(apply_preset(ModelConfig(), "llama-125m"), max_seq_len=2048)
    a = activation_bytes(cfg, 1, 1024)
    assert activation_bytes(cfg, 2, 1024)["layer"] == 2 * a["layer"]
    assert activation_bytes(cfg, 1, 1024, "full")["layer"] == 1024 * 768 * 4
    bf16 = activation_bytes(cfg, 1, 1024, dtype_bytes=2)
    assert bf16["layer"] < a["layer"]


def test_report_note_names_only_the_dimensions_in_use(tmp_path):
    """The report's first note states the layout: at one process no tensor- or context-parallel clause."""
    from trickles.memory.report import predict

    tr = _trainer(tmp_path)
    cfg, mc = tr.cfg, tr.model_cfg
    note = predict(cfg, ParallelDims(), mc).notes[0]
    total = sum(p.numel() for p in tr.model.parameters())
    assert note == (
        f"{total / 1e6:.1f}M parameters, dp=1, ZeRO-0, fp32 (gradients fp32), micro-batch "
        f"{cfg.train.micro_batch or cfg.train.global_batch} x {cfg.data.seq_len}, recompute none"
    )
    tp2 = predict(cfg, ParallelDims(tp=2), mc).notes[0]
    assert ", tp=2 (" in tp2 and ", cp=" not in tp2


def test_a_fresh_scaler_grows_after_exactly_growth_interval_good_steps():
    s = DynamicLossScaler(scale=8, growth_interval=3)
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 8
    s.update(overflow=False)
    assert s.scale == 16
    for _ in range(2):  # and again after exactly growth_interval more
        s.update(overflow=False)
    assert s.scale == 16
    s.update(overflow=False)
    assert s.scale == 32


def test_measure_runs_the_steps_it_is_asked_for(tmp_path):
    from trickles.memory.report import measure, predict

    tr = _trainer(tmp_path)
    measure(tr, predict(tr.cfg, ParallelDims(), tr.model_cfg), steps=2)
    assert tr.step == 2


def test_live_tensor_bytes_counts_storages_once_on_the_device_asked():
    from trickles.memory.accounting import live_tensor_bytes

    before_cpu, before_other = live_tensor_bytes("cpu"), live_tensor_bytes("cuda")
    t = torch.zeros(1000)
    views = [t[:10], t.view(10, 100)]  # views share the storage: counted once
    assert live_tensor_bytes("cpu") - before_cpu == 4000
    assert live_tensor_bytes("cuda") == before_other  # another device's filter leaves the new CPU tensor out
    assert live_tensor_bytes() >= live_tensor_bytes("cpu")
    del t, views
    # a fake tensor (torch.compile's tracing leaves some in its caches) reports a storage but holds no memory: a
    # 64 MiB one left by an earlier test in a pool process once made the memory report's check see 64 MiB too many
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(1024, 128, 128)
    assert fake.untyped_storage().nbytes() == 64 << 20 and live_tensor_bytes("cpu") == before_cpu


def test_only_zero2_adds_two_gradient_buckets_to_the_transient_bytes(tmp_path):
    """ZeRO-2 reduces a bucket-sized gradient buffer at a time, two in flight (``MAX_INFLIGHT``): the report adds
    ``2 x min(bucket, all gradients)`` to the transient bytes at stage 2, and at stage 1 when it does not accumulate
    micro-batches (it then reduces as stage 2 does), only (stage 3's gathered blocks aside). Micro-batches of one
    sequence throughout, so that the loss's transient is the same in every case."""
    from trickles.memory.report import predict
    from trickles.parallel.data.zero import MAX_INFLIGHT

    tr = _trainer(tmp_path)
    n = sum(p.numel() for p in tr.model.parameters())
    transient = {}
    for stage, mb, accumulate in ((0, 0.01, True), (1, 0.01, True), (1, 0.01, False), (2, 0.01, True), (2, 0, True)):
        train = dataclasses.replace(tr.cfg.train, micro_batch=1, global_batch=4 if accumulate else 2)
        cfg = dataclasses.replace(
            tr.cfg, parallel=dataclasses.replace(tr.cfg.parallel, zero=stage, bucket_mb=mb), train=train
        )
        assert cfg.accumulates(ParallelDims(dp=2)) == accumulate
        transient[stage, mb, accumulate] = predict(cfg, ParallelDims(dp=2), tr.model_cfg).predicted["transient"]
    assert transient[0, 0.01, True] == transient[1, 0.01, True]
    assert transient[2, 0.01, True] - transient[1, 0.01, True] == pytest.approx(MAX_INFLIGHT * 0.01 * 2**20, abs=1e-6)
    assert transient[1, 0.01, False] == transient[2, 0.01, True]
    assert transient[2, 0, True] - transient[1, 0.01, True] == MAX_INFLIGHT * 4 * n  # one bucket: all gradients


def test_report_table_marks_the_mixture_of_experts_layers(tmp_path):
    """Beside a measurement, the per-layer rows name the MoE blocks (every second block here)."""
    from trickles.memory.report import predict

    tr = _trainer(tmp_path, "model.n_layers=4", "model.moe_experts=4", "model.moe_every=2")
    rep = predict(tr.cfg, ParallelDims(), tr.model_cfg)
    rep.layers_measured = list(rep.layers_predicted)
    rows = [line.split("  ")[0] for line in rep.table().splitlines() if line.startswith("layer ")]
    assert rows == ["layer 0", "layer 1 (MoE)", "layer 2", "layer 3 (MoE)"], rows


def test_expert_parallel_adds_the_rows_in_flight_to_the_transient_bytes(tmp_path):
    """ep=2 (dropless top-2): the report adds the rows one all-to-all sends and receives, ``2 p m d`` with ``m`` the
    assignments of the rank's tokens in a micro-batch (``micro x seq x k``), to the transient bytes of dp=2."""
    from trickles.memory.report import predict

    tr = _trainer(tmp_path, "model.moe_experts=4", "model.moe_top_k=2")
    micro, _ = tr.cfg.batch_plan(2)
    got = {ep: predict(tr.cfg, ParallelDims(dp=2, ep=ep), tr.model_cfg).predicted["transient"] for ep in (1, 2)}
    assert got[2] - got[1] == 2 * 4 * (micro * tr.cfg.data.seq_len * 2) * tr.model_cfg.d_model


def test_report_sizes_switch_unit_at_each_power_of_1024():
    from trickles.memory.report import _fmt

    assert [_fmt(v) for v in (None, 1023, 1024, 2**20 - 1, 2**20, 2**30, -(2**20))] == [
        "-",
        "1,023 B",
        "1.00 KiB",
        "1,024.00 KiB",
        "1.00 MiB",
        "1.00 GiB",
        "-1.00 MiB",
    ]


def test_profiling_silences_stderr_and_gives_the_same_stderr_back(tmp_path):
    """While the profiler starts and stops, file descriptor 2 points at the null device; afterwards at the very file
    it pointed at before (not at some other open descriptor)."""
    import os

    from trickles.memory.accounting import _quiet_stderr

    before = os.fstat(2)
    spare = open(tmp_path / "other", "w")  # another open descriptor beside 0-2
    try:
        with _quiet_stderr():
            assert os.path.samestat(os.fstat(2), os.stat(os.devnull))
        after = os.fstat(2)
    finally:
        spare.close()
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)


@pytest.mark.parametrize("ep", [2, 4])
def test_a_rank_model_holds_its_share_of_the_experts(ep):
    """Expert parallelism over ``ep`` ranks: the meta model a rank's memory is counted on holds ``E / ep`` experts of
    each MoE block (at ep = 2 as at 4), and the rest of the model whole."""
    from trickles.memory.meta import rank_model
    from trickles.models.config import ModelConfig
    from trickles.models.presets import apply_preset

    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), "tiny"), moe_experts=4, moe_every=2, vocab_size=256, max_seq_len=32
    )
    whole = dict(rank_model(cfg, ParallelDims(), False, 0, torch.float32).named)
    part = dict(rank_model(cfg, ParallelDims(dp=ep, ep=ep), False, 0, torch.float32).named)
    assert whole.keys() == part.keys() and any(".experts." in n for n in whole)
    for name, p in whole.items():
        experts = ".experts." in name
        assert part[name].shape == ((p.shape[0] // ep, *p.shape[1:]) if experts else p.shape), name


def test_partial_full_recomputation_keeps_each_layer_as_its_mode(tmp_path):
    """memory.recompute_num_layers=1 of 2 layers: layer 0 keeps its input only (full), layer 1 what elementwise
    keeps, as the report predicts per layer; losses, weights and evaluation bit for bit those without recomputation."""
    from trickles.memory.tp_modes import activations
    from trickles.parallel.tensor.layout import Layout

    partial = ["memory.recompute=full", "memory.recompute_num_layers=1", "memory.recompute_rest=elementwise"]
    tr = _trainer(tmp_path, "model.dropout=0.1", *partial)
    assert tr.cfg.memory.describe() == "full for the first layer of each rank, elementwise for the rest"
    assert tr.cfg.memory.uniform("none").layer_modes([[0, 1]]) == {0: "none", 1: "none"}  # what "without" counts
    x, y = tr.train_data.micro_batches(0, tr.cfg.train.global_batch, tr.micro_batch)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    tr.engine.zero_grad()
    dims = tr.topo.dims
    predicted = activations(tr.cfg, tr.model_cfg, Layout.of("1d", 1), dims)
    each = {m: activation_bytes(tr.model_cfg, tr.micro_batch, tr.cfg.data.seq_len, m) for m in ("full", "elementwise")}
    assert (
        [meter.per_layer["layers.0"], meter.per_layer["layers.1"]]
        == predicted["per_layer"]
        == [each["full"]["per_layer"][0], each["elementwise"]["per_layer"][1]]
    )
    assert meter.per_layer["head"] == predicted["head"]
    results = {}
    for name, extra in (("none", []), ("partial", partial)):
        t = _trainer(tmp_path, "model.dropout=0.1", *extra)
        results[name] = [t.train_step()["loss"] for _ in range(3)], t.engine.full_state(), t.evaluate()
    assert results["partial"][0] == results["none"][0] and results["partial"][2] == results["none"][2]
    for n, w in results["partial"][1].items():
        assert torch.equal(w, results["none"][1][n]), n
