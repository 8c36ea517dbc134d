"""Fused kernels: trickles' Triton kernels and chunked cross-entropy vs PyTorch, torch.compile and liger-kernel.

What is compared
    For each kernel, forward and backward on one device, from the same inputs and a fixed upstream
    gradient to the gradients of every input and weight:

    * ``rms_norm``: ``weight * rms_norm(x)`` (``x [tokens, hidden]``, statistics in fp32, llama's casting);
    * ``layer_norm``: ``F.layer_norm(x, weight, bias)``;
    * ``rotary``: queries and keys ``[B, T, H, D]`` rotated by position (rotate-half, ``rope_tables``);
    * ``swiglu``: ``silu(a) * b`` on ``[tokens, ffn]``;
    * ``gelu_tanh``: ``gelu(a, approximate="tanh")`` on ``[tokens, ffn]``;
    * ``cross_entropy``: the output projection and mean token cross-entropy, ``h [tokens, hidden]``,
      ``W [vocab, hidden]``.

    Contestants: ``eager`` (the PyTorch reference: ``trickles.kernels``' ``*_reference``/``torch`` paths; for
    the cross-entropy ``F.linear`` then ``F.cross_entropy`` of the fp32 logits), ``compile``
    (``torch.compile`` of that reference; skipped with the reason if it fails), ``ours-triton``
    (``kernels="triton"``: on CUDA, or on a CPU with ``--interpret``, Triton's interpreter, whose times say
    nothing about speed), ``liger`` (liger-kernel's ``LigerRMSNormFunction`` (llama casting, in place: its
    defaults), ``LigerLayerNormFunction``, ``LigerRopeFunction`` (on ``[B, H, T, D]`` transposed views of the
    same storage), ``LigerSiLUMulFunction``, ``LigerFusedLinearCrossEntropyLoss(accum_dtype=fp32)``;
    it has no plain GELU-tanh (``LigerGELUMulFunction`` is ``gelu(a) * b``); CUDA only), and for the
    cross-entropy ``ours-chunked``: ``linear_cross_entropy(kernels="torch")`` with the default chunk
    (``--chunk``), which runs anywhere.

How
    * Fresh inputs: before each step's clock starts, the activations (``x``, ``q``/``k``, ``a``/``b``, ``h``) are
      copied (the gradients flow through the copy to the leaves) and so is the upstream gradient, as a model
      hands a kernel the previous layer's output: ours rotates in place, and liger's backward writes its
      gradients over its inputs (SwiGLU), the upstream gradient (RMSNorm) or both (rope).
    * Agreement first: each contestant's outputs and gradients against eager's, relative error
      ``||a - b|| / ||b||`` over each tensor, at most 1e-4 in fp32; otherwise the run stops. In bf16 the
      reference is eager on fp32 copies of the same inputs, tolerance 2e-2 (eager's own bf16 error is printed,
      not enforced: on a CPU its LayerNorm accumulates the weight and bias gradients in bf16, 5e-2 off).
    * Peak memory: ``trickles.memory.accounting.peak_allocated`` around one forward + backward (CUDA:
      the allocator's peak; CPU: the profiler's allocation record), bytes above what was allocated at the
      start (the inputs), the gradients it produces included.
    * Timing: ``--warmup`` untimed rounds, then ``--rounds`` rounds in which every contestant runs one
      forward + backward, the order rotating each round (``_timing.interleaved``); on CUDA the device is
      synchronized before each clock starts and stops. Reported: median time, its ratio to eager's and to
      liger's (where liger ran), peak MiB and its ratio to eager's.

Target
    On CUDA, ours-triton/liger time <= 1.0x for every kernel; the fused cross-entropy's peak memory far below
    eager's.

Examples::

    python benchmarks/kernels.py                                     # CPU: small shapes, eager vs compile
    python benchmarks/kernels.py --only cross_entropy --json out/kernels.json
    python benchmarks/kernels.py --interpret --only rms_norm --rounds 2 --warmup 1   # Triton path, end to end
    python benchmarks/kernels.py --device cuda --dtype bf16 --shape llama-1b
    python benchmarks/kernels.py --shape tiny --interpret --no-compile --rounds 1 --warmup 0   # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, interleaved, rotations, summarize, table, write_json  # noqa: E402

KERNELS = ["rms_norm", "layer_norm", "rotary", "swiglu", "gelu_tanh", "cross_entropy"]
SHAPES = {  # batch x seq tokens (the cross-entropy: ce_tokens); heads x head_dim = hidden for the rotary
    "tiny": dict(
        batch=1, seq=16, hidden=64, ffn=128, heads=4, head_dim=16, vocab=256, ce_tokens=16, theta=1e4
    ),  # a smoke run
    "small": dict(batch=2, seq=1024, hidden=256, ffn=704, heads=8, head_dim=32, vocab=32000, ce_tokens=1024, theta=1e4),
    "llama-1b": dict(
        batch=4, seq=2048, hidden=2048, ffn=8192, heads=32, head_dim=64, vocab=128256, ce_tokens=8192, theta=5e5
    ),
}
EAGER, COMPILE, TRITON, LIGER, CHUNKED = "eager", "compile", "ours-triton", "liger", "ours-chunked"
TOL = {"fp32": 1e-4, "bf16": 2e-2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="inputs, weights and gradients")
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 20; cross_entropy on a CPU 5)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds after the check (default: 2; cross_entropy on a CPU 1)"
    )
    p.add_argument("--only", default=None, choices=KERNELS, help="run one kernel")
    p.add_argument("--ce-tokens", type=int, default=None, help="tokens of the cross-entropy (default: the shape's)")
    p.add_argument("--chunk", type=int, default=0, help="tokens per chunk of ours' cross-entropy (0: default_chunk)")
    p.add_argument(
        "--interpret", action="store_true", help="on a CPU: run ours-triton under TRITON_INTERPRET=1 (not a speed)"
    )
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: 1 on a CPU, see the README)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write every number as JSON to PATH")
    return p.parse_args(argv)


class Case:
    """One kernel: its arguments (the first ``acts`` are activations; leaves that require grad), upstream
    gradients (None: a scalar loss) and contestants, eager first."""

    def __init__(self, name, args, grads, acts, eager):
        self.name, self.args, self.grads, self.acts, self.note = name, args, grads, acts, ""
        self.contestants = {EAGER: eager}
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []

    @property
    def leaves(self):
        return [a for a in self.args if isinstance(a, torch.Tensor) and a.requires_grad]

    def fresh(self, args=None, grads=None):
        """Copies of the activations (non-leaf: gradients flow through to the leaves) and of the upstream gradients,
        made before a step's clock starts, as a model hands a kernel the previous layer's output: ours and liger
        may overwrite them (rotary in place; liger's SwiGLU, RMSNorm and rope backward reuse their buffers)."""
        args, grads = args or self.args, grads or self.grads
        return (
            tuple(a.clone() if i < self.acts else a for i, a in enumerate(args)),
            grads and [g.clone() for g in grads],
        )

    def step(self, fn, inputs=None, leaves=None):
        """One forward + backward of ``fn``; returns the outputs (detached) and the leaves' gradients."""
        leaves = self.leaves if leaves is None else leaves
        args, grads = inputs or self.fresh()
        for t in leaves:
            t.grad = None
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs], [t.grad for t in leaves]

    def reference(self):
        """Eager on fp32 copies of the arguments (same values): the reference of a low-precision run."""

        def up(a):
            return a.detach().float().requires_grad_(a.requires_grad) if a.is_floating_point() else a

        args = tuple(up(a) for a in self.args)
        inputs = self.fresh(args, self.grads and [g.float() for g in self.grads])
        return self.step(self.contestants[EAGER], inputs, [a for a in args if a.requires_grad])


def load_liger(device: torch.device):
    """liger-kernel's ops as a dict, or the reason it does not run here."""
    if device.type != "cuda":
        return "liger-kernel needs CUDA (its Triton kernels are not run on a CPU here)"
    try:
        from liger_kernel.ops import (
            LigerLayerNormFunction,
            LigerRMSNormFunction,
            LigerRopeFunction,
            LigerSiLUMulFunction,
        )
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # noqa: BLE001 - any import failure means: skip it
        return f"liger-kernel does not import: {type(e).__name__}: {e}"
    return dict(
        rms=LigerRMSNormFunction,
        ln=LigerLayerNormFunction,
        rope=LigerRopeFunction,
        swiglu=LigerSiLUMulFunction,
        flce=LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32),
    )


def build(name: str, s: dict, device, dtype, triton_ok: bool, liger, seed: int, chunk: int = 0) -> Case:
    """The case ``name`` at shape ``s``, with every contestant that runs here."""
    from trickles.kernels.activations import gelu_tanh, swiglu
    from trickles.kernels.cross_entropy import linear_cross_entropy
    from trickles.kernels.norms import layer_norm, rms_norm, rms_norm_reference
    from trickles.kernels.rotary import rotary
    from trickles.models.transformer import rope_tables

    n = s["batch"] * s["seq"]
    g = torch.Generator().manual_seed(seed + KERNELS.index(name))

    def rand(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_(grad)

    eps, lig, note = 1e-5, liger if isinstance(liger, dict) else {}, ""
    if name == "rms_norm":
        x, w = rand(n, s["hidden"]), rand(s["hidden"], scale=0.1)
        w.data += 1
        case = Case(name, (x, w), [rand(n, s["hidden"], grad=False)], 1, lambda x, w: rms_norm_reference(x, w, eps))

        def ours(x, w):
            return rms_norm(x, w, eps, "triton")

        peer = lig.get("rms") and (lambda x, w: lig["rms"].apply(x, w, eps))
    elif name == "layer_norm":
        x, w, b = rand(n, s["hidden"]), rand(s["hidden"], scale=0.1), rand(s["hidden"], scale=0.1)
        w.data += 1
        case = Case(
            name, (x, w, b), [rand(n, s["hidden"], grad=False)], 1, lambda x, w, b: layer_norm(x, w, b, eps, "torch")
        )

        def ours(x, w, b):
            return layer_norm(x, w, b, eps, "triton")

        peer = lig.get("ln") and (lambda x, w, b: lig["ln"].apply(x, w, b, eps))
    elif name == "rotary":
        shape = (s["batch"], s["seq"], s["heads"], s["head_dim"])
        cos, sin = (
            t.to(device) for t in rope_tables(s["head_dim"], s["seq"], s["theta"])
        )  # fp32 buffers, as in the model
        q, k = rand(*shape), rand(*shape)
        case = Case(
            name,
            (q, k, cos, sin),
            [rand(*shape, grad=False), rand(*shape, grad=False)],
            2,
            lambda q, k, c, si: rotary(q, k, c, si, "torch"),
        )

        def ours(q, k, c, si):
            return rotary(q, k, c, si, "triton")

        def peer(q, k, c, si):  # [B, T, H, D] storage seen as liger's [B, H, T, D]; rotated in place
            qr, kr = lig["rope"].apply(q.transpose(1, 2), k.transpose(1, 2), c, si)
            return qr.transpose(1, 2), kr.transpose(1, 2)

        peer = lig.get("rope") and peer
    elif name == "swiglu":
        a, b = rand(n, s["ffn"]), rand(n, s["ffn"])
        case = Case(name, (a, b), [rand(n, s["ffn"], grad=False)], 2, lambda a, b: swiglu(a, b, "torch"))

        def ours(a, b):
            return swiglu(a, b, "triton")

        peer = lig.get("swiglu") and (lambda a, b: lig["swiglu"].apply(a, b))
    elif name == "gelu_tanh":
        a = rand(n, s["ffn"])
        case = Case(name, (a,), [rand(n, s["ffn"], grad=False)], 1, lambda a: gelu_tanh(a, "torch"))

        def ours(a):
            return gelu_tanh(a, "triton")

        peer = None
        if lig:
            case.skipped[LIGER] = "liger-kernel has no plain GELU-tanh op (LigerGELUMulFunction is gelu(a) * b, GEGLU)"
    else:
        n = s["ce_tokens"]
        h, w = rand(n, s["hidden"]), rand(s["vocab"], s["hidden"], scale=0.02)
        y = torch.randint(0, s["vocab"], (n,), generator=g).to(device)
        case = Case(name, (h, w, y), None, 1, lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y))

        def ours(h, w, y):
            return linear_cross_entropy(h, w, y, chunk=chunk, kernels="triton")

        peer = lig.get("flce") and (lambda h, w, y: lig["flce"](w, h, y))
        case.contestants[CHUNKED] = lambda h, w, y: linear_cross_entropy(h, w, y, chunk=chunk, kernels="torch")
        from trickles.kernels.cross_entropy import default_chunk

        note = f"ours: chunks of {chunk or default_chunk(n, s['vocab'], s['hidden'])} tokens of {n}"
    case.note = note
    if triton_ok:
        case.contestants[TRITON] = ours
    if peer:
        case.contestants[LIGER] = peer
    elif isinstance(liger, str):
        case.skipped[LIGER] = liger
    return case


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def agree(case: Case, tol: float) -> dict[str, float]:
    """Every contestant's largest relative error against the reference: eager, in bf16 eager on fp32 copies of the
    inputs. Drops a compile that fails; stops on a disagreement (but not on eager's own bf16 rounding)."""
    low = case.args[0].dtype != torch.float32
    ref_out, ref_grad = case.reference() if low else (None, None)
    errors = {}
    for name, fn in list(case.contestants.items()):
        try:
            out, grad = case.step(fn)
        except Exception as e:  # noqa: BLE001
            if name != COMPILE:
                raise
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            case.skipped[COMPILE] = f"torch.compile failed: {type(e).__name__}: {reason[:160]}"
            del case.contestants[COMPILE]
            continue
        if ref_out is None:  # fp32: eager is the reference
            ref_out, ref_grad = out, grad
        errs = [rel_err(a, b) for a, b in zip(out + grad, ref_out + ref_grad)]
        errors[name] = max(errs)
        if errors[name] > tol or any(e != e for e in errs):
            labels = [f"output {i}" for i in range(len(out))] + [f"grad {i}" for i in range(len(grad))]
            detail = ", ".join(f"{lab} {e:.2e}" for lab, e in zip(labels, errs))
            what = (
                f"{case.name}: {name} differs from {'fp32 eager' if low else 'eager'} (relative errors {detail}; "
                f"tolerance {tol:g})"
            )
            if name == EAGER:  # the baseline's own rounding: say so, keep going
                case.notes.append(f"note: {what} -- PyTorch's own {case.args[0].dtype} kernel on this device")
                continue
            raise SystemExit(f"{what}: timings would be meaningless")
    return errors


def timed_step(case: Case, name: str):
    """The step of contestant ``name`` to time: its gradients cleared and fresh inputs made off the clock."""
    for t in case.leaves:
        t.grad = None
    inputs = case.fresh()
    return lambda: case.step(case.contestants[name], inputs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before trickles (and triton.jit) is imported
    from trickles.kernels import HAVE_TRITON, interpreting
    from trickles.memory.accounting import peak_allocated

    name = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    device = torch.device(name)
    if args.interpret and device.type == "cuda":
        raise SystemExit("--interpret is for a CPU: on CUDA ours-triton runs compiled")
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)  # on a shared host every op of a 2-thread pool waits for a core
    torch.set_float32_matmul_precision("highest")  # fp32 is fp32 (no TF32): the check's tolerance assumes it
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    tol, s = TOL[args.dtype], dict(SHAPES[args.shape])
    s["ce_tokens"] = args.ce_tokens or s["ce_tokens"]
    triton_ok = HAVE_TRITON and (device.type == "cuda" or interpreting())
    triton_why = (
        "Triton is not installed" if not HAVE_TRITON else "needs CUDA, or --interpret on a CPU (Triton's interpreter)"
    )
    liger = load_liger(device)
    triton_label = TRITON + (" (interpreter)" if device.type != "cuda" else "")

    print("fused kernels, forward + backward: eager PyTorch vs torch.compile, ours (Triton / chunked) and liger-kernel")
    print(
        f"  shape   {args.shape}: tokens {s['batch']} x {s['seq']}, hidden {s['hidden']}, ffn {s['ffn']}, "
        f"heads {s['heads']} x {s['head_dim']}; cross-entropy {s['ce_tokens']} tokens, vocab {s['vocab']}; {args.dtype}"
    )
    liger_v = "-"
    if isinstance(liger, dict):
        from importlib.metadata import version

        liger_v = version("liger-kernel")
    print(
        f"  device  {device.type}: {device_name(device)}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}, triton {__import__('triton').__version__ if HAVE_TRITON else '-'}, "
        f"liger-kernel {liger_v}"
    )
    if not triton_ok:
        print(f"  {TRITON}: skipped, {triton_why}")
    elif interpreting():
        print(
            f"  {TRITON}: Triton's INTERPRETER on the CPU (TRITON_INTERPRET=1): checks the path end to end; "
            "its times and ratios are NOT speeds"
        )
    if isinstance(liger, str):
        print(f"  {LIGER}: skipped, {liger}")

    results = {}
    for kernel in [args.only] if args.only else KERNELS:
        case = build(kernel, s, device, dtype, triton_ok, liger, args.seed, args.chunk)
        if not args.no_compile:
            case.contestants[COMPILE] = torch.compile(case.contestants[EAGER])
        errors = agree(case, tol)
        names = list(case.contestants)
        slow = kernel == "cross_entropy" and device.type == "cpu"  # three N x d x V matmuls a step
        rounds = args.rounds or (5 if slow else 20)
        warmup = args.warmup if args.warmup is not None else (1 if slow else 2)
        for _, c in rotations(names, warmup):
            case.step(case.contestants[c])
        peaks = {}
        for c in names:
            for t in case.leaves:
                t.grad = None
            inputs = case.fresh()
            step = functools.partial(case.step, case.contestants[c], inputs)
            peaks[c] = peak_allocated(lambda step=step: step() and None, device)[1]
        times = interleaved(names, functools.partial(timed_step, case), rounds, device)

        med = {c: statistics.median(times[c]) for c in names}
        ref = "eager" if args.dtype == "fp32" else f"fp32 eager (bf16 eager {errors[EAGER]:.1e})"
        rows, out = [], {}
        for c in names:
            label = triton_label if c == TRITON else c
            vs_liger = f"{med[c] / med[LIGER]:.3f}x" if LIGER in med else "-"
            rows.append(
                [
                    label,
                    f"{med[c] * 1e3:.2f}",
                    f"{med[c] / med[EAGER]:.3f}x",
                    vs_liger,
                    f"{peaks[c] / 2**20:.1f}",
                    f"{peaks[c] / max(peaks[EAGER], 1):.3f}x",
                ]
            )
            out[c] = {
                **summarize(times[c]),
                "ratio_eager": med[c] / med[EAGER],
                "ratio_liger": med[c] / med[LIGER] if LIGER in med else None,
                "peak_bytes": peaks[c],
                "peak_ratio_eager": peaks[c] / max(peaks[EAGER], 1),
                "max_rel_err": errors.get(c, 0.0),
                "times": times[c],
            }
        print(
            f"\n{kernel}{' (' + case.note + ')' if case.note else ''}: {rounds} rounds after {warmup} warm-up, "
            f"agreement with {ref} within {max((v for c, v in errors.items() if c != EAGER), default=0.0):.1e} "
            f"(tolerance {tol:g})"
        )
        print(table(["contestant", "median ms", "vs eager", "vs liger", "peak MiB", "peak vs eager"], rows))
        for c, why in case.skipped.items():
            if c != LIGER or not isinstance(liger, str):
                print(f"  {c}: skipped, {why}")
        for line in case.notes:
            print(f"  {line}")
        results[kernel] = {
            "contestants": out,
            "skipped": case.skipped,
            "note": case.note,
            "rounds": rounds,
            "warmup": warmup,
        }

    if interpreting():
        print(f"\n{TRITON} ran under Triton's interpreter: its times are not speeds.")
    write_json(
        args.json,
        {
            "args": vars(args),
            "device": str(device),
            "device_name": device_name(device),
            "dtype": args.dtype,
            "shape": s,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "liger_kernel": liger_v,
            "triton_interpreter": interpreting(),
            "tolerance": tol,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
