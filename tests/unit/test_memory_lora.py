"""The memory report counts a LoRA run's model states exactly: every base parameter held (frozen: whole on each
data-parallel rank, sharded under ZeRO-3; an int8 base in its codes and scales) and only the adapters' gradients and
optimizer state, predicted against the engine's own bytes on each rank: one process, dp2 with ZeRO-2 (float and int8
base) and ZeRO-3, tp2 with sequence parallelism (adapters split like their base weights). Its activations -- the
adapters' inputs and rank-r products, nothing for a frozen weight's gradient (trickles/memory/lora_activations.py) --
equal what autograd keeps, per layer and in the head, for several target sets, with dropout, in bf16 and with
recomputation; the planner's memory bound stays below the report's peak."""

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
    [
        ("parallel.zero=2",),
        ("parallel.zero=2", "train.lora_base=int8"),
        ("parallel.zero=3",),
        ("parallel.tp=2", "parallel.sequence_parallel=true"),
    ],
    ids=["dp2-zero2", "dp2-zero2-int8", "dp2-zero3", "tp2-sp"],
)
def test_two_ranks_are_exact(tmp_path, layout):
    cache = f"data.cache_dir={tmp_path}/cache"
    for (predicted, measured), _ in run_ranks(2, _states, str(tmp_path), cache, layout, 2):
        assert predicted == measured


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenized corpus for the runs below."""
    return f"data.cache_dir={tmp_path_factory.mktemp('lora-cache')}"


def test_int8_base_bytes_exact(tmp_path, cache):
    cfg = tiny_config(str(tmp_path), cache, *LORA, "train.lora_base=int8", steps=2)
    tr = Trainer(cfg, cfg.validate(1).build(torch.device("cpu")), quiet=True)
    report = measure(tr, predict(tr.cfg, tr.topo.dims, tr.model_cfg), steps=1)
    assert {k: report.predicted[k] for k in KEYS} == {k: report.measured[k] for k in KEYS}
    named = dict(tr.model.named_parameters())
    adapted = [n[: -len(".weight_scale")] for n in named if n.endswith(".weight_scale")]
    assert len(adapted) == 2 * 3
    # out * in one-byte codes and 4 bytes of scale per row for the adapted weights; 4 bytes for every other value
    codes = sum(named[f"{n}.weight"].numel() + 4 * named[f"{n}.weight"].shape[0] for n in adapted)
    rest = sum(p.numel() for n, p in named.items() if n.rsplit(".", 1)[0] not in adapted or "lora_" in n)
    assert report.measured["parameters"] == codes + 4 * rest


@pytest.mark.parametrize(
    "overrides",
    [
        ("train.lora_rank=4", "train.lora_base=int8"),
        (*LORA, "train.lora_dropout=0.1"),
        ("train.lora_rank=4", "train.lora_targets=[v_proj, up_proj, output]", "memory.precision=bf16"),
        ("train.lora_rank=4", "memory.recompute=selective", "model.fused_loss=true", "train.lora_base=int8"),
    ],
    ids=["all-int8", "dropout", "bf16-output", "selective-fused-loss"],
)
def test_activations_are_what_autograd_keeps(tmp_path, cache, overrides):
    from trickles.planner import memory_bound

    cfg = tiny_config(str(tmp_path), cache, *overrides, steps=2)
    dims = cfg.validate(1)
    tr = Trainer(cfg, dims.build(torch.device("cpu")), quiet=True)
    report = measure(tr, predict(tr.cfg, tr.topo.dims, tr.model_cfg), steps=1)
    for key in (*KEYS, "activations", "head", "held"):
        assert report.predicted[key] == report.measured[key], key
    assert report.layers_predicted == report.layers_measured
    assert any("measured exact" in note for note in report.notes)
    # the planner's bound counts the adapters' gradients and optimizer state only: below the report's peak
    assert memory_bound(cfg, dims, tr.model_cfg, "cpu", 1).device <= report.predicted["peak"]
