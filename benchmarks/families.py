"""Model families against transformers: a Qwen3-0.6B-shaped training step, and importing a 1B-shaped directory.

What is compared
    step: one training step (forward, backward, AdamW step, ``zero_grad(set_to_none=True)``) of the ``qwen3-0.6b``
    preset (28 layers, d 1024, 16 query / 8 key-value heads of 128, per-head q/k RMSNorm, SwiGLU 3072, vocabulary
    151936 tied to the output; ``--layers``, ``--seq``, ``--vocab`` shrink it) with random weights: our
    :class:`trickles.models.Transformer` against ``transformers``' own ``Qwen3ForCausalLM`` (sdpa attention) built
    from the same config. Ours is built by ``build_model``, written by ``save_hf`` and read back by transformers, so
    both start from identical weights. Same batch, same AdamW (``build_adamw``), same precision: ``fp32``, or
    ``bf16`` (parameters, gradients and AdamW states in bf16 on both sides: the full model in fp32 with two AdamW
    copies would not fit a 24 GiB machine). Ours computes its loss through its loss head (``model(x, target=y)``:
    on a CPU the fp32 logits' ``F.cross_entropy``), transformers' the same ``F.cross_entropy`` of its fp32 logits.
    Agreement first, as ``single_device.py``: the first sequence's logits in fp32 before training within
    ``--logits-tol`` (1e-4), then two training steps' losses within one rounding of the loss in the run's precision
    (fp32 1e-5, bf16 ``2^-8``); the run stops if either fails.

    import: reading a llama3.2-1b-shaped directory (16 layers, d 2048, 32/8 heads, SwiGLU 8192, vocabulary 128256
    tied, llama3 rope scaling; ``--import-layers`` shrinks it) of random bf16 weights, written once by transformers'
    ``save_pretrained`` with ``max_shard_size`` (so it is sharded, with a ``model.safetensors.index.json``):
    ``trickles.load_hf(DIR, dtype=bfloat16)`` against ``AutoModelForCausalLM.from_pretrained(DIR,
    dtype=bfloat16)``. A contestant's clock stops when its model is ready with every weight in memory: after the
    load, one byte of every 4 KiB page of every parameter is read (both sides map the files' pages instead of
    copying them, so the pages are only faulted in when first read). One untimed load of each comes first, so the
    page cache is warm for both (the files were just written, too); then the weights of the two models are checked
    equal.

How
    Contestants alternate step by step (the order rotating every round, ``_timing.rotations``); the ratio is the
    paired one: the median over rounds of ours / transformers' in the same round. On a CPU, ``--threads`` threads
    (default 1, so that the times do not depend on the core count).

Targets
    step: ours/transformers <= 0.95x; import: ours/transformers <= 1.0x.

Examples::

    python benchmarks/families.py                                  # both parts at full size (minutes on a CPU)
    python benchmarks/families.py --layers 4 --seq 128 --import-layers 4
    python benchmarks/families.py --precision fp32 --layers 2 --import-layers 0   # the step only
    python benchmarks/families.py --layers 0 --dir /tmp/llama1b    # the import only, its directory kept there
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, paired, rotations, summarize, table, write_json  # noqa: E402

from trickles.models.config import ModelConfig, resolve_model  # noqa: E402
from trickles.models.families import weight_map  # noqa: E402
from trickles.models.hf import load_hf, save_hf  # noqa: E402
from trickles.models.presets import apply_preset  # noqa: E402
from trickles.models.transformer import build_model, count_params  # noqa: E402
from trickles.optim.adamw import build_adamw  # noqa: E402

OURS, HF = "trickles", "transformers"
LOSS_TOL = {"fp32": 1e-5, "bf16": 2.0**-8}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PAGE = 4096


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--layers", type=int, default=28, help="blocks of the Qwen3-0.6B shape (0: no step part)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary of the step part (default: Qwen3's 151936)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence of the step part")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--precision", choices=sorted(DTYPES), default="bf16", help="the step's parameters and states")
    p.add_argument("--steps", type=int, default=4, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model after the agreement check")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--logits-tol", type=float, default=1e-4, help="largest ||ours - HF|| / ||HF|| of fp32 logits")
    p.add_argument("--import-layers", type=int, default=16, help="blocks of the llama3.2-1b shape (0: no import part)")
    p.add_argument("--import-vocab", type=int, default=128256, help="vocabulary of the imported directory")
    p.add_argument("--shard-size", default="500MB", help="save_pretrained's max_shard_size")
    p.add_argument("--rounds", type=int, default=4, help="timed loads per contestant")
    p.add_argument("--dir", default=None, help="the import directory, written there unless it holds one (kept)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    return p.parse_args(argv)


def quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


# ---- step ----------------------------------------------------------------------------------


def qwen3_pair(args, tmp: str):
    """Our Qwen3-0.6B-shaped model and transformers' ``Qwen3ForCausalLM`` holding the same fp32 weights."""
    transformers = quiet_transformers()
    shape = apply_preset(ModelConfig(), "qwen3-0.6b")
    shape = dataclasses.replace(shape, n_layers=args.layers, vocab_size=args.vocab or shape.vocab_size)
    cfg = resolve_model(shape, tokenizer_vocab=2, seq_len=args.seq)
    ours = build_model(cfg, seed=args.seed).train()
    save_hf(ours, os.path.join(tmp, "qwen3"), dtype=torch.float32)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(
        os.path.join(tmp, "qwen3"), attn_implementation="sdpa", dtype=torch.float32
    ).train()
    if hf.config._attn_implementation != "sdpa":
        raise SystemExit(f"transformers chose attention {hf.config._attn_implementation!r}, not 'sdpa'")
    return cfg, ours, hf


class Stepper:
    """One model, its AdamW and its training step; the step's loss is read back (``.item()``) inside the clock."""

    def __init__(self, name: str, model, lr: float):
        self.name, self.model, self.hf = name, model, name == HF
        self.optimizer = build_adamw(model, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
        self.times: list[float] = []

    def logits(self, x):
        return self.model(input_ids=x, use_cache=False).logits if self.hf else self.model(x)

    def step(self, x, y) -> float:
        if self.hf:
            loss = F.cross_entropy(self.logits(x).float().flatten(0, 1), y.flatten())
        else:
            loss = self.model(x, target=y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def run_step(args, tmp: str) -> dict:
    cfg, ours, hf = qwen3_pair(args, tmp)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        a, b = ours(x[:1]).float(), hf(input_ids=x[:1], use_cache=False).logits.float()
        logits_diff = float((a - b).norm() / b.norm())
    del a, b
    dtype = DTYPES[args.precision]
    inv_freq = hf.model.rotary_emb.inv_freq.clone()
    ours.to(dtype)
    hf.to(dtype)
    hf.model.rotary_emb.inv_freq = inv_freq  # transformers keeps its rotary frequencies in fp32 (as ours its tables)
    gc.collect()
    steppers = {OURS: Stepper(OURS, ours, args.lr), HF: Stepper(HF, hf, args.lr)}
    losses = {n: [s.step(x, y) for _ in range(2)] for n, s in steppers.items()}
    diffs = [abs(o - h) / abs(h) for o, h in zip(losses[OURS], losses[HF])]
    tol = LOSS_TOL[args.precision]
    ok = logits_diff <= args.logits_tol and all(d <= tol for d in diffs)
    print(
        f"\nstep: qwen3-0.6b shape, {cfg.n_layers} layers, d={cfg.d_model}, heads={cfg.n_heads}/{cfg.kv_heads} of "
        f"{cfg.head_dim}, ffn={cfg.ffn_dim}, vocab={cfg.vocab_size} (tied), {count_params(ours) / 1e6:.1f}M params; "
        f"batch {args.batch} x seq {args.seq}, {args.precision}, AdamW foreach"
    )
    print(
        f"  agreement: fp32 logits ||ours - HF|| / ||HF|| {logits_diff:.2e} (tolerance {args.logits_tol:g}); "
        f"losses {losses[OURS][0]:.6f}/{losses[HF][0]:.6f}, after one update {losses[OURS][1]:.6f}/"
        f"{losses[HF][1]:.6f}, |diff|/loss {max(diffs):.1e} (tolerance {tol:.2g}): {'OK' if ok else 'MISMATCH'}"
    )
    check = {"logits_fp32_rel_diff": logits_diff, "losses": losses, "loss_rel_diff": diffs, "ok": ok}
    if not ok:
        print("the models do not compute the same thing: timings would be meaningless", file=sys.stderr)
        return {"check": check, "results": None}
    for r, name in rotations(list(steppers), args.warmup + args.steps):
        start = time.perf_counter()
        steppers[name].step(x, y)
        if r >= args.warmup:
            steppers[name].times.append(time.perf_counter() - start)
    results = {n: {**summarize(s.times), "times": s.times} for n, s in steppers.items()}
    ratio = paired(steppers[OURS].times, steppers[HF].times)
    rows = [[n, f"{r['median']:.3f}", f"{r['mean']:.3f}", f"{r['min']:.3f}"] for n, r in results.items()]
    print(table(["model", "median s", "mean s", "min s"], rows))
    print(
        f"ours/transformers step time (paired): {ratio:.3f}x, target <= 0.95x: {'met' if ratio <= 0.95 else 'NOT met'}"
    )
    return {
        "check": check,
        "results": results,
        "ratio": ratio,
        "model": {k: getattr(cfg, k) for k in ("n_layers", "d_model", "n_heads", "kv_heads", "ffn_dim", "vocab_size")},
    }


# ---- import --------------------------------------------------------------------------------


def write_llama_dir(args, path: str) -> None:
    """A llama3.2-1b-shaped directory of random bf16 weights, saved by transformers in shards with an index."""
    transformers = quiet_transformers()
    config = transformers.LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=args.import_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=args.import_vocab,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=g) * 0.02)
    model.tie_weights()
    model.save_pretrained(path, max_shard_size=args.shard_size)


def touched(model) -> int:
    """Reads one byte of every page of every parameter (faulting in memory-mapped weights); their sum."""
    total = 0
    for p in model.parameters():
        total += int(p.detach().reshape(-1).view(torch.uint8)[::PAGE].sum())
    return total


def same_weights(ours, hf) -> bool:
    """Every Hugging Face tensor ``weight_map`` names equals our parameter(s) it holds."""
    mine, theirs = ours.state_dict(), hf.state_dict()
    return all(torch.equal(mine[e.ours[0]], theirs[e.hf]) for e in weight_map(ours.cfg))


def run_import(args, path: str) -> dict:
    transformers = quiet_transformers()
    if not os.path.isfile(os.path.join(path, "config.json")):
        start = time.perf_counter()
        write_llama_dir(args, path)
        print(f"\nwrote {path} in {time.perf_counter() - start:.0f} s")
    files = sorted(os.listdir(path))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    loads = {
        OURS: lambda: load_hf(path, dtype=torch.bfloat16),
        HF: lambda: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
    }
    warm = {name: load() for name, load in loads.items()}  # untimed: the page cache warm for both
    equal = same_weights(warm[OURS], warm[HF])
    touched(warm[OURS]), touched(warm[HF])
    cfg = warm[OURS].cfg
    del warm
    gc.collect()
    print(
        f"\nimport: llama3.2-1b shape, {cfg.n_layers} layers, vocab {cfg.vocab_size}, bf16, "
        f"{size / 2**30:.2f} GiB in {sum(f.endswith('.safetensors') for f in files)} file(s)"
        f"{' + index' if 'model.safetensors.index.json' in files else ''}; "
        f"page cache warm (one untimed load of each first); weights equal: {equal}"
    )
    if not equal:
        print("the imported weights differ: timings would be meaningless", file=sys.stderr)
        return {"weights_equal": False, "results": None}
    times: dict[str, list[float]] = {n: [] for n in loads}
    for _, name in rotations(list(loads), args.rounds):
        start = time.perf_counter()
        model = loads[name]()
        touched(model)
        times[name].append(time.perf_counter() - start)
        del model
        gc.collect()
    results = {n: {**summarize(t), "times": t} for n, t in times.items()}
    ratio = paired(times[OURS], times[HF])
    rows = [[n, f"{r['median']:.3f}", f"{r['min']:.3f}", f"{r['max']:.3f}"] for n, r in results.items()]
    print(table(["load + touch", "median s", "min s", "max s"], rows))
    print(
        f"ours/transformers import time (paired): {ratio:.3f}x, target <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'}"
    )
    return {"weights_equal": True, "bytes": size, "files": files, "results": results, "ratio": ratio}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers = quiet_transformers()
    print(
        f"trickles vs transformers {transformers.__version__} (torch {torch.__version__}), CPU "
        f"{device_name(torch.device('cpu'))}, {args.threads} thread(s), {os.cpu_count()} cores"
    )
    doc: dict = {"args": vars(args), "transformers": transformers.__version__, "torch": torch.__version__}
    ok = True
    with tempfile.TemporaryDirectory(prefix="trickles-families-") as tmp:
        if args.layers:
            doc["step"] = run_step(args, tmp)
            ok &= doc["step"]["results"] is not None
            gc.collect()
        if args.import_layers:
            path = args.dir or os.path.join(tmp, "llama")
            os.makedirs(path, exist_ok=True)
            doc["import"] = run_import(args, path)
            ok &= doc["import"]["results"] is not None
            if args.dir is None:
                shutil.rmtree(path, ignore_errors=True)
    write_json(args.json, doc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
