"""The ``trickles`` command: parse, build a config, call the library.

    trickles train [--config run.toml] [--set section.key=value ...] [--nproc N] [--resume auto|PATH]
    trickles generate CHECKPOINT [--prompt TEXT ...] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                     [--repetition-penalty R] [--stop S ...] [--beams N --length-penalty A] [--label L]
                     [--device-budget-gb X]
    trickles serve CHECKPOINT [--host H] [--port P] [--max-batch N] [--device-budget-gb X]
    trickles eval CHECKPOINT_OR_HF_DIR [--config run.toml] [--set ...] [--data PATH] [--max-tokens N] [--json]
                  [--nproc N]
    trickles memory [--config run.toml] [--set ...] [--nproc N] [--measure STEPS] [--png F] [--device-gb X]
    trickles bench scaling [--config run.toml] [--set ...] [--ranks 1 2 4 ...] [--steps N] [--warmup W]
                           [--png F | --no-png] [--json F]
    trickles config [--config run.toml] [--set ...] [--keys]
    trickles plan [--config run.toml] [--set ...] --cluster NAME|FILE --devices N [--top K] [--json F]
                  [--write-config F] [--calibrate [F]]
    trickles checkpoint export CHECKPOINT OUT [--format trickles|hf]
    trickles compress quantize CHECKPOINT OUT [--bits 8] [--granularity row|tensor]
    trickles compress prune CHECKPOINT OUT [--heads F] [--ffn F] [--layers N] [--score taylor|activation]
    trickles compress report CHECKPOINT [CHECKPOINT ...]

``trickles train`` with no arguments is the demo. Under ``torchrun`` each process runs
``trickles train`` (or ``python -m trickles train``) and joins the job from the environment;
``--nproc N`` instead spawns N local ranks itself. ``trickles bench scaling`` starts its own local
ranks for each world size in ``--ranks`` and reports weak scaling (:mod:`trickles.train.scaling`).
``trickles generate`` decodes all its prompts (and samples) in one batch; ``--beams N`` searches instead of
sampling (:mod:`trickles.infer`); ``--device-budget-gb`` streams the blocks that do not fit
(:mod:`trickles.infer.streaming`). ``trickles serve`` answers OpenAI-style completions over HTTP
(:mod:`trickles.infer.server`). ``trickles checkpoint export`` consolidates a checkpoint written by any number of ranks,
in one process, into a single-device checkpoint (every tensor whole, optimizer state included) or a
Hugging Face directory. Mistakes in the input print one line and exit with status 2, before any
process group is created.

One module per subcommand, each with ``add_parser(subparsers)`` and ``run(args)``; :mod:`.common` holds what they
share. A subcommand module imports the library (and torch) inside ``run``, so ``trickles --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import NoReturn

from ..errors import EXIT_TERMINATED, ONE_LINE_ERRORS
from . import bench, checkpoint, compress, config, eval, generate, memory, plan, serve, train
from .common import Parser

# in the order ``trickles --help`` lists them
COMMANDS = {
    "train": train,
    "generate": generate,
    "serve": serve,
    "eval": eval,
    "memory": memory,
    "bench": bench,
    "config": config,
    "plan": plan,
    "checkpoint": checkpoint,
    "compress": compress,
}


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="trickles", description="Train and sample transformer models on the hardware you have.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    try:
        code = COMMANDS[args.command].run(args)
        sys.stdout.flush()  # a reader that has gone (trickles config --keys | head) shows here, not at exit
    except BrokenPipeError:  # as Python's docs advise: quiet, and no second error when the interpreter flushes stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # 128 + SIGPIPE, as a command the signal ended
    except ONE_LINE_ERRORS as e:
        code = e.exit_code
        # a SIGTERM stop whose checkpoint was saved and verified is what was asked, not an error
        print(f"{'[trickles]' if code == EXIT_TERMINATED else 'error:'} {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    if distributed:  # skip interpreter teardown after gloo (see DESIGN.md)
        from ..process import exit_process

        exit_process(code)
    return code


def entry() -> NoReturn:
    """``trickles`` and ``python -m trickles``: :func:`main`, then exit with its status. Once the command has ended,
    a SIGTERM that arrives while the interpreter tears down (seconds, after ranks or a forkserver) is ignored: it
    cannot change what happened, and a process the signal ended would read as status 143, a verified checkpoint."""
    code = main()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)
