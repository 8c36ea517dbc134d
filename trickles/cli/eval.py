"""``trickles eval``: the loss and perplexity of a checkpoint or a Hugging Face model directory over a whole data
source (every window, nothing held out), per source of a mixture, on any layout (:mod:`trickles.train.evaluate`)."""

from __future__ import annotations

import os

from ..errors import UserError
from .common import add_command, config_args, count


def add_parser(sub) -> None:
    e = add_command(sub, "eval", "the loss and perplexity of a model over a whole data source")
    e.add_argument(
        "model",
        metavar="CHECKPOINT_OR_HF_DIR",
        help="a checkpoint directory, a run's out_dir (its newest checkpoint) or a Hugging Face model directory; a "
        "LoRA run is evaluated with its adapters",
    )
    config_args(e)
    e.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="the source to evaluate on (same as --set data.source=PATH; a mixture: [[data.sources]] in --config or "
        "--set data.sources=A:W,B:W) (default: a checkpoint's own run's data; a Hugging Face directory needs one)",
    )
    e.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="read only the first N positions of each source (default: all of it)",
    )
    e.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line: loss, tokens, perplexity, windows, seq_len (a mixture: sources, weighted_loss)",
    )
    e.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="spawn N local ranks (not under torchrun); the layout from --set parallel.* (default: one process, or "
        "torchrun's ranks)",
    )


def run(args) -> int:
    from ..launch import launch
    from ..process import env_world_size
    from ..train.evaluate import eval_config, run_eval

    count("--nproc", args.nproc, 1)
    count("--max-tokens", args.max_tokens, 1)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or env_world_size() > 1
    if args.nproc is not None and under_torchrun:
        raise UserError(
            "--nproc starts local ranks itself; under torchrun leave it out (torchrun's --nproc-per-node decides)"
        )
    world = args.nproc or env_world_size()
    cfg = eval_config(args.model, args.config, args.overrides, args.data, world)
    if args.nproc is not None and args.nproc > 1:
        return launch(run_eval, (cfg, args.max_tokens, args.json), world)
    run_eval(cfg, args.max_tokens, args.json)
    return 0
