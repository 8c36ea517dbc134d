"""Entry points the CLI and the launchers call: resolve a resume target, train in this process."""

from __future__ import annotations

import os

from ..config import Config
from ..errors import UserError
from ..topology import distributed_session, env_world_size
from . import checkpoint
from .trainer import Trainer


def resolve_resume(resume: str | None, out_dir: str) -> str | None:
    """``None`` | ``"auto"`` (newest complete checkpoint under out_dir, or none) | a path; verified."""
    if resume is None:
        latest = checkpoint.list_checkpoints(os.path.join(out_dir, "checkpoints"))
        if latest:
            raise UserError(f"{out_dir} already holds checkpoints (newest: step {latest[-1][0]}); continue with --resume auto, "
                            f"or start afresh in another directory (--set train.out_dir=...) or after deleting {out_dir}")
        return None
    if resume == "auto":
        return checkpoint.find_latest(os.path.join(out_dir, "checkpoints"))
    path = checkpoint.resolve(resume)
    checkpoint.verify(path)
    return path


def run_training(cfg: Config, resume: str | None = None, quiet: bool = False, verified: bool = True) -> list[dict]:
    """Trains ``cfg`` in this process (one rank of a torchrun/launcher job, or alone).

    ``resume`` is a checkpoint directory (already checked by :func:`resolve_resume` when
    ``verified``). Returns this rank's per-step metrics.
    """
    dims = cfg.validate(env_world_size())
    with distributed_session(dims, cfg.train.device) as topo:
        trainer = Trainer(cfg, topo, quiet=quiet)
        if resume:
            trainer.load_checkpoint(resume, verify=not verified)
        history = trainer.fit()
        del trainer
    return history
