"""The costs of 2-D, 2.5-D and 3-D tensor parallelism counted, not guessed (:mod:`trickles.parallel.tensor.costs`).

For each grid (2-D tp=4, 2.5-D tp=8 d=2, 3-D tp=8) and each flavour (llama ``tiny``: RMSNorm, untied, no biases;
``gpt2-tiny``: LayerNorm, biases, learned positions, tied embedding; on 2-D also ``tiny-biased``, a llama with biases
on q, k, v and the MLP, none on o) one spawned job measures, on every rank:

* the ledger's wire bytes of one transformer block run alone (forward, then backward) and of a whole training step
  (two micro-batches and the gradient norm): equal to :func:`block_comm` and :func:`step_comm` exactly (a tied
  2-D/2.5-D embedding's diagonal ranks swap nothing: each rank its own number);
* the bytes autograd saves per layer and for the head (the saved-tensor hooks): equal to
  :func:`activation_bytes_nd`; the parameters a rank holds: :func:`param_count`; and the memory report's
  prediction equals what it measures on the running trainer.

1-D's formula is held to the ledger too (with sequence parallelism, replicated key/value heads and gpt2's partial
biases), and each grid's bytes are printed beside 1-D's at the same ``tp``.
"""

import pytest
import torch
from helpers import tiny_config

from trickles.memory.activations import ActivationMeter
from trickles.parallel.tensor.activation_costs import activation_bytes_nd
from trickles.parallel.tensor.costs import block_comm, comm_bytes, param_count, step_comm
from trickles.parallel.tensor.layout import Layout
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
SEQ, MICRO = 32, 4  # two micro-batches of 4 sequences per step (global batch 8)
GRIDS = [("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]
# every mode once, each preset (llama; gpt2's biases and tied embedding) on the 2-D grid and on one 8-rank grid
# tiny-biased: a llama with biases on q, k, v and the MLP's projections, none on o
CASES = [
    (*GRIDS[0], "tiny"),
    (*GRIDS[0], "gpt2-tiny"),
    (*GRIDS[1], "tiny"),
    (*GRIDS[2], "gpt2-tiny"),
    (*GRIDS[0], "tiny-biased"),
]
IDS = [f"{m}-tp{tp}-{preset}" for m, tp, _, preset in CASES]
# the memory formulas once more under selective recomputation (the attention core not saved), on the 2-D grid
MEMORY_CASES = [(*c, "none") for c in CASES] + [(*GRIDS[0], "tiny", "selective")]
MEMORY_IDS = IDS + ["2d-tp4-tiny-selective"]
BIASED = ("model.qkv_bias=true", "model.o_bias=false", "model.mlp_bias=true")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('nd-costs-cache')}"


def _trainer(tmp, cache, mode, tp, depth, preset, *overrides):
    cfg = tiny_config(
        tmp,
        cache,
        f"model.preset={preset.removesuffix('-biased')}",
        *(BIASED if preset.endswith("-biased") else ()),
        f"parallel.tp={tp}",
        f"parallel.tp_mode={mode}",
        f"parallel.tp_depth={depth}",
        f"data.seq_len={SEQ}",
        f"train.micro_batch={MICRO}",
        *overrides,
        steps=2,
    )
    dims = cfg.validate(tp)
    return Trainer(cfg, dims.build(CPU), quiet=True), dims


def _measured(tmp, cache, mode, tp, depth, preset, recompute="none"):
    """On every rank: the ledger of one block and of one step, the saved bytes, the parameters, the memory report."""
    from trickles.memory.report import measure, predict

    tr, dims = _trainer(tmp, cache, mode, tp, depth, preset, f"memory.recompute={recompute}")
    ledger, model = tr.topo.ledger, tr.model
    ledger.reset()
    tr.train_step()
    step = ledger.bytes(wire=True)
    block, ctx = model.layers["0"], model.loss.ctx
    x = torch.randn(ctx.activation_shape(MICRO, SEQ, tr.model_cfg.d_model), requires_grad=True)
    ledger.reset()
    y = block(x, model.rope(0, SEQ))
    forward = ledger.bytes(wire=True)
    y.backward(torch.randn_like(y))
    backward = ledger.bytes(wire=True) - forward
    xb, yb = tr.train_data.micro_batches(0, 8, MICRO)[0]
    tr.engine.zero_grad()
    with ActivationMeter(model) as meter:
        loss = tr._loss(xb, yb)
    loss.backward()
    tr.engine.zero_grad()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    report = measure(tr, predict(tr.cfg, dims, tr.model_cfg), steps=1)
    keys = ("parameters", "gradients", "optimizer", "activations", "head")
    return {
        "cfg": tr.model_cfg,
        "rank": tr.topo.comm("tp").rank,
        "step": step,
        "block": (forward, backward),
        "saved": dict(meter.per_layer),
        "params": params,
        "engine_params": tr.engine.memory()["parameters"],
        "report": ({k: report.predicted[k] for k in keys}, {k: report.measured[k] for k in keys}),
        "layers": (report.layers_predicted, report.layers_measured),
    }


_RUNS: dict = {}


def _runs(tmp_path_factory, cache, mode, tp, depth, preset, recompute="none"):
    """Every rank's measurements of one grid, run once for the module's tests."""
    key = (mode, tp, depth, preset, recompute)
    if key not in _RUNS:
        _RUNS[key] = run_ranks(
            tp, _measured, str(tmp_path_factory.mktemp("nd-costs")), cache, mode, tp, depth, preset, recompute
        )
    return _RUNS[key]


@pytest.mark.parametrize("mode,tp,depth,preset", CASES, ids=IDS)
def test_grid_sends_the_formula_bytes_per_block_and_per_step(tmp_path_factory, cache, mode, tp, depth, preset):
    runs = _runs(tmp_path_factory, cache, mode, tp, depth, preset)
    cfg = runs[0]["cfg"]
    lay = Layout.of(mode, tp, depth)
    block = block_comm(cfg, lay, MICRO, SEQ, 4)
    for r in runs:
        assert r["block"] == (block["forward"], block["backward"]), (r["rank"], r["block"], block)
        assert r["step"] == step_comm(cfg, lay, MICRO, SEQ, 4, micro_batches=2, tp_rank=r["rank"]), r["rank"]
    if cfg.tied and mode != "3d":  # the diagonal ranks keep their embedding block; the others swap it
        assert len({r["step"] for r in runs}) == 2
    one_d = comm_bytes(cfg, Layout.of("1d", tp), MICRO, SEQ, 4)
    grid = comm_bytes(cfg, lay, MICRO, SEQ, 4, tp_rank=None)
    # (1-D's bytes do not depend on the heads: at tp=8 the formula stands for a model whose heads do split)
    print(
        f"\n{mode} tp={tp} {preset}: a block sends {sum(block.values()):,} B per rank (1-D: "
        f"{sum(one_d['block'].values()):,} B, ratio {sum(block.values()) / sum(one_d['block'].values()):.2f}); "
        f"a micro-batch {grid['total']:,} B (1-D: {one_d['total']:,} B, ratio {grid['total'] / one_d['total']:.2f})"
    )


@pytest.mark.parametrize("mode,tp,depth,preset,recompute", MEMORY_CASES, ids=MEMORY_IDS)
def test_grid_memory_equals_the_formulas_and_the_report_measures_its_prediction(
    tmp_path_factory, cache, mode, tp, depth, preset, recompute
):
    runs = _runs(tmp_path_factory, cache, mode, tp, depth, preset, recompute)
    cfg = runs[0]["cfg"]
    lay = Layout.of(mode, tp, depth)
    act = activation_bytes_nd(cfg, lay, MICRO, SEQ, 4, recompute)
    expected = {"head": act["head"], **{f"layers.{i}": act["layer"] for i in range(cfg.n_layers)}}
    count = param_count(cfg, lay)["total"]
    for r in runs:
        assert r["saved"] == expected, (r["rank"], r["saved"], expected)
        assert r["params"] == count and r["engine_params"] == 4 * count, (r["rank"], r["params"], count)
        predicted, measured = r["report"]
        assert predicted == measured, (r["rank"], predicted, measured)
        assert r["layers"][0] == r["layers"][1] == [act["layer"]] * cfg.n_layers


def _one_d_step(tmp, cache, preset, tp, sp):
    tr, _ = _trainer(tmp, cache, "1d", tp, 1, preset, f"parallel.sequence_parallel={str(sp).lower()}")
    tr.topo.ledger.reset()
    tr.train_step()
    return tr.model_cfg, tr.topo.ledger.bytes(wire=True)


@pytest.mark.parametrize(
    "preset,tp,sp",
    [("tiny", 4, False), ("gpt2-tiny", 2, True), ("tiny-biased", 2, True)],
    ids=["tiny-tp4", "gpt2-tiny-tp2-sp", "tiny-biased-tp2-sp"],
)
def test_one_d_sends_the_formula_bytes(tmp_path, cache, preset, tp, sp):
    """Megatron's all-reduces (tp=4 replicates llama's two key/value heads: their gradients are summed once a step);
    with sequence parallelism the reduce-scatter/all-gather pairs, the regathers and the partial gradients (norms,
    positions, the row-parallel biases: gpt2's o and down, tiny-biased's down only)."""
    results = run_ranks(tp, _one_d_step, str(tmp_path), cache, preset, tp, sp)
    cfg = results[0][0]
    expected = step_comm(cfg, Layout.of("1d", tp, sequence_parallel=sp), MICRO, SEQ, 4, micro_batches=2)
    assert [sent for _, sent in results] == [expected] * tp


def _one_d_report(tmp, cache, tp):
    """A llama with biases per part at 1-D ``tp``: the parameters a rank holds, the report's prediction and measure."""
    from trickles.memory.report import measure, predict

    tr, dims = _trainer(tmp, cache, "1d", tp, 1, "tiny", *BIASED)
    params = sum(p.numel() for p in {id(p): p for p in tr.model.parameters()}.values())
    report = measure(tr, predict(tr.cfg, dims, tr.model_cfg), steps=1)
    keys = ("parameters", "gradients", "optimizer", "activations", "head")
    return tr.model_cfg, params, {k: report.predicted[k] for k in keys}, {k: report.measured[k] for k in keys}


def _norms_report(tmp, cache, tp, *overrides):
    """The report's prediction and measure, the parameters a rank holds and the ledger's bytes of one step."""
    from trickles.memory.report import measure, predict

    tr, dims = _trainer(tmp, cache, "1d", tp, 1, "tiny", *overrides)
    params = sum(p.numel() for p in {id(p): p for p in tr.model.parameters()}.values())
    report = measure(tr, predict(tr.cfg, dims, tr.model_cfg), steps=1)
    keys = ("parameters", "gradients", "optimizer", "activations", "head")
    tr.topo.ledger.reset()
    tr.train_step()
    return (
        tr.model_cfg,
        params,
        [{k: r[k] for k in keys} for r in (report.predicted, report.measured)],
        (tr.topo.ledger.bytes(wire=True)),
    )


@pytest.mark.parametrize(
    "tp,overrides",
    [
        (1, ("model.qk_norm=head", "model.norm_placement=sandwich")),
        (2, ("model.qk_norm=full", "model.norm_placement=post", "parallel.sequence_parallel=true")),
    ],
    ids=["head-sandwich", "full-post-tp2-sp"],
)
def test_q_k_norms_and_placements_are_counted_as_the_model_holds_them(tmp_path, cache, tp, overrides):
    """Per-head q/k norms with norms before and after each branch in one process; full-width q/k norms (their sums
    of squares all-reduced over tp) with post norms only at tp2+sp: the report predicts what it measures, the
    formula counts the parameters a rank holds, and the ledger sends the formula's bytes."""
    lay = Layout.of("1d", tp, sequence_parallel=tp > 1)
    for cfg, params, (predicted, measured), sent in run_ranks(tp, _norms_report, str(tmp_path), cache, tp, *overrides):
        assert predicted == measured, (predicted, measured)
        assert predicted["parameters"] == 4 * params == 4 * param_count(cfg, lay)["total"], params
        assert tp == 1 or sent == step_comm(cfg, lay, MICRO, SEQ, 4, micro_batches=2), sent


@pytest.mark.parametrize("tp", [1, 2])
def test_biases_per_part_are_counted_as_the_model_holds_them(tmp_path, cache, tp):
    """q, k, v and the MLP's projections with a bias, o without: the report's parameter, gradient and optimizer bytes
    are what the trainer holds, and the cost formula counts the parameters a rank holds (the column-parallel biases
    split, the down projection's whole)."""
    for cfg, params, predicted, measured in run_ranks(tp, _one_d_report, str(tmp_path), cache, tp):
        assert cfg.bias("qkv") and not cfg.bias("o") and cfg.bias("mlp")
        assert predicted == measured, (predicted, measured)
        assert predicted["parameters"] == 4 * params == 4 * param_count(cfg, Layout.of("1d", tp))["total"], params
