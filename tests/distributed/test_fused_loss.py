"""The fused kernels under parallel layouts: the same losses and weights as one process running eager PyTorch.

``model.fused_loss=true`` puts the chunked cross-entropy (:mod:`trickles.kernels.cross_entropy`) on its PyTorch path
under data, tensor (vocabulary-parallel, with sequence parallelism) and pipeline parallelism, 6 steps in fp32
against the unfused one-process run; ``model.kernels=triton`` runs every Triton kernel (in Triton's interpreter
without a GPU) for a short tensor-parallel case of each model flavour. The fused loss's memory saving is measured
against the memory report's prediction.
"""

import math

import pytest
import torch
from helpers import assert_losses_track, assert_weights_track, tiny_config

from trickles.models.fused import fuse_state
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

STEPS = 6  # fp32 layout invariance: a wrong gradient, shard or message shows in the first steps
CPU = torch.device("cpu")
EPS = "train.eps=1e-6"  # as in the other layout tests: fp32 rounding of near-zero gradients would dominate
FUSED = ["model.fused_loss=true", "model.loss_chunk=48"]  # 256 tokens per micro-batch: chunks of 48, the last of 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('fused-cache')}"


def _train(tmp, dims, overrides, steps=STEPS):
    """Losses, the final weights (each with its block's offset in the global tensor) and the initial ones."""
    cfg = tiny_config(tmp, EPS, *(f"parallel.{k}={v}" for k, v in dims.items()), *overrides, steps=steps)
    tr = Trainer(cfg, cfg.validate(math.prod(dims.values())).build(CPU), quiet=True)

    def state():
        specs = tr.engine.placements()
        return {
            n: (t.detach().float().clone(), specs[n].offset if specs.get(n) else (0,) * t.dim())
            for n, t in tr.engine.full_state().items()
        }

    start = state()
    fused = tr.model.loss.is_fused(torch.empty(0)) if tr.model.loss is not None else None
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return losses, state(), start, fused, tr.model_cfg


_REFERENCE = {}


def _reference(tmp, cache, extra=(), steps=STEPS):
    """One eager, unfused process (and one at a 5% lower learning rate), once per module run."""
    key = (cache, tuple(extra), steps)
    if key not in _REFERENCE:
        common = [cache, *extra]
        _REFERENCE[key] = (
            run_ranks(1, _train, tmp, {}, common, steps)[0],
            run_ranks(1, _train, tmp, {}, [*common, "train.lr=2.85e-3"], steps)[0][0],
        )
    return _REFERENCE[key]


def _check(run, reference, slower):
    losses, weights, start, fused, model_cfg = run
    assert fused in (True, None), "the case did not run the fused loss"  # None: a pipeline stage without the head
    assert_losses_track(losses, reference[0], 1e-4, wrong={"lr 5% lower": slower})
    # with the Triton kernels the projections are fused too: compare with the reference's parts put together
    whole = fuse_state(model_cfg, {n: w[0] for n, w in reference[1].items()})
    # gpt2's key bias gets no gradient (softmax does not see a shift shared by all keys): it never moves
    names = [n for n in weights if not n.endswith(("k_proj.bias", "qkv_proj.bias"))]
    ref = {n: whole[n][tuple(slice(o, o + k) for o, k in zip(weights[n][1], weights[n][0].shape))] for n in names}
    return assert_weights_track({n: weights[n][0] for n in names}, ref, {n: start[n][0] for n in names}, 1e-5)


LAYOUTS = [  # (id, degrees, overrides)
    ("one-process", {}, []),
    ("dp2-zero1", {"dp": 2}, ["parallel.zero=1"]),
    ("tp2-sp", {"tp": 2}, ["parallel.sequence_parallel=true"]),
    ("pp2-1f1b", {"pp": 2}, ["train.micro_batch=2"]),
]


@pytest.mark.parametrize("dims,overrides", [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_fused_loss_layout_invariance(tmp_path, cache, dims, overrides):
    """6 steps, fp32: losses within 1e-4 relative and every weight within 1e-5 of the eager one-process run."""
    reference, slower = _reference(str(tmp_path), cache)
    for run in run_ranks(
        math.prod(dims.values()) if dims else 1, _train, str(tmp_path), dims, [cache, *FUSED, *overrides]
    ):
        _check(run, reference, slower)


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_triton_kernels_under_tensor_parallelism(tmp_path, cache, preset):
    """Every Triton kernel (norms, rotary or none, SwiGLU or GELU, the fused vocabulary-parallel loss, and the fused
    q/k/v and gate/up projections they bring by default) at tp=2 with sequence parallelism, 2 steps on two
    sequences of 8 (Triton's interpreter runs every program in Python): the eager unfused one-process run's losses and
    weights. The output weight is tied to the embedding (gpt2's default), so that every row of each rank's vocabulary
    slice gets a gradient in every step (the byte tokenizer's upper rows never occur as inputs)."""
    short = [f"model.preset={preset}", "data.seq_len=8", "train.global_batch=2", "model.tie_embeddings=true"]
    reference, slower = _reference(str(tmp_path), cache, short, steps=2)
    runs = run_ranks(
        2,
        _train,
        str(tmp_path),
        {"tp": 2},
        [cache, *short, "model.kernels=triton", "parallel.sequence_parallel=true"],
        2,
    )
    for run in runs:
        _check(run, reference, slower)


def _peaks(tmp, cache, vocab, fused):
    """The step's peak allocation (after a warm-up step), the head's saved bytes, and the report's prediction."""
    from trickles.memory.accounting import peak_allocated
    from trickles.memory.activations import ActivationMeter
    from trickles.memory.report import predict

    cfg = tiny_config(
        tmp,
        cache,
        f"model.vocab_size={vocab}",
        f"model.fused_loss={str(fused).lower()}",
        "model.loss_chunk=32",
        "train.micro_batch=8",
    )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cfg.parallel.tp = world
    cfg.parallel.sequence_parallel = world > 1
    dims = cfg.validate(world)
    tr = Trainer(cfg, dims.build(CPU), quiet=True)
    tr.train_step()
    _, peak = peak_allocated(tr.train_step)
    x, y = tr.train_data.micro_batches(0, 8, 8)[0]
    with ActivationMeter(tr.model) as meter:
        loss = tr._loss(x, y)
    loss.backward()
    return peak, meter.per_layer["head"], predict(cfg, dims, tr.model_cfg)


@pytest.mark.parametrize("vocab", [32768])
def test_fused_loss_saves_the_logits_bytes_the_report_predicts(tmp_path, cache, vocab):
    """A training step's peak with and without the fused loss (CPU: every allocation tracked by the profiler): the
    saving equals the report's predicted one within 10% (measured: 0.01%); the head keeps exactly the formula's
    bytes, one process and tp=2 with sequence parallelism."""
    ((plain, plain_head, plain_rep),) = run_ranks(1, _peaks, str(tmp_path), cache, vocab, False)
    ((fused, fused_head, fused_rep),) = run_ranks(1, _peaks, str(tmp_path), cache, vocab, True)
    predicted = plain_rep.predicted["peak"] - fused_rep.predicted["peak"]
    s, v = 8 * 32, vocab
    assert predicted > 8 * s * v  # most of the unfused loss's 12 sV bytes of logits and their gradients
    assert abs((plain - fused) - predicted) <= 0.1 * predicted, (plain - fused, predicted)
    assert plain_head == plain_rep.predicted["head"] and fused_head == fused_rep.predicted["head"]
    assert any("fused loss" in n for n in fused_rep.notes) and not any("fused loss" in n for n in plain_rep.notes)
    for _, head, rep in run_ranks(2, _peaks, str(tmp_path), cache, vocab, True):
        assert head == rep.predicted["head"]
