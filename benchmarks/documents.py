"""Packed documents' attention masks against plain causal attention: one training micro-step of a whole model.

What is compared
    The same model, weights and packed batch ``[batch, seq]`` (``--documents`` documents per sequence, their
    boundaries at random places), one forward with the loss and its backward:

    * ``causal``: attention over the whole sequence (SDPA ``is_causal``), positions ``0..seq-1`` -- what the
      model runs with ``data.document_mask=false``;
    * ``documents``: attention within each document, positions restarting at each
      (:mod:`trickles.models.documents`: the dense boolean mask into SDPA on a CPU, flex attention's block mask,
      compiled, on CUDA) -- ``data.document_mask=true``.

    Agreement first: with one document per sequence both compute the same thing, so the loss and every gradient
    must agree within 1e-5 relative in fp32 (2e-2 in bf16), or the run stops.

How
    ``--warmup`` untimed rounds, then ``--rounds`` rounds in which both contestants run the step, the order
    alternating (``_timing.interleaved``); on CUDA the device is synchronized before each clock starts and stops.
    Reported: each one's median and documents/causal (the median of the paired per-round ratios beside it).

Examples::

    python benchmarks/documents.py                                  # CPU, the demo model, 2 x 512, 8 documents
    python benchmarks/documents.py --device cuda --dtype bf16 --preset llama-1b --seq 4096 --documents 8
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_name, interleaved, model_options, one_device, paired, rel_error, timing_options, write_json  # noqa: E402

from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.presets import PRESETS, apply_preset  # noqa: E402
from trickles.models.transformer import build_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model_options(p, 512, PRESETS)
    p.add_argument("--documents", type=int, default=8, help="documents per sequence")
    timing_options(p)
    return p.parse_args(argv)


def boundaries(batch: int, seq: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, seq]`` document ids with ``documents`` documents per row, cut at random distinct places."""
    ids = torch.zeros(batch, seq, dtype=torch.int32)
    for r in range(batch):
        cuts = torch.randperm(seq - 1, generator=generator)[: documents - 1] + 1
        ids[r, cuts] = 1
    return torch.cumsum(ids, dim=1, dtype=torch.int32)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = one_device(args.device, args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), args.preset), vocab_size=256, max_seq_len=args.seq, dropout=0.0
    )
    model = build_model(cfg, seed=0, device=device).to(dtype)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ids = {"causal": None, "documents": boundaries(args.batch, args.seq, args.documents, g).to(device)}

    def step(name, documents):
        model.zero_grad(set_to_none=True)
        loss = model(x, target=y, **({} if documents is None else {"documents": documents}))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    one = torch.zeros(args.batch, args.seq, dtype=torch.int32, device=device)  # a single document: plain causal
    (la, ga), (lb, gb) = step("causal", None), step("documents", one)
    worst = max([rel_error(la, lb)] + [rel_error(a, b) for a, b in zip(ga, gb)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if worst > tol:
        print(f"causal and one-document masks disagree: {worst:.3g} relative > {tol:g}")
        return 1

    times = interleaved(list(ids), lambda name: lambda: step(name, ids[name]), args.rounds, device, args.warmup)
    med = {n: statistics.median(t) for n, t in times.items()}
    ratio, pair = med["documents"] / med["causal"], paired(times["documents"], times["causal"])
    print(
        f"{device_name(device)}, {args.dtype}, {args.preset} (d={cfg.d_model}, {cfg.n_layers} layers), "
        f"{args.batch} x {args.seq} tokens, {args.documents} documents a sequence, agreement {worst:.1e}"
    )
    for n in ids:
        print(f"  {n:9s} {1e3 * med[n]:9.2f} ms")
    print(f"  documents/causal: {ratio:.3f}x (paired {pair:.3f}x)")
    write_json(
        args.json,
        {
            "device": device_name(device),
            "dtype": args.dtype,
            "preset": args.preset,
            "batch": args.batch,
            "seq": args.seq,
            "documents": args.documents,
            "agreement": worst,
            "ratio": ratio,
            "paired_ratio": pair,
            "median_s": med,
            "times_s": times,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
