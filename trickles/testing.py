"""Run a function on N spawned CPU ranks and get their results back (tests and benchmarks).

A :class:`RankPool` starts N processes once, joins them into a gloo process group, and then
runs one function after another on all of them: ``pool.run(fn, *args)`` returns
``[fn(*args) on rank 0, ..., on rank N-1]``. Functions and results must be picklable (define
them at module level). Reusing the processes keeps a suite of multi-rank tests cheap: the
cost of starting Python, importing torch and connecting is paid once per world size.

Ranks are forked from the launcher's ``forkserver`` (:func:`trickles.launch.rank_context`), which has
already imported the trainer and TorchDynamo (a rank gets this process's environment and standard
streams as they are when the pool starts), so a pool starts in
a fraction of a second rather than seconds of imports per rank, also when a failure test makes the
next call start a fresh pool. Each rank then freezes what it imported (``gc.freeze``): the full
collection before every function (:func:`_release_groups`) scans only what the tests created,
not the ~300,000 objects of torch's modules.

Failures are bounded and explicit:

* a rank raises -> :class:`RankError` carrying that rank's traceback;
* a rank does not finish within ``timeout`` seconds -> :class:`RankTimeout` naming each
  unfinished rank and the collective it is inside (from :data:`trickles.comm.flight`),
  e.g. ``rank 1: all_reduce on group 'dp' (2 ranks, (4,) float32) (call #3), for 10.0 s``.

After either, the pool is killed and the next :func:`pool` call starts a fresh one.

:func:`run_command` and :class:`Command` (forked command lines) live in :mod:`trickles.commands`; they are
re-exported here.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from .commands import Command, run_command
from .launch import Streams, _die_with_parent, _kill, adopt_streams, free_store, rank_context, rank_environment

STATUS_BYTES = 512


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(RuntimeError):
    """Some rank did not finish in time; the message names it and the collective it is in."""


def _worker(
    rank: int, world: int, port: int, conn, status, threads: int, env: dict[str, str], streams: tuple[int, int]
) -> None:
    import torch

    from .comm import flight
    from .process import exit_process, init_distributed, shutdown_distributed

    adopt_streams(streams)
    _die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(rank_environment(rank, world, port))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks over gloo, also on a machine with GPUs
    torch.set_num_threads(threads)

    def sink(what):
        status.value = (what or "").encode()[: STATUS_BYTES - 1]

    flight.sink = sink
    init_distributed(torch.device("cpu"))
    gc.freeze()
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            _release_groups()
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    shutdown_distributed()
    exit_process(0)


def _release_groups() -> None:
    """Destroys the process groups the previous function created (its topology's mesh and pipeline groups),
    once every rank has started the next one: each gloo group keeps threads polling its connections, and a
    pool that runs many functions would otherwise pile them up until the idle ranks eat the machine."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if not dist.is_initialized():
        return
    dist.barrier()
    gc.collect()
    for group in list(_world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


class RankPool:
    """``world_size`` persistent CPU ranks joined in one gloo group."""

    def __init__(self, world_size: int, start_timeout: float = 120.0):
        self.world_size = world_size
        ctx = rank_context()
        self._store = free_store()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        self._status = [ctx.Array("c", STATUS_BYTES, lock=False) for _ in range(world_size)]
        self._conns, self._procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            args = (r, world_size, self._store.port, child, self._status[r], threads, dict(os.environ), Streams())
            p = ctx.Process(target=_worker, args=args, daemon=True, name=f"trickles-test-rank{r}")
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self.broken = False
        self._collect("start", start_timeout)

    @property
    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args, timeout: float = 180.0, **kwargs) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        if not self.alive:
            raise RuntimeError("this RankPool was shut down after a failure; get a new one")
        for c in self._conns:
            c.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", str(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        pending = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        error = None
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = mp.connection.wait(list(pending) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in sentinels:
                    r = sentinels.pop(obj)
                    if any(rr == r for rr in pending.values()) and not self._conns[r].poll():
                        error = error or RankError(
                            f"rank {r} died (exit code {self._procs[r].exitcode}) while running {what}"
                        )
                        pending = {c: rr for c, rr in pending.items() if rr != r}
                    continue
                r = pending.pop(obj)
                try:
                    kind, value = obj.recv()
                except EOFError:
                    error = error or RankError(f"rank {r} died while running {what}")
                    continue
                if kind == "error":
                    error = error or RankError(f"rank {r} raised in {what}:\n{value}")
                    deadline = min(deadline, time.monotonic() + 5.0)  # give peers a moment, then give up
                else:
                    results[r] = value
        if error is not None:
            self.shutdown(force=True)
            raise error
        if pending:
            lines = []
            for r in sorted(pending.values()):
                where = self._status[r].value.decode(errors="replace") or "not inside a collective"
                lines.append(f"rank {r}: {where}")
            self.shutdown(force=True)
            raise RankTimeout(
                f"{what} did not finish on {len(pending)} of {self.world_size} ranks within {timeout:.0f} s:\n  "
                + "\n  ".join(lines)
            )
        return [results[r] for r in range(self.world_size)]

    def shutdown(self, force: bool = False) -> None:
        """Stops the ranks (cleanly unless ``force``, or if a clean stop does not finish)."""
        if self.broken and not force:
            return
        if not force:
            for c in self._conns:
                try:
                    c.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for p in self._procs:
                p.join(timeout=30)
        self.broken = True
        _kill(self._procs)
        for c in self._conns:
            c.close()


_POOLS: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """A live pool of ``world_size`` ranks, reused across calls and replaced after a failure."""
    p = _POOLS.get(world_size)
    if p is None or not p.alive:
        p = _POOLS[world_size] = RankPool(world_size)
    return p


def shutdown_pools() -> None:
    for p in _POOLS.values():
        p.shutdown()
    _POOLS.clear()


def run_ranks(world_size: int, fn: Callable[..., Any], *args, timeout: float = 180.0, **kwargs) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` ranks of a shared pool; results in rank order."""
    return pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


__all__ = ["Command", "RankError", "RankPool", "RankTimeout", "pool", "run_command", "run_ranks", "shutdown_pools"]
