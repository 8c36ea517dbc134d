"""Sampling with a KV cache: greedy, temperature, top-k and top-p (nucleus).

The prompt is run once (prefill) filling the cache; then each new token is a single-position
forward that attends to everything cached. ``temperature == 0`` is greedy decoding.
"""

from __future__ import annotations

import torch

from .transformer import Transformer


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits [B, V]``: the argmax (``temperature == 0``), else one draw from
    :func:`sample_probs`."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(sample_probs(logits, temperature, top_k, top_p), 1, generator=generator).squeeze(-1)


def sample_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution ``[B, V]`` (fp32) that :func:`sample_next` draws from (``temperature > 0``): the softmax of
    ``logits / temperature`` restricted to the ``top_k`` largest and to the smallest prefix holding ``top_p``."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    logits_fn=None,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Continues ``prompt [B, T]`` by up to ``max_new_tokens``; returns only the new tokens ``[B, N]``.

    The prompt is cut from the left and the continuation shortened so that everything fits in
    ``model.cfg.max_seq_len``. Generation stops early when every row has produced ``eos_id``.
    ``logits_fn`` turns what the model returns into full-vocabulary logits (e.g. gathering
    tensor-parallel shards). ``labels [B]``: each row's label id, for hard-routed experts.
    """
    full = logits_fn or (lambda z: z)
    was_training = model.training
    model.eval()
    limit = model.cfg.max_seq_len
    prompt = prompt[:, -max(1, limit - 1) :]
    max_new_tokens = min(max_new_tokens, limit - prompt.shape[1])
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + max_new_tokens)
    extra = {} if labels is None else {"labels": labels}
    logits = full(model(prompt, cache=cache, start=0, **extra)[:, -1:])[:, -1]
    pos = prompt.shape[1]
    out = []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        out.append(nxt)
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = full(model(nxt[:, None], cache=cache, start=pos, **extra))[:, -1]
            pos += 1
    model.train(was_training)
    return torch.stack(out, dim=1) if out else prompt.new_zeros((prompt.shape[0], 0))
