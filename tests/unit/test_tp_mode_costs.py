"""The tensor-parallel cost formulas without ranks: parameters against the plans applied to a meta model, and the memory
report's side-by-side table of 1-D, 2-D, 2.5-D and 3-D (``trickles memory`` at tp > 1). The ledger and the saved-tensor
hooks are held to the same formulas in tests/distributed/test_tensor_nd_costs.py."""

import dataclasses

import pytest
import torch

from trickles.cli import main
from trickles.config import Config
from trickles.errors import ConfigError
from trickles.memory.report import predict
from trickles.memory.tp_modes import compare_tp_modes, depth_for, shard_meta
from trickles.models.config import resolve_model
from trickles.models.transformer import Transformer, count_params
from trickles.parallel.tensor.costs import comm_bytes, param_count, step_comm
from trickles.parallel.tensor.layout import Layout
from trickles.topology import ParallelDims

TINY = ["model.preset=tiny", "model.vocab_size=320", "data.seq_len=32", "train.global_batch=8"]


def _config(*overrides) -> Config:
    return Config.load(None, list(overrides))


def _model(cfg: Config):
    return resolve_model(cfg.model, 320, cfg.data.seq_len)


LAYOUTS = [
    ("1d", 2, 1, False),
    ("1d", 4, 1, False),
    ("1d", 4, 1, True),
    ("2d", 4, 1, False),
    ("2.5d", 8, 2, False),
    ("3d", 8, 1, False),
]


# a llama with biases on q, k, v and on the MLP's projections, none on o (column- and row-parallel alike)
BIASED = ["model.qkv_bias=true", "model.o_bias=false", "model.mlp_bias=true"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-biased", "gpt2-tiny", "gpt2-small", "llama-350m"])
@pytest.mark.parametrize("mode,tp,depth,sp", LAYOUTS, ids=[f"{m}-tp{t}{'-sp' if s else ''}" for m, t, _, s in LAYOUTS])
def test_param_count_is_what_the_plan_leaves_a_rank(preset, mode, tp, depth, sp):
    """The formula counts exactly the parameters tp rank 0 holds once the mode's plan is applied (a tied weight once;
    llama-350m replicates its 8 key/value heads at no tp here, tiny its 2 at tp=4 -- with their biases when
    tiny-biased)."""
    cfg = _config(
        f"model.preset={preset.removesuffix('-biased')}",
        "data.seq_len=64",
        *(["model.vocab_size=320"] if "tiny" in preset else []),
        *(["model.vocab_size=50304"] if preset == "gpt2-small" else []),
        *(BIASED if preset.endswith("-biased") else []),
    )  # (50257 splits over no tp)
    model_cfg = _model(cfg)
    with torch.device("meta"):
        meta = shard_meta(Transformer(model_cfg), ParallelDims(tp=tp, tp_mode=mode, tp_depth=depth), sp)
    assert count_params(meta) == param_count(model_cfg, Layout.of(mode, tp, depth, sp))["total"]


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_param_count_holds_the_q_k_norms_and_every_norm_placement(tp, sp):
    """Per-head q/k norms ``[h]`` whole on every rank, full-width ones split with the heads, post norms ``[d]`` beside
    (sandwich) or in place of (post) the pre norms: the formula is what the plan leaves rank 0, for each pair."""
    for qk in ("none", "head", "full"):
        for placement in ("pre", "post", "sandwich"):
            model_cfg = _model(_config(*TINY, f"model.qk_norm={qk}", f"model.norm_placement={placement}"))
            with torch.device("meta"):
                meta = shard_meta(Transformer(model_cfg), ParallelDims(tp=tp), sp)
            assert count_params(meta) == param_count(model_cfg, Layout.of("1d", tp, 1, sp))["total"], (qk, placement)


def test_fused_projections_change_the_grid_bytes_as_the_formula_says():
    """One qkv and one gate/up linear: one gathered input each, not three and two (the same weights)."""
    cfg = _model(_config(*TINY))
    fused = dataclasses.replace(cfg, fused_proj=True)
    lay = Layout.of("2d", 4)
    assert param_count(fused, lay) == param_count(cfg, lay)
    n, d, p = 8 * 32 // 2, cfg.d_model, 4
    from trickles.parallel.tensor.activation_costs import activation_bytes_nd

    assert (
        activation_bytes_nd(cfg, lay, 8, 32)["layer"] - activation_bytes_nd(fused, lay, 8, 32)["layer"] == 3 * p * n * d
    )


def test_one_d_block_is_megatrons_four_all_reduces_and_a_grid_shrinks_with_q():
    """1-D: ``4 x 2 (tp-1)/tp p N d`` per block whatever tp; a 3-D block's bytes per rank fall as q grows."""
    cfg = _model(_config("model.preset=llama-350m", "data.seq_len=1024"))
    n_d = 8 * 1024 * cfg.d_model * 2
    for tp in (2, 8):
        block = comm_bytes(cfg, Layout.of("1d", tp), 8, 1024, 2)["block"]
        assert block["forward"] == block["backward"] == 2 * round(2 * (tp - 1) / tp * n_d)
    cube = [sum(comm_bytes(cfg, Layout.of("3d", q**3), 64, 1024, 2)["block"].values()) for q in (2, 4)]
    assert cube[1] < cube[0]


def _table(tp, *overrides):
    cfg = _config(*TINY, f"parallel.tp={tp}", *overrides)
    dims = cfg.validate(tp)
    return cfg, dims, compare_tp_modes(cfg, dims, _model(cfg))


def test_the_mode_table_matches_the_report_and_says_why_a_mode_does_not_fit():
    cfg, dims, table = _table(4)
    rep = predict(cfg, dims, _model(cfg))
    one_d = table.row("1d")
    assert one_d.configured and one_d.activations == rep.predicted["activations"] + rep.predicted["head"]
    assert one_d.states == rep.predicted["parameters"] + rep.predicted["gradients"] + rep.predicted["optimizer"]
    two_d = table.row("2d")
    assert two_d.comm == step_comm(_model(cfg), Layout.of("2d", 4), 8, 32, 4)
    assert "is not q^2 x d" in table.row("2.5d").why and "use parallel.tp=8 or 27" in table.row("3d").why
    with_sp = table.row("1d", sequence_parallel=True)  # what the norms keep split over tp; the regathers sent on top
    assert not with_sp.configured and with_sp.activations < one_d.activations and with_sp.comm > one_d.comm
    text = table.table()
    assert "1-D*" in text and "1-D+SP" in text and "- tp=4 is not q^2 x d" in text
    cfg8, dims8, table8 = _table(8, "parallel.tp_mode=3d")
    assert table8.row("3d").configured and table8.row("2.5d").layout == "q=2, d=2"
    assert "model.n_heads (4) must be divisible by parallel.tp (8)" in table8.row("1d").why
    rep8 = predict(cfg8, dims8, _model(cfg8))  # the grid's own report reads the same formulas
    assert table8.row("3d").activations == rep8.predicted["activations"] + rep8.predicted["head"]
    _, _, small = _table(4, "train.micro_batch=1")  # one sample cannot split over the grid's two sample blocks
    assert small.row("2d").why.endswith("make train.micro_batch (or train.global_batch / parallel.dp) a multiple of 2")


def test_2p5d_depth_is_the_configured_one_or_the_widest_grid():
    cfg = _config(*TINY)
    assert [depth_for("2.5d", tp, cfg) for tp in (4, 8, 16, 32, 18)] == [0, 2, 4, 2, 2]
    assert depth_for("2.5d", 8, _config(*TINY, "parallel.tp=8", "parallel.tp_mode=2.5d", "parallel.tp_depth=2")) == 2
    with pytest.raises(ConfigError):
        Layout.of("2d", 8)


def test_memory_command_prints_the_modes_side_by_side(capsys):
    """``trickles memory`` at tp > 1 ends with the four modes; at tp = 1 it prints none."""
    args = [x for o in TINY for x in ("--set", o)]
    assert (
        main(
            [
                "memory",
                "--nproc",
                "8",
                *args,
                "--set",
                "parallel.tp=8",
                "--set",
                "parallel.tp_mode=2.5d",
                "--set",
                "parallel.tp_depth=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tensor-parallel modes at tp=8" in out and "2.5-D*  q=2, d=2" in out and "tp=8 2.5d (q=2, d=2)" in out
    assert main(["memory", "--nproc", "1", *args]) == 0
    assert "tensor-parallel modes" not in capsys.readouterr().out
