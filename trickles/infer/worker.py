"""Driving the engine: a worker thread (what the server runs), or steps in the calling thread.

:class:`Driven` is the part of :class:`~trickles.infer.engine.Engine` that decides *when* it steps, not *what* a step
does: it needs the engine's ``_lock`` (a condition), ``idle``, ``_cancels``, ``step()`` and ``_fail_all(error)``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq

from .decode import Sampling
from .requests import Event


class Driven:
    """Start/stop a worker thread that steps while there is work; or step here until idle."""

    _thread: threading.Thread | None = None
    _stopping: bool = False

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="trickles-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the worker thread; requests not finished fail with a RuntimeError."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all(RuntimeError("the server is shutting down"))

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.idle and not self._cancels and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 -- a fault of the engine itself: what it held fails, it goes on
                self._fail_all(e)

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Steps in this thread until nothing runs or waits; with ``max_steps``, a RuntimeError if the engine is still
        busy after that many iterations (a bound for callers that must not hang)."""
        for _ in itertools.count() if max_steps is None else range(max_steps):
            if self.idle and not self._cancels:
                return
            self.step()
        if not (self.idle and not self._cancels):
            raise RuntimeError(
                f"the engine is still busy after {max_steps} iterations ({len(self.running)} running, "
                f"{self.backlog} waiting, {self.pool.used} of {self.pool.num_blocks} KV blocks held)"
            )

    def generate(self, prompt: Seq[int], sampling: Sampling, n: int = 1) -> Iterator[Event]:
        """Submits one request and yields its events, stepping the engine in this thread when no worker runs."""
        request = self.submit(prompt, sampling, n)
        if self._thread is not None:
            yield from request.events()
            return
        while True:
            while request._queue:
                yield request._queue.popleft()
            if request.finished:
                if isinstance(request.result, BaseException):
                    raise request.result
                return
            self.step()
