"""Decoding with multi-head latent attention: trickles' latent cache (absorbed decode) vs transformers' DeepSeek-V3.

What is compared
    A DeepSeek-V3-shaped model of dense blocks (latent attention: a low-rank query, a compressed key/value latent of
    ``--kv-rank`` values and a shared rotary key) decodes ``--new`` tokens greedily after a ``--context``-token
    prompt, ``--batch`` prompts at once:

    * ``ours``: ``trickles.infer.decode`` with the dense latent cache (:class:`~trickles.models.latent_cache.
      LatentCache`): ``kv_lora_rank + qk_rope_head_dim`` values a token per layer, each step attending in the
      latent space with the up-projections absorbed into the query and the output;
    * ``HF``: ``DeepseekV3ForCausalLM.generate(do_sample=False)`` on the same weights (exported with ``save_hf``,
      sdpa attention), whose cache keeps every head's keys and values.

    Beside the times, the KV bytes a token takes per layer: ours, and those of multi-head attention of the same
    head count (every head's ``qk_nope + qk_rope`` key and ``v_head_dim`` value), the cache transformers keeps.

How
    Agreement first: ours' greedy tokens equal transformers' (a row may part only where transformers' own model
    finds the two tokens tied within ``--tie-tol`` nats, as in ``benchmarks/decoding.py``); then ``--rounds``
    rounds timing each contestant once, order rotated. Reported: median time, new tokens/s, ours/HF (median of the
    per-round ratios).

Target
    ours/HF tokens/s >= 1.0x at a 1k context, with >= 5x fewer KV bytes than multi-head attention.

Examples::

    python benchmarks/mla_decoding.py                    # CPU: 4 layers, d 256, 8 heads, latent 64, 1,024-token context
    python benchmarks/mla_decoding.py --rounds 5 --json out/mla-decoding.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, interleaved, paired, table, write_json  # noqa: E402
from decoding import classify  # noqa: E402

from trickles.infer import Sampling, decode  # noqa: E402
from trickles.models import ModelConfig, build_model, save_hf  # noqa: E402


def model_config(args) -> ModelConfig:
    cfg = ModelConfig(
        attention="mla",
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        q_lora_rank=args.q_rank,
        kv_lora_rank=args.kv_rank,
        qk_nope_head_dim=args.nope,
        qk_rope_head_dim=args.rope,
        v_head_dim=args.v_dim,
        ffn_hidden=4 * args.d_model,
        vocab_size=args.vocab,
        max_seq_len=args.context + args.new + 1,
        family="deepseek_v3",
    )
    cfg.validate()
    return cfg


def kv_bytes(cfg: ModelConfig, e: int = 4) -> dict[str, int]:
    """Bytes a token's cache takes per layer: the latent rows, and multi-head attention's keys and values."""
    return {
        "latent": (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * e,
        "multi-head": cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * e,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--q-rank", type=int, default=96)
    p.add_argument("--kv-rank", type=int, default=64)
    p.add_argument("--nope", type=int, default=32)
    p.add_argument("--rope", type=int, default=16)
    p.add_argument("--v-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tie-tol", type=float, default=1e-3)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    import transformers

    device = torch.device("cpu")
    torch.manual_seed(0)
    cfg = model_config(args)
    ours = build_model(cfg, seed=0, device=device).eval()
    with torch.no_grad():  # away from the initialization: peaked distributions, varied tokens
        for q in ours.parameters():
            q.add_(torch.randn_like(q) * 0.02)
    with tempfile.TemporaryDirectory() as d:
        save_hf(ours, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    ids = torch.tensor(prompts)
    greedy = Sampling(max_new_tokens=args.new, temperature=0)
    hf_kw = dict(do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0, eos_token_id=None)
    one = Sampling(max_new_tokens=1, temperature=0)
    hf_one = dict(hf_kw, max_new_tokens=1, min_new_tokens=1)
    runs = {
        "ours": lambda: decode(ours, prompts, greedy),
        "HF": lambda: hf.generate(ids, **hf_kw),
        "ours prefill": lambda: decode(ours, prompts, one),
        "HF prefill": lambda: hf.generate(ids, **hf_one),
    }
    with torch.no_grad():
        a, b = runs["ours"](), runs["HF"]()
        rows = [
            classify(hf, q, x.tokens, y, False, args.tie_tol, device)
            for q, x, y in zip(prompts, a, b[:, args.context :].tolist())
        ]
        print(f"agreement with transformers: {rows.count('equal')}/{len(rows)} rows equal, {rows.count('tie')} tie")
        if "differ" in rows:
            print("a row parts from transformers' where its model prefers its own token", file=sys.stderr)
            return 1
        times = interleaved(list(runs), runs.get, args.rounds, device)
    kv = kv_bytes(cfg)
    print(
        f"{device_name(device)}; {args.layers} layers, d {args.d_model}, {args.heads} heads, latent {args.kv_rank} + "
        f"rotary {args.rope}; {args.batch} prompts of {args.context} tokens, {args.new} new each, {args.rounds} rounds"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = 1 / paired(times["ours"], times["HF"])  # tokens/s ours over HF, the prompt's prefill included
    # the decoding steps alone: each round's whole run less its one-token run (the prefill and first token)
    steps = {k: [a - b for a, b in zip(times[k], times[f"{k} prefill"])] for k in ("ours", "HF")}
    step_ratio = 1 / paired(steps["ours"], steps["HF"])
    table_rows = [
        [k, f"{med[k] * 1000:.0f} ms", f"{statistics.median(steps[k]) * 1000:.0f} ms"]
        + [f"{args.batch * (args.new - 1) / statistics.median(steps[k]):.0f}"]
        + ([f"{ratio:.2f}x", f"{step_ratio:.2f}x"] if k == "ours" else ["-", "-"])
        for k in ("ours", "HF")
    ]
    print(
        table(
            ["contestant", "whole run", "decoding steps", "decode tok/s", "ours/HF tok/s (whole)", "(decoding)"],
            table_rows,
        )
    )
    print(
        f"KV bytes a token per layer: latent {kv['latent']}, multi-head attention {kv['multi-head']} "
        f"({kv['multi-head'] / kv['latent']:.1f}x fewer)"
    )
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "device_name": device_name(device),
                "agreement": rows,
                "times": times,
                "median_s": med,
                "tokens_per_s_ours_over_hf": ratio,
                "decoding_tokens_per_s_ours_over_hf": step_ratio,
                "kv_bytes": kv,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
