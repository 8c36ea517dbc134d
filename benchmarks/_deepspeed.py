"""DeepSpeed, the peer of three multi-rank benchmarks (ZeRO in ``data_parallel.py``, Ulysses attention in
``context_parallel.py``, DeepSpeed-MoE in ``moe.py``): loading it onto the benchmark's process group, and counting
the bytes its collectives send.

DeepSpeed is optional: where it does not import (or cannot start) :func:`load` says why, and each benchmark
prints that and goes on with the other contestants.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist


def load(device: torch.device):
    """``(deepspeed, version)`` with DeepSpeed adopting the existing process group, or ``(None, why)`` where it cannot
    be imported or started (``why``: the exception's type and first line)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    except Exception as e:  # noqa: BLE001 - any failure to import or start means the peer is absent
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed, deepspeed.__version__


class CountSent:
    """What ``deepspeed.comm.all_to_all_single`` and ``all_reduce`` send from this rank while entered: ``ops[name]`` is
    ``[calls, bytes]``; an all-to-all sends all but this rank's own split, an all-reduce the ring volume
    ``2 (N-1)/N`` of the tensor."""

    def __init__(self, world: int):
        self.world, self.ops = world, {"all_to_all_single": [0, 0], "all_reduce": [0, 0]}

    def __enter__(self) -> CountSent:
        import deepspeed.comm as dcomm

        self.mod, self.orig = dcomm, (dcomm.all_to_all_single, dcomm.all_reduce)
        orig_a2a, orig_ar = self.orig
        n = self.world

        def a2a(output, tensor, output_split_sizes=None, input_split_sizes=None, *a, **kw):
            nb = tensor.numel() * tensor.element_size()
            if input_split_sizes:
                row = nb // tensor.shape[0] if tensor.shape[0] else 0
                sent = nb - row * input_split_sizes[dist.get_rank(kw.get("group"))]
            else:
                sent = nb * (n - 1) // n
            self._count("all_to_all_single", sent)
            return orig_a2a(output, tensor, output_split_sizes, input_split_sizes, *a, **kw)

        def ar(tensor, *a, **kw):
            self._count("all_reduce", 2 * (n - 1) * tensor.numel() * tensor.element_size() // n)
            return orig_ar(tensor, *a, **kw)

        dcomm.all_to_all_single, dcomm.all_reduce = a2a, ar
        return self

    def _count(self, op: str, sent: int) -> None:
        self.ops[op][0] += 1
        self.ops[op][1] += sent

    def __exit__(self, *exc) -> None:
        self.mod.all_to_all_single, self.mod.all_reduce = self.orig

    @property
    def sent(self) -> int:
        return sum(v[1] for v in self.ops.values())
