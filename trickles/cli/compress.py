"""``trickles compress quantize|prune|report``: make a model smaller and compare checkpoints
(:mod:`trickles.compress`)."""

from __future__ import annotations

from .common import add_command, checkpoint_in_out


def add_parser(sub) -> None:
    group = add_command(sub, "compress", "make a model smaller: quantize it, prune it, compare checkpoints")
    actions = group.add_subparsers(dest="action", required=True)
    qz = add_command(actions, "quantize", "symmetric int8 weights of every projection, in a new checkpoint")
    checkpoint_in_out(qz)
    qz.add_argument("--bits", type=int, default=8, help="bits per weight (default: 8)")
    qz.add_argument(
        "--granularity",
        choices=["row", "tensor"],
        default="row",
        help="one scale per output row (default) or per matrix",
    )
    pr = add_command(actions, "prune", "remove attention heads, MLP channels and whole blocks, least important first")
    checkpoint_in_out(pr, "directory of the pruned checkpoint (must not exist)")
    pr.add_argument(
        "--heads",
        type=float,
        default=0.0,
        help="fraction of key/value head groups to remove in every block (default: 0)",
    )
    pr.add_argument(
        "--ffn", type=float, default=0.0, help="fraction of MLP channels to remove in every block (default: 0)"
    )
    pr.add_argument("--layers", type=int, default=0, help="number of whole blocks to remove (default: 0)")
    pr.add_argument(
        "--score",
        choices=["taylor", "activation"],
        default="taylor",
        help="importance: taylor (sum |w x grad|) or activation (size of each unit's residual update) "
        "(default: taylor)",
    )
    pr.add_argument(
        "--batches", type=int, default=8, help="calibration batches of the run's training data (default: 8)"
    )
    pr.add_argument(
        "--multiple-of",
        type=int,
        default=1,
        help="keep a multiple of this many groups and channels (a tensor-parallel degree) (default: 1)",
    )
    rp = add_command(
        actions, "report", "parameters, size on disk, validation loss and perplexity, decode speed, side by side"
    )
    rp.add_argument(
        "checkpoints", nargs="+", help="checkpoints to compare (the first one's run's held-out data is used)"
    )
    rp.add_argument("--tokens", type=int, default=64, help="tokens to decode when timing (default: 64)")


def run(args) -> int:
    if args.action == "quantize":
        from ..compress.checkpoint import quantize_checkpoint

        out = quantize_checkpoint(args.checkpoint, args.out, args.bits, args.granularity)
        print(f"[trickles] quantized {args.checkpoint} to {out} (int{args.bits}, one scale per {args.granularity})")
        return 0
    if args.action == "prune":
        from ..compress.prune import prune_checkpoint

        out, old, new = prune_checkpoint(
            args.checkpoint, args.out, args.heads, args.ffn, args.layers, args.score, args.batches, args.multiple_of
        )
        print(
            f"[trickles] pruned {args.checkpoint} to {out}: {old.n_layers} -> {new.n_layers} blocks, {old.n_heads} -> "
            f"{new.n_heads} heads ({old.kv_heads} -> {new.kv_heads} key/value), MLP {old.ffn_dim} -> {new.ffn_dim}"
        )
        return 0
    from ..compress.report import compress_report, report_table

    print(report_table(compress_report(args.checkpoints, args.tokens)))
    return 0
