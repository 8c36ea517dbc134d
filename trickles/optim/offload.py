"""The offloaded optimizer step, overlapped with the device's work (``memory.offload_overlap``).

With ``memory.offload_optimizer`` the fp32 masters, the moments and the step live in host memory. Done in
sequence -- copy every gradient to the host, step, copy every parameter back -- the device idles through
all of it. :class:`OverlappedHostStep` takes the same step apart along the engine's *units* (ZeRO's buckets,
ordered as the next forward needs them: the last bucket holds the first layers):

1. **Gradients leave during backward.** As soon as a unit's gradients are final (its reduction done on the
   step's last micro-batch), the engine calls :meth:`copy_grads`: the unit's owned gradient segments are
   copied into pinned host memory on a side stream (CUDA; a plain copy on a CPU) while backward goes on.
2. **The host steps while the device starts the next forward.** :meth:`launch` hands the step to one host
   thread and returns at once. The thread takes the units in forward order: it waits for the unit's
   gradients, applies the pending gradient factor (loss-scale unscaling and clipping, which the engine
   decided on the device after the copies left: :meth:`scale`), runs the optimizer on the unit's segments
   only, and copies the unit's updated masters back into the device parameters (a side stream again).
3. **Parameters return block by block just before they are used.** The engine's forward pre-hooks call
   :meth:`wait_unit` for the units their module needs -- so block ``k``'s forward runs while the host
   updates block ``k + 1`` -- and then issue the unit's parameter all-gather themselves: every collective
   stays on the main thread, in the same order on every rank.

The arithmetic is the synchronous step's (the same optimizer on the same segments, elementwise), so every
layout still trains like one process. Only element-wise optimizers (AdamW, SGD) take this path: LAMB's and
LARS's trust ratios need norms reduced over the ranks inside the step, a collective the host thread may not
issue.

``trace``: when a list, the events of each step are appended to it as ``(name, unit)`` tuples in the order
they happen (``"grads_to_host"``, ``"host_step"``, ``"params_to_device"``; the engine adds its own), which is
how the tests prove the order on a machine without a GPU.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class OverlappedHostStep:
    """Steps ``optimizer`` (on host masters) unit by unit on a host thread; ``units``: segment indices per unit in
    the order the next forward needs them."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        units: list[list[int]],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        masters: list[torch.Tensor],
        host_grads: list[torch.Tensor],
        device: torch.device,
    ):
        self.optimizer, self.units = optimizer, units
        self.params, self.grads, self.masters, self.host_grads = params, grads, masters, host_grads
        self.device = device
        cuda = device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if cuda else None
        self._h2d = torch.cuda.Stream(device) if cuda else None
        self._grads_ready = [None] * len(units)  # CUDA events of the gradient copies
        self._params_ready = [None] * len(units)  # CUDA events of the parameter copies
        self._copied = [False] * len(units)
        self._done = [threading.Event() for _ in units]
        for e in self._done:
            e.set()
        ids = [{id(masters[i]) for i in unit} for unit in units]
        self._unit_groups = [
            [dict(g, params=[m for m in g["params"] if id(m) in mine]) for g in optimizer.param_groups] for mine in ids
        ]
        if sum(len(g["params"]) for groups in self._unit_groups for g in groups) != sum(
            len(g["params"]) for g in optimizer.param_groups
        ):
            raise ValueError("every optimizer segment must belong to exactly one unit")
        self._factor: torch.Tensor | None = None
        self._step_queued = None  # CUDA: an event after the step's device work (the parameters are read until then)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trickles-host-step")
        weakref.finalize(self, self._pool.shutdown, wait=False)  # the thread ends with the engine
        self._future: Future | None = None
        self.trace: list | None = None

    def _record(self, name: str, unit: int | None = None) -> None:
        if self.trace is not None:
            self.trace.append((name, unit))

    # ---- 1. gradients to the host ------------------------------------------------------------
    def copy_grads(self, unit: int) -> None:
        """Starts copying ``unit``'s final gradients to the host (once per step)."""
        if self._copied[unit]:
            return
        self.wait()  # the previous step's thread is done with the host gradients
        idx = self.units[unit]
        dst, src = [self.host_grads[i] for i in idx], [self.grads[i] for i in idx]
        self._copied[unit] = True
        self._record("grads_to_host", unit)
        self._copy(self._d2h, dst, src, self._queued(), self._grads_ready, unit)  # after the backward that made them

    def scale(self, factor: torch.Tensor) -> None:
        """Multiplies the gradients the host will use by ``factor`` (a scalar tensor), whether or not they left yet."""
        f = factor.detach().float().reshape(())
        self._factor = f if self._factor is None else self._factor * f

    # ---- 2. the host step ----------------------------------------------------------------------
    def launch(self, lr: float) -> None:
        """Copies what has not left yet, then steps every unit on the host thread, in order; returns at once."""
        for u in range(len(self.units)):
            self.copy_grads(u)
        self._copied = [False] * len(self.units)  # the next backward copies afresh
        self._step_queued = self._queued()  # the parameters go back only once this step's device work is done
        factor = None if self._factor is None else self._factor.to("cpu", non_blocking=False)
        self._factor = None
        for u in range(len(self.units)):
            self._done[u].clear()
        for groups in self._unit_groups:
            for g in groups:
                g["lr"] = lr
        self._future = self._pool.submit(self._run, factor)

    def _run(self, factor: torch.Tensor | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            for u, idx in enumerate(self.units):
                if self._grads_ready[u] is not None:
                    self._grads_ready[u].synchronize()
                    self._grads_ready[u] = None
                grads = [self.host_grads[i] for i in idx]
                if factor is not None and grads:
                    torch._foreach_mul_(grads, factor)
                self._record("host_step", u)
                self._step_unit(u)
                self._params_to_device(u, idx)
                self._done[u].set()
        finally:
            for e in self._done:  # never leave a waiter hanging: an error surfaces in wait()
                e.set()

    def _step_unit(self, u: int) -> None:
        opt = self.optimizer
        every = opt.param_groups
        opt.param_groups = self._unit_groups[u]  # the unit's segments, the groups' settings
        try:
            opt.step()
        finally:
            opt.param_groups = every

    def _params_to_device(self, u: int, idx: list[int]) -> None:
        self._record("params_to_device", u)
        self._copy(
            self._h2d,
            [self.params[i] for i in idx],
            [self.masters[i] for i in idx],
            self._step_queued,
            self._params_ready,
            u,
        )

    def _queued(self):
        """An event after the work queued so far on the device's current stream (None on a CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _copy(self, stream, dst: list[torch.Tensor], src: list[torch.Tensor], after, ready: list, unit: int) -> None:
        """``dst <- src``: a plain copy on a CPU; on CUDA on ``stream`` once ``after`` has happened, the copy's end
        recorded in ``ready[unit]``."""
        if not dst:
            return
        with torch.no_grad():
            if stream is None:
                torch._foreach_copy_(dst, src)
                return
            stream.wait_event(after)
            with torch.cuda.stream(stream):
                torch._foreach_copy_(dst, src, non_blocking=True)
                ready[unit] = torch.cuda.Event()
                ready[unit].record(stream)

    # ---- 3. parameters back, when needed ---------------------------------------------------------
    def wait_unit(self, unit: int) -> None:
        """Blocks until ``unit``'s parameters are updated on the device (the device's current stream waits for the
        copy)."""
        self._done[unit].wait()
        if self._future is not None and self._future.done():
            self._future.result()  # re-raise the host thread's error, if any
        ev = self._params_ready[unit]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self._params_ready[unit] = None

    def pending(self, unit: int) -> bool:
        """Whether ``unit``'s update of the latest step has not finished yet."""
        return not self._done[unit].is_set()

    def wait(self) -> None:
        """Blocks until the latest step is done, every unit back on the device."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()
            for u in range(len(self.units)):
                self.wait_unit(u)
