"""Counting memory: the ZeRO formulas, and the bytes actually held by live tensors.

Model-state bytes per device with ``P`` parameters over ``N`` data-parallel ranks (Rajbhandari
et al., ZeRO, section 5), with ``p``, ``g``, ``k`` bytes per parameter for parameters,
gradients and optimizer state:

    stage 0:  (p + g + k) P
    stage 1:  (p + g) P + k P / N
    stage 2:  p P + (g + k) P / N
    stage 3:  (p + g + k) P / N

Mixed-precision Adam (the paper's case) has ``p = g = 2`` (fp16/bf16) and ``k = 12`` (fp32
master weights, momentum, variance). trickles' fp32 training has ``p = g = 4`` and ``k = 8``:
fp32 parameters are their own master weights.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import torch

FP32_ADAM = (4, 4, 8)
MIXED_ADAM = (2, 2, 12)


def zero_model_state_bytes(
    n_params: float, dp: int, stage: int, bytes_per_param: tuple[float, float, float] = MIXED_ADAM
) -> dict[str, float]:
    """``{"parameters", "gradients", "optimizer", "total"}`` bytes per device under ZeRO ``stage``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    p, g, k = bytes_per_param
    out = {
        "parameters": p * n_params / (dp if stage >= 3 else 1),
        "gradients": g * n_params / (dp if stage >= 2 else 1),
        "optimizer": k * n_params / (dp if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


try:  # a private module: where it is missing, no tensor is a fake one
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE
except ImportError:  # pragma: no cover - depends on the torch version
    _FAKE = ()


def live_tensor_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from Python objects (on ``device``, if given).

    Views share their base's storage and are counted once. Tensors that only C++ holds (e.g.
    activations saved by autograd) are not seen; call it between steps.
    """
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            # type(): no attribute lookups on foreign objects; fake tensors (torch.compile's tracing, which can leave
            # some in its caches) report a storage size but hold no memory
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta or issubclass(type(obj), _FAKE):
                continue
            if device is not None and obj.device != torch.device(device):
                continue
            st = obj.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # objects that pretend to be tensors (e.g. fakes) are not memory
            continue
    return sum(seen.values())


def peak_allocated(fn, device: torch.device | str = "cpu"):
    """Runs ``fn()``; returns ``(its result, the most bytes allocated above the start while it ran)``.

    On CUDA from the caching allocator's statistics (``max_memory_allocated``); on a CPU, which keeps no such
    statistic, from the profiler's record of every allocation and free (``profile_memory=True``), replayed in
    time order by :func:`replay_allocations`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - start
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's backend prints a line to the process's stderr as it starts and stops
        prof.start()
    try:
        out = fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    with tempfile.TemporaryDirectory(prefix="trickles_peak_") as tmp:  # the exported trace has each block's address
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return out, replay_allocations(events)[0]


def replay_allocations(events: list[dict]) -> tuple[int, float]:
    """``(the highest level above the start, when)`` of the CPU allocations in a profiler trace (chrome format).

    Every ``[memory]`` event moves the level by its bytes, in time order. One correction: a block allocated on the
    thread that ran the step and released by a collective's worker thread (gloo's work objects keep their tensors
    until the worker drops them, outside the profiler's view) has no recorded free. Its address shows it: it is
    allocated again, or never freed. Such a block is counted until the collective that took it has finished
    (the first worker-thread span ending after the block was allocated) and the step's thread has made its next
    allocation -- the latest it can still be in use by the step, whose own references to it are gone by then
    (else the step's thread would have freed it, on the record). Without that, the record keeps every such block
    forever and the level drifts up by a message per collective.
    """
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0),
        key=lambda e: e["ts"],
    )
    if not mem:
        return 0, 0.0
    counts: dict = {}
    for e in mem:
        counts[e["tid"]] = counts.get(e["tid"], 0) + 1
    main = max(counts, key=counts.get)
    spans = sorted(e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X" and e.get("tid") != main)
    main_allocs = [e["ts"] for e in mem if e["tid"] == main and e["args"]["Bytes"] > 0]
    # allocations whose free is missing: the next event at their address is another allocation, or there is none
    open_at: dict = {}
    unmatched = []
    for e in mem:
        a = e["args"]
        if a["Bytes"] > 0:
            if a["Addr"] in open_at:
                unmatched.append(open_at[a["Addr"]])
            open_at[a["Addr"]] = e
        else:
            open_at.pop(a["Addr"], None)
    unmatched.extend(open_at.values())
    import bisect

    timeline = [(e["ts"], 0, e["args"]["Bytes"]) for e in mem]
    for e in unmatched:
        if e["tid"] != main:
            continue
        i = bisect.bisect_right(spans, e["ts"])
        if i == len(spans):
            continue
        j = bisect.bisect_right(main_allocs, spans[i])
        if j < len(main_allocs):
            timeline.append((main_allocs[j], 1, -e["args"]["Bytes"]))  # after that allocation (order key 1)
    timeline.sort(key=lambda t: (t[0], t[1]))
    level = peak = 0
    when = timeline[0][0]
    for ts, _, nbytes in timeline:
        level += nbytes
        if level > peak:
            peak, when = level, ts
    return peak, when


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 pointed at the null device (what C++ code writes there included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
