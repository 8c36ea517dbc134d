"""Checkpoints reshard across layouts: saved at one (dp, ZeRO stage, tp with sequence parallel, pp with virtual stages,
pp under ZeRO-3, cp, ep, the optimizer offloaded to the host or not), loaded at another, training goes on as if nothing
changed -- weights, Adam moments and the data position all come back: the losses within 1e-4 of the straight run's and
its final weights within 1e-5 -- and a rank reads only the slices it needs. With the optimizer offloaded, a resume at
the same layout is exact at ZeRO-2 and ZeRO-3 (ZeRO-1 keeps the optimizer state as ZeRO-2 does; its offloaded checkpoint
reshards in the dp2-pp2-zero1-offload case)."""

import os

import pytest
import torch
from helpers import tiny_config

from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
BEFORE, AFTER = 4, 4  # enough for Adam moments (and the step count) that did not come back to change every later loss
# eps as in the tensor-parallel tests: fp32 rounding of near-zero gradients would otherwise dominate; 8 layers so
# that 4 stages (or 2 x 2 virtual ones) fit; micro-batches of 1 so that an interleaved pipeline gets m % pp == 0.
# The tokenized data is cached under the module's per-run directory (tiny_config: data.cache_dir=<tmp>/cache).
COMMON = ("model.n_layers=8", "parallel.bucket_mb=0.05", "train.eps=1e-6", "train.micro_batch=1")
OFFLOAD = "memory.offload_optimizer=true"
MOE = ["model.moe_experts=4", "model.moe_every=2", "model.moe_ffn_hidden=32", "model.moe_capacity_factor=1.0"]

LAYOUTS = {
    "dp2-zero3": (2, ["parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "dp2-tp2-sp-pp2-interleaved-zero1": (
        8,
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.sequence_parallel=true",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "parallel.zero=1",
        ],
    ),
    "dp1": (1, []),
    "pp2": (2, ["parallel.pp=2", "parallel.schedule=1f1b"]),
    "pp4": (4, ["parallel.pp=4"]),
    "pp2-zero3": (
        2,
        ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=3"],
    ),  # each stage's blocks and ends units
    "dp2-zero1": (2, ["parallel.zero=1"]),
    "dp4-zero2": (4, ["parallel.zero=2"]),
    # the optimizer state and step on the host
    "dp2-zero2-offload": (2, ["parallel.zero=2", OFFLOAD]),
    "dp2-zero3-offload": (2, ["parallel.zero=3", OFFLOAD]),
    "dp2-pp2-zero1-offload": (4, ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=1", OFFLOAD]),
    "dp4-zero2-offload": (4, ["parallel.zero=2", OFFLOAD]),
    # context parallel: the sequence split over ranks that hold the same weights (ZeRO shards over dp x cp);
    # micro-batches of 4 (2 per step instead of 8: the ring's many small blocks made this pair a quarter of the file's
    # time)
    "cp2-zero1": (2, ["parallel.cp=2", "parallel.zero=1", "train.micro_batch=4"]),
    "cp4-ulysses": (4, ["parallel.cp=4", "parallel.cp_mode=ulysses", "train.micro_batch=4"]),
    # mixture of experts (another model: 4 experts in every other block): the experts split over ep ranks
    "moe-ep2": (2, [*MOE, "parallel.ep=2"]),
    "moe-dp1": (1, MOE),
    "moe-ep2-zero1": (
        2,
        [*MOE, "parallel.ep=2", "parallel.zero=1"],
    ),  # ZeRO: dense state over both ranks, experts apart
    "moe-dp4-ep4-zero3": (
        4,
        [*MOE, "parallel.ep=4", "parallel.zero=3"],
    ),  # each block's experts a ZeRO-3 unit of their own
}


def _trainer(tmp, layout, out):
    world, overrides = LAYOUTS[layout]
    cfg = tiny_config(tmp, *COMMON, *overrides, f"train.out_dir={out}", steps=BEFORE + AFTER)
    return Trainer(cfg, cfg.validate(world).build(CPU), quiet=True)


def _save_and_go_on(tmp, layout):
    """BEFORE steps, a checkpoint, then AFTER more steps at the same layout and a checkpoint of where they end."""
    tr = _trainer(tmp, layout, f"{tmp}/{layout}")
    for _ in range(BEFORE):
        tr.train_step()
    path = tr.save_checkpoint()
    losses = [tr.train_step()["loss"] for _ in range(AFTER)]
    return path, losses, tr.save_checkpoint()


def _load_and_go_on(tmp, layout, path):
    """AFTER steps from the checkpoint at another layout; also the tensor bytes this rank read from the checkpoint."""
    from trickles.train import pieces

    tr = _trainer(tmp, layout, f"{tmp}/{layout}-resumed")
    read, region = [], pieces._piece_region

    def counting(*args):
        part, mask = region(*args)
        read.append(part.numel() * part.element_size())
        return part, mask

    pieces._piece_region = counting
    try:
        tr.load_checkpoint(path)
    finally:
        pieces._piece_region = region
    step, consumed, losses = tr.step, tr.consumed, [tr.train_step()["loss"] for _ in range(AFTER)]
    return step, consumed, losses, sum(read), tr.save_checkpoint()


def _weights(path):
    """A checkpoint's whole model, as one process loads it."""
    from trickles.train.load import load_for_inference

    return load_for_inference(path)[0].state_dict()


def _source(tmp, layout):
    world, _ = LAYOUTS[layout]
    (path, straight, end), *rest = run_ranks(world, _save_and_go_on, tmp, layout, timeout=600)
    assert all(r[1] == straight for r in rest)
    return path, straight, _weights(end)


class Sources:
    """Each source layout's checkpoint and straight continuation, made once per run when a case first needs it."""

    def __init__(self, tmp):
        self.tmp, self.made = tmp, {}

    def __getitem__(self, layout):
        if layout not in self.made:
            self.made[layout] = _source(self.tmp, layout)
        return self.made[layout]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reshard"))  # this run's own directory: checkpoints and the data cache
    return tmp, Sources(tmp)


@pytest.mark.parametrize(
    "source,target",
    [  # one pair per idea, each source and target kind at least once
        ("dp2-zero3", "tp2"),
        ("dp2-tp2-sp-pp2-interleaved-zero1", "dp1"),
        ("dp2-tp2-sp-pp2-interleaved-zero1", "pp4"),
        ("dp2-tp2-sp-pp2-interleaved-zero1", "dp4-zero2"),
        ("dp2-zero3", "pp2"),  # ZeRO-3 shards to pipeline stages (the 3-D source above: stages to shards)
        (
            "dp2-pp2-zero1-offload",
            "dp4-zero2-offload",
        ),  # host-offloaded optimizer with pp, loaded offloaded at another dp and stage
        ("cp2-zero1", "cp4-ulysses"),  # context parallel to cp=4 in the other mode
        ("moe-ep2", "moe-dp1"),  # experts by global index: from 2 expert-parallel ranks to one process and to 4
        ("moe-ep2-zero1", "moe-dp4-ep4-zero3"),
        # pipeline stages under ZeRO-3: to data-parallel ZeRO-1, to tensor parallel, and back from a dp x tp x pp layout
        ("pp2-zero3", "dp2-zero1"),
        ("pp2-zero3", "tp2"),
        ("dp2-tp2-sp-pp2-interleaved-zero1", "pp2-zero3"),
    ],
)
def test_checkpoint_loads_at_another_layout_and_training_goes_on_unchanged(sources, source, target):
    tmp, found = sources
    path, straight, weights = found[source]
    assert sorted(n for n in os.listdir(path) if n.startswith("model-")) and os.path.exists(
        os.path.join(path, "manifest.json")
    )
    world, _ = LAYOUTS[target]
    stored = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))
    results = run_ranks(world, _load_and_go_on, tmp, target, path, timeout=600)
    for step, consumed, losses, read, _ in results:
        assert (step, consumed) == (BEFORE, BEFORE * 8)  # the data position came back
        assert losses == pytest.approx(straight, rel=1e-4)
        if target == "pp4":  # a quarter of the model and its Adam state, and the small replicated tensors
            assert read < 0.5 * stored, (read, stored)
        elif target == "dp1":
            assert read > 0.95 * stored, (read, stored)
    # where the AFTER steps end, the whole model as one process loads it: within 1e-5 of the straight run's
    resumed = _weights(results[0][4])
    assert resumed.keys() == weights.keys()
    for name, w in resumed.items():
        assert torch.allclose(w, weights[name], atol=1e-5, rtol=0), (name, (w - weights[name]).abs().max())


def _offload_round_trip(tmp, layout):
    """3 steps, a checkpoint, 3 more; a new trainer at the same layout loads it: the live state at saving and after
    loading (weights, and the optimizer's masters, moments and step on the host), and both runs' last 3 losses."""
    tr = _trainer(tmp, layout, f"{tmp}/{layout}-exact")
    assert tr.engine.optimizer.offload and tr.engine.optimizer.separate  # masters, moments and step apart on the host
    for _ in range(3):
        tr.train_step()
    path = tr.save_checkpoint()
    saved = _live_state(tr)
    straight = [tr.train_step()["loss"] for _ in range(3)]
    again = _trainer(tmp, layout, f"{tmp}/{layout}-exact-resumed")
    again.load_checkpoint(path if path is not None else _latest(f"{tmp}/{layout}-exact"))
    loaded = _live_state(again)
    return saved, loaded, straight, [again.train_step()["loss"] for _ in range(3)]


def _latest(out):
    from trickles.train import checkpoint as ckpt

    return ckpt.find_latest(os.path.join(out, "checkpoints"))


def _live_state(tr):
    """This rank's parameters, and its optimizer's state: moments and step per segment, and its fp32 masters."""
    opt = tr.engine.optimizer
    state = {k: t.detach().clone() for k, (t, _) in opt.state_tensors().items()}
    state.update({f"{s.name}@{s.param_range}/master": m.detach().clone() for s, m in zip(opt.segments, opt.masters)})
    return {k: v.detach().clone() for k, v in tr.engine.full_state().items()}, state


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_resumes_exactly_at_the_same_layout(sources, stage):
    """dp=2, ZeRO-``stage``, the optimizer on the host: after loading, every weight, master, moment and step counter
    is the one saved, bit for bit, and the three steps after it are the ones the saving run took."""
    tmp, _ = sources
    for (weights, state), (weights_back, state_back), straight, resumed in run_ranks(
        2, _offload_round_trip, tmp, f"dp2-zero{stage}-offload"
    ):
        assert weights.keys() == weights_back.keys() and state.keys() == state_back.keys()
        assert all(torch.equal(weights[k], weights_back[k]) for k in weights)
        assert all(torch.equal(state[k], state_back[k]) for k in state)
        assert resumed == straight
