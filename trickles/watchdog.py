"""Hang detection: a stuck collective becomes a report from every rank and a non-zero exit.

Every blocking communication call -- collectives, receives, ``Handle.wait`` -- runs between
``flight.begin`` and ``flight.end`` (:class:`trickles.comm.FlightRecorder`). A :class:`Watchdog`
thread per rank wakes every ``min(1 s, timeout / 10)`` and

* when this rank has been inside one call for longer than ``parallel.timeout_s`` (or the call's
  own limit, e.g. the wait for rank 0 to prepare the data), prints which rank, which operation
  on which group, since when and at which training step, publishes that line in the job's store
  and exits with status :data:`HANG_EXIT`;
* when another rank has published such a line, prints where this rank is itself -- inside which
  call, or not inside any (a rank stuck in computation, or one that skipped a collective and
  went on) -- and exits the same way.

A rank that has reported counts itself in the store and, before it exits, waits (at most
:data:`REPORT_WAIT_S`) until every rank has: a rank that left at once would close its connections,
and a peer blocked in a receive from it would end with a connection error instead of saying where
it was. So a job in which one rank skipped a collective ends within the timeout plus a poll
interval or two, every rank that still runs saying where it was, instead of hanging until the
scheduler kills it.
The launcher (:mod:`trickles.launch`) gives the ranks a moment to report before it stops them,
and counts the exit as a failure that ``--max-restarts`` may restart. The process group's own
timeout stays as a backstop for waits that do not pass through the recorder (CUDA-side waits
under NCCL): :func:`backstop_timeout`.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

from .comm import flight
from .errors import EXIT_HANG

HANG_EXIT = EXIT_HANG  # this module's name for it
_KEY = "trickles/hang"
_REPORTED = "trickles/hang_reported"  # how many ranks have reported (a store counter)
REPORT_WAIT_S = 10.0  # how long a rank that reported waits for the others' reports before it exits


def backstop_timeout(timeout_s: float) -> datetime.timedelta:
    """The process group's timeout: twice the watchdog's, at least 30 minutes (long setup phases)."""
    return datetime.timedelta(seconds=max(2 * timeout_s, 1800.0))


def _default_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no process group, or a torch without the helper: this rank's own timeouts still work
        return None


class Watchdog:
    """Watches this rank's communication calls (see the module docstring); ``start()`` / ``stop()``."""

    def __init__(
        self, timeout_s: float, rank: int, where: str = "", store=None, exit_fn=os._exit, world: int | None = None
    ):
        if timeout_s <= 0:
            raise ValueError(f"the communication timeout must be positive, got {timeout_s}")
        self.timeout_s, self.rank, self.where = timeout_s, rank, where
        self.store = store if store is not None else _default_store()
        self.world = world if world is not None else _default_world()
        self.key = _KEY  # the job's store is already prefixed per attempt (trickles.process.init_distributed)
        self.poll_s = min(1.0, timeout_s / 10)
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trickles-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _state(self) -> tuple[str | None, float, float | None]:
        """``(call, seconds inside it, its own limit)`` of this rank now (call None: not inside one)."""
        with flight._lock:
            return flight.current, time.monotonic() - flight.since, flight.limit_s

    def _describe(self, call: str | None, waited: float) -> str:
        step = f" at step {flight.step}" if flight.step is not None else ""
        who = f"rank {self.rank}" + (f" ({self.where})" if self.where else "")
        if call is None:
            return f"{who}{step}: not inside a communication call"
        return f"{who}{step}: inside {call} for {waited:.1f} s"

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def check(self) -> bool:
        """One look (what the thread does every ``poll_s``): fires and returns True when this rank has been
        inside a call past its limit, or another rank has reported; else returns False."""
        call, waited, limit = self._state()
        limit = self.timeout_s if limit is None else limit
        if call is not None and waited > limit:
            line = self._describe(call, waited)
            self._publish(line)
            self._fire(f"{line}, more than the {limit:g} s allowed (parallel.timeout_s); stopping")
            return True
        other = self._published()
        if other is not None:
            self._fire(f"{self._describe(call, waited)}; stopping because {other}")
            return True
        return False

    def _publish(self, line: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self.key, line)
        except Exception:  # the store's host may be gone already; this rank still reports and exits
            pass

    def _published(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode(errors="replace")
        except Exception:
            return None
        return None

    def _fire(self, message: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, f"[trickles] hang: {message}\n".encode())  # one write: the ranks' lines do not interleave
        self._await_reports()
        self._exit(HANG_EXIT)

    def _await_reports(self) -> None:
        """Counts this rank's report and waits until every rank has reported, at most :data:`REPORT_WAIT_S`."""
        if self.store is None or self.world <= 1:
            return
        try:
            reported = self.store.add(_REPORTED, 1)
            deadline = time.monotonic() + REPORT_WAIT_S
            while reported < self.world and time.monotonic() < deadline:
                time.sleep(min(self.poll_s, 0.1))
                reported = self.store.add(_REPORTED, 0)
        except Exception:  # the store's host may be gone already: exit now
            pass
