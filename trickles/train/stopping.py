"""How the training loop saves after a step and how it ends: the checkpoint steps, the final save, and the orderly
stop on SIGTERM -- each ending with the exit status of :data:`trickles.errors.EXIT_STATUSES` that says what happened.

* A checkpoint step (``train.checkpoint_every``) saves in the background (``train.async_checkpoint``); a failed save
  is logged and training goes on, until ``train.max_failed_saves`` fail in a row (:class:`~trickles.errors.SavesFailed`,
  status 5).
* The final save (the last step's; with ``train.checkpoint_every = 0`` the only one) is waited for and verified against
  its manifest. There is no later step to try again, so its failure ends the run with SavesFailed (status 5), and
  with ``train.qat`` the int8 export it was to feed is named as not written. Status 0 therefore means the final
  checkpoint exists.
* SIGTERM (:func:`trickles.process.handle_sigterm`) on any rank: after each step the ranks agree (one all-reduce) on
  whether any was asked to stop; then every rank saves that step's checkpoint (or settles the one already in flight for
  it) as a final save and stops -- :class:`~trickles.errors.Terminated` (143) once the checkpoint is complete and
  verified, :class:`~trickles.errors.TerminatedUnsaved` (6) when it failed. A SIGTERM during the last step is not
  seen: that step's final save ends the run as usual.
"""

from __future__ import annotations

import torch

from ..errors import SavesFailed, Terminated, TerminatedUnsaved
from . import checkpoint as ckpt
from . import trainer_state


def after_step(trainer, last: bool) -> None:
    """The loop's checkpoint work after step ``trainer.step`` (``last``: the run's final step), and the stop when any
    rank was asked to stop; raises what ends the run (module docstring)."""
    t = trainer.cfg.train
    if last:
        final_save(trainer)
    elif t.checkpoint_every and trainer.step % t.checkpoint_every == 0:
        trainer.save_checkpoint(wait=not t.async_checkpoint)
    if not last and stop_agreed(trainer):
        stop(trainer)


def final_save(trainer) -> str | None:
    """Saves the last step's checkpoint, waited for and verified (and with ``train.qat`` exports it as int8); raises
    SavesFailed when it is not saved. Returns its path on rank 0."""
    t = trainer.cfg.train
    try:
        saved = trainer.save_checkpoint(wait=True, final=True)
    except SavesFailed as e:
        if not t.qat:
            raise
        raise SavesFailed(
            f"{e}; the int8 export of train.qat, made from it, was not written", e.step, e.reason
        ) from None
    if t.qat:
        trainer_state.export_int8(saved, t.out_dir, trainer.step, trainer.topo, trainer.quiet)
    return saved


def stop_agreed(trainer) -> bool:
    """Whether any rank was asked to stop (one all-reduce a step, only where a handler is installed)."""
    if trainer.stop_requested is None:
        return False
    flag = torch.tensor([1.0 if trainer.stop_requested() else 0.0], device=trainer.device)
    return trainer.topo.comm("world").all_reduce(flag, op="max").item() > 0


def stop(trainer) -> None:
    """SIGTERM: saves this step's checkpoint as a final save (or settles the one in flight for it) and raises
    Terminated once it is verified, TerminatedUnsaved when it failed."""
    step = trainer.step
    try:
        if trainer.saver.pending_step == step:
            trainer.saver.settle(final=True)
        else:
            trainer.save_checkpoint(wait=True, final=True)
    except SavesFailed as e:
        newest = ckpt.list_checkpoints(trainer.ckpt_dir)
        resume = f"step {newest[-1][0]}" if newest else "step 0 (no complete checkpoint)"
        raise TerminatedUnsaved(
            f"SIGTERM: stopped after step {step}, but its checkpoint was not saved ({e.reason}); --resume auto "
            f"continues from {resume}"
        ) from None
    raise Terminated(
        f"SIGTERM: stopped after step {step}, its checkpoint saved and verified; continue with --resume auto"
    )
