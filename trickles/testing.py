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

:func:`run_command` runs a command line (``python -m trickles ...`` or ``python SCRIPT ...``) the way
``subprocess.run(cmd, capture_output=True)`` would, in a process forked from the same forkserver rather than
a fresh interpreter: the module or script runs as ``__main__`` with the command's arguments, working
directory, environment, ``sys.path`` and unpiped standard streams, and its exit status, output and error come
back as a :class:`subprocess.CompletedProcess`. Only the seconds of importing torch are skipped, also by the ranks
the command launches: its forkserver (the launcher's, :func:`trickles.launch.rank_context`) is a fork of the command's
process taken before the command runs (:func:`_forkserver_from_here`) rather than a fresh interpreter importing the
trainer and TorchDynamo again. Where the
environment differs from the forkserver's in a variable read when modules are imported (``TRITON_*``,
``TORCH*``, ``PYTHON*`` beyond the emulated three, thread counts other than ``OMP_NUM_THREADS``...), the
forked process replaces itself with a fresh interpreter (``os.execve``), so the result is a subprocess's.
"""

from __future__ import annotations

import gc
import io
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from .launch import Streams, _die_with_parent, _kill, adopt_streams, free_store, rank_context, rank_environment

STATUS_BYTES = 512


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(RuntimeError):
    """Some rank did not finish in time; the message names it and the collective it is in."""


def _worker(rank: int, world: int, port: int, conn, status, threads: int, env: dict[str, str],
            streams: tuple[int, int]) -> None:
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
                        error = error or RankError(f"rank {r} died (exit code {self._procs[r].exitcode}) while running {what}")
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
            raise RankTimeout(f"{what} did not finish on {len(pending)} of {self.world_size} ranks within {timeout:.0f} s:\n  " + "\n  ".join(lines))
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


# ---- command lines, forked ---------------------------------------------------------------------

EMULATED_ENV = ("PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONPATH", "OMP_NUM_THREADS")
#: variables read once, by prefix -> the module that reads them when imported (None: the interpreter at start-up); a
#: difference matters only where that module is already imported in the forked process
IMPORT_TIME_ENV = {"PYTHON": None, "LD_": None, "TORCH": "torch", "PYTORCH_": "torch", "OMP_": "torch", "MKL_": "torch",
                   "KMP_": "torch", "TRITON_": "triton", "HF_": "huggingface_hub", "TRANSFORMERS_": "transformers"}
SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR",)  # Inductor's import sets it (for its compile workers) where it is unset


def _needs_fresh_interpreter(env: dict[str, str], inherited: dict[str, str]) -> bool:
    """Whether ``env`` differs from the forked process's inherited environment in a variable that an imported
    module (or the interpreter's start-up) has read already, and :func:`_command_main` does not apply by hand."""
    def read_already(key: str) -> bool:
        return any(key.startswith(prefix) and (module is None or module in sys.modules)
                   for prefix, module in IMPORT_TIME_ENV.items())

    keys = {k for k in (*env, *inherited) if read_already(k) and k not in EMULATED_ENV
            and not (k in SET_BY_IMPORTS and k not in env)}
    if "OMP_NUM_THREADS" in inherited and "OMP_NUM_THREADS" not in env:
        return True  # torch's default thread count is what a fresh interpreter would pick
    if any(os.path.exists(os.path.join(d, f"{m}.py")) for d in env.get("PYTHONPATH", "").split(os.pathsep) if d
           for m in ("sitecustomize", "usercustomize")):
        return True  # imported at start-up
    return any(env.get(k) != inherited.get(k) for k in keys)


def _text_stream(fd: int, encoding: str, errors: str, unbuffered: bool, line_buffering: bool):
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def _forkserver_from_here() -> None:
    """Gives this process a forkserver (the one :func:`trickles.launch.rank_context` forks ranks from) that is a fork
    of it as it is now: the launcher's preloaded modules imported, no thread started, the command's environment and
    path -- the state a freshly spawned forkserver reaches after seconds of imports. Its file descriptors are those
    a spawned one gets (0-2, its socket and the "alive" pipe); it ends when every client has (multiprocessing's
    protocol, unchanged). Called before the command runs anything."""
    server = mp.forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = mp.connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            keep = {0, 1, 2, listener.fileno(), alive_r}
            for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            mp.forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            pass
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _command_main(cmd: list[str], cwd: str, env: dict[str, str], out: str, err: str | None, path: list[str]) -> None:
    """The forked side of :func:`run_command`: output files as fds 1 and 2, a process group of its own, the
    command's directory and environment, then its module or script as ``__main__``; exits with its status."""
    fd = os.open(out, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    if err is None:
        os.dup2(1, 2)
    else:
        fd = os.open(err, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, 2)
        os.close(fd)
    os.setpgrp()
    _die_with_parent()
    os.chdir(cwd)
    inherited = dict(os.environ)
    if cmd[0] != sys.executable or _needs_fresh_interpreter(env, inherited):
        os.execve(cmd[0], cmd, env)
    os.environ.clear()
    os.environ.update({k: inherited[k] for k in SET_BY_IMPORTS if k in inherited}, **env)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    encoding, _, errors = env.get("PYTHONIOENCODING", "").partition(":")
    encoding = encoding or (sys.__stdout__.encoding if sys.__stdout__ else "utf-8")
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _text_stream(1, encoding, errors or "strict", unbuffered, False)
    sys.stderr = sys.__stderr__ = _text_stream(2, encoding, errors or "backslashreplace", unbuffered, True)
    sys.path[:] = path
    sys.argv = [cmd[1], *cmd[2:]] if cmd[1] != "-m" else [cmd[2], *cmd[3:]]
    _forkserver_from_here()
    try:
        if cmd[1] == "-m":
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(cmd[1], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # an interpreter ends by the signal itself
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)  # multiprocessing ends the process as an interpreter would: children joined, streams flushed


def _fresh_path(cmd: Sequence[str], cwd: str, env: dict[str, str]) -> list[str]:
    """``sys.path`` as a fresh ``python`` started with ``cmd`` in ``cwd`` under ``env`` would have it."""
    probe = subprocess.run([cmd[0], "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                           capture_output=True, text=True, cwd=cwd, env=env, check=True)
    first = cwd if cmd[1] == "-m" else os.path.dirname(os.path.realpath(os.path.join(cwd, cmd[1])))
    return [first, *json.loads(probe.stdout)]


class Command:
    """One command line running as :func:`run_command` describes, started at once; ``stderr=None`` sends its
    standard error to the same file as its output."""

    def __init__(self, cmd: Sequence[str], *, cwd=None, env: dict[str, str] | None = None, stderr: bool = True):
        cmd = [str(c) for c in cmd]
        if len(cmd) < 2 or (cmd[1] == "-m" and len(cmd) < 3) or (cmd[1] != "-m" and cmd[1].startswith("-")):
            raise ValueError(f"run_command runs 'python -m MODULE ...' or 'python SCRIPT ...', not {cmd}")
        self.args, cwd = cmd, os.path.abspath(cwd or os.getcwd())
        env = dict(os.environ if env is None else env)
        self._dir = tempfile.mkdtemp(prefix="trickles-command-")
        self._out = os.path.join(self._dir, "out")
        self._err = os.path.join(self._dir, "err") if stderr else None
        for name in filter(None, (self._out, self._err)):
            open(name, "wb").close()
        ctx = rank_context()
        self._proc = ctx.Process(target=_command_main, name="trickles-command",
                                 args=(cmd, cwd, env, self._out, self._err, _fresh_path(cmd, cwd, env)))
        self._proc.start()

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; on ``timeout`` seconds its process group is killed and ``TimeoutExpired`` raised."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout, self.output(), self.error())
        return self._proc.exitcode

    def kill(self) -> None:
        """Ends it and every process it started (its process group)."""
        _kill([self._proc])

    def output(self, text: bool = True):
        return self._read(self._out, text)

    def error(self, text: bool = True):
        return self._read(self._err, text) if self._err else ("" if text else b"")

    @staticmethod
    def _read(path: str, text: bool):
        with open(path, "rb") as f:
            data = f.read()
        return data.decode() if text else data

    def close(self) -> None:
        """Removes its output files (the process must have ended)."""
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


def run_command(cmd: Sequence[str], *, cwd=None, env: dict[str, str] | None = None, timeout: float = 300.0,
                text: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, cwd=cwd, env=env, timeout=timeout, text=text)`` for
    ``cmd = [sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``, forked rather than a fresh
    interpreter (module doc)."""
    command = Command(cmd, cwd=cwd, env=env)
    try:
        code = command.wait(timeout)
        return subprocess.CompletedProcess(command.args, code, command.output(text), command.error(text))
    finally:
        command.close()
