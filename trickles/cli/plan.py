"""``trickles plan``: every valid layout of the model over N devices that fits, ranked by predicted step time
(:mod:`trickles.planner`); ``--calibrate`` measures this machine first."""

from __future__ import annotations

from ..errors import UserError
from .common import add_command, config_args, count, writable


def add_parser(sub) -> None:
    pl = add_command(
        sub,
        "plan",
        "choose the layout: every valid split of the model over N devices that fits, ranked by "
        "predicted step time (trickles.planner)",
    )
    config_args(pl)
    pl.add_argument(
        "--cluster",
        default=None,
        metavar="NAME|FILE",
        help="a preset (dgx-a100, dgx-h100, local) or a cluster TOML file (default: the config's [cluster])",
    )
    pl.add_argument("--devices", type=int, required=True, metavar="N", help="devices (ranks) to plan for (required)")
    pl.add_argument("--top", type=int, default=5, metavar="K", help="layouts to list (default: 5)")
    pl.add_argument(
        "--json",
        default=None,
        metavar="F",
        help="write every layout timed (the memory report's peak where it ran, else the bound's) and the winners, "
        "as JSON (default: none)",
    )
    pl.add_argument(
        "--write-config",
        default=None,
        metavar="F",
        help="write the winner as a config that trickles train -c F runs (default: none)",
    )
    pl.add_argument(
        "--calibrate",
        nargs="?",
        const="cluster-calibrated.toml",
        default=None,
        metavar="F",
        help="measure this machine first (GEMMs at the model's shapes, local collectives), write the cluster to F "
        "(F's default: cluster-calibrated.toml; --cluster is the base) and plan with it "
        "(default: no calibration)",
    )


def run(args) -> int:
    import dataclasses
    import json

    from ..config import Config
    from ..memory.report import predict
    from ..planner.cluster_files import load_cluster
    from ..planner.report import explain, no_fit_message, plan_json, plan_table, summary, winner_toml
    from ..planner.search import Search, pinned_keys, plan_model

    count("--devices", args.devices, 1)
    count("--top", args.top, 1)
    for option, path in (("--json", args.json), ("--write-config", args.write_config), ("--calibrate", args.calibrate)):
        writable(option, path)
    if args.calibrate is None and args.cluster is None and not (args.config is not None and _has_cluster(args.config)):
        raise UserError(
            "give --cluster NAME|FILE (a preset: dgx-a100, dgx-h100, local; or a cluster TOML), a [cluster] "
            "table in the config, or --calibrate"
        )
    cfg = Config.load(args.config, args.overrides)
    if not _gives_expert_load(args.config, args.overrides):  # plan for the most the router can send an expert rank
        cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, expert_load="bound"))
    pins = pinned_keys(args.config, args.overrides)
    model_cfg = plan_model(cfg)
    if args.calibrate is not None:
        from ..planner.calibrate import calibrate

        device = "cuda" if cfg.train.device != "cpu" and _cuda() else "cpu"
        cluster = calibrate(cfg, model_cfg, device=device, base=args.cluster or "local", path=args.calibrate)
        print(f"[trickles] calibrated this machine: {args.calibrate}")
    else:
        cluster = load_cluster(args.cluster or args.config)
    search = Search(cfg, model_cfg, cluster, args.devices, pins).run()
    top = search.top(args.top)
    if not top:
        raise UserError(no_fit_message(search, cfg, model_cfg))
    lines = explain(search, top[0])
    print(summary(search))
    print(plan_table(search, top))
    win = top[0]
    if win.dims.ep > 1 and model_cfg.moe_layers:  # the winner at both expert loads (the plan assumes one)
        rep = predict(win.cfg, win.dims, model_cfg, search.device_type)
        print("\n".join(n for n in rep.notes if n.startswith("expert parallelism:")))
    if lines:
        print("why not ...")
        print("\n".join(f"  {line}" for line in lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan_json(search, top), f, indent=2)
        print(f"[trickles] plan: {args.json}")
    if args.write_config:
        with open(args.write_config, "w") as f:
            f.write(winner_toml(cfg, top[0]))
        print(
            f"[trickles] the winner's config: {args.write_config} "
            f"(trickles train -c {args.write_config} --nproc {args.devices})"
        )
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _gives_expert_load(path: str | None, overrides) -> bool:
    """Whether the config file or a ``--set`` names ``memory.expert_load`` (else the planner assumes the bound)."""
    from ..config import tomllib

    if any(o.replace(" ", "").startswith("memory.expert_load=") for o in overrides or ()):
        return True
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            return "expert_load" in tomllib.load(f).get("memory", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False


def _has_cluster(path: str) -> bool:
    from ..config import tomllib

    try:
        with open(path, "rb") as f:
            return isinstance(tomllib.load(f).get("cluster"), dict)
    except (OSError, tomllib.TOMLDecodeError):
        return False
