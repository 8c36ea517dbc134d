"""Command lines run in tests the way ``subprocess.run`` would, forked from the rank pool's preloaded forkserver.

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
import traceback
from collections.abc import Sequence

from .launch import _die_with_parent, _kill, rank_context

EMULATED_ENV = ("PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONPATH", "OMP_NUM_THREADS")
#: variables read once, by prefix -> the module that reads them when imported (None: the interpreter at start-up); a
#: difference matters only where that module is already imported in the forked process
IMPORT_TIME_ENV = {
    "PYTHON": None,
    "LD_": None,
    "TORCH": "torch",
    "PYTORCH_": "torch",
    "OMP_": "torch",
    "MKL_": "torch",
    "KMP_": "torch",
    "TRITON_": "triton",
    "HF_": "huggingface_hub",
    "TRANSFORMERS_": "transformers",
}
SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR",)  # Inductor's import sets it (for its compile workers) where it is unset


def _needs_fresh_interpreter(env: dict[str, str], inherited: dict[str, str]) -> bool:
    """Whether ``env`` differs from the forked process's inherited environment in a variable that an imported
    module (or the interpreter's start-up) has read already, and :func:`_command_main` does not apply by hand."""

    def read_already(key: str) -> bool:
        return any(
            key.startswith(prefix) and (module is None or module in sys.modules)
            for prefix, module in IMPORT_TIME_ENV.items()
        )

    keys = {
        k
        for k in (*env, *inherited)
        if read_already(k) and k not in EMULATED_ENV and not (k in SET_BY_IMPORTS and k not in env)
    }
    if "OMP_NUM_THREADS" in inherited and "OMP_NUM_THREADS" not in env:
        return True  # torch's default thread count is what a fresh interpreter would pick
    if any(
        os.path.exists(os.path.join(d, f"{m}.py"))
        for d in env.get("PYTHONPATH", "").split(os.pathsep)
        if d
        for m in ("sitecustomize", "usercustomize")
    ):
        return True  # imported at start-up
    return any(env.get(k) != inherited.get(k) for k in keys)


def _text_stream(fd: int, encoding: str, errors: str, unbuffered: bool, line_buffering: bool):
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding=encoding,
        errors=errors,
        line_buffering=line_buffering,
        write_through=unbuffered,
    )


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
    probe = subprocess.run(
        [cmd[0], "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        check=True,
    )
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
        self._proc = ctx.Process(
            target=_command_main,
            name="trickles-command",
            args=(cmd, cwd, env, self._out, self._err, _fresh_path(cmd, cwd, env)),
        )
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


def run_command(
    cmd: Sequence[str], *, cwd=None, env: dict[str, str] | None = None, timeout: float = 300.0, text: bool = True
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, cwd=cwd, env=env, timeout=timeout, text=text)`` for
    ``cmd = [sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``, forked rather than a fresh
    interpreter (module doc)."""
    command = Command(cmd, cwd=cwd, env=env)
    try:
        code = command.wait(timeout)
        return subprocess.CompletedProcess(command.args, code, command.output(text), command.error(text))
    finally:
        command.close()
