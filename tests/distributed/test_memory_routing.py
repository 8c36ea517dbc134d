"""Expert parallelism under a learned router: the activations predicted at the routing the run saw equal the measured
ones block by block (:mod:`trickles.memory.routing`), whatever the imbalance."""

import dataclasses

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


def _skewed(tmp):
    """Sigmoid routing whose bias sends every token to experts 0 and 1, both on expert-parallel rank 0: the most the
    router can send that rank."""
    cfg = tiny_config(
        tmp, "model.moe_experts=4", "model.moe_top_k=2", "model.moe_router_score=sigmoid", "parallel.ep=2", steps=3
    )
    tr = Trainer(cfg, cfg.validate(2).build(CPU), quiet=True)
    for name, buf in tr.model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    bound = predict(tr.cfg, tr.topo.dims, tr.model_cfg)
    at = dataclasses.replace(tr.cfg, memory=dataclasses.replace(tr.cfg.memory, expert_load="bound"))
    rep = measure(tr, predict(at, tr.topo.dims, tr.model_cfg), steps=2)
    return tr.topo.comm("ep").rank, bound.expert_bound, rep.routing, rep.layers_predicted, rep.layers_measured


def test_the_expert_bound_is_what_a_skewed_router_fills(tmp_path):
    """The report's bound (``memory.expert_load=bound``, what ``trickles plan`` assumes) is reached: with every token
    routed to rank 0's experts, rank 0 receives exactly the bound's rows, and its MoE blocks keep exactly the
    activations predicted at the bound; the balanced report states the bound beside its own figures."""
    for rank, bound, routing, predicted, measured in run_ranks(2, _skewed, str(tmp_path)):
        assert bound["received"] == 2 * bound["balanced"]  # ep x min(k, E / ep) per token against k per token
        assert bound["peak"] > 0 and bound["activations"] > 0
        received = {layer: r["received"] for layer, r in routing.items()}
        if rank == 0:
            assert set(received.values()) == {bound["received"]}
            assert predicted == measured  # every block at the bound, to the byte
        else:
            assert set(received.values()) == {0}


def test_the_planner_plans_for_the_routing_bound(tmp_path):
    """``trickles plan`` confirms an expert-parallel layout with the report at the routing bound unless the config
    sets ``memory.expert_load``: the winner's peak is the bound's, above the balanced one."""
    import json
    import sys

    from trickles.config import Config
    from trickles.planner.layouts import plan_model
    from trickles.testing import run_command

    sets = ["model.moe_experts=4", "model.moe_top_k=2", "parallel.ep=2", "parallel.dp=2"]
    out = tmp_path / "plan.json"
    args = [sys.executable, "-m", "trickles", "plan", "--cluster", "local", "--devices", "2", "--json", str(out)]
    r = run_command([*args, *(a for s in sets for a in ("--set", s))], text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(out.read_text())
    won = next(x for x in plan["layouts"] if x["layout"] == plan["top"][0])
    keys = {k: v for k, v in won.items() if k.startswith(("parallel.", "train.", "memory."))}
    overrides = [*sets, *(f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in keys.items())]
    peaks = {}
    for load in ("balanced", "bound"):
        cfg = Config.load(None, [*overrides, f"memory.expert_load={load}"])
        peaks[load] = predict(cfg, cfg.validate(2), plan_model(cfg)).predicted["peak"]
    assert won["peak_bytes"] == peaks["bound"] > peaks["balanced"]
