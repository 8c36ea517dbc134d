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
    * Agreement first: the first two steps run on one fixed batch for every model and their
      losses are compared (step 1 checks the forward, step 2 the gradients and the AdamW
      update). The run stops if they differ by more than ``--tol`` (default 1e-4 in fp32, 1e-2
      in bf16 or with TF32). The largest logit difference before training is printed too.
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
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, rotations, si, summarize, table, timed  # noqa: E402

from trickles.memory.precision import autocast  # noqa: E402
from trickles.models.config import PRESETS, ModelConfig, apply_preset, resolve_model  # noqa: E402
from trickles.models.hf import save_hf  # noqa: E402
from trickles.models.transformer import Transformer, build_model, count_params  # noqa: E402
from trickles.optim.adamw import build_adamw  # noqa: E402
from trickles.train.flops import flops_per_token, peak_flops  # noqa: E402

LLAMA_PRESETS = [name for name, p in PRESETS.items() if p.get("flavor") == "llama"]
DEFAULTS = {"cpu": {"batch": 8, "seq": 256}, "cuda": {"batch": 4, "seq": 2048}}
OURS, HF, COMPILED = "trickles", "hf-llama", "trickles+compile"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="demo", choices=LLAMA_PRESETS, help="model shape (trickles.models.PRESETS)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size for presets that leave it to the tokenizer (demo, tiny)")
    p.add_argument("--batch", type=int, default=None, help=f"sequences per step (default: cpu {DEFAULTS['cpu']['batch']}, cuda {DEFAULTS['cuda']['batch']})")
    p.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default: cpu {DEFAULTS['cpu']['seq']}, cuda {DEFAULTS['cuda']['seq']})")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast with fp32 parameters")
    p.add_argument("--steps", type=int, default=30, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model after the two agreement-check steps")
    p.add_argument("--compile", action="store_true", help="also time our model with each block compiled (block.compile())")
    p.add_argument("--kernels", choices=["auto", "triton", "torch"], default="auto",
                   help="model.kernels for ours (auto: the Triton kernels and the fused loss on CUDA, eager PyTorch elsewhere)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                   help="fp32 matmuls on TF32 tensor cores on CUDA (peak_flops' fp32 peak assumes it)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (both models)")
    p.add_argument("--tol", type=float, default=None,
                   help="largest allowed loss difference in the agreement check (default: 1e-4 fp32, 1e-2 with bf16 or TF32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    return p.parse_args(argv)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (torch %s)" % torch.__version__)
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


def compiled_twin(ours: Transformer) -> Transformer:
    """A second module tree over the *same* parameters and buffers, with each block compiled."""
    memo = {id(t): t for t in list(ours.parameters()) + list(ours.buffers())}
    twin = copy.deepcopy(ours, memo)
    for block in twin.layers.values():
        block.compile()
    return twin


class Contestant:
    """One model, its optimizer and its training step."""

    def __init__(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hf: bool,
                 precision: str, device: torch.device):
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
            else:  # through the model's loss head: the fused loss where model.kernels runs Triton, else the same as HF's
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
    tol = args.tol if args.tol is not None else (1e-2 if args.precision == "bf16" or tf32 else 1e-4)

    cfg = resolve_model(dataclasses.replace(apply_preset(ModelConfig(), args.preset), kernels=args.kernels),
                        tokenizer_vocab=args.vocab, seq_len=seq)

    torch.manual_seed(args.seed)
    ours = build_model(cfg, seed=args.seed, device=device).train()
    hf = load_hf_twin(ours, device)
    adamw = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt_ours = build_adamw(ours, **adamw)
    contestants = [Contestant(OURS, ours, opt_ours, False, args.precision, device),
                   Contestant(HF, hf, build_adamw(hf, **adamw), True, args.precision, device)]
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
    print(f"  model   {args.preset}: {cfg.n_layers} layers, d={cfg.d_model}, heads={cfg.n_heads}/{cfg.kv_heads} kv, "
          f"ffn={cfg.ffn_dim}, vocab={cfg.vocab_size}, {n_params / 1e6:.1f}M params")
    print(f"  step    batch {batch} x seq {seq} = {tokens_per_step} tokens, {args.precision}"
          f"{' (TF32 matmuls)' if tf32 else ''}, AdamW {'fused' if device.type == 'cuda' else 'foreach'}, "
          f"{fpt * tokens_per_step / 1e9:.1f} GFLOP/step")
    print(f"  device  {device.type}: {dev_name}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}")

    # Agreement check: two steps on the fixed batch. The compiled row shares ours' parameters, so
    # it takes ours' second step (its forward then runs on the weights ours' first step made).
    names = [c.name for c in contestants]
    with torch.no_grad(), autocast(args.precision, device):
        a = contestants[0].logits(x[:1]).float()
        b = contestants[1].logits(x[:1]).float()
    logit_diff = ((a - b).abs().max() / b.abs().max()).item()
    del a, b
    check: dict[str, list[float]] = {}
    first = [OURS, HF]
    second = [COMPILED if args.compile else OURS, HF]
    for step, order in enumerate((first, second)):
        for name in order:
            check.setdefault(name, [None, None])[step] = by_name[name].run(x, y, record=False)
    loss_ours = [check[OURS][0], check[second[0]][1]]
    loss_hf = check[HF]
    diffs = [abs(a - b) for a, b in zip(loss_ours, loss_hf)]
    ok = all(d <= tol for d in diffs)
    print(f"\nagreement check (tolerance {tol:g}):")
    print(f"  step 1 loss  {OURS} {loss_ours[0]:.6f}  {HF} {loss_hf[0]:.6f}  |diff| {diffs[0]:.2e}")
    print(f"  step 2 loss  {second[0]} {loss_ours[1]:.6f}  {HF} {loss_hf[1]:.6f}  |diff| {diffs[1]:.2e}"
          f"  (after one AdamW update)")
    print(f"  logits of the first sequence before training: max |ours - HF| / max |HF| = {logit_diff:.2e}")
    print(f"  {'OK' if ok else 'MISMATCH'}")
    if not ok:
        print(f"the losses differ by more than --tol {tol:g}: the models do not compute the same thing and timings "
              "would be meaningless (if this is only kernel rounding, raise --tol)", file=sys.stderr)
        return 1

    for _, name in rotations(names, args.warmup):
        by_name[name].run(x, y, record=False)
    for _, name in rotations(names, args.steps):
        by_name[name].run(x, y, record=True)

    results = {}
    for c in contestants:
        s = summarize(c.times)
        flops = fpt * tokens_per_step / s["median"]
        paired = statistics.median(a / b for a, b in zip(c.times, by_name[HF].times))
        results[c.name] = {**s, "paired_ratio": paired, "tokens_per_s": tokens_per_step / s["median"], "flops_per_s": flops,
                           "mfu": flops / peak if peak else None, "last_loss": c.losses[-1],
                           "step_alloc_bytes": c.step_bytes if device.type == "cuda" else None, "times": c.times}
    base = results[HF]["median"]
    header = ["model", "median ms", "mean ms", "stdev ms", "tokens/s", "FLOP/s", "MFU", "vs HF", "paired"]
    if device.type == "cuda":
        header.insert(-2, "step GiB")
    rows = []
    for c in contestants:
        r = results[c.name]
        row = [c.name, f"{r['median'] * 1e3:.1f}", f"{r['mean'] * 1e3:.1f}", f"{r['stdev'] * 1e3:.1f}",
               f"{r['tokens_per_s']:,.0f}", si(r["flops_per_s"]), f"{r['mfu']:.1%}" if r["mfu"] else "-",
               f"{r['median'] / base:.3f}x", f"{r['paired_ratio']:.3f}x"]
        if device.type == "cuda":
            row.insert(-2, f"{r['step_alloc_bytes'] / 2**30:.2f}")
        rows.append(row)
    print(f"\n{args.steps} timed steps per model after {args.warmup} warm-up steps, interleaved:")
    print(table(header, rows))
    print("vs HF: ratio of median step times; paired: median over rounds of (this step time / HF's step time "
          "in the same round), the steadier of the two on a noisy machine")
    ratio = results[OURS]["median"] / base
    print(f"\nours/HF median step time: {ratio:.3f}x (paired {results[OURS]['paired_ratio']:.3f}x), "
          f"target <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'}")
    if args.compile:
        print(f"ours+compile/HF: {results[COMPILED]['median'] / base:.3f}x (paired {results[COMPILED]['paired_ratio']:.3f}x)")
    if device.type == "cuda":
        print(f"peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB "
              "(step GiB: allocated by one step above the resident parameters and optimizer states of all rows)")

    if args.json:
        out = {"args": vars(args), "batch": batch, "seq": seq, "device": str(device), "device_name": dev_name,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "transformers": __import__("transformers").__version__, "tf32": tf32,
               "model": {k: getattr(cfg, k) for k in ("n_layers", "d_model", "n_heads", "kv_heads", "ffn_dim", "vocab_size",
                                                       "max_seq_len")},
               "params": n_params, "flops_per_token": fpt, "peak_flops": peak,
               "check": {"tolerance": tol, "ours": loss_ours, "hf": loss_hf, "ok": ok, "logits_rel_diff": logit_diff},
               "results": results, "ratio_ours_hf": ratio,
               "ratio_compiled_hf": results[COMPILED]["median"] / base if args.compile else None}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
