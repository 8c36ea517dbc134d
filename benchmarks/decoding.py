"""Decoding: trickles' batched greedy decoding and beam search vs ``transformers``' ``generate``, same weights.

What is compared
    * ``greedy``: ``trickles.infer.decode`` (temperature 0) of ``--batch`` prompts of different lengths in one
      left-padded batch, against ``LlamaForCausalLM.generate(do_sample=False)`` of the same left-padded batch
      with its attention mask (both with a KV cache, ``--new`` new tokens, no end-of-sequence token, so every
      row runs to the end);
    * ``beams``: ``trickles.infer.beam_search`` with ``--beams`` beams against ``generate(num_beams=...)``
      (length penalty 1, ``early_stopping=False``), the cache reordered in place on our side;
    * ``one by one``: our greedy decoding of each prompt alone, one after the other (what batching saves).

How
    Ours is exported with ``save_hf`` and transformers loads that directory (sdpa attention), so both hold
    identical fp32 weights. Agreement first, row by row: ours' greedy and beam tokens must equal transformers',
    or differ only where the choice was a tie within rounding, judged by transformers' own model (the
    reference): at the first token where the rows part, the reference's log-probabilities of its token and of
    ours differ by at most ``--tie-tol`` (1e-3 nats), or, for beams, ours' whole sequence scores at least as
    well under the reference as its own, less ``--tie-tol``. Two correct implementations part only at such
    ties (on a GPU their fp32 logits differ by reduction order; on a CPU they usually agree exactly); a wrong
    model parts where the reference clearly prefers its own token. Any other row stops the run. Then
    ``--rounds`` rounds, each timing every contestant once, in an order rotated each round, the device
    synchronized before each clock starts and stops. Reported: median time per call, new tokens per second,
    and ours/HF (median of the per-round ratios).

Target
    ours/HF <= 1.0x for greedy and beams.

Examples::

    python benchmarks/decoding.py                          # CPU: demo shape, vocab 4096, 8 prompts, 64 new tokens
    python benchmarks/decoding.py --preset llama-125m --device cuda --batch 32 --new 128 --json out/decoding.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, interleaved, paired, table, write_json  # noqa: E402

from trickles.infer import Sampling, beam_search, decode  # noqa: E402
from trickles.models import ModelConfig, apply_preset, build_model, save_hf  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="prompts per batch (lengths spread over 8..64 tokens)")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--tie-tol",
        type=float,
        default=1e-3,
        help="log-probability gap (nats, under transformers' model) below which a row that parts from "
        "transformers' is a tie, not a disagreement",
    )
    p.add_argument("--verbose", action="store_true", help="print every time")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    args = p.parse_args(argv)
    import transformers

    device = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")  # fp32 is fp32 on CUDA too: ties are judged at fp32 rounding
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), args.preset), vocab_size=args.vocab, max_seq_len=64 + args.new + 1
    )
    ours = build_model(cfg, seed=0, device=device).eval()
    with torch.no_grad():  # away from the initialization: peaked distributions, varied tokens
        for q in ours.parameters():
            q.add_(torch.randn_like(q) * 0.02)
    with tempfile.TemporaryDirectory() as d:
        save_hf(ours, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").to(device).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(8, 64, args.batch).long().tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(q)) + q for q in prompts], device=device)
    mask = (
        torch.arange(width, device=device)[None] >= torch.tensor([width - n for n in lengths], device=device)[:, None]
    ).long()
    greedy = Sampling(max_new_tokens=args.new, temperature=0)
    hf_kw = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=args.new,
        min_new_tokens=args.new,
        pad_token_id=0,
        eos_token_id=None,
    )

    runs = {
        "greedy ours": lambda: decode(ours, prompts, greedy),
        "greedy HF": lambda: hf.generate(ids, **hf_kw),
        "beams ours": lambda: beam_search(ours, prompts, args.beams, args.new),
        "beams HF": lambda: hf.generate(ids, num_beams=args.beams, length_penalty=1.0, early_stopping=False, **hf_kw),
        "one by one ours": lambda: [decode(ours, [q], greedy) for q in prompts],
    }
    with torch.no_grad():
        a, b = runs["greedy ours"](), runs["greedy HF"]()
        c, e = runs["beams ours"](), runs["beams HF"]()
        agreement = {
            "greedy": [
                classify(hf, q, x.tokens, y, False, args.tie_tol, device)
                for q, x, y in zip(prompts, a, b[:, width:].tolist())
            ],
            "beams": [
                classify(hf, q, x.tokens, y, True, args.tie_tol, device)
                for q, x, y in zip(prompts, c, e[:, width:].tolist())
            ],
        }
        print(
            "agreement with transformers, rows: "
            + "; ".join(
                f"{k} {v.count('equal')}/{len(v)} equal token for token, {v.count('tie')} parted at a tie "
                f"(within {args.tie_tol:g} nats), {v.count('differ')} differ"
                for k, v in agreement.items()
            )
        )
        if any("differ" in v for v in agreement.values()):
            print(
                "a row parts from transformers' where its model clearly prefers its own token: the models do not "
                "compute the same thing",
                file=sys.stderr,
            )
            return 1
        times = interleaved(list(runs), runs.get, args.rounds, device)
    print(
        f"{device_name(device)}; {args.preset} shape, vocab {args.vocab}, {args.batch} prompts of "
        f"{lengths[0]}..{width} tokens, {args.new} new tokens each, {args.beams} beams, {args.rounds} rounds"
    )
    rows = []
    for name, ts in times.items():
        peer = name.replace("ours", "HF")
        ratio = "-"
        if peer != name and peer in times:
            ratio = f"{paired(ts, times[peer]):.2f}x"
        elif name.startswith("one by one"):
            ratio = f"{paired(ts, times['greedy ours']):.2f}x of batched"
        med = statistics.median(ts)
        rows.append([name, f"{med * 1000:.0f} ms", f"{args.batch * args.new / med:.0f}", ratio])
    print(table(["contestant", "median", "new tok/s", "ours/HF"], rows))
    if args.verbose:
        print({k: [round(t, 3) for t in v] for k, v in times.items()})
    if args.json:
        write_json(args.json, document(args, device, lengths, agreement, times))
    return 0


def reference_logprobs(hf, prompt: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:
    """``[len(tokens), V]``: transformers' fp32 log-probabilities of the next token at each of ``tokens``' positions
    after ``prompt`` (one forward, no padding)."""
    ids = torch.tensor([prompt + tokens], device=device)
    logits = hf(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1)


def sequence_score(logprobs: torch.Tensor, tokens: list[int]) -> float:
    """The sum of ``tokens``' log-probabilities in ``logprobs [len(tokens), V]``."""
    return float(logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None]).sum())


def classify(
    hf, prompt: list[int], ours: list[int], theirs: list[int], beams: bool, tol: float, device: torch.device
) -> str:
    """``equal``, ``tie`` or ``differ`` (module docstring): where the rows part, how much transformers' model prefers
    its token to ours; for beams also how the two whole sequences score under it."""
    if ours == theirs:
        return "equal"
    i = next(j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y)
    lp = reference_logprobs(hf, prompt, theirs, device)
    if float(lp[i, theirs[i]] - lp[i, ours[i]]) <= tol:
        return "tie"
    if beams and sequence_score(reference_logprobs(hf, prompt, ours, device), ours) >= sequence_score(lp, theirs) - tol:
        return "tie"
    return "differ"


def document(args, device: torch.device, lengths: list[int], agreement: dict, times: dict) -> dict:
    """The JSON: every time, the medians, new tokens/s, ours/HF (median of the per-round ratios) and the agreement."""
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        k: paired(v, times[k.replace("ours", "HF")])
        for k, v in times.items()
        if k.endswith("ours") and k.replace("ours", "HF") in times
    }
    return {
        "args": vars(args),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "prompt_lengths": lengths,
        "agreement": agreement,
        "times": times,
        "median_s": med,
        "new_tokens_per_s": {k: args.batch * args.new / m for k, m in med.items()},
        "ours_over_hf": ratios,
    }


if __name__ == "__main__":
    sys.exit(main())
