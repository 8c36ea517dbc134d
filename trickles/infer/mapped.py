"""A checkpoint's tensors as the layer streamer reads them: whole tensors through memory maps of the safetensors
files, pieces (tensor-parallel blocks, ZeRO flat ranges) through :class:`~trickles.train.pieces.PieceReader`, and the
single-threaded copy a prefetch thread uses (:mod:`trickles.infer.streaming` has the whole story).

A memory map (``torch.UntypedStorage.from_file``) gives file-backed pages the kernel can drop, not anonymous memory, so
a model larger than the host's free memory can still be read block by block.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch

from ..models.fused import FusedLayout
from ..train.pieces import DTYPES, PieceReader

__all__ = ["CheckpointTensors", "checkpoint_key"]


def checkpoint_key(param_name: str) -> str:
    """The checkpoint entry holding the model parameter ``param_name`` (the one place a renaming would go)."""
    return param_name


class CheckpointTensors:
    """A checkpoint's ``model*.safetensors`` tensors by name: memory-mapped views of whole ones, pieces read
    otherwise."""

    def __init__(self, root: str):
        self.reader = PieceReader(root, "model")
        self._views: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(root)):
            if name.startswith("model") and name.endswith(".safetensors"):
                self._map_file(os.path.join(root, name))

    def _map_file(self, path: str) -> None:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        size = os.path.getsize(path)
        data = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=size))
        for key, info in header.items():
            if key == "__metadata__" or info["dtype"] not in DTYPES or len(self.reader.pieces.get(key, ())) != 1:
                continue
            meta = self.reader.pieces[key][0][1]
            if (
                meta.get("scalar")
                or "offset" in meta
                or "flat_range" in meta
                or list(meta["global_shape"]) != info["shape"]
            ):
                continue  # a part of a tensor: PieceReader assembles it
            a, b = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            if (8 + n + a) % dtype.itemsize:
                continue
            self._views[key] = data[8 + n + a : 8 + n + b].view(dtype).view(info["shape"])

    def mapped(self, key: str) -> bool:
        """Whether ``key`` is read from a memory map (a whole tensor in one file)."""
        return key in self._views

    def get(self, key: str) -> torch.Tensor:
        """Tensor ``key`` on the CPU: a view of the memory-mapped file, or assembled from its pieces."""
        view = self._views.get(key)
        return view if view is not None else self.reader.read(key)

    def copy_into(self, key: str, dst: torch.Tensor, layout: FusedLayout | None = None, copy=None) -> None:
        """Tensor ``key`` into ``dst`` with ``copy(dst, src)`` (default ``dst.copy_(src)``).

        ``layout``: ``key`` is a fused projection's tensor (:mod:`trickles.models.fused`). Stored whole in one file it
        is copied as it is; otherwise each of its parts is copied into its rows of ``dst`` (a strided view: row block
        ``i`` of every group), so the parts are read from their memory maps without assembling the fused tensor
        in anonymous memory first.
        """
        copy = copy or (lambda d, s: d.copy_(s))
        if layout is None or self.mapped(key):
            copy(dst, self.get(key))
            return
        rows = dst.view(layout.groups, layout.per_group, *dst.shape[1:])
        start = 0
        for part, n in zip(layout.part_keys(key), layout.sizes):
            src = self.get(part)
            copy(rows[:, start : start + n], src.reshape(layout.groups, n, *src.shape[1:]))
            start += n


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_one_thread(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on the calling thread alone (NumPy's copy, bit for bit, of any strides: a fused weight's part
    goes to rows interleaved with the other parts'): ``Tensor.copy_`` of a large tensor starts its own OpenMP team,
    which on a small CPU competes with the compute threads it should hide under."""
    if src.dtype == dst.dtype and src.shape == dst.shape and src.element_size() in _BITS:
        bits = _BITS[src.element_size()]
        np.copyto(dst.view(bits).numpy(), src.view(bits).numpy())
    else:
        dst.copy_(src)
