"""Entry points the CLI and the launchers call: resolve a resume target, train in this process.

Fault tolerance: under ``trickles train --nproc N --max-restarts K`` or ``torchrun --max-restarts=K``
a failed rank brings all ranks down and back up; the restarted ranks see a non-zero
:func:`~trickles.process.restart_count` and continue from the newest complete checkpoint in ``train.out_dir``
(same weights, optimizer state, data position and random states as when it was written). With
``parallel.elastic`` a world the configured degrees do not fit trains on the planner's layout for it
(:mod:`trickles.planner.elastic`), resharding the checkpoint on load. SIGTERM (torchrun's, or passed on by our
launcher) is an orderly stop: every rank finishes its step, the step's checkpoint is saved, waited for and verified,
and the process exits with status 143 -- or 6 when that save failed (:mod:`trickles.train.stopping`).
"""

from __future__ import annotations

import os

from ..config import Config
from ..errors import UserError
from ..hints import warn_slow_config
from ..planner.elastic import agreed_layout
from ..process import env_world_size, handle_sigterm, restart_count, stop_requested
from ..topology import distributed_session
from . import checkpoint
from .trainer import Trainer


def resolve_resume(resume: str | None, out_dir: str) -> str | None:
    """``None`` | ``"auto"`` (newest complete checkpoint under out_dir, or none) | a path; verified.

    A restarted job (:func:`~trickles.process.restart_count` > 0) continues from the newest complete checkpoint in
    out_dir, whatever it was started with; only when it wrote none yet does it start as before.
    """
    if restart_count() > 0:
        latest = checkpoint.find_latest(os.path.join(out_dir, "checkpoints"))
        if latest or resume in (None, "auto"):
            return latest
    if resume is None:
        latest = checkpoint.list_checkpoints(os.path.join(out_dir, "checkpoints"))
        if latest:
            raise UserError(
                f"{out_dir} already holds checkpoints (newest: step {latest[-1][0]}); continue with --resume auto, "
                f"or start afresh in another directory (--set train.out_dir=...) or after deleting {out_dir}"
            )
        return None
    if resume == "auto":
        return checkpoint.find_latest(os.path.join(out_dir, "checkpoints"))
    if not os.path.exists(resume):
        raise UserError(
            f"--resume {resume}: no such checkpoint directory; give a step_* directory, a run's out_dir, or auto"
        )
    path = checkpoint.resolve(resume)
    checkpoint.verify(path)
    return path


def run_training(
    cfg: Config, resume: str | None = None, quiet: bool = False, verified: bool = True, resolved_at: int = 0
) -> list[dict]:
    """Trains ``cfg`` in this process (one rank of a torchrun/launcher job, or alone).

    ``resume`` is a checkpoint directory (already checked by :func:`resolve_resume` when
    ``verified``), resolved at restart count ``resolved_at``: a job restarted since then
    resolves it again, to the newest complete checkpoint. Returns this rank's per-step metrics.
    """
    cfg, relayout = agreed_layout(cfg, env_world_size())  # parallel.elastic: rank 0 plans, every rank takes it
    dims = cfg.validate(env_world_size())
    if restart_count() != resolved_at:  # the launcher brought the job back up after a failure
        resume, verified = resolve_resume(resume, cfg.train.out_dir), True
    # SIGTERM: every rank finishes its step, saves and stops (trickles.train.stopping)
    with handle_sigterm(), distributed_session(dims, cfg.train.device, cfg.parallel.timeout_s) as topo:
        warn_slow_config(cfg, topo)  # valid but slow on this device (fp16 on a CPU, ...): one line each, rank 0
        if relayout and topo.is_main and not quiet:
            print(relayout, flush=True)
        trainer = Trainer(cfg, topo, quiet=quiet)
        trainer.stop_requested = stop_requested
        if resume:
            if restart_count() > 0 and topo.is_main:
                print(f"[trickles] restart {restart_count()}: continuing from {resume}", flush=True)
            trainer.load_checkpoint(resume, verify=not verified)
        history = trainer.fit()
        del trainer
    return history
