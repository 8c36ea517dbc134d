"""Multi-head latent attention's saved tensors on two ranks (trickles/memory/latent_activations.py): tensor
parallelism with and without sequence parallelism (heads split, the compressions replicated), the context-parallel
ring (v padded to the q/k head size) and the all-to-all (whole sequences on half the heads; with packed documents) --
each rank's bytes per layer and for the head equal the formula."""

import pytest
import torch
from helpers import MLA_SHAPE, short_documents, tiny_config

from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

MLA = MLA_SHAPE

LAYOUTS = {
    "tp2": ("parallel.tp=2", "model.q_lora_rank=24"),
    "tp2-sp-bf16-selective": (
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "model.q_lora_rank=none",
        "memory.precision=bf16",
        "memory.recompute=selective",
    ),
    "cp2-ring": ("parallel.cp=2", "model.q_lora_rank=24"),
    "cp2-ulysses-bf16": (
        "parallel.cp=2",
        "parallel.cp_mode=ulysses",
        "model.q_lora_rank=none",
        "memory.precision=bf16",
    ),
    "cp2-ulysses-fused-documents": (
        "parallel.cp=2",
        "parallel.cp_mode=ulysses",
        "model.q_lora_rank=24",
        "model.v_head_dim=12",
        "data.document_mask=true",
    ),
}


def _activations(tmp, overrides):
    cfg = tiny_config(
        tmp, f"data.cache_dir={tmp}/cache", *MLA, *overrides, "train.micro_batch=2", "train.global_batch=2", steps=1
    )
    tr = Trainer(cfg, cfg.validate(2).build(torch.device("cpu")), quiet=True)
    batch = tr._shard(tr.train_data.micro_batches(0, 2, 2))[0]
    ids = batch[3] if cfg.data.document_mask else None
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(batch[0], batch[1], None, ids)
    loss.backward()
    return tr.model_cfg, meter.per_layer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_latent_attention_activations_on_two_ranks(tmp_path, layout):
    overrides = LAYOUTS[layout]
    if "data.document_mask=true" in overrides:
        overrides = (*overrides, *short_documents(tmp_path / "lines.jsonl"))
    sets = dict(o.split("=") for o in overrides)
    for cfg, measured in run_ranks(2, _activations, str(tmp_path), overrides):
        predicted = activation_bytes(
            cfg,
            2,
            32,
            sets.get("memory.recompute", "none"),
            2 if sets.get("memory.precision") == "bf16" else 4,
            tp=int(sets.get("parallel.tp", 1)),
            sequence_parallel=sets.get("parallel.sequence_parallel") == "true",
            cp=int(sets.get("parallel.cp", 1)),
            cp_mode=sets.get("parallel.cp_mode", "ring"),
            documents=sets.get("data.document_mask") == "true",
        )
        assert measured == {
            "head": predicted["head"],
            **{f"layers.{i}": b for i, b in enumerate(predicted["per_layer"])},
        }
