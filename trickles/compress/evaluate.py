"""The held-out loss of any model (float, int8, fake-quantized) on a checkpoint's data, in one process.

``validation_loss(model, meta)`` is what :meth:`~trickles.train.trainer.Trainer.evaluate` computes at one process:
the mean token cross-entropy over ``train.eval_batches`` held-out batches of ``train.global_batch`` sequences
(``meta`` is the checkpoint's ``trainer.json``, whose config names the data), so a quantized model's loss compares
with the float model's number for number.
"""

from __future__ import annotations

import torch

from ..config import Config
from ..data import ShardedBatches, load_corpus


@torch.no_grad()
def validation_loss(model: torch.nn.Module, meta: dict, tokenizer, batches: int | None = None) -> float:
    """Mean held-out loss of ``model`` (on its device) on the data of the run ``meta`` describes."""
    cfg = Config.from_dict(meta["config"])
    t = cfg.train
    corpus = load_corpus(cfg.data, tokenizer, cfg.data.cache_dir)
    val = ShardedBatches(corpus.val, cfg.data.seq_len, t.seed)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    for i in range(batches or t.eval_batches):
        for x, y in val.val_micro_batches(i, t.global_batch, t.global_batch):
            total += float(model(x.to(device), target=y.to(device)))
            count += 1
    return total / count
