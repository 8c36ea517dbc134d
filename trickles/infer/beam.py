"""Beam search over a batch of prompts, with Hugging Face ``transformers``' semantics token for token.

Each prompt keeps ``N`` running beams (rows ``b*N .. b*N+N-1`` of one left-padded batch, see
:mod:`trickles.infer.decode`) with scores ``s`` = the sum of their tokens' log-probabilities. One step:

1. every running beam's ``log_softmax`` over the vocabulary is added to its score: ``N*V`` candidates per
   prompt, of which the best ``K = max(2, 1 + #eos) * N`` are kept (at first only beam 0 is live: the
   other beams start at ``-1e9``, so the ``N`` identical prompts do not yield ``N`` copies of one token);
2. a candidate that ends with the end-of-sequence token, or reaches ``max_new_tokens``, is *finished*; only
   the best ``N`` candidates may become finished hypotheses, scored with the length penalty ``a``

       ``score = s / n**a``      (``n``: tokens generated, the end-of-sequence token included)

   and the ``N`` best finished hypotheses so far are kept (``a > 0`` favours longer ones, ``a < 0`` shorter);
3. the best ``N`` unfinished candidates are the next running beams; their key/value cache rows are
   gathered in place (:meth:`~trickles.models.transformer.KVCache.reorder`: ``index_select`` the rows
   that change, ``index_copy_`` them back into the same storage).

A prompt is done when it cannot improve: with ``early_stopping=False`` (HF's default) when all ``N``
finished slots are filled and the best running beam's ``s / n**a`` at the current length is no better
than the worst finished score; with ``True`` as soon as ``N`` hypotheses are finished; with ``"never"``
and ``a > 0`` the running score is taken at the longest possible length instead. The search ends when
every prompt is done, or at ``max_new_tokens``. The result per prompt is the best finished hypothesis.
Scores use HF's ``-1e9`` for "impossible", so ties break as HF's do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .decode import Completion, PaddedBatch

__all__ = ["beam_search"]

NEG = -1.0e9  # HF's "impossible" score


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, K, ...]`` gathered along dim 1 by ``index [B, J]``."""
    return torch.take_along_dim(x, index.view(*index.shape, *([1] * (x.dim() - 2))), dim=1)


@torch.no_grad()
def beam_search(
    model,
    prompts: Sequence[Sequence[int]],
    num_beams: int,
    max_new_tokens: int,
    *,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos_id: int | None = None,
    tokenizer=None,
    logits_fn=None,
    labels: torch.Tensor | None = None,
) -> list[Completion]:
    """The best beam of each prompt (token-id lists of any lengths), all prompts in one batch of
    ``len(prompts) * num_beams`` rows. Prompts are cut from the left to leave room for one new token, and
    ``max_new_tokens`` shortened so the longest prompt's continuation fits ``model.cfg.max_seq_len``."""
    if num_beams < 1:
        raise ValueError(f"num_beams must be at least 1, got {num_beams}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    limit = model.cfg.max_seq_len
    prompts = [list(p)[-max(1, limit - 1) :] for p in prompts]
    m = min(max_new_tokens, limit - max(len(p) for p in prompts))
    if m <= 0:
        return [Completion([], "", "length", len(p)) for p in prompts]
    was_training = model.training
    model.eval()
    try:
        seqs, lens, scores = _search(
            model, prompts, num_beams, m, length_penalty, early_stopping, eos_id, logits_fn, labels
        )
    finally:
        model.train(was_training)
    out = []
    for b, p in enumerate(prompts):
        tokens = seqs[b, : lens[b]].tolist()
        reason = "length"
        if eos_id is not None and tokens and tokens[-1] == eos_id:
            tokens, reason = tokens[:-1], "stop"
        text = tokenizer.decode(tokens) if tokenizer is not None else ""
        out.append(Completion(tokens, text, reason, len(p), score=float(scores[b])))
    return out


def _search(model, prompts, n, m, lp, early_stopping, eos_id, logits_fn, labels):
    batch = PaddedBatch(model, prompts, m, logits_fn=logits_fn, labels=labels, repeat=n)
    device = batch.tokens.device
    b = len(prompts)
    k = max(2, 1 + (eos_id is not None)) * n
    top_n = (torch.arange(k, device=device) < n)[None, :]
    run_seq = torch.zeros(b, n, m, dtype=torch.long, device=device)
    run_scores = torch.zeros(b, n, device=device)
    run_scores[:, 1:] = NEG
    fin_seq = torch.zeros(b, n, m, dtype=torch.long, device=device)
    fin_scores = torch.full((b, n), NEG, device=device)
    fin_len = torch.zeros(b, n, dtype=torch.long, device=device)
    fin_done = torch.zeros(b, n, dtype=torch.bool, device=device)
    improvable = torch.ones(b, 1, dtype=torch.bool, device=device)
    first_row = (torch.arange(b, device=device) * n)[:, None]
    logits = batch.prefill()
    for t in range(m):
        logp = torch.log_softmax(logits.float(), dim=-1)
        v = logp.shape[-1]
        logp = (logp.view(b, n, v) + run_scores[:, :, None]).view(b, n * v)
        top_scores, top_idx = torch.topk(logp, k)
        src, tok = top_idx // v, top_idx % v
        top_seq = _take(run_seq, src)
        top_seq[:, :, t] = tok
        hits = tok == eos_id if eos_id is not None else torch.zeros_like(tok, dtype=torch.bool)
        if t + 1 >= m:
            hits = torch.ones_like(hits)
        # the next running beams: the best N candidates that did not finish
        run_lp = top_scores + hits.to(torch.float32) * NEG
        keep = torch.topk(run_lp, n)[1]
        run_seq, run_scores, run_src = _take(top_seq, keep), _take(run_lp, keep), _take(src, keep)
        # finished hypotheses: the best N of the old ones and of the top-N candidates that just finished
        just = hits & top_n
        cand = top_scores / ((t + 1) ** lp)
        full = fin_done.all(dim=-1, keepdim=True) & (early_stopping is True)
        cand = cand + full.to(torch.float32) * NEG + (~improvable).to(torch.float32) * NEG + (~just) * NEG
        merged = torch.topk(torch.cat([fin_scores, cand], dim=1), n)[1]
        fin_seq = _take(torch.cat([fin_seq, top_seq], dim=1), merged)
        fin_scores = _take(torch.cat([fin_scores, cand], dim=1), merged)
        fin_len = _take(torch.cat([fin_len, torch.full_like(tok, t + 1)], dim=1), merged)
        fin_done = _take(torch.cat([fin_done, just], dim=1), merged)
        # can a running beam still beat the worst finished one?
        best_len = m if (early_stopping == "never" and lp > 0) else t + 1
        best = run_scores[:, :1] / (best_len**lp)
        worst = torch.where(fin_done, fin_scores.min(dim=1, keepdim=True)[0], NEG)
        improvable = improvable & (best > worst).any(dim=-1, keepdim=True)
        if not (
            bool(improvable.any()) and not (bool(fin_done.all()) and early_stopping is True) and not bool(hits.all())
        ):
            break
        batch.cache.reorder((first_row + run_src).flatten())
        logits = batch.step(run_seq[:, :, t].flatten())
    return fin_seq[:, 0], fin_len[:, 0], fin_scores[:, 0]
