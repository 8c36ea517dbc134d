"""Static batching, kept for comparison with the continuous engine (``trickles serve --batching static``).

Each request becomes a :class:`Job` (one row per choice) on a queue; one worker thread (:class:`Batcher`) owns the
model: it takes the first waiting job, gathers whatever else arrives within ``window_s`` (up to ``max_batch`` rows),
and decodes all their rows in one left-padded batch (:func:`trickles.infer.decode.decode`, each row with its own
sampling settings, seed and stopping). A batch runs to its end before the next starts, so a short request that
arrives just after a long one waits for all of it: what :mod:`trickles.infer.engine` fixes
(``benchmarks/serving.py`` measures both).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .decode import Sampling, decode
from .requests import Event

__all__ = ["Job", "Batcher", "StaticBackend"]


@dataclass
class Job:
    """One request's rows. ``emit(row, text, finish_reason)`` and ``finish(completions or exception)`` are called
    from the worker thread."""

    prompts: list[list[int]]
    settings: list[Sampling]
    emit: Callable[[int, str, str | None], None] = lambda row, text, reason: None
    finish: Callable[[object], None] = lambda result: None


class Batcher:
    """The worker thread that owns the model and decodes waiting jobs together (see the module's notes)."""

    def __init__(self, model, tokenizer, max_batch: int = 32, window_s: float = 0.01, logits_fn=None):
        self.model, self.tokenizer, self.logits_fn = model, tokenizer, logits_fn
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.batches: list[int] = []  #: jobs per batch run so far
        self._thread: threading.Thread | None = None
        self._carry: Job | None = None

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trickles-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finishes the batch in progress, fails jobs still waiting, and ends the thread."""
        self.queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _next_batch(self) -> list[Job] | None:
        first = self._carry or self.queue.get()
        self._carry = None
        if first is None:
            return None
        jobs, rows = [first], len(first.prompts)
        deadline = time.monotonic() + self.window_s
        while rows < self.max_batch:
            try:
                job = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None or rows + len(job.prompts) > self.max_batch:
                self._carry = job  # the next batch starts with it (or stops)
                if job is None:
                    self.queue.put(None)
                    self._carry = None
                break
            jobs.append(job)
            rows += len(job.prompts)
        return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._next_batch()
            if jobs is None:
                break
            self.run(jobs)
        while True:  # refuse what is still waiting
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.finish(RuntimeError("the server is shutting down"))

    def run(self, jobs: list[Job]) -> None:
        """Decodes the rows of ``jobs`` in one batch (in the calling thread)."""
        self.batches.append(len(jobs))
        owner = [(j, r) for j in jobs for r in range(len(j.prompts))]
        try:
            out = decode(
                self.model,
                [p for j in jobs for p in j.prompts],
                [s for j in jobs for s in j.settings],
                eos_id=self.tokenizer.eos_id,
                tokenizer=self.tokenizer,
                logits_fn=self.logits_fn,
                on_text=lambda row, text, reason: owner[row][0].emit(owner[row][1], text, reason),
            )
        except Exception as e:  # noqa: BLE001 -- reported to every request of the batch, the server goes on
            for j in jobs:
                j.finish(e)
            return
        start = 0
        for j in jobs:
            j.finish(out[start : start + len(j.prompts)])
            start += len(j.prompts)


class StaticBackend:
    """The static :class:`~.static.Batcher` behind the engine's ``submit`` (no cancellation: a batch runs out)."""

    def __init__(self, model, tokenizer, max_batch: int, window_s: float, logits_fn=None, metrics=None):
        self.batcher = Batcher(model, tokenizer, max_batch, window_s, logits_fn)
        self.metrics = metrics

    @property
    def backlog(self) -> int:
        """Jobs waiting for a batch."""
        return self.batcher.queue.qsize()

    def submit(self, prompt, sampling: Sampling, n: int = 1, *, on_event, on_finish) -> Job:
        """Queues ``n`` rows of ``prompt``; ValueError for settings only the continuous engine applies."""
        if sampling.engine_only:
            raise ValueError(
                f"{', '.join(sampling.engine_only)}: the static batcher does not apply these; serve with "
                "continuous batching"
            )
        settings = [sampling.for_choice(j) for j in range(n)]

        def finish(result):
            if self.metrics is not None:
                self.metrics.on_request("error" if isinstance(result, BaseException) else "ok")
                if not isinstance(result, BaseException):
                    self.metrics.on_tokens(sum(c.prompt_tokens for c in result), sum(len(c.tokens) for c in result))
            on_finish(result)

        job = Job(
            [list(prompt)] * n,
            settings,
            emit=lambda row, text, reason: on_event(Event(row, None, text, reason)),
            finish=finish,
        )
        self.batcher.submit(job)
        return job

    def cancel(self, handle) -> None:
        """A static batch cannot drop a row; the request's output is ignored."""

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()
