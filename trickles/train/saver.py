"""Checkpoint saves that do not stop training, and that training survives.

A save has two halves.

* **The snapshot**, on the training thread of every rank, between two steps: the rank's checkpoint tensors (its
  model and optimizer pieces, :meth:`~trickles.parallel.engine.Engine.checkpoint_files`) copied to host memory (on
  CUDA into pinned buffers, one synchronize for all), every rank's RNG states gathered (a collective), and rank 0's
  ``trainer.json`` contents. Training goes on once it returns.
* **The write**, on a background thread of every rank (``train.async_checkpoint``; inline otherwise): the rank writes
  its files into ``step_N.tmp`` and then a marker ``.done-rankNNNNN`` (or ``.failed-rankNNNNN`` holding the reason);
  rank 0 also writes the tokenizer and ``trainer.json``, waits for every rank's marker and commits: it removes the
  markers, writes the manifest, renames the directory into place and deletes the checkpoints beyond
  ``train.keep_checkpoints`` (:func:`~trickles.train.checkpoint.commit`). No collective runs off the training thread:
  the ranks meet through the files of the directory they share.

**At most one save in flight.** The next save, and the end of training, first wait for it (the log says how long,
when it had to) and settle its outcome on the training thread: one all-reduce over every rank of whether any part
failed, so that every rank counts the same failures.

**A failed save never kills training.** Any rank's write or rank 0's commit raising (a full or read-only filesystem,
a quota) fails the save: rank 0 removes ``step_N.tmp`` (never renamed into place; ``--resume auto`` reads only
complete ``step_N`` directories), the failure is logged with its step and reason and written to the metrics
(``{"step": N, "checkpoint_failed": reason}``), and the next checkpoint step tries again. ``train.max_failed_saves``
failures in a row stop the run with :class:`~trickles.errors.SavesFailed` (exit status 1) rather than let it run on
unprotected. A rank killed while a save is in flight leaves a ``.tmp`` directory that the next save of the run
removes; the previous complete checkpoint is what a restart resumes.

Host memory: a save in flight holds a host copy of the rank's checkpoint tensors (:attr:`Saver.host_bytes`: what the
rank writes, about its shard of the model and optimizer state).

Injected failures (tests): ``TRICKLES_FAIL_SAVES`` = comma-separated steps (or ``*``) whose first file write raises
``OSError`` on every rank, ``STEP@RANK`` on one rank only.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError, SavesFailed
from . import checkpoint as ckpt

POLL_S = 0.01  # rank 0's writer looks for the other ranks' markers this often


@dataclass
class Snapshot:
    """One rank's part of a save: its files' tensors on the host, and on rank 0 what it writes besides."""

    step: int
    tmp: str
    files: dict[str, dict]  # file name -> {key: (host tensor, piece description)}
    meta: dict | None = None  # rank 0: trainer.json
    tokenizer: object | None = None  # rank 0: the tokenizer to save
    keep: int = 2  # complete checkpoints kept (train.keep_checkpoints)
    host_bytes: int = 0


@dataclass
class _Flight:
    snapshot: Snapshot
    thread: threading.Thread | None
    error: list[str] = field(default_factory=list)  # this rank's failure, if any
    final: list[str] = field(default_factory=list)  # rank 0: the committed path


def host_copy(files: dict[str, dict], device: torch.device) -> tuple[dict[str, dict], int]:
    """The tensors of ``files`` copied to host memory (pinned, asynchronously, on CUDA); their bytes."""
    out, nbytes = {}, 0
    cuda = device.type == "cuda"
    for name, tensors in files.items():
        copied = {}
        for key, (t, meta) in tensors.items():
            t = t.detach()
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            host.copy_(t, non_blocking=cuda)
            copied[key] = (host, meta)
            nbytes += host.numel() * host.element_size()
        out[name] = copied
    if cuda:
        torch.cuda.synchronize(device)
    return out, nbytes


class Saver:
    """Runs the trainer's checkpoint saves (module docstring) for one rank."""

    def __init__(
        self,
        topo,
        background: bool,
        max_failed: int,
        timeout_s: float,
        say: Callable[[str], None],
        record: Callable[[dict], None] | None = None,
    ):
        self.topo, self.background, self.max_failed = topo, background, max_failed
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else math.inf
        self.say, self.record = say, record
        self.failed_in_a_row = 0
        self.failures: list[tuple[int, str]] = []  # (step, reason) of every failed save, on rank 0 with every reason
        self._flight: _Flight | None = None
        self._cleaned = False
        self._giving_up = threading.Event()  # set by abandon(): rank 0's writer stops waiting for the others

    @property
    def pending_step(self) -> int | None:
        """The step of the save in flight, None when none is."""
        return self._flight.snapshot.step if self._flight is not None else None

    @property
    def host_bytes(self) -> int:
        """Bytes of host copies held by the save in flight (0 when none is)."""
        return self._flight.snapshot.host_bytes if self._flight is not None else 0

    # ---- the training thread -------------------------------------------------------------
    def save(self, take: Callable[[str], Snapshot], ckpt_dir: str, step: int, wait: bool) -> str | None:
        """Waits for the save in flight, takes this step's snapshot (``take(tmp)``, every rank) and writes it -- in
        the background unless ``wait`` or the saver is synchronous. Returns rank 0's committed path once written
        (None while in flight, on failure and on the other ranks)."""
        began = time.perf_counter()
        if self._flight is not None:
            busy = self._flight.thread is not None and self._flight.thread.is_alive()
            previous = self._flight.snapshot.step
            self.settle()
            if busy and self.topo.is_main:
                self.say(
                    f"[trickles] checkpoint step {step} waited {time.perf_counter() - began:.2f} s for step "
                    f"{previous}'s save to finish"
                )
        tmp = ckpt.step_dir(ckpt_dir, step) + ".tmp"
        world = self.topo.comm("world")
        if self.topo.is_main:
            if not self._cleaned:  # a run killed during a save left its .tmp directory
                for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else ():
                    if name.startswith("step_") and name.endswith(".tmp"):
                        shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
                self._cleaned = True
            try:
                ckpt.begin(ckpt_dir, step)
            except OSError:
                pass  # the write reports it (its files cannot go anywhere): one path for every failure
        world.barrier()
        snapshot = take(tmp)
        flight = _Flight(snapshot, None)
        self._flight = flight
        if self.background and not wait:
            flight.thread = threading.Thread(
                target=self._write, args=(flight,), name=f"checkpoint-step-{step}", daemon=True
            )
            flight.thread.start()
            return None
        self._write(flight)
        return self.settle()

    def settle(self) -> str | None:
        """Waits for the save in flight (if any) and settles its outcome on every rank (a collective); raises
        SavesFailed after ``max_failed`` failed saves in a row. Returns rank 0's committed path, else None."""
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        if flight.thread is not None:
            flight.thread.join()
        failed = torch.tensor([1.0 if flight.error else 0.0])
        world = self.topo.comm("world")
        if world.size > 1:
            world.all_reduce(failed, op="max")
        step = flight.snapshot.step
        if failed.item() == 0:
            self.failed_in_a_row = 0
            return flight.final[0] if flight.final else None
        self.failed_in_a_row += 1
        reason = flight.error[0] if flight.error else "another rank's part failed"
        self.failures.append((step, reason))
        if self.topo.is_main:
            self.say(
                f"[trickles] checkpoint step {step} failed: {reason}; training goes on and the next checkpoint step "
                f"tries again ({self.failed_in_a_row} of train.max_failed_saves={self.max_failed} in a row)"
            )
            if self.record is not None:
                self.record({"step": step, "checkpoint_failed": reason})
        if self.failed_in_a_row >= self.max_failed:
            raise SavesFailed(
                f"{self.failed_in_a_row} checkpoint saves failed in a row (the last at step {step}: "
                f"{reason}); stopping rather than training on without checkpoints: free space or fix "
                f"train.out_dir and resume from the last complete checkpoint"
            )
        return None

    def abandon(self) -> None:
        """On the way out after an error: waits for this rank's write, without meeting the other ranks (rank 0's
        writer stops waiting for their markers at once: a rank that died will never write one, and a launcher
        restarting the job must not wait for this process)."""
        self._giving_up.set()
        flight, self._flight = self._flight, None
        if flight is not None and flight.thread is not None:
            flight.thread.join(timeout=self.timeout_s if math.isfinite(self.timeout_s) else None)

    # ---- the writer ----------------------------------------------------------------------
    def _write(self, flight: _Flight) -> None:
        snap = flight.snapshot
        rank, world = self.topo.rank, self.topo.world_size
        try:
            _injected_fault(snap.step, rank)
            for name, tensors in snap.files.items():
                ckpt.save_pieces(tensors, os.path.join(snap.tmp, name))
            _mark(snap.tmp, "done", rank)
        except Exception as e:  # noqa: BLE001 -- every failure of a save is survived (module docstring)
            flight.error.append(_reason(e, rank))
            _mark(snap.tmp, "failed", rank, flight.error[0])
        snap.files = {}  # the host copies go with the write
        if rank != 0:
            return
        try:
            if not flight.error:
                snap.tokenizer.save(os.path.join(snap.tmp, "tokenizer"))
                ckpt.write_json(os.path.join(snap.tmp, "trainer.json"), snap.meta)
                other = _wait_for_markers(snap.tmp, world, self.timeout_s, self._giving_up)
                if other:
                    flight.error.append(other)
            if not flight.error:
                for r in range(world):
                    os.remove(_marker(snap.tmp, "done", r))
                flight.final.append(ckpt.commit(snap.tmp, snap.keep))
        except Exception as e:  # noqa: BLE001
            if not flight.error:
                flight.error.append(_reason(e, rank))
        if flight.error:
            shutil.rmtree(snap.tmp, ignore_errors=True)


def _marker(tmp: str, kind: str, rank: int) -> str:
    return os.path.join(tmp, f".{kind}-rank{rank:05d}")


def _mark(tmp: str, kind: str, rank: int, text: str = "") -> None:
    for content in (text, ""):  # on a full filesystem an empty file may still be created where the text cannot
        try:
            with open(_marker(tmp, kind, rank), "w") as f:
                f.write(content)
            return
        except OSError:
            continue  # (the directory gone: rank 0 failed first and removed it)


def _wait_for_markers(tmp: str, world: int, timeout_s: float, give_up: threading.Event) -> str | None:
    """Rank 0: waits until every rank has marked its part done or failed (or ``give_up`` is set); the first
    failure's reason, else None."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(world))
    while pending:
        for r in sorted(pending):
            if os.path.exists(_marker(tmp, "failed", r)):
                with open(_marker(tmp, "failed", r)) as f:
                    return f.read() or f"rank {r}'s part failed"
            if os.path.exists(_marker(tmp, "done", r)):
                pending.discard(r)
        if pending:
            if time.monotonic() > deadline:
                return f"ranks {sorted(pending)} did not finish writing within {timeout_s:.0f} s"
            if give_up.wait(POLL_S):
                return f"the run stopped before ranks {sorted(pending)} finished writing"
    return None


def _reason(e: BaseException, rank: int) -> str:
    return f"{type(e).__name__}: {e} (rank {rank})".replace("\n", " ")


def _injected_fault(step: int, rank: int) -> None:
    spec = os.environ.get("TRICKLES_FAIL_SAVES", "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        at, _, only = item.partition("@")
        if (at == "*" or int(at) == step) and (not only or int(only) == rank):
            raise OSError(28, f"No space left on device (injected by TRICKLES_FAIL_SAVES={spec})")


def probe_writable(directory: str, rank: int) -> None:
    """Writes and removes a file in ``directory``, or in its deepest existing ancestor (which the first save creates it
    under); CheckpointError naming the place when that fails -- a read-only or missing filesystem is found at the
    start, not at the first checkpoint. Nothing is left behind."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    path = os.path.join(existing, f".trickles-probe-rank{rank:05d}")
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, "not a directory", existing)
        with open(path, "w") as f:
            f.write("probe")
        os.remove(path)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoints to {directory} ({existing}: {e.strerror or e}); set "
            f"train.out_dir to a writable directory"
        ) from None
