"""Training progress for a person watching: a progress bar on a terminal, plain lines elsewhere.

On a terminal (stderr is a TTY) a ``tqdm`` bar shows the step, and after each step that step's figures
(loss, tokens/s, MFU or GFLOP/s, validation loss, skipped steps, the loss scale). Elsewhere -- a log file, CI, a
pipe -- a bar's carriage returns would pile up into one long line, so one plain line is printed every ``every``
steps (about 20 lines a run), at a step that evaluated, and at the last step:
``[trickles] step 40/200 loss 2.431 tok/s 12,345 mfu 31.2%``.
``label`` names the loss shown (``loss``; a distillation run shows its combined loss, ``distill loss``).
:class:`CompileReport` adds one line with what ``torch.compile`` cost.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from tqdm import tqdm


def step_figures(record: dict[str, Any], label: str, skipped: int, scale: float | None) -> dict[str, str]:
    """A step's record as the short figures shown after it."""
    post = {label: f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if record["mfu"] is not None:
        post["mfu"] = f"{100 * record['mfu']:.1f}%"
    else:
        post["GFLOP/s"] = f"{record['flops_per_s'] / 1e9:.1f}"
    if record.get("val_loss") is not None:
        post["val"] = f"{record['val_loss']:.3f}"
    if skipped:
        post["skipped"] = str(skipped)
    if scale is not None:
        post["scale"] = f"{scale:g}"
    return post


class Progress:
    """Steps ``start..total`` shown as a bar on a terminal, as a plain line every ``every`` steps elsewhere;
    nothing when ``quiet``."""

    def __init__(self, start: int, total: int, quiet: bool, label: str = "loss", stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.quiet, self.label = total, quiet, label
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, (total - start) // 20)
        self.bar = None
        if self.tty and not quiet:
            tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: ranks leave through os._exit
            self.bar = tqdm(
                total=total,
                initial=start,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=self.stream,
                mininterval=0,
            )  # every step redrawn: its figures with its count

    def step(self, step: int, record: dict[str, Any], skipped: int = 0, scale: float | None = None) -> None:
        """Step ``step`` is done, with ``record``'s figures (shown with the step they belong to)."""
        if self.quiet:
            return
        post = step_figures(record, self.label, skipped, scale)
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)  # redraws, with this step's figures
        elif step % self.every == 0 or step == self.total or record.get("val_loss") is not None:
            figures = " ".join(f"{k} {v}" for k, v in post.items())
            print(f"[trickles] step {step}/{self.total} {figures}", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A message between steps (above the bar on a terminal)."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class CompileReport:
    """Prints, once, what ``torch.compile`` cost: the first step compiles every block (a step's clock ends with
    its work, :meth:`Trainer.train_step` reads its loss), so the first step's time less the second's is the
    compilation."""

    def __init__(self, on: bool):
        self.on, self.first = on, None

    def step_done(self, seconds: float, write) -> None:
        if not self.on:
            return
        if self.first is None:
            self.first = seconds
            return
        write(
            f"[trickles] torch.compile: first step {self.first:.1f} s, second {seconds:.2f} s: about "
            f"{max(0.0, self.first - seconds):.1f} s of compilation, paid once"
        )
        self.on = False


def run_line(tr) -> str:
    """The line a training run starts with: the model, the ranks and layout, the batch, the device and the data
    (``tr``: the :class:`~trickles.train.trainer.Trainer`)."""
    t = tr.cfg.train
    zero = f", ZeRO-{tr.engine.stage}" if tr.engine.stage else ""
    if tr.topo.dims.tp > 1:
        zero += (
            f", tp={tr.topo.dims.tp}"
            + (f" ({tr.topo.dims.tp_mode})" if tr.topo.dims.tp_mode != "1d" else "")
            + (" with sequence parallel" if tr.cfg.parallel.sequence_parallel else "")
        )
    if tr.topo.dims.cp > 1:
        zero += f", cp={tr.topo.dims.cp} {tr.cfg.parallel.cp_mode}"
    if tr.topo.dims.ep > 1:
        zero += f", ep={tr.topo.dims.ep}"
    if tr.pipeline is not None:
        p = tr.pipeline.shape
        zero += f", pp={p.p} {tr.cfg.parallel.schedule}" + (f" x {p.v} chunks" if p.v > 1 else "")
    params = f"{tr.n_params / 1e6:.2f}M parameters"
    if tr.model_cfg.moe_experts:
        mc = tr.model_cfg
        params += (
            f" ({tr.n_active / 1e6:.2f}M active: {mc.moe_experts} experts, top-{mc.moe_top_k}"
            f"{f' + {mc.moe_shared_experts} shared' if mc.moe_shared_experts else ''}, "
            f"in {len(mc.moe_layers)} of {mc.n_layers} blocks)"
        )
    return (
        f"[trickles] {tr.model_cfg.flavor} model, {params}, {tr.topo.world_size} rank(s) "
        f"(dp={tr.topo.dims.dp}{zero}), batch {t.global_batch}x{tr.cfg.data.seq_len} "
        f"(micro {tr.micro_batch} x {tr.accumulation} accumulation), device {tr.device}; data: {tr.corpus.describe()}"
        + (f"; distilling from {tr.cfg.distill.teacher} (alpha {tr.cfg.distill.alpha:g})" if tr.distill else "")
    )
