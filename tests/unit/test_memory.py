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
    for mode in ("none", "selective", "full"):
        tr = _trainer(tmp_path, f"model.preset={flavor}", "model.dropout=0.1", f"memory.precision={precision}", f"memory.recompute={mode}")
        losses = [tr.train_step()["loss"] for _ in range(3)]
        results[mode] = losses, tr.engine.full_state()
    for mode in ("selective", "full"):
        assert results[mode][0] == results["none"][0], mode  # bit for bit, dropout included
        for name, w in results[mode][1].items():
            assert torch.equal(w, results["none"][1][name]), (mode, name)


# One case per idea: each flavor in each precision (their norms and rotary tables keep different
# tensors), two shapes that tell tokens per sequence (seq) from tokens per micro-batch (batch x seq).
_ACTIVATION_CASES = [("tiny", "fp32", 32, 2), ("tiny", "bf16", 64, 4), ("gpt2-tiny", "fp32", 64, 4), ("gpt2-tiny", "bf16", 32, 2)]


@pytest.mark.parametrize("flavor,precision,seq,batch", _ACTIVATION_CASES, ids=[f"{f}-{p}-{s}x{b}" for f, p, s, b in _ACTIVATION_CASES])
def test_activation_prediction_matches_measurement(tmp_path, flavor, precision, seq, batch):
    """The formula counts every byte autograd saves: equal per layer and for the head, in each recompute mode."""
    measured = {}
    for mode in ("none", "selective", "full"):
        tr = _trainer(tmp_path, f"model.preset={flavor}", f"memory.precision={precision}", f"memory.recompute={mode}",
                      f"data.seq_len={seq}", f"train.micro_batch={batch}", f"train.global_batch={batch}")
        x, y = tr.train_data.micro_batches(0, batch, batch)[0]
        with ActivationMeter(tr.model) as meter:
            loss = tr._loss(x, y)
        loss.backward()
        predicted = activation_bytes(tr.model_cfg, batch, seq, mode, 2 if precision == "bf16" else 4)
        layers = [f"layers.{i}" for i in range(tr.model_cfg.n_layers)]
        assert sorted(meter.per_layer) == sorted(["head", *layers]), meter.per_layer
        for name in layers:
            assert meter.per_layer[name] == predicted["layer"], (mode, name, meter.per_layer[name] - predicted["layer"])
        assert meter.per_layer["head"] == predicted["head"], (mode, meter.per_layer["head"] - predicted["head"])
        measured[mode] = meter.per_layer["layers.0"]
    assert measured["full"] < measured["selective"] < measured["none"]


def test_activation_formula_scales_with_tokens_and_mode():
    from trickles.models import ModelConfig, apply_preset

    cfg = dataclasses.replace(apply_preset(ModelConfig(), "llama-125m"), max_seq_len=2048)
    a = activation_bytes(cfg, 1, 1024)
    assert activation_bytes(cfg, 2, 1024)["layer"] == 2 * a["layer"]
    assert activation_bytes(cfg, 1, 1024, "full")["layer"] == 1024 * 768 * 4
    bf16 = activation_bytes(cfg, 1, 1024, dtype_bytes=2)
    assert bf16["layer"] < a["layer"]
