"""The memory report counts the Gemma pieces to the byte: a tiny Gemma-2-like model (sandwich ``(1 + w)`` norms,
GeGLU, scaled embedding, ``query_pre_attn_scalar``, soft-capped attention and final logits, a local/global window
pattern) and a Gemma-3-like one (per-head q/k norms, a local rotary base, no caps), predicted against the
saved-tensor meter per layer and for the head in every recomputation mode, and the whole report at tp2 with sequence
parallelism."""

import pytest
import torch
from helpers import tiny_config

from trickles.memory.activations import ActivationMeter, activation_bytes
from trickles.memory.report import measure, predict
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

GEMMA = [
    "model.norm_placement=sandwich",
    "model.norm_unit_offset=true",
    "model.mlp_activation=gelu_tanh",
    "model.embed_scale=true",
    "model.query_pre_attn_scalar=16",
    "model.sliding_window=8",  # shorter than the sequence (32): the local layer's mask cuts
    "model.window_layers=[true, false]",
]
GEMMA2 = [*GEMMA, "model.attn_softcap=50", "model.final_softcap=30"]
GEMMA3 = [*GEMMA, "model.qk_norm=head", "model.rope_local_theta=1000"]
CASES = {"gemma2-bf16": (GEMMA2, "bf16"), "gemma3-fp32": (GEMMA3, "fp32")}


@pytest.mark.parametrize("case", list(CASES))
def test_gemma_pieces_are_counted_per_layer_in_every_recompute_mode(tmp_path, case):
    """Soft-capped scores keep their tanh, fp32 probabilities (and their cast below fp32) and the inverted mask in
    place of the log-sum-exp; a window's SDPA mask and, with grouped heads, ``o_proj``'s copy of the core's output;
    the capped logits' tanh and the embedding's scale in the head; the ``(1 + w)`` norms and GeGLU as RMSNorm and
    SwiGLU."""
    overrides, precision = CASES[case]
    for mode in ("none", "elementwise", "selective", "full"):
        cfg = tiny_config(
            tmp_path, *overrides, f"memory.precision={precision}", f"memory.recompute={mode}", "train.global_batch=2"
        )
        tr = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
        x, y = tr.train_data.micro_batches(0, 2, 2)[0]
        with ActivationMeter(tr.model) as meter:
            tr._loss(x, y).backward()
        predicted = activation_bytes(tr.model_cfg, 2, 32, mode, 2 if precision == "bf16" else 4)
        measured = [meter.per_layer[f"layers.{i}"] for i in range(tr.model_cfg.n_layers)]
        assert measured == predicted["per_layer"], (mode, measured, predicted["per_layer"])
        assert meter.per_layer["head"] == predicted["head"], (mode, meter.per_layer["head"], predicted["head"])


def _report(tmp, cache, overrides):
    cfg = tiny_config(tmp, cache, *overrides, steps=3)
    tr = Trainer(cfg, cfg.validate(2).build(torch.device("cpu")), quiet=True)
    report = measure(tr, predict(tr.cfg, tr.topo.dims, tr.model_cfg), steps=2)
    keys = ("parameters", "gradients", "optimizer", "activations", "head", "held")
    return [{k: r[k] for k in keys} for r in (report.predicted, report.measured)]


TP2_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
ULYSSES = ("parallel.cp=2", "parallel.cp_mode=ulysses")
LAYOUTS = [("gemma2-bf16", "none", TP2_SP), ("gemma3-fp32", "elementwise", TP2_SP), ("gemma2-bf16", "none", ULYSSES)]


@pytest.mark.parametrize("case,recompute,layout", LAYOUTS, ids=["gemma2-tp2-sp", "gemma3-tp2-sp", "gemma2-ulysses"])
def test_the_gemma_reports_on_two_ranks_are_exact(tmp_path, case, recompute, layout):
    """Two ranks, each with two query heads sharing one key/value head and a vocabulary slice: its soft-capped
    scores or its window's mask and output copy, its slice of the capped logits, its share of the parameters; and
    all-to-all context parallelism, whose core sees whole sequences on half the heads and keeps no output of its
    own beside ``o_proj``'s."""
    overrides, precision = CASES[case]
    overrides = [*overrides, f"memory.precision={precision}", f"memory.recompute={recompute}", *layout]
    cache = f"data.cache_dir={tmp_path}/cache"
    for predicted, measured in run_ranks(2, _report, str(tmp_path), cache, overrides):
        assert predicted == measured, (predicted, measured)


def _grid_saved(tmp, cache, overrides):
    from trickles.parallel.tensor.activation_costs import activation_bytes_nd
    from trickles.parallel.tensor.layout import Layout

    cfg = tiny_config(tmp, cache, *overrides, "train.micro_batch=4", steps=2)
    tr = Trainer(cfg, cfg.validate(4).build(torch.device("cpu")), quiet=True)
    x, y = tr.train_data.micro_batches(0, 8, 4)[0]
    with ActivationMeter(tr.model) as meter:
        tr._loss(x, y).backward()
    predicted = activation_bytes_nd(tr.model_cfg, Layout.of("2d", 4), 4, 32, 2, "none")
    return [meter.per_layer[f"layers.{i}"] for i in range(2)], predicted["per_layer"]


def test_soft_capped_scores_on_a_2d_grid_are_counted(tmp_path):
    """A 2-D grid rank (q = 2) runs the explicit path on its two sequences and two heads: it keeps the scores'
    tensors in place of the fused kernel's output and log-sum-exp (``o_proj`` keeps its gathered copy)."""
    overrides = ["model.attn_softcap=50", "model.n_kv_heads=4", "memory.precision=bf16"]
    overrides += ["parallel.tp=4", "parallel.tp_mode=2d"]
    cache = f"data.cache_dir={tmp_path}/cache"
    for measured, predicted in run_ranks(4, _grid_saved, str(tmp_path), cache, overrides):
        assert measured == predicted, (measured, predicted)
