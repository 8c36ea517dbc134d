"""q/k norms and norms after attention and the MLP under tensor parallelism: a per-head q/k norm local to each rank
(its weight replicated, its gradient from the rank's heads summed; key/value heads replicated where tp does not
divide them), a full-width one split with the heads (its sum of squares all-reduced), post norms on sequence shards.
tp=2 with sequence parallelism trains like one process (the runs and the comparison are test_biases_tp's)."""

import pytest
import torch
from helpers import tiny_config
from test_biases_tp import STEPS, _assemble, _train

from trickles.errors import ConfigError
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

CASES = {
    # Qwen3-like, plus norms in both places (Gemma's sandwich); one key/value head: replicated on both ranks
    "head-sandwich-kv1": ("model.qk_norm=head", "model.norm_placement=sandwich", "model.n_kv_heads=1"),
    # OLMo 2-like
    "full-post": ("model.qk_norm=full", "model.norm_placement=post"),
    # fused q/k/v: a rank's query heads are whole key/value groups', still one contiguous slice of the norm
    "full-post-fused": ("model.qk_norm=full", "model.norm_placement=post", "model.fused_proj=true"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qk_norms_at_tp2_sp_train_like_one_process(tmp_path, case):
    model = [f"data.cache_dir={tmp_path}/cache", *CASES[case]]
    ((ref_losses, ref_pieces),) = run_ranks(1, _train, str(tmp_path), 1, model)
    ref = _assemble([ref_pieces])
    norms = [n for n in ref if n.startswith("layers.0.") and "norm" in n]
    want = {f"layers.0.{n}.weight" for n in ("attn.q_norm", "attn.k_norm", "attn_post_norm", "mlp_post_norm")}
    assert want <= set(norms), norms
    assert ("layers.0.attn_norm.weight" in norms) == CASES[case][1].endswith("sandwich"), norms
    assert all((ref[n] - 1).abs().max() > 0 for n in norms)  # trained away from their start at one
    results = run_ranks(2, _train, str(tmp_path), 2, [*model, "parallel.sequence_parallel=true"])
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


def test_qwen3_like_model_at_pp2_trains_like_one_process(tmp_path):
    """The pipeline splits whole blocks: per-head q/k norms and post norms travel with them."""
    model = [f"data.cache_dir={tmp_path}/cache", "model.qk_norm=head", "model.norm_placement=sandwich"]
    (ref,) = run_ranks(1, _losses, str(tmp_path), 1, model)
    for losses in run_ranks(2, _losses, str(tmp_path), 2, model):
        assert losses == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.qk_norm=full", "model.n_kv_heads=1", "parallel.tp=2"), "model.qk_norm=full splits the key norm"),
        (("model.norm_placement=post", "parallel.tp=4", "parallel.tp_mode=2d"), "norms after attention and MLP"),
        (("model.preset=gpt2-tiny", "model.qk_norm=head"), "model.qk_norm=head normalizes rotary queries"),
    ],
    ids=["full-kv1-tp2", "post-grid", "gpt2"],
)
def test_qk_norm_layouts_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_config(tmp_path, *overrides).validate(4)
    assert "\n" not in str(e.value)
