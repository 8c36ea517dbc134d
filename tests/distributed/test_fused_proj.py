"""Fused q/k/v and gate/up projections (``model.fused_proj``) under parallel layouts, and their checkpoints.

A fused model starts from the unfused model's weights (each part initialized by its own name) and computes the
same function, so every layout of it tracks the *unfused* one-process run: 12 steps, fp32, losses within 1e-4
relative and every weight (compared in the fused layout: the reference's parts fused, then this rank's block cut
out) within 1e-5. Checkpoints keep the parts' names, so a fused run resumes as an unfused one at another layout
and the other way round, optimizer state included, continuing exactly as the uninterrupted run.
"""

import math

import pytest
import torch
from helpers import assert_losses_track, assert_weights_track, tiny_config

from trickles.models import fused
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

STEPS = 12
CPU = torch.device("cpu")
EPS = "train.eps=1e-6"  # as in the other layout tests
FUSED = ["model.fused_proj=true"]
# the tiny llama's 2 key/value heads split over tp=2, and a gpt2 flavour (biases, no grouped heads, no gate)
MODELS = {"llama": [], "gpt2": ["model.preset=gpt2-tiny"]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('fused-proj-cache')}"


def _train(tmp, dims, overrides, steps=STEPS, save_at=None, resume=None):
    """Losses, the final weights as ``{name: (tensor, offset)}`` in the model's own names, the initial ones, and
    whether the model fused its projections. ``save_at``: write a checkpoint after that many steps (its path is
    returned last); ``resume``: start from that checkpoint."""
    cfg = tiny_config(tmp, EPS, *(f"parallel.{k}={v}" for k, v in dims.items()), *overrides, steps=steps)
    tr = Trainer(cfg, cfg.validate(math.prod(dims.values())).build(CPU), quiet=True)
    if resume is not None:
        tr.load_checkpoint(resume)

    def state():
        specs = tr.engine.placements()
        return {
            n: (t.detach().float().clone(), specs[n].offset if specs.get(n) else (0,) * t.dim())
            for n, t in tr.engine.full_state().items()
        }

    start = state()
    losses, path = [], None
    for i in range(tr.step, steps):
        losses.append(tr.train_step()["loss"])
        if save_at is not None and i + 1 == save_at:
            path = tr.save_checkpoint()
    return losses, state(), start, tr.model_cfg.fuses_projections, path


_REFERENCE = {}


def _reference(tmp, cache, extra=()):
    """The unfused one-process run (and one at a 5% lower learning rate), once per module run."""
    key = (cache, tuple(extra))
    if key not in _REFERENCE:
        common = [cache, "model.fused_proj=false", *extra]
        _REFERENCE[key] = (
            run_ranks(1, _train, tmp, {}, common)[0],
            run_ranks(1, _train, tmp, {}, [*common, "train.lr=2.85e-3"])[0][0],
        )
    return _REFERENCE[key]


def _in_fused_layout(cfg, weights):
    """The reference's unfused weights with each fused projection's parts put together."""
    return fused.fuse_state(cfg, {n: w[0] for n, w in weights.items()})


def _check(run, reference, slower, cfg):
    losses, weights, start, was_fused, _ = run
    assert was_fused, "the case did not fuse its projections"
    assert any(".qkv_proj." in n for n in weights), sorted(weights)[:6]
    assert_losses_track(losses, reference[0], 1e-4, wrong={"lr 5% lower": slower})
    final, initial = _in_fused_layout(cfg, reference[1]), _in_fused_layout(cfg, reference[2])
    # gpt2's key bias gets no gradient (softmax does not see a shift shared by all keys): its rows never move
    names = [n for n in weights if not n.endswith("qkv_proj.bias")]
    cut = {n: tuple(slice(o, o + k) for o, k in zip(weights[n][1], weights[n][0].shape)) for n in names}
    # every rank's initial block is the unfused model's (the parts' own initial values fused)
    for n in names:
        assert torch.equal(start[n][0], initial[n][cut[n]]), n
    return assert_weights_track(
        {n: weights[n][0] for n in names}, {n: final[n][cut[n]] for n in names}, {n: start[n][0] for n in names}, 1e-5
    )


LAYOUTS = [  # (id, model, degrees, overrides)
    ("llama-one-process", "llama", {}, []),
    ("llama-dp2-zero3", "llama", {"dp": 2}, ["parallel.zero=3"]),
    ("llama-tp2-sp", "llama", {"tp": 2}, ["parallel.sequence_parallel=true"]),
    ("llama-pp2-1f1b", "llama", {"pp": 2}, ["train.micro_batch=2"]),
    ("gpt2-tp2", "gpt2", {"tp": 2}, []),
    ("llama-2d-tp4", "llama", {"tp": 4}, ["parallel.tp_mode=2d"]),  # the grid's fused projections (tensor/grid_plan.py)
]


@pytest.mark.parametrize("model,dims,overrides", [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_fused_projections_track_the_unfused_model(tmp_path, cache, model, dims, overrides):
    """12 steps, fp32: losses within 1e-4 relative and every weight within 1e-5 of the unfused one-process run."""
    reference, slower = _reference(str(tmp_path), cache, MODELS[model])
    cfg = tiny_config(str(tmp_path), *MODELS[model], *FUSED).model
    for run in run_ranks(
        math.prod(dims.values()) if dims else 1,
        _train,
        str(tmp_path),
        dims,
        [cache, *MODELS[model], *FUSED, *overrides],
    ):
        _check(run, reference, slower, cfg)


@pytest.mark.parametrize(
    "first,then",
    [
        (({"dp": 2}, ["parallel.zero=2", "model.fused_proj=true"]), ({}, ["model.fused_proj=false"])),
        (({}, ["model.fused_proj=false"]), ({"tp": 2}, ["model.fused_proj=true"])),
    ],
    ids=["fused-zero2-to-unfused", "unfused-to-fused-tp2"],
)
def test_checkpoints_keep_the_parts_names_and_resume_across_fusion(tmp_path, cache, first, then):
    """6 steps written by one kind of model at one layout, 6 more by the other kind at another: the 12 losses and the
    final weights equal the uninterrupted unfused run's (moments and step counters travel through the part names)."""
    from trickles.train.pieces import PieceReader

    reference, slower = _reference(str(tmp_path), cache)
    dims, overrides = first
    world = math.prod(dims.values()) if dims else 1
    runs = run_ranks(world, _train, str(tmp_path), dims, [cache, *overrides], STEPS, STEPS // 2)
    path = runs[0][4]
    keys = PieceReader(path, "model").keys()
    assert "layers.0.attn.k_proj.weight" in keys and not any("qkv" in k or "gate_up" in k for k in keys)
    optim = PieceReader(path, "optimizer").keys()
    assert "layers.1.mlp.gate_proj.weight/exp_avg_sq" in optim and not any("qkv" in k or "gate_up" in k for k in optim)
    dims2, overrides2 = then
    world2 = math.prod(dims2.values()) if dims2 else 1
    second = run_ranks(world2, _train, str(tmp_path), dims2, [cache, *overrides2], STEPS, None, path)
    losses = runs[0][0][: STEPS // 2] + second[0][0]
    assert_losses_track(losses, reference[0], 1e-4, wrong={"lr 5% lower": slower})
    unfused = {n: w[0] for n, w in reference[1].items()}
    final = fused.fuse_state(tiny_config(str(tmp_path), *overrides2).model, unfused)
    for _, weights, _, was_fused, _ in second:
        assert was_fused == ("model.fused_proj=true" in overrides2)
        for n, (w, offset) in weights.items():
            ref = final[n][tuple(slice(o, o + k) for o, k in zip(offset, w.shape))]
            assert (w - ref).abs().max() <= 1e-5, n
