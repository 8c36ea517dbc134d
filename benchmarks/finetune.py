"""Fine-tuning steps against transformers: a LoRA step against transformers + peft, a full-parameter SFT step against
transformers' own.

What is compared
    One training step of a llama-shaped model (``--layers``, ``--d-model``, ``--heads``, ``--kv-heads``, ``--ffn``,
    ``--vocab``; default 8 layers, d 512, 8/4 heads, SwiGLU 1408, vocabulary 32000 untied: 58M parameters) on a
    chat-style batch: ``--batch`` sequences of ``--seq`` random tokens cut into turns, a prompt of 24-96 tokens then a
    reply of 16-64, and so on; only the replies' tokens take the loss (the targets of prompt positions are ``-100``),
    about 42% of them by default. The model's weights are random, written once by transformers' ``save_pretrained``
    (fp32 safetensors) into a temporary directory that both contestants read.

    lora: our LoRA step, built the way ``trickles train`` builds it with ``train.init_from=DIR`` and
    ``train.lora_rank``: the model on the meta device, :func:`~trickles.adapters.apply_lora` on ``--targets``
    (default every attention and MLP projection), :func:`~trickles.parallel.plan.parallelize` on one process with the
    base weights read from ``DIR`` (``init_source``, the trainer's reader of a Hugging Face directory), and the
    trainer's step: ``engine.zero_grad()``, forward and backward in ``engine.micro_step``, ``finish_backward``,
    ``clip_grad_norm(--grad-clip)``, ``engine.step(lr)``. Against ``peft.get_peft_model(
    LlamaForCausalLM.from_pretrained(DIR, attn_implementation="sdpa"), LoraConfig(r, lora_alpha, lora_dropout=0,
    target_modules))`` with our starting ``lora_A`` copied in (``B`` is zero on both sides), its loss from its own
    ``labels=`` path, ``torch.nn.utils.clip_grad_norm_`` over the adapters, torch AdamW (``build_adamw``: multi-tensor,
    the same decay groups, hyper-parameters and learning rate) and ``zero_grad(set_to_none=True)``.

    sft: the same with every parameter trained (``train.lora_rank=0``) against ``LlamaForCausalLM`` alone with the same
    clipping and AdamW.

    Both in fp32 (the precision both train in on a CPU without autocast; bf16 would differ in what each keeps in
    fp32). Each contestant's loss is read back (``.item()``) inside its clock, after its optimizer step, so its clock
    stops only once everything its step started has finished (on a CPU nothing runs after it returns).

Agreement first
    Before any timing, each part's two models run three training steps on the timed batch: the losses (step 1 the
    base model, steps 2 and 3 after one and two updates, which check the gradients, the clipping and AdamW) agree
    within ``--tol`` (1e-5 of the loss, fp32). The run stops (exit status 1) otherwise.

Timing
    ``--warmup`` untimed then ``--steps`` timed steps per contestant, alternating step by step with the order rotating
    every round (``_timing.rotations``), so machine noise falls on both alike; ``--repeats`` such runs, one after the
    other, each reported. The ratio is reported as the ratio of medians and as the paired ratio (the median over
    rounds of ours / peer in the same round); the verdict uses the paired ratio of each repeat and their median. On a
    CPU, ``--threads`` threads (default 1: the times do not depend on the core count).

Memory (lora, and sft where ``--memory`` asks)
    Each contestant in a fresh process of its own (``--measure-one``, transformers and peft imported in both): it
    builds its model and optimizer, reads one byte of every page of every weight (transformers leaves its weights
    mapped from the files, to be read in at first use), collects garbage and returns free heap to the system
    (``malloc_trim``), reads its resident set (``VmRSS``) as the baseline, resets the kernel's high-water mark (``echo
    5 > /proc/self/clear_refs``), runs ``--memory-steps`` training steps and reads the high-water mark (``VmHWM``): the
    step peak is ``VmHWM - baseline``, what the steps needed above the built model (activations, gradients, optimizer
    states, temporaries), recorded by the kernel rather than sampled. The resident set after the imports, after the
    build and at the peak are reported beside it.

Targets
    lora: ours/peft step time <= 0.9x and step peak memory <= 1.0x; sft: ours/transformers step time <= 0.95x.

Examples::

    python benchmarks/finetune.py                                   # both parts, 3 repeats (6 min on an idle CPU)
    python benchmarks/finetune.py --part lora --repeats 1 --memory both
    python benchmarks/finetune.py --layers 1 --d-model 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 512 --seq 64 \\
        --steps 1 --warmup 0 --memory-steps 1                      # tiny: the agreement checks and one round
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, paired, rotations, summarize, table, write_json  # noqa: E402

from trickles.adapters.lora import DEFAULT_TARGETS, apply_lora  # noqa: E402
from trickles.adapters.peft import peft_tensors  # noqa: E402
from trickles.config import Config  # noqa: E402
from trickles.memory.precision import autocast  # noqa: E402
from trickles.models.config import resolve_model  # noqa: E402
from trickles.models.transformer import Transformer, count_params  # noqa: E402
from trickles.optim.adamw import build_adamw  # noqa: E402
from trickles.parallel.plan import parallelize  # noqa: E402
from trickles.train.trainer_state import init_source  # noqa: E402

OURS = "trickles"
PEERS = {"lora": "peft", "sft": "transformers"}
TARGETS = {"lora": 0.9, "sft": 0.95}
IGNORE = -100
BETAS, EPS = (0.9, 0.95), 1e-8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--part", choices=["lora", "sft", "both"], default="both")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--rank", type=int, default=16, help="train.lora_rank / LoraConfig.r")
    p.add_argument("--alpha", type=float, default=32.0, help="train.lora_alpha / LoraConfig.lora_alpha")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated target projections")
    p.add_argument("--lr", type=float, default=1e-3, help="constant learning rate (lora); sft uses a tenth of it")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient norm clipped to this (0: none)")
    p.add_argument("--tol", type=float, default=1e-5, help="largest |loss ours - loss peer| / loss peer")
    p.add_argument("--steps", type=int, default=6, help="timed steps per contestant and repeat")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contestant and repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed runs, one after the other")
    p.add_argument("--memory", choices=["lora", "both", "none"], default="lora", help="parts whose peak is measured")
    p.add_argument("--memory-steps", type=int, default=2, help="steps of each memory measurement")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="the model directory (written there unless it holds one; kept)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--measure-one", nargs=2, metavar=("PART", "NAME"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


# ---- the model directory and the batch -----------------------------------------------------


def write_model_dir(args, path: str) -> None:
    """A llama-shaped model of random fp32 weights (transformers' own initialization), saved by transformers."""
    transformers = quiet_transformers()
    config = transformers.LlamaConfig(
        hidden_size=args.d_model,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.seq),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def chat_batch(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [B, T], labels [B, T], targets [B, T])``: random tokens in turns (a prompt of 24-96 tokens, a reply
    of 16-64, ...); ``labels`` are the tokens of replies and ``-100`` elsewhere (transformers' ``labels=``, which
    predicts ``labels[t + 1]`` at position ``t``), ``targets`` the same shifted left by one with ``-100`` last (our
    ``target=``): both count the same predictions."""
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    trained = torch.zeros(args.batch, args.seq, dtype=torch.bool)
    for b in range(args.batch):
        t, reply = 0, False
        while t < args.seq:
            lo, hi = (16, 64) if reply else (24, 96)
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            trained[b, t : t + n] = reply
            t, reply = t + n, not reply
    labels = tokens.masked_fill(~trained, IGNORE)
    targets = torch.cat([labels[:, 1:], torch.full((args.batch, 1), IGNORE)], dim=1)
    return tokens, labels, targets


# ---- the contestants -----------------------------------------------------------------------


def lr_of(args, part: str) -> float:
    return args.lr if part == "lora" else args.lr / 10


class Ours:
    """Our model and engine as ``trickles train`` builds them from ``train.init_from=DIR`` (``train.lora_rank``: the
    adapters), and the trainer's step."""

    def __init__(self, args, part: str, path: str, seq: int):
        cfg = Config()
        t = cfg.train
        t.init_from, t.seed, t.lr, t.weight_decay, t.grad_clip = (
            path,
            args.seed,
            lr_of(args, part),
            args.weight_decay,
            0,
        )
        t.beta1, t.beta2, t.eps = *BETAS, EPS
        t.global_batch = t.micro_batch = args.batch
        if part == "lora":
            t.lora_rank, t.lora_alpha, t.lora_dropout = args.rank, args.alpha, 0.0
            t.lora_targets = args.targets.split(",")
        cfg.data.seq_len = seq
        dims = cfg.validate(1)  # train.init_from: the directory's shape
        self.topo = dims.build(torch.device("cpu"))
        self.cfg, self.lr, self.clip = cfg, t.lr, args.grad_clip
        self.model_cfg = resolve_model(cfg.model, cfg.model.vocab_size, seq)
        with torch.device("meta"):
            model = Transformer(self.model_cfg)
        init = init_source(path, model)
        self.lora = t.lora()
        if self.lora is not None:
            apply_lora(model, self.lora)
        self.engine = parallelize(model, self.topo, cfg, t.seed, init=init)
        self.model = self.engine.model.train()

    def step(self, tokens, labels, targets) -> float:
        e = self.engine
        e.zero_grad()
        with e.micro_step(last=True):
            with autocast(self.cfg.memory.precision, self.topo.device):
                loss = self.model(tokens, target=targets)
            loss.backward()
        e.finish_backward()
        if self.clip:
            e.clip_grad_norm(self.clip)
        e.step(self.lr)
        return loss.item()


class Peer:
    """transformers' ``LlamaForCausalLM`` (sdpa) read from DIR, with peft's LoRA (part ``lora``) or alone (``sft``),
    its loss from its own ``labels=`` path, clipping and torch AdamW."""

    def __init__(self, args, part: str, path: str, ours_adapters: dict[str, torch.Tensor] | None):
        transformers = quiet_transformers()
        model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
        if model.config._attn_implementation != "sdpa":
            raise SystemExit(f"transformers chose attention {model.config._attn_implementation!r}, not 'sdpa'")
        if part == "lora":
            import peft

            config = peft.LoraConfig(
                r=args.rank,
                lora_alpha=args.alpha,
                lora_dropout=0.0,
                target_modules=args.targets.split(","),
                bias="none",
                task_type="CAUSAL_LM",
            )
            model = peft.get_peft_model(model, config)
            if ours_adapters is not None:  # our starting adapters (B is zero on both sides; A random)
                state = dict(model.named_parameters())
                with torch.no_grad():
                    for name, value in ours_adapters.items():
                        state[
                            name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
                                ".lora_B.weight", ".lora_B.default.weight"
                            )
                        ].copy_(value)
        self.model = model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_adamw(model, lr=lr_of(args, part), weight_decay=args.weight_decay, betas=BETAS, eps=EPS)
        self.clip = args.grad_clip

    def step(self, tokens, labels, targets) -> float:
        loss = self.model(input_ids=tokens, labels=labels, use_cache=False).loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def build(args, part: str, name: str, path: str):
    """The contestant ``name`` of ``part`` (the peer's adapters start at ours': built from the same seed)."""
    if name == OURS:
        return Ours(args, part, path, args.seq)
    return Peer(args, part, path, starting_adapters(args, path) if part == "lora" else None)


def starting_adapters(args, path: str) -> dict[str, torch.Tensor]:
    """Our adapters' starting values under PEFT's names (built on a tiny copy: only the adapters are read)."""
    ours = Ours(args, "lora", path, args.seq)
    tensors, *_ = peft_tensors(ours.model, ours.lora)
    out = {k: v.detach().clone() for k, v in tensors.items()}
    del ours
    gc.collect()
    return out


# ---- memory --------------------------------------------------------------------------------


def status(key: str) -> int:
    """``/proc/self/status``'s ``key`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def touch(model) -> int:
    """Reads one byte of every 4 KiB page of every parameter and buffer, so that weights transformers left mapped from
    the files are resident before the baseline is read (the steps would fault them in, and count them, otherwise)."""
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        flat = t.detach().reshape(-1)
        if flat.numel():
            total += int(flat.view(torch.uint8)[::4096].sum()) if flat.dtype != torch.bool else 0
    return total


def measure_one(args, part: str, name: str) -> int:
    """In a fresh process: build one contestant, then the high-water mark of its steps above the built model."""
    tokens, labels, targets = chat_batch(args)
    with tempfile.TemporaryDirectory(prefix="trickles-finetune-mem-") as scratch:
        path = args.dir or os.path.join(scratch, "model")
        quiet_transformers()  # (both contestants import transformers and peft: the first column compares alike)
        import peft  # noqa: F401

        imported = status("VmRSS")
        adapters = starting_adapters(args, path) if part == "lora" and name != OURS else None
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        imported = min(imported, status("VmRSS"))
        contestant = Ours(args, part, path, args.seq) if name == OURS else Peer(args, part, path, adapters)
        del adapters
        touch(contestant.model)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        built = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        losses = [contestant.step(tokens, labels, targets) for _ in range(args.memory_steps)]
        peak = status("VmHWM")
    print(json.dumps({"imported": imported, "built": built, "peak": peak, "step_peak": peak - built, "losses": losses}))
    return 0


def measure_memory(args, part: str, path: str) -> dict[str, dict]:
    """Each contestant's :func:`measure_one` in a fresh process of its own."""
    out = {}
    for name in (OURS, PEERS[part]):
        cmd = [sys.executable, os.path.abspath(__file__), *strip_dir(sys.argv[1:]), "--dir", path]
        cmd += ["--measure-one", part, name]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise SystemExit(f"the memory measurement of {name} failed:\n{run.stderr[-3000:]}")
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def strip_dir(argv: list[str]) -> list[str]:
    """``argv`` without ``--dir PATH`` / ``--json PATH`` (the memory runs get the directory written here)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--dir", "--json"):
            skip = True
        elif not a.startswith(("--dir=", "--json=")):
            out.append(a)
    return out


# ---- one part ------------------------------------------------------------------------------


def run_part(args, part: str, path: str) -> dict:
    peer = PEERS[part]
    tokens, labels, targets = chat_batch(args)
    contestants = {OURS: build(args, part, OURS, path), peer: build(args, part, peer, path)}
    gc.collect()
    ours = contestants[OURS]
    trained = sum(p.numel() for p in ours.model.parameters() if p.requires_grad)
    total = count_params(ours.model)
    mc = ours.model_cfg
    print(
        f"\n{part}: llama shape, {mc.n_layers} layers, d={mc.d_model}, heads={mc.n_heads}/{mc.kv_heads} of "
        f"{mc.head_dim}, ffn={mc.ffn_dim}, vocab={mc.vocab_size}, {total / 1e6:.1f}M params, {trained / 1e6:.2f}M "
        f"trained{f' (LoRA r={args.rank}, alpha={args.alpha:g} on {args.targets})' if part == 'lora' else ''}; "
        f"batch {args.batch} x seq {args.seq}, {int((targets != IGNORE).sum())} trained targets, fp32, lr "
        f"{lr_of(args, part):g}, clip {args.grad_clip:g}"
    )
    losses = {n: [c.step(tokens, labels, targets) for _ in range(3)] for n, c in contestants.items()}
    diffs = [abs(o - h) / abs(h) for o, h in zip(losses[OURS], losses[peer])]
    ok = all(d <= args.tol for d in diffs)
    print(
        f"  agreement: losses over three steps ours {', '.join(f'{v:.6f}' for v in losses[OURS])}, {peer} "
        f"{', '.join(f'{v:.6f}' for v in losses[peer])}; |diff|/loss {max(diffs):.1e} (tolerance {args.tol:g}): "
        f"{'OK' if ok else 'MISMATCH'}"
    )
    check = {"losses": losses, "loss_rel_diff": diffs, "ok": ok}
    if not ok:
        print("the two steps do not compute the same thing: timings would be meaningless", file=sys.stderr)
        return {"check": check, "repeats": None}
    repeats = []
    for rep in range(args.repeats):
        times: dict[str, list[float]] = {n: [] for n in contestants}
        for r, name in rotations(list(contestants), args.warmup + args.steps):
            start = time.perf_counter()
            contestants[name].step(tokens, labels, targets)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)
        results = {n: {**summarize(t), "times": t} for n, t in times.items()}
        ratio = paired(times[OURS], times[peer])
        medians = results[OURS]["median"] / results[peer]["median"]
        repeats.append({"results": results, "paired_ratio": ratio, "ratio_of_medians": medians})
        rows = [
            [f"{n} (repeat {rep + 1})", f"{r['median']:.3f}", f"{r['mean']:.3f}", f"{r['min']:.3f}"]
            for n, r in results.items()
        ]
        print(table(["step", "median s", "mean s", "min s"], rows))
        print(f"  repeat {rep + 1}: ours/{peer} step time {ratio:.3f}x paired, {medians:.3f}x ratio of medians")
    ratio = statistics.median(r["paired_ratio"] for r in repeats)
    target = TARGETS[part]
    print(
        f"{part}: ours/{peer} step time (paired, median of {len(repeats)} repeat(s)): {ratio:.3f}x, target <= "
        f"{target}x: {'met' if ratio <= target else 'NOT met'}"
    )
    del contestants
    gc.collect()
    doc = {"check": check, "repeats": repeats, "ratio": ratio, "target": target, "trained_params": trained}
    if args.memory in (part, "both"):
        mem = measure_memory(args, part, path)
        mem_ratio = mem[OURS]["step_peak"] / max(mem[peer]["step_peak"], 1)
        rows = [
            [
                n,
                f"{m['imported'] / 2**20:.0f}",
                f"{m['built'] / 2**20:.0f}",
                f"{m['peak'] / 2**20:.0f}",
                f"{m['step_peak'] / 2**20:.1f}",
            ]
            for n, m in mem.items()
        ]
        print(table(["memory (own process)", "imported MiB", "built MiB", "peak MiB", "step peak MiB"], rows))
        verdict = "" if part != "lora" else f", target <= 1.0x: {'met' if mem_ratio <= 1.0 else 'NOT met'}"
        print(f"{part}: ours/{peer} step peak memory above the built model: {mem_ratio:.3f}x{verdict}")
        doc["memory"], doc["memory_ratio"] = mem, mem_ratio
    return doc


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure_one:
        return measure_one(args, *args.measure_one)
    transformers = quiet_transformers()
    import peft

    print(
        f"trickles vs transformers {transformers.__version__} + peft {peft.__version__} (torch {torch.__version__}), "
        f"CPU {device_name(torch.device('cpu'))}, {args.threads} thread(s), {os.cpu_count()} cores"
    )
    doc: dict = {"args": vars(args), "transformers": transformers.__version__, "peft": peft.__version__}
    ok = True
    with tempfile.TemporaryDirectory(prefix="trickles-finetune-") as tmp:
        path = args.dir or os.path.join(tmp, "model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            write_model_dir(args, path)
        for part in ("lora", "sft") if args.part == "both" else (args.part,):
            doc[part] = run_part(args, part, path)
            ok &= doc[part]["repeats"] is not None
            gc.collect()
    write_json(args.json, doc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
