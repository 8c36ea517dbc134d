"""Tensors stored in pieces: what each piece is, and reading any region back from them.

Every layout stores a tensor as one or more *pieces*. A piece is described (in the safetensors
file's metadata, ``{"slices": {key: description}}``) as

    {"global_shape": [...], "offset": [...], "block_shape": [...], "flat_range": [a, b]}

-- a block of the global tensor (``offset``/``block_shape``; absent: the whole tensor, as a
replicated parameter is stored) and, optionally, elements ``[a, b)`` of that block flattened
(absent: all of it). Tensor parallelism stores blocks, ZeRO flat ranges, both together flat
ranges of blocks. ``{"scalar": true}`` marks a value stored once (a step counter).

:class:`PieceReader` answers "give me block ``(offset, shape)`` of tensor ``key``, or elements
``[a, b)`` of it" from whichever pieces overlap, reading from disk only the rows those pieces
contribute, so a rank never loads the whole model to find its part. :func:`save_whole` writes
every tensor of a :class:`PieceReader` whole (consolidating a checkpoint), in files of bounded size.

A fused projection (:mod:`trickles.models.fused`) is stored as the model holds it, its description
carrying ``{"fused": layout}``; the reader shows it under its parts' names only (``q_proj``, ``k_proj``,
``v_proj``), reading a part's rows from the fused pieces, and gives a fused model's parameter from a
checkpoint that holds the parts. So a checkpoint has the same names whether the run fused or not, and
either kind of model resumes from either kind of checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..models.fused import FusedLayout

#: safetensors' names of the element types a checkpoint may hold
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def whole_on_every_tp_rank(param: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds all of ``param`` (no ``tp_spec``, or a replicated one)."""
    spec = getattr(param, "tp_spec", None)
    return spec is None or spec.replicated


def is_block(param: torch.Tensor) -> bool:
    """Whether ``param`` is a block of a larger tensor (split by tensor or expert parallelism)."""
    spec = getattr(param, "tp_spec", None)
    return spec is not None and tuple(spec.global_shape) != tuple(param.shape)


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor that ``param`` is (a tensor-parallel block of)."""
    spec = getattr(param, "tp_spec", None)
    return tuple(spec.global_shape) if spec is not None else tuple(param.shape)


def describe(param: torch.Tensor, flat_range: tuple[int, int] | None = None) -> dict[str, Any]:
    """The piece description of ``param`` as this rank holds it (its tensor-parallel block, if any)."""
    shape = list(param.shape)
    if not is_block(param):
        meta: dict[str, Any] = {"global_shape": shape}
    else:
        meta = {
            "global_shape": list(param.tp_spec.global_shape),
            "offset": list(param.tp_spec.offset),
            "block_shape": shape,
        }
    if flat_range is not None:
        meta["flat_range"] = [int(flat_range[0]), int(flat_range[1])]
    return {**meta, **fused_meta(param)}


def fused_layout(param: torch.Tensor) -> FusedLayout | None:
    """The layout of a fused projection's parameter (None: any other tensor)."""
    return getattr(param, "fused_layout", None)


def fused_meta(param: torch.Tensor) -> dict[str, Any]:
    """``{"fused": layout}`` for a fused projection's parameter, else nothing."""
    layout = fused_layout(param)
    return {"fused": layout.to_meta()} if layout is not None else {}


def region_of(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of the block of the global tensor that ``param`` holds."""
    if not is_block(param):
        return (0,) * param.dim(), tuple(param.shape)
    return tuple(param.tp_spec.offset), tuple(param.shape)


def save_pieces(tensors: dict[str, Any], path: str) -> None:
    """Writes ``{key: tensor}`` (whole tensors) or ``{key: (tensor, description)}``."""
    data, slices = {}, {}
    for k, v in tensors.items():
        t, meta = v if isinstance(v, tuple) else (v, {"global_shape": list(v.shape)})
        data[k] = t.detach().contiguous().cpu()
        slices[k] = meta
    save_file(data, path, metadata={"format": "pt", "slices": json.dumps(slices)})


class PieceReader:
    """Reads regions of tensors from every ``<prefix>*.safetensors`` of a checkpoint directory."""

    def __init__(self, root: str, prefix: str):
        self.pieces: dict[str, list[tuple[str, dict]]] = {}
        names = sorted(n for n in os.listdir(root) if n.startswith(prefix) and n.endswith(".safetensors"))
        if not names:
            raise CheckpointError(f"checkpoint {root} has no {prefix}*.safetensors files")
        for n in names:
            path = os.path.join(root, n)
            try:
                with safe_open(path, framework="pt") as f:
                    slices = json.loads((f.metadata() or {}).get("slices", "{}"))
                    for k in f.keys():
                        self.pieces.setdefault(k, []).append(
                            (path, slices.get(k) or {"global_shape": list(f.get_slice(k).get_shape())})
                        )
            except Exception as e:
                raise CheckpointError(f"cannot read {path}: {e}") from None
        #: a part's name -> (the fused tensor stored, its layout, the part's index)
        self.parts: dict[str, tuple[str, FusedLayout, int]] = {}
        for k, pieces in self.pieces.items():
            if "fused" in pieces[0][1]:
                layout = FusedLayout.from_meta(pieces[0][1]["fused"])
                self.parts.update({name: (k, layout, i) for i, name in enumerate(layout.part_keys(k))})
        self.fused = {k for k, _, _ in self.parts.values()}

    def keys(self) -> list[str]:
        """Every tensor's name, a fused projection's under its parts' names."""
        return sorted([k for k in self.pieces if k not in self.fused] + list(self.parts))

    def __contains__(self, key: str) -> bool:
        return key in self.pieces or key in self.parts

    def holds(self, key: str, layout: FusedLayout | None = None) -> bool:
        """Whether ``key`` can be read: stored, a part of a stored fused tensor, or (``layout``: ``key`` is a fused
        tensor's) made of stored parts."""
        return key in self or (layout is not None and all(k in self for k in layout.part_keys(key)))

    def global_shape(self, key: str, layout: FusedLayout | None = None) -> tuple[int, ...]:
        if key in self.parts:
            stored, lay, i = self.parts[key]
            shape = self.global_shape(stored)
            return (lay.groups * lay.sizes[i], *shape[1:])
        if key not in self.pieces and layout is not None:
            shapes = [self.global_shape(k) for k in layout.part_keys(key)]
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        return tuple(self.pieces[key][0][1].get("global_shape", []))

    def is_scalar(self, key: str) -> bool:
        """Whether ``key`` is a value stored once (``{"scalar": true}``, e.g. a step counter)."""
        key = self.parts[key][0] if key in self.parts else key
        return bool(self.pieces[key][0][1].get("scalar"))

    def read(
        self,
        key: str,
        block: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        flat_range: tuple[int, int] | None = None,
        layout: FusedLayout | None = None,
    ) -> torch.Tensor | None:
        """Block ``(offset, shape)`` of ``key`` (None: all of it), or its elements ``[a, b)`` flattened; None if absent.

        ``layout``: ``key`` is a fused projection's tensor with this layout, which may be stored as its parts."""
        if key in self.parts:
            return self._read_part(key, block, flat_range)
        if key not in self.pieces:
            if layout is not None and self.holds(key, layout):
                return self._read_fused(key, layout, block, flat_range)
            return None
        pieces = self.pieces[key]
        if pieces[0][1].get("scalar"):
            return _load(pieces[0][0], key)
        gshape = self.global_shape(key)
        t_off, t_shape = block if block is not None else ((0,) * len(gshape), gshape)
        out, covered = None, None
        for path, meta in pieces:
            p_off = tuple(meta.get("offset", (0,) * len(gshape)))
            p_shape = tuple(meta.get("block_shape", gshape))
            lo = [max(a, b) for a, b in zip(t_off, p_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(t_off, t_shape, p_off, p_shape)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            part, mask = _piece_region(path, key, meta, p_off, p_shape, lo, hi)
            if out is None:
                out = torch.empty(t_shape, dtype=part.dtype)
                covered = torch.zeros(t_shape, dtype=torch.bool)
            dst = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, t_off))
            if mask is None:
                out[dst] = part
                covered[dst] = True
            else:
                out[dst] = torch.where(mask, part, out[dst])
                covered[dst] |= mask
        if out is None:
            raise CheckpointError(
                f"the checkpoint holds no piece of {key} covering the part asked for; it is incomplete"
            )
        flat_out, flat_cov = out.reshape(-1), covered.reshape(-1)
        if flat_range is not None:
            flat_out, flat_cov = flat_out[flat_range[0] : flat_range[1]], flat_cov[flat_range[0] : flat_range[1]]
        if not bool(flat_cov.all()):
            raise CheckpointError(
                f"the checkpoint's pieces of {key} cover {int(flat_cov.sum())} of the {flat_cov.numel()} "
                "elements asked for; it is incomplete"
            )
        return flat_out.clone() if flat_range is not None else out

    def _read_part(self, key, block, flat_range) -> torch.Tensor:
        """Rows of one part, cut from the whole groups of the stored fused tensor that hold them."""
        stored, layout, i = self.parts[key]
        if self.is_scalar(stored):
            return self.read(stored)
        off, shape = block if block is not None else ((0,) * len(self.global_shape(key)), self.global_shape(key))
        n = layout.sizes[i]
        g0, g1 = off[0] // n, -(-(off[0] + shape[0]) // n)
        rows = self.read(stored, ((g0 * layout.per_group, *off[1:]), ((g1 - g0) * layout.per_group, *shape[1:])))
        part = layout.split_rows(rows)[i][off[0] - g0 * n : off[0] - g0 * n + shape[0]]
        return part.reshape(-1)[flat_range[0] : flat_range[1]].clone() if flat_range is not None else part

    def _read_fused(self, key, layout: FusedLayout, block, flat_range) -> torch.Tensor:
        """Rows of a fused tensor, put together from the whole groups of its stored parts."""
        names = layout.part_keys(key)
        if self.is_scalar(names[0]):
            return self.read(names[0])
        gshape = self.global_shape(key, layout)
        off, shape = block if block is not None else ((0,) * len(gshape), gshape)
        per = layout.per_group
        g0, g1 = off[0] // per, -(-(off[0] + shape[0]) // per)
        parts = [
            self.read(name, ((g0 * n, *off[1:]), ((g1 - g0) * n, *shape[1:]))) for name, n in zip(names, layout.sizes)
        ]
        rows = FusedLayout(layout.module, layout.parts, layout.sizes, g1 - g0).fuse(parts)
        out = rows[off[0] - g0 * per : off[0] - g0 * per + shape[0]]
        return out.reshape(-1)[flat_range[0] : flat_range[1]].clone() if flat_range is not None else out


def _load(path: str, key: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def _piece_region(path, key, meta, p_off, p_shape, lo, hi):
    """Elements ``lo..hi`` (global coordinates) from one piece, and which of them it holds (None: all)."""
    local = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, p_off))
    with safe_open(path, framework="pt") as f:
        sl = f.get_slice(key)
        if "flat_range" not in meta:
            return sl[local] if local else f.get_tensor(key), None
        a, b = meta["flat_range"]
        row = math.prod(p_shape[1:]) if len(p_shape) > 1 else 1
        # rows of the piece's block that the wanted region touches, as a flat range of the block
        first = max(a, local[0].start * row) if local else a
        last = min(b, local[0].stop * row) if local else b
        if first >= last:
            empty = torch.zeros([y - x for x, y in zip(lo, hi)], dtype=_dtype(sl))
            return empty, torch.zeros_like(empty, dtype=torch.bool)
        data = sl[first - a : last - a]
    # a buffer of just the rows the wanted region spans (not the piece's whole block), the piece's elements put in place
    r0, r1 = (local[0].start, local[0].stop) if local else (0, 1)
    rows = torch.zeros((r1 - r0) * row, dtype=data.dtype)
    have = torch.zeros((r1 - r0) * row, dtype=torch.bool)
    rows[first - r0 * row : last - r0 * row] = data
    have[first - r0 * row : last - r0 * row] = True
    if not local:
        return rows.view(p_shape), have.view(p_shape)
    shape, rest = (r1 - r0, *p_shape[1:]), (slice(None), *local[1:])
    return rows.view(shape)[rest], have.view(shape)[rest]


def _dtype(sl) -> torch.dtype:
    return DTYPES.get(sl.get_dtype(), torch.float32)


def save_whole(reader: PieceReader, directory: str, prefix: str, shard_bytes: int = 2 << 30) -> list[str]:
    """Writes every tensor of ``reader`` whole into ``<directory>/<prefix>-rank00000.safetensors``; returns the files.

    Each entry is described as the whole tensor (``{"global_shape": shape}``; a scalar keeps
    ``{"scalar": true}``), so :class:`PieceReader` reads it back at any layout. Tensors are read
    one at a time and written in files of at most ``shard_bytes`` (one larger tensor gets a file of
    its own; the second file is ``<prefix>-rank00000-2.safetensors``, and so on), so consolidating
    never holds more than one file's worth in memory.
    """
    files: list[str] = []
    batch: dict[str, tuple[torch.Tensor, dict]] = {}
    size = 0

    def flush() -> None:
        name = f"{prefix}-rank00000" + (f"-{len(files) + 1}" if files else "") + ".safetensors"
        files.append(os.path.join(directory, name))
        save_pieces(batch, files[-1])
        batch.clear()

    for key in reader.keys():
        t = reader.read(key)
        nbytes = t.numel() * t.element_size()
        if batch and size + nbytes > shard_bytes:
            flush()
            size = 0
        meta = (
            {"global_shape": list(t.shape), "scalar": True}
            if reader.is_scalar(key)
            else {"global_shape": list(t.shape)}
        )
        batch[key] = (t, meta)
        size += nbytes
    if batch or not files:
        flush()
    return files
