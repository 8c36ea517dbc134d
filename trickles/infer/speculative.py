"""Speculative decoding in the continuous batch: a proposer guesses the next ``K`` tokens of every decoding sequence,
one call of the target model scores them all, and a rule keeps a prefix of the guesses and adds one token of the
target's own, so a step emits between 1 and ``K + 1`` tokens per sequence at about the cost of one decode step.

**Proposers.** ``ngram`` (prompt lookup decoding): the longest suffix of the sequence's tokens, ``ngram_max`` tokens
down to ``ngram_min``, that occurred earlier in prompt + generated text, at its latest earlier occurrence; the
proposal is the ``K`` tokens that followed it (read on into the proposal itself where the occurrence ends less than
``K`` tokens before the end, as a repeating text goes on). An index per sequence (n-gram -> where it last ended) is
extended by the new tokens only, so a step costs ``O(ngram_max - ngram_min + 1)`` lookups. ``draft``: a smaller model
sharing the target's tokenizer proposes ``K`` tokens one at a time, greedily for a greedy request, else sampled from
its distribution ``q`` (temperature, top-k and top-p applied as for the target; no penalties), with the request's
own generator. The draft has its own paged pool (:class:`~.paged.BlockPool`, no prefix cache, nothing slid out) and
a block table per sequence; what it holds past the tokens the target accepted is found by comparing the tokens it
was fed with the sequence's, and fed again.

**Verification** (:class:`Speculator`). Every decoding sequence feeds its last token and its ``k_s <= K`` draft
tokens in one :class:`~.paged.PagedCall` of the target (rows of different widths right-aligned, as prefill rows
are); the logits at those ``k_s + 1`` positions are ``z_0 .. z_k``, ``z_i`` scoring the token after draft ``i``.
``p_i`` is the distribution the plain sampler would draw from at position ``i`` (:mod:`.sampler`: repetition,
presence and frequency penalties over the tokens so far, the accepted drafts included, then temperature, top-k and
top-p by :func:`~trickles.models.generate.sample_probs`, the code :func:`~trickles.models.generate.sample_next`
draws with). Drafts are judged in order (:func:`accept_drafts`, Leviathan et al. 2023, Chen et al. 2023): draft
``x`` proposed from ``q`` is accepted with probability ``min(1, p(x) / q(x))``; at the first rejection the token
emitted instead is drawn from ``norm(max(0, p - q))`` and the rest are dropped; if all ``k`` are accepted a bonus
token is drawn from ``p_k``. The emitted token then follows ``p``::

    P(y) = q(y) min(1, p(y)/q(y)) + (1 - beta) max(0, p(y) - q(y)) / (1 - beta) = min(p, q)(y) + max(0, p - q)(y)
         = p(y),          beta = sum_x min(p(x), q(x)) = 1 - sum_y max(0, p(y) - q(y)),

and by induction over positions (``p_i`` depends only on the tokens accepted before it) the emitted sequence
follows the target's own distribution. A deterministic proposer (``ngram``, a greedy draft) is ``q = delta_x``:
``x`` is accepted with probability ``p(x)``, and on rejection the token is drawn from ``p`` with ``x`` removed,
renormalized. A greedy request is ``p = delta_argmax``: drafts are accepted while they equal the argmax, and the
token emitted is the argmax (:func:`accept_greedy`), so greedy output is the plain decoder's token for token.
Uniforms and redraws come from the request's own generator, so a seeded request's output is reproducible (it is
not the plain decoder's draw for draw: the random stream is used differently).

**Rolling back.** Of the ``k + 1`` positions written, the sequence keeps the last token and the ``a`` accepted
drafts (``cached += a + 1``); the keys and values at rejected positions stay in the pool unread (a query never sees
a slot past its row's end) until the next call writes those positions again. Blocks grown for the rejected tokens
past the one the next token goes to are released, and a block enters the prefix cache only once every one of its
positions is accepted (registration counts ``cached`` only). Speculation never preempts: blocks for the drafts are
taken only where free, and a sequence's drafts are cut to what its blocks hold.

**Stopping.** The emitted tokens are accepted one by one as a plain step's token is (end-of-text, stop strings,
the ``max_tokens`` budget); the tokens after a stop are dropped. A sequence proposes at most ``budget - drawn - 1``
drafts, so a step never emits past its budget or the context. Metrics: drafts proposed and drafts accepted
(``ServingMetrics.on_spec_decode``), and the same counts on :attr:`Speculator.drafted`, :attr:`Speculator.accepted`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from ..models.generate import sample_probs
from .logprobs import prompt_records
from .paged import BlockPool, PagedCall
from .requests import Sequence as Seq
from .sampler import _penalize

__all__ = ["KINDS", "DraftProposer", "NgramProposer", "Speculator", "accept_drafts", "accept_greedy", "judge"]

KINDS = ("ngram", "draft")  #: the proposers


def judge(p: torch.Tensor, x: int, q: torch.Tensor | None, generator: torch.Generator | None) -> int | None:
    """One draft token ``x`` drawn from ``q [V]`` (None: a point mass at ``x``) against the target's ``p [V]``: None
    when accepted (probability ``min(1, p(x) / q(x))``), else the token drawn instead from ``norm(max(0, p - q))``."""
    px, qx = float(p[x]), 1.0 if q is None else float(q[x])
    u = float(torch.rand((), generator=generator, device=p.device))
    if u * qx < px:
        return None
    if q is None:
        residual = p.clone()
        residual[x] = 0
    else:
        residual = (p - q).clamp_(min=0)
    if not float(residual.sum()) > 0:  # p <= q everywhere up to rounding: rejection had probability ~0
        residual = p
    return int(torch.multinomial(residual, 1, generator=generator))


def accept_drafts(
    p_at: Callable[[int], torch.Tensor],
    drafts: Sequence[int],
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a sampled sequence emits for ``drafts`` (proposed from ``q [k, V]``, None: deterministically):
    the accepted drafts and the token drawn at the first rejection, or all of them and a bonus token. ``p_at(i)`` is
    the target's distribution ``[V]`` after ``drafts[:i]``; it is called for ``i = 0, 1, ...`` in order, and only
    once ``drafts[:i]`` are accepted."""
    for i, x in enumerate(drafts):
        instead = judge(p_at(i), x, None if q is None else q[i], generator)
        if instead is not None:
            return [*drafts[:i], instead]
    return [*drafts, int(torch.multinomial(p_at(len(drafts)), 1, generator=generator))]


def accept_greedy(top_at: Callable[[int], int], drafts: Sequence[int]) -> list[int]:
    """:func:`accept_drafts` for a greedy sequence: drafts are kept while they equal the argmax ``top_at(i)``, then
    the argmax is emitted."""
    for i, x in enumerate(drafts):
        top = top_at(i)
        if top != x:
            return [*drafts[:i], top]
    return [*drafts, top_at(len(drafts))]


class NgramIndex:
    """Where each n-gram (``n_min <= n <= n_max``) of a growing token list last ended, followed by a token."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.done = 0  #: ends indexed: 1 .. done - 1 (end i: the n-gram tokens[i - n: i], followed by tokens[i])

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens after the latest earlier occurrence of the longest matching suffix of ``tokens``."""
        length = len(tokens)
        for i in range(max(1, self.done), length):
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self.ends[n][tuple(tokens[i - n : i])] = i
        self.done = length
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.ends[n].get(tuple(tokens[length - n :]))
            if start is not None:
                out: list[int] = []
                for j in range(start, start + k):  # past the end: the proposal itself (a repeat goes on)
                    out.append(tokens[j] if j < length else out[j - length])
                return out
        return []


class NgramProposer:
    """Prompt lookup decoding (see the module's notes); ``q`` is a point mass."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[Seq, NgramIndex] = {}

    def propose(self, seqs: list[Seq], want: list[int], alive) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts of at most ``want[i]`` tokens for each of ``seqs``, and None for their ``q``; sequences not in
        ``alive`` are forgotten."""
        for s in [s for s in self.index if s not in alive]:
            del self.index[s]
        drafts = []
        for s, k in zip(seqs, want):
            index = self.index.get(s) or self.index.setdefault(s, NgramIndex(self.n_min, self.n_max))
            drafts.append(index.propose(s.tokens, k) if k > 0 else [])
        return drafts, [None] * len(seqs)


class _DraftState:
    def __init__(self):
        self.table: list[int] = []
        self.cached = 0  #: positions in the draft's pool: the sequence's tokens, then ``fed``
        self.fed: list[int] = []  #: draft tokens fed after the sequence's tokens (not yet known to be accepted)


class DraftProposer:
    """A draft model proposing ``K`` tokens per sequence (see the module's notes). ``pool``: the target's, whose
    block size and device the draft's pool takes, with room for ``max_batch`` sequences' drafts on top."""

    def __init__(self, draft, target, pool: BlockPool, max_batch: int, k: int):
        if draft is None:
            raise ValueError(
                "speculative='draft' needs a draft model: give --draft DIR (a smaller model, same tokenizer)"
            )
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft.cfg.vocab_size} tokens, the target's "
                f"{target.cfg.vocab_size}: a draft must share the target's tokenizer"
            )
        self.draft = draft.eval()
        self.context = draft.cfg.max_seq_len
        blocks = pool.num_blocks + max_batch * (math.ceil(k / pool.block_size) + 1)
        self.pool = BlockPool(draft, blocks, pool.block_size, device=pool.device)
        self.state: dict[Seq, _DraftState] = {}

    def propose(self, seqs: list[Seq], want: list[int], alive) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts of at most ``want[i]`` tokens for each of ``seqs`` and, for a sampled sequence, the draft's
        distributions ``[k, V]`` they were drawn from; sequences not in ``alive`` release their draft blocks."""
        for s in [s for s in self.state if s not in alive]:
            self.pool.release(self.state.pop(s).table)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        rows = []  # (index, state, k)
        for i, (s, k) in enumerate(zip(seqs, want)):
            k = min(k, self.context - len(s.tokens))
            if k <= 0:
                continue
            st = self.state.get(s) or self.state.setdefault(s, _DraftState())
            base = st.cached - len(st.fed)
            kept = next((j for j, t in enumerate(st.fed) if s.tokens[base + j : base + j + 1] != [t]), len(st.fed))
            st.cached, st.fed = min(base + kept, len(s.tokens) - 1), []  # (at least one token to feed)
            if self.pool.grow(st.table, len(s.tokens) + k - 1):
                rows.append((i, st, k))
        step = 0
        while rows:  # one call of the draft per proposed position: the catch-up (the new tokens), then the drafts
            feed = [seqs[i].tokens[st.cached :] if step == 0 else drafts[i][-1:] for i, st, _ in rows]
            logits = self._call([st for _, st, _ in rows], feed)
            for b, (i, st, _) in enumerate(rows):
                s = seqs[i]
                st.cached += len(feed[b])
                if step > 0:
                    st.fed.append(feed[b][0])
                z, settings = logits[b : b + 1], s.settings
                if settings.temperature == 0:
                    drafts[i].append(int(z.argmax()))
                else:
                    q = sample_probs(z, settings.temperature, settings.top_k, settings.top_p)
                    drafts[i].append(int(torch.multinomial(q, 1, generator=s.generator)))
                    qs[i].append(q[0])
            step += 1
            rows = [(i, st, k) for i, st, k in rows if k > step]
        return drafts, [torch.stack(q) if q else None for q in qs]

    def _call(self, states: list[_DraftState], feed: list[list[int]]) -> torch.Tensor:
        """The draft's logits ``[B, V]`` after feeding each row's tokens ``feed[b]``."""
        new = [len(f) for f in feed]
        call = PagedCall(self.pool, [st.table for st in states], [st.cached for st in states], new)
        t = call.width
        tokens = torch.tensor([[0] * (t - len(f)) + f for f in feed], device=self.pool.device)
        out = self.draft(tokens, cache=call, start=call.start, positions=call.positions, pad_mask=call.pad_mask)
        return out[:, -1].float()


class Speculator:
    """The engine's decode step with speculation (see the module's notes): ``engine``'s config says the proposer
    (``speculative``), ``num_speculative_tokens`` and the n-gram lengths or the draft model."""

    def __init__(self, engine):
        cfg = engine.config
        if cfg.speculative not in KINDS:
            raise ValueError(f"speculative must be one of {', '.join(KINDS)} (None: off), got {cfg.speculative!r}")
        if cfg.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {cfg.num_speculative_tokens}")
        if not 1 <= cfg.ngram_min <= cfg.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={cfg.ngram_min}, ngram_max={cfg.ngram_max}"
            )
        self.engine, self.k = engine, cfg.num_speculative_tokens
        self.proposer = (
            NgramProposer(cfg.ngram_min, cfg.ngram_max)
            if cfg.speculative == "ngram"
            else DraftProposer(cfg.draft_model, engine.model, engine.pool, cfg.max_batch, self.k)
        )
        self.drafted = self.accepted = 0  #: draft tokens proposed and accepted so far

    def decode(self, seqs: list[Seq]) -> None:
        """One decode step of ``seqs`` (each with one token to feed): blocks for their last token (preempting as a
        plain step does), drafts, blocks for the drafts where free, one verifying call, the emitted tokens."""
        e = self.engine
        seqs = [s for s, _ in e._reserve([(s, 1) for s in seqs])]
        if not seqs:
            return
        want = [min(self.k, s.budget - len(s.generated) - 1) for s in seqs]
        drafts, qs = self.proposer.propose(seqs, want, set(e.running))
        for i, s in enumerate(seqs):
            if drafts[i] and not e.pool.grow(s.table, s.cached + 1 + len(drafts[i])):
                fit = max(0, len(s.table) * e.pool.block_size - s.cached - 1)  # never preempt for a draft
                drafts[i] = drafts[i][:fit]
                qs[i] = None if qs[i] is None or not fit else qs[i][:fit]
        self._verify(seqs, drafts, qs)

    def _verify(self, seqs: list[Seq], drafts: list[list[int]], qs: list[torch.Tensor | None]) -> None:
        e = self.engine
        new = [1 + len(d) for d in drafts]
        call = PagedCall(e.pool, [s.table for s in seqs], [s.cached for s in seqs], new)
        t = call.width
        tokens = [[0] * (t - n) + s.tokens[s.cached :] + d for s, n, d in zip(seqs, new, drafts)]
        try:
            tokens = torch.tensor(tokens, device=e.pool.device)
            logits = (e.logits_fn or (lambda z: z))(e._forward(call, tokens, True, seqs))  # (every rank, when several)
        except Exception as error:  # noqa: BLE001 -- reported to the requests of this call, the engine goes on
            for request in {s.request for s in seqs}:
                e._drop(request, error, "error")
            return
        top = logits.argmax(-1).tolist()  # (greedy rows: one transfer for the batch)
        now, drafted, accepted = time.perf_counter(), 0, 0
        for b, (s, n, d) in enumerate(zip(seqs, new, drafts)):
            if s.finish_reason is not None:
                continue
            z = logits[b, t - n :]
            try:
                emitted = self._emit(s, z, d, qs[b], top[b][t - n :])
                want = s.settings.logprobs
                records = [None] * len(emitted) if want is None else prompt_records(z[: len(emitted)], emitted, want)
            except RuntimeError as error:  # this row's settings broke its sampling (overflow): it fails, the rest go on
                e._drop(s.request, error, "error")
                continue
            drafted, accepted = drafted + len(d), accepted + len(emitted) - 1
            s.cached += len(emitted)  # the fed token and the accepted drafts; the last token emitted is fed next
            for tok, lp in zip(emitted, records):
                e._accept(s, tok, now, lp)
                if s.finish_reason is not None:  # a stop: the tokens after it are dropped
                    break
            else:
                self._settle(s)
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        if e.metrics is not None:
            e.metrics.on_spec_decode(drafted, accepted)

    def _emit(self, s: Seq, z: torch.Tensor, drafts: list[int], q: torch.Tensor | None, top: list[int]) -> list[int]:
        """The tokens ``s`` emits from the target's logits ``z [k + 1, V]`` at its last token and ``drafts``."""
        st = s.settings
        penalized = st.repetition_penalty != 1 or st.presence_penalty or st.frequency_penalty
        if not penalized and st.temperature == 0:
            return accept_greedy(top.__getitem__, drafts)
        if penalized:
            z = z.clone()  # (the raw logits stay for the log-probabilities)

            def logits_at(i: int) -> torch.Tensor:  # the penalties over the tokens so far, accepted drafts included
                if i > 0:
                    _note(s, drafts[i - 1])
                _penalize(s, z, i)
                return z[i]

            if st.temperature == 0:
                out = accept_greedy(lambda i: int(logits_at(i).argmax()), drafts)
            else:
                out = accept_drafts(
                    lambda i: sample_probs(logits_at(i)[None], st.temperature, st.top_k, st.top_p)[0],
                    drafts,
                    q,
                    s.generator,
                )
            _note(s, out[-1])
            return out
        p = sample_probs(z, st.temperature, st.top_k, st.top_p)
        return accept_drafts(p.__getitem__, drafts, q, s.generator)

    def _settle(self, s: Seq) -> None:
        """After ``s`` took its accepted tokens: the blocks past the one its next token goes to are released (they
        held rejected drafts only), its full blocks of accepted tokens enter the prefix cache, and what slid out of
        every window goes back to the pool."""
        pool = self.engine.pool
        keep = pool.blocks_for(s.cached + 1)
        for b in reversed(s.table[keep:]):
            pool.blocks.drop(b)
        del s.table[keep:]
        s.registered = pool.blocks.register(s.table, s.tokens, s.cached, s.keys, s.registered, s.salt)
        pool.slide(s.table, s.cached)


def _note(s: Seq, token: int) -> None:
    """``token`` joins the tokens the penalties of ``s`` count (as :func:`~.sampler.draw` notes a drawn token)."""
    if s.seen is not None:
        s.seen[token] = True
    if s.counts is not None:
        s.counts[token] += 1
