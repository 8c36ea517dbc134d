"""``trickles checkpoint export``: consolidate a checkpoint written by any number of ranks, in one process, into a
single-device checkpoint (every tensor whole, optimizer state included), a Hugging Face directory or a LoRA run's
PEFT adapter (:mod:`trickles.train.export`)."""

from __future__ import annotations

from .common import add_command, checkpoint_in_out


def add_parser(sub) -> None:
    k = add_command(sub, "checkpoint", "work with checkpoints (export)")
    actions = k.add_subparsers(dest="action", required=True)
    e = add_command(actions, "export", "consolidate a checkpoint written at any layout, in one process")
    checkpoint_in_out(e)
    e.add_argument(
        "--format",
        dest="fmt",
        choices=["trickles", "hf", "peft"],
        default="trickles",
        help="trickles: a single-device checkpoint, every tensor whole, optimizer state included (default); "
        "hf: a Hugging Face directory (config.json + model.safetensors, the tokenizer's files; a LoRA run's adapters "
        "merged); peft: a LoRA run's adapters as a PEFT adapter directory",
    )


def run(args) -> int:
    from ..train.export import export_checkpoint

    notes: list[str] = []
    out = export_checkpoint(args.checkpoint, args.out, args.fmt, notes)
    print(f"[trickles] exported {args.checkpoint} to {out} ({args.fmt})")
    for note in notes:
        print(f"[trickles] {note}")
    return 0
