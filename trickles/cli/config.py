"""``trickles config``: print the resolved configuration as TOML, or with ``--keys`` every key
(:mod:`trickles.config`)."""

from __future__ import annotations

from .common import add_command, config_args


def add_parser(sub) -> None:
    c = add_command(sub, "config", "print the resolved configuration as TOML (or every key with --keys)")
    config_args(c)
    c.add_argument("--keys", action="store_true", help="list every key with its type, default and meaning")


def run(args) -> int:
    from ..config import Config, describe_keys

    if args.keys:
        print(describe_keys())
        return 0
    print(Config.load(args.config, args.overrides).to_toml(), end="")
    return 0
