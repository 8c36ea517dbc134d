"""Dropout's saved tensors: the formula against the saved-tensor meter, to the byte, per layer and for the head.

On a CPU each dropout keeps its scaled keep-mask in the input's type (``p`` bytes an element: it multiplies the
input by it), and attention with dropout leaves the fused kernel for SDPA's math path (fp32 copies of q, k, v, the
probabilities, their dropout mask and the dropped probabilities); see :mod:`trickles.memory.activations`."""

import dataclasses

import pytest
import torch
from helpers import tiny_config

from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

SEQ, BATCH = 32, 2


def _measured(tmp, *overrides):
    cfg = tiny_config(
        tmp,
        "model.dropout=0.1",
        f"data.seq_len={SEQ}",
        f"train.micro_batch={BATCH}",
        f"train.global_batch={BATCH}",
        *overrides,
    )
    tr = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    x, y = tr.train_data.micro_batches(0, BATCH, BATCH)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    return tr, meter.per_layer


@pytest.mark.parametrize("flavor", ["tiny", "gpt2-tiny"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dropout_prediction_matches_measurement(tmp_path, flavor, precision):
    p = 2 if precision == "bf16" else 4
    for mode in ("none", "selective", "full"):
        tr, measured = _measured(
            tmp_path, f"model.preset={flavor}", f"memory.precision={precision}", f"memory.recompute={mode}"
        )
        cfg = tr.model_cfg
        predicted = activation_bytes(cfg, BATCH, SEQ, mode, p)
        for i in range(cfg.n_layers):
            assert measured[f"layers.{i}"] == predicted["layer"], (
                mode,
                i,
                measured[f"layers.{i}"] - predicted["layer"],
            )
        assert measured["head"] == predicted["head"], (mode, measured["head"] - predicted["head"])
        without = activation_bytes(dataclasses.replace(cfg, dropout=0.0), BATCH, SEQ, mode, p)
        s, d, a, h = BATCH * SEQ, cfg.d_model, cfg.n_heads, cfg.head_dim
        masks = 2 * p * s * d  # the two residual dropouts' masks, in the input's type
        # attention with dropout: SDPA's math path in fp32 in place of the fused kernel's q, k, v and log-sum-exp
        core = 4 * 3 * s * a * h + 3 * 4 * BATCH * a * SEQ * SEQ - (p * s * (a * h + 2 * cfg.kv_heads * h) + 4 * s * a)
        extra = {"none": masks + core, "selective": masks, "full": 0}[mode]
        assert predicted["layer"] - without["layer"] == extra, mode
        assert predicted["head"] - without["head"] == p * s * d  # the embedding's dropout


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "model.n_layers=2",
            "model.moe_every=2",
            "model.moe_experts=4",
            "model.moe_top_k=2",
            "model.moe_shared_experts=1",
        ],
        ["model.preset=gpt2-tiny", "model.fused_loss=true", "memory.precision=bf16"],
    ],
    ids=["moe-shared", "gpt2-fused-loss-bf16"],
)
def test_dropout_in_moe_blocks_and_with_the_fused_loss(tmp_path, overrides):
    """A mixture-of-experts block adds its own output dropout, and its shared expert (a dense MLP) one more."""
    tr, measured = _measured(tmp_path, *overrides)
    cfg = tr.model_cfg
    p = 2 if "memory.precision=bf16" in overrides else 4
    predicted = activation_bytes(cfg, BATCH, SEQ, "none", p, fused_loss=cfg.fused_loss is True)
    assert [measured[f"layers.{i}"] for i in range(cfg.n_layers)] == predicted["per_layer"]
    assert measured["head"] == predicted["head"]
