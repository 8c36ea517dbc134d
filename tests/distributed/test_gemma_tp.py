"""A Gemma-like llama with every Gemma piece on -- ``(1 + w)`` norms in sandwich placement and per-head q/k norms,
GeGLU, the embedding scale, ``query_pre_attn_scalar``, attention and final-logit soft-capping, a window on the first
layer with its own rotary base -- under tensor parallelism with sequence parallelism (unfused; and with fused
projections and the fused vocabulary-split loss) and under a 2-stage pipeline, trains like one process (the runs and
the comparison are test_biases_tp's)."""

import pytest
import torch
from helpers import tiny_config
from test_biases_tp import STEPS, _assemble, _train

from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

GEMMA = (
    "model.norm_placement=sandwich",
    "model.qk_norm=head",
    "model.norm_unit_offset=true",
    "model.mlp_activation=gelu_tanh",
    "model.embed_scale=true",
    "model.query_pre_attn_scalar=12",
    "model.attn_softcap=1.5",
    "model.final_softcap=2",
    "model.sliding_window=8",
    "model.window_layers=[true, false]",
    "model.rope_local_theta=100",
    "model.tie_embeddings=true",
)


@pytest.mark.parametrize(
    "extra",
    [("parallel.sequence_parallel=true",), ("model.fused_proj=true", "model.fused_loss=true")],
    ids=["tp2-sp", "tp2-fused"],
)
def test_gemma_pieces_at_tp2_train_like_one_process(tmp_path, extra):
    model = [f"data.cache_dir={tmp_path}/cache", *GEMMA, *(e for e in extra if e.startswith("model."))]
    ((ref_losses, ref_pieces),) = run_ranks(1, _train, str(tmp_path), 1, model)
    ref = _assemble([ref_pieces])
    norms = [n for n in ref if "norm" in n]
    assert all(ref[n].abs().max() > 0 for n in norms)  # trained away from their zero start
    results = run_ranks(2, _train, str(tmp_path), 2, [*model, *extra])
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    weights = _assemble([pieces for _, pieces in results])
    assert weights.keys() == ref.keys()
    for n, w in weights.items():
        assert (w - ref[n]).abs().max() <= 1e-5, (n, (w - ref[n]).abs().max())


def _losses(tmp, pp, overrides):
    cfg = tiny_config(tmp, f"parallel.pp={pp}", "train.eps=1e-6", *overrides, steps=STEPS)
    tr = Trainer(cfg, ParallelDims(pp=pp).build(torch.device("cpu")), quiet=True)
    return [tr.train_step()["loss"] for _ in range(STEPS)]


def test_gemma_pieces_at_pp2_train_like_one_process(tmp_path):
    """Each stage's blocks keep their window, rotary part and caps; the last stage caps the logits in the loss."""
    model = [f"data.cache_dir={tmp_path}/cache", *GEMMA]
    (ref,) = run_ranks(1, _losses, str(tmp_path), 1, model)
    for losses in run_ranks(2, _losses, str(tmp_path), 2, model):
        assert losses == pytest.approx(ref, rel=1e-4)
