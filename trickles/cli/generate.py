"""``trickles generate``: decode all prompts (and samples) from a checkpoint in one batch (:mod:`trickles.infer`);
``--beams N`` searches instead of sampling; ``--device-budget-gb`` streams the blocks that do not fit
(:mod:`trickles.infer.streaming`)."""

from __future__ import annotations

import math

from ..errors import UserError
from .common import DEVICE_HELP, add_command, check_budget, check_checkpoint, check_device, count, load_model


def add_parser(sub) -> None:
    g = add_command(sub, "generate", "sample text from a checkpoint or a Hugging Face model directory")
    g.add_argument(
        "checkpoint",
        help="a checkpoint directory, a run's out_dir (its newest checkpoint), or a Hugging Face model directory "
        "(config.json, safetensors and its tokenizer, which encodes the prompts as transformers does)",
    )
    g.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="text to continue (repeatable: all prompts are decoded in one batch; default: 'def ')",
    )
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        metavar="N",
        help="most tokens to add to each prompt; fewer when the end-of-text token or a --stop text comes "
        "(default: 200)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="divide the logits by this before sampling; lower is more predictable, 0: greedy (default: 0.8)",
    )
    g.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample among the k most likely tokens (default: 0, all)"
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="sample among the most likely tokens holding this much probability (default: 1, all)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="> 1 discourages tokens already in the text (default: 1, off)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample before this text (repeatable; default: none)",
    )
    g.add_argument(
        "--beams",
        type=int,
        default=None,
        metavar="N",
        help="beam search with N beams instead of sampling (default: sample)",
    )
    g.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="A",
        help="with --beams: a finished beam scores logprob / length**A (default: 1; > 0 favours longer text)",
    )
    g.add_argument(
        "--early-stopping",
        choices=["false", "true", "never"],
        default=None,
        help="with --beams: when a prompt's search ends, as transformers' early_stopping (default: false)",
    )
    g.add_argument(
        "--num-samples",
        type=int,
        default=1,
        metavar="N",
        help="samples per prompt, drawn together in the batch (default: 1)",
    )
    g.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the sampling's random generator (default: 0)"
    )
    g.add_argument("--device", default="auto", help=DEVICE_HELP)
    g.add_argument(
        "--label",
        default=None,
        metavar="L",
        help="hard-routed experts (model.moe_router=hard): decode with this label's experts "
        "(default: none; such a model needs one)",
    )
    g.add_argument(
        "--device-budget-gb",
        type=float,
        default=None,
        metavar="GB",
        help="keep weights and KV cache within this many GB of the device (RAM on CPU); blocks that do not fit "
        "stream from the checkpoint (docs/inference-streaming.md) (default: no budget, the whole model "
        "on the device)",
    )

    g.add_argument(
        "--int8",
        choices=["weight", "full"],
        default=None,
        help="a quantized checkpoint: weight-only int8 (default) or full (activations per token, integer matmul)",
    )


def run(args) -> int:
    import torch

    from ..infer import Sampling, beam_search, decode
    from ..infer.streaming import prompt_length
    from ..process import select_device

    count("--max-new-tokens", args.max_new_tokens, 0)
    count("--top-k", args.top_k, 0)
    count("--num-samples", args.num_samples, 1)
    count("--beams", args.beams, 1)
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
        given = [
            o
            for o, v in (
                ("--temperature", args.temperature),
                ("--top-k", args.top_k),
                ("--top-p", args.top_p),
                ("--stop", args.stop),
                ("--num-samples", args.num_samples > 1),
                ("--repetition-penalty", args.repetition_penalty != 1.0),
            )
            if v
        ]
        if given:
            raise UserError(f"--beams searches deterministically; leave out {', '.join(given)}")
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        raise UserError(f"--length-penalty must be a finite number, got {args.length_penalty:g}")
    check_device(args.device)
    check_budget(args.device_budget_gb)
    check_checkpoint(args.checkpoint, args.device_budget_gb, args.int8)
    device = select_device(args.device)
    texts = args.prompt or ["def "]
    rows = len(texts) * (args.beams or args.num_samples)
    longest = prompt_length(args.checkpoint, texts) if args.device_budget_gb is not None else 0
    model, tokenizer, meta = load_model(
        args.checkpoint, device, args.device_budget_gb, rows, longest + args.max_new_tokens, args.int8
    )
    prompts = [tokenizer.encode_prompt(t) or [tokenizer.eos_id] for t in texts]
    labels = None
    hard = model.cfg.moe_experts and model.cfg.moe_router == "hard"
    if hard or args.label is not None:
        names = list(model.cfg.label_experts) if hard else []
        if args.label is None or args.label not in names:
            what = f"--label {args.label!r} is not one of its labels" if args.label is not None else "give --label"
            raise UserError(
                f"{what}: this model routes by label ({', '.join(names)})"
                if hard
                else "--label is for models with hard-routed experts (model.moe_router=hard); this one has none"
            )
        labels = torch.full(
            (len(prompts) * args.num_samples,), names.index(args.label), dtype=torch.long, device=device
        )
    if args.beams is not None:
        early = {"false": False, "true": True, "never": "never"}[args.early_stopping or "false"]
        labels = None if labels is None else labels[: len(prompts)]
        out = beam_search(
            model,
            prompts,
            args.beams,
            args.max_new_tokens,
            length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
            early_stopping=early,
            eos_id=tokenizer.eos_id,
            tokenizer=tokenizer,
            labels=labels,
        )
    else:
        sampling = Sampling(
            max_new_tokens=args.max_new_tokens,
            temperature=0.8 if args.temperature is None else args.temperature,
            top_k=args.top_k or 0,
            top_p=1.0 if args.top_p is None else args.top_p,
            repetition_penalty=args.repetition_penalty,
            stop=tuple(args.stop),
        )
        g = torch.Generator(device=device).manual_seed(args.seed)  # one generator for the batch: draws as generate's
        rows = [p for p in prompts for _ in range(args.num_samples)]
        out = decode(model, rows, sampling, eos_id=tokenizer.eos_id, tokenizer=tokenizer, generator=g, labels=labels)
    heads = [t for t in texts for _ in range(len(out) // len(texts))]
    for i, (head, c) in enumerate(zip(heads, out)):
        if len(out) > 1:
            print(f"--- sample {i + 1} ---")
        print(head + c.text)
    return 0
