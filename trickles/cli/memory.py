"""``trickles memory``: predict (and with ``--measure``, measure) the memory per device
(:mod:`trickles.memory.report`)."""

from __future__ import annotations

import math

from ..errors import UserError
from .common import add_command, config_args, count, writable


def add_parser(sub) -> None:
    m = add_command(
        sub,
        "memory",
        "predict (and measure) the memory per device: parameters, gradients, optimizer, "
        "activations, peak (with pipeline stages, every stage's)",
    )
    config_args(m)
    m.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="number of ranks of the layout (spawned when measuring) (default: torchrun's world size, else 1)",
    )
    m.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="STEPS",
        help="also run this many training steps and measure (default: 0, predict only)",
    )
    m.add_argument(
        "--png", default=None, metavar="F", help="write a bar chart of the categories to this PNG (default: no chart)"
    )
    m.add_argument(
        "--device-gb",
        type=float,
        default=None,
        metavar="GB",
        help="say whether the peak fits on a device of this many GB (default: no verdict)",
    )


def run(args) -> int:
    from ..config import Config
    from ..launch import launch
    from ..memory.report import run_report
    from ..process import env_world_size

    count("--nproc", args.nproc, 1)
    if args.measure < 0:
        raise UserError(f"--measure must be 0 or more steps, got {args.measure}")
    if args.device_gb is not None and not (math.isfinite(args.device_gb) and args.device_gb > 0):
        raise UserError(f"--device-gb must be a positive number of GB, got {args.device_gb:g}")
    writable("--png", args.png)
    cfg = Config.load(args.config, args.overrides)
    world = args.nproc or env_world_size()
    cfg.validate(world)
    if args.measure and world > 1 and args.nproc:
        return launch(run_report, (cfg, args.measure, args.png, args.device_gb, world), world)
    run_report(cfg, args.measure, args.png, args.device_gb, world)
    return 0
