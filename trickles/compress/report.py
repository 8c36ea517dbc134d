"""``trickles compress report``: checkpoints side by side -- size, quality and decoding speed.

For each checkpoint, in one table:

* **parameters**: every parameter of the model once (a tied embedding once);
* **MB on disk**: the bytes of its model weight files (``model*.safetensors``; optimizer state is left out, a
  pruned checkpoint has none);
* **val loss / perplexity**: the mean token cross-entropy ``L`` over the held-out data of the *first*
  checkpoint's run (every model sees the same tokens; ``train.eval_batches`` batches of ``train.global_batch``
  sequences, as the run evaluated), and ``exp(L)``;
* **decode tok/s**: greedy decoding of ``tokens`` new tokens after a one-token prompt, batch 1, with the KV
  cache, the fastest of three timed runs after an untimed warm-up (wall clock, so it depends on the machine and its
  load).

Every model is read through :func:`load_model`, the one place that turns a checkpoint into a module; a
checkpoint format with other weights (int8) plugs in there.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from ..config import Config
from ..data import ShardedBatches, load_corpus
from ..errors import UserError
from ..train import checkpoint as ckpt
from ..train.load import load_for_inference
from .checkpoint import load_checkpoint


def load_model(path: str, device: torch.device | str = "cpu", fused_proj: bool | None = None):
    """``(model, tokenizer, trainer_meta, checkpoint_dir)`` of a checkpoint directory, ``checkpoints`` folder or run's
    out_dir, float or int8 (:mod:`trickles.compress.checkpoint`, weight-only), verified against its manifest;
    ``fused_proj`` overrides how a float model computes its projections."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} does not exist; give a checkpoint directory or a run's out_dir")
    path = ckpt.resolve(path)
    ckpt.verify(path)
    if ckpt.read_json(os.path.join(path, "trainer.json")).get("quantization"):
        model, tokenizer, meta = load_checkpoint(path, device, verify=False)
    else:
        model, tokenizer, meta = load_for_inference(path, device, verify=False, fused_proj=fused_proj)
    return model, tokenizer, meta, path


def parameter_count(model: torch.nn.Module) -> int:
    """The model's weights, each once: its parameters and an int8 layer's codes and bias (not its scales)."""
    from ..models.transformer import count_params
    from .quantize import Int8Linear

    int8 = sum(
        m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
        for m in model.modules()
        if isinstance(m, Int8Linear)
    )
    return count_params(model) + int8


def calibration_batches(meta: dict, tokenizer, split: str, count: int, batch: int | None = None):
    """``count`` batches ``(inputs, targets)`` of the run's data that ``meta`` (a trainer.json) describes: the first
    training batches in the run's order (``split="train"``) or its held-out batches (``"val"``)."""
    cfg = Config.from_dict(meta["config"])
    corpus = load_corpus(cfg.data, tokenizer, cfg.data.cache_dir)
    rows = batch or cfg.train.global_batch
    tokens = corpus.train if split == "train" else corpus.val
    data = ShardedBatches(tokens, cfg.data.seq_len, cfg.train.seed)
    if split == "train":
        return [b[:2] for i in range(count) for b in data.micro_batches(i * rows, rows, rows)]
    if len(tokens) <= cfg.data.seq_len:
        raise UserError(
            f"the run's held-out split has {len(tokens)} tokens, fewer than one sequence; "
            "set data.val_fraction in the run that wrote the first checkpoint"
        )
    return [b[:2] for i in range(count) for b in data.val_micro_batches(i, rows, rows)]


@dataclass
class Row:
    """One checkpoint's line of the report."""

    name: str
    params: int
    disk_bytes: int
    val_loss: float
    tokens_per_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.val_loss) if self.val_loss < 700 else math.inf


def disk_bytes(path: str) -> int:
    """Bytes of the model weight files of the checkpoint directory ``path``."""
    return sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if n.startswith("model") and n.endswith(".safetensors")
    )


@torch.no_grad()
def val_loss(model, batches) -> float:
    """Mean of the model's loss over ``batches`` (moved to the model's device)."""
    device = next(model.parameters()).device
    model.eval()
    total = sum(float(model(x.to(device), target=y.to(device))) for x, y in batches)
    return total / len(batches)


def validation_loss(model: torch.nn.Module, meta: dict, tokenizer, batches: int | None = None) -> float:
    """What :meth:`~trickles.train.trainer.Trainer.evaluate` computes at one process, for any model (float, int8,
    fake-quantized): the mean token cross-entropy over ``train.eval_batches`` (or ``batches``) held-out batches of
    ``train.global_batch`` sequences of the run ``meta`` (a ``trainer.json``) describes."""
    count = batches or int(meta["config"].get("train", {}).get("eval_batches", 4)) or 4
    return val_loss(model, calibration_batches(meta, tokenizer, "val", count))


@torch.no_grad()
def decode_speed(model, tokens: int, vocab: int) -> float:
    """New tokens per second of greedy batch-1 decoding after a one-token prompt (one untimed warm-up)."""
    from ..models.generate import generate

    tokens = min(tokens, model.cfg.max_seq_len - 1)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    generate(model, prompt, tokens, temperature=0.0)  # warm-up: first calls allocate and pick kernels
    best = math.inf
    for _ in range(3):  # the fastest of three: the least disturbed by whatever else the machine runs
        start = time.perf_counter()
        out = generate(model, prompt, tokens, temperature=0.0)
        best = min(best, time.perf_counter() - start)
    return out.shape[1] / best


def compress_report(paths: list[str], tokens: int = 64, batches: int | None = None) -> list[Row]:
    """The report's rows, in the order given (see the module doc)."""
    if not paths:
        raise UserError("give at least one checkpoint to report on")
    if tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {tokens}")
    rows, data, vocab = [], None, None
    for p in paths:
        model, tokenizer, meta, path = load_model(p)
        if data is None:
            count = batches or int(meta["config"].get("train", {}).get("eval_batches", 4)) or 4
            data = calibration_batches(meta, tokenizer, "val", count)
            vocab = tokenizer.vocab_size
        elif tokenizer.vocab_size != vocab:
            raise UserError(
                f"{p} has a tokenizer of {tokenizer.vocab_size} tokens, {paths[0]} one of {vocab}; "
                "report checkpoints that read the same tokens"
            )
        rows.append(
            Row(p, parameter_count(model), disk_bytes(path), val_loss(model, data), decode_speed(model, tokens, vocab))
        )
        del model
    return rows


def report_table(rows: list[Row]) -> str:
    """The rows as an aligned text table (parameters and size also relative to the first row)."""
    head = ("checkpoint", "params", "MB on disk", "val loss", "perplexity", "decode tok/s")
    base = rows[0]
    lines = [head]
    for r in rows:
        rel = "" if r is base else f" ({r.params / base.params:.2f}x)"
        lines.append(
            (
                r.name,
                f"{r.params:,}{rel}",
                f"{r.disk_bytes / 1e6:.2f}",
                f"{r.val_loss:.4f}",
                f"{r.perplexity:.2f}",
                f"{r.tokens_per_s:,.0f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))  # noqa: E731
    return "\n".join([fmt(lines[0]), "  ".join("-" * w for w in widths), *map(fmt, lines[1:])])
