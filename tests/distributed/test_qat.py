"""Quantization-aware training (``train.qat``) under parallel layouts, against one process.

The fake quantization's scales are those of the whole tensors at every layout: a row-parallel layer's per-row
weight maxima and per-token input maxima are all-reduced (max) over the tp group, so dp2 and tp2 (with sequence
parallelism) train like one process: 8 steps, fp32, losses within 1e-4 relative (shown to reject a run at a 5%
lower learning rate). Weights are compared in norm against their own update (``assert_updates_track``), not element
by element: rounding to the int8 grid is discontinuous, so the last-bit differences of a layout's reductions flip the
rounding of an element now and then, and Adam turns a near-zero gradient's flip into a step of the other sign
(measured at dp2: one embedding element 2.6e-3 apart after 12 steps while the tensor tracks).
"""

import math

import pytest
import torch
from helpers import assert_losses_track, assert_updates_track, tiny_config

from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

STEPS = 8
CPU = torch.device("cpu")
QAT = ["train.qat=true", "train.eps=1e-6"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('qat-cache')}"


def _train(tmp, dims, overrides):
    cfg = tiny_config(tmp, *QAT, *(f"parallel.{k}={v}" for k, v in dims.items()), *overrides, steps=STEPS)
    tr = Trainer(cfg, cfg.validate(math.prod(dims.values()) if dims else 1).build(CPU), quiet=True)
    assert all(
        getattr(tr.model.get_submodule(n), "qat", False) for n in ("layers.0.attn.o_proj", "layers.1.mlp.down_proj")
    )

    def state():
        specs = tr.engine.placements()
        return {
            n: (t.detach().float().clone(), specs[n].offset if specs.get(n) else (0,) * t.dim())
            for n, t in tr.engine.full_state().items()
        }

    start = state()
    losses = [tr.train_step()["loss"] for _ in range(STEPS)]
    return losses, state(), start


_REFERENCE = {}


def _reference(tmp, cache):
    if cache not in _REFERENCE:
        _REFERENCE[cache] = (
            run_ranks(1, _train, tmp, {}, [cache])[0],
            run_ranks(1, _train, tmp, {}, [cache, "train.lr=2.85e-3"])[0][0],
        )
    return _REFERENCE[cache]


@pytest.mark.parametrize(
    "dims,overrides", [({"dp": 2}, []), ({"tp": 2}, ["parallel.sequence_parallel=true"])], ids=["dp2", "tp2-sp"]
)
def test_qat_layouts_track_one_process(tmp_path, cache, dims, overrides):
    (ref_losses, ref_weights, _), slower = _reference(str(tmp_path), cache)
    for losses, weights, start in run_ranks(math.prod(dims.values()), _train, str(tmp_path), dims, [cache, *overrides]):
        assert_losses_track(losses, ref_losses, 1e-4, wrong={"lr 5% lower": slower})
        cut = {n: tuple(slice(o, o + k) for o, k in zip(off, w.shape)) for n, (w, off) in weights.items()}
        worst = assert_updates_track(
            {n: w for n, (w, _) in weights.items()},
            {n: ref_weights[n][0][cut[n]] for n in weights},
            {n: w for n, (w, _) in start.items()},
            0.05,
        )
        print(f"{dims}: worst weight {worst:.3g} of its update away")


def _row_parallel_scales():
    """On each of 2 tp ranks: a row-parallel block (columns split) of a weight and of some tokens, fake-quantized with
    the group's maxima and with local ones, against the whole tensors fake-quantized in one process."""
    import torch.distributed as dist

    from trickles.comm import CommLedger, GroupComm
    from trickles.compress.qat import fake_quant_rows

    comm = GroupComm("tp", dist.group.WORLD, CommLedger())
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 32, generator=g), torch.randn(5, 32, generator=g)
    w[:, :16] *= 4.0  # rank 0's half holds every row's maximum: local scales on rank 1 are smaller
    x[:, :16] *= 4.0
    cols = slice(16 * comm.rank, 16 * comm.rank + 16)
    out = {}
    for name, t in (("w", w), ("x", x)):
        whole = fake_quant_rows(t)[:, cols]
        out[name] = (
            float((fake_quant_rows(t[:, cols].clone(), comm) - whole).abs().max()),
            float((fake_quant_rows(t[:, cols].clone()) - whole).abs().max()),
        )
    return out


def test_row_parallel_scales_are_the_whole_rows():
    ranks = run_ranks(2, _row_parallel_scales)
    for r, out in enumerate(ranks):
        for name, (grouped, _) in out.items():
            assert grouped == 0.0, (r, name, grouped)  # the same grid as one process, bit for bit
    assert ranks[1]["w"][1] > 0 and ranks[1]["x"][1] > 0  # local maxima would not be
