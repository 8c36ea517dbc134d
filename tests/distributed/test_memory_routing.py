"""Expert parallelism under a learned router: the activations predicted at the routing the run saw equal the measured
ones block by block (:mod:`trickles.memory.routing`), whatever the imbalance."""

import torch
from helpers import tiny_config

from trickles.memory.report import measure, predict
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")


def _routing(tmp):
    cfg = tiny_config(tmp, "model.moe_experts=4", "model.moe_top_k=2", "parallel.ep=2", "parallel.zero=1", steps=3)
    tr = Trainer(cfg, cfg.validate(2).build(CPU), quiet=True)
    rep = measure(tr, predict(tr.cfg, tr.topo.dims, tr.model_cfg), steps=2)
    return rep.routing, rep.layers_predicted, rep.layers_measured, rep.notes


def test_activations_at_the_routing_seen_equal_the_measured(tmp_path):
    results = run_ranks(2, _routing, str(tmp_path))
    received = []
    for routing, predicted, measured, notes in results:
        assert routing and set(routing) == set(range(len(predicted)))  # every block of tiny is an MoE block here
        for layer, r in routing.items():
            assert r["predicted_at_load"] == measured[layer], (layer, r)
            # the balanced prediction is off exactly where the load is
            assert (r["predicted_at_load"] == predicted[layer]) == (r["received"] == r["balanced"])
        received.append([routing[k]["received"] for k in sorted(routing)])
        assert any(n.startswith("routing seen") for n in notes)
    # the two ranks' experts receive every assignment of the group's tokens between them
    balanced = results[0][0][0]["balanced"]
    assert all(a + b == 2 * balanced for a, b in zip(*received))
