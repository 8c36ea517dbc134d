"""DeepSeek-V3's and Qwen3-MoE's mixture-of-experts blocks: trickles' ``MoE`` against transformers' ``DeepseekV3MoE``
and ``Qwen3MoeSparseMoeBlock`` with the same weights, forward + backward on one device, same run.

What is compared
    From the input ``x [B, T, d]`` forward, then backward from a fixed upstream gradient to the gradients of ``x``
    and of every weight (the router's included):

    * deepseek: our ``MoE`` with DeepSeek-V3's routing (``moe_router_score=sigmoid``, ``moe_groups``,
      ``moe_topk_groups``, ``moe_routed_scale``, ``moe_norm_topk``, the routing bias ``e_score_correction_bias``
      set to random values, one shared expert of ``moe_ffn_hidden`` units) against
      ``transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE`` (``DeepseekV3TopkRouter``, fused
      ``experts.gate_up_proj [E, 2F, d]`` / ``down_proj [E, d, F]``, ``shared_experts``);
    * qwen3: our ``MoE`` with softmax top-k renormalized and no shared expert against
      ``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock``.

    transformers' experts run as ``grouped_mm`` (its default for a loaded model: one
    ``torch.nn.functional.grouped_mm`` per projection over the tokens sorted by expert); ``--impls grouped_mm,eager``
    adds ``eager`` (a loop over the experts hit, 13-17x ours at the default shape); ours is compared with the
    fastest, the other ratios printed too. Our auxiliary-loss
    weights are 0: the layer still computes the balance loss and the z-loss, records its statistics and
    backpropagates them through ``AuxLossGrad`` (gradient 0), the work it does in training; the peers compute none.

Agreement check first, in fp32: output, input gradient and every weight gradient (the largest relative error
``||a - b|| / ||b||`` over the parameters) within ``--tol`` (1e-5) of each transformers implementation; a mismatch
stops the run. Then ``--steps`` timed rounds after ``--warmup`` untimed ones, the contestants interleaved in
rotating order (``_timing.interleaved``); ratios of medians and paired (the median of each round's ratio).

Target: ours/peer <= 0.95x for both blocks.

Usage::

    python benchmarks/moe_blocks.py                          # CPU fp32: B 2 x T 512, d 512, E 64 of F 256, top-6
    python benchmarks/moe_blocks.py --steps 30 --json out/moe_blocks.json
    python benchmarks/moe_blocks.py --device cuda --dtype bf16 --seq 4096
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, interleaved, one_device, paired, rel_error, summarize, table, write_json  # noqa: E402

from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.moe import MoE, MoEStats  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=2, help="sequences B")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence T")
    p.add_argument("--d-model", type=int, default=512, help="width d")
    p.add_argument("--ffn", type=int, default=256, help="hidden units of each expert F (and of the shared one)")
    p.add_argument("--experts", type=int, default=64, help="routed experts E")
    p.add_argument("--top-k", type=int, default=6, help="experts per token")
    p.add_argument("--groups", type=int, default=8, help="deepseek: expert groups (n_group)")
    p.add_argument("--topk-groups", type=int, default=4, help="deepseek: groups a token may use (topk_group)")
    p.add_argument("--blocks", default="deepseek,qwen3", help="which blocks, comma-separated")
    p.add_argument(
        "--impls",
        default="grouped_mm",
        help="transformers' experts implementations, comma-separated (grouped_mm, eager; eager took 13-17x ours at "
        "the default shape)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the agreement check")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: 1 on a CPU)")
    p.add_argument("--tol", type=float, default=1e-5, help="the agreement check's relative tolerance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def our_config(args, kind: str) -> ModelConfig:
    """The block's routing as a :class:`ModelConfig` (one MoE layer; auxiliary-loss weights 0)."""
    common = dict(n_layers=1, d_model=args.d_model, n_heads=4, vocab_size=64, max_seq_len=args.seq)
    moe = dict(moe_experts=args.experts, moe_top_k=args.top_k, moe_ffn_hidden=args.ffn, moe_aux_loss=0.0)
    moe.update(moe_z_loss=0.0, moe_norm_topk=True)
    if kind == "deepseek":
        moe.update(moe_router_score="sigmoid", moe_groups=args.groups, moe_topk_groups=args.topk_groups)
        moe.update(moe_routed_scale=2.5, moe_shared_experts=1)
    cfg = ModelConfig(**common, **moe)
    cfg.validate()
    return cfg


def hf_block(args, kind: str, impl: str):
    """transformers' block of ``kind`` with the experts implementation ``impl``."""
    if kind == "deepseek":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = DeepseekV3Config(
            hidden_size=args.d_model, moe_intermediate_size=args.ffn, n_routed_experts=args.experts,
            num_experts_per_tok=args.top_k, n_group=args.groups, topk_group=args.topk_groups, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, experts_implementation=impl,
        )  # fmt: skip
        return DeepseekV3MoE(cfg)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=args.d_model, moe_intermediate_size=args.ffn, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, experts_implementation=impl,
    )  # fmt: skip
    return Qwen3MoeSparseMoeBlock(cfg)


@torch.no_grad()
def copy_into(hf, ours: MoE) -> None:
    """Our layer's weights (and routing bias) into transformers' block (``gate_up_proj``: gate rows first)."""
    ex = ours.experts
    hf.gate.weight.copy_(ours.router.weight)
    hf.experts.gate_up_proj.copy_(torch.cat([ex.gate_proj.weight, ex.up_proj.weight], 1))
    hf.experts.down_proj.copy_(ex.down_proj.weight)
    if ours.router.e_score_correction_bias is not None:
        hf.gate.e_score_correction_bias.copy_(ours.router.e_score_correction_bias)
    if ours.shared is not None:
        for w in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_experts, w).weight.copy_(getattr(ours.shared, w).weight)


def hf_grads(hf) -> dict[str, torch.Tensor]:
    """transformers' weight gradients under our names."""
    f = hf.experts.down_proj.shape[-1]
    gu = hf.experts.gate_up_proj.grad
    out = {
        "router.weight": hf.gate.weight.grad,
        "experts.gate_proj.weight": gu[:, :f],
        "experts.up_proj.weight": gu[:, f:],
        "experts.down_proj.weight": hf.experts.down_proj.grad,
    }
    if hasattr(hf, "shared_experts"):
        out.update({f"shared.{w}.weight": getattr(hf.shared_experts, w).weight.grad for w in ("gate_proj", "up_proj")})
        out["shared.down_proj.weight"] = hf.shared_experts.down_proj.weight.grad
    return out


class Step:
    """Forward + backward of ``module`` on its own leaf copy of ``x`` from the upstream gradient ``dy``."""

    def __init__(self, module, grads, x: torch.Tensor, dy: torch.Tensor):
        self.module, self.grads = module, grads
        self.x, self.dy = x.detach().clone().requires_grad_(), dy

    def to(self, dtype) -> None:
        self.module.to(dtype)
        self.x, self.dy = self.x.detach().to(dtype).requires_grad_(), self.dy.to(dtype)

    def __call__(self) -> torch.Tensor:
        self.x.grad = None
        for p in self.module.parameters():
            p.grad = None
        y = self.module(self.x)
        y.backward(self.dy)
        return y


def contestants(args, kind: str, device: torch.device) -> dict[str, Step]:
    """Ours and transformers' (each experts implementation) for ``kind``, the same weights and inputs."""
    torch.manual_seed(args.seed)
    ours = MoE(our_config(args, kind), 0, MoEStats()).to(device).train()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.05)
        if ours.router.e_score_correction_bias is not None:  # a trained bias: it changes which experts are chosen
            ours.router.e_score_correction_bias.normal_(0.0, 0.02)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)
    dy = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)
    steps = {f"ours {kind}": Step(ours, lambda: {n: p.grad for n, p in ours.named_parameters()}, x, dy)}
    for impl in [i.strip() for i in args.impls.split(",") if i.strip()]:
        hf = hf_block(args, kind, impl).to(device).train()
        copy_into(hf, ours)
        steps[f"hf {kind} ({impl})"] = Step(hf, lambda hf=hf: hf_grads(hf), x, dy)
    return steps


def check(steps: dict[str, Step], tol: float) -> tuple[list[list[str]], bool]:
    """fp32: ours against each transformers implementation (output, dx, the largest dW error)."""
    got = {}
    for name, s in steps.items():
        y = s()
        got[name] = (
            y.detach().clone(),
            s.x.grad.detach().clone(),
            {n: v.detach().clone() for n, v in s.grads().items()},
        )
    ours = next(iter(steps))
    rows, ok = [], True
    for name in list(steps)[1:]:
        (yo, xo, wo), (yh, xh, wh) = got[ours], got[name]
        errs = [rel_error(yo, yh), rel_error(xo, xh), max(rel_error(wo[n], wh[n]) for n in wh)]
        good = max(errs) <= tol and wh.keys() == wo.keys()
        ok &= good
        rows.append([f"{ours} vs {name}", *(f"{e:.1e}" for e in errs), "ok" if good else "MISMATCH"])
    return rows, ok


def main(argv=None) -> int:
    import transformers

    args = parse_args(argv)
    device = one_device(args.device, args.threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest")  # the check in true fp32
    kinds = [k.strip() for k in args.blocks.split(",") if k.strip()]
    print(
        f"trickles MoE vs transformers {transformers.__version__} DeepseekV3MoE / Qwen3MoeSparseMoeBlock, "
        "forward + backward"
    )
    print(
        f"  shape   B {args.batch}, T {args.seq} ({args.batch * args.seq} tokens), d {args.d_model}, E {args.experts} "
        f"of F {args.ffn}, top-{args.top_k}, dropless, {args.dtype}; deepseek: sigmoid, {args.groups} groups, "
        f"{args.topk_groups} a token, routed scale 2.5, one shared expert of F, a random routing bias"
    )
    print(
        f"  device  {device.type}: {device_name(device)}, {torch.get_num_threads()} threads; torch {torch.__version__}"
    )
    doc = {"args": vars(args), "device": device_name(device), "torch": torch.__version__, "blocks": {}}
    verdicts = []
    for kind in kinds:
        steps = contestants(args, kind, device)
        rows, ok = check(steps, args.tol)
        print(f"\n{kind}: agreement check (fp32), relative error ||a-b||/||b||, tolerance {args.tol:g}")
        print(table(["pair", "out", "dx", "dW", ""], rows))
        if not ok:
            print(f"{kind}: an implementation disagrees beyond --tol: no timing", file=sys.stderr)
            return 1
        if DTYPES[args.dtype] != torch.float32:
            for s in steps.values():
                s.to(DTYPES[args.dtype])
        times = interleaved(list(steps), steps.__getitem__, args.steps, device, args.warmup)
        ours = next(iter(steps))
        stats = {n: summarize(t) for n, t in times.items()}
        peer = min(list(steps)[1:], key=lambda n: stats[n]["median"])
        ratio = {n: stats[ours]["median"] / stats[n]["median"] for n in list(steps)[1:]}
        pair = {n: paired(times[ours], times[n]) for n in list(steps)[1:]}
        tokens = args.batch * args.seq
        table_rows = [
            [n, f"{s['median'] * 1e3:.1f}", f"{s['stdev'] * 1e3:.1f}", f"{tokens / s['median']:,.0f}",
             f"{1 / ratio[n]:.3f}x" if n in ratio else "-", f"{1 / pair[n]:.3f}x" if n in pair else "-"]
            for n, s in stats.items()
        ]  # fmt: skip
        print(f"{args.steps} timed rounds after {args.warmup} warm-up rounds, interleaved")
        print(table(["contestant", "median ms", "stdev ms", "tokens/s", "it/ours", "paired"], table_rows))
        met = ratio[peer] <= 0.95
        verdicts.append(
            f"{kind}: ours/{peer} {ratio[peer]:.3f}x (paired {pair[peer]:.3f}x) {'met' if met else 'NOT met'}"
            + "".join(f"; vs {n} {ratio[n]:.3f}x" for n in ratio if n != peer)
        )
        doc["blocks"][kind] = {
            "checks": rows,
            "stats": stats,
            "times": times,
            "peer": peer,
            "ratio": ratio,
            "paired": pair,
            "met": met,
        }
    print("\ntarget ours/peer <= 0.95x:  " + ";  ".join(verdicts))
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
