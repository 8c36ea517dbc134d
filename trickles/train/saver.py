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

**A failed save does not kill training -- unless it is the last.** Any rank's write or rank 0's commit raising (a
full or read-only filesystem, a quota) fails the save: once every rank's writer has ended (the settling all-reduce
comes after each rank joined its own), rank 0 removes ``step_N.tmp`` -- never while another rank may still write into
it; it was never renamed into place and ``--resume auto`` reads only complete ``step_N`` directories. The failure is
logged with its step and reason and written to the metrics (``{"step": N, "checkpoint_failed": reason}``), and the
next checkpoint step tries again. ``train.max_failed_saves`` failures in a row stop the run with
:class:`~trickles.errors.SavesFailed` (:data:`~trickles.errors.EXIT_SAVES_FAILED`) rather than let it run on
unprotected. A **final** save (``final=True``: the last step's, or the one a SIGTERM stops at) has no later step to try
again: it is verified against its manifest before the rename, and its failure raises SavesFailed at once. A rank
killed while a save is in flight leaves a ``.tmp`` directory; every save begins by removing such leftovers (rank 0,
when no writer runs on any rank), and the previous complete checkpoint is what a restart resumes.

Host memory: a save in flight holds a host copy of the rank's checkpoint tensors (:attr:`Saver.host_bytes`: what the
rank writes, about its shard of the model and optimizer state).

Injected faults (tests): ``TRICKLES_FAIL_SAVES`` (:mod:`trickles.train.faults`) fails a write, kills a rank or sends
SIGTERM at a chosen phase of a chosen save.
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
from . import faults as injected

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
    final: bool = False  # verified against its manifest before the rename; its failure raises (Saver.settle)


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
        self.faults = injected.from_environment()  # TRICKLES_FAIL_SAVES (tests)
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
    def save(
        self, take: Callable[[str], Snapshot], ckpt_dir: str, step: int, wait: bool, final: bool = False
    ) -> str | None:
        """Waits for the save in flight, takes this step's snapshot (``take(tmp)``, every rank) and writes it -- in
        the background unless ``wait``, ``final`` or the saver is synchronous. Returns rank 0's committed path once
        written (None while in flight, on failure and on the other ranks). ``final``: the run's last save, verified
        before the rename; its failure raises SavesFailed (:meth:`settle`)."""
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
            for name in sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else ():
                if name.startswith("step_") and name.endswith(".tmp"):  # no writer runs on any rank now (settled)
                    self._remove(os.path.join(ckpt_dir, name), "left by a save that did not finish", say=True)
            try:
                ckpt.begin(ckpt_dir, step)
            except OSError:
                pass  # the write reports it (its files cannot go anywhere): one path for every failure
        world.barrier()
        injected.strike(self.faults, step, self.topo.rank, "copy")
        snapshot = take(tmp)
        snapshot.final = final
        flight = _Flight(snapshot, None)
        self._flight = flight
        if self.background and not wait and not final:
            flight.thread = threading.Thread(
                target=self._write, args=(flight,), name=f"checkpoint-step-{step}", daemon=True
            )
            flight.thread.start()
            return None
        self._write(flight)
        return self.settle(final)

    def settle(self, final: bool = False) -> str | None:
        """Waits for the save in flight (if any) and settles its outcome on every rank (a collective); rank 0 then
        removes a failed save's directory. Raises SavesFailed after ``max_failed`` failed saves in a row, and at once
        when ``final`` (the run's last save: a committed one is first verified, if its writer did not). Returns rank
        0's committed path, else None."""
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        if flight.thread is not None:
            flight.thread.join()
        if final and flight.final and not flight.snapshot.final:  # committed in the background, not yet verified
            try:
                ckpt.verify(flight.final[0])
            except CheckpointError as e:
                flight.error.append(_reason(e, self.topo.rank))
                flight.final.clear()
        failed = torch.tensor([1.0 if flight.error else 0.0])
        world = self.topo.comm("world")
        if world.size > 1:
            world.all_reduce(failed, op="max")
        step = flight.snapshot.step
        if failed.item() == 0:
            self.failed_in_a_row = 0
            return flight.final[0] if flight.final else None
        # every rank joined its writer before the all-reduce: nothing writes into step_N.tmp any more
        if self.topo.is_main:
            self._remove(flight.snapshot.tmp, "a failed save's directory")
        self.failed_in_a_row += 1
        reason = flight.error[0] if flight.error else "another rank's part failed"
        if world.size > 1:  # every rank tells rank 0's reason: its own, or the first failed rank's marker
            reason = _from_rank0(world, reason)
        self.failures.append((step, reason))
        stop = final or self.failed_in_a_row >= self.max_failed
        if self.topo.is_main:
            self.say(
                f"[trickles] checkpoint step {step} failed: {reason}"
                + ("" if stop else "; training goes on and the next checkpoint step tries again")
                + ("" if final else f" ({self.failed_in_a_row} of train.max_failed_saves={self.max_failed} in a row)")
            )
            if self.record is not None:
                self.record({"step": step, "checkpoint_failed": reason})
        newest = ckpt.list_checkpoints(os.path.dirname(flight.snapshot.tmp))
        resume = f"step {newest[-1][0]}" if newest else "step 0 (no complete checkpoint)"
        if final:
            raise SavesFailed(
                f"the final checkpoint, step {step}, was not saved: {reason}; free space or fix train.out_dir, "
                f"then run again with --resume auto (it continues from {resume})",
                step,
                reason,
            )
        if stop:
            raise SavesFailed(
                f"{self.failed_in_a_row} checkpoint saves failed in a row (the last at step {step}: "
                f"{reason}); stopping rather than training on without checkpoints: free space or fix "
                f"train.out_dir, then run again with --resume auto (it continues from {resume})",
                step,
                reason,
            )
        return None

    def abandon(self) -> None:
        """On the way out after an error: waits for this rank's write, without meeting the other ranks (rank 0's
        writer stops waiting for their markers at once: a rank that died will never write one, and a launcher
        restarting the job must not wait for this process). An uncommitted ``step_N.tmp`` stays: another rank may
        still be writing into it; the next run's first save removes it, and nothing ever loads it."""
        self._giving_up.set()
        flight, self._flight = self._flight, None
        if flight is not None and flight.thread is not None:
            flight.thread.join(timeout=self.timeout_s if math.isfinite(self.timeout_s) else None)

    def _remove(self, path: str, why: str, say: bool = False) -> None:
        """Removes directory ``path`` (rank 0); says so with ``say``, and always when it cannot."""
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return
        except OSError as e:
            self.say(
                f"[trickles] could not remove {path} ({why}): {e}; it is never resumed from, the next save retries"
            )
            return
        if say:
            self.say(f"[trickles] removed {path} ({why})")

    # ---- the writer ----------------------------------------------------------------------
    def _write(self, flight: _Flight) -> None:
        snap = flight.snapshot
        rank, world = self.topo.rank, self.topo.world_size
        try:
            names = list(snap.files)
            for i, name in enumerate(names):
                if i == len(names) - 1:
                    injected.strike(self.faults, snap.step, rank, "write")
                ckpt.save_pieces(snap.files[name], os.path.join(snap.tmp, name))
            if not names:
                injected.strike(self.faults, snap.step, rank, "write")
            injected.strike(self.faults, snap.step, rank, "marker")
            _mark(snap.tmp, "done", rank)
        except Exception as e:  # noqa: BLE001 -- every failure of a save is survived (module docstring)
            flight.error.append(_reason(e, rank))
            _mark(snap.tmp, "failed", rank, flight.error[0])
        snap.files = {}  # the host copies go with the write
        if rank != 0 or flight.error:  # (a failed save's directory: Saver.settle removes it, once no rank writes)
            return
        try:
            snap.tokenizer.save(os.path.join(snap.tmp, "tokenizer"))
            ckpt.write_json(os.path.join(snap.tmp, "trainer.json"), snap.meta)
            other = _wait_for_markers(snap.tmp, world, self.timeout_s, self._giving_up)
            if other:
                flight.error.append(other)
                return
            for r in range(world):
                os.remove(_marker(snap.tmp, "done", r))
            flight.final.append(
                ckpt.commit(
                    snap.tmp,
                    snap.keep,
                    check=snap.final,
                    before=lambda phase: injected.strike(self.faults, snap.step, rank, phase),
                )
            )
        except Exception as e:  # noqa: BLE001
            flight.error.append(_reason(e, rank))


def _from_rank0(world, text: str, limit: int = 2048) -> str:
    """Rank 0's ``text`` (its first ``limit`` bytes) on every rank of ``world`` (a broadcast)."""
    data = text.encode()[:limit]
    buf = torch.zeros(limit + 4, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4 : 4 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    buf = world.broadcast(buf, src=0)
    n = int.from_bytes(bytes(buf[:4].tolist()), "little")
    return bytes(buf[4 : 4 + n].tolist()).decode(errors="replace")


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
