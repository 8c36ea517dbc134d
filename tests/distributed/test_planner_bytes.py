"""The planner's bytes per step are the ledger's: one training step at 2 ranks per layout, every group's wire bytes
against :func:`trickles.planner.cost.step_time`'s traffic (which reads the formulas each dimension's module states)."""

import pytest
from helpers import tiny_config

from trickles.planner import load_cluster, step_time
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

LAYOUTS = {
    "dp2-zero0": ["parallel.dp=2", "parallel.bucket_mb=0"],
    "dp2-zero1": ["parallel.dp=2", "parallel.zero=1", "parallel.bucket_mb=0"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
    "dp2-zero1-buckets": ["parallel.dp=2", "parallel.zero=1", "parallel.bucket_mb=0.05"],
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2-1f1b": ["parallel.pp=2", "train.micro_batch=2"],
    "cp2-ring": ["parallel.cp=2"],
    "cp2-ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "tp4-2d": ["parallel.tp=4", "parallel.tp_mode=2d", "model.n_kv_heads=4"],
    "tp4-2d-full": ["parallel.tp=4", "parallel.tp_mode=2d", "model.n_kv_heads=4", "memory.recompute=full"],
    "tp2-full": ["parallel.tp=2", "memory.recompute=full"],
    "dp2-zero2-accum": ["parallel.dp=2", "parallel.zero=2", "train.micro_batch=2"],
    "pp2-interleaved": [
        "parallel.pp=2",
        "parallel.schedule=interleaved",
        "parallel.virtual_stages=2",
        "train.micro_batch=1",
        "model.n_layers=4",
    ],
    # LoRA: the adapters' gradients alone reduced; ZeRO-3 gathers the frozen base too; no gradient into the embedding
    "dp2-zero0-lora": ["parallel.dp=2", "parallel.bucket_mb=0", "train.lora_rank=4"],
    "dp2-zero3-lora": ["parallel.dp=2", "parallel.zero=3", "train.lora_rank=4", "train.lora_targets=q_proj,v_proj"],
    "tp2-sp-lora": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.lora_rank=4"],
    "tp2-lora": ["parallel.tp=2", "train.lora_rank=4", "train.lora_targets=v_proj,o_proj,down_proj"],
    "dp2-ep2": ["parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", "model.moe_capacity_factor=1.0"],
    # the first layer recomputed whole (its ring exchanges again), the second not
    "cp2-ring-full:1": ["parallel.cp=2", "memory.recompute=full", "memory.recompute_num_layers=1"],
    # the recomputed block's entries keep their gathered inputs (no regathers), the other's regather in backward
    "tp2-sp-full:1+elementwise": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "memory.recompute=full",
        "memory.recompute_num_layers=1",
        "memory.recompute_rest=elementwise",
    ],
    # the V: both ends (and the tied embedding's one copy) on rank 0, the turn on rank 1 sends nothing
    "pp2-zb-v-gpt2": [
        "parallel.pp=2",
        "parallel.schedule=zb-v",
        "parallel.virtual_stages=2",
        "train.micro_batch=1",
        "model.n_layers=4",
        "model.preset=gpt2-tiny",
    ],
}


def _ledger(tmp, cache, overrides):
    import torch.distributed as dist

    cfg = tiny_config(tmp, cache, *overrides, steps=2)
    tr = Trainer(cfg, cfg.validate(dist.get_world_size()).build(), quiet=True)
    tr.train_step()
    tr.topo.ledger.reset()
    tr.train_step()
    return tr.model_cfg, tr.topo.ledger.snapshot()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_bytes_are_the_ledgers(tmp_path, name):
    overrides = [f"data.cache_dir={tmp_path}/cache", *LAYOUTS[name]]
    world = 4 if "tp4" in name else 2
    results = run_ranks(world, _ledger, str(tmp_path), overrides[0], overrides[1:])
    cfg = tiny_config(str(tmp_path), *overrides)
    dims = cfg.validate(world)
    st = step_time(cfg, dims, results[0][0], load_cluster("local"))
    model_cfg, ledger = results[st.stage * (world // dims.pp)]  # the planned rank: the slowest pipeline stage's
    planned: dict[str, float] = {}
    for tt in st.traffic:
        planned[tt.traffic.group] = planned.get(tt.traffic.group, 0.0) + tt.traffic.wire_bytes
    measured: dict[str, float] = {}
    for key, v in ledger.items():
        op, group = key.split("/")
        group = {"pp_grad": "pp"}.get(group, group)
        measured[group] = measured.get(group, 0.0) + v["wire_bytes"]
    assert set(planned) == set(measured), (planned, measured)
    for group, wire in measured.items():
        # data-parallel buckets: the planner leaves out the flat layout's padding (< 16 dp elements per bucket); expert
        # dispatch: the planner assumes every expert full, what a step sends depends on its routing
        rel = {"dp": 0.01, "dp_cp": 0.01, "ep": 0.3}.get(group, 1e-9)
        assert planned[group] == pytest.approx(wire, rel=rel), (group, planned, measured)
        if group == "ep":
            assert planned[group] >= wire
