"""``trickles train``: train a model (no arguments: the demo), in this process, on ``--nproc`` local ranks, or as one
rank of a ``torchrun`` job (:mod:`trickles.train.run`)."""

from __future__ import annotations

import os
import signal
import threading

from ..errors import TerminatedUnsaved, UserError
from .common import add_command, config_args, count, writable


def add_parser(sub) -> None:
    t = add_command(sub, "train", "train a model (no arguments: the demo)")
    config_args(t)
    t.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="spawn N local ranks (not under torchrun) (default: one process, or torchrun's ranks)",
    )
    t.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="continue from a checkpoint; auto: the newest complete one in out_dir (default: start at step 0)",
    )
    t.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc: restart all ranks up to K times after a failure a restart can cure (an error, a rank "
        "killed, a hang: status 1 or 4; never bad input, failed saves or SIGTERM: see docs/checkpoints.md) "
        "(default: 0)",
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    t.add_argument(
        "--pipeline-trace",
        default=None,
        metavar="PNG",
        help="with parallel.pp > 1: draw the last step's pipeline timeline (same as --set train.pipeline_trace=PNG; "
        "default: the config's)",
    )
    t.add_argument(
        "--teacher",
        default=None,
        metavar="CKPT_OR_HF_DIR",
        help="distil from this teacher (same as --set distill.teacher=...; see the [distill] keys; "
        "default: the config's)",
    )
    t.add_argument(
        "--init-from",
        default=None,
        metavar="CKPT_OR_HF_DIR",
        help="start from the weights and model shape of this checkpoint or Hugging Face model directory (whose "
        "tokenizer data.tokenizer then defaults to), step 0 (same as --set train.init_from=...; default: the config's)",
    )


def _sigterm_before_training(signum, frame):
    raise TerminatedUnsaved("SIGTERM before training started; nothing was saved")


def run(args) -> int:
    """Trains as ``args`` say; a SIGTERM before the launcher or the trainer takes it over ends the command with the
    status of a stop without a checkpoint (not the 143 of a process the signal ended, which reads as a verified
    checkpoint)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_before_training) if main else None
    try:
        return _run(args)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    from ..config import Config
    from ..data.corpus import check_boundaries
    from ..data.sources import check_source
    from ..data.tokenizers import load_hf_tokenizer
    from ..launch import launch
    from ..planner.elastic import fits, layout_for_world
    from ..process import env_world_size, restart_count
    from ..train.run import resolve_resume, run_training

    count("--nproc", args.nproc, 1)
    count("--max-restarts", args.max_restarts, 0)
    writable("--pipeline-trace", args.pipeline_trace)
    overrides = args.overrides + ([f"train.pipeline_trace={args.pipeline_trace}"] if args.pipeline_trace else [])
    overrides += ([f"distill.teacher={args.teacher}"] if args.teacher else []) + (
        [f"train.init_from={args.init_from}"] if args.init_from else []
    )
    cfg = Config.load(args.config, overrides)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or env_world_size() > 1
    if args.nproc is not None and under_torchrun:
        raise UserError(
            "--nproc starts local ranks itself; under torchrun leave it out (torchrun's --nproc-per-node decides)"
        )
    world = args.nproc or env_world_size()
    if not (under_torchrun and cfg.parallel.elastic and not fits(cfg, world)):  # else rank 0 plans: run_training
        cfg, relayout = layout_for_world(cfg, world)  # parallel.elastic: planned once here, the ranks get the layout
        cfg.validate(world)
        if relayout and not args.quiet and int(os.environ.get("RANK", "0")) == 0:
            print(relayout, flush=True)
    check_source(cfg.data)
    check_boundaries(cfg.data)
    if cfg.data.tokenizer not in ("byte", "bpe"):  # a tokenizer directory that cannot load fails here, not in ranks
        load_hf_tokenizer(cfg.data.tokenizer, key="data.tokenizer")
    resume = resolve_resume(args.resume, cfg.train.out_dir)
    if args.resume == "auto" and resume is None and not args.quiet:
        print(f"[trickles] no complete checkpoint in {cfg.train.out_dir}; starting from step 0")
    if args.nproc is not None and args.nproc > 1 or args.max_restarts:
        return launch(run_training, (cfg, resume, args.quiet), world, max_restarts=args.max_restarts)
    run_training(
        cfg, resume, quiet=args.quiet, resolved_at=restart_count()
    )  # under torchrun: resolved for this attempt
    return 0
