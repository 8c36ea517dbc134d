"""ZeRO-3 with frozen parameters (a LoRA run's base): frozen shards stay sharded and bitwise unchanged, hold no
gradient and no optimizer state, are gathered twice a step and never reduced (the ledger equals the formula),
their buffers are freed with the unit's backward, and checkpoints resume and reshard to and from one process.

Only block 0 gets adapters (``adapt_block0``), so the model has every kind of unit: block 0 with a trainable and a
frozen part, block 1 with no trainable parameter but an input that needs a gradient, and the root (embedding, final
norm, head) with none either."""

import gc

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_config

from trickles.adapters.lora import apply_lora, freeze_base
from trickles.comm import wire_bytes
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train import trainer as trainer_module
from trickles.train.trainer import Trainer

LORA = ["train.lora_rank=4", "train.lora_alpha=8", "model.fused_proj=false"]


def adapt_block0(model, settings):
    """LoRA on block 0's projections only; every other parameter frozen."""
    apply_lora(model.layers["0"], settings)
    freeze_base(model)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('zero3-frozen-cache')}"


def _trainer(tmp, dp, stage, *extra, steps=4):
    cfg = tiny_config(tmp, *LORA, f"parallel.zero={stage}", "train.warmup_steps=0", *extra, steps=steps)
    apply, trainer_module.apply_lora = trainer_module.apply_lora, adapt_block0  # the pool's ranks serve other tests
    try:
        return Trainer(cfg, ParallelDims(dp=dp).build(torch.device("cpu")), quiet=True)
    finally:
        trainer_module.apply_lora = apply


def _step_and_count(tmp, cache):
    """Two steps; the units' sizes, the frozen state before and after, memory and the second step's ledger, and which
    buffers are gathered just after backward (before the micro-step ends) and after it."""
    tr = _trainer(tmp, dist.get_world_size(), 3, cache, "train.micro_batch=4")
    engine = tr.engine
    units = {u.name: (u.train is not None, u.frozen is not None) for u in engine.units}
    frozen = [u.frozen for u in engine.units]
    before = [p.shard.detach().clone() for p in frozen]
    first = tr.train_step()
    tr.topo.ledger.reset()
    second = tr.train_step()
    ledger = tr.topo.ledger.snapshot()
    gc.collect()
    mem = engine.memory()
    unchanged = all(torch.equal(p.shard, b) for p, b in zip(frozen, before))
    train = [u.train for u in engine.units if u.train is not None]
    owned = sum(s.numel for s in engine.optimizer.segments)
    sizes = {
        "frozen": sum(p.layout.total for p in frozen),
        "trainable": sum(p.layout.total for p in train),
        "frozen_shards": sum(p.shard.numel() for p in frozen),
        "train_shards": sum(p.shard.numel() for p in train),
        "owned": owned,
        "segments": len(engine.optimizer.segments),
        "parts": (len(frozen), len(train)),
    }
    names = {s.name for s in engine.optimizer.segments}
    x, y = tr.train_data.micro_batches(0, 8, 8 // dist.get_world_size())[0]
    engine.zero_grad()
    with engine.micro_step(last=True):
        tr._loss(x, y).backward()
        after_backward = {u.name: u.gathered_bytes() for u in engine.units}
    after_micro_step = {u.name: u.gathered_bytes() for u in engine.units}
    engine.finish_backward()
    return units, unchanged, mem, ledger, sizes, names, after_backward, after_micro_step, (first, second)


def test_frozen_parts_sharded_unchanged_uncounted_and_gathered_twice(tmp_path, cache):
    n = 2
    for units, unchanged, mem, ledger, sizes, names, after_bwd, after_step, losses in run_ranks(
        n, _step_and_count, str(tmp_path), cache
    ):
        # block 0: adapters and its frozen base; block 1 and the root: frozen only
        assert units == {"layers.0": (True, True), "layers.1": (False, True), "<root>": (False, True)}
        assert unchanged and all(v == v for v in losses)  # the frozen shards are bitwise what they started as
        assert names and all(".lora_A." in s or ".lora_B." in s for s in names)  # Adam sees the adapters only
        # memory: both parts' shards; gradients and Adam state (two moments per owned element, one step counter per
        # segment) for the trainable shard only
        assert mem == {
            "parameters": 4 * (sizes["frozen_shards"] + sizes["train_shards"]),
            "gradients": 4 * sizes["train_shards"],
            "optimizer": 8 * sizes["owned"] + 4 * sizes["segments"],
        }
        assert sizes["frozen_shards"] * n == sizes["frozen"] and sizes["frozen"] > 20 * sizes["trainable"]
        # bytes: frozen buffers all-gathered twice, trainable ones twice plus one reduce-scatter (fp32, P padded):
        # 2 (N-1)/N 4 P_f + 3 (N-1)/N 4 P_t; plus the trainer's mean loss and the squared norm (4 bytes each)
        p_f, p_t = sizes["frozen"], sizes["trainable"]
        frozen_parts, train_parts = sizes["parts"]
        assert {k: (v["calls"], v["wire_bytes"]) for k, v in ledger.items()} == {
            "all_gather/dp": (2 * (frozen_parts + train_parts), 2 * (n - 1) * 4 * (p_f + p_t) // n),
            "reduce_scatter/dp": (train_parts, (n - 1) * 4 * p_t // n),
            "all_reduce/dp": (2, 2 * int(wire_bytes("all_reduce", 4, n))),
        }
        sent = sum(v["wire_bytes"] for k, v in ledger.items() if k != "all_reduce/dp")
        assert sent == (2 * 4 * p_f + 3 * 4 * p_t) * (n - 1) // n
        # after backward, before the micro-step ends: block 0 freed by its GatherUnit, block 1 (no trainable part)
        # once its input's gradient was complete; the root's frozen buffer waits for the end of the micro-step
        assert after_bwd["layers.0"] == 0 and after_bwd["layers.1"] == 0 and after_bwd["<root>"] > 0
        assert sum(after_step.values()) == 0


def _first_half(tmp, cache, dp, stage, tag):
    tr = _trainer(tmp, dp, stage, cache, f"train.out_dir={tmp}/{tag}")
    losses = [tr.train_step()["loss"] for _ in range(2)]
    path = tr.save_checkpoint()
    straight = losses + [tr.train_step()["loss"] for _ in range(2)]
    return path, straight, tr.engine.full_state()


def _second_half(tmp, cache, dp, stage, path, tag):
    tr = _trainer(tmp, dp, stage, cache, f"train.out_dir={tmp}/{tag}")
    tr.load_checkpoint(path)
    return [tr.train_step()["loss"] for _ in range(2)], tr.engine.full_state()


@pytest.mark.parametrize("there,back", [((2, 3), (1, 0)), ((1, 0), (2, 3))], ids=["dp2-zero3-to-dp1", "dp1-to-zero3"])
def test_lora_checkpoints_reshard_between_zero3_and_one_process(tmp_path, cache, there, back):
    """A checkpoint written by one layout resumes at the other: the same next losses and weights as going straight
    on, the frozen base bitwise so."""
    (path, straight, final), *_ = run_ranks(there[0], _first_half, str(tmp_path), cache, *there, "a")
    (tail, resumed), *_ = run_ranks(back[0], _second_half, str(tmp_path), cache, *back, path, "b")
    assert tail == pytest.approx(straight[2:], rel=1e-4)
    assert resumed.keys() == final.keys()
    for name, w in resumed.items():
        if ".lora_" in name:
            torch.testing.assert_close(w, final[name], rtol=0, atol=1e-5)
        else:
            assert torch.equal(w, final[name]), name
