"""The memory report counts a LoRA run's model states exactly: every base parameter held (frozen: whole on each
data-parallel rank, sharded under ZeRO-3) and only the adapters' gradients and optimizer state, predicted against
the engine's own bytes on each rank: one process, dp2 with ZeRO-2 and ZeRO-3, tp2 with sequence parallelism
(adapters split like their base weights)."""

import pytest
import torch
from helpers import tiny_config

from trickles.memory.report import measure, predict
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

LORA = ("train.lora_rank=4", "train.lora_targets=[q_proj, v_proj, down_proj]")
KEYS = ("parameters", "gradients", "optimizer")


def _states(tmp, cache, overrides, world):
    cfg = tiny_config(tmp, cache, *LORA, *overrides, steps=2)
    tr = Trainer(cfg, cfg.validate(world).build(torch.device("cpu")), quiet=True)
    report = measure(tr, predict(tr.cfg, tr.topo.dims, tr.model_cfg, dp_rank=tr.replicas.rank), steps=1)
    adapters = sum(p.numel() for n, p in tr.model.named_parameters() if "lora_" in n)
    return [{k: r[k] for k in KEYS} for r in (report.predicted, report.measured)], adapters


def test_one_process_counts_only_the_adapters_states(tmp_path):
    (predicted, measured), adapters = _states(str(tmp_path), f"data.cache_dir={tmp_path}/cache", (), 1)
    assert predicted == measured
    # AdamW: two fp32 moments per adapter value and a 4-byte step per parameter (one segment each)
    assert measured["optimizer"] == 8 * adapters + 4 * 2 * 2 * 3
    assert measured["gradients"] == 4 * adapters


@pytest.mark.parametrize(
    "layout",
    [("parallel.zero=2",), ("parallel.zero=3",), ("parallel.tp=2", "parallel.sequence_parallel=true")],
    ids=["dp2-zero2", "dp2-zero3", "tp2-sp"],
)
def test_two_ranks_are_exact(tmp_path, layout):
    cache = f"data.cache_dir={tmp_path}/cache"
    for (predicted, measured), _ in run_ranks(2, _states, str(tmp_path), cache, layout, 2):
        assert predicted == measured
