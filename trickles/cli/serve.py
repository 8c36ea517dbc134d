"""``trickles serve``: OpenAI's completions and chat completions over HTTP, continuously batched
(:mod:`trickles.infer.server`, :mod:`trickles.infer.engine`)."""

from __future__ import annotations

import os

from ..errors import UserError
from . import serve_lora
from .common import (
    DEVICE_HELP,
    add_command,
    check_budget,
    check_checkpoint,
    check_device,
    context_length,
    count,
    load_model,
    resolved,
)


def add_parser(sub) -> None:
    v = add_command(
        sub,
        "serve",
        "serve a checkpoint over HTTP: OpenAI's /v1/completions and /v1/chat/completions, "
        "/v1/models, /health, /metrics",
    )
    v.add_argument(
        "checkpoint",
        help="a checkpoint directory, a run's out_dir (its newest checkpoint), or a Hugging Face model directory "
        "(config.json, safetensors and its tokenizer, whose chat template chat requests use)",
    )
    v.add_argument(
        "--host", default="127.0.0.1", metavar="H", help="address to listen on (default: 127.0.0.1, this machine only)"
    )
    v.add_argument(
        "--port", type=int, default=8000, metavar="P", help="port; 0: any free port, printed at start (default: 8000)"
    )
    v.add_argument(
        "--max-batch", type=int, default=32, metavar="N", help="most sequences decoded together (default: 32)"
    )
    v.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory of the paged KV cache pool (default: room for --max-batch sequences of the model's "
        "context, on a GPU at most 80%% of the memory free after loading; continuous batching only)",
    )
    v.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="P",
        help="positions per KV cache block (default: 16; continuous batching only)",
    )
    v.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="T",
        help="most prompt tokens prefilled per iteration; longer prompts are prefilled in pieces between "
        "decode steps (default: 256; continuous batching only)",
    )
    v.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not keep the KV blocks of finished prompts for requests that share their prefix (default: "
        "cached, evicted least recently used when the pool needs the blocks; continuous batching only)",
    )
    v.add_argument(
        "--speculative",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: propose tokens and verify every running sequence's in one model call; ngram: "
        "look the text's last tokens up earlier in it (prompt lookup), draft: a smaller model, --draft "
        "(docs/speculative-decoding.md; default: off; continuous batching only)",
    )
    v.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="with --speculative: tokens proposed per sequence and step (default: 4)",
    )
    v.add_argument(
        "--ngram-max",
        type=int,
        default=None,
        metavar="N",
        help="with --speculative ngram: the longest suffix looked up (default: 4)",
    )
    v.add_argument(
        "--ngram-min",
        type=int,
        default=None,
        metavar="N",
        help="with --speculative ngram: the shortest suffix looked up (default: 1)",
    )
    v.add_argument(
        "--draft",
        default=None,
        metavar="DIR",
        help="with --speculative draft: the draft model, a checkpoint or Hugging Face directory with the served "
        "model's tokenizer (default: none)",
    )
    serve_lora.add_arguments(v)
    v.add_argument(
        "--batching",
        choices=["continuous", "static"],
        default="continuous",
        help="continuous: requests join and leave the running batch at every step (default); static: a "
        "batch runs to its end before the next starts (for comparison)",
    )
    v.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
        "TRICKLES_API_KEY environment variable; unset: no key)",
    )
    v.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        metavar="B",
        help="refuse request bodies larger than this with 413 (default: 1048576)",
    )
    v.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="spawn N local ranks, --tp x --ep: rank 0 serves HTTP and schedules, every rank runs its part of the "
        "model (default: --tp x --ep; under torchrun its ranks)",
    )
    v.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel degree (default: 1)")
    v.add_argument(
        "--ep", type=int, default=1, metavar="E", help="experts split over E ranks (mixture-of-experts; default: 1)"
    )
    v.add_argument("--device", default="auto", help=DEVICE_HELP)
    v.add_argument(
        "--device-budget-gb",
        type=float,
        default=None,
        metavar="GB",
        help="as for generate, with a KV cache for --max-batch sequences of the model's context "
        "(default: no budget, the whole model on the device)",
    )
    v.add_argument(
        "--int8",
        choices=["weight", "full"],
        default=None,
        help="as for generate: a quantized checkpoint's weight-only int8 (default) or full int8",
    )


def run(args) -> int:
    import importlib.util

    from ..process import select_device

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    count("--max-batch", args.max_batch, 1)
    count("--block-size", args.block_size, 1)
    count("--prefill-chunk", args.prefill_chunk, 1)
    count("--max-body-bytes", args.max_body_bytes, 1)
    if args.batching == "static":  # the static batcher has no paged pool and no chunked prefill
        given = [
            f
            for f, v in (
                ("--block-size", args.block_size),
                ("--prefill-chunk", args.prefill_chunk),
                ("--kv-cache-gb", args.kv_cache_gb),
                ("--no-prefix-caching", True if args.no_prefix_caching else None),
                ("--speculative", args.speculative),
            )
            if v is not None
        ]
        if given:
            raise UserError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --batching continuous only "
                "(the static batcher has no paged KV pool and no chunked prefill): drop "
                f"{'it' if len(given) == 1 else 'them'} or serve with continuous batching"
            )
    check_speculative(args)
    loras = serve_lora.check(args, served_name(args))
    args.block_size = 16 if args.block_size is None else args.block_size
    args.prefill_chunk = 256 if args.prefill_chunk is None else args.prefill_chunk
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        raise UserError(f"--kv-cache-gb must be a number of gigabytes > 0, got {args.kv_cache_gb:g}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("TRICKLES_API_KEY") or None
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key must not be empty; leave it out to serve without a key")
    check_device(args.device)
    check_budget(args.device_budget_gb)
    check_checkpoint(args.checkpoint, args.device_budget_gb, args.int8)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"trickles serve needs {' and '.join(missing)}: pip install 'trickles[serve]'")
    if (layout := check_layout(args)) is not None:
        return serve_ranks(args, api_key, loras, *layout)
    device = select_device(args.device)
    model, tokenizer, _ = load_model(
        args.checkpoint, device, args.device_budget_gb, args.max_batch, context_length(args.checkpoint), args.int8
    )
    if model.cfg.moe_experts and model.cfg.moe_router == "hard":
        raise UserError(
            "this model routes its experts by label (model.moe_router=hard); trickles serve has no label "
            "field yet: use trickles generate --label L"
        )
    draft = load_draft(args, device, model, tokenizer)
    return listen(args, model, tokenizer, api_key, device, draft, adapters=serve_lora.bank(args, model, loras))


def served_name(args) -> str:
    """The served model's name (``model`` in requests and replies): its directory's."""
    return os.path.basename(os.path.normpath(args.checkpoint))


def listen(args, model, tokenizer, api_key, device, draft=None, forward=None, layout: str = "", adapters=None) -> int:
    """Serves ``model`` as ``args`` say until interrupted: one process's server, or rank 0's (``forward``: the model
    call every rank makes, :class:`~trickles.infer.ranks.Leader`; ``layout`` ends the line printed)."""
    from ..infer.engine import EngineConfig
    from ..infer.listen import serve
    from ..infer.paged import block_bytes

    name = served_name(args)
    per_block = block_bytes(model, args.block_size)
    pool = kv_pool_bytes(model, device, args, per_block)
    if pool < per_block:
        raise UserError(
            f"a KV pool of {pool} bytes holds no block of {args.block_size} positions ({per_block} bytes "
            f"each): raise --kv-cache-gb to at least {per_block / 1e9:.9f}"
        )

    def ready(host, port):
        loras = f" with adapters {', '.join(adapters.names)}" if adapters is not None else ""
        print(
            f"[trickles] serving {args.checkpoint}{loras} on http://{host}:{port} (POST /v1/completions, "
            f"/v1/chat/completions; GET /v1/models, /health, /metrics{layout})",
            flush=True,
        )

    try:
        serve(
            model,
            tokenizer,
            args.host,
            args.port,
            name=name,
            max_batch=args.max_batch,
            on_ready=ready,
            batching=args.batching,
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            forward=forward,
            engine_config=EngineConfig(
                max_batch=args.max_batch,
                block_size=args.block_size,
                prefill_chunk=args.prefill_chunk,
                kv_cache_bytes=pool,
                prefix_caching=not args.no_prefix_caching,
                speculative=args.speculative,
                num_speculative_tokens=args.num_speculative_tokens or 4,
                ngram_min=args.ngram_min or 1,
                ngram_max=args.ngram_max or 4,
                draft_model=draft,
                adapters=adapters,
            ),
        )
    except OSError as e:
        raise UserError(
            f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose another --host or --port"
        ) from None
    except KeyboardInterrupt:  # uvicorn has shut down cleanly, then re-raised the signal: the normal way to stop
        pass
    print("[trickles] server stopped", flush=True)
    return 0


def check_layout(args):
    """None for one process; else ``(world, dims, cfg)`` of serving on several ranks (:func:`serving_config`)."""
    from ..infer.ranks import env_world_size, serving_config
    from ..train.load import is_hf_dir

    if args.nproc in (None, 1) and args.tp == args.ep == 1 and env_world_size() <= 1:
        return None  # one process (the checkpoint is read once, by the server)
    flags = {"--batching static": args.batching == "static", "--speculative draft": args.speculative == "draft"}
    flags.update({"--device-budget-gb": args.device_budget_gb, "--int8": args.int8})
    refused = [f for f, v in flags.items() if v]
    path = args.checkpoint if is_hf_dir(args.checkpoint) else resolved(args.checkpoint)
    context = context_length(args.checkpoint)
    return serving_config(path, context, args.nproc, args.tp, args.ep, args.device, refused)


def serve_ranks(args, api_key, loras, world: int, dims, cfg) -> int:
    """Serves on ``world`` ranks: spawned here, or this process one of torchrun's (``loras``: ``--lora``'s pairs)."""
    from ..errors import EXIT_INTERRUPTED
    from ..launch import launch
    from ..process import env_world_size

    if env_world_size() > 1:
        return serve_rank(args, api_key, loras, dims, cfg)
    status = launch(serve_rank, (args, api_key, loras, dims, cfg), world)
    if status == EXIT_INTERRUPTED:  # Ctrl-C: the launcher stopped every rank, the normal way to stop
        print("[trickles] server stopped", flush=True)
        return 0
    return status


def serve_rank(args, api_key, loras, dims, cfg) -> int:
    """One rank of a server on several: its part of the model; rank 0 serves HTTP and leads every model call, the
    others follow it (:mod:`trickles.infer.ranks`)."""
    import torch

    from ..infer import ranks
    from ..process import handle_sigterm
    from ..topology import distributed_session

    # SIGTERM (the launcher passes it on to every rank) stops uvicorn on rank 0, which then stops the others
    with handle_sigterm(), distributed_session(dims, args.device, cfg.parallel.timeout_s) as topo:
        full, tokenizer, _ = load_model(args.checkpoint, torch.device("cpu"), None, args.max_batch, 0)
        model, logits_fn = ranks.shard(full, topo, cfg)
        del full
        bank = serve_lora.bank(args, model, loras)  # (every rank: its parts of the adapters)
        group = ranks.control_group()
        if topo.rank != 0:
            ranks.follow(model, logits_fn, group, topo.rank, bank)
            return 0
        leader = ranks.Leader(model, logits_fn, group, bank)
        try:
            layout = f"; {topo.world_size} ranks: --tp {dims.tp} --ep {dims.ep}"
            return listen(
                args, model, tokenizer, api_key, topo.device, forward=leader.forward, layout=layout, adapters=bank
            )
        finally:
            leader.stop()


def check_speculative(args) -> None:
    """One line for speculative decoding's flags given without what they apply to."""
    count("--num-speculative-tokens", args.num_speculative_tokens, 1)
    count("--ngram-min", args.ngram_min, 1)
    count("--ngram-max", args.ngram_max, 1)
    if args.speculative is None and args.num_speculative_tokens is not None:
        raise UserError("--num-speculative-tokens applies with --speculative ngram or draft; add one or drop it")
    if args.speculative != "ngram" and (args.ngram_min is not None or args.ngram_max is not None):
        raise UserError("--ngram-min and --ngram-max apply to --speculative ngram; add it or drop them")
    if (args.speculative == "draft") != (args.draft is not None):
        raise UserError(
            "--speculative draft needs --draft DIR (a smaller model with the same tokenizer)"
            if args.draft is None
            else "--draft applies to --speculative draft; add it or drop --draft"
        )
    if (args.ngram_min or 1) > (args.ngram_max or 4):
        raise UserError(f"--ngram-min {args.ngram_min or 1} is above --ngram-max {args.ngram_max or 4}")
    if args.draft is not None:
        check_checkpoint(args.draft, None, None)


def load_draft(args, device, model, tokenizer):
    """The draft model of ``--speculative draft`` on ``device`` (None without one); its tokenizer must encode as the
    served ``model``'s ``tokenizer`` does, and its vocabulary be the model's."""
    if args.draft is None:
        return None
    draft, draft_tokenizer, _ = load_model(args.draft, device, None, args.max_batch, 0)
    sample = "def speculative(x):\n    return 'décodage' + x  # 12345"
    if draft_tokenizer.vocab_size != tokenizer.vocab_size or draft_tokenizer.encode(sample) != tokenizer.encode(sample):
        raise UserError(
            f"--draft {args.draft}: its tokenizer is not the served model's (it encodes text differently or has "
            "another vocabulary size); a draft must share the tokenizer"
        )
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise UserError(
            f"--draft {args.draft}: its vocabulary has {draft.cfg.vocab_size} rows, the served model's "
            f"{model.cfg.vocab_size}: a draft must have the served model's vocabulary size"
        )
    return draft


def kv_pool_bytes(model, device, args, per_block: int) -> int:
    """Bytes of the KV pool: ``--kv-cache-gb``, else room for ``--max-batch`` full contexts (on a GPU, at most 80% of
    the memory free after loading the model); ``per_block``: bytes of one block of every layer."""
    import torch

    if args.kv_cache_gb is not None:
        return int(args.kv_cache_gb * 1e9)
    blocks = args.max_batch * -(-model.cfg.max_seq_len // args.block_size)
    dense = blocks * per_block
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(dense, int(0.8 * free))
    return dense
