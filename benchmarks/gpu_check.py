"""Every GPU check of the library in one run: the tests that need CUDA and the GPU benchmarks, each step bounded
in time.

Run it first whenever a GPU is at hand; its table goes into benchmarks/README.md (section ``gpu_check.py``).

What runs, in order (``--list`` prints the commands)
    a  the kernel tests (``tests/unit/test_kernel*.py``: on a machine with CUDA the Triton kernels run compiled) and the
       tests marked ``needs_gpu`` (the files that carry the mark, found by reading ``tests/``, ``-m needs_gpu``);
    b  ``kernels.py --device cuda --dtype bf16 --shape llama-1b``: per kernel ours-triton against eager,
       ``torch.compile`` and liger-kernel (time ratios), and the fused cross-entropy's time and peak memory;
    c  ``single_device.py --preset llama-1b --precision bf16`` (batch 4 x 2048): eager and compiled with
       ``model.kernels=auto``, then eager with ``model.kernels=torch``; step time, tokens/s, MFU, ours/HF;
    d  the command line, ``python -m trickles train`` of llama-1b in bf16 (batch 4 x 2048) compiled and eager, and
       ``examples/llama_125m_gpu.toml`` as shipped, each for a few steps into a temporary ``train.out_dir``; tokens/s
       and MFU from its ``metrics.jsonl`` (the median over the steps after the first, which compiles);
    e  ``inference.py --device cuda``: decoding tokens/s of our resident model against transformers', and of our layer
       streaming against accelerate's offloading;
    f  ``quantization.py --speed-preset llama-1b --device cuda``: int8 decoding (``torch._int_mm``) against bf16;
    g  ``moe.py --part single --device cuda``: the MoE layer and block in bf16 against transformers' Mixtral;
    h  ``context_parallel.py --world 1 --device cuda``: ring (and all-to-all) attention at cp=1 against SDPA, and the
       ring with packed documents' masks against the ring;
    i  ``decoding.py --device cuda``: batched greedy and beam decoding against transformers' ``generate``;
    l  ``serving.py --device cuda``: continuous batching (HTTP and in process) against the static batcher and
       transformers' continuous batching, 16 clients;
    j  ``documents.py``: packed documents' masks (flex attention) against plain causal attention;
    k  ``split_backward.py --preset llama-1b --dtype bf16``: a pipeline chunk's backward split into B and W (the
       zero-bubble schedules) against its whole backward -- what the split costs on a GPU.

How
    * One process tree: each step is a child process in its own process group, with a timeout; a step that fails or
      runs out of time is recorded as such (its output's tail kept) and the next one starts. The whole run keeps to
      ``--budget`` seconds (default 440: under 8 minutes with the start-up and the 20 s it may take to end a step
      that ran out of time): a step gets at most what is left, and one that cannot get ``MIN_STEP_S`` is recorded
      as skipped. The sizes (steps, rounds, shapes) are estimates for that budget on one H100/H200, llama-1b's
      compile taking about a minute of it; the first GPU run's seconds per step are what to size them by.
    * Writes ``--out`` (default ``gpu_check/``): ``gpu_check.json`` (environment, every step's command, status,
      seconds, numbers and output tail), ``gpu_check.md`` (the table, then each step's detail table) and
      ``gpu_check.log`` (every step's whole output). The JSON and the table are rewritten after every step (the steps
      not reached yet ``pending``, ``finished`` false), so a run killed midway leaves what it did; the table is
      printed at the end.
    * A step's status: ``ok`` (exit 0 and its numbers read), ``no result`` (exit 0 without them), ``failed (exit N)``,
      ``timeout (N s)``, ``skipped: out of the budget`` or ``skipped: not selected (--only)``. The exit status is 0
      only when every selected step is ``ok``; otherwise 1, and the last line names the steps without numbers.
    * ``--device cpu`` runs the same pipeline on the CPU at tiny shapes (the tests are only collected there: on a CPU
      the kernel tests run in Triton's interpreter for minutes, and ``needs_gpu`` tests skip), so the script itself
      is tested without a GPU; ``--dry-run`` writes the plan without running anything; ``--only`` picks steps.
    * liger-kernel is found if it imports (installed, or on ``PYTHONPATH``); its version, or ``absent``, is recorded.

Examples::

    python benchmarks/gpu_check.py                              # on a GPU machine: everything, about 8 minutes
    python benchmarks/gpu_check.py --device cpu --out /tmp/gc   # the pipeline at tiny shapes on a CPU
    python benchmarks/gpu_check.py --only c1,g --out gc2        # two steps again
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from _gpu_check_results import (
    Ctx,
    cp_summary,
    decoding_summary,
    documents_summary,
    inference_summary,
    kernels_summary,
    moe_summary,
    out,
    pytest_summary,
    quantization_summary,
    serving_summary,  # this folder
    single_summary,
    split_summary,
    train_summary,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_STEP_S = 15  # a step is not started with less time than this left in the budget
TAIL_CHARS = 3000  # the output kept in the JSON per step (the log has all of it)
OK, NO_RESULT, PENDING, PLANNED = "ok", "no result", "pending", "planned"  # statuses (and failed / timeout / skipped)
NOT_SELECTED = "skipped: not selected (--only)"


@dataclass
class Step:
    """One check: ``argv(ctx)`` its command, ``timeout`` its seconds on a GPU and on a CPU, ``summary(ctx, output)``
    the numbers it reports (``{"headline": str, "numbers": dict, "header": [...], "rows": [[...]]}``)."""

    key: str
    title: str
    argv: Callable[[Ctx], list[str]]
    timeout: tuple[float, float]
    summary: Callable[[Ctx, str], dict]
    scratch: str | None = None  # a directory of the scratch space the step fills, removed once it is read
    result: dict = field(default_factory=dict)


# ---- commands --------------------------------------------------------------------------------------------------------


def bench(ctx: Ctx, script: str, *args: str) -> list[str]:
    return [ctx.python, os.path.join("benchmarks", script), *args]


def kernel_test_files() -> list[str]:
    """The kernel tests: ``tests/unit/test_kernel*.py`` (they run on CUDA wherever it is available)."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "unit", "test_kernel*.py")))


def needs_gpu_files() -> list[str]:
    """The test files that mark a test ``needs_gpu`` (read from ``tests/``; the conftest, which defines it, left
    out)."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            if "mark.needs_gpu" in f.read():
                found.append(os.path.relpath(path, ROOT))
    return found


def pytest_argv(ctx: Ctx, files: list[str], *extra: str) -> list[str]:
    """pytest on ``files``; on a CPU only collected (the kernel tests would run in Triton's interpreter for minutes)."""
    return [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *files] + (
        [] if ctx.cuda else ["--collect-only"]
    )


def train_argv(ctx: Ctx, name: str, compile_: bool) -> list[str]:
    """``python -m trickles train`` of llama-1b in bf16 (CPU: the tiny preset), ``train.compile`` as given."""
    shape = (
        [
            "model.preset=llama-1b",
            "data.seq_len=2048",
            "train.micro_batch=4",
            "train.global_batch=4",
            "train.steps=5",
            "data.max_bytes=2000000",
        ]
        if ctx.cuda
        else [
            "model.preset=tiny",
            "data.seq_len=32",
            "train.micro_batch=4",
            "train.global_batch=4",
            "train.steps=3",
            "data.max_bytes=120000",
        ]
    )
    sets = [*shape, "memory.precision=bf16", f"train.compile={str(compile_).lower()}", *quiet_run(ctx, name)]
    return [ctx.python, "-m", "trickles", "train", *(a for s in sets for a in ("--set", s))]


def quiet_run(ctx: Ctx, name: str) -> list[str]:
    """A run's scratch directory, and no evaluation, sample or plot (what a few timed steps do not need)."""
    return [
        f"train.out_dir={os.path.join(ctx.work, name)}",
        f"data.cache_dir={os.path.join(ctx.work, 'data-cache')}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.plot=false",
    ]


def example_argv(ctx: Ctx) -> list[str]:
    """``examples/llama_125m_gpu.toml`` as shipped, three steps, a bounded slice of its corpus and a scratch
    ``out_dir``; on a CPU the tiny preset at batch 4 x 32 and uncompiled (the file's compiled 125M model takes minutes
    a step there)."""
    sets = [
        "train.steps=3",
        f"train.out_dir={os.path.join(ctx.work, 'example')}",
        f"data.cache_dir={os.path.join(ctx.work, 'data-cache')}",
    ]
    sets += (
        ["data.max_bytes=20000000"]
        if ctx.cuda
        else [
            "data.max_bytes=120000",
            "model.preset=tiny",
            "data.seq_len=32",
            "train.global_batch=4",
            "train.micro_batch=2",
            "train.compile=false",
            "train.sample_tokens=0",
            "train.plot=false",
        ]
    )
    return [
        ctx.python,
        "-m",
        "trickles",
        "train",
        "-c",
        "examples/llama_125m_gpu.toml",
        *(a for s in sets for a in ("--set", s)),
    ]


# ---- the steps -------------------------------------------------------------------------------------------------------


def steps() -> list[Step]:
    """Every check with its command on a GPU and on a CPU and its timeouts (GPU, CPU), in the order they run: the
    tests, the kernels and the single-device step first, the command-line runs (the longest) last."""
    return [
        Step("a1", "kernel tests", lambda c: pytest_argv(c, kernel_test_files()), (75, 120), pytest_summary),
        Step(
            "a2",
            "needs_gpu tests",
            lambda c: pytest_argv(c, needs_gpu_files(), "-m", "needs_gpu"),
            (45, 120),
            pytest_summary,
        ),
        Step(
            "b",
            "kernels: ours vs eager, compile, liger",
            lambda c: bench(
                c,
                "kernels.py",
                "--json",
                out(c, "kernels.json"),
                *(
                    ["--device", "cuda", "--dtype", "bf16", "--shape", "llama-1b", "--rounds", "10", "--warmup", "2"]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--shape",
                        "small",
                        "--rounds",
                        "1",
                        "--warmup",
                        "0",
                        "--no-compile",
                        "--ce-tokens",
                        "64",
                    ]
                ),
            ),
            (75, 120),
            kernels_summary,
        ),
        Step(
            "c1",
            "single device bf16: eager + compiled, kernels auto",
            lambda c: bench(
                c,
                "single_device.py",
                "--precision",
                "bf16",
                "--compile",
                "--json",
                out(c, "single-auto.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--preset",
                        "llama-1b",
                        "--batch",
                        "4",
                        "--seq",
                        "2048",
                        "--steps",
                        "5",
                        "--warmup",
                        "2",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--preset",
                        "tiny",
                        "--vocab",
                        "256",
                        "--batch",
                        "2",
                        "--seq",
                        "32",
                        "--steps",
                        "2",
                        "--warmup",
                        "1",
                    ]
                ),
            ),
            (100, 240),
            single_summary("single-auto.json"),
        ),
        Step(
            "c2",
            "single device bf16: eager, kernels torch",
            lambda c: bench(
                c,
                "single_device.py",
                "--precision",
                "bf16",
                "--kernels",
                "torch",
                "--json",
                out(c, "single-torch.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--preset",
                        "llama-1b",
                        "--batch",
                        "4",
                        "--seq",
                        "2048",
                        "--steps",
                        "5",
                        "--warmup",
                        "1",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--preset",
                        "tiny",
                        "--vocab",
                        "256",
                        "--batch",
                        "2",
                        "--seq",
                        "32",
                        "--steps",
                        "2",
                        "--warmup",
                        "0",
                    ]
                ),
            ),
            (40, 120),
            single_summary("single-torch.json"),
        ),
        Step(
            "g",
            "MoE layer and block vs Mixtral",
            lambda c: bench(
                c,
                "moe.py",
                "--part",
                "single",
                "--json",
                out(c, "moe.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--batch",
                        "8",
                        "--seq",
                        "4096",
                        "--d-model",
                        "1024",
                        "--ffn",
                        "2816",
                        "--steps",
                        "10",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--batch",
                        "1",
                        "--seq",
                        "64",
                        "--d-model",
                        "64",
                        "--ffn",
                        "128",
                        "--experts",
                        "4",
                        "--heads",
                        "4",
                        "--kv-heads",
                        "2",
                        "--steps",
                        "1",
                        "--warmup",
                        "0",
                    ]
                ),
            ),
            (40, 120),
            moe_summary,
        ),
        Step(
            "i",
            "batched greedy and beam decoding vs transformers",
            lambda c: bench(
                c,
                "decoding.py",
                "--json",
                out(c, "decoding.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--preset",
                        "llama-125m",
                        "--vocab",
                        "32000",
                        "--batch",
                        "8",
                        "--new",
                        "64",
                        "--rounds",
                        "3",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--preset",
                        "tiny",
                        "--vocab",
                        "256",
                        "--batch",
                        "2",
                        "--new",
                        "4",
                        "--rounds",
                        "1",
                    ]
                ),
            ),
            (40, 120),
            decoding_summary,
        ),
        Step(
            "l",
            "serving: continuous vs static vs transformers",
            lambda c: bench(
                c,
                "serving.py",
                "--json",
                out(c, "serving.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--preset",
                        "llama-125m",
                        "--requests",
                        "64",
                        "--output-lens",
                        "16,256,32,8,128,64",
                        "--time-limit",
                        "100",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--preset",
                        "tiny",
                        "--requests",
                        "6",
                        "--concurrency",
                        "3",
                        "--prompt-lens",
                        "8,20",
                        "--output-lens",
                        "4,12,2",
                        "--max-batch",
                        "4",
                        "--block-size",
                        "4",
                    ]
                ),
            ),
            (60, 120),
            serving_summary,
        ),
        Step(
            "h",
            "ring attention at cp=1 vs SDPA",
            lambda c: bench(
                c,
                "context_parallel.py",
                "--world",
                "1",
                "--json",
                out(c, "cp.json"),
                *(
                    ["--device", "cuda", "--seq", "8192", "--heads", "16", "--steps", "10", "--warmup", "2"]
                    if c.cuda
                    else ["--device", "cpu", "--seq", "256", "--steps", "1", "--warmup", "0"]
                ),
            ),
            (25, 120),
            cp_summary,
        ),
        Step(
            "j",
            "packed documents' masks (flex attention) vs causal",
            lambda c: bench(
                c,
                "documents.py",
                "--json",
                out(c, "documents.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--dtype",
                        "bf16",
                        "--preset",
                        "llama-1b",
                        "--batch",
                        "1",
                        "--seq",
                        "4096",
                        "--documents",
                        "8",
                        "--rounds",
                        "5",
                        "--warmup",
                        "2",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--preset",
                        "tiny",
                        "--seq",
                        "32",
                        "--documents",
                        "4",
                        "--rounds",
                        "1",
                        "--warmup",
                        "0",
                    ]
                ),
            ),
            (40, 120),
            documents_summary,
        ),
        Step(
            "k",
            "zero-bubble B + W vs a whole backward",
            lambda c: bench(
                c,
                "split_backward.py",
                "--json",
                out(c, "split.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--dtype",
                        "bf16",
                        "--preset",
                        "llama-1b",
                        "--layers",
                        "4",
                        "--batch",
                        "2",
                        "--seq",
                        "2048",
                        "--rounds",
                        "5",
                        "--warmup",
                        "2",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--preset",
                        "tiny",
                        "--layers",
                        "1",
                        "--seq",
                        "32",
                        "--rounds",
                        "1",
                        "--warmup",
                        "0",
                    ]
                ),
            ),
            (30, 120),
            split_summary,
        ),
        Step(
            "f",
            "int8 (_int_mm) decoding vs bf16",
            lambda c: bench(
                c,
                "quantization.py",
                "--out",
                out(c, "quantization"),
                *(
                    ["--device", "cuda", "--speed-preset", "llama-1b", "--rounds", "3", "--new-tokens", "32"]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--speed-preset",
                        "tiny",
                        "--rounds",
                        "1",
                        "--new-tokens",
                        "4",
                        "--prompt-tokens",
                        "8",
                    ]
                ),
            ),
            (45, 120),
            quantization_summary,
        ),
        Step(
            "e",
            "layer streaming vs accelerate, resident vs HF",
            lambda c: bench(
                c,
                "inference.py",
                "--json",
                out(c, "inference.json"),
                *(
                    [
                        "--device",
                        "cuda",
                        "--layers",
                        "24",
                        "--d-model",
                        "1024",
                        "--ffn",
                        "4096",
                        "--vocab",
                        "32000",
                        "--rounds",
                        "3",
                    ]
                    if c.cuda
                    else [
                        "--device",
                        "cpu",
                        "--layers",
                        "8",
                        "--d-model",
                        "128",
                        "--heads",
                        "4",
                        "--kv-heads",
                        "4",
                        "--ffn",
                        "512",
                        "--vocab",
                        "256",
                        "--prompt-len",
                        "8",
                        "--new-tokens",
                        "4",
                        "--rounds",
                        "1",
                        "--warmup",
                        "0",
                    ]
                ),
            ),  # blocks large against the embeddings: half the model can stream
            (60, 120),
            inference_summary,
        ),
        Step(
            "d1",
            "trickles train bf16, compiled",
            lambda c: train_argv(c, "train-compiled", True),
            (80, 240),
            train_summary("train-compiled"),
            "train-compiled",
        ),
        Step(
            "d2",
            "trickles train bf16, eager",
            lambda c: train_argv(c, "train-eager", False),
            (40, 120),
            train_summary("train-eager"),
            "train-eager",
        ),
        Step(
            "d3",
            "trickles train -c examples/llama_125m_gpu.toml",
            example_argv,
            (45, 120),
            train_summary("example"),
            "example",
        ),
    ]


# ---- running ---------------------------------------------------------------------------------------------------------


def child_env() -> dict:
    """The children's environment: this checkout importable, output unbuffered, no attempt to reach the Hub."""
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_bounded(argv: list[str], timeout: float, output_path: str) -> tuple[int | None, float, str]:
    """``(exit status or None when it ran out of time, seconds, output)`` of ``argv`` in its own process group, which
    is ended (TERM, then KILL) when ``timeout`` passes. The output goes to ``output_path``, not a pipe: a process that
    outlives the group (a compile worker in a session of its own) cannot keep this waiting."""
    start = time.monotonic()
    with open(output_path, "w") as sink:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=child_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            end_group(proc)
        except BaseException:  # this script stopped (Ctrl-C, or SIGTERM through main's handler): its step goes too
            end_group(proc)
            raise
    seconds = time.monotonic() - start
    with open(output_path, errors="replace") as f:
        return rc, seconds, f.read()


def unwind_on_sigterm() -> None:
    """A SIGTERM (a device lease ending, a job's time limit) unwinds this script like Ctrl-C, with status 143: the
    running step's process group is ended on the way out (:func:`run_bounded`), and the report is on disk already."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def end_group(proc: subprocess.Popen) -> None:
    """Ends the process group this script started for ``proc``: TERM, and KILL what is left after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # the group's other members, should any have ignored TERM
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def run_step(step: Step, ctx: Ctx, timeout: float, log) -> dict:
    """Runs one step and returns its record (status, seconds, summary, output tail); never raises. The status is
    ``ok`` only when the step exited 0 *and* its numbers were read; exit 0 without them is ``no result``."""
    argv = step.argv(ctx)
    rc, seconds, output = run_bounded(argv, timeout, os.path.join(ctx.work, f"{step.key}.out"))
    log.write(
        f"\n===== {step.key}: {step.title}\n$ {shlex.join(argv)}\n{output}\n===== {step.key}: "
        f"{'timeout' if rc is None else f'exit {rc}'} after {seconds:.1f} s\n"
    )
    log.flush()
    record = {
        "command": shlex.join(argv),
        "timeout_s": timeout,
        "seconds": round(seconds, 1),
        "output_tail": output[-TAIL_CHARS:],
    }
    try:
        record.update(step.summary(ctx, output))
    except Exception as e:  # noqa: BLE001 - a step without its numbers is still recorded, with why
        record.update(
            {"headline": f"no numbers: {type(e).__name__}: {str(e)[:160]}", "numbers": {}, "header": [], "rows": []}
        )
    if rc is None:
        record["status"] = f"timeout ({timeout:.0f} s)"
    elif rc:
        record["status"] = f"failed (exit {rc})"
    else:
        record["status"] = OK if record["numbers"] else NO_RESULT
    if step.scratch:  # a training run's checkpoint (llama-1b: about 15 GB) is not kept for the next step
        shutil.rmtree(os.path.join(ctx.work, step.scratch), ignore_errors=True)
    return record


def skipped(step: Step, ctx: Ctx, why: str) -> dict:
    return {
        "command": shlex.join(step.argv(ctx)),
        "status": f"skipped: {why}",
        "seconds": 0.0,
        "headline": "",
        "numbers": {},
        "header": [],
        "rows": [],
    }


def run_all(plan: list[Step], ctx: Ctx, args, log, after_each: Callable[[], object] = lambda: None) -> None:
    """Every step in order, each bounded by its timeout and by what is left of ``--budget``; the steps not reached yet
    are ``pending``, and ``after_each()`` is called once every step has its record (the report written so far)."""
    start = time.monotonic()
    for step in plan:
        step.result = {**skipped(step, ctx, ""), "status": PENDING}
    for step in plan:
        left = args.budget - (time.monotonic() - start)
        limit = step.timeout[0 if ctx.cuda else 1]
        if args.only and step.key not in args.only:
            step.result = {**skipped(step, ctx, ""), "status": NOT_SELECTED}
        elif args.dry_run:
            step.result = {**skipped(step, ctx, "dry run"), "status": PLANNED, "timeout_s": limit}
        elif left < MIN_STEP_S:
            step.result = skipped(step, ctx, f"out of the budget ({left:.0f} s of --budget {args.budget:g} s left)")
        else:
            print(f"[gpu_check] {step.key}: {step.title} (at most {min(limit, left):.0f} s)", flush=True)
            step.result = run_step(step, ctx, min(limit, left), log)
        print(f"[gpu_check] {step.key}: {step.result['status']}  {step.result.get('headline', '')}", flush=True)
        after_each()


def incomplete(plan: list[Step], dry_run: bool = False) -> list[str]:
    """``key: status`` of every step that was selected but did not give its numbers: failed, out of time, ``no
    result``, skipped for the budget, or never reached (``pending``); in a dry run, every step not ``planned``."""
    done = PLANNED if dry_run else OK
    return [f"{s.key}: {s.result['status']}" for s in plan if s.result["status"] not in (done, NOT_SELECTED)]


# ---- the environment and the report ----------------------------------------------------------------------------------


def version(package: str, module: str | None = None) -> str:
    """The installed version of ``package``, ``absent`` where it is not installed; with ``module``, only if that module
    imports (else why not)."""
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        if module:
            import_module(module)
    except ImportError:
        return "absent"
    except Exception as e:  # noqa: BLE001 - installed but broken
        return f"does not import: {type(e).__name__}: {str(e)[:120]}"
    try:
        return dist_version(package)
    except PackageNotFoundError:
        return "imports (version unknown)" if module else "absent"


def environment(cuda: bool) -> dict:
    import torch

    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "accelerate": version("accelerate"),
        "liger_kernel": version("liger-kernel", "liger_kernel"),
        "python": sys.version.split()[0],
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def commit() -> str:
    """The checkout's commit, marked when files differ from it; ``unknown`` without git or a repository (a copied
    working tree)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


def md_table(header: list[str], rows: list[list]) -> list[str]:
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(cell, r)) + " |" for r in rows
    ]


def markdown(plan: list[Step], env: dict, elapsed: float, cuda: bool, finished: bool = True) -> str:
    """The summary table, then each step's detail table; an unfinished run says so (``pending`` steps)."""
    lines = [
        f"# gpu_check: {env['device']}, {env['date']}",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, transformers {env['transformers']}, "
        f"accelerate {env['accelerate']}, liger-kernel {env['liger_kernel']}; commit {env['commit']}; "
        f"{elapsed:.0f} s {'in all' if finished else 'so far (the run had not finished)'}"
        f"{'' if cuda else ' (CPU smoke run: tiny shapes, not speeds)'}",
        "",
    ]
    lines += md_table(
        ["step", "what", "status", "s", "result"],
        [
            [s.key, s.title, s.result["status"], f"{s.result.get('seconds', 0):.0f}", s.result.get("headline", "")]
            for s in plan
        ],
    )
    for s in plan:
        if s.result.get("rows"):
            lines += ["", f"## {s.key}: {s.title}", "", f"`{s.result['command']}`", ""] + md_table(
                s.result["header"], s.result["rows"]
            )
    return "\n".join(lines) + "\n"


def write_report(out_dir: str, plan: list[Step], env: dict, args, elapsed: float, cuda: bool, finished: bool) -> str:
    """Writes ``gpu_check.json`` and ``gpu_check.md`` into ``out_dir`` as the steps stand (each file replaced whole,
    so a run killed at any moment leaves the steps done before); returns the table."""
    doc = {
        "device": "cuda" if cuda else "cpu",
        "dry_run": args.dry_run,
        "budget_s": args.budget,
        "elapsed_s": round(elapsed, 1),
        "finished": finished,
        "environment": env,
        "steps": [{"key": s.key, "title": s.title, **s.result} for s in plan],
    }
    text = markdown(plan, env, elapsed, cuda, finished)
    for name, content in (("gpu_check.json", json.dumps(doc, indent=2, default=str)), ("gpu_check.md", text)):
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as f:
            f.write(content)
        os.replace(path + ".tmp", path)
    return text


def check(plan: list[Step], ctx: Ctx, args, env: dict) -> int:
    """Runs ``plan`` into ``args.out`` -- the JSON and the table written after every step, the log as it goes -- prints
    the table and returns the exit status: 0 when every selected step is ``ok`` (``planned`` in a dry run), else 1."""
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()

    def report(finished: bool = False) -> str:
        return write_report(args.out, plan, env, args, time.monotonic() - start, ctx.cuda, finished)

    with open(os.path.join(args.out, "gpu_check.log"), "w") as log:
        run_all(plan, ctx, args, log, after_each=report)
    print("\n" + report(finished=True))
    print(f"[gpu_check] wrote {os.path.join(args.out, 'gpu_check.json')}, gpu_check.md and gpu_check.log")
    missing = incomplete(plan, args.dry_run)
    if missing:
        print(f"[gpu_check] {len(missing)} step(s) without their numbers: {'; '.join(missing)}", flush=True)
    return 1 if missing else 0


def scratch_parent(cuda: bool) -> str | None:
    """Where the scratch directory goes: memory (``/dev/shm``) on a GPU machine with room for llama-1b's checkpoints
    (about 15 GB each, written at a run's last step), else the system's temporary directory."""
    shm = "/dev/shm"
    return shm if cuda and os.path.isdir(shm) and shutil.disk_usage(shm).free > 40 << 30 else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="cuda: the checks at their GPU sizes; cpu: the same pipeline at tiny shapes (tests collected only)",
    )
    p.add_argument("--out", default="gpu_check", help="directory for gpu_check.json, gpu_check.md and gpu_check.log")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for all steps together (default: 440 on CUDA, under 8 minutes with the start-up and "
        "the ending of a step out of time; 900 on a CPU)",
    )
    p.add_argument(
        "--only",
        type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
        default=None,
        help=f"comma-separated step keys to run ({','.join(s.key for s in steps())}); the others are recorded as "
        "not selected",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="write the plan (commands, timeouts) without running anything"
    )
    p.add_argument("--list", action="store_true", help="print every step's command and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    unwind_on_sigterm()
    import torch

    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available() and not (args.list or args.dry_run):  # a plan needs no GPU
        raise SystemExit("gpu_check.py --device cuda: no CUDA device here (use --device cpu for the smoke run)")
    plan = steps()
    unknown = sorted(set(args.only or []) - {s.key for s in plan})
    if unknown:
        raise SystemExit(
            f"--only: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(s.key for s in plan)}"
        )
    if args.budget is None:
        args.budget = 440.0 if cuda else 900.0
    work = tempfile.mkdtemp(prefix="gpu-check-", dir=scratch_parent(cuda))
    ctx = Ctx(cuda=cuda, work=work)
    if args.list:
        for s in plan:
            print(f"{s.key}: {s.title} (timeout {s.timeout[0 if cuda else 1]:g} s)\n    {shlex.join(s.argv(ctx))}")
        shutil.rmtree(work, ignore_errors=True)
        return 0
    env = environment(cuda and torch.cuda.is_available())
    print(
        f"[gpu_check] {env['device']}: torch {env['torch']}, liger-kernel {env['liger_kernel']}; "
        f"budget {args.budget:g} s; scratch {work}",
        flush=True,
    )
    try:
        return check(plan, ctx, args, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
