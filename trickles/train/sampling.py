"""A sample from the model a run is training (``train.sample_tokens``; ``Trainer.sample``)."""

from __future__ import annotations

import contextlib

import torch

from ..memory.precision import autocast
from ..models.generate import generate
from ..parallel.pipeline.runner import PipelinedModel


def sample(tr, prompt: str, n_tokens: int, label: str | None = None) -> str:
    """Prompt plus ``n_tokens`` sampled from trainer ``tr``'s current model (settings from ``[train]``); hard-routed
    experts decode with ``label``'s experts (default: the first label)."""
    t = tr.cfg.train
    ids = tr.tokenizer.encode(prompt) or [tr.tokenizer.eos_id]
    g = torch.Generator(device=tr.device).manual_seed(t.seed)
    model = tr.model
    if tr.pipeline is not None:
        vocab_local = tr.model_cfg.vocab_size // tr.topo.dims.tp
        model = PipelinedModel(tr.pipeline, tr.model, vocab_local)
    with autocast(tr.cfg.memory.precision, tr.device), _eager():
        new = generate(
            model,
            torch.tensor([ids], device=tr.device),
            n_tokens,
            t.sample_temperature,
            t.sample_top_k,
            eos_id=tr.tokenizer.eos_id,
            generator=g,
            logits_fn=tr.engine.full_logits,
            labels=tr.label_ids(label or tr.label_names[0]) if tr.label_names else None,
        )
    return prompt + tr.tokenizer.decode(new[0].tolist())


def _eager():
    """Runs compiled blocks eagerly (decoding shapes would only trigger recompilation)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()
