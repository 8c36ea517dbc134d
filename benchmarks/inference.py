"""Decoding speed: trickles' ``generate`` against ``transformers``' ``generate``, resident and streamed.

What is compared
    (a) **Resident**: our :func:`trickles.models.generate.generate` on the model loaded with
        ``load_for_inference`` against ``LlamaForCausalLM.generate`` (sdpa, KV cache) with the same
        weights (ours exported with ``save_hf``), on the same device. Target: ours/HF time <= 1.0x.
    (b) **A model twice the budget**: our layer streaming (``load_streaming`` with a budget of half
        the model's bytes: the blocks that do not fit stream through two reusable buffers,
        docs/inference-streaming.md) against ``accelerate``'s offloading of the same Hugging Face
        checkpoint (``from_pretrained(device_map="auto", max_memory=...)``: on CPU ``{"cpu": budget}``,
        the rest offloaded to disk; on CUDA ``{0: budget, "cpu": ...}``, the rest in host memory).
        Target: ours >= 3x accelerate's tokens/s. ``accelerate`` is optional: without it (b) times
        ours alone and says so.

How
    * One model, built from the shape options with a random init (``build_model``), saved as a
      trickles checkpoint (``save_for_inference``) and as a Hugging Face directory (``save_hf``) in a
      temporary directory; every contestant loads from those files.
    * Agreement first: every contestant decodes the same prompt greedily; the streamed tokens must
      equal the resident ones exactly (the run stops otherwise), and the number of leading tokens
      the Hugging Face models share with ours is printed.
    * Timing: ``--rounds`` rounds after ``--warmup``, each contestant generating ``--new-tokens``
      tokens greedily (no early stop) from a ``--prompt-len`` prompt, contestants interleaved
      with a rotating order. A generation's time includes its prefill (short next to the decode
      at the defaults). Reported: median and mean seconds per generation, tokens/s
      (new tokens / median time) and the paired ratio (median over rounds of the per-round ratio).
    * ``--memory`` (CPU): each contestant is loaded again in a fresh process that generates once
      while a thread samples ``RssAnon`` every millisecond; the peak above the process's baseline
      (imports, and a tiny model built on the meta device) is printed. The budget of (b) is what
      the streamed contestants were asked to hold, plus their KV cache.

Examples::

    python benchmarks/inference.py                                  # CPU: 8 x 512 llama, vocab 4096 (151 MB fp32)
    python benchmarks/inference.py --rounds 10 --new-tokens 64 --json out/inference.json
    python benchmarks/inference.py --layers 24 --d-model 1024 --ffn 4096 --vocab 32000 --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, interleaved, paired, summarize, table, write_json  # noqa: E402

from trickles.data.tokenizers import ByteTokenizer  # noqa: E402
from trickles.infer.streaming import load_streaming, save_for_inference  # noqa: E402
from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.generate import generate  # noqa: E402
from trickles.models.hf import save_hf  # noqa: E402
from trickles.models.presets import apply_preset  # noqa: E402
from trickles.models.transformer import build_model, count_params  # noqa: E402
from trickles.train.trainer import load_for_inference  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048, help="MLP hidden width")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="timed generations per contestant")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per contestant after the agreement check")
    p.add_argument(
        "--budget-fraction", type=float, default=0.5, help="(b): the device budget as a fraction of the model's bytes"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-accelerate", action="store_true", help="leave accelerate's offloading out of (b)")
    p.add_argument(
        "--memory",
        action="store_true",
        help="CPU: also measure each contestant's peak anonymous memory (RssAnon) in a fresh process",
    )
    p.add_argument(
        "--measure-one", nargs=4, default=None, metavar=("NAME", "CKPT", "HF", "BUDGET"), help=argparse.SUPPRESS
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    return p.parse_args(argv)


class HFGenerate:
    """``model.generate`` greedy, exactly ``n`` new tokens (no end-of-text stop)."""

    def __init__(self, model):
        self.model = model
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0

    def __call__(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            out = self.model.generate(
                prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt)
            )
        return out[:, prompt.shape[1] :]


def ours(model):
    return lambda prompt, n: generate(model, prompt, n, temperature=0)


def load_accelerate(hf_dir: str, budget: int, device: torch.device, offload_dir: str):
    """accelerate's offloaded model, or ``(None, why)`` where accelerate does not import."""
    try:
        import accelerate  # noqa: F401
    except ImportError as e:
        return None, f"accelerate is not installed ({e}); pip install accelerate to compare against its offloading"
    from transformers import AutoModelForCausalLM

    max_memory = {0: budget, "cpu": 64 << 30} if device.type == "cuda" else {"cpu": budget}
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir,
        device_map="auto",
        max_memory=max_memory,
        offload_folder=offload_dir,
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    dmap = getattr(model, "hf_device_map", {})
    # what it loads at every forward: the modules placed off the execution device
    offloaded = [
        m for m, where in dmap.items() if where in ("disk", "cpu") and not (device.type == "cpu" and where == "cpu")
    ]
    moved = sum(p.numel() * 4 for m in offloaded for p in model.get_submodule(m).parameters(recurse=True))
    return model, (
        f"accelerate {accelerate.__version__}: device_map={dmap}; loads {moved / 1e6:.1f} MB of offloaded "
        f"weights ({', '.join(offloaded)}) at every forward"
    )


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def measure_one(args) -> int:
    """In a fresh process: load one contestant and generate, printing the peak RssAnon above the baseline as JSON.

    The baseline is read after the imports (TorchDynamo's too: torch imports it on first use of some meta-device
    functions) and after building a tiny model on the meta device (its first build imports the kernels' modules); a
    thread samples ``/proc/self/status`` every millisecond from then on. Memory-mapped checkpoint pages are
    file-backed, not anonymous.
    """
    import threading

    name, ckpt_dir, hf_dir, budget = args.measure_one
    budget = int(budget)
    import torch._dynamo  # noqa: F401  (what torch imports on first use of the meta functions loading reaches)

    with torch.device("meta"):
        from trickles.models.transformer import Transformer

        Transformer(dataclasses.replace(apply_preset(ModelConfig(), "tiny"), vocab_size=256, max_seq_len=8))
    device = torch.device("cpu")
    base = peak = rss_anon()
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.wait(0.001):
            peak = max(peak, rss_anon())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    if name == "ours resident":
        fn = ours(load_for_inference(ckpt_dir, device)[0])
    elif name == "ours streamed":
        model = load_streaming(ckpt_dir, device, budget, batch=1, max_len=args.prompt_len + args.new_tokens + 8)[0]
        fn = ours(model)
    elif name == "accelerate offload":
        fn = HFGenerate(load_accelerate(hf_dir, budget, device, tempfile.mkdtemp(prefix="trickles-offload-"))[0].eval())
    else:
        from transformers import AutoModelForCausalLM

        fn = HFGenerate(
            AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        )
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed + 1))
    fn(prompt, args.new_tokens)
    stop.set()
    thread.join()
    print(json.dumps({"peak_above_baseline": max(peak, rss_anon()) - base}))
    return 0


def measure_memory(args, names, ckpt_dir, hf_dir, budget) -> dict[str, int]:
    import subprocess

    out = {}
    for name in names:
        argv = [sys.executable, os.path.abspath(__file__), "--measure-one", name, ckpt_dir, hf_dir, str(budget)] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k in ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "prompt_len", "new_tokens", "seed")
        ]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(f"memory of {name}: the measuring process failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])["peak_above_baseline"]
    return out


def leading_match(a: torch.Tensor, b: torch.Tensor) -> int:
    same = (a.cpu() == b.cpu()).all(dim=0).tolist()
    return same.index(False) if False in same else len(same)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_one:
        return measure_one(args)
    with tempfile.TemporaryDirectory(
        prefix="trickles-inference-"
    ) as work:  # the checkpoints (GBs at GPU sizes) go with it
        return compare(args, work)


def compare(args, work: str) -> int:
    """Builds and saves the model under ``work``, checks the contestants agree, times them and prints the table."""
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), "tiny"),
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=args.prompt_len + args.new_tokens + 8,
    )
    model = build_model(cfg, args.seed)
    n_params = count_params(model)
    model_bytes = n_params * 4
    ckpt_dir = save_for_inference(model, ByteTokenizer(), os.path.join(work, "ckpt"))
    hf_dir = str(save_hf(model, os.path.join(work, "hf")))
    del model
    budget = int(model_bytes * args.budget_fraction)
    print(
        f"device {device_name(device)} ({device.type}), threads {torch.get_num_threads()}; "
        f"llama {args.layers} x {args.d_model}, ffn {args.ffn}, vocab {args.vocab}: {n_params / 1e6:.1f}M parameters, "
        f"{model_bytes / 1e6:.1f} MB fp32; "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, batch 1"
    )

    from transformers import AutoModelForCausalLM

    contestants = {}
    resident, _, _ = load_for_inference(ckpt_dir, device)
    contestants["ours resident"] = ours(resident)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    contestants["HF generate"] = HFGenerate(hf)
    streamed, _, _ = load_streaming(ckpt_dir, device, budget, batch=1, max_len=cfg.max_seq_len)
    st = streamed.streamer
    per_token = sum(st.layouts[i].nbytes for i in st.order) if st is not None else 0
    print(
        f"(b) budget {budget / 1e6:.1f} MB = {args.budget_fraction:g} x the model; "
        f"ours: {streamed.placement.summary()}; copies {per_token / 1e6:.1f} MB of streamed blocks at every forward"
    )
    contestants["ours streamed"] = ours(streamed)
    note = "accelerate left out (--no-accelerate)"
    if not args.no_accelerate:
        acc, note = load_accelerate(hf_dir, budget, device, os.path.join(work, "offload"))
        if acc is not None:
            contestants["accelerate offload"] = HFGenerate(acc.eval())
    print(f"(b) peer: {note}")

    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=g).to(device)
    outs = {name: fn(prompt, args.new_tokens) for name, fn in contestants.items()}
    if not torch.equal(outs["ours streamed"], outs["ours resident"]):
        print("the streamed model's tokens differ from the resident model's: stopping", file=sys.stderr)
        return 1
    print(
        f"agreement: ours streamed == ours resident ({args.new_tokens} tokens, exact); leading tokens equal to ours: "
        + ", ".join(
            f"{n} {leading_match(o, outs['ours resident'])}/{args.new_tokens}"
            for n, o in outs.items()
            if n.startswith(("HF", "acc"))
        )
    )

    names = list(contestants)
    times = interleaved(
        names, lambda n: lambda: contestants[n](prompt, args.new_tokens), args.rounds, device, args.warmup
    )
    peers = {
        "ours resident": "HF generate",
        "HF generate": None,
        "ours streamed": "accelerate offload",
        "accelerate offload": None,
    }
    rows, results = [], {}
    for n in names:
        s = summarize(times[n])
        peer = peers[n] if peers[n] in times else None
        ratio = (
            f"{s['median'] / statistics.median(times[peer]):.3f}x ({paired(times[n], times[peer]):.3f}x)"
            if peer
            else "-"
        )
        rows.append(
            [n, f"{s['median'] * 1e3:.1f}", f"{s['mean'] * 1e3:.1f}", f"{args.new_tokens / s['median']:.1f}", ratio]
        )
        results[n] = {**s, "tokens_per_s": args.new_tokens / s["median"]}
    header = ["contestant", "median ms", "mean ms", "tokens/s", "time vs peer (paired)"]
    if args.memory and device.type == "cpu":
        del resident, hf, streamed, contestants
        mem = measure_memory(args, names, ckpt_dir, hf_dir, budget)
        header.append("peak anon MB")
        for row, n in zip(rows, names):
            row.append(f"{mem[n] / 1e6:.1f}" if n in mem else "-")
            results[n]["peak_anon_bytes"] = mem.get(n)
    print(table(header, rows))
    if "accelerate offload" in times:
        speedup = statistics.median(times["accelerate offload"]) / statistics.median(times["ours streamed"])
        resident = statistics.median(times["ours resident"]) / statistics.median(times["HF generate"])
        print(
            f"(a) ours/HF time {resident:.3f}x (target <= 1.0x); (b) ours streamed tokens/s = {speedup:.2f}x "
            "accelerate's (target >= 3x)"
        )
    write_json(
        args.json,
        {"args": vars(args), "device": str(device), "params": n_params, "budget_bytes": budget, "results": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
