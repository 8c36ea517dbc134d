"""Checkpoints: tensors in safetensors, everything else in JSON, written atomically.

Layout of ``<out_dir>/checkpoints/step_000100/``::

    model.safetensors       parameters by name (a tied weight once), written by rank 0 when replicated;
                            model-rankNNNNN.safetensors instead, one per rank, under ZeRO-3
    optimizer-rankNNNNN.safetensors
                            "<param name>/<state key>" -> the rank's part of the Adam moments
                            (and fp32 master weights of low-precision parameters), step counters
    trainer.json            step, consumed samples, resolved config, every rank's RNG states
    tokenizer/              what the tokenizer needs to rebuild itself
    manifest.json           size and sha256 of every file above; written last

Every tensor entry's safetensors metadata records its global shape and which part it holds
(``{"global_shape": [...], "flat_range": [a, b]}`` for a range of the flattened tensor,
``"offset"`` for a block); a replicated tensor is one whole piece, a sharded layout writes one
file per rank, and :class:`SliceReader` reads, at any layout, just the pieces it needs.

Writing happens in ``step_000100.tmp`` and ends with ``os.replace`` to the final name, so a
directory without ``.tmp`` always holds a complete checkpoint. Loading checks the manifest
first and names any file that is missing, truncated or altered. Nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import shutil
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(root: str) -> None:
    """Records size and sha256 of every file under ``root`` (to a temp name, then renamed)."""
    entries = {rel: {"bytes": os.path.getsize(os.path.join(root, rel)), "sha256": _sha256(os.path.join(root, rel))} for rel in _files(root)}
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": "trickles-checkpoint-1", "files": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(root, MANIFEST))


def verify(root: str) -> None:
    """Raises CheckpointError naming the first missing, truncated or altered file."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint {root} does not exist; give a checkpoint directory or a run's out_dir")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {root} has no {MANIFEST}, so it was never completed; resume from an earlier checkpoint")
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is not a valid manifest; the checkpoint is damaged, resume from an earlier one") from None
    for rel, info in files.items():
        p = os.path.join(root, rel)
        if not os.path.exists(p):
            raise CheckpointError(f"checkpoint file {p} is missing; resume from an earlier checkpoint")
        size = os.path.getsize(p)
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {p} has {size} bytes but the manifest says {info['bytes']} (truncated?); resume from an earlier checkpoint")
        if _sha256(p) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {p} does not match its checksum (altered?); resume from an earlier checkpoint")


def is_complete(root: str) -> bool:
    return os.path.exists(os.path.join(root, MANIFEST))


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of complete checkpoints under ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(directory: str) -> str | None:
    """The newest complete checkpoint that passes :func:`verify`; damaged ones are skipped."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            verify(path)
            return path
        except CheckpointError:
            continue
    return None


def resolve(path: str) -> str:
    """A checkpoint directory from a checkpoint path, a ``checkpoints`` folder or a run's out_dir."""
    if is_complete(path) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return path
    for candidate in (os.path.join(path, "checkpoints"), path):
        latest = find_latest(candidate)
        if latest:
            return latest
    raise CheckpointError(f"no complete checkpoint found at {path}; give a step_* directory or a run's out_dir")


# ---- tensors -----------------------------------------------------------------------------

def save_tensors(tensors: dict[str, Any], path: str) -> None:
    """Writes ``{key: tensor}`` (whole tensors) or ``{key: (tensor, slice metadata)}`` (parts).

    Slice metadata is ``{"global_shape": [...], "flat_range": [a, b]}`` for a range of the
    flattened tensor, or ``{"global_shape": [...], "offset": [...]}`` for a block; a whole tensor
    is the block at offset 0.
    """
    data, slices = {}, {}
    for k, v in tensors.items():
        t, meta = v if isinstance(v, tuple) else (v, {"global_shape": list(v.shape), "offset": [0] * v.dim()})
        data[k] = t.detach().contiguous().cpu()
        slices[k] = meta
    save_file(data, path, metadata={"format": "pt", "slices": json.dumps(slices)})


class SliceReader:
    """Reads whole tensors or ranges of flattened tensors from every ``<prefix>*.safetensors``.

    A checkpoint written at any data-parallel layout stores each tensor as one or more pieces,
    each with its global shape and the part it holds; the reader assembles what is asked for
    from whichever pieces overlap it, reading only those slices from disk.
    """

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
                        self.pieces.setdefault(k, []).append((path, slices.get(k) or {}))
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"cannot read {path}: {e}") from None

    def keys(self) -> list[str]:
        return sorted(self.pieces)

    def __contains__(self, key: str) -> bool:
        return key in self.pieces

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.pieces[key][0][1].get("global_shape", []))

    def read(self, key: str, flat_range: tuple[int, int] | None = None) -> torch.Tensor | None:
        """The whole tensor (``flat_range=None``) or elements ``[a, b)`` of it flattened; None if absent."""
        if key not in self.pieces:
            return None
        shape = self.global_shape(key)
        pieces = self.pieces[key]
        if pieces[0][1].get("scalar"):
            return self._get(pieces[0][0], key, None)
        numel = math.prod(shape)
        a, b = flat_range if flat_range is not None else (0, numel)
        out, filled = None, 0
        for path, meta in pieces:
            if "flat_range" in meta:
                s, e = meta["flat_range"]
            elif list(meta.get("offset", [])) == [0] * len(shape):
                s, e = 0, numel
            else:
                raise CheckpointError(f"{path}: {key} is stored as a block; this loader reads flat ranges")
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            part = self._get(path, key, (lo - s, hi - s))
            if out is None:
                out = torch.empty(b - a, dtype=part.dtype)
            out[lo - a:hi - a] = part
            filled += hi - lo
        if out is None or filled != b - a:
            raise CheckpointError(f"the checkpoint's pieces of {key} cover {filled} of the {b - a} elements asked for; it is incomplete")
        return out.view(shape) if flat_range is None else out

    @staticmethod
    def _get(path: str, key: str, rng: tuple[int, int] | None) -> torch.Tensor:
        with safe_open(path, framework="pt") as f:
            if rng is None:
                return f.get_tensor(key)
            sl = f.get_slice(key)
            shape = sl.get_shape()
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            r0, r1 = rng[0] // row, -(-rng[1] // row)  # only the rows that hold the range
            rows = sl[r0:r1].reshape(-1)
            return rows[rng[0] - r0 * row:rng[1] - r0 * row].clone()


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, shared tensors once (under the first name)."""
    seen, out = set(), {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    persistent = model.state_dict(keep_vars=True)
    return {k: v for k, v in out.items() if k in persistent}


def load_model_state(model: torch.nn.Module, reader: "SliceReader", source: str) -> None:
    """Copies every parameter and persistent buffer of ``model`` from the checkpoint's pieces."""
    state = unique_state(model)
    missing = sorted(k for k in state if k not in reader)
    extra = sorted(set(reader.keys()) - set(state))
    if missing or extra:
        raise CheckpointError(f"{source} does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}; "
                              "check that model.* settings match the run that wrote it")
    with torch.no_grad():
        for k, t in state.items():
            shape = reader.global_shape(k)
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{source}: {k} has shape {shape}, the model expects {tuple(t.shape)}")
            t.copy_(reader.read(k))


# ---- RNG ---------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["cpu"]), dtype=np.uint8).copy()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()))


# ---- directory handling ------------------------------------------------------------------

def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:06d}")


def begin(directory: str, step: int) -> str:
    """Creates an empty ``step_N.tmp`` directory (removing a leftover one) and returns it."""
    tmp = step_dir(directory, step) + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, keep: int) -> str:
    """Writes the manifest, renames ``tmp`` into place and deletes all but the newest ``keep``."""
    write_manifest(tmp)
    final = tmp[: -len(".tmp")]
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    directory = os.path.dirname(final)
    for _, old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({e}); the checkpoint is damaged") from None
