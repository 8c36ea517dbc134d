"""Dropout's saved tensors under tensor parallelism, with and without sequence parallelism: each rank's bytes per
layer and for the head equal the formula (masks on the rank's tokens, the math path on its heads)."""

import pytest
import torch
from helpers import tiny_config

from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer


def _activations(tmp, preset, sp, precision):
    cfg = tiny_config(
        tmp,
        f"data.cache_dir={tmp}/cache",
        f"model.preset={preset}",
        "model.dropout=0.1",
        "parallel.tp=2",
        f"parallel.sequence_parallel={str(sp).lower()}",
        f"memory.precision={precision}",
        "train.micro_batch=2",
        "train.global_batch=2",
        steps=1,
    )
    tr = Trainer(cfg, cfg.validate(2).build(torch.device("cpu")), quiet=True)
    x, y = tr.train_data.micro_batches(0, 2, 2)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    return tr.model_cfg, meter.per_layer


@pytest.mark.parametrize("preset,precision", [("tiny", "fp32"), ("gpt2-tiny", "bf16")])
def test_dropout_under_tensor_and_sequence_parallelism(tmp_path, preset, precision):
    for sp in (False, True):
        for cfg, measured in run_ranks(2, _activations, str(tmp_path), preset, sp, precision):
            predicted = activation_bytes(
                cfg, 2, 32, dtype_bytes=2 if precision == "bf16" else 4, tp=2, sequence_parallel=sp
            )
            assert measured == {
                "head": predicted["head"],
                **{f"layers.{i}": predicted["layer"] for i in range(cfg.n_layers)},
            }, sp
