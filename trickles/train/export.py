"""Consolidating a checkpoint: into one that a single process loads as it is, or into a Hugging Face directory.

A checkpoint written by N ranks holds each tensor in pieces (see :mod:`~trickles.train.pieces`).
:func:`export_checkpoint` reads it in this one process, whatever layout wrote it, after checking
its manifest, and writes

* ``fmt="trickles"``: the checkpoint one process at dp = tp = pp = 1 without ZeRO would have
  written: ``model-rank00000.safetensors`` with every parameter and buffer whole,
  ``optimizer-rank00000.safetensors`` with every Adam moment (and fp32 master weight of a
  low-precision parameter) whole and the step counters as scalars -- read one tensor at a time and
  written in files of at most 2 GiB (``...-rank00000-2.safetensors`` and on for larger models) --,
  ``trainer.json`` for one process (world size 1, the layout and the
  ``[parallel]`` settings reset, rank 0's RNG state, and under ``exported_from`` the source and
  its layout), the tokenizer, and a fresh manifest. Step, consumed samples, loss scaler, model
  and the rest of the config are kept. Like any checkpoint it loads at any layout.
* ``fmt="peft"``: a LoRA run's adapters as a PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``; :mod:`trickles.adapters.peft`), which ``peft.PeftModel.from_pretrained`` loads onto
  the Hugging Face model the run started from. (``fmt="hf"`` of a LoRA run writes the merged weights.)
* ``fmt="hf"``: the whole model through :func:`~trickles.train.load.load_for_inference` and
  :func:`~trickles.models.hf.save_hf` (``config.json`` + ``model.safetensors``, the tokenizer's
  eos id in the config), with the tokenizer's files beside them. When the run's tokenizer is a Hugging Face
  tokenizer directory (``data.tokenizer``) that still holds the tokenizer the run trained with, its own files
  (:data:`HF_FILES`, those that exist) are copied instead, so that ``transformers.AutoTokenizer`` loads the same
  tokenizer with the same special tokens and chat template; otherwise the checkpoint's ``tokenizer/`` files are, and
  a note (appended to ``notes``) says which Hugging Face tokenizer files are missing.

Either is written in ``<out>.tmp`` and renamed to ``out`` once complete; a failure removes
``<out>.tmp``, and an existing ``out`` is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from typing import Any

import torch

from ..adapters.lora import apply_lora
from ..adapters.peft import save_peft
from ..data.tokenizers import load_hf_tokenizer
from ..errors import CheckpointError, DataError, UserError
from ..models.config import ModelConfig
from ..models.transformer import Transformer
from ..parallel.config import ParallelConfig
from . import checkpoint as ckpt
from .config import TrainConfig
from .load import load_for_inference, run_lora
from .pieces import PieceReader, save_whole

FORMATS = ("trickles", "hf", "peft")
TOKENIZER = "tokenizer"
#: what a Hugging Face export copies from the run's tokenizer directory, where they exist
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def export_checkpoint(src: str, out: str, fmt: str = "trickles", notes: list[str] | None = None) -> str:
    """Writes the checkpoint at ``src`` (a step_N directory, a checkpoints folder or a run's out_dir) to ``out`` as
    ``fmt``; one-line remarks for the user (which tokenizer files an ``hf`` export lacks) are appended to ``notes``.

    Returns ``out``. Raises :class:`CheckpointError` for a missing or damaged source (nothing is
    written then) and for an ``out`` that already exists.
    """
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose {' or '.join(FORMATS)}")
    path, out = ckpt.source_and_target(src, out)
    source, target = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([source, target]) == source:
        raise CheckpointError(f"{out} lies inside the checkpoint it exports; choose a path outside {path}")
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    tmp = ckpt.begin_dir(out)
    try:
        if fmt == "trickles":
            _write_single_process(path, tmp, meta)
            ckpt.write_manifest(tmp)
        elif fmt == "peft":
            _write_peft(path, tmp, meta)
        else:
            note = _write_hf(path, tmp, meta)
            if note and notes is not None:
                notes.append(note)
        if os.path.lexists(out):
            raise CheckpointError(f"{out} appeared while exporting; choose another path or delete it")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_single_process(path: str, tmp: str, meta: dict[str, Any]) -> None:
    """Model, optimizer state, tokenizer and trainer.json of the checkpoint at ``path``, whole, into ``tmp``."""
    models = PieceReader(path, "model")
    with torch.device("meta"):
        model = Transformer(ModelConfig(**meta["model"]))
        if (lora := run_lora(meta)) is not None:  # a LoRA run's checkpoint holds its adapters too
            apply_lora(model, lora)
    ckpt.check_fits(models, ckpt.unique_state(model), path)
    save_whole(models, tmp, "model")
    if any(n.startswith("optimizer") and n.endswith(".safetensors") for n in os.listdir(path)):
        save_whole(PieceReader(path, "optimizer"), tmp, "optimizer")
    shutil.copytree(_tokenizer_dir(path), os.path.join(tmp, TOKENIZER))
    ckpt.write_json(os.path.join(tmp, "trainer.json"), single_process_meta(meta, path))


def single_process_meta(meta: dict[str, Any], source: str) -> dict[str, Any]:
    """``trainer.json`` of the checkpoint at ``source`` as one process would have written it.

    The layout becomes dp = tp = pp = 1, ZeRO 0, no sequence parallelism, the default schedule;
    the config's ``[parallel]`` section says the same (its bucket size and prefetch kept), and the
    settings that need several ranks (``memory.offload_optimizer``, ``train.pipeline_trace``) are
    off, so that ``Config.validate(1)`` accepts it. Only rank 0's RNG state is kept.
    """
    defaults = ParallelConfig().resolve()
    out = copy.deepcopy(meta)
    config = out.setdefault("config", {})
    old = config.get("parallel", {})
    config["parallel"] = {
        **dataclasses.asdict(defaults),
        "dp": 1,
        **{k: old[k] for k in ("bucket_mb", "prefetch") if k in old},
    }
    if "memory" in config:
        config["memory"]["offload_optimizer"] = False
    if "train" in config:
        config["train"]["pipeline_trace"] = TrainConfig().pipeline_trace
    out.update(
        world_size=1,
        config=config,
        rng=(meta.get("rng") or [])[:1],
        layout={
            "dp": 1,
            "tp": 1,
            "pp": 1,
            "zero": 0,
            "sequence_parallel": False,
            "schedule": defaults.schedule,
            "virtual_stages": defaults.virtual_stages,
        },
        exported_from={
            "checkpoint": os.path.abspath(source),
            "world_size": meta.get("world_size"),
            "layout": meta.get("layout"),
        },
    )
    return out


def _write_hf(path: str, tmp: str, meta: dict[str, Any]) -> str | None:
    """The whole model of the checkpoint at ``path`` as a Hugging Face directory ``tmp``, the tokenizer's files beside
    it (the run's Hugging Face tokenizer directory's own where it has one). Returns a note when the export holds no
    Hugging Face tokenizer, or only the checkpoint's copy of one."""
    from ..models.hf import save_hf

    model, tokenizer, _ = load_for_inference(path, verify=False)  # verified by the caller
    model.hf_token_ids = {"eos_token_id": tokenizer.eos_id}
    save_hf(model, tmp)
    del model
    source = str(((meta.get("config") or {}).get("data") or {}).get("tokenizer") or "")
    if getattr(tokenizer, "kind", None) == "hf":
        directory = os.path.dirname(source) if os.path.isfile(source) else source
        try:
            same = load_hf_tokenizer(directory).identity() == tokenizer.identity()
        except DataError:
            same = False
        if same:
            for name in HF_FILES:
                if os.path.isfile(os.path.join(directory, name)):
                    shutil.copy2(os.path.join(directory, name), os.path.join(tmp, name))
            return None
    tok = _tokenizer_dir(path)
    for name in sorted(os.listdir(tok)):
        if os.path.exists(os.path.join(tmp, name)):
            raise CheckpointError(
                f"the tokenizer's {name} would overwrite the model's; the checkpoint's tokenizer/ is unexpected"
            )
        copy = shutil.copytree if os.path.isdir(os.path.join(tok, name)) else shutil.copy2
        copy(os.path.join(tok, name), os.path.join(tmp, name))
    if getattr(tokenizer, "kind", None) == "hf":
        return (
            f"the run's tokenizer directory {source} is gone or holds another tokenizer: wrote the checkpoint's "
            "tokenizer files as the run saved them (no generation_config.json)"
        )
    if not os.path.exists(os.path.join(tmp, "tokenizer.json")):
        return f"no Hugging Face tokenizer files written: the run's tokenizer ({tokenizer.name}) has none"
    return None


def _write_peft(path: str, tmp: str, meta: dict[str, Any]) -> None:
    """A LoRA run's adapters as a PEFT adapter directory ``tmp`` (:func:`~trickles.adapters.peft.save_peft`), for the
    Hugging Face model the run started from (``train.init_from``, recorded as the base)."""
    lora = run_lora(meta)
    if lora is None:
        raise UserError(f"{path} is not a LoRA run (train.lora_rank=0): it has no adapters; export it with --format hf")
    model, _, _ = load_for_inference(path, verify=False, merge_adapters=False)
    base = ((meta.get("config") or {}).get("train") or {}).get("init_from") or None
    os.rmdir(tmp)  # save_peft writes a new directory and renames it into place
    save_peft(model, tmp, lora, base=base)


def _tokenizer_dir(path: str) -> str:
    tok = os.path.join(path, TOKENIZER)
    if not os.path.isdir(tok):
        raise CheckpointError(f"checkpoint {path} has no {TOKENIZER}/ directory; it is incomplete")
    return tok
