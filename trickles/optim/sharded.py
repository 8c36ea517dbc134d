"""The optimizer over the parameter segments one data-parallel rank owns (ZeRO's sharded optimizer).

Each rank updates only its :class:`~trickles.parallel.data.flat.Segment` s, with the optimizer
``train.optimizer`` names (:class:`~trickles.optim.settings.OptimizerSettings`) applied to
per-segment tensors. AdamW and SGD are element-wise, so this is element for element the update a
single process makes on the whole parameter; LAMB and LARS also need each weight's norms, which
the engine's norm provider (:class:`~trickles.parallel.norms.ShardNorms`) reduces over the ranks
holding its segments -- the same update again, to rounding.

Where the state lives:

* default, fp32 parameters: the *master weights are the parameters themselves* (the rank's
  slices of the flat parameter buffer), updated in place; Adam's (and LAMB's) two moments add
  ``8 P / N`` bytes per rank, LARS's and SGD's momentum ``4 P / N``;
* parameters in a lower precision: an fp32 master copy of the segments (``4 P / N``) is kept
  and copied back into the parameters after each step; gradients in a lower precision are
  copied to fp32 before the step (another ``4 P / N``), fp32 gradients are used as they are;
* ``offload=True``: master copy, moments and the step itself live in host memory (pinned on
  CUDA); reduced gradient segments are copied to the host and the updated masters copied back,
  on side streams. Given ``units`` (the engine's buckets in forward order) and an element-wise
  optimizer, the step is overlapped (:class:`~trickles.optim.offload.OverlappedHostStep`): gradients
  leave during backward, the host steps unit by unit on a thread while the next forward starts,
  and :meth:`ShardedOptimizer.wait_unit` hands each unit back just before it is used. Otherwise the
  step waits for each transfer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CheckpointError
from ..parallel.data.flat import Segment
from .settings import LAYERWISE, OptimizerSettings


class ShardedOptimizer:
    """The optimizer ``settings`` names on ``segments``; ``param_of(seg)`` / ``grad_of(seg)`` give the device
    tensors (1-D); ``norms``: the engine's norm provider (LAMB and LARS), bound here to the master tensors."""

    def __init__(
        self,
        segments: list[Segment],
        param_of: Callable[[Segment], torch.Tensor],
        grad_of: Callable[[Segment], torch.Tensor],
        decay: dict[str, bool],
        settings: OptimizerSettings,
        offload: bool = False,
        norms=None,
        units: list[list[int]] | None = None,
    ):
        self.segments = segments
        self.settings = settings
        self.params = [param_of(s) for s in segments]
        self.grads = [grad_of(s) for s in segments]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.offload = offload
        self.separate = offload or any(p.dtype != torch.float32 for p in self.params)  # masters apart from params
        self.copy_grads = offload or any(g.dtype != torch.float32 for g in self.grads)  # fp32 gradients apart
        host = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"
        n = sum(s.numel for s in segments)
        self.master_flat = torch.empty(n, dtype=torch.float32, device=host, pin_memory=pin) if self.separate else None
        self.grad_flat = torch.zeros(n, dtype=torch.float32, device=host, pin_memory=pin) if self.copy_grads else None
        self.masters = _pieces(self.master_flat, segments) if self.separate else self.params
        self.host_grads = _pieces(self.grad_flat, segments) if self.copy_grads else self.grads
        if self.separate:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    m.copy_(p)
        for m, g in zip(self.masters, self.host_grads):
            m.grad = g
        groups = [  # the decay group also takes LAMB's and LARS's trust ratio (optim.settings)
            {
                "params": [m for s, m in zip(segments, self.masters) if decay[s.name]],
                "weight_decay": settings.weight_decay,
                "adapt": True,
            },
            {
                "params": [m for s, m in zip(segments, self.masters) if not decay[s.name]],
                "weight_decay": 0.0,
                "adapt": False,
            },
        ]
        groups = [g for g in groups if g["params"]]
        opt_device = self.masters[0].device if self.masters else torch.device("cpu")
        self.norms = norms
        if norms is not None:
            norms.bind(segments, self.masters)
        self.optimizer = settings.build(groups, opt_device, norms) if groups else None
        self._stream = torch.cuda.Stream(device) if offload and device.type == "cuda" else None
        self.overlapped = None  # the overlapped host step (offload with units and an element-wise optimizer)
        if offload and units is not None and self.optimizer is not None and settings.name not in LAYERWISE:
            from .offload import OverlappedHostStep

            self.overlapped = OverlappedHostStep(
                self.optimizer, units, self.params, self.grads, self.masters, self.host_grads, device
            )

    def step(self, lr: float) -> None:
        """One optimizer step with learning rate ``lr`` on every owned segment."""
        if self.optimizer is None:
            if self.norms is not None and self.settings.name in LAYERWISE:
                self.norms.norms([], [])  # a rank owning nothing still takes part in the norms' reduction
            return
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.overlapped is not None:
            self.overlapped.launch(lr)
            return
        if self.copy_grads:
            self._copy(self.host_grads, self.grads)
        self.optimizer.step()
        if self.separate:
            self._copy(self.params, self.masters)

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if not dst:
                return
            if self._stream is None:
                torch._foreach_copy_(dst, src)
                return
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                torch._foreach_copy_(dst, src, non_blocking=True)
            torch.cuda.current_stream().wait_stream(self._stream)
            self._stream.synchronize()

    def grads_final(self, unit: int) -> None:
        """The engine's word that ``unit``'s gradients are reduced and final: the overlapped step starts copying
        them."""
        if self.overlapped is not None:
            self.overlapped.copy_grads(unit)

    def scale(self, factor: torch.Tensor) -> None:
        """The engine multiplied the device gradients by ``factor``; the overlapped step's host copies get it too."""
        if self.overlapped is not None:
            self.overlapped.scale(factor)

    def wait_unit(self, unit: int) -> None:
        if self.overlapped is not None:
            self.overlapped.wait_unit(unit)

    def wait(self) -> None:
        """Blocks until the latest step is done on the host and back on the device."""
        if self.overlapped is not None:
            self.overlapped.wait()

    # ---- accounting and checkpoints ------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state held: moments, step counters, and separate masters/gradients."""
        self.wait()
        total = (
            sum(
                t.numel() * t.element_size()
                for st in self.optimizer.state.values()
                for t in st.values()
                if torch.is_tensor(t)
            )
            if self.optimizer
            else 0
        )
        for extra in (self.master_flat, self.grad_flat):
            if extra is not None:
                total += extra.numel() * 4
        return total

    def state_tensors(self, writes=None) -> dict[str, tuple[torch.Tensor, dict]]:
        """``"<param>/<key>" -> (1-D tensor, piece description)`` of every owned segment.

        ``writes(param)``: whether this rank writes the state of ``param`` (None: all of it).
        """
        from ..train.pieces import describe, fused_meta

        self.wait()
        out = {}
        for s, m in zip(self.segments, self.masters):
            if writes is not None and not writes(s.slot.param):
                continue
            meta = describe(s.slot.param, s.param_range)
            st = self.optimizer.state.get(m, {}) if self.optimizer else {}
            for key in self.settings.state_keys:
                if st.get(key) is not None:
                    out[f"{s.name}/{key}"] = (st[key], meta)
            if "step" in st:
                out[f"{s.name}/step"] = (
                    st["step"].reshape(1).float(),
                    {"global_shape": [1], "scalar": True, **fused_meta(s.slot.param)},
                )
            if self.separate and self.params[0].dtype != torch.float32:
                out[f"{s.name}/master"] = (m, meta)
        return out

    def load_state(self, reader) -> None:
        """Restores moments (and fp32 masters) of the owned segments from a :class:`PieceReader`."""
        from ..train.pieces import fused_layout, region_of

        if self.optimizer is None:
            return
        self.wait()
        if self.separate:  # the parameters were just loaded: start the masters from them
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    m.copy_(p)
        keys = self.settings.state_keys
        for s, m in zip(self.segments, self.masters):
            if not keys:
                break
            layout = fused_layout(s.slot.param)
            if not reader.holds(f"{s.name}/{keys[0]}", layout):
                other = [k for k in ("exp_avg", "momentum_buffer") if reader.holds(f"{s.name}/{k}", layout)]
                if other:
                    raise CheckpointError(
                        f"the checkpoint holds {other[0]} for {s.name}, the state of another optimizer than "
                        f"train.optimizer = {self.settings.name}; resume with the optimizer it was saved with"
                    )
                continue
            where = region_of(s.slot.param)
            state = {
                key: reader.read(f"{s.name}/{key}", where, s.param_range, layout).to(m.device, torch.float32)
                for key in keys
            }
            if reader.holds(f"{s.name}/step", layout):
                step = reader.read(f"{s.name}/step", layout=layout)
                state["step"] = torch.tensor(
                    float(step.reshape(-1)[0]),
                    dtype=torch.float32,
                    device=m.device if self.optimizer.defaults.get("fused") else "cpu",
                )
            self.optimizer.state[m] = state
            if self.separate and reader.holds(f"{s.name}/master", layout):
                with torch.no_grad():
                    m.copy_(reader.read(f"{s.name}/master", where, s.param_range, layout))


def _pieces(flat: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    out, pos = [], 0
    for s in segments:
        out.append(flat[pos : pos + s.numel])
        pos += s.numel
    return out
