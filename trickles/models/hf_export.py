"""Hugging Face export: :func:`save_hf` writes a trickles model as a Hugging Face directory.

The names and layouts it writes are :mod:`trickles.models.hf_names`', the ``config.json``
:mod:`trickles.models.hf_config`'.

:func:`save_hf` writes what both transformers 4.x and 5.x read: ``rope_theta`` at the top level
(4.x) and ``rope_parameters`` (5.x); ``torch_dtype`` (4.x) and ``dtype`` (5.x). Files are written
in a temporary directory beside the target and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from . import fused as fusion
from .families import weight_map
from .hf_config import config_to_hf
from .hf_names import CONFIG, INDEX, WEIGHTS, _as_dtype, to_hf
from .transformer import Transformer


def save_hf(model: Transformer, path, dtype=None) -> Path:
    """Writes ``model`` as a Hugging Face directory (``config.json`` + ``model.safetensors``).

    ``dtype`` defaults to the parameters' dtype. A new ``path`` is created by renaming a finished
    temporary directory; in an existing directory each file is replaced by rename, other files
    (a tokenizer, say) are kept and stale sharded weights are removed. Returns ``path``.
    """
    cfg = model.cfg
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory; choose another path")
    dtype = _as_dtype(dtype) or model.embed.weight.dtype
    config = config_to_hf(cfg, dtype, getattr(model, "hf_token_ids", None))
    state = fusion.split_state(cfg, model.state_dict())
    buffers = {n for n, _ in model.named_buffers()}
    tensors = {}
    for e in weight_map(cfg):
        absent = [n for n in e.ours if n not in state]
        if absent:
            raise CheckpointError(f"cannot export: the model has no {absent[:3]}; save the full, unparallelized model")
        kind = torch.float32 if e.ours[0] in buffers else dtype  # a routing bias stays fp32, as transformers keeps it
        tensors[e.hf] = to_hf(e, [state[n].detach() for n in e.ours]).to(device="cpu", dtype=kind).contiguous()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in (WEIGHTS, CONFIG):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if not target.exists():
            os.replace(tmp, target)
            return target
        for name in (WEIGHTS, CONFIG):
            os.replace(tmp / name, target / name)
        _remove_stale_shards(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_shards(root: Path) -> None:
    """Deletes a sharded checkpoint left from an earlier save, so only one set of weights remains."""
    index = root / INDEX
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        shards = set()
    for name in shards:
        if isinstance(name, str) and Path(name).name == name and name.endswith(".safetensors") and name != WEIGHTS:
            (root / name).unlink(missing_ok=True)
    index.unlink()
