"""Sliding windows under tensor and pipeline parallelism: a layer's window is part of its attention, so tp=2 with
sequence parallelism (each rank's heads, the whole sequence) and pp=2 (whole blocks per stage, each keeping its
layer's window) train like one process (the runs and the comparison are test_biases_tp's)."""

import pytest
import torch
from helpers import tiny_config
from test_biases_tp import STEPS, _assemble, _train

from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

# a window of 8 over sequences of 32, on the second layer only
WINDOW = ("model.sliding_window=8", "model.window_layers=[false, true]")


def test_a_windowed_layer_at_tp2_sp_trains_like_one_process(tmp_path):
    model = [f"data.cache_dir={tmp_path}/cache", *WINDOW]
    ((ref_losses, ref_pieces),) = run_ranks(1, _train, str(tmp_path), 1, model)
    ref = _assemble([ref_pieces])
    results = run_ranks(2, _train, str(tmp_path), 2, [*model, "parallel.sequence_parallel=true"])
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    weights = _assemble([pieces for _, pieces in results])
    for n, w in weights.items():
        assert (w - ref[n]).abs().max() <= 1e-5, (n, (w - ref[n]).abs().max())


def _losses(tmp, pp, overrides):
    cfg = tiny_config(tmp, f"parallel.pp={pp}", "train.eps=1e-6", *overrides, steps=STEPS)
    tr = Trainer(cfg, ParallelDims(pp=pp).build(torch.device("cpu")), quiet=True)
    return [tr.train_step()["loss"] for _ in range(STEPS)]


def test_windowed_layers_at_pp2_train_like_one_process(tmp_path):
    """A window of 2 on every layer: each stage's blocks keep theirs."""
    cache = f"data.cache_dir={tmp_path}/cache"
    (ref,) = run_ranks(1, _losses, str(tmp_path), 1, [cache, "model.sliding_window=2"])
    (plain,) = run_ranks(1, _losses, str(tmp_path), 1, [cache])
    assert max(abs(a - b) for a, b in zip(plain, ref)) > 1e-2  # the window changes the model
    for losses in run_ranks(2, _losses, str(tmp_path), 2, [cache, "model.sliding_window=2"]):
        assert losses == pytest.approx(ref, rel=1e-4)
