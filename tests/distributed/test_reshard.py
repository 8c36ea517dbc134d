"""Checkpoints reshard across layouts: saved at one (dp, ZeRO stage, tp with sequence parallel, pp with virtual
stages), loaded at another, training goes on as if nothing changed -- weights, Adam moments and the data position
all come back -- and a rank reads only the slices it needs."""

import os

import pytest
import torch

from helpers import tiny_config
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
BEFORE, AFTER = 6, 10
CACHE = "/tmp/trickles-test-reshard"
# eps as in the tensor-parallel tests: fp32 rounding of near-zero gradients would otherwise dominate; 8 layers so
# that 4 stages (or 2 x 2 virtual ones) fit; micro-batches of 1 so that an interleaved pipeline gets m % pp == 0
COMMON = ("model.n_layers=8", f"data.cache_dir={CACHE}", "parallel.bucket_mb=0.05", "train.eps=1e-6", "train.micro_batch=1")

LAYOUTS = {
    "dp2-zero3": (2, ["parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "dp2-tp2-sp-pp2-interleaved-zero1": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                                             "parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.zero=1"]),
    "dp1": (1, []),
    "pp4": (4, ["parallel.pp=4"]),
    "tp4": (4, ["parallel.tp=4"]),
    "dp4-zero2": (4, ["parallel.zero=2"]),
}


def _trainer(tmp, layout, out):
    world, overrides = LAYOUTS[layout]
    cfg = tiny_config(tmp, *COMMON, *overrides, f"train.out_dir={out}", steps=BEFORE + AFTER)
    return Trainer(cfg, cfg.validate(world).build(CPU), quiet=True)


def _save_and_go_on(tmp, layout):
    """BEFORE steps, a checkpoint, then AFTER more steps at the same layout."""
    tr = _trainer(tmp, layout, f"{tmp}/{layout}")
    for _ in range(BEFORE):
        tr.train_step()
    path = tr.save_checkpoint()
    return path, [tr.train_step()["loss"] for _ in range(AFTER)]


def _load_and_go_on(tmp, layout, path):
    """AFTER steps from the checkpoint at another layout; also the tensor bytes this rank read from the checkpoint."""
    from trickles.train import pieces

    tr = _trainer(tmp, layout, f"{tmp}/{layout}-resumed")
    read, region = [], pieces._piece_region

    def counting(*args):
        part, mask = region(*args)
        read.append(part.numel() * part.element_size())
        return part, mask

    pieces._piece_region = counting
    try:
        tr.load_checkpoint(path)
    finally:
        pieces._piece_region = region
    return tr.step, tr.consumed, [tr.train_step()["loss"] for _ in range(AFTER)], sum(read)


def _source(tmp, layout):
    world, _ = LAYOUTS[layout]
    (path, straight), *rest = run_ranks(world, _save_and_go_on, tmp, layout, timeout=600)
    assert all(r[1] == straight for r in rest)
    return path, straight


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reshard"))
    return tmp, {name: _source(tmp, name) for name in ("dp2-zero3", "dp2-tp2-sp-pp2-interleaved-zero1")}


@pytest.mark.parametrize("source,target", [
    ("dp2-zero3", "tp2"),
    ("dp2-tp2-sp-pp2-interleaved-zero1", "dp1"),
    ("dp2-tp2-sp-pp2-interleaved-zero1", "pp4"),
    ("dp2-tp2-sp-pp2-interleaved-zero1", "tp4"),
    ("dp2-tp2-sp-pp2-interleaved-zero1", "dp4-zero2"),
])
def test_checkpoint_loads_at_another_layout_and_training_goes_on_unchanged(sources, source, target):
    tmp, found = sources
    path, straight = found[source]
    assert sorted(n for n in os.listdir(path) if n.startswith("model-")) and os.path.exists(os.path.join(path, "manifest.json"))
    world, _ = LAYOUTS[target]
    stored = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))
    for step, consumed, losses, read in run_ranks(world, _load_and_go_on, tmp, target, path, timeout=600):
        assert (step, consumed) == (BEFORE, BEFORE * 8)  # the data position came back
        assert losses == pytest.approx(straight, rel=1e-4)
        if target in ("tp4", "pp4"):  # a quarter of the model and its Adam state, and the small replicated tensors
            assert read < 0.5 * stored, (read, stored)
        elif target == "dp1":
            assert read > 0.95 * stored, (read, stored)
