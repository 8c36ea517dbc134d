"""Layout invariance of (naive) data parallelism: dp ranks reproduce one process."""

import pytest
import torch

from helpers import tiny_config
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS = 6


def _train(tmp, dp, overrides):
    cfg = tiny_config(tmp, *overrides, steps=STEPS)
    trainer = Trainer(cfg, ParallelDims(dp=dp).build(torch.device("cpu")), quiet=True)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer.topo.ledger.snapshot()


@pytest.mark.parametrize("dp,overrides", [(2, []), (2, ["train.micro_batch=2"]), (4, [])])
def test_dp_matches_single_process(tmp_path, dp, overrides):
    ref_losses, ref_weights, _ = _train(str(tmp_path), 1, overrides)
    out = run_ranks(dp, _train, str(tmp_path), dp, overrides)
    for losses, weights, ledger in out:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        for n, w in weights.items():
            assert torch.allclose(w, ref_weights[n], atol=1e-5, rtol=0), n
        # one all-reduce per parameter per step, of the whole gradient: 2(n-1)/n * 4 bytes * P on the wire
        params = sum(w.numel() for w in weights.values())
        grads = ledger["all_reduce/dp"]
        assert grads["bytes"] == STEPS * (4 * params + 4)  # + the 4-byte loss average
        assert grads["wire_bytes"] == pytest.approx(STEPS * 2 * (dp - 1) / dp * 4 * (params + 1), rel=1e-3)
