"""train.compile=true compiles the blocks and trains to the same losses as eager execution."""

import pytest
import torch

from helpers import tiny_config
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer


def _losses(tmp, *overrides):
    trainer = Trainer(tiny_config(tmp, *overrides, steps=3), ParallelDims().build(torch.device("cpu")), quiet=True)
    return [trainer.train_step()["loss"] for _ in range(3)], trainer


def test_compiled_blocks_match_eager(tmp_path):
    eager, _ = _losses(tmp_path)
    compiled, trainer = _losses(tmp_path, "train.compile=true")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in trainer.model.layers.values())
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert trainer.sample("def ", 8).startswith("def ")  # decoding runs eagerly, no recompilation storm
