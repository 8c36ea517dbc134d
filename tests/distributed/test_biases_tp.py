"""Projection biases (``model.qkv_bias``, ``o_bias``, ``mlp_bias``) on a llama under tensor parallelism: the
column-parallel biases split with their heads and channels, the row-parallel ones added once after the reduction,
and the fused projections' biases interleaved like their weights. tp=2 (with sequence parallelism, and with fused
projections) trains like one process."""

import pytest
import torch
from helpers import tiny_config

from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 6
BIASES = ("model.qkv_bias=true", "model.o_bias=true", "model.mlp_bias=true", "train.eps=1e-6")


def _train(tmp, tp, overrides):
    """Losses and ``{name: (this rank's tensor, global shape, offset)}`` of every parameter."""
    cfg = tiny_config(tmp, "parallel.bucket_mb=0.05", f"parallel.tp={tp}", *BIASES, *overrides, steps=STEPS)
    tr = Trainer(cfg, ParallelDims(tp=tp).build(torch.device("cpu")), quiet=True)
    losses = [tr.train_step()["loss"] for _ in range(STEPS)]
    specs, pieces = tr.engine.placements(), {}
    for name, p in tr.engine.full_state().items():
        spec = specs.get(name)
        shape, offset = (spec.global_shape, spec.offset) if spec else (tuple(p.shape), (0,) * p.dim())
        pieces[name] = (p.detach().float().clone(), shape, offset)
    return losses, pieces


def _assemble(per_rank):
    whole = {}
    for name, (_, shape, _) in per_rank[0].items():
        full = torch.full(shape, float("nan"))
        for pieces in per_rank:
            t, _, offset = pieces[name]
            full[tuple(slice(o, o + n) for o, n in zip(offset, t.shape))] = t
        whole[name] = full
    return whole


@pytest.mark.parametrize(
    "extra", [("parallel.sequence_parallel=true",), ("model.fused_proj=true",)], ids=["tp2-sp", "tp2-fused"]
)
def test_biased_llama_at_tp2_trains_like_one_process(tmp_path, extra):
    cache = f"data.cache_dir={tmp_path}/cache"
    fused = [e for e in extra if e.startswith("model.")]
    ((ref_losses, ref_pieces),) = run_ranks(1, _train, str(tmp_path), 1, [cache, *fused])
    ref = _assemble([ref_pieces])
    biases = [n for n in ref if n.endswith(".bias")]
    part = "qkv_proj" if fused else "q_proj"
    want = {f"layers.0.attn.{part}.bias", "layers.0.attn.o_proj.bias", "layers.0.mlp.down_proj.bias"}
    assert want <= set(biases), biases
    assert all(ref[n].abs().max() > 0 for n in biases)  # trained away from their zero start
    results = run_ranks(2, _train, str(tmp_path), 2, [cache, *extra])
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    weights = _assemble([pieces for _, pieces in results])
    assert weights.keys() == ref.keys()
    for n, w in weights.items():
        assert torch.allclose(w, ref[n], atol=1e-5, rtol=0), (n, (w - ref[n]).abs().max())
