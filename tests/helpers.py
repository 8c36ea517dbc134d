"""Small shared pieces of the test suite: a tiny, fast configuration, and tolerance checks that prove they can fail.

A tolerance is only worth something if a wrong run would break it. :func:`assert_losses_track` and
:func:`assert_weights_track` therefore assert both sides at once:

* the run under test is within ``tol`` of the reference (the same precision on one process), and
* each deliberately wrong run (a learning rate 5% off, a weight that never moved) is *farther* than ``tol``.

Every caller justifies its ``tol`` in a comment by the gap it measured.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from collections.abc import Mapping, Sequence

import torch

from trickles.config import Config
from trickles.parallel.ring_blocks import CudaEfficient
from trickles.train import checkpoint as ckpt
from trickles.train.pieces import PieceReader


def tiny_config(tmp, *overrides, steps=6, corpus_bytes=120_000):
    """A 2-layer llama on a slice of the standard library, writing under ``tmp``."""
    return Config.load(
        None,
        [
            "model.preset=tiny",
            "data.seq_len=32",
            f"data.max_bytes={corpus_bytes}",
            f"data.cache_dir={tmp}/cache",
            f"train.steps={steps}",
            "train.global_batch=8",
            "train.warmup_steps=2",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "train.plot=false",
            f"train.out_dir={tmp}/run",
            "train.lr=3e-3",
            *overrides,
        ],
    )


def tiny_hf_llama(path, vocab_size: int = 320, seed: int = 0):
    """A tiny random ``LlamaForCausalLM`` (2 layers, width 32, grouped-query heads, untied), saved at ``path``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def short_documents(path, count: int = 5000) -> list[str]:
    """A JSONL corpus of short documents written to ``path`` -- the non-blank lines of the standard library's
    ``argparse``, ``typing`` and ``inspect`` sources, about 45 bytes each, so a window of 32-64 tokens packs
    several -- and the overrides that read it."""
    import argparse
    import inspect
    import json
    import typing

    lines = [line for m in (argparse, typing, inspect) for line in inspect.getsource(m).splitlines() if line.strip()]
    with open(path, "w") as f:
        for line in lines[:count]:
            f.write(json.dumps({"text": line}) + "\n")
    return [f"data.source={path}", "data.max_bytes=200000"]


def trained_checkpoint(tmp, steps: int, *overrides) -> str:
    """A tiny llama (``tiny_config``) trained ``steps`` steps on one process, and the checkpoint it then writes."""
    from trickles.topology import ParallelDims
    from trickles.train.trainer import Trainer

    trainer = Trainer(tiny_config(tmp, *overrides, steps=steps), ParallelDims().build(torch.device("cpu")), quiet=True)
    for _ in range(steps):
        trainer.train_step()
    path = trainer.save_checkpoint()
    assert path is not None
    return path


def loss_gap(losses: Sequence[float], reference: Sequence[float]) -> float:
    """Largest relative difference between two loss curves, step by step."""
    assert len(losses) == len(reference), (len(losses), len(reference))
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def weight_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute element difference (fp32 arithmetic)."""
    return float((a.detach().float() - b.detach().float()).abs().max())


def assert_losses_track(losses, reference, tol: float, wrong: Mapping[str, Sequence[float]]) -> float:
    """``losses`` within ``tol`` (relative, per step) of ``reference``, and every run in ``wrong`` farther.

    Returns the measured gap, for the caller's message or comment."""
    gap = loss_gap(losses, reference)
    assert gap <= tol, f"losses differ from the reference by {gap:.3g} relative, more than the tolerance {tol:.3g}"
    assert wrong, "name at least one wrong run the tolerance must reject"
    for name, bad in wrong.items():
        bad_gap = loss_gap(bad, reference)
        assert bad_gap > tol, f"the tolerance {tol:.3g} would pass a wrong run ({name}: gap {bad_gap:.3g})"
    return gap


def assert_weights_track(
    weights: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
    tol: float,
) -> float:
    """Every weight within ``tol`` (absolute) of the reference's, and every weight moved farther than ``tol`` from
    where it started -- so a weight that was never updated (left at ``initial``) fails. Returns the largest gap."""
    assert weights.keys() == reference.keys() == initial.keys(), (sorted(weights), sorted(reference), sorted(initial))
    worst = 0.0
    for name, w in weights.items():
        gap = weight_gap(w, reference[name])
        moved = weight_gap(initial[name], reference[name])
        assert gap <= tol, f"{name} differs from the reference by {gap:.3g}, more than the tolerance {tol:.3g}"
        assert moved > tol, (
            f"the tolerance {tol:.3g} would pass {name} never being updated (it moved {moved:.3g} in all)"
        )
        worst = max(worst, gap)
    return worst


def assert_updates_track(
    weights: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
    tol: float,
) -> float:
    """Every weight's distance to the reference within ``tol`` of the reference's own update, in norm:
    ``||w - ref|| <= tol ||ref - initial||`` -- a weight never updated scores 1. For low-precision runs where a few
    elements with near-zero gradients take Adam steps of opposite sign (a full learning rate apart) although the
    tensor as a whole tracks. Returns the largest ratio."""
    assert weights.keys() == reference.keys() == initial.keys(), (sorted(weights), sorted(reference), sorted(initial))
    assert 0 < tol < 1, "a tolerance of 1 or more passes a weight never updated"
    worst = 0.0
    for name, w in weights.items():
        ref = reference[name].float()
        update = float((ref - initial[name].float()).norm())
        ratio = float((w.float() - ref).norm()) / update if update else float("inf")
        assert ratio <= tol, (
            f"{name} is {ratio:.3g} of its update away from the reference, more than the tolerance {tol:.3g}"
        )
        worst = max(worst, ratio)
    return worst


def perturbed(weights: Mapping[str, torch.Tensor], name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` with ``name`` replaced by ``value`` (e.g. its initial value: a weight left un-updated)."""
    out = dict(weights)
    out[name] = value
    return out


def cli_here(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """``trickles ARGS`` run by :func:`trickles.cli.main` in this process (in ``cwd``), its exit status, stdout and
    stderr captured as a subprocess's would be. For input the command refuses before it starts anything: a fresh
    interpreter costs seconds of importing torch per case. The tests that check a refusal through a real process
    (status, the one line on stderr) keep doing so in their own files."""
    from trickles.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's errors and --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["trickles", *args], code, out.getvalue(), err.getvalue())


def efficient_attention_stand_in():
    """:class:`~trickles.parallel.ring_blocks.CudaEfficient` over CPU stand-ins for PyTorch's memory-efficient attention
    kernels that keep their contract -- and check the ring keeps its side: the bias in the inputs' type, its rows
    16-element aligned; the log-sum-exp returned padded to 32 rows (NaN past the rows), taken back padded and
    contiguous; a row that sees no key returned as NaN; grads of q, k and v only -- so the ring's glue around the CUDA
    kernel runs on a CPU (the kernel itself: ``tests/unit/test_ring_blocks.py``, on CUDA)."""

    def scores(q, k, bias, causal, scale):
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        if bias is not None:
            assert bias.dtype == q.dtype and bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, bias.stride()
            assert tuple(bias.shape) == (*q.shape[:3], k.shape[2]), bias.shape
            s = s + bias.float()
        return s

    def forward(q, k, v, bias, compute_lse, dropout_p, causal, *, scale):
        assert compute_lse and dropout_p == 0.0
        s = scores(q, k, bias, causal, scale)
        lse = torch.logsumexp(s, -1)
        out = torch.exp(s - lse[..., None]) @ v.float()  # NaN in a row that sees no key
        padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), float("nan"))
        padded[..., : lse.shape[-1]] = lse
        return out.to(q.dtype), padded, torch.empty(()), torch.empty(())

    def backward(do, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, causal, *, scale):
        m = q.shape[2]
        assert lse.is_contiguous() and lse.shape[-1] % 32 == 0 and lse.shape[-1] >= m and dropout_p == 0.0
        assert do.dtype == out.dtype == q.dtype and list(grad_input_mask) == [True, True, True, False]
        p = torch.exp(scores(q, k, bias, causal, scale) - lse[..., :m, None])
        do32 = do.float()
        delta = (do32 * out.float()).sum(-1)
        ds = p * (do32 @ v.float().transpose(-1, -2) - delta[..., None])
        return (
            ((ds @ k.float()) * scale).to(q.dtype),
            ((ds.transpose(-1, -2) @ q.float()) * scale).to(k.dtype),
            (p.transpose(-1, -2) @ do32).to(v.dtype),
            None,
        )

    return CudaEfficient(forward, backward)


def run_losses(out, steps: int) -> list[float]:
    """The per-step losses a run logged in ``out/metrics.jsonl`` (one record per step 1..steps, asserted)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, steps + 1))
    return [x["loss"] for x in records]


def final_weights(out, steps: int) -> dict[str, torch.Tensor]:
    """The whole tensors of a run's checkpoint at step ``steps`` (its latest), whatever layout wrote it."""
    path = ckpt.find_latest(str(out / "checkpoints"))
    assert path is not None and path.endswith(f"step_{steps:06d}"), path
    reader = PieceReader(path, "model")
    return {k: reader.read(k) for k in reader.keys()}


#: a tiny latent attention (``model.attention=mla``): ``n + r = 12`` keys against ``v = 6`` values, so on a CPU SDPA's
#: math path runs (the fused kernel needs equal sizes)
MLA_SHAPE = (
    "model.attention=mla",
    "model.d_model=64",
    "model.n_heads=4",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=4",
    "model.v_head_dim=6",
)
