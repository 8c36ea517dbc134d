"""Checkpoints: tensors in safetensors, everything else in JSON, written atomically.

Layout of ``<out_dir>/checkpoints/step_000100/``::

    model-rankNNNNN.safetensors
                            parameters by name (a tied weight once): with ZeRO 0-2 written by the
                            first data-parallel rank of each tensor-parallel rank, under ZeRO-3
                            by every rank (its shard)
    optimizer-rankNNNNN.safetensors
                            "<param name>/<state key>" -> the rank's part of the Adam moments
                            (and fp32 master weights of low-precision parameters), step counters
    trainer.json            step, consumed samples, resolved config, every rank's RNG states
    tokenizer/              what the tokenizer needs to rebuild itself
    manifest.json           size and sha256 of every file above; written last

Every tensor entry's safetensors metadata records its global shape and which part it holds
(``{"global_shape": [...], "flat_range": [a, b]}`` for a range of the flattened tensor,
``"offset"`` for a block); a replicated tensor is one whole piece, a sharded layout writes one
file per rank, and :class:`~trickles.train.pieces.PieceReader` reads, at any layout, just the pieces it needs.

Writing happens in ``step_000100.tmp`` and ends with ``os.replace`` to the final name, so a
directory without ``.tmp`` always holds a complete checkpoint. Loading checks the manifest
first and names any file that is missing, truncated or altered. Nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
from typing import Any

import torch

from ..errors import CheckpointError
from .pieces import (
    PieceReader,
    describe,
    fused_layout,
    global_shape,
    region_of,
    save_pieces,  # noqa: F401  (re-exported)
)

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
    entries = {
        rel: {"bytes": os.path.getsize(os.path.join(root, rel)), "sha256": _sha256(os.path.join(root, rel))}
        for rel in _files(root)
    }
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
        raise CheckpointError(
            f"checkpoint {root} has no {MANIFEST}, so it was never completed; resume from an earlier checkpoint"
        )
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{path} is not a valid manifest; the checkpoint is damaged, resume from an earlier one"
        ) from None
    for rel, info in files.items():
        p = os.path.join(root, rel)
        if not os.path.exists(p):
            raise CheckpointError(f"checkpoint file {p} is missing; resume from an earlier checkpoint")
        size = os.path.getsize(p)
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {p} has {size} bytes but the manifest says {info['bytes']} (truncated?); resume "
                "from an earlier checkpoint"
            )
        if _sha256(p) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint file {p} does not match its checksum (altered?); resume from an earlier checkpoint"
            )


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


def model_pieces(model: torch.nn.Module, writes=None) -> dict[str, tuple[torch.Tensor, dict]]:
    """This rank's parameters (its tensor- or expert-parallel blocks) and buffers with their piece descriptions.

    ``writes(tensor)``: whether this rank writes it (what several ranks hold alike, one of them writes;
    :meth:`~trickles.parallel.engine.Engine.writes`); None: everything.
    """
    out = {}
    for name, t in unique_state(model).items():
        if writes is not None and not writes(t):
            continue
        out[name] = (t, describe(t))
    return out


def load_model_state(model: torch.nn.Module, reader: PieceReader, source: str, part: bool = False) -> None:
    """Copies every parameter and persistent buffer of ``model`` (its blocks) from the checkpoint's pieces.

    ``part``: the model is one pipeline stage, holding some of the checkpoint's tensors.
    """
    state = unique_state(model)
    check_fits(reader, state, source, part)
    with torch.no_grad():
        for k, t in state.items():
            t.copy_(reader.read(k, region_of(t), layout=fused_layout(t)))


def check_fits(reader: PieceReader, params: dict[str, torch.Tensor], source: str, part: bool = False) -> None:
    """Raises unless the checkpoint holds exactly ``params`` (``part``: at least them), by name, each with its global
    shape."""
    # a fused projection's parameter is named by its parts, as the reader names it (trickles.models.fused)
    names = {k: (fused_layout(t).part_keys(k) if fused_layout(t) is not None else [k]) for k, t in params.items()}
    missing = sorted(n for ns in names.values() for n in ns if n not in reader)
    extra = [] if part else sorted(set(reader.keys()) - {n for ns in names.values() for n in ns})
    if missing or extra:
        raise CheckpointError(
            f"{source} does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "check that model.* settings match the run that wrote it"
        )
    for k, t in params.items():
        have = reader.global_shape(k, fused_layout(t))
        if have != global_shape(t):
            raise CheckpointError(f"{source}: {k} has shape {have}, the model expects {global_shape(t)}")


def model_config_of(path: str, mine):
    """The model config of the checkpoint at ``path`` (``train.init_from``), keeping from ``mine`` how the model
    computes (kernels, fused loss and projections), which may change between runs."""
    import dataclasses

    from ..models.config import HOW_KEYS, ModelConfig

    root = resolve(path)  # checked against its manifest when the trainer reads its weights
    saved = read_json(os.path.join(root, "trainer.json")).get("model")
    if not saved:
        raise CheckpointError(f"{root}/trainer.json holds no model config; give a checkpoint trickles wrote")
    how = {k: getattr(mine, k) for k in HOW_KEYS}
    return dataclasses.replace(ModelConfig(**saved), preset=None, **how)


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
        torch.cuda.set_rng_state(
            torch.from_numpy(np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy())
        )


# ---- directory handling ------------------------------------------------------------------


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:06d}")


def begin_dir(final: str) -> str:
    """Creates an empty ``<final>.tmp`` directory (removing a leftover one) and returns it."""
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def source_and_target(src: str, out: str) -> tuple[str, str]:
    """For a command that reads checkpoint ``src`` and writes a new directory ``out``: the checkpoint's directory
    (verified against its manifest) and ``out`` normalized; CheckpointError when ``out`` already exists."""
    path = resolve(src)
    verify(path)
    out = os.path.normpath(out)
    if os.path.lexists(out):
        raise CheckpointError(f"{out} already exists; choose another path or delete it")
    return path, out


def write_model_dir(out: str, tensors: dict, tokenizer_dir: str, trainer: dict[str, Any]) -> str:
    """Writes a one-process model checkpoint ``out`` atomically: ``tensors`` (a :func:`model_pieces` dict) in
    ``model-rank00000.safetensors``, a copy of ``tokenizer_dir``, ``trainer.json`` and the manifest, all in
    ``<out>.tmp`` renamed once complete (removed on any failure); returns ``out``."""
    tmp = begin_dir(out)
    try:
        save_pieces(tensors, os.path.join(tmp, "model-rank00000.safetensors"))
        if not os.path.isdir(tokenizer_dir):
            raise CheckpointError(f"{os.path.dirname(tokenizer_dir)} has no tokenizer/ directory; it is incomplete")
        shutil.copytree(tokenizer_dir, os.path.join(tmp, "tokenizer"))
        write_json(os.path.join(tmp, "trainer.json"), trainer)
        write_manifest(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def begin(directory: str, step: int) -> str:
    """Creates an empty ``step_N.tmp`` directory (removing a leftover one) and returns it."""
    return begin_dir(step_dir(directory, step))


def commit(tmp: str, keep: int, check: bool = False, before=None) -> str:
    """Writes the manifest, with ``check`` verifies ``tmp`` against it (:func:`verify`: every file's size and sha256
    read back), renames ``tmp`` into place and deletes all but the newest ``keep``. ``before(phase)``, when given, is
    called before the manifest (``"manifest"``) and before the rename (``"rename"``)."""
    if before is not None:
        before("manifest")
    write_manifest(tmp)
    if check:
        verify(tmp)
    if before is not None:
        before("rename")
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
