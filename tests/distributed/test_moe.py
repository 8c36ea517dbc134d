"""Mixture-of-experts models under data parallelism, ZeRO, pipeline stages and recomputation: the same losses,
weights and expert load as one process; what is not built yet is refused by the config."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tiny_config
from trickles.errors import ConfigError
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

STEPS = 20
CPU = torch.device("cpu")
EPS = "train.eps=1e-6"  # as in the other layout tests: fp32 rounding of near-zero gradients would dominate
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=64", "model.moe_aux_loss=0.05",
       "model.moe_z_loss=0.01"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('moe-cache')}"


def _train(tmp, dims, overrides, steps=STEPS):
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", EPS, *MOE, *(f"parallel.{k}={v}" for k, v in dims.items()), *overrides,
                      steps=steps)
    tr = Trainer(cfg, cfg.validate(math.prod(dims.values())).build(CPU), quiet=True)
    records = [tr.train_step() for _ in range(steps)]
    state = {n: t.detach().float().clone() for n, t in tr.engine.full_state().items()}
    return [r["loss"] for r in records], [(r["moe_aux_loss"], r["moe_z_loss"], r["moe_dropped"], r["moe_load"]) for r in records], state


_REFERENCE = {}


def _reference(tmp, cache, overrides):
    key = (cache, tuple(overrides))
    if key not in _REFERENCE:
        _REFERENCE[key] = run_ranks(1, _train, tmp, {}, [cache, *overrides])[0]
    return _REFERENCE[key]


LAYOUTS = [  # (id, degrees, overrides)
    ("dp2-capacity", {"dp": 2}, ["model.moe_capacity_factor=1.0"]),
    ("dp2-zero1-shared", {"dp": 2}, ["parallel.zero=1", "model.moe_shared_experts=1"]),
    ("dp4-zero3-capacity", {"dp": 4}, ["parallel.zero=3", "model.moe_capacity_factor=1.0"]),
    ("dp2-zero2-accum-gpt2", {"dp": 2}, ["parallel.zero=2", "train.micro_batch=2", "model.preset=gpt2-tiny"]),
    ("pp2-1f1b-capacity", {"pp": 2}, ["train.micro_batch=2", "model.moe_capacity_factor=1.0"]),
    ("dp2-full-recompute-every2", {"dp": 2}, ["memory.recompute=full", "model.n_layers=4", "model.moe_every=2"]),
]


@pytest.mark.parametrize("dims,overrides", [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_layout_invariance(tmp_path, cache, dims, overrides):
    """Losses within 1e-4 relative and weights within 1e-5 of one process (fp32, 20 steps); the experts' load
    per layer, the dropped fraction and the auxiliary losses are those of one process (the capacity's unit is a
    sequence, so every layout drops the same assignments)."""
    same_math = [o for o in overrides if o.startswith(("model.", "train.micro_batch"))]
    ref_losses, ref_moe, ref_w = _reference(str(tmp_path), cache, same_math)
    for losses, moe, weights in run_ranks(math.prod(dims.values()), _train, str(tmp_path), dims, [cache, *overrides]):
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        for (aux, z, dropped, load), (r_aux, r_z, r_dropped, r_load) in zip(moe, ref_moe):
            assert load == r_load and dropped == r_dropped
            assert aux == pytest.approx(r_aux, rel=1e-5) and z == pytest.approx(r_z, rel=1e-5)
        if "pp" in dims:  # each stage holds its layers; together they are checked by the loss
            weights = {n: w for n, w in weights.items() if n in ref_w}
        for name, w in weights.items():
            assert torch.allclose(w, ref_w[name], atol=1e-5, rtol=0), (name, (w - ref_w[name]).abs().max())
    if any("capacity" in o for o in overrides):
        assert any(d > 0 for _, _, d, _ in ref_moe)  # capacity really dropped assignments
    else:
        assert all(d == 0 for _, _, d, _ in ref_moe)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.tp=2"], 2, "mixture-of-experts blocks do not run under parallel.tp > 1 yet"),
    (["parallel.cp=2"], 2, "mixture-of-experts blocks do not run under parallel.cp > 1 yet"),
    (["parallel.ep=2"], 2, "this version has no expert parallelism"),
])
def test_layouts_not_built_yet_are_refused_by_the_config(tmp_path, overrides, world, message):
    cfg = tiny_config(str(tmp_path), *MOE, *overrides)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        cfg.validate(world)
