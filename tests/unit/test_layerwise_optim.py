"""LAMB and LARS against the papers' update written out here in fp64, against torch-optimizer's Lamb, and the norm
provider that lets a rank holding pieces of weights (ZeRO segments, experts) see every whole weight's norm."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config

from trickles.errors import CheckpointError, ConfigError
from trickles.models import build_model
from trickles.optim import Lamb, Lars, decay_flags
from trickles.parallel.data.flat import FlatLayout
from trickles.parallel.norms import ShardNorms
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 10
LRS = [0.02 * (1 + s) / 3 if s < 3 else 0.02 * (1 - (s - 3) / 10) ** 2 for s in range(STEPS)]  # warm-up, poly decay


def _problem(seed=0):
    """Three weights and their gradients for every step: a matrix (adapted, decayed), a matrix starting at zero
    (adapted: ||w|| = 0 gives ratio 1) whose gradient vanishes at step 4 (LARS: ||g|| = 0 gives ratio 1 too), and a
    bias (neither adapted nor decayed). fp64."""
    g = torch.Generator().manual_seed(seed)
    weights = [
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.zeros(4, 3, dtype=torch.float64),
        torch.randn(5, generator=g, dtype=torch.float64),
    ]
    grads = []
    for s in range(STEPS):
        step = [torch.randn(w.shape, generator=g, dtype=torch.float64) * 0.1 for w in weights]
        if s == 4:
            step[1].zero_()
        grads.append(step)
    return weights, grads, [True, True, False]


def _run(make, weights, grads, adapt, wd, plain=False):
    """``make(groups)`` stepped over the problem: each adapted weight in a group of its own (so the optimizer finds each
    group's norms in the right place among all of them), the rest in one non-adapted group; ``plain``: one bare list
    of parameters and ``weight_decay`` left to ``make`` (the optimizer's defaults: every weight adapted)."""
    ps = [torch.nn.Parameter(w.clone()) for w in weights]
    groups = [{"params": [p], "weight_decay": wd, "adapt": True} for p, a in zip(ps, adapt) if a]
    groups.append({"params": [p for p, a in zip(ps, adapt) if not a], "weight_decay": 0.0, "adapt": False})
    opt = make(ps if plain else groups)
    for s in range(STEPS):
        for p, gr in zip(ps, grads[s]):
            p.grad = gr.clone()
        for group in opt.param_groups:
            group["lr"] = LRS[s]
        opt.step()
    return [p.detach() for p in ps]


def _ratio(num, den, clip):
    if not (num > 0 and den > 0):
        return 1.0  # nothing to take a ratio of: the plain step, not clipped
    return min(num / den, clip) if clip > 0 else num / den


def _lamb_reference(weights, grads, adapt, wd, b1, b2, eps, clip, bias_correction):
    """LAMB, You et al. 2020, Algorithm 2, tensor by tensor."""
    ws, ms, vs = (
        [w.clone() for w in weights],
        [torch.zeros_like(w) for w in weights],
        [torch.zeros_like(w) for w in weights],
    )
    for s in range(STEPS):
        t = s + 1
        for i, w in enumerate(ws):
            g = grads[s][i]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            mh, vh = (ms[i] / (1 - b1**t), vs[i] / (1 - b2**t)) if bias_correction else (ms[i], vs[i])
            u = mh / (vh.sqrt() + eps) + (wd if adapt[i] else 0.0) * w
            r = _ratio(float(w.norm()), float(u.norm()), clip) if adapt[i] else 1.0
            ws[i] = w - LRS[s] * r * u
    return ws


def _lars_reference(weights, grads, adapt, wd, momentum, eta, clip):
    """LARS, You, Gitman and Ginsburg 2017, Algorithm 1 (the learning rate inside the momentum), tensor by tensor."""
    ws, vs = [w.clone() for w in weights], [torch.zeros_like(w) for w in weights]
    for s in range(STEPS):
        for i, w in enumerate(ws):
            g = grads[s][i]
            decay = wd if adapt[i] else 0.0
            wn, gn = float(w.norm()), float(g.norm())
            local = _ratio(eta * wn, gn + decay * wn, clip) if adapt[i] and wn > 0 and gn > 0 else 1.0
            vs[i] = momentum * vs[i] + LRS[s] * local * (g + decay * w)
            ws[i] = w - vs[i]
    return ws


@pytest.mark.parametrize("clip,bias_correction", [(0.0, True), (0.5, False)], ids=["paper", "clip-v3"])
def test_lamb_equals_the_papers_update(clip, bias_correction):
    weights, grads, adapt = _problem()
    ours = _run(
        lambda g: Lamb(g, betas=(0.9, 0.99), eps=1e-6, trust_clip=clip, bias_correction=bias_correction),
        weights,
        grads,
        adapt,
        wd=0.1,
    )
    ref = _lamb_reference(weights, grads, adapt, 0.1, 0.9, 0.99, 1e-6, clip, bias_correction)
    for i, (a, b) in enumerate(zip(ours, ref)):
        # measured: 2.2e-16 (fp64 rounding of the same arithmetic in another order); every weight moves 7.9e-3 or more
        assert float((a - b).abs().max()) < 1e-10, i
        assert float((b - weights[i]).abs().max()) > 1e-3, i


def test_a_bare_parameter_list_is_adapted_and_decayed_by_default():
    weights, grads, _ = _problem(3)
    adapt = [True, True, True]
    ours = _run(
        lambda ps: Lars(ps, momentum=0.9, weight_decay=0.01, trust_coefficient=0.05),
        weights,
        grads,
        adapt,
        0.01,
        plain=True,
    )
    ref = _lars_reference(weights, grads, adapt, 0.01, 0.9, 0.05, 0.0)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert float((a - b).abs().max()) < 1e-10, i


@pytest.mark.parametrize("clip", [0.0, 0.02], ids=["paper", "clip"])
def test_lars_equals_the_papers_update(clip):
    weights, grads, adapt = _problem(1)
    ours = _run(
        lambda g: Lars(g, momentum=0.9, trust_coefficient=0.05, trust_clip=clip), weights, grads, adapt, wd=0.01
    )
    ref = _lars_reference(weights, grads, adapt, 0.01, 0.9, 0.05, clip)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert float((a - b).abs().max()) < 1e-10, i  # measured: 0 (bit for bit); every weight moves 1.0e-3 or more
        assert float((b - weights[i]).abs().max()) > 1e-3, i


@pytest.mark.parametrize("optimizer", [Lamb, Lars])
def test_step_with_a_closure_runs_it_with_autograd_and_returns_its_loss(optimizer):
    """``step(closure)`` as torch's optimizers take it: the closure recomputes the loss and its gradients (autograd on,
    although the step itself runs without), the step returns that loss and updates as after a plain backward."""
    torch.manual_seed(0)
    x, w0 = torch.randn(8, 4), torch.randn(4, 3)
    runs = []
    for with_closure in (True, False):
        w = torch.nn.Parameter(w0.clone())
        opt = optimizer([w], lr=0.1)

        def closure(opt=opt, w=w):
            opt.zero_grad()
            loss = (x @ w).square().mean()
            loss.backward()
            return loss

        if with_closure:
            loss = opt.step(closure)
        else:
            loss = closure()
            assert opt.step() is None
        runs.append((float(loss.detach()), w.detach().clone()))
    (loss, w), (plain_loss, plain_w) = runs
    assert loss == plain_loss and torch.equal(w, plain_w) and not torch.equal(w, w0)


def test_lamb_equals_torch_optimizer_lamb():
    """torch-optimizer's Lamb is the paper's v3 (no bias correction), adapts every tensor and clamps ||w|| at 10."""
    import torch_optimizer

    weights, grads, _ = _problem(2)
    adapt = [True, True, True]
    ours = _run(
        lambda g: Lamb(g, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, bias_correction=False),
        weights,
        grads,
        adapt,
        wd=0.1,
        plain=True,
    )  # a bare parameter list: LAMB adapts every weight by default
    theirs = _run(
        lambda g: torch_optimizer.Lamb(g, betas=(0.9, 0.99), eps=1e-6, clamp_value=1e9), weights, grads, adapt, wd=0.1
    )
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert float((a - b).abs().max()) < 1e-6, i  # measured: 1.1e-16


def test_shard_norms_see_whole_weights_and_each_expert_through_any_cut():
    """Three ranks' ZeRO segments cut a matrix and a stacked expert weight [4, 3, 5] anywhere (an expert's rows split
    between two ranks); summing the ranks' partial vectors (what the engine's all-reduce does) gives every piece the
    norm of its whole matrix, or of its own expert."""
    g = torch.Generator().manual_seed(0)
    mat = torch.nn.Parameter(torch.randn(7, 5, generator=g))
    experts = torch.nn.Parameter(torch.randn(4, 3, 5, generator=g))
    named = [("w", mat), ("experts", experts)]
    layout = FlatLayout(named, 3, bucket_bytes=None)
    flat = torch.zeros(layout.total)
    layout.pack(flat)
    ranks = []
    for r in range(3):
        segments = layout.segments(r)
        tensors = [flat[s.flat_range[0] : s.flat_range[1]] for s in segments]
        ranks.append((segments, tensors))
    assert any(0 < s.param_range[0] % 15 for segs, _ in ranks for s in segs if s.name == "experts"), (
        "no cut inside an expert"
    )
    partial = []
    for segments, tensors in ranks:  # each rank's partial squares, as the collective would receive them
        prov = ShardNorms(
            named, {id(experts)}, lambda p: True, lambda t: partial.append(t.clone()), torch.device("cpu")
        )
        prov.bind(segments, tensors)
        prov.norms(tensors, [2 * t for t in tensors])
    total = sum(partial)
    expected = {"w": [float(mat.detach().norm())], "experts": [float(e.norm()) for e in experts.detach()]}
    for segments, tensors in ranks:
        prov = ShardNorms(named, {id(experts)}, lambda p: True, lambda t: t.copy_(total), torch.device("cpu"))
        prov.bind(segments, tensors)
        wn, twice = prov.norms(tensors, [2 * t for t in tensors])
        want = []
        for s, _ in zip(segments, tensors):
            if s.name == "w":
                want.append(expected["w"][0])
            else:
                per = 15
                first, last = s.param_range[0] // per, (s.param_range[1] - 1) // per
                want += expected["experts"][first : last + 1]
        torch.testing.assert_close(wn, torch.tensor(want), rtol=1e-6, atol=0)
        torch.testing.assert_close(twice, 2 * torch.tensor(want), rtol=1e-6, atol=0)


# ---- through the engine, on the real model ------------------------------------------------------------

MOE = [
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden=64",
    "model.moe_aux_loss=0",
    "model.moe_z_loss=0",
]


def _trainer(tmp, *overrides, steps=4):
    cfg = tiny_config(tmp, "train.grad_clip=0", "train.eps=1e-6", *MOE, *overrides, steps=steps)
    return Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)


@pytest.mark.parametrize("optimizer", ["lamb", "lars", "sgd"])
def test_one_process_engine_step_equals_the_reference_per_weight_and_per_expert(tmp_path, optimizer):
    """The engine's optimizer on a mixture-of-experts model equals the references above applied by hand: matrices
    adapted and decayed, norms, biases and embeddings neither, every expert of a stacked weight its own unit (and
    SGD: torch's momentum SGD, the decay an L2 term on the same matrices)."""
    lr = {"lamb": "train.lr=0.02", "lars": "train.lr=2.0", "sgd": "train.lr=0.5"}[optimizer]
    tr = _trainer(
        str(tmp_path), f"train.optimizer={optimizer}", lr, "train.weight_decay=0.01", "train.trust_coefficient=0.01"
    )
    plain = build_model(tr.model_cfg, tr.cfg.train.seed)
    flags = decay_flags(plain)
    units, adapt = [], []  # the reference's tensors: whole weights, and each expert of a stacked one
    for n, p in plain.named_parameters():
        parts = list(p.data.unbind(0)) if ".experts." in n else [p.data]
        units += parts
        adapt += [flags[n]] * len(parts)
    assert any(".experts." in n and flags[n] for n, _ in plain.named_parameters())
    state = [torch.zeros_like(u, dtype=torch.float64) for u in units]
    state2 = [torch.zeros_like(u, dtype=torch.float64) for u in units]
    for s in range(4):
        x, y = tr.train_data.micro_batches(s * 8, 8, 8)[0]
        plain.zero_grad()
        loss = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads = []
        for n, p in plain.named_parameters():
            grads += list(p.grad.unbind(0)) if ".experts." in n else [p.grad]
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        record = tr.train_step()
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)
        with torch.no_grad():
            for i, (u, g) in enumerate(zip(units, grads)):
                w, g = u.double(), g.double()
                wd = 0.01 if adapt[i] else 0.0
                if optimizer == "lamb":
                    t = s + 1
                    state[i] = 0.9 * state[i] + 0.1 * g
                    state2[i] = 0.95 * state2[i] + 0.05 * g * g
                    upd = (state[i] / (1 - 0.9**t)) / ((state2[i] / (1 - 0.95**t)).sqrt() + 1e-6) + wd * w
                    r = _ratio(float(w.norm()), float(upd.norm()), 0.0) if adapt[i] else 1.0
                    u.copy_(w - record["lr"] * r * upd)
                elif optimizer == "sgd":
                    state[i] = 0.9 * state[i] + (g + wd * w) if s else g + wd * w
                    u.copy_(w - record["lr"] * state[i])
                else:
                    wn, gn = float(w.norm()), float(g.norm())
                    local = 0.01 * wn / (gn + wd * wn) if adapt[i] and wn > 0 and gn > 0 else 1.0
                    state[i] = 0.9 * state[i] + record["lr"] * local * (g + wd * w)
                    u.copy_(w - state[i])
        # measured: at most 2.7e-7 after four steps (fp32 in the engine, fp64 here), while every weight moves at
        # least 9.8e-5 in every step -- a weight left where it was fails
        ref = dict(plain.named_parameters())
        for n, p in tr.model.named_parameters():
            assert float((p.detach() - before[n]).abs().max()) > 2e-6, (s + 1, n)
            torch.testing.assert_close(
                p.detach(), ref[n].detach(), rtol=0, atol=2e-6, msg=lambda m, s=s, n=n: f"step {s + 1}, {n}: {m}"
            )


def test_bad_optimizer_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.optimizer must be one of adamw, lamb, lars, sgd, got 'adam'"):
        tiny_config(str(tmp_path), "train.optimizer=adam").validate(1)
    with pytest.raises(ConfigError, match="train.schedule must be auto, cosine or poly"):
        tiny_config(str(tmp_path), "train.schedule=linear").validate(1)
    with pytest.raises(ConfigError, match="train.momentum must be in"):
        tiny_config(str(tmp_path), "train.momentum=1.0").validate(1)


def test_a_checkpoint_resumes_only_with_its_optimizer(tmp_path):
    tr = _trainer(str(tmp_path), "train.optimizer=lars", steps=1)
    tr.train_step()
    path = tr.save_checkpoint()
    other = _trainer(str(tmp_path / "other"), "train.optimizer=lamb", steps=1)
    with pytest.raises(
        CheckpointError, match="holds lars state but train.optimizer = lamb; set train.optimizer = lars"
    ):
        other.load_checkpoint(path)


@pytest.mark.parametrize("optimizer", ["lamb", "lars", "sgd-plain"])
def test_memory_report_predicts_each_optimizers_state(tmp_path, optimizer):
    """``trickles memory`` counts each optimizer's own state: LAMB Adam's 8 bytes and a step counter per tensor, LARS
    4 bytes of momentum and no counter, SGD without momentum nothing -- exactly what the engine then holds."""
    from trickles.memory.report import measure, predict

    name, extra = {"lamb": ("lamb", []), "lars": ("lars", []), "sgd-plain": ("sgd", ["train.momentum=0"])}[optimizer]
    tr = _trainer(str(tmp_path), f"train.optimizer={name}", *extra, steps=2)
    rep = predict(tr.cfg, tr.topo.dims, tr.model_cfg, dp_rank=0)
    measure(tr, rep, steps=1)
    assert rep.measured["optimizer"] == rep.predicted["optimizer"]
    params = sum(p.numel() for p in tr.model.parameters())
    assert (
        rep.predicted["optimizer"]
        == {"lamb": 8 * params + 4 * len(list(tr.model.parameters())), "lars": 4 * params, "sgd-plain": 0}[optimizer]
    )


def test_optimizer_settings_defaults_are_the_configs():
    """``OptimizerSettings`` built by hand (the benchmarks, a library user) defaults to what ``[train]`` does."""
    from trickles.optim import OptimizerSettings
    from trickles.train.config import TrainConfig

    t = TrainConfig()
    for name in ("adamw", "lars"):
        t.optimizer = name
        assert OptimizerSettings(t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay, name) == OptimizerSettings.from_train(
            t
        )
