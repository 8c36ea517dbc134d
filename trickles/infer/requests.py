"""A request's state in the serving engine: its sequences (one per choice), their events, and how it ends.

A :class:`Request` is what :meth:`trickles.infer.engine.Engine.submit` returns. Its output is a stream of
:class:`Event` s (a token, the text that became final with it, a finish reason on a choice's last one), delivered
to ``on_event`` from the engine's thread or, without a callback, queued for :meth:`Request.events`. It ends with a
list of :class:`~trickles.infer.decode.Completion` s, or the exception that ended it (:class:`Cancelled` when its
client went away).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .decode import Completion, Sampling, TextTracker
from .grammar import Matcher
from .logprobs import TokenLogprob

__all__ = ["Cancelled", "Event", "PoolStalled", "PoolTooSmall", "Request", "Sequence"]


class PoolTooSmall(ValueError):
    """A prompt needs more KV blocks than the whole pool holds."""


class PoolStalled(RuntimeError):
    """A waiting sequence can never be admitted: nothing runs, and the pool's free blocks are too few for it."""

    @classmethod
    def of(cls, s: Sequence, need: int, pool, waiting) -> PoolStalled:
        """The error of ``s``, which needs ``need`` blocks of ``pool`` while nothing runs and ``waiting`` wait."""
        lost = pool.used - sum(pool.held(q.table) for q in waiting)
        return cls(
            f"request {s.request.id} cannot be admitted: it needs {need} KV blocks, {pool.free} of "
            f"{pool.num_blocks} are free and no sequence runs that could free more ({lost} blocks are held by "
            "no sequence: a block leak in the engine); the server goes on, this request fails"
        )


class Cancelled(RuntimeError):
    """The request was cancelled (its client went away) before it finished."""


@dataclass
class Event:
    """One piece of a request's output: ``token`` drawn for choice ``row`` (None on its last event), the ``text``
    that became final with it, and ``finish_reason`` on the choice's last event."""

    row: int
    token: int | None
    text: str
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None  #: the token's, when its request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  #: on a choice's first event, when its request asked for them


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens, cache blocks, sampling state and timestamps."""

    request: Request
    row: int
    prompt: list[int]
    settings: Sampling
    budget: int  #: new tokens it may draw
    generator: torch.Generator | None
    text: TextTracker
    tokens: list[int] = field(default_factory=list)  #: prompt + drawn tokens (the end-of-text token never added)
    cached: int = 0  #: tokens whose keys and values are in the pool
    table: list[int] = field(default_factory=list)  #: block ids in position order
    seen: torch.Tensor | None = None  #: repetition penalty: token ids in the row so far
    counts: torch.Tensor | None = None  #: presence and frequency penalties: times each token was drawn
    logprobs: list[TokenLogprob] = field(default_factory=list)  #: of the drawn tokens, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  #: of the prompt's tokens after the first
    announced: bool = False  #: its first event went out
    keys: list[bytes] = field(default_factory=list)  #: prefix cache: the keys of its full blocks so far
    registered: int = 0  #: prefix cache: blocks of its table entered in the cache (or passed over)
    grammar: Matcher | None = None  #: structured output: its grammar's state (:mod:`.grammar`; None: free)
    adapter: str | None = None  #: the LoRA adapter its request chose (None: the base model)
    slot: int | None = None  #: the adapter bank's slot it holds while admitted (:mod:`trickles.adapters.multi`)
    finish_reason: str | None = None
    arrived_step: int = 0
    admitted_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    arrived_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def salt(self) -> bytes:
        """The prefix cache's key of nothing (:mod:`.prefix`): its adapter's name, or empty for the base model."""
        return (self.adapter or "").encode()

    @property
    def pending(self) -> int:
        """Tokens to feed before the next draw."""
        return len(self.tokens) - self.cached

    def completion(self) -> Completion:
        """What the choice returns once finished."""
        asked = self.settings.logprobs is not None, self.settings.prompt_logprobs is not None
        return Completion(
            self.generated,
            self.text.text,
            self.finish_reason,
            len(self.prompt),
            logprobs=self.logprobs if asked[0] else None,
            prompt_logprobs=self.prompt_logprobs if asked[1] else None,
        )


class Request:
    """What :meth:`~trickles.infer.engine.Engine.submit` returns: ``n`` sequences of one prompt; :meth:`events`
    iterates over the output (a thread running the engine must feed it: :meth:`Engine.start`), :meth:`cancel` stops
    it."""

    def __init__(
        self, engine, rid: int, on_event: Callable[[Event], None] | None, on_finish: Callable[[object], None] | None
    ):
        self.engine, self.id = engine, rid
        self.sequences: list[Sequence] = []
        self._on_event, self._on_finish = on_event, on_finish
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self.cancelled = False
        self.result: list[Completion] | BaseException | None = None

    def _emit(self, event: Event) -> None:
        s = self.sequences[event.row]
        if not s.announced:
            s.announced = True
            if s.settings.prompt_logprobs is not None:
                event.prompt_logprobs = s.prompt_logprobs
        if self._on_event is not None:
            self._on_event(event)
            return
        with self._ready:
            self._queue.append(event)
            self._ready.notify_all()

    def _done(self, result) -> None:
        self.result = result
        if self._on_finish is not None:
            self._on_finish(result)
        with self._ready:
            self._ready.notify_all()

    @property
    def finished(self) -> bool:
        return self.result is not None

    def cancel(self) -> None:
        self.engine.cancel(self)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The request's events as they come (blocks); raises what failed the request."""
        while True:
            with self._ready:
                while not self._queue and self.result is None:
                    if not self._ready.wait(timeout):
                        raise TimeoutError(f"request {self.id}: no output within {timeout} s")
                event = self._queue.popleft() if self._queue else None
            if event is not None:
                yield event
            elif isinstance(self.result, BaseException):
                raise self.result
            else:
                return
