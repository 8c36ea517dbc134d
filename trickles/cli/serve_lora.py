"""``trickles serve --lora NAME=DIR``: LoRA adapters a request chooses by its ``model`` field, several in one batch
(:mod:`trickles.adapters.multi`). Each DIR is a PEFT adapter directory or a trickles LoRA run
(:mod:`trickles.adapters.loaded`)."""

from __future__ import annotations

import os

from ..errors import UserError
from .common import count


def add_arguments(v) -> None:
    v.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=DIR",
        help="serve a LoRA adapter under the model name NAME (repeatable): a PEFT adapter directory "
        "(adapter_config.json, adapter_model.safetensors) or a trickles LoRA run; one batch mixes adapters and "
        "the base model (docs/inference.md; continuous batching; default: no adapters)",
    )
    v.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="with --lora: most adapters held on the device at once; a request for another waits until a slot "
        "frees (default: every --lora adapter)",
    )


def check(args, served_name: str) -> list[tuple[str, str]]:
    """``[(name, dir)]`` of ``--lora``, checked before the model loads: one line for a malformed pair, a repeated or
    reserved name, a directory that is no adapter, or ``--max-loras`` without ``--lora``."""
    from ..adapters.loaded import check_adapter_dir

    count("--max-loras", args.max_loras, 1)
    if not args.lora:
        if args.max_loras is not None:
            raise UserError("--max-loras applies with --lora NAME=DIR; add an adapter or drop it")
        return []
    pairs = []
    for item in args.lora:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise UserError(f"--lora {item!r}: give NAME=DIR, e.g. --lora sql=/adapters/sql-lora")
        if name == served_name or name in (n for n, _ in pairs):
            owner = "the served model's" if name == served_name else "another adapter's"
            raise UserError(f"--lora {item!r}: the name {name!r} is already {owner}; choose another")
        if not os.path.isdir(path):
            raise UserError(f"--lora {item!r}: {path} is no directory")
        check_adapter_dir(path)
        pairs.append((name, path))
    if args.batching == "static":
        raise UserError("--lora applies to --batching continuous only (the static batcher has no adapter slots)")
    refused = [f for f, v in (("--int8", args.int8), ("--device-budget-gb", args.device_budget_gb)) if v]
    if refused:
        raise UserError(
            f"--lora cannot be combined with {refused[0]} (adapters update the float linears of a model held "
            "whole on the device); drop one of them"
        )
    return pairs


def bank(args, model, pairs: list[tuple[str, str]]):
    """The adapter bank over ``model`` (its linears swapped in place) for ``pairs``, or None without any."""
    if not pairs:
        return None
    from ..adapters.loaded import load_adapter
    from ..adapters.multi import AdapterBank

    adapters = [load_adapter(path, model.cfg, name) for name, path in pairs]
    return AdapterBank(model, adapters, args.max_loras or len(adapters))
