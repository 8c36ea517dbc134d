"""Local launcher: run a function in N processes on this machine, the way torchrun would.

``launch(fn, args, nproc)`` hosts a TCP store on an ephemeral port, spawns ``nproc`` ranks
with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) plus ``TRICKLES_AGENT_STORE=1`` so they join the launcher's store as clients,
and watches them:

* every rank succeeds -> exit status 0;
* a rank fails -> the others are killed at once (with any processes they started), the failing
  rank's traceback is printed and the status is its own (for a :class:`UserError` or
  :class:`TrainingStopped`, its one-line message and its exit code: :data:`~trickles.errors.EXIT_STATUSES`); a rank
  killed by a signal is named before a peer that failed because it vanished; when its hang
  watchdog stopped it (status 4, :mod:`trickles.watchdog`), the others first get
  ``HANG_GRACE_S`` to report where they are;
* the launcher gets SIGTERM -> it passes it on: every rank finishes its step, saves a checkpoint and exits
  (:mod:`trickles.train.stopping`), within ``TERM_GRACE_S``; the status is what the ranks did: 143 when every rank
  reported its checkpoint saved and verified, 6 when that save failed or a rank had to be killed after the grace
  period (or ended before it could save), a rank's own status when it failed otherwise, 0 when the run had finished;
* the launcher itself is interrupted or dies, even by SIGKILL -> the ranks die with it: each rank holds the read end
  of a pipe whose write end only the launcher holds (:class:`Lifeline`), and a thread of the rank kills the rank's
  process group when it reads end-of-file. (``PR_SET_PDEATHSIG`` alone does not do it: a rank's parent is the
  forkserver, which by design lives while any rank it forked lives.)

With ``max_restarts`` a failed attempt is retried unless its status is one a restart cannot cure
(:data:`~trickles.errors.NO_RESTART`: bad input, failed saves, a stop on purpose, SIGTERM, Ctrl-C).

Ranks are forked from a ``forkserver`` (:data:`PRELOAD`): one fresh process per launcher that imports the
trainer and TorchDynamo once -- pure Python, no accelerator touched, no thread started, which is what
makes forking safe with CUDA -- so ``nproc`` ranks and every restart skip seconds of imports each. A
rank gets the launcher's environment, standard output and standard error as they are at :func:`launch`
(as a spawned process would: the forkserver's own are those of the moment it started), then its torchrun
variables.

Ranks end through :func:`trickles.process.exit_process`, so a rank that tore its group down
cleanly cannot turn a green run red during interpreter teardown.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from .errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STATUSES,
    EXIT_TERM_UNSAVED,
    EXIT_TERMINATED,
    NO_RESTART,
    ONE_LINE_ERRORS,
    UserError,
)
from .watchdog import HANG_EXIT

PRELOAD = ["trickles.train.run", "torch._dynamo"]  # what the forkserver imports, once
HANG_GRACE_S = 5.0  # after a rank's watchdog fired, how long the others get to report before they are stopped
TERM_GRACE_S = 120.0  # after SIGTERM, how long the ranks get to finish their step and save before they are killed

USER_ERROR_TAG = "trickles-user-error: "


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def rank_environment(rank: int, world: int, port: int, restart: int = 0) -> dict[str, str]:
    """The torchrun-style environment of one local rank."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TRICKLES_AGENT_STORE": "1",
        "TRICKLES_RESTART": str(restart),
    }


def rank_context():
    """The multiprocessing context ranks start from: a forkserver with :data:`PRELOAD` imported (see module doc)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Streams:
    """This process's standard output and error (file descriptors 1 and 2) as a forked rank receives them: pickled
    into the rank's arguments, each is passed to it as a file descriptor (``multiprocessing.reduction.DupFd``)."""

    def __reduce__(self):
        return _received_streams, (reduction.DupFd(1), reduction.DupFd(2))


def _received_streams(out, err) -> tuple[int, int]:
    return out.detach(), err.detach()


class Lifeline:
    """The read end of the launcher's lifeline pipe as a forked rank receives it (pickled as a file descriptor)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(fd) -> int:
    return fd.detach()


def _die_with_launcher(fd: int) -> None:
    """Kills this rank's process group once ``fd`` (:class:`Lifeline`'s read end) reads end-of-file: the launcher is
    gone (its write end closed, however it ended)."""

    def watch():
        while os.read(fd, 1):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="trickles-lifeline", daemon=True).start()


def adopt_streams(fds: tuple[int, int]) -> None:
    """Makes the received descriptors (:class:`Streams`, unpickled) this process's standard output and error."""
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)


def _rank_main(
    fn: Callable, args: tuple, env: dict[str, str], error_file: str, streams: tuple[int, int], lifeline: int
) -> None:
    from .process import exit_process

    adopt_streams(streams)
    _die_with_parent()
    os.setpgrp()
    _die_with_launcher(lifeline)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" not in os.environ:  # the ranks share this machine's cores (torchrun sets 1 per rank)
        import torch

        from .process import cpu_cores

        torch.set_num_threads(max(1, cpu_cores() // int(env["LOCAL_WORLD_SIZE"])))
    try:
        code = fn(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ONE_LINE_ERRORS as e:
        with open(error_file, "w") as f:
            f.write(f"{USER_ERROR_TAG}{e.exit_code} {e}")
        exit_process(e.exit_code)
    except BaseException:
        with open(error_file, "w") as f:
            f.write(traceback.format_exc())
        exit_process(1)
    exit_process(code if isinstance(code, int) else 0)  # a function's return value is not a status


class _Terminated(Exception):
    """The launcher got SIGTERM and passed it on to its ranks."""


def _terminate(procs: list, grace_s: float) -> list[int]:
    """SIGTERM to every rank still running, which finishes its step, saves a checkpoint and exits; those still
    running after ``grace_s`` are killed. Returns the ranks that had to be killed."""
    for p in procs:
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    late = [r for r, p in enumerate(procs) if p.exitcode is None]
    _kill(procs)
    return late


def _kill(procs: list) -> None:
    for p in procs:
        if p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        p.join(timeout=10)


def free_store():
    """A TCP store server on an ephemeral port of 127.0.0.1 (held by the caller, so no port races)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def launch(fn: Callable[..., Any], args: tuple, nproc: int, max_restarts: int = 0, quiet: bool = False) -> int:
    """Runs ``fn(*args)`` on ``nproc`` local ranks; returns the exit status (0: every rank succeeded).

    With ``max_restarts=K`` a failed attempt is retried up to K times with all ranks restarted
    (``TRICKLES_RESTART`` counts the attempts), as ``torchrun --max-restarts`` does.
    """
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be at least 0, got {max_restarts}")
    ctx = rank_context()
    store = free_store()
    status = 1
    for attempt in range(max_restarts + 1):
        status = _attempt(ctx, fn, args, nproc, store.port, attempt, quiet)
        if status == EXIT_OK or attempt == max_restarts:
            break
        if status in NO_RESTART:
            meaning = EXIT_STATUSES[status][2]
            print(f"[trickles] not restarting: status {status} ({meaning}) is not cured by a restart", file=sys.stderr)
            break
        print(
            f"[trickles] attempt {attempt + 1} ended with status {status}; restarting all {nproc} ranks "
            f"(attempt {attempt + 2} of {max_restarts + 1})",
            file=sys.stderr,
        )
    del store
    return status


def _attempt(ctx, fn, args, nproc: int, port: int, attempt: int, quiet: bool) -> int:
    errors = tempfile.mkdtemp(prefix="trickles-ranks-")
    procs, late = [], []
    life_r, life_w = os.pipe()  # the ranks' lifeline: only this process holds the write end
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum, frame):
        if signum == signal.SIGTERM:  # an orderly stop: every rank saves its checkpoint and exits (Trainer)
            late.extend(_terminate(procs, TERM_GRACE_S))
            raise _Terminated
        _kill(procs)
        raise KeyboardInterrupt

    for s in previous:
        signal.signal(s, on_signal)
    try:
        for r in range(nproc):
            env = {**os.environ, **rank_environment(r, nproc, port, attempt)}
            env["TRICKLES_LAUNCHER_PID"] = str(os.getpid())  # where an injected SIGTERM goes (trickles.train.faults)
            p = ctx.Process(
                target=_rank_main,
                args=(fn, args, env, os.path.join(errors, f"rank{r}.txt"), Streams(), Lifeline(life_r)),
                name=f"trickles-rank{r}",
            )
            p.start()
            procs.append(p)
        alive = {p.sentinel: (r, p) for r, p in enumerate(procs)}
        while alive:
            ended = [alive.pop(s) for s in mp.connection.wait(list(alive), timeout=1.0)]
            for _, p in ended:
                p.join()
            failed = [(r, p) for r, p in ended if p.exitcode != 0]
            if failed:  # a rank killed by a signal first: a peer that lost it fails too, and is not the cause
                r, p = min(failed, key=lambda rp: (rp[1].exitcode >= 0, rp[0]))
                if p.exitcode == HANG_EXIT:  # let the other ranks' watchdogs say where they are
                    _await_exits(alive, HANG_GRACE_S)
                _kill(procs)
                return _report(r, p.exitcode, errors, quiet)
        return EXIT_OK
    except _Terminated:
        return _after_sigterm(procs, nproc, late, errors, quiet)
    except KeyboardInterrupt:
        _kill(procs)
        print("[trickles] interrupted; all ranks stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(life_r)
        os.close(life_w)  # (a rank still alive here dies with it)
        for name in os.listdir(errors):
            os.unlink(os.path.join(errors, name))
        os.rmdir(errors)


def _await_exits(alive: dict, seconds: float) -> None:
    """Waits up to ``seconds`` for the processes in ``alive`` (sentinel -> (rank, process)) to end by themselves."""
    deadline = time.monotonic() + seconds
    while alive and time.monotonic() < deadline:
        for s in mp.connection.wait(list(alive), timeout=max(0.0, deadline - time.monotonic())):
            alive.pop(s)[1].join()


def _after_sigterm(procs: list, nproc: int, late: list[int], errors: str, quiet: bool) -> int:
    """The status of an attempt the launcher passed SIGTERM on to, from what its ranks did (module docstring)."""
    if len(procs) < nproc:
        print(
            f"[trickles] SIGTERM while starting the ranks ({len(procs)} of {nproc} started); nothing was saved",
            file=sys.stderr,
        )
        return EXIT_TERM_UNSAVED
    if late:
        print(
            f"[trickles] SIGTERM: rank(s) {', '.join(map(str, late))} did not stop within {TERM_GRACE_S:.0f} s and "
            "were killed; no checkpoint of the stopping step is confirmed (--resume auto continues from the newest "
            "complete one)",
            file=sys.stderr,
        )
        return EXIT_TERM_UNSAVED
    codes = [p.exitcode for p in procs]
    if all(c == EXIT_OK for c in codes):
        print("[trickles] SIGTERM came as the run ended: every rank finished (status 0)", file=sys.stderr)
        return EXIT_OK
    if -signal.SIGTERM in codes:
        rank = codes.index(-signal.SIGTERM)
        print(f"[trickles] SIGTERM: rank {rank} ended before it could save (it was still starting)", file=sys.stderr)
        return EXIT_TERM_UNSAVED
    rank = next((r for r, c in enumerate(codes) if c not in (EXIT_OK, EXIT_TERMINATED)), 0)
    return _report(rank, codes[rank], errors, quiet)


def _report(rank: int, exitcode: int, errors: str, quiet: bool) -> int:
    path = os.path.join(errors, f"rank{rank}.txt")
    text = open(path).read() if os.path.exists(path) else ""
    if text.startswith(USER_ERROR_TAG):
        code, _, message = text[len(USER_ERROR_TAG) :].partition(" ")
        # a SIGTERM's stop with its checkpoint verified is no error; every other one-line status is
        print(f"[trickles] {message}" if int(code) == EXIT_TERMINATED else f"error: {message}", file=sys.stderr)
        return int(code)
    if exitcode == HANG_EXIT:
        # every rank exits with the hang status once all have reported: whichever is seen first is not the one that
        # found it
        print(
            f"[trickles] a communication call was stuck past parallel.timeout_s (rank {rank} ended with the hang "
            "status); the ranks' reports are above; stopped the others",
            file=sys.stderr,
        )
        return exitcode
    if exitcode < 0:
        what = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        what = f"exited with status {exitcode}"
    if not quiet:
        print(f"[trickles] rank {rank} {what}; stopped the other ranks", file=sys.stderr)
        if text:
            print(f"[trickles] traceback of rank {rank}:\n{text}", file=sys.stderr, end="")
    return exitcode if exitcode > 0 else 1
