"""The trainer's checkpoints: what a run writes beside the engine's shards, and how a run gets it back.

* :func:`snapshot` takes what ``<out_dir>/checkpoints/step_N`` holds, for :class:`~trickles.train.saver.Saver` to
  write atomically (:mod:`trickles.train.checkpoint`) in the background: every rank its part of the model and
  optimizer (the engine's, copied to the host), rank 0 the tokenizer and ``trainer.json`` -- the step, the consumed
  samples (the data position: the next global batch is a pure function of it and the seed), the layout, the skipped
  steps, the loss scaler's state, the resolved config and model, and every rank's RNG states;
* :func:`load` resumes from one: it refuses, before anything is loaded, a checkpoint this model or optimizer
  cannot continue (an int8 one, another model, another optimizer's state), then restores the engine at any
  layout, the loss scaler and this rank's RNG states, and returns the position;
* :func:`init_source` reads ``train.init_from``'s weights into a fresh run (a trickles checkpoint's, or a Hugging
  Face directory's through :func:`trickles.load_hf`), and :func:`export_int8` turns
  quantization-aware training's final checkpoint into an int8 one.

:class:`~trickles.train.trainer.Trainer` calls them with its pieces (``save_checkpoint``, ``load_checkpoint``,
``export_int8``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ..adapters.lora import is_adapter, part_name
from ..compress.checkpoint import quantize_checkpoint
from ..config import Config
from ..data import Tokenizer
from ..errors import CheckpointError, SavesFailed
from ..memory.scaler import DynamicLossScaler
from ..models import fused as fuse
from ..models.config import HOW_KEYS, ModelConfig
from ..models.hf import load_hf
from ..models.transformer import Transformer, initial_value
from ..parallel.engine import Engine
from ..topology import Topology
from . import checkpoint as ckpt
from .load import is_hf_dir, load_for_inference, run_lora
from .saver import Snapshot, host_copy


def snapshot(
    tmp: str,
    topo: Topology,
    engine: Engine,
    tokenizer: Tokenizer,
    cfg: Config,
    model_cfg: ModelConfig,
    scaler: DynamicLossScaler | None,
    *,
    step: int,
    consumed: int,
    skipped: int,
    device,
) -> Snapshot:
    """This rank's part of the checkpoint of step ``step`` (written into ``tmp`` by
    :class:`~trickles.train.saver.Saver`): its model and optimizer pieces copied to the host and, on rank 0,
    ``trainer.json``. Every rank calls it (the RNG states are gathered)."""
    rng = _gather_objects(ckpt.rng_state(), topo)
    files, nbytes = host_copy(engine.checkpoint_files(topo.rank), device)
    snap = Snapshot(step, tmp, files, keep=cfg.train.keep_checkpoints, host_bytes=nbytes)
    if topo.is_main:
        snap.tokenizer = tokenizer
        snap.meta = {
            "step": step,
            "consumed_samples": consumed,
            "world_size": topo.world_size,
            "layout": {
                "dp": topo.dims.dp,
                "tp": topo.dims.tp,
                "pp": topo.dims.pp,
                "zero": engine.stage,
                "sequence_parallel": cfg.parallel.sequence_parallel,
                "schedule": cfg.parallel.schedule,
                "virtual_stages": cfg.parallel.virtual_stages,
            },
            "skipped_steps": skipped,
            "loss_scaler": scaler.state_dict() if scaler else None,
            "config": cfg.to_dict(),
            "model": dataclasses.asdict(model_cfg),
            "rng": rng,
        }
    return snap


def load(
    path: str,
    engine: Engine,
    scaler: DynamicLossScaler | None,
    rank: int,
    model_cfg: ModelConfig,
    optimizer: str,
    verify: bool = True,
) -> tuple[int, int, int]:
    """Restores model and optimizer (``engine``), ``scaler`` and rank ``rank``'s RNG from ``path`` (a step_N directory,
    any dp layout) written for ``model_cfg`` with ``optimizer``; returns ``(step, consumed samples, skipped steps)``."""
    if verify:
        ckpt.verify(path)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    if meta.get("quantization"):
        raise CheckpointError(
            f"{path} is an int8 checkpoint for inference; resume from the float checkpoint it came from "
            f"({meta['quantization'].get('source')})"
        )
    saved = meta.get("model", {})
    mine = dataclasses.asdict(model_cfg)
    # how the model computes (kernels, fusion) may change between runs; what it computes may not
    diff = sorted(k for k in mine if k not in ("preset", *HOW_KEYS) and saved.get(k) != mine[k])
    if diff:
        detail = ", ".join(f"model.{k}: checkpoint {saved.get(k)!r} vs now {mine[k]!r}" for k in diff[:4])
        raise CheckpointError(
            f"checkpoint {path} was written by a different model ({detail}); use the same model settings"
        )
    was = meta.get("config", {}).get("train", {}).get("optimizer", "adamw")
    if was != optimizer:
        raise CheckpointError(
            f"checkpoint {path} holds {was} state but train.optimizer = {optimizer}; "
            f"set train.optimizer = {was} to resume it"
        )
    engine.load(path)
    step = int(meta["step"])
    consumed = int(meta["consumed_samples"])
    skipped = int(meta.get("skipped_steps", 0))
    if scaler and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    rng = meta.get("rng") or []
    if rng:
        ckpt.set_rng_state(rng[rank % len(rng)])
    return step, consumed, skipped


def init_source(init_from: str, model: Transformer, seed: int = 0):
    """``train.init_from``: each parameter's full value read from the checkpoint (checked against it first), or
    from a Hugging Face directory (read whole by every rank, projections unfused, then fused as ``model`` is; a
    multi-token prediction module the directory does not hold starts from its initial value of ``seed``).

    A LoRA run's checkpoint (``train.lora_rank > 0`` there) is read whole too: into a run without adapters with each
    adapter folded into its base weight (``W + s B A``), into a run with adapters as it is (its adapters go on
    training; a different rank or target set is refused by shape or name)."""
    if is_hf_dir(init_from):
        source = load_hf(init_from, fused_proj=False)
        return _whole_state({n: p.detach() for n, p in source.named_parameters()}, model, seed, init_from)
    path = ckpt.resolve(init_from)
    ckpt.verify(path)
    if run_lora(ckpt.read_json(os.path.join(path, "trainer.json"))) is not None:
        adapters = any(is_adapter(n) for n in ckpt.unique_state(model))
        source, _, _ = load_for_inference(path, verify=False, merge_adapters=not adapters)
        whole = fuse.split_state(source.cfg, {n: p.detach() for n, p in source.named_parameters()})
        return _whole_state({part_name(n): t for n, t in whole.items()}, model, seed, init_from)
    reader = ckpt.PieceReader(path, "model")
    ckpt.check_fits(reader, ckpt.unique_state(model), path)
    return lambda name, p: reader.read(name, ((0,) * p.dim(), ckpt.global_shape(p)), layout=ckpt.fused_layout(p))


def _whole_state(state: dict, model: Transformer, seed: int, where: str):
    """``init(name, p)`` of ``model``'s parameters from ``state``, a whole model's tensors by their unfused names in
    host memory (fused as ``model`` is; a fused projection's adapters by their parts' names)."""

    def keys(name, p) -> list[str]:
        layout = ckpt.fused_layout(p)
        return layout.part_keys(name) if layout is not None else [part_name(name)]

    wanted = {k for n, p in model.named_parameters() if not n.startswith("mtp.") for k in keys(n, p)}
    missing = sorted(wanted - set(state))
    extra = sorted(k for k in state if is_adapter(k) and k not in wanted)  # adapters the new run would drop
    if missing or extra:
        raise CheckpointError(
            f"{where} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}; check that model.* "
            "and train.lora_* settings match the run that wrote it"
        )

    def value(name, p):
        layout, held = ckpt.fused_layout(p), keys(name, p)
        if name.startswith("mtp.") and not any(k in state for k in held):  # a module the source lacks
            return initial_value(model.cfg, name, ckpt.global_shape(p), seed)
        full = layout.fuse([state[k] for k in held]) if layout is not None else state[held[0]]
        if tuple(full.shape) != ckpt.global_shape(p):
            raise CheckpointError(
                f"{where}: {name} has shape {list(full.shape)}, the model expects {list(ckpt.global_shape(p))}"
            )
        return full

    return value


def export_int8(path: str | None, out_dir: str, step: int, topo: Topology, quiet: bool) -> str:
    """Quantization-aware training's final checkpoint ``path`` (rank 0's; None elsewhere) as an int8 checkpoint
    ``<out_dir>/int8_step_N``, written by rank 0 while the others wait. Without a final checkpoint on rank 0 there is
    nothing to export: SavesFailed says so (never a silent skip)."""
    out = os.path.join(out_dir, f"int8_step_{step:06d}")
    if topo.is_main and path is None:
        raise SavesFailed(
            f"no final checkpoint of step {step} to export to int8 (train.qat); {out} was not written: free space or "
            f"fix train.out_dir, then run again with --resume auto",
            step,
            "no final checkpoint",
        )
    if topo.is_main:
        if os.path.lexists(out):
            print(f"[trickles] {out} exists; not exporting the int8 checkpoint again")
        else:
            quantize_checkpoint(path, out, qat=True)
            if not quiet:
                print(f"[trickles] int8 checkpoint: {out}")
    topo.comm("world").barrier(limit_s=math.inf)  # file work on rank 0 (see Trainer.__init__)
    return out


def _gather_objects(obj: Any, topo: Topology) -> list[Any]:
    if topo.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * topo.world_size
    dist.all_gather_object(out, obj)
    return out
