"""A pipeline chunk's backward split into B and W (the zero-bubble schedules) against its whole backward.

What is compared
    One chunk of ``--layers`` transformer blocks of ``--preset`` (a middle pipeline stage: hidden states in, hidden
    states out), ``[batch, seq]`` tokens, its forward then:

    * ``whole``: ``torch.autograd.backward(out, dy)``, every gradient at once (what 1F1B runs);
    * ``split``: ``B`` then ``W`` (:mod:`trickles.parallel.pipeline.split`): the input's gradient, then the weights'
      from the gradients ``B`` recorded -- what ZB-H1 and ZB-V run, minus the time between the two.

    Agreement first: the input's gradient and every weight's must equal the whole backward's within 1e-6 relative
    in fp32 (the split is exact; 1e-2 in bf16), or the run stops.

How
    ``--warmup`` untimed rounds, then ``--rounds`` rounds of both, alternating (``_timing.interleaved``; CUDA
    synchronized around each clock). Each contestant's clock runs over forward + backward; ``B`` and ``W`` are also
    timed apart in the split rounds. Reported: the medians, split/whole (paired beside it), and the engine restarts
    ``W`` makes (one per depth level of the chunk's graph): split/whole above 1 is the price the zero-bubble schedules
    pay for moving ``W`` into the bubble -- worth it when that price is below the bubble they remove.

Examples::

    python benchmarks/split_backward.py                                   # CPU, demo blocks (d = 256), 4 layers
    python benchmarks/split_backward.py --device cuda --dtype bf16 --preset llama-1b --layers 4 --batch 2 --seq 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    device_name,
    interleaved,
    model_options,
    one_device,
    paired,
    rel_error,
    sync,
    timing_options,
    write_json,
)  # noqa: E402

from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.presets import PRESETS, apply_preset  # noqa: E402
from trickles.models.transformer import build_model  # noqa: E402
from trickles.parallel.pipeline.split import backward_input, backward_weight  # noqa: E402
from trickles.parallel.pipeline.stages import StageChunk  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model_options(p, 256, PRESETS)
    p.add_argument("--layers", type=int, default=4, help="blocks in the chunk")
    timing_options(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = one_device(args.device, args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), args.preset),
        vocab_size=256,
        max_seq_len=args.seq,
        dropout=0.0,
        n_layers=args.layers + 2,
    )
    model = build_model(cfg, seed=0, device=device).to(dtype)
    chunk = StageChunk(model, list(range(1, args.layers + 1)), False, False)  # a middle stage's layers
    params = [p for i in chunk.layers for p in model.layers[str(i)].parameters()]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.batch, args.seq, cfg.d_model, generator=g).to(device, dtype)
    dy = torch.randn(args.batch, args.seq, cfg.d_model, generator=g).to(device, dtype)
    parts: dict[str, list[float]] = {"B": [], "W": []}
    restarts = []

    def run(name: str):
        model.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_(True)
        out = chunk(inp, args.seq)
        if name == "whole":
            torch.autograd.backward(out, dy)
        else:
            sync(device)
            t0 = time.perf_counter()
            deferred = backward_input(out, dy, inp)
            sync(device)
            t1 = time.perf_counter()
            backward_weight(deferred)
            sync(device)
            parts["B"].append(t1 - t0)
            parts["W"].append(time.perf_counter() - t1)
            restarts.append(len(deferred.groups))
        return inp.grad, [p.grad for p in params]

    (wx, wg), (sx, sg) = run("whole"), run("split")
    worst = max([rel_error(sx, wx)] + [rel_error(a, b) for a, b in zip(sg, wg)])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    if worst > tol:
        print(f"the split backward disagrees with the whole one: {worst:.3g} relative > {tol:g}")
        return 1
    parts = {"B": [], "W": []}
    times = interleaved(["whole", "split"], lambda name: lambda: run(name), args.rounds, device, args.warmup)
    med = {n: statistics.median(t) for n, t in times.items()}
    b, w = statistics.median(parts["B"][-args.rounds :]), statistics.median(parts["W"][-args.rounds :])
    ratio, pair = med["split"] / med["whole"], paired(times["split"], times["whole"])
    print(
        f"{device_name(device)}, {args.dtype}, {args.preset} blocks (d={cfg.d_model}), {args.layers} layers, "
        f"{args.batch} x {args.seq} tokens, agreement {worst:.1e}, W restarts {restarts[-1]}"
    )
    for n in ("whole", "split"):
        print(f"  {n:6s} forward + backward {1e3 * med[n]:9.2f} ms")
    print(f"  split: B {1e3 * b:.2f} ms, W {1e3 * w:.2f} ms")
    print(f"  split/whole: {ratio:.3f}x (paired {pair:.3f}x)")
    write_json(
        args.json,
        {
            "device": device_name(device),
            "dtype": args.dtype,
            "preset": args.preset,
            "layers": args.layers,
            "batch": args.batch,
            "seq": args.seq,
            "agreement": worst,
            "ratio": ratio,
            "paired_ratio": pair,
            "median_s": med,
            "b_s": b,
            "w_s": w,
            "restarts": restarts[-1],
            "times_s": times,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
