"""Every refusal of a configuration value is pinned: each case names the check it exercises and the part of its message
that tells the user what to change, so removing the check fails the case (docs/testing.md, "Refusals").

The cases here are the ones no other test reached when the audit was made (the configuration values refused by
``Config.validate`` joined tests/unit/test_config.py's ``BAD_VALUES``); the common ones live in
tests/unit/test_config.py, tests/unit/test_config_bounds.py and the layout tests' "refused by the config" cases."""

from __future__ import annotations

import re

import pytest

from trickles.config import Config
from trickles.errors import ConfigError
from trickles.options import coerce
from trickles.topology import ParallelDims, TPGrid

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


@pytest.mark.parametrize(
    "text,message",
    BAD_FILES,
    ids=[
        "unknown-section",
        "section-not-a-table",
        "int-from-bool",
        "int-from-fraction",
        "float-from-bool",
        "float-from-list",
        "str-from-int",
        "list-from-int",
        "optional-int-from-text",
    ],
)
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


@pytest.mark.parametrize(
    "text,message",
    [
        ("cluster = 3\n", "cluster must be a table of keys ([cluster]) (in "),
        (
            "[cluster]\npreset = 'local'\nlink_efficiency = 1.5\n",
            "cluster.gemm_efficiency and cluster.link_efficiency are fractions in (0, 1]",
        ),
        (
            "[cluster]\npreset = 'local'\ncollective_links = 3\n",
            "cluster.collective_links must be a table of op = [latency_us, GB/s]",
        ),
        (
            "[cluster]\npreset = 'local'\ngemm_table = 3\n",
            "cluster.gemm_table must be a table of 'precision:MxNxK' = fraction",
        ),
        (
            "[cluster]\npreset = 'local'\n[cluster.gemm_table]\n'fp8:8x8x8' = 0.5\n",
            "cluster.gemm_table key 'fp8:8x8x8': precision must be one of fp32, bf16, fp16",
        ),
    ],
    ids=["not-a-table", "efficiency", "links-not-a-table", "gemm-not-a-table", "gemm-precision"],
)
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
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "parallel.tp=2 x parallel.pp=1 x parallel.cp=1 x parallel.dp=2 = 4 "
            "is not --devices 8; change a degree or set parallel.dp=-1"
        ),
    ):
        check_pins(Config.load(None, ["parallel.tp=2", "parallel.dp=2"]), pins, 8)
