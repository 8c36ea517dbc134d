"""Faults injected into checkpoint saves, for tests: the environment variable ``TRICKLES_FAIL_SAVES``.

A comma-separated list of items ``STEP[@RANK][:PHASE[:ACTION]][#ATTEMPT]``:

* ``STEP``: the checkpoint step to strike, or ``*`` for every one;
* ``RANK``: only on this rank (default: every rank);
* ``PHASE``: where in the save (:mod:`trickles.train.saver`): ``copy`` (the snapshot's host copy, on the training
  thread), ``write`` (the default: before the rank's last file, the others written), ``marker`` (its files written,
  before its ``.done`` marker), ``manifest`` (rank 0, every marker seen, before the manifest), ``rename`` (rank 0,
  manifest written -- and for a final save verified -- before the rename into place);
* ``ACTION``: ``fail`` (the default: ``OSError`` "No space left on device", as a full disk would raise), ``kill``
  (SIGKILL to this process) or ``term`` (SIGTERM to the launcher, ``TRICKLES_LAUNCHER_PID``, which passes it on to
  every rank -- or to this process where there is none -- then waits until this process has received it, so that the
  stop lands while this save is in flight);
* ``ATTEMPT``: only in this attempt of a restarted job (:func:`~trickles.process.restart_count`; default: every one).

Several items may strike at one place: ``term`` first, then ``kill``, then ``fail``. ``2@1`` fails rank 1's write
of step 2; ``4@0:rename:kill#1`` kills rank 0 before step 4's rename, in the job's second attempt.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ..errors import ConfigError
from ..process import restart_count, wait_for_stop_request

PHASES = ("copy", "write", "marker", "manifest", "rename")
ACTIONS = ("term", "kill", "fail")  # the order in which they strike
TERM_WAIT_S = 60.0  # how long a ``term`` fault waits for its SIGTERM to come back to this process


@dataclass(frozen=True)
class Fault:
    """One item of ``TRICKLES_FAIL_SAVES``."""

    step: int | None  # None: every checkpoint step
    rank: int | None  # None: every rank
    phase: str = "write"
    action: str = "fail"
    attempt: int | None = None  # None: every attempt


def parse(spec: str) -> list[Fault]:
    """The faults ``spec`` describes (module docstring); ConfigError naming the item it cannot read."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, attempt = item.partition("#")
        head, *rest = where.split(":")
        at, _, rank = head.partition("@")
        phase = rest[0] if rest else "write"
        action = rest[1] if len(rest) > 1 else "fail"
        try:
            fault = Fault(
                None if at == "*" else int(at),
                int(rank) if rank else None,
                phase,
                action,
                int(attempt) if attempt else None,
            )
        except ValueError:
            fault = None
        if fault is None or len(rest) > 2 or phase not in PHASES or action not in ACTIONS:
            raise ConfigError(
                f"TRICKLES_FAIL_SAVES item {item!r}: expected STEP[@RANK][:PHASE[:ACTION]][#ATTEMPT] with STEP a "
                f"number or *, PHASE one of {', '.join(PHASES)} and ACTION one of {', '.join(ACTIONS)}"
            )
        if phase == "copy" and action == "fail":
            raise ConfigError(
                f"TRICKLES_FAIL_SAVES item {item!r}: the host copy does not write; use the kill or term action there"
            )
        faults.append(fault)
    return faults


def strike(faults: list[Fault], step: int, rank: int, phase: str) -> None:
    """Carries out the faults that match this save's ``step``, this ``rank``, ``phase`` and attempt (if any)."""
    hits = [
        f
        for f in faults
        if f.phase == phase
        and f.step in (None, step)
        and f.rank in (None, rank)
        and f.attempt in (None, restart_count())
    ]
    for action in ACTIONS:
        if not any(f.action == action for f in hits):
            continue
        if action == "term":
            os.kill(int(os.environ.get("TRICKLES_LAUNCHER_PID") or os.getpid()), signal.SIGTERM)
            wait_for_stop_request(TERM_WAIT_S)
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            spec = os.environ.get("TRICKLES_FAIL_SAVES", "")
            raise OSError(28, f"No space left on device (injected by TRICKLES_FAIL_SAVES={spec} at {phase})")


def from_environment() -> list[Fault]:
    """The faults of ``TRICKLES_FAIL_SAVES`` (none when it is unset)."""
    return parse(os.environ.get("TRICKLES_FAIL_SAVES", ""))
