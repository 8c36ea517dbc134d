"""Fused q/k/v and gate/up projections against separate ones: one block's projections, forward and backward.

What is compared
    A llama block's input projections at a preset's shape, from the same input ``x [tokens, d]`` and weights
    and a fixed upstream gradient, to the input's and every weight's gradient:

    * ``separate``: ``q_proj``, ``k_proj``, ``v_proj`` (three matmuls) and ``gate_proj``, ``up_proj`` (two), then
      SwiGLU -- what the model runs with ``model.fused_proj=false``;
    * ``fused``: ``qkv_proj`` (one matmul) split into query, key and value heads, and ``gate_up_proj`` (one)
      read as pairs by the packed SwiGLU -- ``model.fused_proj=true`` (:mod:`trickles.models.fused`).

    Both run the same kernels setting (``--kernels``: ``torch`` everywhere, ``triton`` on CUDA). Agreement
    first: the outputs and gradients (the fused weights' cut into their parts) within 1e-5 relative in fp32
    (2e-2 in bf16), or the run stops.

How
    ``--warmup`` untimed rounds, then ``--rounds`` rounds in which both contestants run one forward + backward,
    the order alternating (``_timing.interleaved``); on CUDA the device is synchronized before each clock starts
    and stops. Reported: median time of each and fused/separate.

Examples::

    python benchmarks/projections.py                                  # CPU, the demo model's block
    python benchmarks/projections.py --preset llama-125m --tokens 1024
    python benchmarks/projections.py --device cuda --dtype bf16 --preset llama-1b --tokens 8192 --kernels triton
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_name, interleaved, one_device, rel_error  # noqa: E402

from trickles.models import fused  # noqa: E402
from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.presets import PRESETS, apply_preset  # noqa: E402
from trickles.models.transformer import MLP, Attention, initial_value  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--preset", default="demo", choices=[k for k, v in PRESETS.items() if v["flavor"] == "llama"])
    p.add_argument("--tokens", type=int, default=512, help="tokens in the batch (one sequence)")
    p.add_argument("--kernels", default="torch", choices=["torch", "triton"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: 1 on a CPU)")
    return p.parse_args(argv)


class Projections(torch.nn.Module):
    """The attention's q/k/v heads and the MLP's activation of one block (what fusion changes), summed into one
    output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn, self.mlp = Attention(cfg, 0), MLP(cfg)

    def forward(self, x):
        a = self.attn
        if a.fused:
            q, k, v = fused.split_heads(a.qkv_proj(x), a.rep, a.head_dim)
        else:
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, -1, a.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        m = self.mlp
        h = m.act(m.gate_up_proj(x)) if m.fused else m.act(m.gate_proj(x), m.up_proj(x))
        return q.sum(2) + k.sum(2) + v.sum(2), h


def main(argv=None) -> int:
    args = parse_args(argv)
    device = one_device(args.device, args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), args.preset), kernels=args.kernels, vocab_size=256, max_seq_len=args.tokens
    )
    models = {}
    for name, on in (("separate", False), ("fused", True)):
        c = dataclasses.replace(cfg, fused_proj=on)
        with torch.device("meta"):
            m = Projections(c)
        m.to_empty(device=device)
        with torch.no_grad():  # the unfused model's weights, each part by its own name, fused where fused
            for n, p in m.named_parameters():
                p.copy_(initial_value(c, "layers.0." + n, tuple(p.shape), seed=0))
        models[name] = m.to(dtype)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, args.tokens, cfg.d_model, generator=g).to(device, dtype)
    douts = None

    def step(name):
        x = x0.clone().requires_grad_()
        outs = models[name](x)
        torch.autograd.backward(outs, douts)
        return outs, x.grad

    with torch.no_grad():
        douts = [torch.randn(o.shape, generator=g).to(device, dtype) for o in models["separate"](x0)]
    check = {name: step(name) for name in models}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    sep = dict(models["separate"].named_parameters())
    got = fused.split_state(
        dataclasses.replace(cfg, fused_proj=True),
        {"layers.0." + n: p.grad for n, p in models["fused"].named_parameters()},
    )
    pairs = [(a, b) for a, b in zip(check["fused"][0], check["separate"][0])] + [
        (check["fused"][1], check["separate"][1])
    ]
    pairs += [
        (got["layers.0." + n], p.grad) for n, p in sep.items() if p.grad is not None
    ]  # (o_proj, down_proj: unused)
    worst = max(rel_error(a, b) for a, b in pairs)
    if worst > tol:
        print(f"fused and separate disagree: {worst:.3g} relative > {tol:g}")
        return 1

    def prepare(name):
        for m in models.values():
            m.zero_grad(set_to_none=True)
        return lambda: step(name)

    times = interleaved(list(models), prepare, args.rounds, device, args.warmup)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"{device_name(device)}, {args.dtype}, {args.preset} block (d={cfg.d_model}, "
        f"heads {cfg.n_heads}/{cfg.kv_heads}, ffn {cfg.ffn_dim}), {args.tokens} tokens, kernels={args.kernels}, "
        f"agreement {worst:.1e}"
    )
    for n in models:
        print(f"  {n:9s} {1e3 * med[n]:8.3f} ms")
    print(f"  fused/separate: {med['fused'] / med['separate']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
