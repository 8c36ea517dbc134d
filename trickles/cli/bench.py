"""``trickles bench scaling``: weak scaling over local ranks, one world size after another
(:mod:`trickles.train.scaling`)."""

from __future__ import annotations

import os

from ..errors import UserError
from .common import add_command, config_args, writable


def add_parser(sub) -> None:
    b = add_command(sub, "bench", "measure how training performs on this machine")
    actions = b.add_subparsers(dest="action", required=True)
    sc = add_command(
        actions,
        "scaling",
        "weak scaling: the same work per rank on 1, 2, 4, ... local ranks; "
        "throughput, scale factor, communication share and bytes sent",
    )
    config_args(sc)
    sc.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="world sizes to run (default: 1, 2, 4, ... up to the GPUs, or the CPU cores but at least 1 and 2)",
    )
    sc.add_argument(
        "--steps", type=int, default=5, metavar="N", help="timed training steps per world size (default: 5)"
    )
    sc.add_argument(
        "--warmup", type=int, default=2, metavar="W", help="untimed training steps before them (default: 2)"
    )
    sc.add_argument(
        "--png",
        default=None,
        metavar="F",
        help="draw throughput against ideal linear scaling, and the communication share, to this PNG "
        "(default: scaling.png in train.out_dir)",
    )
    sc.add_argument("--no-png", action="store_true", help="print the table only, draw no PNG")
    sc.add_argument(
        "--json",
        default=None,
        metavar="F",
        help="write the rows (with every step time and bytes per operation) to this JSON file (default: none)",
    )


def run(args) -> int:
    return {"scaling": _scaling}[args.action](args)


def _scaling(args) -> int:
    import json

    from ..config import Config
    from ..process import env_world_size
    from ..train.scaling import RanksFailed, measure_scaling, plot_scaling, scaling_json, scaling_table

    if "TORCHELASTIC_RUN_ID" in os.environ or env_world_size() > 1:
        raise UserError("trickles bench starts its own local ranks; run it once, not under torchrun")
    cfg = Config.load(args.config, args.overrides)
    png = None if args.no_png else args.png or os.path.join(cfg.train.out_dir, "scaling.png")
    if args.png:
        writable("--png", args.png)
    writable("--json", args.json)
    try:
        rows = measure_scaling(cfg, args.ranks, args.steps, args.warmup, quiet=False)
    except RanksFailed as e:  # the launcher has printed the failing rank's message
        return e.exit_code
    print(scaling_table(rows))
    if png:
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        if plot_scaling(rows, png):
            print(f"[trickles] scaling plot: {png}")
        else:
            print("[trickles] no plot: matplotlib is not installed (pip install 'trickles[plots]')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(scaling_json(rows, args.steps, args.warmup), f, indent=2)
        print(f"[trickles] scaling rows: {args.json}")
    return 0
