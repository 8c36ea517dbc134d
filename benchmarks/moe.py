"""Mixture of experts: trickles' MoE layer and block vs transformers' Mixtral on one device, and trickles'
expert parallelism vs DeepSpeed-MoE on N ranks, same run.

What is compared
    One device (``--part single``), forward and backward of one layer from its input ``x [B, T, d]`` to the
    gradients of ``x`` and of every weight, from a fixed upstream gradient:

    * layer: ``trickles.models.moe.MoE`` (router in fp32, top-k renormalized, dropless:
      ``moe_capacity_factor = 0``; the auxiliary losses with weight 0 -- the layer still computes them and
      backpropagates them through :class:`AuxLossGrad`, with gradient 0, so its work is what it does in
      training) against ``transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock`` with the
      same weights (``gate.weight [E, d]`` = our router; ``experts.gate_up_proj [E, 2F, d]`` = our
      ``gate_proj`` and ``up_proj`` stacked; ``experts.down_proj [E, d, F]`` = ours), ``router_jitter_noise
      = 0``: Mixtral's rule (softmax, top-k, renormalized) is ours with capacity factor 0. Two experts
      implementations of transformers run: ``grouped_mm`` (its default for a loaded model: one
      ``torch.nn.functional.grouped_mm`` per projection) and ``eager`` (a loop over the experts hit);
      ours is compared with the faster of them (the other ratio is printed too);
    * block: ``trickles.models.transformer.Block`` (pre-norm RMSNorm, grouped-query causal attention with
      rotary embeddings, the MoE) against ``MixtralDecoderLayer`` (sdpa attention, the same two experts
      implementations), same weights, each given its own rotary tables (same base) computed outside the
      step.

    Expert parallel (``--part ep``), ``N = --world`` ranks, each with its own ``B x T`` tokens and ``E / N``
    experts, forward and backward as above:

    * ours: the layer above with ``trickles.parallel.expert.apply_expert_parallel`` applied over
      ``ParallelDims(dp=N, ep=N).build(device).comm("ep")`` (this rank's slice of the stacked expert weights,
      the all-to-all dispatch: counts, rows out, outputs back, and the reverse in backward);
    * peer: ``deepspeed.moe.layer.MoE(ep_size=N, k=top_k, drop_tokens=False, use_rts=False,
      top2_2nd_expert_sampling=False)`` with an expert ``nn.Module`` of the same SwiGLU MLP and the same
      weights, its expert groups made by ``set_deepspeed_parallelism()``. ``drop_tokens=False`` is
      DeepSpeed's dropless mode: every expert's capacity becomes the largest expert load over the ``ep``
      ranks (one all-reduce), so its all-to-alls carry ``E x C`` rows, padding included, and each expert
      runs on its padded ``N x C`` rows. With ``top2_2nd_expert_sampling=False`` its top-2 gate picks the
      two most probable experts and renormalizes their weights, Mixtral's (and our) rule; left on, it
      draws the second expert with Gumbel noise. Its load-balancing loss is computed and not used (ours:
      computed and backpropagated with weight 0);
    * reference row: our layer with all ``E`` experts on every rank (no communication), what one rank would
      compute without expert parallelism.

How
    * Same weights: ours from ``build_model`` (one MoE block, the run's seed), copied into the peers; the
      router's weights are ``N(0, 0.02)`` as initialized (logits with standard deviation about 0.3 at unit
      inputs: no near-ties in practice). Same data: ``x`` and the upstream gradient from a fixed generator.
    * Agreement check before timing (fp32, also on CUDA, where the modules are cast to bf16 afterwards):
      output, input gradient and weight gradients, relative error ``||a - b|| / ||b||`` over the whole
      tensor (weights: the largest over the parameters) at most ``--tol`` (1e-5), else the run stops. One
      device: ours against each transformers implementation. Expert parallel: every contestant against
      ``MixtralSparseMoeBlock`` (eager) holding all experts on this rank's tokens; expert weight gradients
      against that reference's, summed over the ranks, this rank's slice; the largest error over the ranks. At
      ``--top-k 1`` Mixtral's weight is 1, ours (Switch's) and DeepSpeed's the raw probability: the one-device part
      is skipped and the expert-parallel reference is our layer with all experts.
    * Bytes sent per rank, in one more untimed step: ours from the topology's ``CommLedger`` (wire bytes of the
      ``ep`` group's all-to-alls), DeepSpeed's by wrapping ``deepspeed.comm.all_to_all_single`` and
      ``all_reduce``; both next to their formulas (below), computed from this step's routing.
    * Timing: after ``--warmup`` untimed rounds, ``--steps`` rounds in which every contestant runs one step,
      the order rotating each round. Each step's clock stops when its backward has returned and the device
      is synchronized (every all-to-all it started has completed); with several ranks each step starts
      after a barrier and its time is the slowest rank's. Median and mean step time, ``vs peer`` (ratio of
      medians) and ``paired`` (median over rounds of ours/peer in the same round).
    * CPU: ``torch.set_num_threads`` = the cores for one device, ``cores // N`` per rank (``--threads``
      overrides both); gloo. CUDA: bf16 (``--precision``), one GPU per rank, NCCL, under ``torchrun``.

Communication formulas (bytes one rank sends per step, ``e`` bytes per element)
    * ours (``trickles/parallel/expert.py``): ``2 (m_out + m_in) d e + (N-1)/N E 8``, ``m_out`` the
      assignments this rank routes to experts on other ranks, ``m_in`` those it receives;
    * DeepSpeed dropless: four all-to-alls of the ``[E, C, d]`` buffer, ``4 (N-1)/N E C d e``, ``C`` the
      largest expert load on any rank, plus the all-reduce of ``C`` (8 bytes).

Target
    ours/peer median step time <= 1.0x: layer and block against transformers, expert parallel against
    DeepSpeed-MoE.

Examples::

    python benchmarks/moe.py                    # both parts; CPU: B 2, T 1024, d 256, F 512, E 8, top-2, fp32; 2 ranks
    python benchmarks/moe.py --part single --steps 20
    python benchmarks/moe.py --part ep --world 4
    python benchmarks/moe.py --part single --device cuda --batch 8 --seq 4096 --d-model 1024 --ffn 2816   # bf16
    torchrun --nproc-per-node 8 benchmarks/moe.py --part ep --device cuda --experts 64 --d-model 1024 --ffn 2816
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _deepspeed import CountSent  # noqa: E402
from _deepspeed import load as load_deepspeed
from _mixtral import (
    NORM_EPS,
    ROPE_THETA,
    by_parts,
    hf_block_grads,
    hf_config,
    hf_moe_grads,
    load_hf_block,  # noqa: E402
    load_hf_moe,
)
from _ranks import (
    PAIRED_NOTE,
    TIME_COLUMNS,
    Contestant,
    compare_times,
    device_line,
    finish,
    gather,
    setup_rank,
    time_rounds,
    times_table,
)
from _ranks import main as run_main  # noqa: E402
from _timing import add_to_json, device_name, interleaved, paired, rel_error, summarize, sync, table  # noqa: E402

from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.moe import route  # noqa: E402
from trickles.models.transformer import build_model, rope_tables  # noqa: E402
from trickles.process import cpu_cores  # noqa: E402
from trickles.topology import ParallelDims, select_device  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_PRECISION = {"cpu": "fp32", "cuda": "bf16"}

OURS_LAYER, OURS_BLOCK = "ours moe layer", "ours block"
HF_LAYER = {"grouped_mm": "hf moe (grouped_mm)", "eager": "hf moe (eager)"}
HF_BLOCK = {"grouped_mm": "hf block (grouped_mm)", "eager": "hf block (eager)"}
OURS_EP, DS_EP, REF_EP = "ours ep", "deepspeed-moe ep", "ours, all experts (no ep)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--part",
        choices=["all", "single", "ep"],
        default="all",
        help="single: one device vs transformers; ep: expert parallel vs DeepSpeed-MoE on --world ranks; all: both",
    )
    p.add_argument(
        "--world", type=int, default=2, help="expert-parallel ranks (ep = dp = world); under torchrun its WORLD_SIZE"
    )
    p.add_argument("--batch", type=int, default=2, help="sequences (per rank in the ep part)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence T")
    p.add_argument("--d-model", type=int, default=256, help="model width d")
    p.add_argument("--ffn", type=int, default=512, help="hidden units of each expert F")
    p.add_argument("--experts", type=int, default=8, help="routed experts E")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--heads", type=int, default=8, help="query heads (block)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (block)")
    p.add_argument(
        "--precision", choices=list(DTYPES), default=None, help="timed precision (default: cpu fp32, cuda bf16)"
    )
    p.add_argument(
        "--fused-proj",
        choices=["auto", "on", "off"],
        default="auto",
        help="our block's q/k/v as one matmul (model.fused_proj; auto: the library's default, on with "
        "kernels=triton or where measured to win on CUDA); transformers' weights are loaded from the parts either way",
    )
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every contestant per round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the agreement check")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads on CPU, both parts (default: cores // --world, what one rank of the ep part gets)",
    )
    p.add_argument(
        "--tol", type=float, default=1e-5, help="largest relative error allowed in the (fp32) agreement check"
    )
    p.add_argument("--no-block", action="store_true", help="leave the whole-block comparison out")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed-MoE out of the ep part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH (one key per part)")
    return p.parse_args(argv)


# ---- the models -----------------------------------------------------------------------------

FUSED_PROJ = {"auto": None, "on": True, "off": False}


def model_config(args) -> ModelConfig:
    """One llama-flavoured MoE block: dropless top-k, auxiliary losses with weight 0; the kernels and fused
    projections the library picks on this machine (``--fused-proj`` pins the latter)."""
    return ModelConfig(
        n_layers=1,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=64,
        fused_proj=FUSED_PROJ[args.fused_proj],
        max_seq_len=args.seq,
        rope_theta=ROPE_THETA,
        norm_eps=NORM_EPS,
        dropout=0.0,
        moe_experts=args.experts,
        moe_top_k=args.top_k,
        moe_ffn_hidden=args.ffn,
        moe_capacity_factor=0.0,
        moe_aux_loss=0.0,
        moe_z_loss=0.0,
    )


# ---- one device -----------------------------------------------------------------------------


class LeafStep:
    """Forward and backward of ``fn`` over its own leaf ``self.x``, from the fixed upstream gradient ``self.dy``."""

    module: nn.Module

    def _leaf(self, module: nn.Module, fn, x: torch.Tensor, dy: torch.Tensor) -> None:
        self.module, self.fn = module, fn
        self.x, self.dy = x.detach().clone().requires_grad_(), dy

    def to(self, dtype) -> None:
        self.module.to(dtype)
        self.x = self.x.detach().to(dtype).requires_grad_()
        self.dy = self.dy.to(dtype)

    def run(self) -> torch.Tensor:
        self.x.grad = None
        for p in self.module.parameters():
            p.grad = None
        y = self.fn(self.x)
        y.backward(self.dy)
        return y


def to_timed_precision(steps: list[LeafStep], dtype: torch.dtype) -> None:
    """After the (fp32) agreement check: every step's gradients cleared, its module and data cast to ``dtype``."""
    for s in steps:
        s.x.grad = None
        for p in s.module.parameters():
            p.grad = None
        if dtype != torch.float32:
            s.to(dtype)


class Step(LeafStep):
    """One implementation on one device (``kind``: layer or block); ``grads()`` its weight gradients by our names."""

    def __init__(self, name: str, kind: str, module: nn.Module, fn, grads, x: torch.Tensor, dy: torch.Tensor):
        self.name, self.kind, self.grads = name, kind, grads
        self._leaf(module, fn, x, dy)

    step = LeafStep.run


def single_steps(args, cfg: ModelConfig, block, x: torch.Tensor, dy: torch.Tensor, device: torch.device) -> list[Step]:
    """Our MoE layer and (unless ``--no-block``) our block, and transformers' with the same weights in both experts
    implementations, each with its own leaf copy of ``x``."""
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralDecoderLayer,
        MixtralRotaryEmbedding,
        MixtralSparseMoeBlock,
    )

    steps = [
        Step(
            OURS_LAYER,
            "layer",
            block.mlp,
            block.mlp,
            lambda: {n: p.grad for n, p in block.mlp.named_parameters()},
            x,
            dy,
        )
    ]
    for impl in ("grouped_mm", "eager"):
        hf = MixtralSparseMoeBlock(hf_config(args, impl)).to(device).train()
        load_hf_moe(hf, block.mlp)
        steps.append(Step(HF_LAYER[impl], "layer", hf, hf, lambda hf=hf: hf_moe_grads(hf), x, dy))
    if args.no_block:
        return steps
    t = x.shape[1]
    ours_rope = tuple(r.to(device) for r in rope_tables(cfg.head_dim, t, ROPE_THETA))
    steps.append(
        Step(
            OURS_BLOCK,
            "block",
            block,
            lambda x: block(x, ours_rope),
            lambda: by_parts(cfg, {n: p.grad for n, p in block.named_parameters()}),
            x,
            dy,
        )
    )
    for impl in ("grouped_mm", "eager"):
        hcfg = hf_config(args, impl)
        hf = MixtralDecoderLayer(hcfg, 0).to(device).train()
        load_hf_block(hf, block, cfg)
        hf_rope = MixtralRotaryEmbedding(hcfg).to(device)(x, torch.arange(t, device=device)[None])

        def fn(x, hf=hf, hf_rope=hf_rope):
            return hf(x, position_embeddings=tuple(r.to(x.dtype) for r in hf_rope), attention_mask=None)

        steps.append(Step(HF_BLOCK[impl], "block", hf, fn, lambda hf=hf: hf_block_grads(hf), x, dy))
    return steps


def check_single(steps: list[Step], tol: float) -> tuple[list[list[str]], bool]:
    """The agreement check (fp32): ours against each transformers implementation, output, input gradient and the
    largest relative error over the weight gradients; the table's rows and whether all are within ``tol``."""
    got = {}
    for s in steps:
        y = s.step()
        got[s.name] = (y.detach(), s.x.grad.detach(), {n: v.detach() for n, v in s.grads().items()})
    checks, ok = [], True
    for s in steps:
        if s.name in (OURS_LAYER, OURS_BLOCK):
            continue
        ours = OURS_LAYER if s.kind == "layer" else OURS_BLOCK
        (yo, xo, wo), (yh, xh, wh) = got[ours], got[s.name]
        errs = [rel_error(yo, yh), rel_error(xo, xh), max(rel_error(wo[n], wh[n]) for n in wh)]
        good = max(errs) <= tol
        ok &= good
        checks.append([f"{ours} vs {s.name}", *(f"{e:.1e}" for e in errs), "ok" if good else "MISMATCH"])
    return checks, ok


def compare_single(times: dict[str, list[float]], tokens: int) -> tuple[dict, list, list[str]]:
    """``(results, rows, verdicts)``: ours (layer, block) against the faster transformers experts implementation,
    ratio of medians and paired, and against the other one too."""
    stats = {n: summarize(ts) for n, ts in times.items()}
    results, rows, verdicts = {}, [], []
    for kind, ours, peers in (("layer", OURS_LAYER, HF_LAYER), ("block", OURS_BLOCK, HF_BLOCK)):
        if ours not in times:
            continue
        peer = min(peers.values(), key=lambda n: stats[n]["median"])  # the faster transformers implementation
        for n in (ours, *peers.values()):
            s = stats[n]
            vs = (
                {p: (s["median"] / stats[p]["median"], paired(times[n], times[p])) for p in peers.values()}
                if n == ours
                else {}
            )
            results[n] = {
                **s,
                "times": times[n],
                "peer": peer if n == ours else None,
                "ratio": vs[peer][0] if vs else None,
                "paired_ratio": vs[peer][1] if vs else None,
                "vs": {p: {"ratio": r, "paired": q} for p, (r, q) in vs.items()},
            }
            rows.append(
                [
                    n,
                    f"{s['median'] * 1e3:.1f}",
                    f"{s['mean'] * 1e3:.1f}",
                    f"{s['stdev'] * 1e3:.1f}",
                    f"{tokens / s['median']:,.0f}",
                    peer if vs else "-",
                    f"{vs[peer][0]:.3f}x" if vs else "-",
                    f"{vs[peer][1]:.3f}x" if vs else "-",
                ]
            )
        others = [p for p in peers.values() if p != peer]
        r = results[ours]
        verdicts.append(
            f"{kind} {ours}/{peer} {r['ratio']:.3f}x (paired {r['paired_ratio']:.3f}x): "
            f"{'met' if r['ratio'] <= 1.0 else 'NOT met'}"
            + "".join(f"; vs {p} {r['vs'][p]['ratio']:.3f}x (paired {r['vs'][p]['paired']:.3f}x)" for p in others)
        )
    return results, rows, verdicts


def single_device(args) -> tuple[int, dict]:
    """The one-device part: set-up, agreement check, timed rounds and the report; ``(status, its JSON)``."""
    import transformers

    device = select_device(args.device)
    precision = args.precision or DEFAULT_PRECISION[device.type]
    if device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, cpu_cores() // args.world))
    else:
        torch.set_float32_matmul_precision("highest")  # the check in true fp32
    b, t, d = args.batch, args.seq, args.d_model
    cfg = model_config(args)
    block = build_model(cfg, args.seed, device).layers["0"].train()
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(b, t, d, generator=g).to(device)
    dy = torch.randn(b, t, d, generator=g).to(device)
    steps = single_steps(args, cfg, block, x, dy, device)
    checks, ok = check_single(steps, args.tol)
    to_timed_precision(steps, DTYPES[precision])

    print(f"trickles MoE vs transformers {transformers.__version__} Mixtral, one device, forward + backward")
    print(
        f"  shape   B {b}, T {t} ({b * t} tokens), d {d}, F {args.ffn}, E {args.experts}, top-{args.top_k}, dropless, "
        f"{precision}"
        + ("" if args.no_block else f"; block: {args.heads} heads, {args.kv_heads} key/value heads, causal sdpa")
    )
    print(
        f"  ours    model.kernels={cfg.kernels}, "
        f"{'fused q/k/v projection (model.fused_proj)' if cfg.fuses_projections else 'separate q/k/v projections'}"
    )
    print(
        f"  device  {device.type}: {device_name(device)}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
        f"torch {torch.__version__}"
    )
    print(
        "\nagreement check (fp32): output, input gradient, weight gradients (largest over the parameters); relative "
        f"error ||a-b||/||b||, tolerance {args.tol:g}"
    )
    print(table(["pair", "out", "dx", "dW", ""], checks))
    if not ok:
        print(
            f"an implementation disagrees by more than --tol {args.tol:g}: the timings would be meaningless",
            file=sys.stderr,
        )
        return 1, {}

    by_name = {s.name: s for s in steps}
    times = interleaved(list(by_name), lambda n: by_name[n].step, args.steps, device, args.warmup)
    results, rows, verdicts = compare_single(times, b * t)
    print(
        f"\n{args.steps} timed rounds after {args.warmup} warm-up rounds, contestants interleaved; peer: the faster "
        "transformers experts implementation"
    )
    print(table(TIME_COLUMNS, rows))
    print("\ntarget ours/peer <= 1.0x:  " + ";  ".join(verdicts))
    sys.stdout.flush()
    out = {
        "shape": {
            "batch": b,
            "seq": t,
            "d_model": d,
            "ffn": args.ffn,
            "experts": args.experts,
            "top_k": args.top_k,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "precision": precision,
        },
        "ours": {"kernels": cfg.kernels, "fused_proj": cfg.fuses_projections},
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "checks": checks,
        "results": results,
    }
    return 0, out


# ---- expert parallel ------------------------------------------------------------------------


class SwiGLU(nn.Module):
    """DeepSpeed's expert: ``down(silu(gate x) * up x)``, the MLP of each of our experts."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_deepspeed(args, full, world: int, rank: int, device: torch.device):
    """DeepSpeed-MoE over ``world`` ranks holding ``full``'s weights; ``(module, version)`` or ``(None, why)``."""
    deepspeed, why = load_deepspeed(device)
    if deepspeed is None:
        return None, f"import failed ({why}); pip install deepspeed"
    try:
        from deepspeed.moe.layer import MoE as DSMoE

        ds = (
            DSMoE(
                hidden_size=args.d_model,
                expert=SwiGLU(args.d_model, args.ffn),
                num_experts=args.experts,
                ep_size=world,
                k=args.top_k,
                capacity_factor=1.0,
                eval_capacity_factor=1.0,
                min_capacity=0,
                noisy_gate_policy=None,
                drop_tokens=False,
                use_rts=False,
                top2_2nd_expert_sampling=False,
            )
            .to(device)
            .train()
        )
        ds.set_deepspeed_parallelism()
        el = args.experts // world
        with torch.no_grad():
            ds.deepspeed_moe.gate.wg.weight.copy_(full.router.weight)
            for j, ex in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(ex, name).weight.copy_(getattr(full.experts, name).weight[rank * el + j])
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return ds, f"deepspeed {deepspeed.__version__}"


class Layer(Contestant, LeafStep):
    """One MoE layer on this rank: its leaf ``x`` (this rank's tokens), ``fn(x) -> y``, backward from ``dy``."""

    def __init__(self, name: str, peer: str | None, module: nn.Module, fn, x, dy):
        super().__init__(name)
        self.peer = peer
        self._leaf(module, fn, x, dy)
        self.none = torch.zeros((), device=dy.device)

    def step(self, x=None, y=None) -> torch.Tensor:
        self.run()
        return self.none  # run_step reads a "loss"; the step has none


def expert_grads(c: Layer, name: str, el: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's experts' weight gradients ``[E_l, ...]`` under our names, whatever the implementation."""
    if name == DS_EP:
        exs = c.module.deepspeed_moe.experts.deepspeed_experts
        return {
            f"experts.{n}.weight": torch.stack([getattr(ex, n).weight.grad for ex in exs])
            for n in ("gate_proj", "up_proj", "down_proj")
        }
    grads = {
        f"experts.{n}.weight": getattr(c.module.experts, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")
    }
    if name == REF_EP:  # all experts: the slice this rank holds under ep (the sum over ranks is taken by the caller)
        return {n: g[rank * el : (rank + 1) * el] for n, g in grads.items()}
    return grads


def reference_grads(args, cfg: ModelConfig, full, x: torch.Tensor, dy: torch.Tensor, el: int, rank: int, device):
    """The expert-parallel check's reference on this rank's tokens: transformers' Mixtral block holding all experts
    (at top-1, where Mixtral's weight is 1 and ours and DeepSpeed's the raw probability: our layer with all experts);
    ``(leaf x, output, this rank's experts' weight gradients summed over the ranks)``."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    if args.top_k > 1:
        ref = MixtralSparseMoeBlock(hf_config(args, "eager")).to(device).train()
        load_hf_moe(ref, full)
    else:
        ref = build_model(cfg, args.seed, device).layers["0"].mlp.train()
    xr = x.detach().clone().requires_grad_()
    yr = ref(xr)
    yr.backward(dy)
    grads = hf_moe_grads(ref) if args.top_k > 1 else {n: p.grad for n, p in ref.named_parameters()}
    return xr, yr.detach(), summed_slice({n: g for n, g in grads.items() if n.startswith("experts.")}, el, rank)


def summed_slice(grads: dict[str, torch.Tensor], el: int, rank: int) -> dict[str, torch.Tensor]:
    """Gradients of all experts from this rank's tokens, summed over the ranks (an expert's gradient under ep: every
    rank's tokens routed to it), then this rank's ``el`` experts."""
    out = {}
    for n, g in grads.items():
        g = g.clone()
        dist.all_reduce(g)
        out[n] = g[rank * el : (rank + 1) * el]
    return out


def check_ep(
    contestants: list[Layer], reference, full, el: int, rank: int
) -> tuple[dict[str, list[float]], str | None]:
    """The agreement check (fp32): each contestant's output, input gradient and its experts' weight gradients against
    :func:`reference_grads`'; ``(errors, why DeepSpeed failed or None)``."""
    xr, yr, ref_ex = reference
    errors: dict[str, list[float]] = {}
    failure = None
    for c in contestants:
        try:
            y = c.run()
        except Exception as exc:  # noqa: BLE001 - a peer that fails here is dropped, with the reason
            if c.name != DS_EP:
                raise
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        ge = expert_grads(c, c.name, el, rank)
        if c.name == REF_EP:  # all experts, this rank's tokens only: sum over the ranks like the reference
            ge = summed_slice({n: getattr(full.experts, n.split(".")[1]).weight.grad for n in ge}, el, rank)
        errors[c.name] = [
            rel_error(y, yr),
            rel_error(c.x.grad, xr.grad),
            max(rel_error(ge[n], ref_ex[n]) for n in ref_ex),
        ]
    return errors, failure


def sent_in_one_step(contestants: list[Layer], topo, world: int, device: torch.device) -> dict[str, dict]:
    """Bytes each contestant sends from this rank in one untimed step: ours from the ``ep`` group's ledger,
    DeepSpeed's counted at its ``deepspeed.comm`` calls, the reference none."""
    sent: dict[str, dict] = {}
    for c in contestants:
        dist.barrier()
        if c.name == OURS_EP:
            topo.ledger.reset()
            c.run()
            snap = {k: v for k, v in topo.ledger.snapshot().items() if k.endswith("/ep")}
            sent[c.name] = {
                "sent": sum(v["wire_bytes"] for v in snap.values()),
                "ops": {k: {"calls": v["calls"], "wire_bytes": v["wire_bytes"]} for k, v in snap.items()},
            }
        elif c.name == DS_EP:
            with CountSent(world) as counter:
                c.run()
            sent[c.name] = {
                "sent": counter.sent,
                "ops": {k: {"calls": v[0], "wire_bytes": v[1]} for k, v in counter.ops.items()},
            }
        else:
            sent[c.name] = {"sent": 0, "ops": {}}
    sync(device)
    return sent


def routing_counts(full, x: torch.Tensor, dtype: torch.dtype, top_k: int) -> list[int]:
    """Assignments per expert of this rank's tokens, by the router's rule (for the formulas)."""
    with torch.no_grad():
        logits = full.router(x.to(dtype) if dtype != torch.float32 else x)
        _, experts, _, _ = route(logits.float(), top_k, 0.0)
        return torch.bincount(experts.flatten(), minlength=full.router.weight.shape[0]).cpu().tolist()


def rank_main(args) -> int:
    """The expert-parallel part on this rank: set-up, agreement check, bytes sent, timed rounds, report."""
    from trickles.parallel.expert import apply_expert_parallel

    device, rank, world = setup_rank(args)
    precision = args.precision or DEFAULT_PRECISION[device.type]
    dtype = DTYPES[precision]
    b, t, d, e_count = args.batch, args.seq, args.d_model, args.experts
    if world < 2 or e_count % world:
        if rank == 0:
            print(
                f"moe.py: the ep part needs --world >= 2 dividing --experts ({e_count}), got {world}", file=sys.stderr
            )
        return finish(2, device)
    el = e_count // world
    topo = ParallelDims(dp=world, ep=world).build(device)
    cfg = model_config(args)

    full = build_model(cfg, args.seed, device).layers["0"].mlp.train()  # every rank: all experts (the reference row)
    model = build_model(cfg, args.seed, device)
    apply_expert_parallel(model, topo.comm("ep"))
    ours = model.layers["0"].mlp.train()
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.experts, name).weight.copy_(getattr(full.experts, name).weight[rank * el : (rank + 1) * el])

    g = torch.Generator().manual_seed(args.seed)
    x_all = torch.randn(world * b, t, d, generator=g)
    dy_all = torch.randn(world * b, t, d, generator=g)
    x, dy = (z[rank * b : (rank + 1) * b].to(device) for z in (x_all, dy_all))
    del x_all, dy_all

    peers: dict[str, str] = {}
    ds, why = (
        (None, "left out (--no-deepspeed)") if args.no_deepspeed else make_deepspeed(args, full, world, rank, device)
    )
    whys = gather(None if ds is not None else why)
    if any(whys):
        ds, why = None, next(w for w in whys if w)
    peers[DS_EP] = f"ran ({why})" if ds is not None else f"did not run: {why}"

    contestants: list[Layer] = [
        Layer(OURS_EP, DS_EP if ds is not None else None, ours, ours, x, dy),
        Layer(REF_EP, None, full, full, x, dy),
    ]
    if ds is not None:
        contestants.append(Layer(DS_EP, None, ds, lambda x: ds(x)[0], x, dy))

    errors, failure = check_ep(contestants, reference_grads(args, cfg, full, x, dy, el, rank, device), full, el, rank)
    failure = next((f for f in gather(failure) if f), None)
    if failure:
        peers[DS_EP] = f"did not run: {failure}"
        contestants = [c for c in contestants if c.name != DS_EP]
        contestants[0].peer = None
        errors.pop(DS_EP, None)
    to_timed_precision(contestants, dtype)
    gc.collect()

    all_counts = gather(routing_counts(full, x, dtype, args.top_k))
    sent = sent_in_one_step(contestants, topo, world, device)
    time_rounds(contestants, None, None, args, device)
    everyone = gather({"times": {c.name: c.times for c in contestants}, "errors": errors, "sent": sent})
    status = report_ep(args, everyone, contestants, peers, all_counts, precision, device, world) if rank == 0 else 0
    del contestants, topo
    return finish(status, device)


def formulas(all_counts: list[list[int]], world: int, d: int, e: int) -> dict[str, list[float]]:
    """Bytes each rank sends per step: ours and DeepSpeed dropless (module docstring)."""
    n_exp = len(all_counts[0])
    el = n_exp // world
    ours, ds = [], []
    cap = max(max(c) for c in all_counts)
    for r in range(world):
        mine = range(r * el, (r + 1) * el)
        m_out = sum(c for i, c in enumerate(all_counts[r]) if i not in mine)
        m_in = sum(all_counts[s][i] for s in range(world) if s != r for i in mine)
        ours.append(2 * (m_out + m_in) * d * e + (world - 1) / world * n_exp * 8)
        ds.append(4 * (world - 1) / world * n_exp * cap * d * e + 2 * (world - 1) / world * 8)
    return {OURS_EP: ours, DS_EP: ds, REF_EP: [0.0] * world}


def report_ep(args, everyone, contestants, peers, all_counts, precision, device, world) -> int:
    b, t, d = args.batch, args.seq, args.d_model
    e = DTYPES[precision].itemsize
    names = [c.name for c in contestants]
    print(f"\ntrickles expert parallelism vs DeepSpeed-MoE, one MoE layer forward + backward, ep={world} (dp={world})")
    print(
        f"  shape   per rank B {b}, T {t} ({b * t} tokens), d {d}, F {args.ffn}, E {args.experts} "
        f"({args.experts // world} per rank), "
        f"top-{args.top_k}, dropless, {precision}"
    )
    print(device_line(device))
    for n, what in peers.items():
        print(f"  peer    {n}: {what}")
    el = args.experts // world
    loads = [sum(sum(c[r * el : (r + 1) * el]) for c in all_counts) for r in range(world)]
    print(
        f"  routing assignments per rank's experts (all ranks' tokens): {loads}; largest expert load on a rank "
        f"{max(max(c) for c in all_counts)} (mean {b * t * args.top_k // args.experts})"
    )

    what = (
        "transformers' MixtralSparseMoeBlock (eager)"
        if args.top_k > 1
        else "our single-device layer (Mixtral's top-1 weight is 1)"
    )
    print(
        "\nagreement check (fp32): output, input gradient, this rank's expert weight gradients (summed over the ranks) "
        f"vs {what} with all experts on this rank's tokens; largest over the ranks, tolerance {args.tol:g}"
    )
    rows, ok = [], True
    for n in names:
        errs = [max(r["errors"][n][i] for r in everyone) for i in range(3)]
        good = max(errs) <= args.tol
        ok &= good
        rows.append([n, *(f"{x:.1e}" for x in errs), "ok" if good else "MISMATCH"])
    print(table(["implementation", "out", "dx", "dW experts", ""], rows))
    if not ok:
        print(
            f"an implementation disagrees by more than --tol {args.tol:g}: the timings would be meaningless",
            file=sys.stderr,
        )
        return 1

    expect = formulas(all_counts, world, d, e)
    results, cells = compare_times(everyone, contestants, args.steps, b * t * world)
    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    rows = []
    for n in names:
        s = max(r["sent"][n]["sent"] for r in everyone)
        rows.append([*cells[n], mib(s), mib(max(expect[n]))])
        results[n]["sent"] = [r["sent"][n] for r in everyone]
        results[n]["formula"] = expect[n]
    times_table(
        args,
        rows,
        [*TIME_COLUMNS, "sent MiB", "formula MiB"],
        how="; tokens/s over all ranks; bytes per rank (largest over the ranks)",
        note=PAIRED_NOTE + "; sent: wire bytes (ours: CommLedger; DeepSpeed: its all_to_all_single and all_reduce "
        "calls); formula: the module docstring's",
    )
    for n in (OURS_EP, DS_EP):
        if n in names:
            ops = everyone[0]["sent"][n]["ops"]
            print(
                f"  {n} (rank 0): "
                + ", ".join(f"{k} x{v['calls']} {v['wire_bytes'] / 2**20:.2f} MiB" for k, v in ops.items())
            )
    r = results[OURS_EP]
    verdict = (
        f"{OURS_EP}/{r['peer']} {r['ratio']:.3f}x (paired {r['paired_ratio']:.3f}x): "
        f"{'met' if r['ratio'] <= 1.0 else 'NOT met'}"
        if r["peer"]
        else f"{OURS_EP}: no peer ran"
    )
    print("\ntarget ours/peer <= 1.0x:  " + verdict)
    if args.json:
        add_to_json(
            args.json,
            "ep",
            {
                "world": world,
                "device": str(device),
                "device_name": device_name(device),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "precision": precision,
                "peers": peers,
                "counts": all_counts,
                "errors": {n: everyone[0]["errors"][n] for n in names},
                "results": results,
            },
        )
    return 0


# ---- entry ---------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched and args.part == "single":
        print(
            "moe.py: --part single runs in one process; run it without torchrun (under torchrun only the ep part runs)",
            file=sys.stderr,
        )
        return 2
    if args.json and os.path.exists(args.json) and not launched:
        os.remove(args.json)
    if args.part in ("all", "single") and not launched and args.top_k == 1:
        print(
            "moe.py: no one-device comparison at --top-k 1: Mixtral renormalizes the top-k weights even for k = 1 "
            "(weight 1), ours keeps the raw probability there, as Switch does (DeepSpeed's top-1 gate too)",
            file=sys.stderr,
        )
        if args.part == "single":
            return 2
    elif args.part in ("all", "single") and not launched:
        status, out = single_device(args)
        if status:
            return status
        if args.json:
            add_to_json(args.json, "single", {"args": vars(args), **out})
        gc.collect()
    if args.part in ("all", "ep"):
        return run_main(args, rank_main)
    return 0


if __name__ == "__main__":
    sys.exit(main())
