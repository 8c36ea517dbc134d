"""The memory report under pipeline stages: every stage's model states and the activations it holds over the
micro-batches in flight, predicted against measured on the ranks, for each schedule."""

import pytest
import torch
from helpers import tiny_config

from trickles.memory.report import measure, predict
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
EXACT = ("parameters", "gradients", "optimizer", "activations", "head", "held", "host", "checkpoint_host")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This run's tokenized-data cache, shared by the module's tests (spawned ranks get it in their overrides)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('memory-pp-cache')}"


def _stages(tmp, cache, world, overrides):
    cfg = tiny_config(tmp, cache, "train.micro_batch=2", "train.global_batch=8", *overrides, steps=3)
    tr = Trainer(cfg, cfg.validate(world).build(CPU), quiet=True)
    rep = measure(tr, predict(tr.cfg, tr.topo.dims, tr.model_cfg), steps=2)
    if not rep.stages_measured:
        return None
    return (
        rep.stages,
        rep.stages_measured,
        rep.stage,
        rep.layers_predicted,
        rep.layers_measured,
        tr.pipeline.peak_alive,
        rep.table(),
    )


# each schedule (pp=2; interleaved and zb-v with 2 chunks of 4 layers), and pp=2 x dp=2 with ZeRO-1, offload, bf16,
# dropout, and with ZeRO-2 and ZeRO-3;
# zero-bubble: model states, saved activations (held from F to W) and held bytes exact, the peak with the gradients B
# records for W
CASES = {
    "gpipe": (2, ["parallel.pp=2", "parallel.schedule=gpipe"]),
    "1f1b": (2, ["parallel.pp=2", "parallel.schedule=1f1b"]),
    # each rank's first layer recomputed whole, its second elementwise (memory.recompute_num_layers)
    "interleaved-full:1+elementwise": (
        2,
        [
            "parallel.pp=2",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "model.n_layers=4",
            "memory.recompute=full",
            "memory.recompute_num_layers=1",
            "memory.recompute_rest=elementwise",
        ],
    ),
    "zb-h1-elementwise": (2, ["parallel.pp=2", "parallel.schedule=zb-h1", "memory.recompute=elementwise"]),
    # norms after the branches only: the last stage's B ends in the branch's input gradient, no norm's backward
    "zb-h1-post": (2, ["parallel.pp=2", "parallel.schedule=zb-h1", "model.norm_placement=post"]),
    "zb-v": (2, ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "model.n_layers=4"]),
    "gpt2-tied-bf16-dropout": (
        2,
        [
            "parallel.pp=2",
            "model.preset=gpt2-tiny",
            "memory.precision=bf16",
            "model.dropout=0.1",
            "model.n_layers=3",
            "memory.recompute=selective",
        ],
    ),
    "dp2-zero1-offload": (
        4,
        [
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.zero=1",
            "memory.offload_optimizer=true",
            "train.global_batch=16",
            "memory.recompute=full",
        ],
    ),
    # ZeRO-2: the shard held, the step's full gradient buffer transient; ZeRO-3: shards held, the units gathered and the
    # reductions in flight estimated (the peak within 10%: "estimated" in the table)
    # four stages, the ends lighter (the embedding's and the head's stage one layer each); micro-batches of one row
    # (each in its own storage: a view of the batch would keep all of it alive in the embedding's saved ids)
    "pp4-uneven": (
        4,
        ["parallel.pp=4", "model.n_layers=8", "parallel.pipeline_layers=[1, 3, 3, 1]", "train.micro_batch=1"],
    ),
    "dp2-zero2": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2", "train.global_batch=16"]),
    "dp2-zero3": (
        4,
        ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "train.global_batch=16", "model.n_layers=4"],
    ),
}

# the peak: within 0.3% (a few hundred bytes of ~2 MiB: what the step allocates beside the counted tensors) where every
# transient is counted; where full recomputation reruns a chunk, where gpt2's bf16 LayerNorm and GELU upcast, and where
# the offloaded optimizer's step runs, the transients are the formulas' estimates (measured: 0.6%, 2.5%, 1.1%)
PEAK = {"interleaved-full:1+elementwise": 0.03, "gpt2-tied-bf16-dropout": 0.03, "dp2-zero1-offload": 0.03}


@pytest.mark.parametrize("case", list(CASES))
def test_every_stage_predicted_equals_measured(tmp_path, cache, case):
    world, overrides = CASES[case]
    results = run_ranks(world, _stages, str(tmp_path), cache, world, overrides)
    stages, measured, top, layers_pred, layers_meas, alive, table = results[0]
    assert all(r is None for r in results[1:])  # rank 0 gathers every stage
    pp = 4 if "parallel.pp=4" in overrides else 2
    assert len(stages) == len(measured) == pp
    for r, (pred, meas) in enumerate(zip(stages, measured)):
        for key in EXACT:
            assert meas[key] == pred[key], (case, r, key, pred[key], meas[key])
        if case.endswith("zero3"):
            assert abs(meas["peak"] - pred["peak"]) <= 0.04 * pred["peak"] and "estimated" in table, (
                r,
                pred["peak"],
                meas["peak"],
            )
            continue
        assert abs(meas["peak"] - pred["peak"]) <= PEAK.get(case, 0.003) * pred["peak"], (
            case,
            r,
            pred["peak"],
            meas["peak"],
        )
    assert top == max(range(pp), key=lambda r: stages[r]["peak"])
    assert layers_meas == layers_pred
    assert "stage 0: layers" in table and "stage 1: layers" in table
    if case == "zb-v":  # the V: the embedding and the head both on rank 0
        assert "stage 0: layers 0, 3 + embedding + head: model states" in table
        assert "stage 1: layers 1-2: model states" in table
