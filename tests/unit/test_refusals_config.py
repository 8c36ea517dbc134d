"""Every refusal of a configuration value is pinned: each case names the check it exercises and the part of its message
that tells the user what to change, so removing the check fails the case (docs/testing.md, "Refusals").

The cases here are the ones no other test reached when the audit was made; the common ones live in
tests/unit/test_config.py, tests/unit/test_config_bounds.py and the layout tests' "refused by the config" cases."""

from __future__ import annotations

import re

import pytest

from trickles.config import Config
from trickles.errors import ConfigError
from trickles.options import coerce
from trickles.topology import ParallelDims, TPGrid

# (overrides, world size, a distinctive part of the message) -- refused by Config.validate(world)
INVALID = [
    # [model] (trickles/models/config.py ModelConfig.validate)
    (["model.n_layers=0"], 1, "model.n_layers must be at least 1, got 0"),
    (["model.head_size=0"], 1, "model.head_size must be at least 1 or none"),
    (["model.d_model=96", "model.n_heads=4", "model.n_kv_heads=4", "model.head_size=5"], 1,
     "rotary embeddings need an even head size, but the head size is 5"),
    (["model.dropout=1.0"], 1, "model.dropout must be in [0, 1), got 1.0"),
    (["model.vocab_size=1"], 1, "model.vocab_size must be at least 2, got 1"),
    (["model.moe_experts=4", "model.moe_ffn_hidden=0"], 1, "model.moe_ffn_hidden must be at least 1, got 0"),
    (["model.moe_experts=4", "model.moe_top_k=1", "model.moe_router=hard", "model.moe_label_experts=[a:0, a:1]"], 1,
     "model.moe_label_experts names a label twice"),
    (["model.max_seq_len=0", "data.seq_len=1"], 1, "model.max_seq_len must be at least 1, got 0"),
    # [train] (trickles/train/config.py TrainConfig.validate)
    (["train.micro_batch=0"], 1, "train.micro_batch must be at least 1 or none, got 0"),
    (["train.min_lr_ratio=1.5"], 1, "train.min_lr_ratio must be in [0, 1], got 1.5"),
    (["train.warmup_steps=-1"], 1, "train.warmup_steps must not be negative, got -1"),
    (["train.keep_checkpoints=0"], 1, "train.keep_checkpoints must be at least 1, got 0"),
    (["train.eps=0"], 1, "train.eps must be positive"),
    (["train.poly_power=0"], 1, "train.poly_power must be positive, got 0"),
    (["train.trust_coefficient=0"], 1, "train.trust_coefficient must be positive"),
    (["train.sample_temperature=-1"], 1, "train.sample_temperature must not be negative, got -1"),
    # [data] (trickles/data/config.py DataConfig.validate)
    (["data.val_fraction=1"], 1, "data.val_fraction must be in [0, 1), got 1.0"),
    (["data.bpe_vocab_size=258"], 1, "data.bpe_vocab_size must be at least 259"),
    (["data.max_bytes=0"], 1, "data.max_bytes must be positive or none, got 0"),
    # [parallel] (trickles/parallel/config.py ParallelConfig.validate, trickles/topology.py)
    (["parallel.zero=4"], 1, "parallel.zero must be 0, 1, 2 or 3, got 4"),
    (["parallel.schedule=zigzag"], 1, "parallel.schedule must be one of"),
    (["parallel.virtual_stages=0"], 1, "parallel.virtual_stages must be at least 1, got 0"),
    (["parallel.tp_mode=4d"], 1, "parallel.tp_mode must be one of 1d, 2d, 2.5d, 3d, got '4d'"),
    (["parallel.tp_mode=2.5d", "parallel.tp_depth=0"], 1, "parallel.tp_depth must be at least 1, got 0"),
    (["parallel.tp_mode=2d", "parallel.tp=4", "parallel.tp_depth=2"], 4, "with tp_mode=2d leave it at 1"),
    (["parallel.dp=0"], 1, "parallel.dp must be a positive integer, got 0"),
    # combinations (trickles/config.py Config.validate and its _check_* helpers)
    (["parallel.ep=2"], 2, "parallel.ep=2 splits the experts of mixture-of-experts blocks, but model.moe_experts is 0"),
    (["model.moe_experts=3", "parallel.ep=2"], 2, "model.moe_experts (3) must be divisible by parallel.ep (2)"),
    (["memory.offload_optimizer=true"], 1, "memory.offload_optimizer needs a sharded optimizer"),
    (["parallel.zero=3", "train.compile=true"], 1, "train.compile does not work with parallel.zero=3"),
    (["model.vocab_size=256"], 1, "model.vocab_size (256) is smaller than the byte tokenizer's 257 tokens"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel needs parallel.tp > 1"),
    (["parallel.tp=2", "model.ffn_hidden=129"], 2, "the MLP width (129) must be divisible by parallel.tp (2)"),
    (["parallel.tp=2", "model.vocab_size=301"], 2, "the vocabulary (model.vocab_size = 301) must be divisible by parallel.tp (2)"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=255"], 2,
     "data.seq_len (255) must be divisible by parallel.tp (2) for sequence parallelism"),
]


@pytest.mark.parametrize("overrides,world,message", INVALID, ids=[" ".join(c[0]) for c in INVALID])
def test_invalid_values_and_combinations_are_refused(overrides, world, message):
    cfg = Config.load(None, overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate(world)


# (the TOML file's text, a distinctive part of the message) -- refused by Config.load(file)
BAD_FILES = [
    ("[trian]\nsteps = 1\n", "unknown key 'trian' (in "),
    ("model = 3\n", "model must be a table of keys ([model]) (in "),
    ("[train]\nsteps = true\n", "train.steps must be an integer, got True"),
    ("[train]\nsteps = 2.5\n", "train.steps must be an integer, got 2.5"),
    ("[train]\nlr = false\n", "train.lr must be a number, got False"),
    ("[train]\nlr = [1]\n", "train.lr must be a number, got [1]"),
    ("[train]\nsample_prompt = 3\n", "train.sample_prompt must be a string, got 3"),
    ("[parallel]\npipeline_layers = 3\n", "parallel.pipeline_layers must be a list of an integer, got 3"),
    ("[model]\nmax_seq_len = 'long'\n", "model.max_seq_len must be an integer (or none), got 'long'"),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=["unknown-section", "section-not-a-table", "int-from-bool",
                                                          "int-from-fraction", "float-from-bool", "float-from-list",
                                                          "str-from-int", "list-from-int", "optional-int-from-text"])
def test_bad_values_in_a_file_are_refused_at_load(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config.load(path)


def test_public_config_helpers_refuse_what_a_file_cannot_say():
    """What only a caller of the API can pass: None for a union without None, a grid or degree the config would have
    caught earlier."""
    with pytest.raises(ConfigError, match=re.escape("k must be an integer or a string, got None")):
        coerce(None, int | str, "k")
    with pytest.raises(ConfigError, match=re.escape("parallel.tp_mode must be one of")):
        TPGrid.of("4d", 4)
    with pytest.raises(ConfigError, match=re.escape("parallel.pp must be a positive integer, got 0")):
        ParallelDims(pp=0).validate(0)


# ---- the planner's cluster files and pinned degrees (trickles/planner/) -----------------------------------------

@pytest.mark.parametrize("text,message", [
    ("cluster = 3\n", "cluster must be a table of keys ([cluster]) (in "),
    ("[cluster]\npreset = 'local'\nlink_efficiency = 1.5\n", "cluster.gemm_efficiency and cluster.link_efficiency are fractions in (0, 1]"),
    ("[cluster]\npreset = 'local'\ncollective_links = 3\n", "cluster.collective_links must be a table of op = [latency_us, GB/s]"),
    ("[cluster]\npreset = 'local'\ngemm_table = 3\n", "cluster.gemm_table must be a table of 'precision:MxNxK' = fraction"),
    ("[cluster]\npreset = 'local'\n[cluster.gemm_table]\n'fp8:8x8x8' = 0.5\n",
     "cluster.gemm_table key 'fp8:8x8x8': precision must be one of fp32, bf16, fp16"),
], ids=["not-a-table", "efficiency", "links-not-a-table", "gemm-not-a-table", "gemm-precision"])
def test_bad_cluster_files_are_refused(tmp_path, text, message):
    from trickles.planner import load_cluster

    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_cluster(path)


def test_the_planner_refuses_an_unknown_precision_or_device_and_pins_that_cannot_fill_the_devices():
    import dataclasses

    from trickles.planner import load_cluster
    from trickles.planner.layouts import check_pins

    with pytest.raises(ConfigError, match=re.escape("cluster.device must be cuda or cpu, got 'tpu'")):
        dataclasses.replace(load_cluster("local"), device="tpu").validate()  # a file's value is checked as it is read
    with pytest.raises(ConfigError, match=re.escape("precision must be one of fp32, bf16, fp16, got 'fp8'")):
        load_cluster("local").peak_flops("fp8")
    with pytest.raises(ConfigError, match=re.escape("parallel.tp=0 must be at least 1 (or parallel.dp=-1")):
        check_pins(Config.load(None, ["parallel.tp=0"]), {"parallel.tp"}, 8)
    pins = {"parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp"}
    with pytest.raises(ConfigError, match=re.escape("parallel.tp=2 x parallel.pp=1 x parallel.cp=1 x parallel.dp=2 = 4 "
                                                    "is not --devices 8; change a degree or set parallel.dp=-1")):
        check_pins(Config.load(None, ["parallel.tp=2", "parallel.dp=2"]), pins, 8)
