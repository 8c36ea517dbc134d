"""``trickles serve``: OpenAI-style completions over HTTP (:mod:`trickles.infer.server`)."""

from __future__ import annotations

import os

from ..errors import UserError
from .common import DEVICE_HELP, add_command, check_budget, check_checkpoint, check_device, context_length, count, load_model


def add_parser(sub) -> None:
    v = add_command(sub, "serve", "serve a checkpoint over HTTP: OpenAI-style POST /v1/completions, GET /health")
    v.add_argument("checkpoint", help="a checkpoint directory, or a run's out_dir (its newest checkpoint)")
    v.add_argument("--host", default="127.0.0.1", metavar="H",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    v.add_argument("--port", type=int, default=8000, metavar="P", help="port; 0: any free port, printed at start (default: 8000)")
    v.add_argument("--max-batch", type=int, default=32, metavar="N", help="most sequences decoded together (default: 32)")
    v.add_argument("--device", default="auto", help=DEVICE_HELP)
    v.add_argument("--device-budget-gb", type=float, default=None, metavar="GB",
                   help="as for generate, with a KV cache for --max-batch sequences of the model's context "
                        "(default: no budget, the whole model on the device)")
    v.add_argument("--int8", choices=["weight", "full"], default=None,
                   help="as for generate: a quantized checkpoint's weight-only int8 (default) or full int8")


def run(args) -> int:
    import importlib.util

    from ..process import select_device

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    count("--max-batch", args.max_batch, 1)
    check_device(args.device)
    check_budget(args.device_budget_gb)
    check_checkpoint(args.checkpoint)
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"trickles serve needs {' and '.join(missing)}: pip install 'trickles[serve]'")
    from ..infer.server import serve

    model, tokenizer, _ = load_model(args.checkpoint, select_device(args.device), args.device_budget_gb, args.max_batch,
                                     context_length(args.checkpoint), args.int8)
    if model.cfg.moe_experts and model.cfg.moe_router == "hard":
        raise UserError("this model routes its experts by label (model.moe_router=hard); trickles serve has no label "
                        "field yet: use trickles generate --label L")
    name = os.path.basename(os.path.normpath(args.checkpoint))

    def ready(host, port):
        print(f"[trickles] serving {args.checkpoint} on http://{host}:{port} (POST /v1/completions, GET /health)", flush=True)
    try:
        serve(model, tokenizer, args.host, args.port, name=name, max_batch=args.max_batch, on_ready=ready)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose another --host or --port") from None
    except KeyboardInterrupt:  # uvicorn has shut down cleanly, then re-raised the signal: the normal way to stop
        pass
    print("[trickles] server stopped", flush=True)
    return 0
