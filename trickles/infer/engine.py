"""Continuous batching: one scheduler owns the model and advances every running sequence each iteration.

**A request** is a prompt (token ids), its :class:`~trickles.infer.decode.Sampling` and ``n`` choices; each choice
is a :class:`Sequence` with its own generator (choice ``j`` of a seeded request uses ``seed + j``), text tracker
(stop strings) and block table in the paged cache (:mod:`trickles.infer.paged`). Sequences wait in arrival order.

**One iteration** (:meth:`Engine.step`):

1. cancelled sequences leave and free their blocks;
2. waiting sequences are admitted in order while fewer than ``max_batch`` run and the pool has blocks for their
   tokens (their first chunk, see Windows) with one block to spare for every running sequence (to grow);
3. **prefill**: sequences with more than one token not yet in the cache feed up to ``prefill_chunk`` of them in
   total, oldest first, in one model call (a long prompt is thus spread over several iterations and decoding of
   the others is never stalled for more than one chunk); a sequence whose prompt is then all cached draws its
   first token;
4. **decode**: every sequence with exactly one token to feed (its last) feeds it in one model call and draws
   the next. A sequence that needs a new block when none is free preempts the sequence admitted last (its
   blocks are freed and it waits at the front of the queue; when admitted again it prefills its prompt and the
   tokens drawn so far, and goes on drawing from where its generator stands: vLLM's recompute preemption);
5. sequences that stop (end-of-text token, a stop string, their budget) leave and free their blocks.

Tokens are drawn per row as :func:`trickles.infer.decode.decode` draws them for a row of its own, with OpenAI's
presence and frequency penalties and log-probabilities on top (:mod:`.sampler`), so a request's tokens do not depend
on what it ran with, up to float rounding of batched matmuls. A request with prompt log-probabilities gets them from
its prefill calls' logits at every position, and is prefilled even when it asks for no new token. A request with a
``response_format`` draws every token under its JSON grammar (:mod:`.grammar`: compiled at :meth:`Engine.submit`, a
matcher per choice, the mask applied to its rows only).

**Budgets.** A prompt is cut from the left to leave room for a token in the context; ``max_new_tokens`` is
shortened to what the context and the whole pool leave (``finish_reason: "length"``). A prompt that does not fit
in the pool at all is refused at :meth:`Engine.submit` (:class:`PoolTooSmall`); nothing can run out of memory
mid-batch, since the sequence admitted first can always take the blocks of the ones after it. So a sequence that
waits while nothing runs always fits in the free blocks; one that does not (blocks lost to a bug) could wait forever,
and instead fails at once with :class:`PoolStalled` (the server answers it as an error), the engine going on.

**Prefix caching** (on by default, :mod:`~trickles.infer.prefix`): a sequence admitted takes the cached blocks of
the longest cached prefix of its tokens and prefills only the rest (after preemption too: its own blocks are likely
still cached); its blocks enter the cache as they fill and stay there, once released, until the pool needs them.

**Windows.** With every layer windowed (window ``w``), blocks that slid out of every window go back to the pool
after each call and prefill takes blocks chunk by chunk, so a decoding sequence holds ``ceil(w / P) + 1`` blocks
however long it runs and only the context bounds its budget (:mod:`~trickles.infer.paged`'s notes).

**Speculative decoding** (off by default, :mod:`~trickles.infer.speculative`): step 4 feeds each sequence's last
token and up to ``num_speculative_tokens`` proposed ones (n-gram lookup or a draft model) in one call, and keeps the
proposals the target's own sampling accepts, plus one token of its own.

**Adapters** (``EngineConfig.adapters``, :mod:`trickles.adapters.multi`): a request may choose a LoRA adapter. A
sequence holds a slot of the adapter bank from admission until it leaves or is preempted; admission stops at a
sequence whose adapter no slot can take (every slot held by running sequences) until one is let go, so arrival order
is kept. Every model call tells the bank each row's slot, and the rows of each adapter get its update. Prefix cache
keys start from the adapter's name, so blocks are shared only between sequences of the same adapter.

**Timestamps.** Every sequence records the iteration (``engine.steps``) and ``time.perf_counter()`` at which it
arrived, was admitted, drew its first token and finished: scheduling is tested from these, not from wall clocks.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..adapters.multi import AdapterBank
from .decode import Sampling, TextTracker
from .grammar import Grammars
from .paged import BlockPool, PagedCall, pool_blocks
from .requests import Cancelled, Event, PoolStalled, PoolTooSmall, Request, Sequence
from .sampler import draw, record_prompt
from .speculative import Speculator
from .worker import Driven

__all__ = ["Engine", "EngineConfig", "Event", "Request", "Sequence", "PoolStalled", "PoolTooSmall", "Cancelled"]


@dataclass
class EngineConfig:
    """How the engine schedules and how large its KV pool is."""

    max_batch: int = 32  #: most sequences running (admitted) at once
    block_size: int = 16  #: positions per KV block
    num_blocks: int = 0  #: blocks in the pool (0: from kv_cache_bytes, or enough for max_batch full contexts)
    kv_cache_bytes: int = 0  #: bytes of the pool when num_blocks is 0 (0: see num_blocks)
    prefill_chunk: int = 256  #: most prompt tokens prefilled in one iteration (long prompts are chunked)
    prefix_caching: bool = True  #: reuse the KV blocks of prefixes computed before (:mod:`~trickles.infer.prefix`)
    speculative: str | None = None  #: propose tokens and verify them in one call: "ngram" or "draft" (None: off)
    num_speculative_tokens: int = 4  #: speculative: tokens proposed per sequence and step
    ngram_min: int = 1  #: speculative="ngram": the shortest suffix looked up earlier in the sequence
    ngram_max: int = 4  #: speculative="ngram": the longest suffix looked up earlier in the sequence
    draft_model: torch.nn.Module | None = None  #: speculative="draft": a smaller model with the target's tokenizer
    adapters: AdapterBank | None = None  #: LoRA adapters requests may choose (:mod:`trickles.adapters.multi`)


class Engine(Driven):
    """The continuous-batching scheduler over ``model`` (see the module's notes). Drive it with :meth:`step` /
    :meth:`run_until_idle` in the calling thread, or :meth:`start` a worker thread (what the server does). It owns
    the model while it runs: the first iteration puts it in eval mode, and it stays there.

    ``metrics``: an object with ``on_request(outcome)``, ``on_tokens(prompt, generated)``, ``on_first_token(s)``,
    ``on_inter_token(s)``, ``on_prefix_cache(queried, hit)``, with speculative decoding ``on_spec_decode(drafted,
    accepted)`` (:class:`trickles.infer.metrics.ServingMetrics`), or None.
    """

    def __init__(
        self, model, tokenizer=None, config: EngineConfig | None = None, *, logits_fn=None, metrics=None, forward=None
    ):
        self.model, self.tokenizer, self.logits_fn, self.metrics = model, tokenizer, logits_fn, metrics
        self.forward = forward  # (call, tokens, every) -> logits: makes the call on every rank too (:mod:`.ranks`)
        self.config = cfg = config or EngineConfig()
        if cfg.max_batch < 1 or cfg.prefill_chunk < 1:
            raise ValueError(
                f"max_batch and prefill_chunk must be at least 1, got {cfg.max_batch}, {cfg.prefill_chunk}"
            )
        self.context = model.cfg.max_seq_len
        blocks = pool_blocks(model, cfg.block_size, cfg.num_blocks, cfg.kv_cache_bytes, cfg.max_batch)
        self.pool = BlockPool(model, blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size)  # (structured output: :mod:`.grammar`)
        self.spec = Speculator(self) if cfg.speculative is not None else None
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: list[Request] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- requests ---------------------------------------------------------------------------
    def submit(
        self, prompt: Seq[int], sampling: Sampling, n: int = 1, *, on_event=None, on_finish=None, adapter=None
    ) -> Request:
        """Queues ``n`` choices of ``prompt`` (with LoRA ``adapter``: one of ``config.adapters``' names; None: the
        base); ``on_event(Event)`` and ``on_finish(completions or exception)`` are called from the thread that steps
        the engine. Raises ValueError (:class:`PoolTooSmall` included) for what can never run."""
        sampling.validate()
        bank = self.config.adapters
        if adapter is not None and (bank is None or adapter not in bank.names):
            raise ValueError(f"no adapter {adapter!r} is served here; choose one of {bank.names if bank else []}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        prompt = list(prompt)[-max(1, self.context - 1) :]
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        room = self.pool.room(len(prompt), self.context)  # (PoolTooSmall for a prompt it can never hold)
        budget = max(0, min(sampling.max_new_tokens, self.context - len(prompt), room - len(prompt)))
        grammars = self.grammars.matchers(sampling.response_format, n, speculative=self.spec is not None)
        request = Request(self, next(self._ids), on_event, on_finish)
        device = self.pool.device
        for j in range(n):
            settings = sampling.for_choice(j)
            gen = settings.generator(device) if settings.temperature > 0 else None
            request.sequences.append(
                Sequence(
                    request,
                    j,
                    prompt,
                    settings,
                    budget,
                    gen,
                    TextTracker(self.tokenizer, sampling.stop),
                    tokens=list(prompt),
                    arrived_at=time.perf_counter(),
                    grammar=grammars[j],
                    adapter=adapter,
                )
            )
        with self._lock:
            for s in request.sequences:
                s.arrived_step = self.steps
            self._inbox.extend(request.sequences)
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stops ``request`` at the next iteration: its sequences leave, their blocks are freed, it fails with
        :class:`Cancelled`."""
        with self._lock:
            request.cancelled = True
            self._cancels.append(request)
            self._lock.notify_all()

    @property
    def backlog(self) -> int:
        """Sequences submitted and not yet admitted."""
        return len(self.waiting) + len(self._inbox)

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self._inbox)

    # ---- one iteration ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """One iteration: cancellations, admission, a prefill chunk, one decode step (see the module's notes)."""
        with self._lock:
            for s in self._inbox:
                if s.budget == 0 and s.settings.prompt_logprobs is None:
                    self._finish(s, "length")
                else:
                    self.waiting.append(s)
            self._inbox.clear()
            cancels, self._cancels = self._cancels, []
        for request in cancels:
            self._drop(request, Cancelled(f"request {request.id} was cancelled"), "cancelled")
        self._admit()
        if self.model.training:  # (switching modes walks every module: only when needed)
            self.model.eval()
        prefill = self._prefill_rows()
        if prefill:
            self._call(prefill)
        if self.spec is not None:
            self.spec.decode([s for s in self.running if s.pending == 1])
        elif decode := self._reserve([(s, 1) for s in self.running if s.pending == 1]):
            self._call(decode)
        self.steps += 1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch:
            s = self.waiting[0]
            if s.adapter is not None and s.slot is None:
                s.slot = self.config.adapters.acquire(s.adapter)
                if s.slot is None:  # every slot is held by running sequences: wait for one
                    return
            if not s.table and s.settings.prompt_logprobs is None:  # the cached blocks of its prefix, if any
                s.table = self.pool.blocks.share(s.tokens, s.keys, s.salt)
                s.cached, s.registered = len(s.table) * self.pool.block_size, len(s.table)
                self.pool.slide(s.table, s.cached)
            first = self._prefill_span(s, len(s.tokens))  # positions its first call holds
            need = self.pool.blocks_for(first) - len(s.table)
            fits = not (self.pool.free - need < len(self.running) and self.running)  # one block per runner to grow
            if not fits or not self.pool.grow(s.table, first):
                self._unadmit(s)
                if fits and not self.running:  # nothing will ever free a block: fail it rather than wait forever
                    need = self.pool.blocks_for(self._prefill_span(s, len(s.tokens)))
                    self._drop(s.request, PoolStalled.of(s, need, self.pool, self.waiting), "error")
                    continue
                return
            self.waiting.popleft()
            if s.admitted_step is None:
                s.admitted_step = self.steps
            if self.metrics is not None and self.pool.blocks.caching:
                self.metrics.on_prefix_cache(len(s.tokens), s.cached)
            self.running.append(s)

    def _prefill_span(self, s: Sequence, end: int) -> int:
        """Where the blocks ``s`` holds to prefill towards ``end`` reach: ``end``, or a chunk (all layers windowed)."""
        if self.pool.slide_window is None:
            return end
        return min(end, s.cached + min(self.config.prefill_chunk, self.pool.chunk_cap))

    def _prefill_rows(self) -> list[tuple[Sequence, int]]:
        rows, left = [], self.config.prefill_chunk
        for s in self.running:
            if s.pending > 1 and left > 0:
                take = self._prefill_span(s, s.cached + min(s.pending, left)) - s.cached
                rows.append((s, take))
                left -= take
        return self._reserve(rows)  # (a no-op under full attention: admission reserved the prompt)

    def _reserve(self, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Blocks for the next ``n`` positions of each ``(s, n)`` of ``rows`` (oldest first), preempting the newest
        sequences when the pool is out of blocks; the rows whose sequences still run."""
        for s, n in rows:
            if s not in self.running:
                continue
            while not self.pool.grow(s.table, s.cached + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is s:
                    break
        return [(s, n) for s, n in rows if s in self.running]

    def _preempt(self, s: Sequence) -> None:
        self.running.remove(s)
        self._unadmit(s)
        s.preemptions += 1
        self.waiting.appendleft(s)

    def _unadmit(self, s: Sequence) -> None:
        self._let_go(s)
        s.cached = s.registered = 0

    def _let_go(self, s: Sequence) -> None:
        """Gives back what ``s`` holds: its blocks and its adapter slot."""
        self.pool.release(s.table)
        if s.slot is not None:
            self.config.adapters.release(s.slot)
            s.slot = None

    def _call(self, rows: list[tuple[Sequence, int]]) -> None:
        seqs = [s for s, _ in rows]
        call = PagedCall(self.pool, [s.table for s in seqs], [s.cached for s in seqs], [n for _, n in rows])
        t = call.width
        tokens = torch.tensor(
            [[0] * (t - n) + s.tokens[s.cached : s.cached + n] for s, n in rows], device=self.pool.device
        )
        try:
            out = self._forward(call, tokens, any(s.settings.prompt_logprobs is not None for s in seqs), seqs)
            logits = (self.logits_fn or (lambda z: z))(out[:, -1:])[:, -1]
            record_prompt(rows, out, self.logits_fn)
        except Exception as e:  # noqa: BLE001 -- reported to the requests of this call, the engine goes on
            for request in {s.request for s in seqs}:
                self._drop(request, e, "error")
            return
        for s, n in rows:
            s.cached += n
            s.registered = self.pool.blocks.register(s.table, s.tokens, s.cached, s.keys, s.registered, s.salt)
            self.pool.slide(s.table, s.cached)  # (every layer windowed: what slid out of every window goes back)
        ready = [i for i, s in enumerate(seqs) if s.pending == 0]
        if ready:
            self._draw([seqs[i] for i in ready], logits[ready] if len(ready) < len(seqs) else logits)

    def _forward(self, call: PagedCall, tokens: torch.Tensor, every: bool = False, seqs=()) -> torch.Tensor:
        """The model's output for ``tokens [B, T]`` over ``call`` (the engine's one model call; ``seqs``: its rows,
        whose adapters the bank selects); with ``forward`` (tensor/expert-parallel serving) every rank makes it, and
        only the last position's logits unless ``every``."""
        if self.config.adapters is not None:
            self.config.adapters.select([s.slot for s in seqs])
        if self.forward is not None:
            return self.forward(call, tokens, every)
        return self.model(tokens, cache=call, start=call.start, positions=call.positions, pad_mask=call.pad_mask)

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The next token of each of ``seqs`` from its logits row (:func:`~.sampler.draw`)."""
        tokens, records, failed = draw(seqs, logits)
        for s, error in failed:
            self._drop(s.request, error, "error")
        now = time.perf_counter()
        for s, tok, lp in zip(seqs, tokens, records):
            if s.finish_reason is not None:  # dropped above
                continue
            if len(s.generated) >= s.budget:  # (a budget of 0: prefilled for its prompt's log-probabilities)
                self._finish(s, "length")
            else:
                self._accept(s, tok, now, lp)

    def _accept(self, s: Sequence, tok: int, now: float, lp=None) -> None:
        if s.first_token_at is None:
            s.first_token_at, s.first_token_step = now, self.steps
            if self.metrics is not None:
                self.metrics.on_first_token(now - s.arrived_at)
        elif self.metrics is not None:
            self.metrics.on_inter_token(now - s.last_token_at)
        s.last_token_at = now
        eos = self.tokenizer.eos_id if self.tokenizer is not None else None
        if eos is not None and tok == eos:
            return self._finish(s, "stop")
        s.tokens.append(tok)
        if lp is not None:
            s.logprobs.append(lp)
        if s.text.update(s.generated):
            return self._finish(s, "stop", tok, lp)
        if len(s.generated) >= s.budget:
            return self._finish(s, "length", tok, lp)
        s.request._emit(Event(s.row, tok, s.text.delta(final=False), logprob=lp))

    def _finish(self, s: Sequence, reason: str, tok: int | None = None, lp=None) -> None:
        s.finish_reason, s.finished_step, s.finished_at = reason, self.steps, time.perf_counter()
        if s in self.running:
            self.running.remove(s)
        self._let_go(s)
        if tok is not None:
            s.request._emit(Event(s.row, tok, "", logprob=lp))
        s.request._emit(Event(s.row, None, s.text.delta(final=True), reason))
        request = s.request
        if all(q.finish_reason is not None for q in request.sequences) and not request.finished:
            done = [q.completion() for q in request.sequences]
            if self.metrics is not None:
                self.metrics.on_tokens(sum(c.prompt_tokens for c in done), sum(len(c.tokens) for c in done))
                self.metrics.on_request("ok")
            request._done(done)

    def _drop(self, request: Request, error: BaseException, outcome: str) -> None:
        """Ends every sequence of ``request`` now (cancelled or failed), freeing their blocks."""
        for s in request.sequences:
            if s in self.running:
                self.running.remove(s)
            if s in self.waiting:
                self.waiting.remove(s)
            self._let_go(s)
            if s.finish_reason is None:
                s.finish_reason, s.finished_step, s.finished_at = outcome, self.steps, time.perf_counter()
        if not request.finished:
            if self.metrics is not None:
                self.metrics.on_request(outcome)
            request._done(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = {s.request for s in (*self.running, *self.waiting, *self._inbox)}
            self._inbox.clear()
        for request in pending:
            self._drop(request, error, "error")
