"""What the subcommands share: the parser class with the command's error style, the ``--config``/``--set`` options,
checks of option values that fail as one-line :class:`~trickles.errors.UserError`s, and loading a checkpoint or a
Hugging Face model directory (``config.json`` and safetensors, no trickles manifest) for inference (``generate``,
``serve``).

Nothing here imports torch or the library's heavier modules at import time: ``trickles --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with the command's error style: one line ``error: ...`` and status 2 (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser, its one-line ``help`` also the description its own ``--help`` starts with."""
    return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".")


def checkpoint_in_out(sp, out: str = "directory to create (must not exist)") -> None:
    """The positional ``checkpoint`` (what to read) and ``out`` (where to write) of a command that rewrites one."""
    sp.add_argument(
        "checkpoint", help="a checkpoint directory, a checkpoints folder, or a run's out_dir (its newest checkpoint)"
    )
    sp.add_argument("out", help=out)


def config_args(sp) -> None:
    """``--config/-c`` and ``--set/-s``: the options of every command that builds a :class:`~trickles.config.Config`."""
    sp.add_argument("--config", "-c", metavar="F", help="TOML config file (default: the built-in demo settings)")
    sp.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.steps=100 (default: none)",
    )


def count(option: str, value: int | None, low: int) -> None:
    """An integer option (None: not given) that must be at least ``low``."""
    if value is not None and value < low:
        raise UserError(f"{option} must be at least {low}, got {value}")


def writable(option: str, path: str | None) -> None:
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        raise UserError(f"{option} {path}: the directory {folder} does not exist; create it or give another path")


# ---- inference: generate and serve ---------------------------------------------------------------------------------

DEVICE_HELP = "where to run: auto (CUDA when available, else CPU), cpu, cuda or cuda:N (default: auto)"


def check_device(device: str) -> None:
    import torch

    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UserError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            f"--device {device}: no CUDA device is available (torch.cuda.is_available() is false); use --device auto "
            "or cpu"
        )


def check_checkpoint(path: str, budget_gb: float | None = None, int8: str | None = None) -> None:
    """``path`` is a trickles checkpoint (or run) or a Hugging Face model directory whose shape and tokenizer load;
    ``--device-budget-gb`` and ``--int8`` need a trickles checkpoint."""
    if not os.path.exists(path):
        raise UserError(
            f"checkpoint {path} does not exist; give a checkpoint directory, a run's out_dir or a Hugging Face model "
            "directory"
        )
    from ..train.load import hf_model_config, is_hf_dir

    if not is_hf_dir(path):
        return  # read when loaded (resolved)
    for option, value in (("--device-budget-gb", budget_gb), ("--int8", int8)):
        if value is not None:
            raise UserError(f"{option} needs a trickles checkpoint; {path} is a Hugging Face directory: leave it out")
    hf_model_config(path, "the model")


def resolved(path: str) -> str:
    """The checkpoint directory ``path`` names (a run's out_dir: its newest); the one-line error says that ``path`` is
    no Hugging Face directory either."""
    from ..train import checkpoint as ckpt

    try:
        return ckpt.resolve(path)
    except UserError as e:
        raise UserError(f"{e} (nor a Hugging Face model directory: it has no config.json)") from None


def context_length(path: str) -> int:
    """The model's context length, from a checkpoint's ``trainer.json`` or a Hugging Face directory's config."""
    from ..train import checkpoint as ckpt
    from ..train.load import hf_model_config, is_hf_dir

    if is_hf_dir(path):
        return int(hf_model_config(path, "the model").max_seq_len)
    return int(ckpt.read_json(os.path.join(resolved(path), "trainer.json"))["model"]["max_seq_len"])


def check_budget(budget_gb: float | None) -> None:
    if budget_gb is not None and not (math.isfinite(budget_gb) and budget_gb > 0):
        raise UserError(f"--device-budget-gb must be a positive number of GB, got {budget_gb:g}")


def load_model(path: str, device, budget_gb: float | None, rows: int, max_len: int, int8: str | None = None):
    """``(model, tokenizer, meta)``: the whole model on ``device`` (a quantized checkpoint with its ``int8`` matmul), or
    with ``--device-budget-gb`` the blocks that do not fit beside a KV cache of ``rows x max_len`` streamed from the
    checkpoint (placement printed on stderr). A Hugging Face directory loads whole, with its own tokenizer."""
    from ..compress.checkpoint import load_checkpoint
    from ..train.load import is_hf_dir, load_hf_for_inference

    if is_hf_dir(path):
        return load_hf_for_inference(path, device)
    resolved(path)
    if budget_gb is None:
        return load_checkpoint(path, device, int8=int8)
    from ..infer.streaming import load_streaming

    model, tokenizer, meta = load_streaming(path, device, int(budget_gb * 1e9), rows, max_len, int8=int8)
    print(model.placement.summary(), file=sys.stderr)
    return model, tokenizer, meta
