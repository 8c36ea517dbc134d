"""Pipeline stages under ZeRO-2 and ZeRO-3: each layout trains like one process (fp32, losses and gathered weights), and
the data-parallel collectives of a step are the ones the engines' docstrings promise -- ZeRO-2 reduce-scatters each
bucket of a stage once per step (not once per micro-batch), ZeRO-3 gathers each unit for every micro-batch's forward and
again for its backward and reduce-scatters its gradient once per micro-batch.

The memory report's stages under both are in tests/distributed/test_memory_pipeline.py, the checkpoints' reshards in
tests/distributed/test_reshard.py, the refused combinations in tests/unit/test_schedules.py."""

import pytest
import torch
from test_pipeline import INVARIANCE_STEPS, _assemble, _pieces, _trainer, reference

from trickles.testing import run_ranks


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This run's tokenized-data cache, shared by the module's tests (spawned ranks get it in their overrides)."""
    return f"data.cache_dir={tmp_path_factory.mktemp('pipeline-cache')}"


# (preset, layers, dp, pp, schedule, zero, extra)
CASES = [
    ("tiny", 8, 1, 2, "1f1b", 2, ()),
    ("tiny", 8, 1, 2, "1f1b", 3, ()),
    # ZeRO-3 units over two replicas, two chunks a rank (the root gathered around the first and the last chunk)
    ("tiny", 8, 2, 2, "interleaved", 3, ("parallel.virtual_stages=2",)),
    # ZeRO-2 with the backward split into B and W, and the tied embedding on ZB-V's rank 0, used by two of its chunks:
    # its bucket waits for both chunks' last W
    ("gpt2-tiny", 8, 2, 2, "zb-v", 2, ("parallel.virtual_stages=2",)),
]


def _case_id(c):
    preset, layers, dp, pp, schedule, zero, _ = c
    return f"{preset}-dp{dp}-pp{pp}-{schedule}-zero{zero}"


def _run(tmp, dp, pp, overrides, steps):
    """Losses, this rank's pieces, the last step's collectives and what to count them against."""
    tr = _trainer(tmp, dp, 1, pp, overrides, steps)
    losses = []
    for i in range(steps):
        if i == steps - 1:
            tr.topo.ledger.reset()
        losses.append(tr.train_step()["loss"])
    e, ops = tr.engine, tr.topo.ledger.snapshot()  # (before _pieces: ZeRO-3's full_state gathers)
    layout = {"buckets": len(e.layout.buckets), "elements": e.layout.total} if e.stage == 2 else {"units": len(e.units)}
    return losses, _pieces(e), ops, tr.pipeline.shape.m, layout, e.memory()


@pytest.mark.parametrize("preset,layers,dp,pp,schedule,zero,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_pipeline_with_zero_trains_like_one_process(tmp_path, cache, preset, layers, dp, pp, schedule, zero, extra):
    """Losses within 1e-4 relative of one process's, gathered weights within 1e-5, over 6 steps; the step's
    data-parallel collectives counted."""
    ref_losses, ref_weights = reference(str(tmp_path), cache, preset, layers)
    overrides = [
        cache,
        f"model.preset={preset}",
        f"model.n_layers={layers}",
        f"parallel.schedule={schedule}",
        f"parallel.zero={zero}",
        *extra,
    ]
    results = run_ranks(dp * pp, _run, str(tmp_path), dp, pp, overrides, INVARIANCE_STEPS, timeout=600)
    for losses, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
    for d in range(dp):
        weights = _assemble([results[s * dp + d][1] for s in range(pp)])
        assert weights.keys() == ref_weights.keys()
        for n, w in weights.items():
            assert torch.allclose(w, ref_weights[n], atol=1e-5, rtol=0), (n, (w - ref_weights[n]).abs().max())
    if dp == 1:
        return
    for _, _, ops, m, layout, held in results:
        rs, ag = ops["reduce_scatter/dp"], ops["all_gather/dp"]
        if zero == 2:  # once per step: every bucket reduce-scattered and its update gathered, the whole stage once
            assert rs["calls"] == ag["calls"] == layout["buckets"]
            assert rs["bytes"] == 4 * layout["elements"]
            assert held["gradients"] == 4 * layout["elements"] // dp  # between steps only the shard
        else:  # every unit gathered for each micro-batch's F and B, reduced once per micro-batch
            assert ag["calls"] == 2 * m * layout["units"] and rs["calls"] == m * layout["units"]
            assert ag["wire_bytes"] == 2 * rs["wire_bytes"]  # each moves (N-1)/N of the unit per call
