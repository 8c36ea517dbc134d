"""How the serving engine turns one call's logits into a token for each sequence, every row as its request asks, so
that requests with different settings (logprobs or not, penalties or not, greedy or sampled) share a batch.

Per row, in vLLM's order (the penalty of step 2 and the draw of step 4 as :func:`~trickles.infer.decode.decode` takes
them for a row):

0. structured output: the grammar's mask, for the rows that have one (:func:`~.grammar.constrain`: the tokens it
   forbids get ``-inf``), so their log-probabilities are those of the masked distribution, as vLLM V1 reports them;
1. the raw log-probabilities, for the rows that ask (:mod:`.logprobs`), before anything below changes the logits;
2. the repetition penalty ``r`` over the prompt and the tokens drawn so far
   (:func:`~trickles.infer.decode.apply_repetition_penalty`);
3. OpenAI's presence and frequency penalties over the tokens generated so far (the prompt not counted), with
   ``count[t]`` the times token ``t`` was drawn: ``z[t] -= presence * (count[t] > 0) + frequency * count[t]``;
4. the argmax (temperature 0) or one draw from :func:`~trickles.models.generate.sample_next` with the row's own
   generator.

The tokens (and the logprob rows, packed with them) reach the host in one transfer per call; then each grammar
takes its row's token (:func:`~.grammar.advance`). A row whose sampling fails (its settings overflow, or its grammar
allows nothing) is returned with its error; the others are drawn.

Prompt log-probabilities (``echo`` with ``logprobs``) are read from a prefill call's logits at every position
(:func:`record_prompt`): position ``q``'s logits score prompt token ``q + 1``.
"""

from __future__ import annotations

import torch

from ..models.generate import sample_next
from .decode import apply_repetition_penalty
from .grammar import HIDDEN_LOGPROB, advance, constrain
from .logprobs import TokenLogprob, pack, prompt_records, raw_logprobs, unpack
from .requests import Sequence

__all__ = ["draw", "record_prompt"]


def _penalize(s: Sequence, logits: torch.Tensor, i: int) -> None:
    """Steps 2 and 3 on row ``i`` of ``logits``, in place; the row's token sets and counts are made on first use."""
    settings, device, vocab = s.settings, logits.device, logits.shape[-1]
    if settings.repetition_penalty != 1:
        if s.seen is None:
            s.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            s.seen[torch.tensor(s.tokens, device=device)] = True
        logits[i] = apply_repetition_penalty(
            logits[i : i + 1], s.seen[None], logits.new_tensor([settings.repetition_penalty])
        )[0]
    if settings.presence_penalty or settings.frequency_penalty:
        if s.counts is None:
            s.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if s.generated:
                s.counts.index_add_(0, torch.tensor(s.generated, device=device), s.counts.new_ones(len(s.generated)))
        penalty = settings.presence_penalty * (s.counts > 0) + settings.frequency_penalty * s.counts
        logits[i] = (logits[i].float() - penalty).to(logits.dtype)


def draw(
    seqs: list[Sequence], logits: torch.Tensor
) -> tuple[list[int], list[TokenLogprob | None], list[tuple[Sequence, BaseException]]]:
    """The next token of each of ``seqs`` from its row of ``logits [B, V]`` (changed in place), its
    :class:`~.logprobs.TokenLogprob` when it asked for logprobs, and the rows whose sampling failed with the error."""
    failed = constrain(seqs, logits)
    wants = [s.settings.logprobs for s in seqs]
    raw = raw_logprobs(logits, wants)
    if raw is not None and any(s.grammar is not None for s in seqs):
        raw[1].clamp_(min=HIDDEN_LOGPROB)  # (a forbidden token's -inf)
    for i, s in enumerate(seqs):
        _penalize(s, logits, i)
    nxt = logits.argmax(dim=-1)
    for i, s in enumerate(seqs):
        if s.settings.temperature > 0 and all(s is not f for f, _ in failed):
            try:
                z, st = logits[i : i + 1], s.settings
                nxt[i] = sample_next(z, st.temperature, st.top_k, st.top_p, s.generator)[0]
            except RuntimeError as e:  # this row's settings broke its sampling (overflow): it fails, the rest go on
                failed.append((s, e))
    tokens, records = unpack(pack(nxt, raw, wants), wants)
    broken = {id(s) for s, _ in failed}
    failed += advance(seqs, tokens, broken)
    broken = {id(s) for s, _ in failed}
    for s, tok in zip(seqs, tokens):
        if id(s) in broken:
            continue
        if s.seen is not None:
            s.seen[tok] = True
        if s.counts is not None:
            s.counts[tok] += 1
    return tokens, records, failed


def record_prompt(rows: list[tuple[Sequence, int]], out: torch.Tensor, logits_fn) -> None:
    """Appends to each row's ``prompt_logprobs`` the records of the prompt tokens its call just scored: for a row
    ``(s, n)`` that fed positions ``s.cached .. s.cached + n - 1``, right-aligned in ``out [B, T, ...]`` (the model's
    output, ``logits_fn`` turning it into logits). A position scored before (a sequence prefilled again after
    preemption) is not recorded twice."""
    width = out.shape[1]
    for b, (s, n) in enumerate(rows):
        want, c = s.settings.prompt_logprobs, s.cached
        if want is None or c != len(s.prompt_logprobs) or c >= len(s.prompt) - 1:
            continue
        m = min(c + n, len(s.prompt) - 1) - c
        z = (logits_fn or (lambda x: x))(out[b : b + 1, width - n : width - n + m])[0]
        s.prompt_logprobs.extend(prompt_records(z, s.prompt[c + 1 : c + 1 + m], want))
