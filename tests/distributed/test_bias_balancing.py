"""Auxiliary-loss-free balancing across ranks: the routing bias after a few steps is the same on every rank and the
same as one process's (the loads are summed over the data- and expert-parallel replicas), and it survives a checkpoint
written by the ranks and read back by one process."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_config

from trickles.optim import lr_at
from trickles.testing import run_ranks
from trickles.train.load import load_for_inference
from trickles.train.trainer import Trainer

STEPS = 4
CPU = torch.device("cpu")
BALANCED = [
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden=32",
    "model.moe_aux_loss=0",
    "model.moe_z_loss=0",
    "model.moe_router_score=sigmoid",
    "model.moe_bias_rate=0.01",
    "train.eps=1e-6",
]


def _biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("router.e_score_correction_bias")}


def _train(tmp, dims, overrides):
    """Each MoE layer's routing bias after ``STEPS`` steps, the checkpoint then written, and the bias read back from
    it by the engine (after zeroing it)."""
    cfg = tiny_config(tmp, *BALANCED, *(f"parallel.{k}={v}" for k, v in dims.items()), *overrides, steps=STEPS)
    world = math.prod(v for k, v in dims.items() if k != "ep")
    tr = Trainer(cfg, cfg.validate(world).build(CPU), quiet=True)
    for _ in range(STEPS):
        tr.train_step()
    trained = _biases(tr.model)
    tr.save_checkpoint()  # the path on rank 0 only
    path = f"{tmp}/run/checkpoints/step_{STEPS:06d}"
    for b in _biases(tr.model):
        tr.model.get_buffer(b).zero_()
    tr.engine.load(path)
    return trained, path, _biases(tr.model)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(1, _train, str(tmp_path_factory.mktemp("bias-ref")), {}, [])[0][0]


@pytest.mark.parametrize(
    "dims,overrides",
    [
        ({"dp": 2}, ["parallel.zero=3"]),
        ({"dp": 2, "ep": 2}, []),
        ({"tp": 2}, ["parallel.sequence_parallel=true"]),
        ({"cp": 2}, []),
        ({"pp": 2}, ["train.micro_batch=2"]),
    ],
    ids=["dp2-zero3", "ep2", "tp2-sp", "cp2-ring", "pp2"],
)
def test_every_rank_holds_one_processes_bias_and_the_checkpoint_keeps_it(tmp_path, reference, dims, overrides):
    assert reference and all(b.abs().max() > 0 for b in reference.values())  # the bias moved
    results = run_ranks(2, _train, str(tmp_path), dims, overrides)
    for biases, _, reloaded in results:
        assert biases.keys() <= reference.keys() and reloaded.keys() == biases.keys()  # pp: each stage its layers
        for name, bias in biases.items():
            assert torch.allclose(bias, reference[name], atol=1e-7), (name, bias, reference[name])
            assert torch.equal(reloaded[name], bias), name  # the engine reads its checkpoint back
            for other, _, _ in results:  # every rank holding the layer the same
                assert name not in other or torch.equal(other[name], bias), name
    assert set().union(*(r[0].keys() for r in results)) == reference.keys()
    model, _, _ = load_for_inference(results[0][1], CPU)  # written by two ranks, read by one
    loaded = _biases(model)
    assert loaded.keys() == reference.keys()
    for name, bias in loaded.items():
        assert torch.allclose(bias, reference[name], atol=1e-7), name


def _pipeline_steps(tmp):
    """Each pipeline stage's biases after 2 trainer steps and after as many ``pipeline.train_step`` calls."""
    made = []
    for _ in range(2):
        cfg = tiny_config(tmp, *BALANCED[:-1], "parallel.pp=2", "train.micro_batch=2", steps=2)  # (default eps)
        made.append(Trainer(cfg, cfg.validate(2).build(CPU), quiet=True))
    by_trainer, by_api = made
    t = by_api.cfg.train
    for step in range(2):
        by_trainer.train_step()
        micro = by_api.train_data.micro_batches(step * t.global_batch, t.global_batch, by_api.micro_batch)
        tokens, targets = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        by_api.pipeline.train_step(tokens, targets, lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio))
    return _biases(by_trainer.model), _biases(by_api.model)


def test_pipeline_train_step_moves_the_routing_bias(tmp_path):
    """Through ``engine.pipeline.train_step`` (no trainer) at pp=2 each stage moves its own routers' biases after the
    step, exactly as the trainer's step does."""
    results = run_ranks(2, _pipeline_steps, str(tmp_path))
    for by_trainer, by_api in results:  # each stage its own layers' routers
        assert by_trainer and by_api.keys() == by_trainer.keys()
        for name, bias in by_trainer.items():
            assert bias.abs().max() > 0, name  # the trainer's step moved it
            assert torch.equal(by_api[name], bias), (name, by_api[name], bias)
