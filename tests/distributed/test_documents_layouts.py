"""Packed documents (``data.document_mask=true``) under every layout that takes document ids (the n-D tensor grids
refuse them for now: tests/unit/test_documents.py):

* context parallelism, ring and all-to-all: each document's per-token losses and the gradients equal those of the
  document run alone (fp32, 1e-5), with documents straddling the ring's chunks and one longer than a chunk;
* training: the same losses as one process for 6 steps (fp32, 1e-4 relative), and farther than that from the
  unmasked run's, so each layout really applies the mask."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_losses_track, efficient_attention_stand_in, short_documents, tiny_config

from trickles.models.config import ModelConfig
from trickles.models.documents import document_ids
from trickles.models.presets import apply_preset
from trickles.models.transformer import build_model
from trickles.parallel.context import apply_context_parallel
from trickles.parallel.ring_blocks import Matmul
from trickles.parallel.sequence import positions
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 6
CPU = torch.device("cpu")
COMMON = ["train.eps=1e-6", "parallel.bucket_mb=0.05", "data.seq_len=64"]  # 64 tokens: several documents a row
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=64"]


EOS = 0


def _alone(model, x, y, ids):
    """Per-token losses ``[B, T]`` of each document run by itself, and the gradients of their sum."""
    model.zero_grad()
    out = torch.empty(y.shape)
    for r in range(x.shape[0]):
        cuts = [0] + [i for i in range(1, x.shape[1]) if ids[r, i] != ids[r, i - 1]] + [x.shape[1]]
        for a, b in zip(cuts[:-1], cuts[1:]):
            loss = F.cross_entropy(model(x[r : r + 1, a:b])[0], y[r, a:b], reduction="none")
            loss.sum().backward()
            out[r, a:b] = loss.detach()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed_on_cp(mode, preset, blocks=None):
    """This cp rank's tokens of a packed batch through a context-parallel model: the largest gaps of the per-token
    losses and of the gradients (summed over the cp ranks) to the documents run alone. ``blocks``: the ring's block
    kernel in place of the device's -- ``"matmul"`` (fp32 matmuls, the fallback) or ``"cuda"`` (the glue around
    CUDA's memory-efficient kernel with the masks as its bias, over stand-ins that keep its contract)."""
    import trickles.parallel.ring as ring

    real = ring.kernel_for
    if blocks is not None:
        kernel = Matmul if blocks == "matmul" else efficient_attention_stand_in()
        ring.kernel_for = lambda q: kernel
    try:
        return _packed_on_cp_run(mode, preset)
    finally:
        ring.kernel_for = real


def _packed_on_cp_run(mode, preset):
    topo = ParallelDims(cp=torch.distributed.get_world_size()).build(CPU)
    comm = topo.comm("cp")
    cfg = apply_preset(ModelConfig(preset=preset), preset)
    cfg.vocab_size, cfg.max_seq_len = 256, 64
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 200, (2, 33), generator=g)
    tokens[0, [3, 5, 14, 27]] = EOS  # with cp=4 chunks of 4 tokens: [5, 14) spans three of them
    tokens[1, [11, 12, 30]] = EOS
    x, y = tokens[:, :-1], tokens[:, 1:]
    ids = document_ids(x, EOS)
    want, want_grads = _alone(build_model(cfg, seed=3), x, y, ids)
    model = build_model(cfg, seed=3)
    apply_context_parallel(model, comm, mode)
    pos = positions(x.shape[1], comm.size, comm.rank, mode)
    logits = model(x[:, pos].contiguous(), documents=ids)
    losses = F.cross_entropy(logits.flatten(0, 1), y[:, pos].flatten(), reduction="none").view(2, -1)
    losses.sum().backward()
    grads = {n: comm.all_reduce(p.grad.clone()) for n, p in model.named_parameters()}
    loss_gap = float((losses.detach() - want[:, pos]).abs().max())
    grad_gap = max(float((grads[n] - want_grads[n]).abs().max()) for n in grads)
    return loss_gap, grad_gap


@pytest.mark.parametrize(
    "world,mode,preset,blocks",
    [
        (2, "ring", "tiny", None),
        (2, "ring", "tiny", "matmul"),
        (2, "ring", "tiny", "cuda"),
        (2, "ulysses", "gpt2-tiny", None),
        (4, "ring", "gpt2-tiny", None),
    ],
)
def test_each_document_under_context_parallelism_is_as_if_alone(world, mode, preset, blocks):
    for loss_gap, grad_gap in run_ranks(world, _packed_on_cp, mode, preset, blocks):
        assert loss_gap <= 1e-5 and grad_gap <= 1e-5, (loss_gap, grad_gap)


def _cp_memory(mode, preset):
    """This cp rank's saved bytes per layer and in the head for a packed micro-batch, and the memory model's."""
    from trickles.memory.activations import ActivationMeter, activation_bytes

    comm = ParallelDims(cp=torch.distributed.get_world_size()).build(CPU).comm("cp")
    cfg = apply_preset(ModelConfig(preset=preset), preset)
    cfg.vocab_size, cfg.max_seq_len = 256, 64
    model = build_model(cfg, seed=3)
    apply_context_parallel(model, comm, mode)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 200, (2, 33), generator=g)
    tokens[0, [3, 5, 14, 27]] = EOS
    x, y = tokens[:, :-1], tokens[:, 1:]
    pos = positions(x.shape[1], comm.size, comm.rank, mode)
    with ActivationMeter(model) as meter:
        loss = model(x[:, pos].contiguous(), target=y[:, pos].contiguous(), documents=document_ids(x, EOS))
    loss.backward()
    want = activation_bytes(cfg, 2, 32, cp=comm.size, cp_mode=mode, documents=True)
    return [meter.per_layer[f"layers.{i}"] for i in range(cfg.n_layers)] + [meter.per_layer["head"]], want[
        "per_layer"
    ] + [want["head"]]


@pytest.mark.parametrize("mode,preset", [("ring", "tiny"), ("ulysses", "tiny"), ("ulysses", "gpt2-tiny")])
def test_the_memory_model_counts_each_cp_ranks_document_masks(mode, preset):
    """Per layer and in the head, to the byte: the ring keeps per-row positions and tables only, the all-to-all
    mode also the whole sequence's mask and the repeated key/value heads of its query heads."""
    for measured, predicted in run_ranks(2, _cp_memory, mode, preset):
        assert measured == predicted


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The data settings: a corpus of short documents (tests/helpers.py) and its cache."""
    tmp = tmp_path_factory.mktemp("documents-cache")
    return (f"data.cache_dir={tmp}", *short_documents(tmp / "lines.jsonl"))


def _losses(tmp, cache, overrides, world=1):
    cfg = tiny_config(tmp, *cache, *COMMON, *overrides, steps=STEPS)
    trainer = Trainer(cfg, cfg.validate(world).build(CPU), quiet=True)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


_REFERENCE = {}


def _reference(tmp, cache, extra):
    key = (cache, tuple(extra))
    if key not in _REFERENCE:
        _REFERENCE[key] = (
            _losses(tmp / "masked", cache, ["data.document_mask=true", *extra]),
            _losses(tmp / "plain", cache, extra),
        )
    return _REFERENCE[key]


@pytest.mark.parametrize(
    "layout,extra",
    [
        (["parallel.dp=2", "parallel.zero=3"], []),
        (
            ["parallel.tp=2", "parallel.sequence_parallel=true"],
            ["model.preset=gpt2-tiny"],
        ),  # learned positions, cut by sp
        (["parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=2"], []),
        (["parallel.ep=2", "parallel.dp=2", "parallel.zero=1"], MOE),
        (["parallel.cp=2", "parallel.cp_mode=ring"], []),
        (["parallel.cp=2", "parallel.cp_mode=ulysses"], []),
        (["parallel.dp=2", "parallel.cp=2", "parallel.cp_mode=ring"], []),
    ],
    ids=["dp2-zero3", "tp2-sp", "pp2-1f1b", "moe-ep2", "cp2-ring", "cp2-all-to-all", "dp2-cp2-ring"],
)
def test_layout_invariance_with_document_masks(tmp_path, cache, layout, extra):
    masked, plain = _reference(tmp_path, cache, extra)
    world = 4 if "parallel.dp=2" in layout and "parallel.cp=2" in layout else 2
    for losses in run_ranks(
        world, _losses, tmp_path / "layout", cache, ["data.document_mask=true", *extra, *layout], world
    ):
        assert_losses_track(losses, masked, 1e-4, wrong={"no document mask": plain})
