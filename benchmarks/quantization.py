"""int8 inference: decode speed and held-out loss of our int8 against fp32, bf16 and torchao's int8 weight-only.

One float model (``--checkpoint``, or the demo model trained here for ``--train-steps``), in this process, as

* ``fp32`` and ``bf16`` (the float model, and a bf16 copy of it),
* ``int8-weight`` and ``int8-full``: ``trickles compress quantize`` of its checkpoint (one scale per row) loaded with
  ``trickles.load_checkpoint(int8="weight" | "full")`` -- weight-only (codes widened in the matmul) and true int8
  (activations per token, ``torch._int_mm``, one rescale);
* ``int8-tensor``: the same with one scale per matrix (weight-only), for the granularity's loss;
* ``torchao-int8``: ``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`` of the same float model (the
  same linears: every projection and the untied output head), skipped with a message when torchao is absent.

The held-out loss is the trainer's (``train.eval_batches`` batches of the run's held-out data); decode speed is
greedy generation of ``--new-tokens`` tokens after a ``--prompt-tokens`` prompt with the KV cache, batch
``--batch``, the contestants interleaved round by round (``_timing.interleaved``) after one warm-up each. Prints the
table and writes ``--out``/quantization.json.

    python benchmarks/quantization.py                          # CPU: trains the demo model 150 steps first (minutes)
    python benchmarks/quantization.py --checkpoint runs/demo   # an existing run
    python benchmarks/quantization.py --speed-preset llama-125m --threads 1   # decode speed of an untrained wider model
    python benchmarks/quantization.py --speed-preset llama-1b --device cuda --rounds 3   # the same on a GPU
    python benchmarks/quantization.py --train-steps 2 --set model.preset=tiny --eval-batches 1 --rounds 1  # smoke run

On CUDA (``--device cuda``, with ``--speed-preset``) true int8 runs ``torch._int_mm`` on the GPU (one decoded token is
one row: padded to 17, the fewest it takes there; ``trickles.compress.quantize.int_mm_path``); every step is timed
with the device synchronized (``_timing.timed``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _timing import device_name, interleaved, table, write_json  # noqa: E402

from trickles.compress import float_model, load_checkpoint, quantize_checkpoint  # noqa: E402
from trickles.compress.report import validation_loss  # noqa: E402
from trickles.models.generate import generate  # noqa: E402
from trickles.train import checkpoint as ckpt  # noqa: E402


def train_demo(args) -> str:
    from trickles.config import Config
    from trickles.topology import ParallelDims
    from trickles.train.trainer import Trainer

    cfg = Config.load(
        None,
        [
            f"train.steps={args.train_steps}",
            f"data.seq_len={args.seq_len}",
            f"train.out_dir={args.out}/run",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "train.plot=false",
            "train.warmup_steps=10",
            *args.set,
        ],
    )
    tr = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=False)
    start = time.perf_counter()
    tr.fit()
    print(f"[bench] trained the demo model {args.train_steps} steps in {time.perf_counter() - start:.0f} s")
    return ckpt.find_latest(os.path.join(args.out, "run", "checkpoints"))


def torchao_model(model):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        print(f"[bench] torchao is not installed ({e}); pip install torchao to compare with its int8 weight-only")
        return None
    m = copy.deepcopy(model)
    quantize_(m, Int8WeightOnlyConfig())
    return m


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="a float checkpoint or run (default: train the demo model here)")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=128, help="sequence length of the model trained here")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="extra setting of the model trained here (e.g. model.preset=tiny, data.max_bytes=120000)",
    )
    p.add_argument("--out", default="runs/bench-quant")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's; 1 is steadier on a shared machine)"
    )
    p.add_argument(
        "--eval-batches", type=int, default=None, help="held-out batches (default: the run's train.eval_batches)"
    )
    p.add_argument(
        "--speed-preset",
        default=None,
        metavar="PRESET",
        help="decode speed only, of an untrained model of this preset (e.g. llama-125m), quantized in memory",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the models decode; cuda needs --speed-preset (the held-out loss path trains and loads on the CPU)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not args.speed_preset:
        p.error("--device cuda measures decode speed only: add --speed-preset PRESET")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    if args.speed_preset:
        return speed_only(args)
    path = ckpt.resolve(args.checkpoint) if args.checkpoint else train_demo(args)
    int8_dirs = {g: os.path.join(args.out, f"int8-{g}") for g in ("row", "tensor")}
    for g, d in int8_dirs.items():
        if os.path.exists(d):
            import shutil

            shutil.rmtree(d)
        quantize_checkpoint(path, d, granularity=g)
    base, tok, meta = load_checkpoint(path)
    models = {"fp32": base, "bf16": copy.deepcopy(base).to(torch.bfloat16)}
    models["int8-weight"] = load_checkpoint(int8_dirs["row"], int8="weight")[0]
    models["int8-full"] = load_checkpoint(int8_dirs["row"], int8="full")[0]
    models["int8-tensor"] = load_checkpoint(int8_dirs["tensor"], int8="weight")[0]
    ao = torchao_model(float_model(path))
    if ao is not None:
        models["torchao-int8"] = ao

    losses = {n: validation_loss(m, meta, tok, args.eval_batches) for n, m in models.items()}
    report(models, losses, args, path)


def speed_only(args) -> None:
    """The contestants built in memory from an untrained ``--speed-preset`` model (no held-out loss)."""
    from trickles.compress import quantize_model
    from trickles.models.config import ModelConfig, resolve_model
    from trickles.models.presets import apply_preset
    from trickles.models.transformer import build_model

    cfg = resolve_model(apply_preset(ModelConfig(), args.speed_preset), 32000, args.prompt_tokens + args.new_tokens)
    base = build_model(cfg, seed=0, device=args.device).eval()
    models = {"fp32": base, "bf16": copy.deepcopy(base).to(torch.bfloat16)}
    for name, g, mode in (("int8-weight", "row", "weight"), ("int8-full", "row", "full")):
        models[name] = copy.deepcopy(base)
        quantize_model(models[name], g, mode)
    ao = torchao_model(base) if args.device == "cpu" else None  # its int8 weight-only path is the CPU peer here
    if ao is not None:
        models["torchao-int8"] = ao
    report(models, {n: None for n in models}, args, f"untrained {args.speed_preset} (vocab {cfg.vocab_size})")


def report(models, losses, args, path) -> None:
    device = next(models["fp32"].parameters()).device
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, models["fp32"].cfg.vocab_size, (args.batch, args.prompt_tokens), generator=g).to(device)
    outputs = {}
    with torch.no_grad():
        for name, m in models.items():  # warm-up, and the greedy tokens
            outputs[name] = generate(m, prompt, args.new_tokens, temperature=0.0)
        times = interleaved(
            list(models),
            lambda n: lambda: generate(models[n], prompt, args.new_tokens, temperature=0.0),
            args.rounds,
            device,
        )
    tokens = args.batch * args.new_tokens
    rows, out = [], {}
    ref_loss = losses["fp32"]

    def loss_cells(name):
        if losses[name] is None:
            return ["-", "-"]
        return [f"{losses[name]:.4f}", f"{100 * (losses[name] - ref_loss) / ref_loss:+.3f}%"]

    ao_speed = tokens / statistics.median(times["torchao-int8"]) if "torchao-int8" in times else None
    bf16_speed = tokens / statistics.median(times["bf16"])
    for name in models:
        speed = tokens / statistics.median(times[name])
        same = float((outputs[name] == outputs["fp32"]).float().mean())
        rows.append(
            [
                name,
                f"{speed:.1f}",
                f"{speed / ao_speed:.2f}x" if ao_speed else "-",
                f"{speed / bf16_speed:.2f}x",
                *loss_cells(name),
                f"{100 * same:.0f}%",
            ]
        )
        out[name] = {
            "tokens_per_s": speed,
            "times": times[name],
            "val_loss": losses[name],
            "greedy_agreement": same,
            "speed_vs_bf16": speed / bf16_speed,
        }
    print(
        f"\n[bench] decode {args.new_tokens} tokens after {args.prompt_tokens}, batch {args.batch}, "
        f"{args.rounds} rounds, {torch.get_num_threads()} threads, {device.type}: {device_name(device)}; model {path}"
    )
    print(table(["model", "tokens/s", "vs torchao", "vs bf16", "val loss", "vs fp32", "greedy = fp32"], rows))
    write_json(
        os.path.join(args.out, "quantization.json"),
        {"args": vars(args), "model": path, "device": str(device), "device_name": device_name(device), "results": out},
    )


if __name__ == "__main__":
    main()
