"""What a run leaves besides its checkpoints once its loop has ended: the pipeline trace (``train.pipeline_trace``),
the loss curve and expert-load plot (``train.plot``) and a generated sample (``train.sample_tokens``), each named on
rank 0's output."""

from __future__ import annotations

import os

from .metrics import plot_expert_load, plot_loss


def finish(trainer, log) -> None:
    """Closes rank 0's metrics ``log`` (None elsewhere) and writes what the run's settings ask for; every rank calls
    it (the trace and the sample need all of them)."""
    t = trainer.cfg.train
    quiet = trainer.quiet
    if trainer.pipeline is not None and t.pipeline_trace:
        draw_pipeline_trace(trainer, t.pipeline_trace)
    if log is not None:
        log.close()
        if t.plot and plot_loss(log.path, os.path.join(t.out_dir, "loss.png")) and not quiet:
            print(f"[trickles] loss curve: {os.path.join(t.out_dir, 'loss.png')}")
        if (
            t.plot
            and trainer.moe_stats is not None
            and plot_expert_load(log.path, os.path.join(t.out_dir, "expert_load.png"))
            and not quiet
        ):
            print(f"[trickles] expert load: {os.path.join(t.out_dir, 'expert_load.png')}")
    if t.sample_tokens and trainer.topo.dims.tp_mode != "1d":
        if not quiet:
            print(
                f"[trickles] no sample: decoding with a KV cache needs parallel.tp_mode=1d (this run: "
                f"{trainer.topo.dims.tp_mode}); `trickles generate` reads the checkpoint at any layout"
            )
    elif t.sample_tokens:
        text = trainer.sample(t.sample_prompt, t.sample_tokens)  # every rank: sharded parameters need all of them
        if trainer.topo.is_main:
            with open(os.path.join(t.out_dir, "sample.txt"), "w") as f:
                f.write(text)
        if not quiet:
            print(f"[trickles] sample after {trainer.step} steps:\n{'-' * 60}\n{text}\n{'-' * 60}")


def draw_pipeline_trace(trainer, path: str) -> None:
    """Draws when each stage ran each forward and backward of the last step (pipeline rank 0 of the first
    replica)."""
    from ..parallel.pipeline.plot import plot_pipeline  # matplotlib, only when a trace is asked for

    runner = trainer.pipeline
    timeline = runner.gather_trace()
    if timeline is not None and trainer.topo.is_main:
        measured, predicted = plot_pipeline(timeline, runner.shape, trainer.cfg.parallel.schedule, path)
        if not trainer.quiet:
            print(
                f"[trickles] pipeline trace: {path} (bubble {100 * measured:.1f}% measured, "
                f"{100 * predicted:.1f}% predicted for these stage times with free messages)"
            )
