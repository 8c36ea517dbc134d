"""Auxiliary-loss-free balancing through ``engine.pipeline.train_step`` (one call per step, no trainer): at pp=2 each
stage moves its own routers' biases after the step, exactly as the trainer's step does."""

from __future__ import annotations

import torch
from helpers import tiny_config

from trickles.optim import lr_at
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
STEPS = 2
BALANCED = [
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden=32",
    "model.moe_aux_loss=0",
    "model.moe_z_loss=0",
    "model.moe_router_score=sigmoid",
    "model.moe_bias_rate=0.01",
    "parallel.pp=2",
    "train.micro_batch=2",
]


def _biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("router.e_score_correction_bias")}


def _steps(tmp):
    """Each stage's biases after ``STEPS`` trainer steps and after as many ``pipeline.train_step`` calls."""
    made = []
    for _ in range(2):
        cfg = tiny_config(tmp, *BALANCED, steps=STEPS)
        made.append(Trainer(cfg, cfg.validate(2).build(CPU), quiet=True))
    by_trainer, by_api = made
    t = by_api.cfg.train
    for step in range(STEPS):
        by_trainer.train_step()
        micro = by_api.train_data.micro_batches(step * t.global_batch, t.global_batch, by_api.micro_batch)
        tokens, targets = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        by_api.pipeline.train_step(tokens, targets, lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio))
    return _biases(by_trainer.model), _biases(by_api.model)


def test_pipeline_train_step_moves_the_routing_bias(tmp_path):
    results = run_ranks(2, _steps, str(tmp_path))
    for by_trainer, by_api in results:  # each stage its own layers' routers
        assert by_trainer and by_api.keys() == by_trainer.keys()
        for name, bias in by_trainer.items():
            assert bias.abs().max() > 0, name  # the trainer's step moved it
            assert torch.equal(by_api[name], bias), (name, by_api[name], bias)
