"""This process in the job: its device, the default process group, the launcher's environment, a clean exit.

What a rank needs before (and after) it knows its place in the layout: :func:`select_device` picks ``cuda:LOCAL_RANK``
or the CPU, :func:`init_distributed` joins the default group through the launcher's TCP store (one key prefix per
restart attempt), :func:`shutdown_distributed` and :func:`exit_process` leave cleanly; :func:`handle_sigterm` turns
SIGTERM into a request to stop (:func:`stop_requested`) that the trainer honours after a step. The layout itself
(degrees, mesh, groups) is :mod:`trickles.topology`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from .errors import ConfigError


def select_device(preference: str = "auto") -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available (or asked for) with a GPU for every local rank, else CPU.

    ``auto`` falls back to CPU when this machine runs more ranks than it has GPUs (NCCL needs
    one GPU per rank); asking for ``cuda`` then is an error that says what to change.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "train.device asks for CUDA, but torch.cuda.is_available() is false; use train.device=auto or cpu"
        )
    if preference.startswith("cuda:"):
        return torch.device(preference)
    count = torch.cuda.device_count()
    if local_world > count:
        if preference == "auto":
            return torch.device("cpu")
        raise ConfigError(
            f"{local_world} ranks on this machine but {count} GPU(s) visible; launch at most {count} "
            f"processes per machine or use train.device=cpu"
        )
    return torch.device("cuda", local)


@contextlib.contextmanager
def _valid_local_rank(device: torch.device):
    """torch's DeviceMesh binds the process to ``cuda:LOCAL_RANK`` whenever CUDA is present, even for a CPU mesh;
    keep that index in range for CPU ranks on a machine with fewer GPUs than ranks."""
    saved = os.environ.get("LOCAL_RANK")
    if device.type == "cpu" and saved is not None and torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = str(int(saved) % torch.cuda.device_count())
    try:
        yield
    finally:
        if saved is not None:
            os.environ["LOCAL_RANK"] = saved


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS tells it, else all of them)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def env_world_size() -> int:
    """World size from the launcher's environment (torchrun or ours); 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_count() -> int:
    """How often the launcher has restarted this job after a failure: ``TRICKLES_RESTART`` (``trickles train
    --max-restarts``) or ``TORCHELASTIC_RESTART_COUNT`` (``torchrun --max-restarts``); 0 on the first attempt."""
    return int(os.environ.get("TRICKLES_RESTART") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def init_distributed(device: torch.device, timeout_s: float | None = None) -> bool:
    """Joins the default process group described by the environment; False when single-process.

    Rendezvous goes through the TCP store at ``MASTER_ADDR:MASTER_PORT``: hosted by the launcher
    (``trickles.launch``, which sets ``TRICKLES_AGENT_STORE=1``) or by torchrun's agent
    (``TORCHELASTIC_USE_AGENT_STORE``), else by rank 0. Every attempt of a restarted job
    (``TRICKLES_RESTART`` / ``TORCHELASTIC_RESTART_COUNT``) works under its own key prefix, so its
    ranks never meet the addresses the previous attempt left in the store.
    """
    world = env_world_size()
    if world == 1 or dist.is_initialized():
        return dist.is_initialized()
    rank = int(os.environ["RANK"])
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    hosted = (
        os.environ.get("TRICKLES_AGENT_STORE") == "1"
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    )
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not hosted and rank == 0,
        timeout=kwargs.get("timeout", datetime.timedelta(seconds=300)),
    )
    dist.init_process_group(
        backend_for(device),
        store=dist.PrefixStore(f"attempt{restart_count()}", store),
        rank=rank,
        world_size=world,
        **kwargs,
    )
    return True


def shutdown_distributed() -> None:
    """Clean teardown: barrier, collect garbage, destroy the group (see DESIGN.md's gloo note)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


_STOP = threading.Event()  # SIGTERM arrived while handle_sigterm() was active


@contextlib.contextmanager
def handle_sigterm():
    """While inside (on the main thread; elsewhere nothing is installed): SIGTERM does not end the process but sets
    :func:`stop_requested`; the previous handler comes back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _STOP.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_requested() -> bool:
    """Whether this process got SIGTERM under :func:`handle_sigterm`."""
    return _STOP.is_set()


def wait_for_stop_request(timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for :func:`stop_requested`; whether it came."""
    return _STOP.wait(timeout_s)


def exit_process(code: int) -> None:
    """Flushes output and leaves without running interpreter teardown (which can abort after gloo)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
