"""Serving an application: on a socket until interrupted (:func:`serve`, what ``trickles serve`` runs), or by uvicorn
in a thread of this process (:class:`BackgroundServer`: tests, benchmarks, notebooks)."""

from __future__ import annotations

import asyncio
import ipaddress
import sys
import threading
import time
from collections.abc import Callable

from .server import create_app

__all__ = ["serve", "BackgroundServer"]


def serve(
    model,
    tokenizer,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str = "trickles",
    max_batch: int = 32,
    on_ready: Callable[[str, int], None] | None = None,
    **app_options,
) -> None:
    """Serves ``model`` until interrupted. The socket is bound here (``port=0``: a free port), and ``on_ready(host,
    port)`` is told the address before uvicorn starts accepting connections. ``app_options`` go to
    :func:`create_app`; without ``api_key`` on an address other than loopback, one warning line goes to stderr."""
    import socket

    import uvicorn

    if not app_options.get("api_key") and not _loopback(host):
        print(
            f"[trickles] warning: listening on {host} without --api-key: anyone who can reach this address may "
            "use the model",
            file=sys.stderr,
            flush=True,
        )
    app = create_app(model, tokenizer, name=name, max_batch=max_batch, log_requests=True, **app_options)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    if on_ready is not None:
        on_ready(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


class BackgroundServer:
    """An application served by uvicorn in a thread of this process (tests, benchmarks, notebooks): ``port``, and
    ``stop()``, which shuts it down (the app's engine with it) and waits for the thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, port))
        self.port, self.timeout_s = sock.getsockname()[1], timeout_s
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {host}:{self.port} did not start")
            time.sleep(0.02)
        self.loop = self.server.servers[0].get_loop()  # the listening socket's loop: uvicorn's own

    def tasks(self) -> list[str]:
        """The asyncio tasks alive in the server's loop (their names and coroutines), for checking that none leak."""

        async def alive():
            me = asyncio.current_task()
            return sorted(f"{t.get_name()}: {t.get_coro()!r}" for t in asyncio.all_tasks() if t is not me)

        return asyncio.run_coroutine_threadsafe(alive(), self.loop).result(self.timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the server on port {self.port} did not shut down within {self.timeout_s:g} s")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
