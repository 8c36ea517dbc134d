"""Batched decoding: many prompts of different lengths in one batch, each row stopping on its own.

**Left padding.** Prompts of lengths ``L_b`` are right-aligned in a ``[B, T]`` batch (``T = max L_b``,
``pad_b = T - L_b`` padding slots on the left). Cache slot ``s`` of row ``b`` holds the token at position
``s - pad_b``, so every row's positions are its own (``0..L_b-1`` for the prompt, ``L_b + i`` for its
``i``-th new token) whether gpt2 looks them up in its learned table or llama rotates by them; and
``pad_mask [B, S]`` (slot ``s`` is real iff ``s >= pad_b``) keeps every query from attending to padding.
A row therefore computes what it would alone, up to the summation order of the batched matmuls.
With prompts of one length nothing is padded and the model is called exactly as before (which is what
a pipelined or context-parallel model understands).

**One step** turns the last position's logits ``z`` into a token per row, in Hugging Face's order:

* repetition penalty ``r`` (CTRL; HF's ``RepetitionPenaltyLogitsProcessor``): for every token id already
  in the row (prompt or generated), ``z <- z / r`` if ``z > 0`` else ``z * r``;
* ``temperature == 0``: the argmax (greedy); otherwise ``softmax(z / temperature)`` restricted to the
  ``top_k`` largest and to the smallest prefix holding ``top_p`` of the mass, and one draw from it
  (:func:`trickles.models.generate.sample_next`).

**Stopping, per row**: the end-of-sequence token (not part of the text), a stop string (the text is cut
before it; the row stops as soon as the string appears), or ``max_new_tokens`` (or the model's context):
``finish_reason`` "stop", "stop", "length" as in OpenAI's API. The batch ends when every row has.

**Seeds.** With one shared ``generator`` all sampled rows are drawn in one ``multinomial`` call per step (the
draws then depend on the batch, as in :func:`trickles.models.generate.generate`); otherwise each row draws
from its own generator seeded by its ``seed`` (random when None), so a request's text does not depend on
what it was batched with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.generate import sample_next
from .grammar import JsonFormat

__all__ = ["Sampling", "Completion", "PaddedBatch", "decode", "apply_repetition_penalty", "TextTracker"]


@dataclass
class Sampling:
    """How one prompt is continued."""

    max_new_tokens: int = 16  #: at most this many new tokens (fewer where the model's context ends)
    temperature: float = 1.0  #: 0: greedy
    top_k: int = 0  #: sample among the k most likely tokens (0: all)
    top_p: float = 1.0  #: sample among the most likely tokens holding this much probability (1: all)
    repetition_penalty: float = 1.0  #: > 1 discourages tokens already in the row (1: off)
    stop: tuple[str, ...] = ()  #: stop strings: the text ends before the first one to appear
    seed: int | None = None  #: the row's own generator (None: a random seed)
    presence_penalty: float = 0.0  #: OpenAI's: subtracted from the logit of every token generated so far (engine)
    frequency_penalty: float = 0.0  #: OpenAI's: times each token's count among those generated so far (engine)
    logprobs: int | None = None  #: each drawn token's log-probability and the N most likely (engine; None: off)
    prompt_logprobs: int | None = None  #: the same for every prompt token after the first (engine; None: off)
    response_format: JsonFormat | None = None  #: structured output: the reply's JSON (engine, :mod:`.grammar`)

    def validate(self) -> None:
        """ValueError saying which field is wrong and what it must be."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {self.temperature:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be at least 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p:g}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1: off), got {self.repetition_penalty:g}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number (0: off), got {getattr(self, name):g}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0 (None: off), got {getattr(self, name)}")

    @property
    def engine_only(self) -> list[str]:
        """The settings set here that only the continuous-batching engine applies (not :func:`decode`)."""
        return [
            name
            for name, off in (
                ("presence_penalty", 0),
                ("frequency_penalty", 0),
                ("logprobs", None),
                ("prompt_logprobs", None),
                ("response_format", None),
            )
            if getattr(self, name) != off
        ]

    def for_choice(self, j: int) -> Sampling:
        """The settings of choice ``j`` of ``n``: a seeded request's choice ``j`` draws with ``seed + j``."""
        return self if self.seed is None or j == 0 else dataclasses.replace(self, seed=self.seed + j)

    def generator(self, device) -> torch.Generator:
        """A generator of its own on ``device``, seeded with ``seed`` (a random seed when None)."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


@dataclass
class Completion:
    """One row's result."""

    tokens: list[int]  #: the new tokens (the end-of-sequence token left out)
    text: str  #: their text, cut before a stop string ('' without a tokenizer)
    finish_reason: str  #: "stop" (end of sequence or a stop string) or "length"
    prompt_tokens: int  #: tokens of the prompt the model saw (after any cut from the left)
    score: float | None = None  #: beam search: the length-normalized log-probability
    logprobs: list | None = None  #: the engine with ``Sampling.logprobs``: a ``TokenLogprob`` per new token
    prompt_logprobs: list | None = None  #: with ``Sampling.prompt_logprobs``: one per prompt token after the first


class PaddedBatch:
    """The model calls of a left-padded batch with a KV cache: :meth:`prefill` once, then :meth:`step` per token.

    ``repeat`` repeats each prompt that many times in a row (the beams of beam search). ``logits_fn`` turns
    what the model returns into full-vocabulary logits (e.g. gathering tensor-parallel shards); ``labels [B]``
    are hard-routed experts' label ids (one per prompt).
    """

    def __init__(
        self,
        model,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        *,
        logits_fn=None,
        labels: torch.Tensor | None = None,
        repeat: int = 1,
        device=None,
    ):
        device = device or next(model.parameters()).device
        self.model, self.full = model, logits_fn or (lambda z: z)
        lengths = [len(p) for p in prompts for _ in range(repeat)]
        if not lengths or min(lengths) == 0:
            raise ValueError("every prompt needs at least one token")
        self.width = max(lengths)
        self.lengths = torch.tensor(lengths, device=device)
        self.pad = self.width - self.lengths
        self.padded = bool((self.pad > 0).any())
        rows = [list(p) for p in prompts for _ in range(repeat)]
        self.tokens = torch.tensor([[0] * (self.width - len(r)) + r for r in rows], device=device)
        self.repeat, self.size = repeat, self.width + new_tokens
        self.cache = None
        self.pad_mask = torch.arange(self.size, device=device)[None, :] >= self.pad[:, None] if self.padded else None
        self.labels = labels
        self.extra = {} if labels is None else {"labels": labels.repeat_interleave(repeat)}
        self.done_steps = 0

    def _call(
        self, tokens: torch.Tensor, start: int, positions: torch.Tensor, cache=None, pad_mask=None, extra=None
    ) -> torch.Tensor:
        kw = dict(self.extra if extra is None else extra)
        if self.padded:
            kw.update(positions=positions, pad_mask=self.pad_mask if pad_mask is None else pad_mask)
        out = self.model(tokens, cache=self.cache if cache is None else cache, start=start, **kw)
        return self.full(out[:, -1:])[:, -1]

    def prefill(self) -> torch.Tensor:
        """The next-token logits ``[B, V]`` after each prompt.

        With ``repeat > 1`` each prompt runs once and its key/value rows are then repeated (one allocation of the
        batch's cache, not a prefill per beam)."""
        r = self.repeat
        positions = (torch.arange(self.width, device=self.tokens.device)[None, :] - self.pad[:, None]).clamp(min=0)
        if r == 1:
            self.cache = self.model.new_cache(len(self.tokens), self.size)
            return self._call(self.tokens, 0, positions)
        once = self.model.new_cache(len(self.tokens) // r, self.size)
        extra = {} if self.labels is None else {"labels": self.labels}
        logits = self._call(
            self.tokens[::r],
            0,
            positions[::r],
            cache=once,
            pad_mask=None if self.pad_mask is None else self.pad_mask[::r],
            extra=extra,
        )
        self.cache = self.model.new_cache(len(self.tokens), self.size)
        for table, full in ((once.k, self.cache.k), (once.v, self.cache.v)):
            for layer, t in table.items():
                full[layer] = t.repeat_interleave(r, dim=0)
        self.cache.end = once.end
        return logits.repeat_interleave(r, dim=0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token per row ``[B]``; the logits ``[B, V]`` after it."""
        i = self.done_steps
        self.done_steps += 1
        # a row that has used up its context has finished; it is still fed (at its last position) until the batch ends
        positions = (self.lengths + i).clamp(max=self.model.cfg.max_seq_len - 1)
        return self._call(tokens[:, None], self.width + i, positions[:, None])


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's repetition penalty: where ``seen [B, V]``, ``z / r`` for ``z > 0`` and ``z * r`` otherwise
    (``penalty [B]``)."""
    r = penalty.to(logits.dtype)[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)


class TextTracker:
    """One row's text as tokens arrive: stop strings, and the part that is safe to stream.

    Text is streamed only once it can no longer change: trailing replacement characters (an incomplete
    UTF-8 sequence) and a tail that could still become a stop string are held back.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.text, self.sent = "", 0

    def update(self, tokens: list[int]) -> bool:
        """Decodes ``tokens``; True when a stop string appeared (the text is then cut before it)."""
        if self.tokenizer is None:
            return False
        self.text = self.tokenizer.decode(tokens)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def delta(self, final: bool) -> str:
        """The text not streamed yet that can no longer change (all of it when ``final``)."""
        end = len(self.text)
        if not final:
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
            for s in self.stop:  # the longest tail that is a proper prefix of a stop string
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text[end - n : end] == s[:n]:
                        end -= n
                        break
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out


@torch.no_grad()
def decode(
    model,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling | Sequence[Sampling],
    *,
    eos_id: int | None = None,
    tokenizer=None,
    generator: torch.Generator | None = None,
    logits_fn=None,
    labels: torch.Tensor | None = None,
    on_text: Callable[[int, str, str | None], None] | None = None,
) -> list[Completion]:
    """Continues every prompt (lists of token ids, any lengths) in one batch; one :class:`Completion` per prompt.

    ``sampling``: one :class:`Sampling` for all rows or one per row. A prompt is cut from the left to leave room
    for at least one new token in ``model.cfg.max_seq_len``, and its continuation to fit there. ``tokenizer``
    (needed for stop strings) gives each completion its text. ``generator``: one generator shared by all rows
    (see the module's notes); otherwise each row's own seed. ``on_text(row, delta, finish_reason)`` is called
    with each piece of text as it becomes final, and once more per row with its ``finish_reason`` when it ends.
    """
    settings = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
    if len(settings) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(settings)} sampling settings")
    for s in settings:
        s.validate()
        if s.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if s.engine_only:
            raise ValueError(f"{', '.join(s.engine_only)}: only the continuous-batching engine applies these")
    limit = model.cfg.max_seq_len
    prompts = [list(p)[-max(1, limit - 1) :] for p in prompts]
    budgets = [min(s.max_new_tokens, limit - len(p)) for s, p in zip(settings, prompts)]
    b = len(prompts)
    rows: list[list[int]] = [[] for _ in range(b)]
    reasons: list[str | None] = [None] * b
    texts = [TextTracker(tokenizer, s.stop) for s in settings]

    def finish(i: int, reason: str) -> None:
        reasons[i] = reason
        if on_text is not None:
            delta = texts[i].delta(final=True)
            if delta:
                on_text(i, delta, None)
            on_text(i, "", reason)

    for i in range(b):
        if budgets[i] <= 0:
            finish(i, "length")
    was_training = model.training
    model.eval()
    try:
        if any(r is None for r in reasons):
            _run(
                model,
                prompts,
                settings,
                budgets,
                rows,
                reasons,
                texts,
                finish,
                eos_id,
                generator,
                logits_fn,
                labels,
                on_text,
            )
    finally:
        model.train(was_training)
    return [Completion(rows[i], texts[i].text, reasons[i], len(prompts[i])) for i in range(b)]


def _run(
    model, prompts, settings, budgets, rows, reasons, texts, finish, eos_id, generator, logits_fn, labels, on_text
):
    batch = PaddedBatch(model, prompts, max(budgets), logits_fn=logits_fn, labels=labels)
    device = batch.tokens.device
    b = len(prompts)
    logits = batch.prefill()
    vocab = logits.shape[-1]
    penalty = torch.tensor([s.repetition_penalty for s in settings], device=device)
    seen = None
    if bool((penalty != 1).any()):
        seen = torch.zeros(b, vocab, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            seen[i, torch.tensor(p, device=device)] = True
    uniform = len({(s.temperature, s.top_k, s.top_p) for s in settings}) == 1
    gens = None if generator is not None else [s.generator(device) for s in settings]
    for _ in range(max(budgets)):
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, penalty)
        if generator is not None and uniform:  # every row in one draw (the CLI's and the trainer's way)
            s = settings[0]
            nxt = sample_next(logits, s.temperature, s.top_k, s.top_p, generator)
        else:
            nxt = logits.argmax(dim=-1)
            for i, s in enumerate(settings):
                if s.temperature > 0 and reasons[i] is None:
                    nxt[i] = sample_next(
                        logits[i : i + 1],
                        s.temperature,
                        s.top_k,
                        s.top_p,
                        generator if generator is not None else gens[i],
                    )[0]
        if seen is not None:
            seen[torch.arange(b, device=device), nxt] = True
        for i, tok in enumerate(nxt.tolist()):
            if reasons[i] is not None:
                continue
            if eos_id is not None and tok == eos_id:
                finish(i, "stop")
                continue
            rows[i].append(tok)
            if texts[i].update(rows[i]):
                finish(i, "stop")
            elif len(rows[i]) >= budgets[i]:
                finish(i, "length")
            elif on_text is not None:
                delta = texts[i].delta(final=False)
                if delta:
                    on_text(i, delta, None)
        if all(r is not None for r in reasons):
            break
        logits = batch.step(nxt)
