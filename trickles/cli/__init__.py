"""The ``trickles`` command: parse, build a config, call the library.

    trickles train [--config run.toml] [--set section.key=value ...] [--nproc N] [--resume auto|PATH]
    trickles generate CHECKPOINT [--prompt TEXT ...] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                     [--repetition-penalty R] [--stop S ...] [--beams N --length-penalty A] [--label L] [--device-budget-gb X]
    trickles serve CHECKPOINT [--host H] [--port P] [--max-batch N] [--device-budget-gb X]
    trickles memory [--config run.toml] [--set ...] [--nproc N] [--measure STEPS] [--png F] [--device-gb X]
    trickles bench scaling [--config run.toml] [--set ...] [--ranks 1 2 4 ...] [--steps N] [--warmup W] [--png F | --no-png] [--json F]
    trickles config [--config run.toml] [--set ...] [--keys]
    trickles plan [--config run.toml] [--set ...] --cluster NAME|FILE --devices N [--top K] [--json F] [--write-config F]
                  [--calibrate [F]]
    trickles checkpoint export CHECKPOINT OUT [--format trickles|hf]
    trickles compress quantize CHECKPOINT OUT [--bits 8] [--granularity row|tensor]
    trickles compress prune CHECKPOINT OUT [--heads F] [--ffn F] [--layers N] [--score taylor|activation]
    trickles compress report CHECKPOINT [CHECKPOINT ...]

``trickles train`` with no arguments is the demo. Under ``torchrun`` each process runs
``trickles train`` (or ``python -m trickles train``) and joins the job from the environment;
``--nproc N`` instead spawns N local ranks itself. ``trickles bench scaling`` starts its own local
ranks for each world size in ``--ranks`` and reports weak scaling (:mod:`trickles.train.scaling`).
``trickles generate`` decodes all its prompts (and samples) in one batch; ``--beams N`` searches instead of
sampling (:mod:`trickles.infer`); ``--device-budget-gb`` streams the blocks that do not fit (:mod:`trickles.infer.streaming`).
``trickles serve`` answers OpenAI-style completions over HTTP
(:mod:`trickles.infer.server`). ``trickles checkpoint export`` consolidates a checkpoint written by any number of ranks, in one
process, into a single-device checkpoint (every tensor whole, optimizer state included) or a
Hugging Face directory. Mistakes in the input print one line and exit with status 2, before any
process group is created.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from .errors import ONE_LINE_ERRORS, UserError


class _Parser(argparse.ArgumentParser):
    """argparse with the command's error style: one line ``error: ...`` and status 2 (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trickles", description="Train and sample transformer models on the hardware you have.")
    sub = p.add_subparsers(dest="command", required=True)

    def config_args(sp):
        sp.add_argument("--config", "-c", help="TOML config file (default: the built-in demo settings)")
        sp.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set train.steps=100")

    t = sub.add_parser("train", help="train a model (no arguments: the demo)")
    config_args(t)
    t.add_argument("--nproc", type=int, default=None, help="spawn N local ranks (not under torchrun)")
    t.add_argument("--resume", default=None, metavar="auto|PATH", help="continue from a checkpoint; auto: the newest complete one in out_dir")
    t.add_argument("--max-restarts", type=int, default=0, help="with --nproc: restart all ranks up to K times after a failure")
    t.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    t.add_argument("--pipeline-trace", default=None, metavar="PNG",
                   help="with parallel.pp > 1: draw the last step's pipeline timeline (same as --set train.pipeline_trace=PNG)")
    t.add_argument("--teacher", default=None, metavar="CKPT_OR_HF_DIR",
                   help="distil from this teacher (same as --set distill.teacher=...; see the [distill] keys)")
    t.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights and model shape, step 0 (same as --set train.init_from=...)")

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("checkpoint", help="a checkpoint directory, or a run's out_dir (its newest checkpoint)")
    g.add_argument("--prompt", action="append", default=None,
                   help="text to continue (repeatable: all prompts are decoded in one batch; default: 'def ')")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=None, help="0: greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: all, the default)")
    g.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens holding this much probability (default 1: all)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens already in the text (1: off)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end a sample before this text (repeatable)")
    g.add_argument("--beams", type=int, default=None, metavar="N", help="beam search with N beams instead of sampling")
    g.add_argument("--length-penalty", type=float, default=None, metavar="A",
                   help="with --beams: a finished beam scores logprob / length**A (default 1; > 0 favours longer text)")
    g.add_argument("--early-stopping", choices=["false", "true", "never"], default=None,
                   help="with --beams: when a prompt's search ends, as transformers' early_stopping (default false)")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--label", default=None, help="hard-routed experts (model.moe_router=hard): decode with this label's experts")
    g.add_argument("--device-budget-gb", type=float, default=None, metavar="GB",
                   help="keep weights and KV cache within this many GB of the device (RAM on CPU); blocks that do not fit "
                        "stream from the checkpoint (docs/inference-streaming.md)")

    g.add_argument("--int8", choices=["weight", "full"], default=None,
                   help="a quantized checkpoint: weight-only int8 (default) or full (activations per token, integer matmul)")

    v = sub.add_parser("serve", help="serve a checkpoint over HTTP: OpenAI-style POST /v1/completions, GET /health")
    v.add_argument("checkpoint", help="a checkpoint directory, or a run's out_dir (its newest checkpoint)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed at start)")
    v.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together (default 32)")
    v.add_argument("--device", default="auto", help="auto, cpu or cuda")
    v.add_argument("--device-budget-gb", type=float, default=None, metavar="GB",
                   help="as for generate, with a KV cache for --max-batch sequences of the model's context")
    v.add_argument("--int8", choices=["weight", "full"], default=None, help="as for generate")

    m = sub.add_parser("memory", help="predict (and measure) the memory per device: parameters, gradients, optimizer, activations, "
                                      "peak (with pipeline stages, every stage's)")
    config_args(m)
    m.add_argument("--nproc", type=int, default=None, help="number of ranks of the layout (spawned when measuring)")
    m.add_argument("--measure", type=int, default=0, metavar="STEPS", help="also run this many training steps and measure")
    m.add_argument("--png", default=None, help="write a bar chart of the categories to this PNG")
    m.add_argument("--device-gb", type=float, default=None, help="say whether the peak fits on a device of this many GB")

    b = sub.add_parser("bench", help="measure how training performs on this machine")
    actions = b.add_subparsers(dest="action", required=True)
    sc = actions.add_parser("scaling", help="weak scaling: the same work per rank on 1, 2, 4, ... local ranks; "
                                            "throughput, scale factor, communication share and bytes sent")
    config_args(sc)
    sc.add_argument("--ranks", type=int, nargs="+", default=None, metavar="N",
                    help="world sizes to run (default: 1, 2, 4, ... up to the GPUs, or the CPU cores but at least 1 and 2)")
    sc.add_argument("--steps", type=int, default=5, help="timed training steps per world size (default: 5)")
    sc.add_argument("--warmup", type=int, default=2, help="untimed training steps before them (default: 2)")
    sc.add_argument("--png", default=None, help="draw throughput against ideal linear scaling, and the communication share, "
                                                "to this PNG (default: scaling.png in train.out_dir)")
    sc.add_argument("--no-png", action="store_true", help="print the table only, draw no PNG")
    sc.add_argument("--json", default=None, help="write the rows (with every step time and bytes per operation) to this JSON file")

    c = sub.add_parser("config", help="print the resolved configuration as TOML (or every key with --keys)")
    config_args(c)
    c.add_argument("--keys", action="store_true", help="list every key with its type, default and meaning")

    pl = sub.add_parser("plan", help="choose the layout: every valid split of the model over N devices that fits, ranked by "
                                     "predicted step time (trickles.planner)")
    config_args(pl)
    pl.add_argument("--cluster", default=None, metavar="NAME|FILE",
                    help="a preset (dgx-a100, dgx-h100, local) or a cluster TOML file (default: the config's [cluster])")
    pl.add_argument("--devices", type=int, required=True, metavar="N", help="devices (ranks) to plan for")
    pl.add_argument("--top", type=int, default=5, metavar="K", help="layouts to list (default 5)")
    pl.add_argument("--json", default=None, metavar="F", help="write every layout timed (the memory report's peak where it ran, else the bound's) and the winners, as JSON")
    pl.add_argument("--write-config", default=None, metavar="F", help="write the winner as a config that trickles train -c F runs")
    pl.add_argument("--calibrate", nargs="?", const="cluster-calibrated.toml", default=None, metavar="F",
                    help="measure this machine first (GEMMs at the model's shapes, local collectives), write the cluster to F "
                         "(default cluster-calibrated.toml; --cluster is the base) and plan with it")

    k = sub.add_parser("checkpoint", help="work with checkpoints (export)")
    actions = k.add_subparsers(dest="action", required=True)
    e = actions.add_parser("export", help="consolidate a checkpoint written at any layout, in one process")
    e.add_argument("checkpoint", help="a checkpoint directory, a checkpoints folder, or a run's out_dir (its newest checkpoint)")
    e.add_argument("out", help="directory to create (must not exist)")
    e.add_argument("--format", dest="fmt", choices=["trickles", "hf"], default="trickles",
                   help="trickles: a single-device checkpoint, every tensor whole, optimizer state included (default); "
                        "hf: a Hugging Face directory (config.json + model.safetensors)")
    _compress_parser(sub)
    return p


def _compress_parser(sub) -> None:
    """``trickles compress quantize|prune|report`` (trickles.compress)."""
    group = sub.add_parser("compress", help="make a model smaller: quantize it, prune it, compare checkpoints")
    actions = group.add_subparsers(dest="action", required=True)
    qz = actions.add_parser("quantize", help="symmetric int8 weights of every projection, in a new checkpoint")
    qz.add_argument("checkpoint", help="a checkpoint directory, a checkpoints folder, or a run's out_dir (its newest checkpoint)")
    qz.add_argument("out", help="directory to create (must not exist)")
    qz.add_argument("--bits", type=int, default=8, help="bits per weight (8)")
    qz.add_argument("--granularity", choices=["row", "tensor"], default="row", help="one scale per output row (default) or per matrix")
    pr = actions.add_parser("prune", help="remove attention heads, MLP channels and whole blocks, least important first")
    pr.add_argument("checkpoint", help="a checkpoint directory or a run's out_dir (its newest checkpoint)")
    pr.add_argument("out", help="directory of the pruned checkpoint (must not exist)")
    pr.add_argument("--heads", type=float, default=0.0, help="fraction of key/value head groups to remove in every block")
    pr.add_argument("--ffn", type=float, default=0.0, help="fraction of MLP channels to remove in every block")
    pr.add_argument("--layers", type=int, default=0, help="number of whole blocks to remove")
    pr.add_argument("--score", choices=["taylor", "activation"], default="taylor",
                    help="importance: taylor (sum |w x grad|) or activation (size of each unit's residual update)")
    pr.add_argument("--batches", type=int, default=8, help="calibration batches of the run's training data (default: 8)")
    pr.add_argument("--multiple-of", type=int, default=1, help="keep a multiple of this many groups and channels (a tensor-parallel degree)")
    rp = actions.add_parser("report", help="parameters, size on disk, validation loss and perplexity, decode speed, side by side")
    rp.add_argument("checkpoints", nargs="+", help="checkpoints to compare (the first one's run's held-out data is used)")
    rp.add_argument("--tokens", type=int, default=64, help="tokens to decode when timing (default: 64)")


def _compress(args) -> int:
    if args.action == "quantize":
        from .compress.checkpoint import quantize_checkpoint

        out = quantize_checkpoint(args.checkpoint, args.out, args.bits, args.granularity)
        print(f"[trickles] quantized {args.checkpoint} to {out} (int{args.bits}, one scale per {args.granularity})")
        return 0
    if args.action == "prune":
        from .compress.prune import prune_checkpoint

        out, old, new = prune_checkpoint(args.checkpoint, args.out, args.heads, args.ffn, args.layers, args.score,
                                         args.batches, args.multiple_of)
        print(f"[trickles] pruned {args.checkpoint} to {out}: {old.n_layers} -> {new.n_layers} blocks, {old.n_heads} -> "
              f"{new.n_heads} heads ({old.kv_heads} -> {new.kv_heads} key/value), MLP {old.ffn_dim} -> {new.ffn_dim}")
        return 0
    from .compress.report import compress_report, report_table

    print(report_table(compress_report(args.checkpoints, args.tokens)))
    return 0


def _train(args) -> int:
    from .config import Config
    from .data.sources import check_source
    from .launch import launch
    from .topology import env_world_size, restart_count
    from .train.run import resolve_resume, run_training

    _count("--nproc", args.nproc, 1)
    _count("--max-restarts", args.max_restarts, 0)
    _writable("--pipeline-trace", args.pipeline_trace)
    overrides = args.overrides + ([f"train.pipeline_trace={args.pipeline_trace}"] if args.pipeline_trace else [])
    overrides += ([f"distill.teacher={args.teacher}"] if args.teacher else []) + \
        ([f"train.init_from={args.init_from}"] if args.init_from else [])
    cfg = Config.load(args.config, overrides)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or env_world_size() > 1
    if args.nproc is not None and under_torchrun:
        raise UserError("--nproc starts local ranks itself; under torchrun leave it out (torchrun's --nproc-per-node decides)")
    world = args.nproc or env_world_size()
    cfg.validate(world)
    check_source(cfg.data)
    resume = resolve_resume(args.resume, cfg.train.out_dir)
    if args.resume == "auto" and resume is None and not args.quiet:
        print(f"[trickles] no complete checkpoint in {cfg.train.out_dir}; starting from step 0")
    if args.nproc is not None and args.nproc > 1 or args.max_restarts:
        return launch(run_training, (cfg, resume, args.quiet), world, max_restarts=args.max_restarts)
    run_training(cfg, resume, quiet=args.quiet, resolved_at=restart_count())  # under torchrun: resolved for this attempt
    return 0


def _check_device(device: str) -> None:
    import torch

    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UserError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available (torch.cuda.is_available() is false); use --device auto or cpu")


def _check_checkpoint(path: str) -> None:
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} does not exist; give a checkpoint directory or a run's out_dir")


def _context(path: str) -> int:
    """The model's context length, from a checkpoint's ``trainer.json``."""
    from .train import checkpoint as ckpt

    return int(ckpt.read_json(os.path.join(ckpt.resolve(path), "trainer.json"))["model"]["max_seq_len"])


def _check_budget(budget_gb: float | None) -> None:
    if budget_gb is not None and not (math.isfinite(budget_gb) and budget_gb > 0):
        raise UserError(f"--device-budget-gb must be a positive number of GB, got {budget_gb:g}")


def _load_model(path: str, device, budget_gb: float | None, rows: int, max_len: int, int8: str | None = None):
    """``(model, tokenizer, meta)``: the whole model on ``device`` (a quantized checkpoint with its ``int8`` matmul), or
    with ``--device-budget-gb`` the blocks that do not fit beside a KV cache of ``rows x max_len`` streamed from the
    checkpoint (placement printed on stderr)."""
    from .compress.checkpoint import load_checkpoint

    if budget_gb is None:
        return load_checkpoint(path, device, int8=int8)
    from .infer.streaming import load_streaming

    model, tokenizer, meta = load_streaming(path, device, int(budget_gb * 1e9), rows, max_len, int8=int8)
    print(model.placement.summary(), file=sys.stderr)
    return model, tokenizer, meta


def _generate(args) -> int:
    import torch

    from .infer import Sampling, beam_search, decode
    from .infer.streaming import prompt_length
    from .topology import select_device

    _count("--max-new-tokens", args.max_new_tokens, 0)
    _count("--top-k", args.top_k, 0)
    _count("--num-samples", args.num_samples, 1)
    _count("--beams", args.beams, 1)
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a number >= 0 (0: greedy), got {args.temperature:g}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (1: off), got {args.top_p:g}")
    if not (math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0):
        raise UserError(f"--repetition-penalty must be a number > 0 (1: off), got {args.repetition_penalty:g}")
    if any(not s for s in args.stop):
        raise UserError("--stop needs a non-empty text")
    if args.beams is None and (args.length_penalty is not None or args.early_stopping is not None):
        raise UserError("--length-penalty and --early-stopping apply to beam search; add --beams N")
    if args.beams is not None:
        given = [o for o, v in (("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p),
                                ("--stop", args.stop), ("--num-samples", args.num_samples > 1),
                                ("--repetition-penalty", args.repetition_penalty != 1.0)) if v]
        if given:
            raise UserError(f"--beams searches deterministically; leave out {', '.join(given)}")
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        raise UserError(f"--length-penalty must be a finite number, got {args.length_penalty:g}")
    _check_device(args.device)
    _check_budget(args.device_budget_gb)
    _check_checkpoint(args.checkpoint)
    device = select_device(args.device)
    texts = args.prompt or ["def "]
    rows = len(texts) * (args.beams or args.num_samples)
    longest = prompt_length(args.checkpoint, texts) if args.device_budget_gb is not None else 0
    model, tokenizer, meta = _load_model(args.checkpoint, device, args.device_budget_gb, rows, longest + args.max_new_tokens,
                                         args.int8)
    prompts = [tokenizer.encode(t) or [tokenizer.eos_id] for t in texts]
    labels = None
    hard = model.cfg.moe_experts and model.cfg.moe_router == "hard"
    if hard or args.label is not None:
        names = list(model.cfg.label_experts) if hard else []
        if args.label is None or args.label not in names:
            what = f"--label {args.label!r} is not one of its labels" if args.label is not None else "give --label"
            raise UserError(f"{what}: this model routes by label ({', '.join(names)})" if hard else
                            "--label is for models with hard-routed experts (model.moe_router=hard); this one has none")
        labels = torch.full((len(prompts) * args.num_samples,), names.index(args.label), dtype=torch.long, device=device)
    if args.beams is not None:
        early = {"false": False, "true": True, "never": "never"}[args.early_stopping or "false"]
        labels = None if labels is None else labels[:len(prompts)]
        out = beam_search(model, prompts, args.beams, args.max_new_tokens, length_penalty=1.0 if args.length_penalty is None
                          else args.length_penalty, early_stopping=early, eos_id=tokenizer.eos_id, tokenizer=tokenizer,
                          labels=labels)
    else:
        sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=0.8 if args.temperature is None else args.temperature,
                            top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p,
                            repetition_penalty=args.repetition_penalty, stop=tuple(args.stop))
        g = torch.Generator(device=device).manual_seed(args.seed)  # one generator for the batch: draws as generate's
        rows = [p for p in prompts for _ in range(args.num_samples)]
        out = decode(model, rows, sampling, eos_id=tokenizer.eos_id, tokenizer=tokenizer, generator=g, labels=labels)
    heads = [t for t in texts for _ in range(len(out) // len(texts))]
    for i, (head, c) in enumerate(zip(heads, out)):
        if len(out) > 1:
            print(f"--- sample {i + 1} ---")
        print(head + c.text)
    return 0


def _serve(args) -> int:
    import importlib.util

    from .topology import select_device

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    _count("--max-batch", args.max_batch, 1)
    _check_device(args.device)
    _check_budget(args.device_budget_gb)
    _check_checkpoint(args.checkpoint)
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"trickles serve needs {' and '.join(missing)}: pip install 'trickles[serve]'")
    from .infer.server import serve

    model, tokenizer, _ = _load_model(args.checkpoint, select_device(args.device), args.device_budget_gb, args.max_batch,
                                      _context(args.checkpoint), args.int8)
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


def _memory(args) -> int:
    from .config import Config
    from .launch import launch
    from .memory.report import run_report
    from .topology import env_world_size

    _count("--nproc", args.nproc, 1)
    if args.measure < 0:
        raise UserError(f"--measure must be 0 or more steps, got {args.measure}")
    if args.device_gb is not None and not (math.isfinite(args.device_gb) and args.device_gb > 0):
        raise UserError(f"--device-gb must be a positive number of GB, got {args.device_gb:g}")
    _writable("--png", args.png)
    cfg = Config.load(args.config, args.overrides)
    world = args.nproc or env_world_size()
    cfg.validate(world)
    if args.measure and world > 1 and args.nproc:
        return launch(run_report, (cfg, args.measure, args.png, args.device_gb, world), world)
    run_report(cfg, args.measure, args.png, args.device_gb, world)
    return 0


def _count(option: str, value: int | None, low: int) -> None:
    """An integer option (None: not given) that must be at least ``low``."""
    if value is not None and value < low:
        raise UserError(f"{option} must be at least {low}, got {value}")


def _writable(option: str, path: str | None) -> None:
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        raise UserError(f"{option} {path}: the directory {folder} does not exist; create it or give another path")


def _bench(args) -> int:
    return {"scaling": _bench_scaling}[args.action](args)


def _bench_scaling(args) -> int:
    import json

    from .config import Config
    from .topology import env_world_size
    from .train.scaling import RanksFailed, measure_scaling, plot_scaling, scaling_json, scaling_table

    if "TORCHELASTIC_RUN_ID" in os.environ or env_world_size() > 1:
        raise UserError("trickles bench starts its own local ranks; run it once, not under torchrun")
    cfg = Config.load(args.config, args.overrides)
    png = None if args.no_png else args.png or os.path.join(cfg.train.out_dir, "scaling.png")
    if args.png:
        _writable("--png", args.png)
    _writable("--json", args.json)
    try:
        rows = measure_scaling(cfg, args.ranks, args.steps, args.warmup, quiet=False)
    except RanksFailed as e:  # the launcher has printed the failing rank's message
        return e.exit_code
    print(scaling_table(rows))
    if png:
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        if plot_scaling(rows, png):
            print(f"[trickles] scaling plot: {png}")
        else:
            print("[trickles] no plot: matplotlib is not installed (pip install 'trickles[plots]')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(scaling_json(rows, args.steps, args.warmup), f, indent=2)
        print(f"[trickles] scaling rows: {args.json}")
    return 0


def _config(args) -> int:
    from .config import Config, describe_keys

    if args.keys:
        print(describe_keys())
        return 0
    print(Config.load(args.config, args.overrides).to_toml(), end="")
    return 0


def _plan(args) -> int:
    import json

    from .config import Config
    from .planner.cluster import load_cluster
    from .planner.report import explain, no_fit_message, plan_json, plan_table, summary, winner_toml
    from .planner.search import Search, pinned_keys, plan_model

    _count("--devices", args.devices, 1)
    _count("--top", args.top, 1)
    for option, path in (("--json", args.json), ("--write-config", args.write_config), ("--calibrate", args.calibrate)):
        _writable(option, path)
    if args.calibrate is None and args.cluster is None and not (args.config is not None and _has_cluster(args.config)):
        raise UserError("give --cluster NAME|FILE (a preset: dgx-a100, dgx-h100, local; or a cluster TOML), a [cluster] "
                        "table in the config, or --calibrate")
    cfg = Config.load(args.config, args.overrides)
    pins = pinned_keys(args.config, args.overrides)
    model_cfg = plan_model(cfg)
    if args.calibrate is not None:
        from .planner.calibrate import calibrate

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
        print(f"[trickles] the winner's config: {args.write_config} (trickles train -c {args.write_config} --nproc {args.devices})")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_cluster(path: str) -> bool:
    from .config import tomllib

    try:
        with open(path, "rb") as f:
            return isinstance(tomllib.load(f).get("cluster"), dict)
    except (OSError, tomllib.TOMLDecodeError):
        return False


def _checkpoint(args) -> int:
    from .train.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, args.fmt)
    print(f"[trickles] exported {args.checkpoint} to {out} ({args.fmt})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    try:
        commands = {"train": _train, "generate": _generate, "serve": _serve, "memory": _memory, "bench": _bench, "config": _config,
                    "checkpoint": _checkpoint, "compress": _compress, "plan": _plan}
        code = commands[args.command](args)
    except ONE_LINE_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    if distributed:  # skip interpreter teardown after gloo (see DESIGN.md)
        from .topology import exit_process

        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
