"""Single-device training step: trickles' ``Transformer`` vs Hugging Face ``LlamaForCausalLM``.

What is compared
    One full training step of two models of the same llama shape, on the same device, batch
    and precision: our :class:`trickles.models.Transformer` (built with ``build_model``) and
    ``transformers``' ``LlamaForCausalLM`` with ``attn_implementation="sdpa"``. With
    ``--compile`` a third row times our model with every block compiled by ``block.compile()``
    (the trainer's ``train.compile``); it shares parameters, gradients and optimizer with the
    eager row, so it costs no extra parameter memory.

How
    * Same weights: ours is exported with ``save_hf`` and Hugging Face loads that directory, so
      the two start from identical fp32 parameters on the same device.
    * Same step: forward (``fp32``, or ``bf16`` autocast with fp32 parameters), cross-entropy
      over all positions from the logits cast to fp32 (``F.cross_entropy(logits.float(), y)``,
      as trickles' trainer does; Hugging Face's ``labels=`` path is not used), backward,
      ``torch.optim.AdamW`` built by ``build_adamw`` for both (foreach on CPU, fused on CUDA, the
      same hyper-parameters and decay groups), ``zero_grad(set_to_none=True)``. Hugging Face
      runs with ``use_cache=False`` (no KV cache is built in training).
    * Agreement first, in two parts; the run stops if either fails.
      (1) The logits of the first sequence before training, both models in fp32 with TF32 off
      whatever ``--precision``: ``||ours - HF|| / ||HF||`` at most ``--logits-tol`` (1e-4). Two
      correct implementations differ here by reduction order only (0 on a CPU, where both run
      the same kernels); each wrong model of ``--break`` by 2.1e-2 or more, so this part is what
      stops a wrong model.
      (2) The first two training steps on one fixed batch, in the run's precision (step 1 checks
      the forward, step 2 the gradients and the AdamW update): ``|loss ours - loss HF|`` at most
      ``--tol`` times HF's loss. The default is one rounding of the loss in the precision the
      steps compute in: fp32 1e-5, TF32 matmuls (CUDA fp32) ``2^-10``, bf16 ``2^-8`` (3.9e-3;
      bf16 keeps 8 significant bits). It lets rounding through -- Adam's first update is about
      ``lr * sign(g)`` per weight, so every gradient element whose sign rounding flips moves
      by ``2 lr`` and step 2 amplifies the rounding of a deep bf16 model (llama-1b on one GPU:
      1.9e-2 of a loss near 11.8, 0.41 of the bound) -- and stops what is grossly wrong. In
      bf16 it cannot tell a subtle error from rounding: at random initialization a wrong rotary
      changes the loss by less than bf16 rounding does (16 layers on a CPU: 7.6e-5 against a
      correct model's 2.7e-4; benchmarks/README.md has the table), which is why (1) runs in fp32.
      ``--break`` damages transformers' twin on purpose (a weight transposed, a norm skipped,
      no or wrong rotary, gate and up swapped) to show the check stopping it.
    * Timing: ``--warmup`` untimed steps, then ``--steps`` timed steps per model, alternating
      models step by step (the order rotates each round) so machine noise hits all alike. On
      CUDA the device is synchronized before and after each step. Reported: median and mean
      step time, the paired ratio (median over rounds of this row's time / HF's time in the
      same round, steadier than the ratio of medians on a noisy machine), tokens/s, achieved
      model FLOP/s (``flops_per_token``, the 6N + 12LdT convention), MFU where ``peak_flops``
      knows the device (CUDA), and on CUDA the memory a step allocates above what is resident.
    * CUDA: fp32 matmuls use TF32 unless ``--no-tf32`` (``peak_flops``' fp32 peak is the TF32
      one). Memory: both models' fp32 parameters and AdamW states stay resident (12 bytes per
      parameter each, gradients are freed by ``zero_grad``), plus one step's activations; for
      llama-1b about 30 GiB plus the step (estimated under 70 GiB in all at batch 4 x 2048, bf16).

Target
    ours/HF median step time <= 1.0x (eager). The compiled row should be below 1.0x.

Examples::

    python benchmarks/single_device.py                       # CPU: demo shape, vocab 4096, fp32
    python benchmarks/single_device.py --compile --precision bf16
    python benchmarks/single_device.py --preset llama-125m --precision bf16 --compile   # CUDA: MFU
    python benchmarks/single_device.py --preset llama-1b --precision bf16 --batch 4 --seq 2048
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, paired, rotations, si, summarize, table, timed, write_json  # noqa: E402

from trickles.memory.precision import autocast  # noqa: E402
from trickles.models.config import ModelConfig, resolve_model  # noqa: E402
from trickles.models.hf import save_hf  # noqa: E402
from trickles.models.presets import PRESETS, apply_preset  # noqa: E402
from trickles.models.transformer import Transformer, build_model, count_params  # noqa: E402
from trickles.optim.adamw import build_adamw  # noqa: E402
from trickles.train.flops import flops_per_token, peak_flops  # noqa: E402

LLAMA_PRESETS = [name for name, p in PRESETS.items() if p.get("flavor") == "llama"]
DEFAULTS = {"cpu": {"batch": 8, "seq": 256}, "cuda": {"batch": 4, "seq": 2048}}
OURS, HF, COMPILED = "trickles", "hf-llama", "trickles+compile"
#: ``--tol`` by the precision the check's steps compute in: one rounding of the loss (unit roundoff ``2^-p``, ``p``
#: significant bits: bf16 8, TF32 11); fp32 stays strict, a few orders above its own ``2^-24``
LOSS_TOL = {"fp32": 1e-5, "tf32": 2.0**-10, "bf16": 2.0**-8}
LOGITS_TOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="demo", choices=LLAMA_PRESETS, help="model shape (trickles.models.PRESETS)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    p.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="vocabulary size for presets that leave it to the tokenizer (demo, tiny)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"sequences per step (default: cpu {DEFAULTS['cpu']['batch']}, cuda {DEFAULTS['cuda']['batch']})",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"tokens per sequence (default: cpu {DEFAULTS['cpu']['seq']}, cuda {DEFAULTS['cuda']['seq']})",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast with fp32 parameters")
    p.add_argument("--steps", type=int, default=30, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model after the two agreement-check steps")
    p.add_argument(
        "--compile", action="store_true", help="also time our model with each block compiled (block.compile())"
    )
    p.add_argument(
        "--kernels",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="model.kernels for ours (auto: the Triton kernels and the fused loss on CUDA, eager PyTorch elsewhere)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp32 matmuls on TF32 tensor cores on CUDA (peak_flops' fp32 peak assumes it)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (both models)")
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="largest allowed |loss ours - loss HF| / loss HF in the agreement check's two training steps "
        "(default: one rounding of the loss in the precision the steps run in: fp32 1e-5, TF32 2^-10, "
        "bf16 2^-8 = 3.9e-3; bf16 keeps 8 significant bits. A correct llama-1b differed by 1.9e-2 of a "
        "loss near 11.8, 1.6e-3, in bf16 on a GPU; what stops a wrong model is the fp32 logits check, "
        "--logits-tol)",
    )
    p.add_argument(
        "--logits-tol",
        type=float,
        default=LOGITS_TOL,
        help="largest allowed ||ours - HF|| / ||HF|| of the first sequence's logits before training, both in "
        "fp32 with TF32 off (correct: reduction order only, 0 on a CPU; the --break models measured "
        "2.1e-2 and more)",
    )
    p.add_argument(
        "--break",
        dest="break_",
        choices=list(BREAKS),
        default="none",
        help="damage transformers' twin on purpose, to see the agreement check stop the run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    return p.parse_args(argv)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: no CUDA device is available (torch {torch.__version__})")
    return torch.device(name)


# ---- models --------------------------------------------------------------------------------


def load_hf_twin(ours: Transformer, device: torch.device) -> torch.nn.Module:
    """``LlamaForCausalLM`` (sdpa attention) holding exactly ``ours``' weights, fp32, on ``device``."""
    import transformers
    from transformers import LlamaForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="trickles-bench-") as tmp:
        save_hf(ours, os.path.join(tmp, "model"), dtype=torch.float32)
        hf = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "model"), attn_implementation="sdpa")
    hf = hf.to(device=device, dtype=torch.float32)
    hf.train()
    impl = getattr(hf.config, "_attn_implementation", "sdpa")
    if impl != "sdpa":
        raise SystemExit(f"transformers chose attention implementation {impl!r}, not 'sdpa'")
    return hf


def _transpose_o_proj(hf) -> None:
    w = hf.model.layers[0].self_attn.o_proj.weight
    w.data = w.data.t().contiguous()


def _skip_first_norm(hf) -> None:
    hf.model.layers[0].input_layernorm.forward = lambda x: x


def _scale_rotary(factor: float):
    def damage(hf) -> None:
        hf.model.rotary_emb.inv_freq.mul_(factor)

    return damage


def _swap_gate_up(hf) -> None:
    mlp = hf.model.layers[0].mlp
    mlp.gate_proj.weight.data, mlp.up_proj.weight.data = (
        mlp.up_proj.weight.data.clone(),
        mlp.gate_proj.weight.data.clone(),
    )


#: ``--break``: ways to make transformers' twin compute something else (each touches the first block or the rotary)
BREAKS = {
    "none": None,
    "o-proj-transposed": _transpose_o_proj,
    "no-attn-norm": _skip_first_norm,
    "no-rotary": _scale_rotary(0.0),
    "rotary-x2": _scale_rotary(2.0),
    "gate-up-swapped": _swap_gate_up,
}


def compiled_twin(ours: Transformer) -> Transformer:
    """A second module tree over the *same* parameters and buffers, with each block compiled."""
    memo = {id(t): t for t in list(ours.parameters()) + list(ours.buffers())}
    twin = copy.deepcopy(ours, memo)
    for block in twin.layers.values():
        block.compile()
    return twin


class Contestant:
    """One model, its optimizer and its training step."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        hf: bool,
        precision: str,
        device: torch.device,
    ):
        self.name, self.model, self.optimizer, self.hf = name, model, optimizer, hf
        self.precision, self.device = precision, device
        self.times: list[float] = []
        self.step_bytes = 0
        self.losses: list[float] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.hf:
            return self.model(input_ids=x, use_cache=False).logits
        return self.model(x)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, self.device):
            if self.hf:
                loss = F.cross_entropy(self.logits(x).float().flatten(0, 1), y.flatten())
            else:  # through the model's loss head: the fused loss where model.kernels runs Triton, else HF's
                loss = self.model(x, target=y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def run(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> float:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        seconds, loss = timed(lambda: self.step(x, y), self.device)
        if cuda:
            self.step_bytes = max(self.step_bytes, torch.cuda.max_memory_allocated(self.device) - resident)
        value = loss.item()
        self.losses.append(value)
        if record:
            self.times.append(seconds)
        return value


def logits_error(ours: Contestant, hf: Contestant, x: torch.Tensor, precision: str, device: torch.device) -> float:
    """``||ours - HF|| / ||HF||`` of the logits of ``x`` without gradients, in ``precision``; fp32 with TF32 off (the
    matmul precision restored afterwards), so that only the two implementations' reduction orders differ."""
    before = torch.get_float32_matmul_precision()
    if precision == "fp32":
        torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad(), autocast(precision, device):
            a, b = ours.logits(x).float(), hf.logits(x).float()
            return ((a - b).norm() / b.norm()).item()
    finally:
        torch.set_float32_matmul_precision(before)


def agreement(
    by_name: dict[str, Contestant],
    x: torch.Tensor,
    y: torch.Tensor,
    args,
    tol: float,
    steps_in: str,
    device: torch.device,
) -> dict:
    """The agreement check (module docstring), printed; its numbers and ``ok``. Two steps on the fixed batch; the
    compiled row shares ours' parameters, so it takes ours' second step (its forward then runs on the weights ours'
    first step made)."""
    ours, hf = by_name[OURS], by_name[HF]
    logit_diff = logits_error(ours, hf, x[:1], args.precision, device)
    logit_fp32 = logits_error(ours, hf, x[:1], "fp32", device)
    second = COMPILED if COMPILED in by_name else OURS
    losses: dict[str, list] = {}
    for step, order in enumerate(([OURS, HF], [second, HF])):
        for name in order:
            losses.setdefault(name, [None, None])[step] = by_name[name].run(x, y, record=False)
    loss_ours, loss_hf = [losses[OURS][0], losses[second][1]], losses[HF]
    diffs = [abs(a - b) / abs(b) for a, b in zip(loss_ours, loss_hf)]
    logits_ok, losses_ok = logit_fp32 <= args.logits_tol, all(d <= tol for d in diffs)
    ok = logits_ok and losses_ok
    print(
        f"\nagreement check{f' (transformers twin broken on purpose: {args.break_})' if args.break_ != 'none' else ''}:"
    )
    print(
        f"  logits of the first sequence before training, ||ours - HF|| / ||HF||: fp32 {logit_fp32:.2e} "
        f"(tolerance {args.logits_tol:g}){f', {args.precision} {logit_diff:.2e}' if args.precision != 'fp32' else ''}"
    )
    print(f"  step 1 loss  {OURS} {loss_ours[0]:.6f}  {HF} {loss_hf[0]:.6f}  |diff|/loss {diffs[0]:.2e}")
    print(
        f"  step 2 loss  {second} {loss_ours[1]:.6f}  {HF} {loss_hf[1]:.6f}  |diff|/loss {diffs[1]:.2e}"
        f"  (after one AdamW update; tolerance {tol:.2g}, {steps_in})"
    )
    print(f"  {'OK' if ok else 'MISMATCH'}")
    if not ok:
        what = ([f"the fp32 logits differ by more than --logits-tol {args.logits_tol:g}"] if not logits_ok else []) + (
            [f"the losses differ by more than --tol {tol:.2g} of the loss"] if not losses_ok else []
        )
        print(
            f"{' and '.join(what)}: the models do not compute the same thing and timings would be meaningless",
            file=sys.stderr,
        )
    return {
        "loss_tolerance_rel": tol,
        "steps_in": steps_in,
        "ours": loss_ours,
        "hf": loss_hf,
        "loss_rel_diff": diffs,
        "ok": ok,
        "logits_rel_diff": logit_diff,
        "logits_fp32_rel_diff": logit_fp32,
        "logits_tolerance": args.logits_tol,
        "break": args.break_,
    }


# ---- main ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    batch = args.batch or DEFAULTS[device.type]["batch"]
    seq = args.seq or DEFAULTS[device.type]["seq"]
    if args.threads:
        torch.set_num_threads(args.threads)
    tf32 = device.type == "cuda" and args.tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    steps_in = "bf16" if args.precision == "bf16" else ("tf32" if tf32 else "fp32")
    tol = args.tol if args.tol is not None else LOSS_TOL[steps_in]

    shape = apply_preset(ModelConfig(), args.preset)
    cfg = resolve_model(
        dataclasses.replace(shape, kernels=args.kernels, n_layers=args.layers or shape.n_layers),
        tokenizer_vocab=args.vocab,
        seq_len=seq,
    )

    torch.manual_seed(args.seed)
    ours = build_model(cfg, seed=args.seed, device=device).train()
    hf = load_hf_twin(ours, device)
    if BREAKS[args.break_] is not None:
        with torch.no_grad():
            BREAKS[args.break_](hf)
    adamw = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt_ours = build_adamw(ours, **adamw)
    contestants = [
        Contestant(OURS, ours, opt_ours, False, args.precision, device),
        Contestant(HF, hf, build_adamw(hf, **adamw), True, args.precision, device),
    ]
    if args.compile:
        contestants.append(Contestant(COMPILED, compiled_twin(ours), opt_ours, False, args.precision, device))
    by_name = {c.name: c for c in contestants}

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    tokens_per_step = batch * seq
    fpt = flops_per_token(cfg, seq)
    peak = peak_flops(device, args.precision)
    dev_name = device_name(device)
    n_params = count_params(ours)
    print("trickles vs transformers.LlamaForCausalLM (sdpa), one training step each, same weights")
    print(
        f"  model   {args.preset}: {cfg.n_layers} layers, d={cfg.d_model}, heads={cfg.n_heads}/{cfg.kv_heads} kv, "
        f"ffn={cfg.ffn_dim}, vocab={cfg.vocab_size}, {n_params / 1e6:.1f}M params"
    )
    print(
        f"  step    batch {batch} x seq {seq} = {tokens_per_step} tokens, {args.precision}"
        f"{' (TF32 matmuls)' if tf32 else ''}, AdamW {'fused' if device.type == 'cuda' else 'foreach'}, "
        f"{fpt * tokens_per_step / 1e9:.1f} GFLOP/step"
    )
    print(
        f"  device  {device.type}: {dev_name}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}"
    )

    names = [c.name for c in contestants]
    check = agreement(by_name, x, y, args, tol, steps_in, device)
    info = {
        "args": vars(args),
        "batch": batch,
        "seq": seq,
        "device": str(device),
        "device_name": dev_name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tf32": tf32,
        "model": {
            k: getattr(cfg, k)
            for k in ("n_layers", "d_model", "n_heads", "kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "kernels")
        },
        "fused_proj": cfg.fuses_projections,
        "params": n_params,
        "flops_per_token": fpt,
        "peak_flops": peak,
    }
    if not check["ok"]:
        write_json(args.json, {**info, "check": check, "results": None})
        return 1

    for _, name in rotations(names, args.warmup):
        by_name[name].run(x, y, record=False)
    for _, name in rotations(names, args.steps):
        by_name[name].run(x, y, record=True)

    results = {}
    for c in contestants:
        s = summarize(c.times)
        flops = fpt * tokens_per_step / s["median"]
        results[c.name] = {
            **s,
            "paired_ratio": paired(c.times, by_name[HF].times),
            "tokens_per_s": tokens_per_step / s["median"],
            "flops_per_s": flops,
            "mfu": flops / peak if peak else None,
            "last_loss": c.losses[-1],
            "step_alloc_bytes": c.step_bytes if device.type == "cuda" else None,
            "times": c.times,
        }
    base = results[HF]["median"]
    header = ["model", "median ms", "mean ms", "stdev ms", "tokens/s", "FLOP/s", "MFU", "vs HF", "paired"]
    if device.type == "cuda":
        header.insert(-2, "step GiB")
    rows = []
    for c in contestants:
        r = results[c.name]
        row = [
            c.name,
            f"{r['median'] * 1e3:.1f}",
            f"{r['mean'] * 1e3:.1f}",
            f"{r['stdev'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            si(r["flops_per_s"]),
            f"{r['mfu']:.1%}" if r["mfu"] else "-",
            f"{r['median'] / base:.3f}x",
            f"{r['paired_ratio']:.3f}x",
        ]
        if device.type == "cuda":
            row.insert(-2, f"{r['step_alloc_bytes'] / 2**30:.2f}")
        rows.append(row)
    print(f"\n{args.steps} timed steps per model after {args.warmup} warm-up steps, interleaved:")
    print(table(header, rows))
    print(
        "vs HF: ratio of median step times; paired: median over rounds of (this step time / HF's step time "
        "in the same round), the steadier of the two on a noisy machine"
    )
    ratio = results[OURS]["median"] / base
    print(
        f"\nours/HF median step time: {ratio:.3f}x (paired {results[OURS]['paired_ratio']:.3f}x), "
        f"target <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'}"
    )
    if args.compile:
        print(
            f"ours+compile/HF: {results[COMPILED]['median'] / base:.3f}x "
            f"(paired {results[COMPILED]['paired_ratio']:.3f}x)"
        )
    if device.type == "cuda":
        print(
            f"peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB "
            "(step GiB: allocated by one step above the resident parameters and optimizer states of all rows)"
        )

    write_json(
        args.json,
        {
            **info,
            "check": check,
            "results": results,
            "ratio_ours_hf": ratio,
            "ratio_compiled_hf": results[COMPILED]["median"] / base if args.compile else None,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
