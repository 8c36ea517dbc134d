"""The flight recorder: which communication call this process is blocked in, for hang reports.

``flight`` remembers the collective this process is inside, so a harness or watchdog can say which operation a
hung rank is stuck in; :class:`~trickles.comm.group.GroupComm` and its :class:`~trickles.comm.group.Handle`
enter and leave it around every blocking call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class FlightRecorder:
    """The communication call this process is blocked in, if any (process-wide).

    Every blocking collective, receive and ``Handle.wait`` runs between :meth:`begin` and
    :meth:`end`: ``current`` names it, ``since`` is when it began (``time.monotonic``), ``step``
    is the training step the trainer says it is in, and ``blocked_s`` sums the seconds spent
    inside such calls -- the communication that computation did not hide. Read by the hang
    watchdog (:mod:`trickles.watchdog`), the test harness and the scaling report.
    """

    current: str | None = None
    since: float = 0.0
    limit_s: float | None = None
    seq: int = 0
    step: int | None = None
    blocked_s: float = 0.0
    sink: Callable[[str | None], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, what: str, limit_s: float | None = None) -> None:
        """Entering ``what``; ``limit_s``: how long it may take (None: the watchdog's timeout)."""
        with self._lock:
            self.seq += 1
            self.current = f"{what} (call #{self.seq})"
            self.since = time.monotonic()
            self.limit_s = limit_s
            if self.sink is not None:
                self.sink(self.current)

    def end(self) -> None:
        with self._lock:
            if self.current is not None:
                self.blocked_s += time.monotonic() - self.since
            self.current = None
            self.limit_s = None
            if self.sink is not None:
                self.sink(None)


flight = FlightRecorder()
