"""The offloaded optimizer in the memory report: its state in a host column, the device's held and peak without it,
predicted against measured."""

import torch
from helpers import tiny_config

from trickles.memory.report import measure, predict
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer


def test_offloaded_optimizer_state_is_host_bytes_and_out_of_the_device_peak(tmp_path):
    base = tiny_config(tmp_path, "parallel.zero=1", "memory.precision=bf16", steps=3)
    off = tiny_config(tmp_path, "parallel.zero=1", "memory.precision=bf16", "memory.offload_optimizer=true", steps=3)
    tr = Trainer(off, ParallelDims().build(torch.device("cpu")), quiet=True)
    on_device = predict(base, ParallelDims(), tr.model_cfg).predicted
    rep = measure(tr, predict(off, ParallelDims(), tr.model_cfg), steps=2)
    pred, meas = rep.predicted, rep.measured
    # the host holds the fp32 masters, the fp32 gradient copy and the moments: 4 + 4 + 8 bytes a parameter
    assert pred["host"] == pred["optimizer"] == meas["host"] == meas["optimizer"]
    assert pred["optimizer"] == on_device["optimizer"] + 4 * sum(p.numel() for p in tr.model.parameters())
    assert pred["held"] == meas["held"] == pred["parameters"] + pred["gradients"] + pred["activations"] + pred["head"]
    assert on_device["held"] - pred["held"] == on_device["optimizer"]
    lines = rep.table().splitlines()
    assert lines[0].split()[:3] == ["category", "device", "host"]
    row = {line.split()[0]: line for line in lines if line.strip()}
    assert row["optimizer"].split()[2:4] == ["0", "B"]  # "optimizer (host)": nothing of it on the device
    assert any("offload_optimizer" in line for line in lines)
