"""``trickles serve``: OpenAI's completions and chat completions over HTTP, continuously batched
(:mod:`trickles.infer.server`, :mod:`trickles.infer.engine`)."""

from __future__ import annotations

import os

from ..errors import UserError
from .common import (
    DEVICE_HELP,
    add_command,
    check_budget,
    check_checkpoint,
    check_device,
    context_length,
    count,
    load_model,
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
            )
            if v is not None
        ]
        if given:
            raise UserError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --batching continuous only "
                "(the static batcher has no paged KV pool and no chunked prefill): drop "
                f"{'it' if len(given) == 1 else 'them'} or serve with continuous batching"
            )
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
    from ..infer.engine import EngineConfig
    from ..infer.listen import serve
    from ..infer.paged import block_bytes

    device = select_device(args.device)
    model, tokenizer, _ = load_model(
        args.checkpoint, device, args.device_budget_gb, args.max_batch, context_length(args.checkpoint), args.int8
    )
    if model.cfg.moe_experts and model.cfg.moe_router == "hard":
        raise UserError(
            "this model routes its experts by label (model.moe_router=hard); trickles serve has no label "
            "field yet: use trickles generate --label L"
        )
    name = os.path.basename(os.path.normpath(args.checkpoint))
    per_block = block_bytes(model, args.block_size)
    pool = kv_pool_bytes(model, device, args, per_block)
    if pool < per_block:
        raise UserError(
            f"a KV pool of {pool} bytes holds no block of {args.block_size} positions ({per_block} bytes "
            f"each): raise --kv-cache-gb to at least {per_block / 1e9:.9f}"
        )

    def ready(host, port):
        print(
            f"[trickles] serving {args.checkpoint} on http://{host}:{port} (POST /v1/completions, "
            f"/v1/chat/completions; GET /v1/models, /health, /metrics)",
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
            engine_config=EngineConfig(
                max_batch=args.max_batch,
                block_size=args.block_size,
                prefill_chunk=args.prefill_chunk,
                kv_cache_bytes=pool,
                prefix_caching=not args.no_prefix_caching,
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
